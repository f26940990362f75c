"""Layer 1: the SwiGLU elementwise primitives.

Contract (both implementations):

``swiglu_forward(x12, out=None) -> h``
    x12 is [M, 2H] with gate in columns :H and up in columns H:. Returns
    h = silu(gate) * up as [M, H]. ``out`` may be given (any [M, H] view with
    unit inner stride, including the gate half of x12 itself).

``swiglu_backward(x12, dh, dx12_out=None) -> (dx12, h)``
    One pass: dx12 = [dgate | dup] as [M, 2H] and the recomputed h as [M, H].
    ``dx12_out`` may be x12 itself (in-place backward).

``silu_mul_forward(gate, up, out=None) -> h``
    The same with gate and up as separate [M, H] tensors (any row strides).
    ``out`` may be gate itself.

``silu_mul_backward(gate, up, dh, dgate_out=None, dup_out=None) -> (dgate, dup)``
    One pass, h is not produced. ``dgate_out``/``dup_out`` may be gate/up.

The x12 primitives run the same kernels with gate = x12[:, :H] and
up = x12[:, H:] (no copies). The kernels need unit inner stride: other
layouts are copied to contiguous first (outputs are written back).

``activation=`` (a ``swiglu_cupy.activations.GLUActivation`` or a plain
form's name, default ``"silu"``) selects the GLU variant: ``h = act(gate) *
up`` with its clamps, and for x12 its layout (halves or interleaved); the
backward's ``dgate``/``dup`` are that variant's (an interleaved dx12 is
interleaved too). Separate gate/up tensors take halves-layout specs only, and
an interleaved x12 cannot take h over itself (``out`` must not share its
memory: the pairs are compacted by independent threads).

Math runs in fp32 (fp64 for float64 storage) and every output is rounded to
the storage dtype once. Supported dtypes: float16, bfloat16, float32, float64.

CUDA tensors run the kernels in ``kernels_cu/`` (CuPy); other tensors run the
torch implementation. ``implementation=`` forces one ("torch" or "kernels"),
``launcher=`` (or ``launch_config.using_launcher``) substitutes the kernel
launcher (the host-execution harness).
The kernels' launch shape is chosen with ``swiglu_cupy.kernels.launch_config``.
"""
from __future__ import annotations

import torch

from ..kernels.launch import cuda_kernels_available
from .._dtypes import FULL_PRECISION_DTYPES as _FULL_PRECISION
from .._validation import check_gate, check_like, check_x12
from ..activations import SILU, resolve_activation
from ..kernels.launch_config import forced_launcher
from . import torch_impl
from . import cuda_impl as kernels

__all__ = ["swiglu_forward", "swiglu_backward", "silu_mul_forward", "silu_mul_backward"]


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


def _kernel_launcher(x12: torch.Tensor, implementation: str | None, launcher):
    """The launcher to run the kernels with (None: the CuPy one), or False
    for the torch implementation."""
    if implementation not in (None, "torch", "kernels"):
        raise ValueError(f"implementation must be None, 'torch' or 'kernels', got {implementation!r}")
    if implementation == "torch":
        return False
    forced = forced_launcher()
    if launcher is not None or forced is not None:
        return launcher if launcher is not None else forced
    if implementation == "kernels" or (x12.is_cuda and cuda_kernels_available()):
        return None
    return False


def swiglu_forward(x12: torch.Tensor, out: torch.Tensor | None = None, *,
                   implementation: str | None = None, launcher=None, activation="silu") -> torch.Tensor:
    H = check_x12(x12)
    spec = resolve_activation(activation)
    if out is not None:
        check_like("out", out, (x12.shape[0], H), x12)
        if spec.interleaved and out.untyped_storage().data_ptr() == x12.untyped_storage().data_ptr():
            raise ValueError("out must not share x12's memory when activation is interleaved "
                             "(h cannot overwrite interleaved pairs in place)")
    return run_swiglu_forward(x12, out, implementation, launcher, spec)


def swiglu_backward(x12: torch.Tensor, dh: torch.Tensor, dx12_out: torch.Tensor | None = None, *,
                    implementation: str | None = None, launcher=None, activation="silu"
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    H = check_x12(x12)
    check_like("dh", dh, (x12.shape[0], H), x12)
    if dx12_out is not None:
        check_like("dx12_out", dx12_out, tuple(x12.shape), x12)
    return run_swiglu_backward(x12, dh, dx12_out, implementation, launcher, resolve_activation(activation))


def silu_mul_forward(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None, *,
                     implementation: str | None = None, launcher=None, activation="silu") -> torch.Tensor:
    check_gate(gate)
    shape = tuple(gate.shape)
    check_like("up", up, shape, gate, "gate")
    if out is not None:
        check_like("out", out, shape, gate, "gate")
    return run_silu_mul_forward(gate, up, out, implementation, launcher, _halves_only(activation))


def silu_mul_backward(gate: torch.Tensor, up: torch.Tensor, dh: torch.Tensor,
                      dgate_out: torch.Tensor | None = None, dup_out: torch.Tensor | None = None, *,
                      implementation: str | None = None, launcher=None, activation="silu"
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    check_gate(gate)
    shape = tuple(gate.shape)
    check_like("up", up, shape, gate, "gate")
    check_like("dh", dh, shape, gate, "gate")
    for name, t in (("dgate_out", dgate_out), ("dup_out", dup_out)):
        if t is not None:
            check_like(name, t, shape, gate, "gate")
    return run_silu_mul_backward(gate, up, dh, dgate_out, dup_out, implementation, launcher,
                                 _halves_only(activation))


def _halves_only(activation):
    """The spec for primitives on separate gate/up tensors (no packed layout)."""
    spec = resolve_activation(activation)
    if spec.interleaved:
        raise ValueError("activation: interleaved describes a packed x12; gate and up are separate tensors here")
    return spec


# The same four without the argument checks, for callers whose inputs are
# valid by construction (the Functions, after the API's one validation pass):
# the checks are a measurable part of a small call's host time.

def run_swiglu_forward(x12, out=None, implementation=None, launcher=None, activation=SILU) -> torch.Tensor:
    launcher = _kernel_launcher(x12, implementation, launcher)
    if launcher is not False:
        return kernels.launch_swiglu_forward(x12, out, launcher, activation=activation)
    return torch_impl.swiglu_forward_torch(x12, _or_new_if_half(out, (x12.shape[0], x12.shape[1] // 2), x12),
                                           activation)


def run_swiglu_backward(x12, dh, dx12_out=None, implementation=None, launcher=None, activation=SILU):
    launcher = _kernel_launcher(x12, implementation, launcher)
    if launcher is not False:
        return kernels.launch_swiglu_backward(x12, dh, dx12_out, launcher, activation=activation)
    return torch_impl.swiglu_backward_torch(x12, dh, _or_new(dx12_out, tuple(x12.shape), x12),
                                            h_out=_or_new(None, tuple(dh.shape), x12), activation=activation)


def run_silu_mul_forward(gate, up, out=None, implementation=None, launcher=None, activation=SILU) -> torch.Tensor:
    launcher = _kernel_launcher(gate, implementation, launcher)
    if launcher is not False:
        return kernels.launch_silu_mul_forward(gate, up, out, launcher, activation=activation)
    return torch_impl.silu_mul_forward_torch(gate, up, _or_new_if_half(out, gate.shape, gate), activation)


def run_silu_mul_backward(gate, up, dh, dgate_out=None, dup_out=None, implementation=None, launcher=None,
                          activation=SILU):
    launcher = _kernel_launcher(gate, implementation, launcher)
    if launcher is not False:
        return kernels.launch_silu_mul_backward(gate, up, dh, dgate_out, dup_out, launcher, activation=activation)
    shape = gate.shape
    return torch_impl.silu_mul_backward_torch(gate, up, dh, _or_new(dgate_out, shape, gate),
                                             _or_new(dup_out, shape, gate), activation)
