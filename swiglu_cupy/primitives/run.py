"""The primitives' eager entry points on arguments valid by construction (the
Functions, after the API's one validation pass: the checks are a measurable
part of a small call's host time): each picks the CUDA kernels
(``cuda_impl``) or the torch implementation (``torch_impl``) and runs it.
The checked public entries are in ``primitives/__init__``; tracers and
torch.func reach these through the registered ops (``ops``, via ``route``)."""
from __future__ import annotations

import torch

from .._dtypes import FULL_PRECISION_DTYPES as _FULL_PRECISION
from ..activations import SILU, GLUActivation
from ..kernels.launch import cuda_kernels_available
from ..kernels.launch_config import forced_launcher
from . import cuda_impl as kernels
from . import saved_x12, torch_impl
from .first_use_check import kernels_usable, verdicts

__all__ = ["run_swiglu_forward", "run_swiglu_backward", "run_silu_mul_forward", "run_silu_mul_backward",
           "run_swiglu_forward_fp8", "run_swiglu_backward_fp8", "h_over_gate", "gate_half", "batch_first"]


def _or_new(out: torch.Tensor | None, shape: tuple, like: torch.Tensor) -> torch.Tensor:
    """The caller's buffer, or a new one: the torch implementation writes
    given buffers in one pass per output (its functional form, with no
    buffers, is for tracers)."""
    return torch.empty(shape, dtype=like.dtype, device=like.device) if out is None else out


def _or_new_if_half(out: torch.Tensor | None, shape: tuple, like: torch.Tensor) -> torch.Tensor | None:
    """Like ``_or_new`` for fp16/bf16, where the buffered store saves a
    rounding pass; fp32/fp64 outputs come as fast from the functional op,
    without the allocation call."""
    return out if out is not None or like.dtype in _FULL_PRECISION else _or_new(out, shape, like)


def _kernel_launcher(x12: torch.Tensor, implementation: str | None, launcher, spec: GLUActivation):
    """The launcher to run the kernels with (None: the CuPy one), or False
    for the torch implementation: also when the module (variant, dtype,
    device, launcher) failed its first-use self-check (``first_use_check``)."""
    if implementation is None and launcher is None:  # the common call: one verdict lookup
        chosen = forced_launcher()
        if chosen is None and not (x12.is_cuda and cuda_kernels_available()):
            return False
    else:
        if implementation not in (None, "torch", "kernels"):
            raise ValueError(f"implementation must be None, 'torch' or 'kernels', got {implementation!r}")
        if implementation == "torch":
            return False
        chosen = launcher if launcher is not None else forced_launcher()
    if verdicts.get((chosen, spec, x12.dtype, x12.device)):
        return chosen
    return chosen if kernels_usable(chosen, spec, x12.dtype, x12.device) else False


def run_swiglu_forward(x12, out=None, implementation=None, launcher=None, activation=SILU) -> torch.Tensor:
    launcher = _kernel_launcher(x12, implementation, launcher, activation)
    if launcher is not False:
        return kernels.launch_swiglu_forward(x12, out, launcher, activation=activation)
    return torch_impl.swiglu_forward_torch(x12, _or_new_if_half(out, (x12.shape[0], x12.shape[1] // 2), x12),
                                           activation)


def run_swiglu_backward(x12, dh, dx12_out=None, implementation=None, launcher=None, activation=SILU):
    launcher = _kernel_launcher(x12, implementation, launcher, activation)
    if launcher is not False:
        return kernels.launch_swiglu_backward(x12, dh, dx12_out, launcher, activation=activation)
    return torch_impl.swiglu_backward_torch(x12, dh, _or_new(dx12_out, tuple(x12.shape), x12),
                                            h_out=_or_new(None, tuple(dh.shape), x12), activation=activation)


def run_silu_mul_forward(gate, up, out=None, implementation=None, launcher=None, activation=SILU) -> torch.Tensor:
    launcher = _kernel_launcher(gate, implementation, launcher, activation)
    if launcher is not False:
        return kernels.launch_silu_mul_forward(gate, up, out, launcher, activation=activation)
    return torch_impl.silu_mul_forward_torch(gate, up, _or_new_if_half(out, gate.shape, gate), activation)


def run_silu_mul_backward(gate, up, dh, dgate_out=None, dup_out=None, implementation=None, launcher=None,
                          activation=SILU):
    launcher = _kernel_launcher(gate, implementation, launcher, activation)
    if launcher is not False:
        return kernels.launch_silu_mul_backward(gate, up, dh, dgate_out, dup_out, launcher, activation=activation)
    shape = gate.shape
    return torch_impl.silu_mul_backward_torch(gate, up, dh, _or_new(dgate_out, shape, gate),
                                             _or_new(dup_out, shape, gate), activation)


def gate_half(x12: torch.Tensor) -> torch.Tensor:
    return x12.chunk(2, 1)[0]


def h_over_gate(x12: torch.Tensor, spec: GLUActivation) -> torch.Tensor:
    """h = act(gate) * up written over the gate half of x12 (the silu_mul
    primitive on x12's two halves); returns that strided [M, H] view."""
    gate, up = x12.chunk(2, 1)  # one call for both views: slicing costs ~1.5 us each
    return run_silu_mul_forward(gate, up, gate, activation=spec)


def batch_first(info, t: torch.Tensor, dim) -> torch.Tensor:
    """``t`` with its vmap batch (at ``dim``, or none: then broadcast) as dim 0."""
    return t.expand(info.batch_size, *t.shape) if dim is None else t.movedim(dim, 0)


# ---- the 8-bit saved x12 (saved_x12="fp8", see saved_x12.py) --------------------------------

def run_swiglu_forward_fp8(x12, implementation=None, launcher=None, activation=SILU):
    """(h, saved): h from x12 as ``run_swiglu_forward``, and x12 quantized to
    the 8-bit saved tensor, in one kernel pass (the torch path: two)."""
    launcher = _kernel_launcher(x12, implementation, launcher, activation)
    if launcher is not False:
        return kernels.launch_swiglu_forward_fp8(x12, launcher, activation=activation)
    h = run_swiglu_forward(x12, None, "torch", None, activation)
    return h, saved_x12.quantize_torch(x12, activation)


def run_swiglu_backward_fp8(saved, dh, implementation=None, launcher=None, activation=SILU):
    """(dx12, h) in dh's dtype from the 8-bit saved x12: the backward of the
    dequantized x12 (fp32 math, each output rounded once)."""
    launcher = _kernel_launcher(dh, implementation, launcher, activation)
    if launcher is not False:
        return kernels.launch_swiglu_backward_fp8(saved, dh, launcher, activation=activation)
    x12 = saved_x12.dequantize_torch(saved, dh.shape[1], activation)
    dx12, h = torch_impl.swiglu_backward_torch(x12, dh.float(), activation=activation)
    return dx12.to(dh.dtype), h.to(dh.dtype)
