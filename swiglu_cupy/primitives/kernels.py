"""Kernel implementation of the primitives: layout checks, the vector-width
choice and the grid, then one call to a launcher (CuPy on a GPU, or the host
harness in CI). Tensors are passed as raw pointers, never copied."""
from __future__ import annotations

import torch

from .._launch import cupy_launcher, i64, pointer
from .._sources import vector_width

THREADS_PER_BLOCK = 256
MAX_GRID_Y = 65535  # CUDA's limit; rows beyond it are covered by a grid-stride loop


def _rows_view(t: torch.Tensor) -> torch.Tensor:
    """The kernels take a row stride but need unit inner stride."""
    return t if t.stride(1) == 1 or t.shape[1] <= 1 else t.contiguous()


def _leading_dim(t: torch.Tensor) -> int:
    # A single row (or size-1 dims) can report any stride; it is never used to step.
    return t.stride(0) if t.shape[0] > 1 else t.shape[1]


def choose_vector_width(dtype: torch.dtype, H: int, *tensors: torch.Tensor) -> int:
    """16-byte accesses when every row start is 16-byte aligned, else 1."""
    vec = vector_width(dtype)
    if H % vec:
        return 1
    for t in tensors:
        if t.data_ptr() % 16 or _leading_dim(t) % vec:
            return 1
    return vec


def launch_shape(M: int, H: int, vec: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """x threads cover the packs of one row (one pack each); y covers rows."""
    packs = -(-H // vec)
    block_x = min(128, -(-packs // 32) * 32)
    block_y = THREADS_PER_BLOCK // block_x
    grid_x = -(-packs // block_x)
    grid_y = min(-(-M // block_y), MAX_GRID_Y)
    return (grid_x, grid_y, 1), (block_x, block_y, 1)


def _launch(launcher, kind: str, vec: int, ref: torch.Tensor, M: int, H: int, args) -> None:
    if M == 0 or H == 0:
        return  # an empty grid is a CUDA launch error; there is nothing to do
    name = f"{kind}_{'vec' if vec > 1 else 'scalar'}"
    grid, block = launch_shape(M, H, vec)
    (launcher or cupy_launcher()).launch(name, ref.dtype, ref.device, grid, block, args)


def swiglu_forward(x12: torch.Tensor, out: torch.Tensor | None, launcher=None) -> torch.Tensor:
    x12 = _rows_view(x12)
    M, H = x12.shape[0], x12.shape[1] // 2
    h = torch.empty((M, H), dtype=x12.dtype, device=x12.device) if out is None else out
    target = _rows_view(h)
    vec = choose_vector_width(x12.dtype, H, x12, target)
    _launch(launcher, "swiglu_forward", vec, x12, M, H, [
        pointer(x12), pointer(target), i64(M), i64(H), i64(_leading_dim(x12)), i64(_leading_dim(target)),
    ])
    if target is not h:
        h.copy_(target)
    return h


def swiglu_backward(x12: torch.Tensor, dh: torch.Tensor, dx12_out: torch.Tensor | None,
                    launcher=None) -> tuple[torch.Tensor, torch.Tensor]:
    x12, dh = _rows_view(x12), _rows_view(dh)
    M, H = x12.shape[0], x12.shape[1] // 2
    dx12 = torch.empty_like(x12, memory_format=torch.contiguous_format) if dx12_out is None else dx12_out
    target = _rows_view(dx12)
    h = torch.empty((M, H), dtype=x12.dtype, device=x12.device)
    vec = choose_vector_width(x12.dtype, H, x12, dh, target, h)
    _launch(launcher, "swiglu_backward", vec, x12, M, H, [
        pointer(x12), pointer(dh), pointer(target), pointer(h), i64(M), i64(H),
        i64(_leading_dim(x12)), i64(_leading_dim(dh)), i64(_leading_dim(target)), i64(_leading_dim(h)),
    ])
    if target is not dx12:
        dx12.copy_(target)
    return dx12, h
