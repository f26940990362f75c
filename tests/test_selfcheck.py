"""The first-use self-check of each kernel module (``primitives.first_use_check``),
with the host-executed kernels playing the GPU: a correct module passes once,
each kind of wrong kernel is caught, warned about once and replaced by the
torch implementation (whose results match float64), STRICT raises,
SELFCHECK=0 skips, ``info`` lists the results, and neither CUDA graph capture
nor a torch.compile trace ever runs a probe.

Every test wraps the session's host launcher in its own launcher object: the
check is keyed by launcher, so each wrapper is a fresh "device" whose modules
are checked anew, and the session's results stay as they were."""
import warnings

import numpy as np
import pytest
import torch

import swiglu_cupy as sc
from swiglu_cupy import primitives, reference
from swiglu_cupy.activations import GPT_OSS, GLUActivation, deepseek_v4
from swiglu_cupy.kernels.sources import kernel_variant
from swiglu_cupy.primitives import cuda_impl, dispatch, saved_x12
from swiglu_cupy.primitives import first_use_check as selfcheck
from swiglu_cupy.tools import info as info_tool
from conftest import glu_error_bounds, primitives_on_host_kernels


class Passthrough:
    """The host launcher under a new identity (a fresh set of modules)."""

    def __init__(self, launcher):
        self.launcher = launcher
        self.calls = 0

    def launch(self, name, dtype, device, grid, block, args):
        self.calls += 1
        self.launcher.launch(name, dtype, device, grid, block, list(args))


# Argument positions in the entry points (see primitives/cuda_impl.py): H follows M.
_H_INDEX = {("forward", False): 4, ("backward", False): 7, ("forward", True): 3, ("backward", True): 5}


class Faulty(Passthrough):
    """The host launcher with one kind of kernel bug, made at the launch:

    ``tail``   the last element (16-byte pack on the vector path) of every row
               is never written (an off-by-one bound),
    ``clamp``  the clamp mask follows the other torch's rule at the limit
               (``x < limit`` for ``x <= limit`` or the reverse: the gradient
               bound argument moved one math ulp),
    ``swap``   gate and up read from each other's pointer (halves layout),
    ``waves``  rows past the first grid wave are skipped (a capped grid's
               row loop that never iterates).

    The faults are made in the elementwise entry points; the 8-bit saved
    x12's (another argument layout) run as they are.
    """

    def __init__(self, launcher, fault):
        super().__init__(launcher)
        self.fault = fault

    def launch(self, name, dtype, device, grid, block, args):
        args = list(args)
        if "_fp8_" in name:
            return super().launch(name, dtype, device, grid, block, args)
        direction = "forward" if "forward" in name else "backward"
        h_at = _H_INDEX[(direction, "_pairs_" in name)]
        if self.fault == "tail":
            step = 16 // torch.empty((), dtype=dtype).element_size() if "_vec_" in name else 1
            args[h_at] = np.int64(int(args[h_at]) - step)
        elif self.fault == "clamp":
            limit, grad_bound = args[-4], args[-1]
            scalar = type(limit)
            args[-1] = scalar(np.nextafter(limit, scalar(-np.inf))) if grad_bound == limit else limit
        elif self.fault == "swap":
            lds = (5, 6) if direction == "forward" else (8, 9)
            args[0], args[1] = args[1], args[0]
            args[lds[0]], args[lds[1]] = args[lds[1]], args[lds[0]]
        elif self.fault == "waves":
            args[h_at - 1] = np.int64(min(int(args[h_at - 1]), grid[1] * block[1]))
        super().launch(name, dtype, device, grid, block, args)


def _inputs(M, H, dtype, spec, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x12 = (torch.randn(M, 2 * H, generator=gen, dtype=torch.float64) * 2).to(dtype)
    dh = torch.randn(M, H, generator=gen, dtype=torch.float64).to(dtype)
    if spec.limit is not None:  # values exactly at the limits, where a wrong mask shows
        gate, up = reference.split_gate_up(x12, spec)
        gate[:, ::3] = spec.limit
        up[:, 1::3] = -spec.limit
    return x12, dh


def _fp64_reference(x12, dh, spec):
    """h and dx12 by float64 autograd of the models' eager expression."""
    x = x12.detach().double().requires_grad_()
    h = reference.glu_reference(*reference.split_gate_up(x, spec), spec)
    h.backward(dh.double())
    return h.detach(), x.grad


def _result(launcher, spec, dtype):
    return selfcheck.check_module(launcher, spec, dtype, torch.device("cpu"))


def test_a_correct_module_passes_once_and_its_probe_covers_the_shapes(host_launcher):
    launcher = Passthrough(host_launcher)
    spec = GPT_OSS
    x12, dh = _inputs(6, 16, torch.bfloat16, spec)
    probes_before = len(host_launcher.probe_launches)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        h = primitives.swiglu_forward(x12, launcher=launcher, activation=spec)
        probed = len(host_launcher.probe_launches) - probes_before
        calls = launcher.calls
        primitives.swiglu_backward(x12, dh, launcher=launcher, activation=spec)
        primitives.swiglu_forward(x12, launcher=launcher, activation=spec)
    assert launcher.calls == calls + 2            # no second probe: two kernel launches, the calls'
    assert len(host_launcher.probe_launches) - probes_before == probed
    result = _result(launcher, spec, torch.bfloat16)
    assert (result.status, result.calls, result.launches) == ("passed", 1, probed)
    assert result.kernel == "glu_oai_clamp_pairs" and result.device == "cpu via Passthrough"
    probe = host_launcher.probe_launches[probes_before:]
    names = {name for name, *_ in probe}
    assert names == ({f"glu_{d}_oai_clamp_pairs_{w}_p{p}" for d in ("forward", "backward")
                      for w in ("vec", "scalar") for p in (1, 2, 4)}     # all 12 entry points
                     | {f"glu_{d}_fp8_oai_clamp_pairs_{w}_p{p}" for d in ("forward", "backward")
                        for w in ("vec", "scalar") for p in (1, 2, 4)})  # and the 8-bit saved x12's 12
    # A capped launch whose rows run past its one grid wave (the row loop).
    M = selfcheck.probe_rows(24, 8, selfcheck.probe_configs(), kernel_variant(spec), cuda_impl.HOST_SM_COUNT)
    assert any(grid[1] * block[1] < M for name, grid, block in probe if "fp8" not in name)
    cols = cuda_impl.fp8_launch_columns(saved_x12.BLOCK + 3, spec, torch.bfloat16)
    M8 = selfcheck.probe_rows(cols, 1, selfcheck.probe_configs(), kernel_variant(spec), cuda_impl.HOST_SM_COUNT)
    assert any(grid[1] * block[1] < M8 for name, grid, block in probe if "fp8" in name)
    ref_h, ref_dx12 = _fp64_reference(x12, dh, spec)
    h_bound, _ = glu_error_bounds(x12, dh, spec, ref_h, ref_dx12)
    assert ((h.double() - ref_h).abs() <= h_bound).all()


def test_probe_inputs_hold_the_clamp_boundaries_zeros_and_large_values():
    spec = deepseek_v4(7.3)   # not a bf16 value: "at the limit" is its bf16 rounding
    below, at, above = selfcheck._neighbours(7.3, torch.bfloat16)
    assert below < at < above and (above - at) == pytest.approx(2 ** -5)   # one bf16 ulp at 7.x
    x12, _ = selfcheck.probe_inputs(spec, torch.bfloat16, torch.device("cpu"), 9, 25, 0)
    gate, up = x12.float().chunk(2, 1)
    assert (gate[0] == 0).all() and (up[0, ::2] == 0).all()
    assert (gate[1].abs() == 8192).all() and (up[2].abs() == 8192).all()
    for row in (3, 8):
        assert {at, above, below} <= set(gate[row].tolist()) and {at, -at, above} <= set(up[row].tolist())


FAULT_CASES = [("tail", "silu", torch.bfloat16), ("tail", GPT_OSS, torch.float32),
               ("clamp", deepseek_v4(1.5), torch.float32), ("clamp", GPT_OSS, torch.bfloat16),
               ("swap", GLUActivation("gelu_tanh"), torch.float16), ("waves", "silu", torch.float32),
               ("waves", GPT_OSS, torch.bfloat16)]


@pytest.mark.parametrize("fault,activation,dtype", FAULT_CASES,
                         ids=[f"{f}-{a}-{str(d)[6:]}" for f, a, d in FAULT_CASES])
def test_a_wrong_kernel_is_caught_warned_once_and_replaced(host_launcher, fault, activation, dtype):
    spec = sc.GLUActivation() if activation == "silu" else activation
    launcher = Faulty(host_launcher, fault)
    x12, dh = _inputs(80, 24, dtype, spec, seed=3)   # 80 rows: past the host's one-wave cap of 64
    # The fault is real: straight through the entry point (no check), with a capped grid for "waves".
    config = sc.kernels.launch_config.LaunchConfig(1, 256, 1)
    wrong = cuda_impl.launch_swiglu_backward(x12, dh, None, launcher, config, spec)[0]
    correct = cuda_impl.launch_swiglu_backward(x12, dh, None, host_launcher, config, spec)[0]
    assert not torch.equal(wrong, correct)

    with pytest.warns(RuntimeWarning, match="self-check FAILED") as caught:
        h = primitives.swiglu_forward(x12, launcher=launcher, activation=spec)
    message = str(caught[0].message)
    result = _result(launcher, spec, dtype)
    assert result.status == "failed" and result.detail in message
    assert f"kernel {result.kernel} on cpu via Faulty, {dtype}" in message
    assert "worst |diff|" in message and "x its bound" in message
    calls = launcher.calls
    with warnings.catch_warnings():
        warnings.simplefilter("error")                 # warned once only
        dx12, h_bwd = primitives.swiglu_backward(x12, dh, launcher=launcher, activation=spec)
        with primitives_on_host_kernels(launcher):
            h_again = primitives.swiglu_forward(x12, activation=spec)
    assert launcher.calls == calls                     # the faulty kernels never run again
    # The fallback is the torch implementation, within bounds of float64.
    torch.testing.assert_close(h, primitives.swiglu_forward(x12, implementation="torch", activation=spec),
                               rtol=0, atol=0)
    assert torch.equal(h, h_again) and torch.equal(h, h_bwd)
    ref_h, ref_dx12 = _fp64_reference(x12, dh, spec)
    h_bound, dx_bound = glu_error_bounds(x12, dh, spec, ref_h, ref_dx12)
    assert ((h.double() - ref_h).abs() <= h_bound).all()
    assert ((dx12.double() - ref_dx12).abs() <= dx_bound).all()


class FaultyFp8(Passthrough):
    """The host launcher whose 8-bit saved x12 forward skips the rows past the
    first grid wave (its M argument cut to one wave); everything else is right."""

    def launch(self, name, dtype, device, grid, block, args):
        args = list(args)
        if "_forward_fp8_" in name:
            m_at = 4 if "_pairs_" in name else 5         # after the pointers (see cuda_impl)
            args[m_at] = np.int64(min(int(args[m_at]), grid[1] * block[1]))
        super().launch(name, dtype, device, grid, block, args)


def test_a_wrong_fp8_saved_x12_kernel_is_caught_and_replaced(host_launcher):
    """Only the 8-bit saved x12's forward is wrong (rows past one wave never
    written): the module's check fails naming that entry point, and the fp8
    path then takes the torch implementation."""
    spec = sc.GLUActivation()
    launcher = FaultyFp8(host_launcher)
    config = sc.kernels.launch_config.LaunchConfig(1, 256, 1)     # capped at one wave
    cols = cuda_impl.fp8_launch_columns(131, spec, torch.bfloat16)
    M = selfcheck.probe_rows(cols, 1, [config], kernel_variant(spec), cuda_impl.HOST_SM_COUNT)  # past that wave
    x12, _ = _inputs(M, 131, torch.bfloat16, spec, seed=5)
    wrong = cuda_impl.launch_swiglu_forward_fp8(x12, launcher, config, spec)[1]
    assert not torch.equal(wrong, saved_x12.quantize_torch(x12, spec))   # the fault is real
    with pytest.warns(RuntimeWarning, match="self-check FAILED") as caught:
        h, saved = dispatch.run_swiglu_forward_fp8(x12, None, launcher, spec)
    assert "swiglu_forward_fp8_vec_p1" in str(caught[0].message)   # the entry point that failed (probed first)
    calls = launcher.calls
    h2, saved2 = dispatch.run_swiglu_forward_fp8(x12, None, launcher, spec)
    assert launcher.calls == calls                     # the module's kernels never run again
    assert torch.equal(saved, saved_x12.quantize_torch(x12, spec)) and torch.equal(saved, saved2)
    assert torch.equal(h, primitives.swiglu_forward(x12, implementation="torch", activation=spec))


def test_strict_mode_makes_a_failed_check_an_error(host_launcher, monkeypatch):
    monkeypatch.setenv("SWIGLU_CUPY_STRICT", "1")
    launcher = Faulty(host_launcher, "tail")
    x12, _ = _inputs(4, 16, torch.float32, sc.GLUActivation())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):   # the first use and every use after it
            with pytest.raises(selfcheck.SelfCheckError, match="swiglu \\[float32, cpu via Faulty\\]: failed"):
                primitives.swiglu_forward(x12, launcher=launcher)


def test_selfcheck_off_skips_the_probe_and_trusts_the_kernels(host_launcher, monkeypatch):
    monkeypatch.setenv("SWIGLU_CUPY_SELFCHECK", "0")
    launcher = Faulty(host_launcher, "tail")
    x12, _ = _inputs(4, 16, torch.float32, sc.GLUActivation())
    probes = len(host_launcher.probe_launches)
    h = primitives.swiglu_forward(x12, out=torch.zeros(4, 16), launcher=launcher)
    assert len(host_launcher.probe_launches) == probes and launcher.calls == 1
    assert (h[:, -1] == 0).all()   # the trade-off: a wrong kernel goes unnoticed
    result = _result(launcher, sc.GLUActivation(), torch.float32)
    assert result.status == "skipped" and "SWIGLU_CUPY_SELFCHECK=0" in result.detail


def test_info_lists_each_module_with_its_result(host_launcher):
    good, bad = Passthrough(host_launcher), Faulty(host_launcher, "swap")
    x12, _ = _inputs(4, 16, torch.float16, sc.GLUActivation())
    primitives.swiglu_forward(x12, launcher=good)
    with pytest.warns(RuntimeWarning, match="self-check FAILED"):
        primitives.swiglu_forward(x12, launcher=bad)
    facts = sc.info()
    assert facts["self_check"] == "on"
    lines = facts["self_checks"]
    assert any(line.startswith("swiglu [float16, cpu via Passthrough]: passed") for line in lines)
    assert any(line.startswith("swiglu [float16, cpu via Faulty]: failed") and "worst |diff|" in line
               for line in lines)
    text = info_tool.format_info(facts)
    assert "self_checks" in text and "cpu via Faulty]: failed" in text


def test_first_use_inside_graph_capture_refuses_to_probe(host_launcher, monkeypatch):
    """The decision, with capture simulated: a module never checked raises
    (naming warmup) without launching anything; a checked one runs."""
    launcher = Passthrough(host_launcher)
    x12, _ = _inputs(4, 16, torch.float32, sc.GLUActivation())
    monkeypatch.setattr(selfcheck, "_stream_capturing", lambda device: True)
    assert selfcheck.probe_decision(torch.device("cpu")) == "refuse"
    with pytest.raises(selfcheck.SelfCheckError, match=r"inside CUDA graph capture.*swiglu_cupy\.warmup"):
        primitives.swiglu_forward(x12, launcher=launcher)
    assert launcher.calls == 0
    monkeypatch.setattr(selfcheck, "_stream_capturing", lambda device: False)
    primitives.swiglu_forward(x12, launcher=launcher)        # checked outside capture
    monkeypatch.setattr(selfcheck, "_stream_capturing", lambda device: True)
    calls = launcher.calls
    primitives.swiglu_forward(x12, launcher=launcher)        # captured: the call's launch only
    assert launcher.calls == calls + 1


def test_a_compile_trace_defers_the_probe_to_the_first_real_call(host_launcher, monkeypatch):
    launcher = Passthrough(host_launcher)
    x12, _ = _inputs(4, 16, torch.float32, sc.GLUActivation())
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert selfcheck.probe_decision(torch.device("cpu")) == "defer"
    h = dispatch.run_swiglu_forward(x12, launcher=launcher)       # traced: the torch implementation
    assert launcher.calls == 0 and selfcheck.result_of(launcher, "silu", torch.float32, x12.device) is None
    assert torch.equal(h, primitives.swiglu_forward(x12, implementation="torch"))
    monkeypatch.undo()
    primitives.swiglu_forward(x12, launcher=launcher)
    assert _result(launcher, sc.GLUActivation(), torch.float32).status == "passed"


def test_torch_compile_traces_no_probe(host_launcher):
    """A compiled model on the host kernels: nothing is launched while
    tracing (the graph holds our op, no probe); the probe runs once, at the
    compiled graph's first real call, and the result matches eager."""
    launcher = Passthrough(host_launcher)
    torch.manual_seed(0)
    model = sc.SwiGLU(16, 24, activation=GLUActivation("relu", limit=2.0))
    x = torch.randn(5, 16)
    seen = []

    def backend(gm, example_inputs):
        graphs = [m.graph for m in gm.modules() if isinstance(m, torch.fx.GraphModule)]   # with the Function's
        seen.append((launcher.calls, [str(n.target) for g in graphs for n in g.nodes if n.op == "call_function"]))
        return gm.forward

    with primitives_on_host_kernels(launcher):
        torch._dynamo.reset()
        y = torch.compile(model, backend=backend, fullgraph=True)(x)
        expected = model(x)
    assert seen and all(calls == 0 for calls, _ in seen)
    assert any("swiglu_cupy" in target for _, targets in seen for target in targets)
    result = _result(launcher, GLUActivation("relu", limit=2.0), torch.float32)
    assert (result.status, result.calls) == ("passed", 1)
    torch.testing.assert_close(y, expected, rtol=1e-6, atol=1e-6)


def test_warmup_runs_each_modules_check(monkeypatch):
    """``sc.warmup`` loads the kernels, then checks every (variant, dtype) module."""
    loaded, checked = [], []
    monkeypatch.setattr(selfcheck.launch, "warmup", lambda *a: loaded.append(a) or 24)
    monkeypatch.setattr(selfcheck, "device_index", lambda device: 0)
    monkeypatch.setattr(selfcheck, "kernels_usable", lambda *a: checked.append(a) or True)
    monkeypatch.setattr(selfcheck, "check_module", lambda *a: a)
    assert sc.warmup("cuda", dtypes=(torch.bfloat16, torch.float32), activations=("silu", GPT_OSS, GPT_OSS)) == 24
    assert len(loaded) == 1
    assert checked == [(None, s, d, torch.device("cuda", 0)) for d in (torch.bfloat16, torch.float32)
                       for s in (sc.GLUActivation(), GPT_OSS)]


@pytest.mark.gpu
def test_first_use_inside_cuda_graph_capture_raises_and_warmup_fixes_it():
    dtype = torch.float16
    spec = GLUActivation("sigmoid", limit=3.0, interleaved=True)   # a module no other GPU test loads first
    x12 = torch.randn(64, 256, device="cuda", dtype=dtype)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(selfcheck.SelfCheckError, match="warmup"):
            with torch.cuda.graph(graph):
                primitives.swiglu_forward(x12, activation=spec)
    sc.warmup("cuda", dtypes=(dtype,), activations=(spec,))
    result = selfcheck.check_module(None, spec, dtype, torch.device("cuda", torch.cuda.current_device()))
    assert result.status == "passed", result.line()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        h = primitives.swiglu_forward(x12, activation=spec)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(h, primitives.swiglu_forward(x12, implementation="torch", activation=spec),
                               rtol=0, atol=1e-3)


@pytest.mark.gpu
def test_every_variant_passes_its_self_check_on_this_gpu():
    from swiglu_cupy.kernels.sources import VARIANTS

    device = torch.device("cuda", torch.cuda.current_device())
    for variant in VARIANTS:   # bf16: the selftest's quick facts check every variant first
        for dtype in (torch.float32,):
            result = selfcheck.check_module(None, selfcheck.probe_spec(variant), dtype, device)
            assert result.status == "passed", result.line()


# ---- the MoE op's grouped path ------------------------------------------------------------------

def _moe_problem(dtype, seed=1):
    from swiglu_cupy.moe.grouped import grouped_mm_runs

    gen = torch.Generator().manual_seed(seed)
    S, E, D, I = 12, 3, 16, 8
    x = torch.randn(S, D, generator=gen).to(dtype)
    w12 = (torch.randn(E, 2 * I, D, generator=gen) / 4).to(dtype)
    w3 = (torch.randn(E, D, I, generator=gen) / 3).to(dtype)
    if not grouped_mm_runs(x, w12, w3):   # e.g. an older torch without it on the CPU
        pytest.skip("torch.nn.functional.grouped_mm does not run here: the grouped path (and its check) is not taken")
    offsets = torch.tensor([4, 4, 12], dtype=torch.int32)
    ids = torch.tensor([0] * 4 + [2] * 8).view(S, 1)
    rw = torch.rand(S, generator=gen)
    return x, offsets, w12, w3, ids, rw


def test_moe_grouped_path_passes_its_check_once(host_launcher):
    from swiglu_cupy.moe import grouped_experts

    launcher = Passthrough(host_launcher)
    x, offsets, w12, w3, ids, rw = _moe_problem(torch.float32)
    with primitives_on_host_kernels(launcher), warnings.catch_warnings():
        warnings.simplefilter("error")
        grouped_experts(x, offsets, w12, w3, routing_weights=rw)
        grouped_experts(x, offsets, w12, w3, routing_weights=rw)
    moe = [r for r in selfcheck.results() if r.kernel == "moe_experts" and r.device == "cpu via Passthrough"
           and r.dtype is torch.float32]
    assert len(moe) == 1 and moe[0].status == "passed" and moe[0].calls == 1


def test_moe_wrong_group_boundaries_are_caught_and_the_loop_takes_over(host_launcher, monkeypatch):
    """grouped_mm with every group boundary one row late (a combine/offsets
    bug): caught, warned once, and the per-expert loop's result is right."""
    from swiglu_cupy.moe import grouped, grouped_experts

    real = torch.nn.functional.grouped_mm
    calls = []

    def late_boundaries(a, b, offs=None, **kw):
        calls.append(1)
        return real(a, b, offs=(offs + 1).clamp(max=offs[-1]), **kw)

    monkeypatch.setattr(grouped.F, "grouped_mm", late_boundaries)
    launcher = Passthrough(host_launcher)
    x, offsets, w12, w3, ids, rw = _moe_problem(torch.float32, seed=2)
    with primitives_on_host_kernels(launcher):
        x_req = x.clone().requires_grad_()
        with pytest.warns(RuntimeWarning, match="self-check FAILED for kernel moe_experts on cpu via Passthrough"):
            y = grouped_experts(x_req, offsets, w12, w3, routing_weights=rw)
        assert calls                                   # the probe did reach the faulty GEMM
        calls.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            y.sum().backward()
            grouped_experts(x, offsets, w12, w3, routing_weights=rw)
        assert not calls                               # the loop from now on
    xr = x.double().requires_grad_()
    ref = reference.experts_reference(xr, ids, rw.double().view(-1, 1), w12.double(), w3.double())
    ref.sum().backward()
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x_req.grad.double(), xr.grad, rtol=1e-5, atol=1e-5)


def test_moe_check_under_autocast_and_inference_mode_is_not_fooled(host_launcher):
    """A first call under bf16 autocast and inference mode: the probe runs
    its own fp32 numerics (and its autograd reference) and passes."""
    from swiglu_cupy.moe import grouped_experts

    launcher = Passthrough(host_launcher)
    x, offsets, w12, w3, ids, rw = _moe_problem(torch.float32, seed=4)
    with primitives_on_host_kernels(launcher), warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            grouped_experts(x, offsets, w12, w3, routing_weights=rw)
    mine = [r for key, r in selfcheck._results.items() if launcher in key]
    assert any(r.kernel == "moe_experts" for r in mine) and all(r.status == "passed" for r in mine), mine


def test_a_limit_beyond_the_dtype_range_is_probed_at_its_largest_value(host_launcher):
    assert selfcheck._neighbours(1e6, torch.float16)[1] == torch.finfo(torch.float16).max
    result = _result(Passthrough(host_launcher), deepseek_v4(1e6), torch.float16)
    assert result.status == "passed", result.line()


# ---- a launch config first used after the module's check ------------------------------------

class SkipsWideBlocks(Passthrough):
    """The host launcher, except that launches of 512-thread blocks write
    nothing: a kernel instance wrong for one launch config only."""

    def launch(self, name, dtype, device, grid, block, args):
        if block[0] * block[1] == 512:
            self.calls += 1
            return
        super().launch(name, dtype, device, grid, block, args)


WIDE = sc.kernels.launch_config.LaunchConfig(1, 512, None)   # not among the default check's configs


def test_a_launch_config_the_check_did_not_cover_gets_its_own_probe(host_launcher):
    launcher = SkipsWideBlocks(host_launcher)
    x12, _ = _inputs(4, 16, torch.float32, sc.GLUActivation())
    torch_h = primitives.swiglu_forward(x12, implementation="torch")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        primitives.swiglu_forward(x12, launcher=launcher)         # the default config: checked, passes
    assert WIDE not in selfcheck.probe_configs()
    with sc.kernels.launch_config.using_launch_config(WIDE):
        with pytest.warns(RuntimeWarning, match="self-check FAILED.*threads=512"):
            h = primitives.swiglu_forward(x12, launcher=launcher)
        calls = launcher.calls
        assert torch.equal(primitives.swiglu_forward(x12, launcher=launcher), torch_h)  # no warning again
        assert torch.equal(h, torch_h) and launcher.calls == calls   # the torch implementation ran
    calls = launcher.calls
    h = primitives.swiglu_forward(x12, launcher=launcher)                 # the default config: the kernels
    assert launcher.calls == calls + 1 and torch.equal(h, primitives.swiglu_forward(x12, launcher=host_launcher))
    assert _result(launcher, sc.GLUActivation(), torch.float32).status == "passed"   # the module itself


def test_a_passing_config_is_probed_once_and_strict_refuses_a_failing_one(host_launcher, monkeypatch):
    good = Passthrough(host_launcher)
    x12, _ = _inputs(4, 16, torch.float16, sc.GLUActivation())
    primitives.swiglu_forward(x12, launcher=good)
    with sc.kernels.launch_config.using_launch_config(WIDE):
        probes = len(host_launcher.probe_launches)
        primitives.swiglu_forward(x12, launcher=good)
        probed = len(host_launcher.probe_launches) - probes
        assert probed > 0 and {b[0] * b[1] for _, _, b in host_launcher.probe_launches[probes:]} == {512}
        primitives.swiglu_forward(x12, launcher=good)
        assert len(host_launcher.probe_launches) == probes + probed     # checked once
    bad = SkipsWideBlocks(host_launcher)
    primitives.swiglu_forward(x12, launcher=bad)                        # the default config's check passes
    monkeypatch.setenv("SWIGLU_CUPY_STRICT", "1")
    with sc.kernels.launch_config.using_launch_config(WIDE):
        for _ in range(2):   # the first use and every use after it
            with pytest.raises(selfcheck.SelfCheckError, match="threads=512.*failed"):
                primitives.swiglu_forward(x12, launcher=bad)


def test_a_new_launch_config_inside_graph_capture_names_warmup(host_launcher, monkeypatch):
    launcher = Passthrough(host_launcher)
    x12, _ = _inputs(4, 16, torch.float32, sc.GLUActivation())
    primitives.swiglu_forward(x12, launcher=launcher)                  # checked outside capture
    monkeypatch.setattr(selfcheck, "_stream_capturing", lambda device: True)
    calls = launcher.calls
    with sc.kernels.launch_config.using_launch_config(WIDE):
        with pytest.raises(selfcheck.SelfCheckError, match="threads=512 .*inside CUDA graph capture.*warmup"):
            primitives.swiglu_forward(x12, launcher=launcher)
    assert launcher.calls == calls


def test_concurrent_first_use_from_threads_probes_once_and_agrees(host_launcher):
    """8 threads make a module's first call at once (each with its own launch
    decision to take): one probe runs, and every thread gets the kernels' result."""
    import threading

    launcher = Passthrough(host_launcher)
    x12, _ = _inputs(6, 16, torch.float32, sc.GLUActivation())
    expected = primitives.swiglu_forward(x12, launcher=host_launcher)
    probes = len(host_launcher.probe_launches)
    start, results, errors = threading.Barrier(8), [None] * 8, []

    def first_call(i):
        try:
            start.wait()
            results[i] = primitives.swiglu_forward(x12, launcher=launcher)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=first_call, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    result = _result(launcher, sc.GLUActivation(), torch.float32)
    assert (result.status, result.calls) == ("passed", 1)
    assert len(host_launcher.probe_launches) > probes
    assert all(torch.equal(r, expected) for r in results)          # the kernels' result, in every thread
    assert launcher.calls - result.launches == 8                   # one launch each, besides the probe
