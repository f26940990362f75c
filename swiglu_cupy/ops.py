"""The primitives as registered torch ops, so torch.compile sees opaque calls
with known output shapes (``torch.ops.swiglu_cupy.*``).

Eager calls skip the custom-op dispatcher (a few microseconds per call) and go
straight to the primitives; both routes end in the same implementation.
"""
from __future__ import annotations

import torch

from . import primitives


@torch.library.custom_op("swiglu_cupy::swiglu_forward", mutates_args=())
def swiglu_forward_op(x12: torch.Tensor) -> torch.Tensor:
    return primitives.swiglu_forward(x12)


@swiglu_forward_op.register_fake
def _(x12):
    return x12.new_empty((x12.shape[0], x12.shape[1] // 2))


@torch.library.custom_op("swiglu_cupy::swiglu_forward_inplace", mutates_args=("x12",))
def swiglu_forward_inplace_op(x12: torch.Tensor) -> None:
    """Writes h over the gate half of x12 (no-grad path)."""
    primitives.swiglu_forward(x12, out=x12[:, : x12.shape[1] // 2])


@swiglu_forward_inplace_op.register_fake
def _(x12):
    return None


@torch.library.custom_op("swiglu_cupy::swiglu_backward", mutates_args=())
def swiglu_backward_op(x12: torch.Tensor, dh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return primitives.swiglu_backward(x12, dh)


@swiglu_backward_op.register_fake
def _(x12, dh):
    return torch.empty_like(x12, memory_format=torch.contiguous_format), dh.new_empty(dh.shape)


@torch.library.custom_op("swiglu_cupy::swiglu_backward_inplace", mutates_args=("x12",))
def swiglu_backward_inplace_op(x12: torch.Tensor, dh: torch.Tensor) -> torch.Tensor:
    """Writes dx12 over x12 and returns the recomputed h."""
    return primitives.swiglu_backward(x12, dh, dx12_out=x12)[1]


@swiglu_backward_inplace_op.register_fake
def _(x12, dh):
    return dh.new_empty(dh.shape)


def forward(x12: torch.Tensor) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return swiglu_forward_op(x12)
    return primitives.swiglu_forward(x12)


def forward_inplace(x12: torch.Tensor) -> torch.Tensor:
    """h written over the gate half of x12; returns that strided [M, H] view."""
    if torch.compiler.is_compiling():
        swiglu_forward_inplace_op(x12)
    else:
        primitives.swiglu_forward(x12, out=x12[:, : x12.shape[1] // 2])
    return x12[:, : x12.shape[1] // 2]


def backward(x12: torch.Tensor, dh: torch.Tensor, inplace: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if torch.compiler.is_compiling():
        if inplace:
            return x12, swiglu_backward_inplace_op(x12, dh)
        return swiglu_backward_op(x12, dh)
    return primitives.swiglu_backward(x12, dh, dx12_out=x12 if inplace else None)
