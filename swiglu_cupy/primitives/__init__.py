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

from .._validation import check_gate, check_like, check_x12
from ..activations import resolve_activation
from .dispatch import run_silu_mul_backward, run_silu_mul_forward, run_swiglu_backward, run_swiglu_forward

__all__ = ["swiglu_forward", "swiglu_backward", "silu_mul_forward", "silu_mul_backward",
           "run_swiglu_forward", "run_swiglu_backward", "run_silu_mul_forward", "run_silu_mul_backward"]


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


