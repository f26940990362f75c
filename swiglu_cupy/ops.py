"""The primitives as registered torch ops, so torch.compile sees opaque calls
with known output shapes (``torch.ops.swiglu_cupy.*``).

Each op wraps one plain function below. Eager calls use that function
directly (the custom-op dispatcher costs ~13 us per call), compiled code calls
the op: one implementation either way.
"""
from __future__ import annotations

import torch

from . import primitives


def _gate_half(x12: torch.Tensor) -> torch.Tensor:
    return x12[:, : x12.shape[1] // 2]


def _forward(x12: torch.Tensor) -> torch.Tensor:
    return primitives.swiglu_forward(x12)


def _forward_inplace(x12: torch.Tensor) -> None:
    """Writes h over the gate half of x12 (no-grad path)."""
    primitives.swiglu_forward(x12, out=_gate_half(x12))


def _backward(x12: torch.Tensor, dh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return primitives.swiglu_backward(x12, dh)


def _backward_inplace(x12: torch.Tensor, dh: torch.Tensor) -> torch.Tensor:
    """Writes dx12 over x12 and returns the recomputed h."""
    return primitives.swiglu_backward(x12, dh, dx12_out=x12)[1]


swiglu_forward_op = torch.library.custom_op("swiglu_cupy::swiglu_forward", _forward, mutates_args=())
swiglu_forward_inplace_op = torch.library.custom_op(
    "swiglu_cupy::swiglu_forward_inplace", _forward_inplace, mutates_args=("x12",))
swiglu_backward_op = torch.library.custom_op("swiglu_cupy::swiglu_backward", _backward, mutates_args=())
swiglu_backward_inplace_op = torch.library.custom_op(
    "swiglu_cupy::swiglu_backward_inplace", _backward_inplace, mutates_args=("x12",))


@swiglu_forward_op.register_fake
def _(x12):
    return x12.new_empty((x12.shape[0], x12.shape[1] // 2))


@swiglu_forward_inplace_op.register_fake
def _(x12):
    return None


@swiglu_backward_op.register_fake
def _(x12, dh):
    return torch.empty_like(x12, memory_format=torch.contiguous_format), dh.new_empty(dh.shape)


@swiglu_backward_inplace_op.register_fake
def _(x12, dh):
    return dh.new_empty(dh.shape)


def forward(x12: torch.Tensor) -> torch.Tensor:
    return (swiglu_forward_op if torch.compiler.is_compiling() else _forward)(x12)


def forward_inplace(x12: torch.Tensor) -> torch.Tensor:
    """h written over the gate half of x12; returns that strided [M, H] view."""
    (swiglu_forward_inplace_op if torch.compiler.is_compiling() else _forward_inplace)(x12)
    return _gate_half(x12)


def backward(x12: torch.Tensor, dh: torch.Tensor, inplace: bool) -> tuple[torch.Tensor, torch.Tensor]:
    compiling = torch.compiler.is_compiling()
    if inplace:
        return x12, (swiglu_backward_inplace_op if compiling else _backward_inplace)(x12, dh)
    return (swiglu_backward_op if compiling else _backward)(x12, dh)
