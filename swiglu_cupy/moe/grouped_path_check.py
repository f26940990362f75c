"""First-use self-check of the MoE op's grouped path (``grouped_mm`` GEMMs,
the fused activation, the routing-weight combine), per (launcher, GLU
variant, dtype, device), as ``primitives.first_use_check`` does for the kernel
modules: a small routed problem (4 experts, one empty, biases, routing
weights, rows in the variant's layout) runs the op's forward and backward
bodies and is compared with ``reference.experts_reference`` by float64
autograd (relative RMS error per output within ``REL_RMS_BOUND``). A failure
warns once and the op then takes the per-expert GEMM loop for that module
(and the activation whatever its own check decided). It applies where the
grouped path runs on CUDA, or through a substituted launcher (tests)."""
from __future__ import annotations

import threading

import torch

from ..activations import GLUActivation
from ..kernels.launch import strict_mode
from ..kernels.launch_config import forced_launcher
from ..kernels.sources import kernel_variant
from ..primitives import first_use_check
from ..reference import experts_reference

REL_RMS_BOUND = {torch.float16: 1e-2, torch.bfloat16: 4e-2, torch.float32: 1e-4, torch.float64: 1e-10}
_E, _D, _I = 4, 16, 24          # 16-byte aligned widths: grouped_mm runs
_ROWS = (5, 0, 9, 3)            # rows per expert: expert 1 is empty

_verdicts: dict[tuple, bool] = {}
_local = threading.local()      # set while the probe runs the bodies (no recursion)


def grouped_path_trusted(x: torch.Tensor, activation: GLUActivation, forward_body, backward_body) -> bool:
    """Whether the grouped path may run for this call (checked on first use)."""
    launcher = forced_launcher()
    if getattr(_local, "probing", False) or not (x.is_cuda or launcher is not None):
        return True
    key = (launcher, activation, x.dtype, x.device)
    verdict = _verdicts.get(key)
    if verdict is None:
        if not first_use_check.enabled():
            return True
        decision = first_use_check.probe_decision(x.device)
        if decision == "defer":
            return True   # traced: the op's fake rule; checked at its first eager call
        module_key = ("moe", launcher, kernel_variant(activation), x.dtype, x.device)
        if decision == "refuse" and module_key not in first_use_check._results:
            raise first_use_check.SelfCheckError(
                f"swiglu-cupy: the MoE experts op ({x.dtype}, {x.device}) is first used inside CUDA graph "
                "capture, before its self-check; run it once (or call swiglu_cupy.warmup) before capture.")
        result = first_use_check.record(module_key, lambda: _check(launcher, activation, x.dtype, x.device,
                                                             forward_body, backward_body))
        verdict = _verdicts[key] = result.status != "failed"
    if not verdict and strict_mode():
        raise first_use_check.SelfCheckError(f"the MoE experts op failed its self-check ({x.dtype}, {x.device})")
    return verdict


def _check(launcher, spec, dtype, device, forward_body, backward_body):
    name = "moe_experts" + (f" ({spec})" if kernel_variant(spec).tag else "")
    text = first_use_check.describe_device(launcher, device)
    result = first_use_check.run_probe(kernel_variant(spec), dtype, text, device,
                                 lambda: _probe(spec, dtype, device, forward_body, backward_body), module=name)
    if result.status == "failed" and strict_mode():
        raise first_use_check.SelfCheckError(result.line())
    return result


def _probe(spec, dtype, device, forward_body, backward_body):
    gen = torch.Generator().manual_seed(0)
    S = sum(_ROWS)
    x = torch.randn(S, _D, generator=gen, dtype=torch.float64)
    w12 = torch.randn(_E, 2 * _I, _D, generator=gen, dtype=torch.float64) / _D ** 0.5
    b12 = torch.randn(_E, 2 * _I, generator=gen, dtype=torch.float64) * 0.1
    w3 = torch.randn(_E, _D, _I, generator=gen, dtype=torch.float64) / _I ** 0.5
    b3 = torch.randn(_E, _D, generator=gen, dtype=torch.float64) * 0.1
    rw = torch.rand(S, generator=gen, dtype=torch.float64)
    dy = torch.randn(S, _D, generator=gen, dtype=torch.float64)
    ids = torch.repeat_interleave(torch.arange(_E), torch.tensor(_ROWS)).view(S, 1)
    stored = [t.to(dtype).to(device) for t in (x, w12, b12, w3, b3)]
    offsets = torch.tensor(_ROWS).cumsum(0).to(torch.int32).to(device)
    rw_d, dy_d = rw.to(device), dy.to(device)
    _local.probing = True
    try:
        rows_way = (None, 1, None)  # perm, top_k, combine_dtype: the grouped rows as given
        y, x12 = forward_body(*stored[:1], offsets, stored[1], stored[2], stored[3], stored[4], rw_d, spec, False,
                              False, *rows_way)
        grads = backward_body(dy_d, stored[0], x12, offsets, stored[1], stored[2], stored[3], stored[4], rw_d,
                              spec, False, False, (True,) * 6, *rows_way)
    finally:
        _local.probing = False
    # float64 autograd of the per-expert reference, from the stored (rounded) values.
    with torch.enable_grad():   # the op's forward may run inside a Function's forward (grad off)
        leaves = [t.detach().cpu().double().requires_grad_() for t in stored] + [rw.clone().requires_grad_()]
        rx, rw12, rb12, rw3, rb3, rrw = leaves
        ref = experts_reference(rx, ids, rrw.view(S, 1), rw12, rw3, rb12, rb3, activation=spec, x12_dtype=dtype)
        ref.backward(dy)
    names = ("y", "dx", "dw12", "db12", "dw3", "db3", "drouting_weights")
    got = (y, *grads)
    want = (ref.detach(), rx.grad, rw12.grad, rb12.grad, rw3.grad, rb3.grad, rrw.grad)
    problems = []
    for name, g, r in zip(names, got, want):
        g = g.detach().double().cpu()
        err = ((g - r).pow(2).mean().sqrt() / r.pow(2).mean().sqrt().clamp_min(1e-300)).item()
        if not err <= REL_RMS_BOUND[dtype]:   # NaN fails too
            problems.append(f"{name}: relative RMS error {err:.3g} > {REL_RMS_BOUND[dtype]:g} (E={_E}, rows "
                            f"{_ROWS}, D={_D}, I={_I})")
    return problems, 0
