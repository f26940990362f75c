"""GPU tests: the CuPy kernels against the torch implementation and the fp64
reference, on a non-default stream, plus checkpointing on CUDA. Skipped
without a GPU (their CPU counterparts: test_host_exec, test_compile_check,
test_checkpoint)."""
import pytest
import torch
from torch.utils.checkpoint import checkpoint

import swiglu_cupy as sc
from swiglu_cupy import primitives
from swiglu_cupy.kernels import launch as _launch
from swiglu_cupy.kernels.sources import VARIANTS
from swiglu_cupy.activations import GPT_OSS, GLUActivation, deepseek_v4
from swiglu_cupy.kernels.launch_config import DEFAULT_LAUNCH, LAUNCH_CANDIDATES, using_launch_config
from conftest import (assert_compiled_matches_eager, assert_nontrivial, elementwise_error_bounds, glu_error_bounds,
                      rel_rms, spec_of_variant, swiglu_fp64_reference)

pytestmark = pytest.mark.gpu
CUDA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@pytest.mark.parametrize("dtype", CUDA_DTYPES)
@pytest.mark.parametrize("M,H", [(1, 1), (3, 7), (64, 11008 // 8), (257, 1001), (4096, 64)])
def test_kernels_match_torch_on_a_side_stream(dtype, M, H):
    torch.manual_seed(M + H)
    x12 = (torch.randn(M, 2 * H, device="cuda") * 2).to(dtype)
    dh = torch.randn(M, H, device="cuda").to(dtype)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        h = primitives.swiglu_forward(x12, implementation="kernels")
        dx12, h_bwd = primitives.swiglu_backward(x12, dh, implementation="kernels")
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    ref_dx12, ref_h = primitives.swiglu_backward(x12.cpu(), dh.cpu(), implementation="torch")
    h_bound, dx12_bound = elementwise_error_bounds(x12.cpu(), dh.cpu(), ref_h, ref_dx12)
    # -ftz and the GPU's expf may differ from the CPU in the last fp32 bit.
    assert ((h.cpu().double() - ref_h.double()).abs() <= 2 * h_bound).all()
    assert ((h_bwd.cpu().double() - ref_h.double()).abs() <= 2 * h_bound).all()
    assert ((dx12.cpu().double() - ref_dx12.double()).abs() <= 2 * dx12_bound).all()


def test_misaligned_input_takes_the_scalar_path_correctly():
    H = 64
    storage = torch.randn(5 * 2 * H + 1, device="cuda").to(torch.bfloat16)
    x12 = storage[1:].view(5, 2 * H)
    h = primitives.swiglu_forward(x12, implementation="kernels")
    ref = primitives.swiglu_forward(x12.cpu(), implementation="torch")
    assert rel_rms(h.cpu(), ref) < 2**-8


@pytest.mark.parametrize("dtype", CUDA_DTYPES)
@pytest.mark.parametrize("lead", [(8, 33), (129,)])
def test_function_parity_on_cuda(dtype, lead):
    torch.manual_seed(0)
    m = sc.SwiGLU(256, 688, 128, device="cuda", dtype=dtype)
    x = torch.randn(*lead, 256, device="cuda", dtype=dtype, requires_grad=True)
    y = m(x)
    # A sum, not a mean: a mean over ~34k outputs puts fp16 gradients (~1e-5)
    # below fp16's smallest normal (6.1e-5), where rounding is ~3% relative.
    y.float().pow(2).sum().backward()
    ref = swiglu_fp64_reference(x, m.w12.weight, m.w12.bias, m.w3.weight, m.w3.bias)
    assert rel_rms(y, ref) < {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 1.6e-2}[dtype]
    # Gradients against the fp64 autograd reference.
    xr = x.detach().double().requires_grad_(True)
    pr = [p.detach().double().requires_grad_(True) for p in m.parameters()]
    sc.swiglu_reference(xr, *pr).float().pow(2).sum().backward()
    bound = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 3e-2}[dtype]
    for g, r in zip([x.grad] + [p.grad for p in m.parameters()], [xr.grad] + [p.grad for p in pr]):
        assert_nontrivial(g, "grad")
        assert rel_rms(g, r) < bound


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("x_requires_grad", [False, True])
def test_checkpoint_on_cuda(use_reentrant, x_requires_grad):
    if use_reentrant and not x_requires_grad:
        x_requires_grad = True  # torch's reentrant rule (see test_checkpoint.py)
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(sc.SwiGLU(64, 96, device="cuda") for _ in range(3))
    x = torch.randn(4, 16, 64, device="cuda", requires_grad=x_requires_grad)

    def run(ckpt):
        blocks.zero_grad(set_to_none=True)
        h = x
        for b in blocks:
            h = h + (checkpoint(b, h, use_reentrant=use_reentrant) if ckpt else b(h))
        h.pow(2).mean().backward()
        return [p.grad.clone() for p in blocks.parameters()]

    for g, g_ref in zip(run(True), run(False)):
        assert_nontrivial(g_ref, "grad")
        assert torch.equal(g, g_ref)


def test_kernels_are_used_on_cuda():
    assert _launch.cuda_kernels_available()
    x = torch.randn(4, 32, device="cuda")
    m = sc.SwiGLU(32, 64, device="cuda")
    before = _launch.cupy_launcher().compile_count
    m(x)
    assert _launch.cupy_launcher().compile_count >= before
    assert any(key[2].startswith("swiglu_forward") for key in _launch.cupy_launcher()._functions)


def test_cuda_graph_capture_and_replay():
    torch.manual_seed(0)
    model = torch.nn.Sequential(sc.SwiGLU(64, 96, device="cuda"), sc.SwiGLU(64, 96, device="cuda"))
    sc.warmup(dtypes=(torch.float32,))
    static_x = torch.randn(32, 64, device="cuda", requires_grad=True)
    # Warm up on a side stream (torch's recipe), then capture fwd + bwd.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            model(static_x).pow(2).mean().backward()
    torch.cuda.current_stream().wait_stream(side)
    model.zero_grad(set_to_none=False)
    static_x.grad = None
    compiles_before = _launch.cupy_launcher().compile_count
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = model(static_x)
        static_y.pow(2).mean().backward()
    assert _launch.cupy_launcher().compile_count == compiles_before  # nothing loaded in capture
    for seed in (1, 2):
        torch.manual_seed(seed)
        new_x = torch.randn(32, 64, device="cuda")
        with torch.no_grad():
            static_x.copy_(new_x)
            for p in model.parameters():
                p.grad.zero_()
            static_x.grad.zero_()
        graph.replay()
        torch.cuda.synchronize()
        x = new_x.clone().requires_grad_(True)
        ref = torch.nn.Sequential(*[sc.SwiGLU(64, 96, device="cuda") for _ in range(2)])
        ref.load_state_dict(model.state_dict())
        y = ref(x)
        y.pow(2).mean().backward()
        torch.testing.assert_close(static_y, y)
        torch.testing.assert_close(static_x.grad, x.grad)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad)


def test_no_grad_peak_memory_is_x12_plus_output():
    torch.manual_seed(0)
    M, D, H = 4096, 1024, 2752
    m = sc.SwiGLU(D, H, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(M, D, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        m(x)  # compile + cuBLAS workspace
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        y = m(x)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    x12_bytes, y_bytes = M * 2 * H * 2, M * D * 2
    # Allow cuBLAS workspace slack but not an [M, H] h buffer (M*H*2 bytes).
    assert peak < x12_bytes + y_bytes + M * H * 2 // 2, (peak, x12_bytes + y_bytes)
    assert torch.equal(y, m(x).detach())  # identical to the grad-enabled forward


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", [None, "non_reentrant", "reentrant"])
def test_cuda_autocast_with_and_without_checkpoint(dtype, mode):
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(sc.SwiGLU(64, 96, device="cuda") for _ in range(2))
    x = torch.randn(8, 64, device="cuda", requires_grad=True)

    def run(checkpoint_mode):
        blocks.zero_grad(set_to_none=True)
        x.grad = None
        with torch.autocast("cuda", dtype=dtype):
            h = x
            for b in blocks:
                if checkpoint_mode is None:
                    out = b(h)
                else:
                    out = checkpoint(b, h, use_reentrant=checkpoint_mode == "reentrant")
                assert out.dtype == dtype  # the block ran in the autocast dtype
                h = h + out  # fp32 residual + low-precision output promotes to fp32
            loss = h.float().pow(2).mean()
        loss.backward()
        return [x.grad.clone()] + [p.grad.clone() for p in blocks.parameters()]

    expected = run(None)
    for g in expected:
        assert g.dtype == torch.float32
        assert_nontrivial(g, "grad")
    if mode is not None:
        for g, g_ref in zip(run(mode), expected):
            assert torch.equal(g, g_ref)


def test_torch_compile_fullgraph_on_cuda():
    torch.manual_seed(0)
    model = torch.nn.Sequential(sc.SwiGLU(64, 96, device="cuda"), sc.SwiGLU(64, 96, device="cuda"))
    assert_compiled_matches_eager(model, torch.randn(16, 64, device="cuda", requires_grad=True), tol=1e-5)


def _assert_within_single_rounding(x12, dh, h=None, dx12=None):
    """CUDA results against the torch implementation on the CPU (-ftz and the
    GPU's expf may differ from the CPU in the last fp32 bit, hence 2x)."""
    x12, dh = x12.cpu(), dh.cpu()
    ref_dx12, ref_h = primitives.swiglu_backward(x12, dh, implementation="torch")
    h_bound, dx12_bound = elementwise_error_bounds(x12, dh, ref_h, ref_dx12)
    if h is not None:
        assert ((h.cpu().double() - ref_h.double()).abs() <= 2 * h_bound).all()
    if dx12 is not None:
        assert ((dx12.cpu().double() - ref_dx12.double()).abs() <= 2 * dx12_bound).all()


@pytest.mark.parametrize("dtype", CUDA_DTYPES)
@pytest.mark.parametrize("M,H", [(1, 1), (37, 129), (512, 1376)])
def test_silu_mul_kernels_match_torch_on_cuda(dtype, M, H):
    torch.manual_seed(M + H)
    x12 = (torch.randn(M, 2 * H, device="cuda") * 2).to(dtype)
    dh = torch.randn(M, H, device="cuda").to(dtype)
    wide = torch.zeros(M, H + 24, device="cuda", dtype=dtype)
    gate = wide[:, 8:8 + H]                      # own row stride
    gate.copy_(x12[:, :H])
    up = x12[:, H:].clone()
    h = primitives.silu_mul_forward(gate, up, implementation="kernels")
    dgate, dup = primitives.silu_mul_backward(gate, up, dh, implementation="kernels")
    torch.cuda.synchronize()
    assert_nontrivial(dgate, "dgate")
    assert_nontrivial(dup, "dup")
    _assert_within_single_rounding(x12, dh, h=h, dx12=torch.cat([dgate, dup], dim=1))
    # In place: dgate over gate, dup over up.
    primitives.silu_mul_backward(gate, up, dh, dgate_out=gate, dup_out=up, implementation="kernels")
    torch.testing.assert_close(torch.cat([gate, up], dim=1), torch.cat([dgate, dup], dim=1), rtol=0, atol=0)


@pytest.mark.parametrize("config", LAUNCH_CANDIDATES, ids=lambda c: c.label.replace(" ", "-"))
def test_every_launch_candidate_on_cuda(config):
    """LLaMA-width rows (vector path), an odd H (scalar path) and many rows,
    so capped grids loop; results independent of the launch shape."""
    torch.manual_seed(0)
    for M, H in [(4096, 11008 // 8), (300, 1001)]:
        x12 = (torch.randn(M, 2 * H, device="cuda") * 2).to(torch.bfloat16)
        dh = torch.randn(M, H, device="cuda").to(torch.bfloat16)
        with using_launch_config(DEFAULT_LAUNCH):
            h_ref = primitives.swiglu_forward(x12, implementation="kernels")
            dx12_ref, _ = primitives.swiglu_backward(x12, dh, implementation="kernels")
        with using_launch_config(config):
            h = primitives.swiglu_forward(x12, implementation="kernels")
            dx12, h_bwd = primitives.swiglu_backward(x12, dh, implementation="kernels")
            dgate, dup = primitives.silu_mul_backward(x12[:, :H], x12[:, H:], dh, implementation="kernels")
        torch.cuda.synchronize()
        # Same math per element whatever the shape: bitwise equal to the default.
        assert torch.equal(h, h_ref) and torch.equal(h_bwd, h_ref)
        assert torch.equal(dx12, dx12_ref) and torch.equal(torch.cat([dgate, dup], dim=1), dx12_ref)
    _assert_within_single_rounding(x12, dh, h=h, dx12=dx12)


# ---- every GLU variant on CUDA (one test per variant: each compiles its module per dtype) ----

@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.tag or "swiglu")
def test_every_variant_kernel_matches_torch_on_cuda(variant):
    spec = spec_of_variant(variant)
    for dtype in CUDA_DTYPES:
        for M, H in [(3, 7), (257, 1001), (64, 1376)]:  # scalar and 16-byte paths
            torch.manual_seed(M + H)
            x12 = (torch.randn(M, 2 * H, device="cuda") * 2).to(dtype)
            dh = torch.randn(M, H, device="cuda").to(dtype)
            h = primitives.swiglu_forward(x12, implementation="kernels", activation=spec)
            dx12, h_bwd = primitives.swiglu_backward(x12, dh, implementation="kernels", activation=spec)
            ref_dx12, ref_h = primitives.swiglu_backward(x12.cpu(), dh.cpu(), implementation="torch", activation=spec)
            h_bound, dx12_bound = glu_error_bounds(x12.cpu(), dh.cpu(), spec, ref_h, ref_dx12)
            # -ftz and the GPU's expf/tanhf/erff may differ from the CPU in the last fp32 bits.
            assert ((h.cpu().double() - ref_h.double()).abs() <= 2 * h_bound).all()
            assert torch.equal(h, h_bwd)
            assert ((dx12.cpu().double() - ref_dx12.double()).abs() <= 2 * dx12_bound).all()
            if spec.limit is not None:
                assert torch.equal(dx12.cpu() == 0, ref_dx12 == 0)
            if not spec.interleaved:
                gate, up = x12[:, :H].contiguous(), x12[:, H:].contiguous()
                assert torch.equal(primitives.silu_mul_forward(gate, up, implementation="kernels",
                                                               activation=spec), h)


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.tag or "swiglu")
def test_fp8_saved_x12_kernels_match_the_cpu_path_on_cuda(variant):
    """saved_x12="fp8" on CUDA (CPU counterpart: test_saved_x12_fp8.py, host
    execution): the saved bytes and scales identical to the CPU path's, the
    backward from them within the single-rounding bounds, masks identical."""
    from swiglu_cupy.primitives import dispatch, saved_x12

    spec = spec_of_variant(variant)
    for dtype in CUDA_DTYPES:
        for M, H in [(3, 7), (257, 1001), (64, 1376)]:
            torch.manual_seed(M + H)
            x12 = (torch.randn(M, 2 * H, device="cuda") * 2).to(dtype)
            dh = torch.randn(M, H, device="cuda").to(dtype)
            h, saved = dispatch.run_swiglu_forward_fp8(x12, "kernels", None, spec)
            h_cpu, saved_cpu = dispatch.run_swiglu_forward_fp8(x12.cpu(), "torch", None, spec)
            assert torch.equal(saved.cpu(), saved_cpu)
            dx12, h_bwd = dispatch.run_swiglu_backward_fp8(saved, dh, "kernels", None, spec)
            ref_dx12, ref_h = dispatch.run_swiglu_backward_fp8(saved_cpu, dh.cpu(), "torch", None, spec)
            x12_saved = saved_x12.dequantize_torch(saved_cpu, H, spec).to(dtype)
            h_bound, dx12_bound = glu_error_bounds(x12_saved, dh.cpu(), spec, ref_h, ref_dx12)
            assert ((h_bwd.cpu().double() - ref_h.double()).abs() <= 2 * h_bound).all()
            assert ((dx12.cpu().double() - ref_dx12.double()).abs() <= 2 * dx12_bound).all()
            if spec.limit is not None:
                assert torch.equal(dx12.cpu() == 0, ref_dx12 == 0)


@pytest.mark.parametrize("spec", [GPT_OSS, deepseek_v4(10.0), GLUActivation("gelu_tanh")], ids=str)
def test_variant_function_parity_checkpoint_and_compile_on_cuda(spec):
    torch.manual_seed(1)
    m = sc.SwiGLU(256, 688, 128, device="cuda", dtype=torch.bfloat16, activation=spec)
    x = (torch.randn(8, 33, 256, device="cuda", dtype=torch.bfloat16) * 4).requires_grad_()
    y = checkpoint(m, x, use_reentrant=False)
    y.float().pow(2).sum().backward()
    params = [p.detach().double().requires_grad_() for p in (m.w12.weight, m.w12.bias, m.w3.weight, m.w3.bias)]
    x_ref = x.detach().double().requires_grad_()
    y_ref = sc.glu_ffn_reference(x_ref, *params, activation=spec)
    y_ref.pow(2).sum().backward()
    assert rel_rms(y, y_ref) < 1.6e-2
    for p, p_ref in zip([x, m.w12.weight, m.w3.weight], [x_ref, params[0], params[2]]):
        assert_nontrivial(p.grad, "grad")
        assert rel_rms(p.grad, p_ref.grad) < 5e-2
    with torch.no_grad():
        torch.testing.assert_close(m(x), y.detach(), rtol=0, atol=0)
    model = torch.nn.Sequential(sc.SwiGLU(64, 96, device="cuda", activation=spec))
    assert_compiled_matches_eager(model, torch.randn(4, 64, device="cuda", requires_grad=True), tol=1e-5)


def test_every_launch_candidate_on_cuda_interleaved():
    """The interleaved kernels under every launch shape: bitwise equal to the
    default (one test: 27 sub-millisecond cases)."""
    torch.manual_seed(2)
    x12 = (torch.randn(1024, 2 * 1376, device="cuda") * 8).to(torch.bfloat16)
    dh = torch.randn(1024, 1376, device="cuda").to(torch.bfloat16)
    with using_launch_config(DEFAULT_LAUNCH):
        h_ref = primitives.swiglu_forward(x12, implementation="kernels", activation=GPT_OSS)
        dx12_ref, _ = primitives.swiglu_backward(x12, dh, implementation="kernels", activation=GPT_OSS)
    for config in LAUNCH_CANDIDATES:
        h, dx12 = torch.full_like(h_ref, float("nan")), torch.full_like(dx12_ref, float("nan"))
        with using_launch_config(config):
            primitives.swiglu_forward(x12, out=h, implementation="kernels", activation=GPT_OSS)
            primitives.swiglu_backward(x12, dh, dx12_out=dx12, implementation="kernels", activation=GPT_OSS)
        assert torch.equal(h, h_ref) and torch.equal(dx12, dx12_ref), config


def test_cuda_graph_capture_of_a_variant_after_warmup():
    m = sc.SwiGLU(64, 128, device="cuda", dtype=torch.bfloat16, activation=GPT_OSS)
    sc.warmup("cuda", dtypes=(torch.bfloat16,), activations=(GPT_OSS,))
    x = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        expected = m(x)
        compiles = _launch.cupy_launcher().compile_count
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = m(x)
        graph.replay()
        torch.cuda.synchronize()
    assert _launch.cupy_launcher().compile_count == compiles
    torch.testing.assert_close(y, expected, rtol=0, atol=0)


def test_stream_changed_between_calls_and_threads_first_use():
    """The cached launch plan follows torch's current stream at every call (two
    streams alternating, each result right), and eight threads' concurrent
    first calls of a fresh launcher compile once and compute right."""
    import threading

    torch.manual_seed(5)
    x12 = torch.randn(33, 2 * 96, device="cuda", dtype=torch.bfloat16)
    ref = primitives.swiglu_forward(x12.cpu(), implementation="torch")
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    outs = []
    for i in range(6):
        stream = streams[i % 2]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            outs.append(primitives.swiglu_forward(x12, implementation="kernels"))
        torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    for h in outs:
        assert rel_rms(h.cpu(), ref) < 2**-8
    launcher = _launch.CupyLauncher()
    failures, barrier = [], threading.Barrier(8)

    def worker():
        try:
            barrier.wait()
            h = primitives.swiglu_forward(x12, launcher=launcher)
            torch.cuda.synchronize()
            assert rel_rms(h.cpu(), ref) < 2**-8
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures
    assert launcher.compile_count == 1


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_each_device_launches_on_its_own():
    """A tensor on the device that is not current launches there (the device
    context is entered only then), and results on both devices are right."""
    x0 = torch.randn(9, 2 * 64, device="cuda:0")
    x1 = x0.to("cuda:1")
    with torch.cuda.device(0):
        h1 = primitives.swiglu_forward(x1, implementation="kernels")
    h0 = primitives.swiglu_forward(x0, implementation="kernels")
    torch.cuda.synchronize(0), torch.cuda.synchronize(1)
    ref = primitives.swiglu_forward(x0.cpu(), implementation="torch")
    assert rel_rms(h0.cpu(), ref) < 1e-6 and rel_rms(h1.cpu(), ref) < 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_separate_weights_modes_agree_on_cuda(dtype):
    """Separate gate/up weights: the default mode keeps gate and up apart
    (cuBLAS writes each into its own tensor), recompute_gate_up and
    inplace_backward write the halves of one x12. The kernels' math does not
    depend on the layout, so y and every gradient agree bit for bit as long
    as cuBLAS gives a half the same bits in either layout; no_grad writes h
    over gate and gives the same y."""
    torch.manual_seed(0)
    M, D, H = 257, 512, 1376
    x = torch.randn(M, D, device="cuda", dtype=dtype)
    w1, w2 = ((torch.randn(H, D, device="cuda") / 20).to(dtype).requires_grad_() for _ in range(2))
    w3 = (torch.randn(D, H, device="cuda") / 30).to(dtype).requires_grad_()
    results = []
    for modes in ({}, {"recompute_gate_up": True}, {"inplace_backward": True}):
        xg = x.clone().requires_grad_()
        y = sc.swiglu_unpacked(xg, w1, None, w2, None, w3, None, **modes)
        results.append((y.detach(), torch.autograd.grad(y.float().square().sum(), (xg, w1, w2, w3))))
    with torch.no_grad():
        assert torch.equal(sc.swiglu_unpacked(x, w1, None, w2, None, w3, None), results[0][0])
    (y, grads), *others = results
    for y_mode, grads_mode in others:
        assert torch.equal(y_mode, y)
        for g, g_mode in zip(grads, grads_mode):
            assert_nontrivial(g, "grad")
            assert torch.equal(g_mode, g)
