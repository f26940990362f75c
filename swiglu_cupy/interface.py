"""Layers 2 and 3: the autograd Function, the public functional API and the
eager reference.

Weight layout (xformers' packed ``w12``, Phi-3's ``gate_up_proj``):
    x   [..., D]
    w12 [2H, D]   rows 0..H-1 = gate (w1), rows H..2H-1 = up (w2)
    b12 [2H] or None
    w3  [O, H]    down projection
    b3  [O] or None
    y = (silu(x @ w1.T + b1) * (x @ w2.T + b2)) @ w3.T + b3

``SwiGLUFunction`` is only ever called through ``.apply()``: its forward
always saves the same tensors (x, w12, w3 and x12, never h), whatever
requires grad, so activation checkpointing in both modes sees identical
forwards (the bug that broke xformers' fused op).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from . import ops
from ._sources import SUPPORTED_DTYPES

__all__ = ["SwiGLUFunction", "swiglu", "swiglu_reference"]


def _linear_2d(inp: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """inp @ weight.T (+ bias), with the bias folded into the GEMM (addmm)."""
    if bias is None:
        return torch.mm(inp, weight.t(), out=out)
    return torch.addmm(bias, inp, weight.t(), out=out)


class SwiGLUFunction(torch.autograd.Function):
    """Fused SwiGLU: 3 GEMMs forward, 4 GEMMs + one elementwise pass backward.

    ``apply(x, w12, b12, w3, b3, recompute_gate_up=False, inplace_backward=False,
    inference=False)`` (positional):
    - ``recompute_gate_up``: save only x and recompute x12 in backward (one
      extra GEMM, D instead of D + 2H saved elements per token).
    - ``inplace_backward``: write dx12 over the saved x12 (one [M, 2H] buffer
      less); the graph can then be backpropagated only once.
    - ``inference``: pass ``not torch.is_grad_enabled()`` (``swiglu`` does).
    With grad disabled (no_grad / inference_mode) h is written over the gate
    half of x12 and the down projection reads that strided view: nothing is
    allocated besides x12 and the output, and nothing is saved.
    """

    @staticmethod
    def forward(ctx, x, w12, b12, w3, b3, recompute_gate_up=False, inplace_backward=False,
                inference=False):
        D, O = x.shape[-1], w3.shape[0]
        x2d = x.reshape(-1, D)
        x12 = _linear_2d(x2d, w12, b12)                       # [M, 2H]
        # `inference` comes from the caller's grad mode (forward itself runs
        # without grad), never from requires_grad: checkpoint recomputes, which
        # run with grad enabled, always take the saving path.
        h = ops.forward_inplace(x12) if inference else ops.forward(x12)
        # Allocate y in its final shape so the output is not a view.
        y = torch.empty((*x.shape[:-1], O), dtype=x12.dtype, device=x.device)
        _linear_2d(h, w3, b3, out=y.view(-1, O))
        if inference:
            return y  # no graph is recorded, so nothing can be saved
        if recompute_gate_up:
            ctx.save_for_backward(x2d, w12, b12, w3)
        else:
            ctx.save_for_backward(x2d, w12, w3, x12)
        ctx.x_shape = x.shape
        ctx.recompute_gate_up = recompute_gate_up
        ctx.inplace_backward = inplace_backward
        ctx.backward_done = False
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy, *_):
        if ctx.inplace_backward and ctx.backward_done:
            raise RuntimeError(
                "swiglu_cupy: this graph was built with inplace_backward=True, whose first "
                "backward overwrote the saved x12; a second backward (retain_graph=True) "
                "cannot run. Use inplace_backward=False to backpropagate more than once.")
        ctx.backward_done = True
        if ctx.recompute_gate_up:
            x2d, w12, b12, w3 = ctx.saved_tensors
            x12 = _linear_2d(x2d, w12, b12)                    # extra GEMM
        else:
            x2d, w12, w3, x12 = ctx.saved_tensors
        need_x, need_w12, need_b12, need_w3, need_b3 = ctx.needs_input_grad[:5]
        dy2d = dy.reshape(-1, w3.shape[0])
        dh = torch.mm(dy2d, w3)                                 # GEMM 1
        # In-place reuse is always safe for the recomputed x12 (nobody else holds it).
        inplace = ctx.inplace_backward or ctx.recompute_gate_up
        dx12, h = ops.backward(x12, dh, inplace)                # one fused pass
        dx = dw12 = db12 = dw3 = db3 = None
        if need_x:
            dx = torch.empty(ctx.x_shape, dtype=dx12.dtype, device=dx12.device)
            torch.mm(dx12, w12, out=dx.view(-1, x2d.shape[1]))   # GEMM 2
        if need_w12:
            dw12 = torch.mm(dx12.t(), x2d)                      # GEMM 3
        if need_b12:
            db12 = dx12.sum(0)
        if need_w3:
            dw3 = torch.mm(dy2d.t(), h)                         # GEMM 4
        if need_b3:
            db3 = dy2d.sum(0)
        return dx, dw12, db12, dw3, db3, None, None, None


def _check_tensor(name: str, t, optional: bool = False) -> None:
    if t is None and optional:
        return
    if not isinstance(t, torch.Tensor):
        kind = "a torch.Tensor or None" if optional else "a torch.Tensor"
        raise TypeError(f"{name} must be {kind}, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} must be a floating tensor of dtype float16, bfloat16, float32 "
                        f"or float64, got {t.dtype}")
    if t.is_meta:
        raise ValueError(f"{name} is a meta tensor (no data); materialize it first, e.g. "
                         "module.to_empty(device=...) and re-initialize the parameters")
    if name != "x" and any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)):
        raise ValueError(f"{name} is an expanded view (stride 0 along a dim of size > 1, strides "
                         f"{t.stride()}); pass a materialized tensor, e.g. {name}.contiguous()")


def _check_shapes(x, w12, b12, w3, b3) -> None:
    if x.dim() < 1:
        raise ValueError("x must have shape [..., D], got a 0-d tensor")
    if w12.dim() != 2:
        raise ValueError(f"w12 must be 2-D [2H, D], got shape {tuple(w12.shape)}")
    rows, D = w12.shape
    if rows == 0 or rows % 2:
        raise ValueError(f"w12 must have 2H rows (gate rows then up rows, H >= 1), got {rows} rows")
    if D != x.shape[-1]:
        raise ValueError(f"w12 must be [2H, D] with D = x.shape[-1] = {x.shape[-1]}, "
                         f"got shape {tuple(w12.shape)}")
    H = rows // 2
    if b12 is not None and tuple(b12.shape) != (rows,):
        raise ValueError(f"b12 must have shape ({rows},) = (2H,), got {tuple(b12.shape)}")
    if w3.dim() != 2 or w3.shape[1] != H:
        raise ValueError(f"w3 must be 2-D [O, H] with H = {H}, got shape {tuple(w3.shape)}")
    if b3 is not None and tuple(b3.shape) != (w3.shape[0],):
        raise ValueError(f"b3 must have shape ({w3.shape[0]},) = (O,), got {tuple(b3.shape)}")


def _check_same(tensors: dict, attr: str, error) -> None:
    ref_name, ref = "x", tensors["x"]
    for name, t in tensors.items():
        if t is not None and getattr(t, attr) != getattr(ref, attr):
            raise error(f"{name} must have the same {attr} as {ref_name} ({getattr(ref, attr)}), "
                        f"got {getattr(t, attr)}")


def swiglu(x: torch.Tensor, w12: torch.Tensor, b12: torch.Tensor | None,
           w3: torch.Tensor, b3: torch.Tensor | None, *,
           recompute_gate_up: bool = False, inplace_backward: bool = False) -> torch.Tensor:
    """Fused SwiGLU feed-forward: returns [..., O] (layout in the module doc).

    ``recompute_gate_up`` and ``inplace_backward`` are the memory modes of
    ``SwiGLUFunction``. Under ``torch.autocast`` the inputs are cast to the autocast dtype (as
    ``nn.Linear`` does), and the gradients flow back in each input's dtype.
    """
    tensors = {"x": x, "w12": w12, "b12": b12, "w3": w3, "b3": b3}
    for name, t in tensors.items():
        _check_tensor(name, t, optional=name in ("b12", "b3"))
    _check_same(tensors, "device", ValueError)
    _check_shapes(x, w12, b12, w3, b3)
    for name, flag in (("recompute_gate_up", recompute_gate_up), ("inplace_backward", inplace_backward)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    modes = (recompute_gate_up, inplace_backward, not torch.is_grad_enabled())
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        cast = [None if t is None else t.to(dtype) for t in tensors.values()]
        with torch.autocast(device_type=device_type, enabled=False):
            return SwiGLUFunction.apply(*cast, *modes)
    _check_same(tensors, "dtype", TypeError)
    return SwiGLUFunction.apply(x, w12, b12, w3, b3, *modes)


def swiglu_reference(x: torch.Tensor, w12: torch.Tensor, b12: torch.Tensor | None,
                     w3: torch.Tensor, b3: torch.Tensor | None) -> torch.Tensor:
    """Slow eager reference with the same layout (three torch ops)."""
    gate, up = F.linear(x, w12, b12).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w3, b3)
