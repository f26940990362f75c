"""The feed-forward's GEMMs (cuBLAS / the CPU BLAS through torch), laid out
for the fused Function: x12 = [gate | up] as one buffer, the down projection
into the output's final shape, and dx from the two halves of dx12.

Outside tracing and transforms, outputs are written into preallocated
buffers (``out=``); tracers and torch.func get out=-free ops (``functional``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .._torch_compat import is_functorch_wrapped


def functional(t: torch.Tensor) -> bool:
    """Use out=-free ops: a tracer (torch.compile / torch.export / ONNX) records
    this call, or ``t`` carries a torch.func transform (out= buffers cannot
    hold a vmap batch)."""
    return torch.compiler.is_compiling() or is_functorch_wrapped(t)


def linear_2d(inp: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """inp @ weight.T (+ bias), with the bias folded into the GEMM (addmm)."""
    if out is None:
        return F.linear(inp, weight, bias)  # addmm, with the transpose done in C++
    if bias is None:
        return torch.mm(inp, weight.T, out=out)  # .T: half the binding cost of .t() on a 2-D weight
    return torch.addmm(bias, inp, weight.T, out=out)


def gate_up(x2d: torch.Tensor, w1: torch.Tensor, b1, w2, b2, is_functional: bool,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """x12 = [gate | up] as one [M, 2H] tensor (into ``out`` when given, outside
    tracing). Packed weights (``w2 is None``: ``w1`` is w12) take one GEMM;
    separate ones write their halves of one buffer, so no weight is ever
    concatenated."""
    if w2 is None:
        # No out (the common call): straight to F.linear, as linear_2d would (a frame less).
        return F.linear(x2d, w1, b1) if out is None or is_functional else linear_2d(x2d, w1, b1, out=out)
    if is_functional:
        return torch.cat([linear_2d(x2d, w1, b1), linear_2d(x2d, w2, b2)], dim=1)
    x12 = out if out is not None else x2d.new_empty(x2d.shape[0], 2 * w1.shape[0])
    gate, up = x12.chunk(2, 1)  # one call for both halves' views (slicing costs ~1.5 us each)
    linear_2d(x2d, w1, b1, out=gate)
    linear_2d(x2d, w2, b2, out=up)
    return x12


def down(h: torch.Tensor, w3: torch.Tensor, b3, lead, is_functional: bool) -> torch.Tensor:
    """y = h @ w3.T + b3 with x's leading dims ``lead`` (None: 2-D x, y is the
    GEMM's own output), never a view (FSDP2 warns about a view output)."""
    if lead is None:
        return F.linear(h, w3, b3)  # as linear_2d without out (a frame less)
    if b3 is None:
        # torch folds the leading dims in C++ and returns the product as an ``_unsafe_view`` (no
        # view): ~3.5 us less at a decode-sized call than an allocated y and a GEMM into it.
        return F.linear(h.view(*lead, h.shape[1]), w3)
    if is_functional:
        return linear_2d(h, w3, b3).view(*lead, w3.shape[0])
    # With a bias, F.linear of an N-D input returns a view: y is allocated in its shape instead.
    y = h.new_empty(*lead, w3.shape[0])  # sizes as separate ints: a tuple costs torch's argument parser ~1 us more
    linear_2d(h, w3, b3, out=y.view(-1, w3.shape[0]))
    return y


def input_grad_weights(w1: torch.Tensor, w2, dtype: torch.dtype) -> tuple:
    """The weights dx reads: ``(w12, None)`` packed; separate ones as they are,
    except in 16-bit dtypes: there the sum of two GEMMs would round dx twice,
    so one GEMM reads a transient ``[w1; w2]`` and dx is rounded once, as with
    packed weights."""
    if w2 is not None and dtype in (torch.float16, torch.bfloat16):
        return torch.cat([w1, w2]), None
    return w1, w2


def input_grad_rows(dx12: torch.Tensor, w1: torch.Tensor, w2, out: torch.Tensor | None) -> torch.Tensor:
    """dx [M, D] = dx12 @ w12 (or dgate @ w1 + dup @ w2), into ``out`` when given;
    ``(w1, w2)`` from ``input_grad_weights``."""
    if w2 is None:
        return torch.mm(dx12, w1) if out is None else torch.mm(dx12, w1, out=out)
    dgate, dup = dx12.chunk(2, 1)  # one call for both halves' views (slicing costs ~1.5 us each)
    if out is None:
        return torch.mm(dgate, w1).addmm_(dup, w2)  # the sum in place: no second [M, D] allocation
    torch.mm(dgate, w1, out=out)
    return out.addmm_(dup, w2)


def input_grad(dx12: torch.Tensor, w1: torch.Tensor, w2, x_shape) -> torch.Tensor:
    """dx = dx12 @ w12 in x's shape (weights as ``input_grad_weights`` takes them)."""
    w1, w2 = input_grad_weights(w1, w2, dx12.dtype)
    if len(x_shape) == 2:  # the GEMM's own output has x's shape
        return input_grad_rows(dx12, w1, w2, None)
    if functional(dx12):
        return input_grad_rows(dx12, w1, w2, None).view(x_shape)
    dx = dx12.new_empty(*x_shape)
    input_grad_rows(dx12, w1, w2, dx.view(-1, w1.shape[1]))
    return dx


#: torch.mm(..., out_dtype=torch.float32) of 16-bit operands: CUDA only (torch's ``aten::mm.dtype``).
_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype")


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b of 16-bit operands as a float32 result (fp32 accumulation, no rounding):
    cuBLAS writes fp32 directly; elsewhere the operands are widened (exact)."""
    if a.is_cuda and _MM_OUT_DTYPE:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


def accumulate_mm(acc: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor, acc_dtype: torch.dtype,
                  is_functional: bool) -> torch.Tensor:
    """acc + a @ b in ``acc_dtype`` (None: the first term), in place outside tracing."""
    part_dtype_ok = a.dtype == acc_dtype
    if acc is None:
        return torch.mm(a, b) if part_dtype_ok else _mm_fp32(a, b)
    if part_dtype_ok:
        return acc + torch.mm(a, b) if is_functional else acc.addmm_(a, b)
    part = _mm_fp32(a, b)
    return acc + part if is_functional else acc.add_(part)
