"""Row tiles (``tile_rows=``): the whole feed-forward of a long sequence, one
tile of rows at a time, inside ``SwiGLUFunction``, so that no tensor of
``tokens x H`` elements ever exists.

Forward, per tile: the gate/up GEMM into a ``[tile, 2H]`` workspace, the fused
activation (h over the gate half: the tile's x12 is never saved), the down
GEMM straight into the tile's rows of y. Saved for backward: x and the
weights only; with ``saved_x12="fp8"`` also the tiles' 8-bit x12 (written row
by row into one ``[M, R]`` uint8 tensor), which the user asked to keep, so the
backward reads it instead of recomputing it.

Backward, per tile: x12 recomputed (one GEMM; none with fp8), ``dh = dy @ w3``,
the fused backward pass (dx12 over the recomputed x12), the tile's rows of dx,
and its share of dW12 and dW3. 7 GEMMs per call in all (6 with fp8) against
6 untiled (7 with ``recompute_gate_up``). Weight and bias gradients of 16-bit
weights accumulate across tiles in float32 (``grads_fp32``, the default) and
are rounded once at the end, as the untiled GEMM rounds its fp32 sum once;
the accumulators cost 4 bytes per weight element while the backward runs.
``grads_fp32=False`` accumulates in the weights' dtype (one rounding per
tile) and saves those bytes.

Outside tracing and transforms, outputs go into preallocated buffers
(``out=``); tracers and torch.func get out=-free ops (the tiles' results are
concatenated)."""
from __future__ import annotations

import torch

from .._tile_size import HALF_DTYPES as _HALF, tile_slices
from .._torch_compat import is_transformed
from ..primitives import route
from ..primitives.saved_x12 import saved_row_bytes
from . import gemm as _gemm

__all__ = ["tiled_forward", "tiled_backward"]

def _workspace(tile: int, width: int, like: torch.Tensor, is_functional: bool) -> torch.Tensor | None:
    """One [tile, width] buffer for every tile of a call (None under tracing):
    made once, not per tile (on the CPU a fresh large buffer costs its page faults)."""
    return None if is_functional else like.new_empty(tile, width)


def _rows_of(workspace: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    """The first rows of the workspace, as many as the tile has (contiguous)."""
    return None if workspace is None else workspace[:rows.stop - rows.start]


def tiled_forward(x2d, w1, b1, w2, b2, w3, b3, activation, tile: int, inference: bool,
                  is_functional: bool, saved_x12_fp8: bool, out_shape=None):
    """(y, saved): y [M, O] or in ``out_shape`` (allocated so, not a view);
    ``saved`` is the 8-bit x12 [M, R] with ``saved_x12_fp8`` (not under
    ``inference``), else an empty tensor (nothing of x12 is kept)."""
    M, H, O = x2d.shape[0], w3.shape[1], w3.shape[0]
    fp8 = saved_x12_fp8 and not inference
    y = None if is_functional else torch.empty(out_shape or (M, O), dtype=x2d.dtype, device=x2d.device)
    y_rows = None if y is None else y.view(M, O)
    saved = None
    if fp8 and not is_functional:
        saved = torch.empty(M, saved_row_bytes(H, activation.interleaved), dtype=torch.uint8, device=x2d.device)
    y_parts, saved_parts = [], []
    workspace = _workspace(tile, 2 * H, x2d, is_functional)
    for rows in tile_slices(M, tile):
        x12 = _gemm.gate_up(x2d[rows], w1, b1, w2, b2, is_functional, _rows_of(workspace, rows))
        if fp8:
            h, saved_tile = route.forward_fp8(x12, activation)
            if is_functional:
                saved_parts.append(saved_tile)
            else:
                saved[rows].copy_(saved_tile)
            del saved_tile
        else:  # the tile's x12 is a workspace: h may take its gate half (not under tracing / torch.func)
            h = route.forward(x12, activation) if is_functional else route.forward_inplace(x12, activation)
        if is_functional:
            y_parts.append(_gemm.linear_2d(h, w3, b3))
        else:
            _gemm.linear_2d(h, w3, b3, out=y_rows[rows])
        del x12, h  # views of the workspace (h: its gate half), reused by the next tile
    if is_functional:
        y = torch.cat(y_parts)
        y = y if out_shape is None else y.view(out_shape)
        saved = torch.cat(saved_parts) if fp8 else None
    return y, (saved if saved is not None else x2d.new_empty(M, 0))  # [M, 0]: rows for a vmap rule to split


def tiled_backward(dy2d, x2d, w1, b1, w2, b2, w3, saved, activation, tile: int, needs, grads_fp32: bool,
                   x_shape):
    """(dx, dw1, db1, dw2, db2, dw3, db3) of the tiled forward; ``saved`` as it
    returned (the 8-bit x12, or empty: recompute)."""
    need_x, need_w1, need_b1, need_w2, need_b2, need_w3, need_b3 = needs
    functional = _gemm.functional(dy2d)
    M, H = x2d.shape[0], w3.shape[1]
    acc_dtype = torch.float32 if grads_fp32 and x2d.dtype in _HALF else x2d.dtype
    dx_weights = _gemm.input_grad_weights(w1, w2, x2d.dtype)
    dx = None
    if need_x and not functional:
        dx = torch.empty(x_shape, dtype=x2d.dtype, device=x2d.device)
    dx_rows = None if dx is None else dx.view(-1, x2d.shape[1])
    dx_parts, dw12, db12, dw3 = [], None, None, None
    fp8 = saved.numel() > 0
    x12_workspace = None if fp8 else _workspace(tile, 2 * H, x2d, functional)
    dh_workspace = _workspace(tile, H, x2d, functional)
    for rows in tile_slices(M, tile):
        x_t, dy_t = x2d[rows], dy2d[rows]
        dh = torch.mm(dy_t, w3) if dh_workspace is None else torch.mm(dy_t, w3, out=_rows_of(dh_workspace, rows))
        if fp8:
            dx12, h = route.backward_fp8(saved[rows], dh, activation)
        else:  # the recompute (one GEMM), into the workspace; dx12 is written over it
            x12 = _gemm.gate_up(x_t, w1, b1, w2, b2, functional, _rows_of(x12_workspace, rows))
            dx12, h = route.backward(x12, dh, not functional and not is_transformed(dh), activation)
            del x12
        if need_x:
            part = _gemm.input_grad_rows(dx12, *dx_weights, None if functional else dx_rows[rows])
            if functional:
                dx_parts.append(part)
        if need_w1 or need_w2:
            dw12 = _gemm.accumulate_mm(dw12, dx12.t(), x_t, acc_dtype, functional)
        if need_b1 or need_b2:
            part = dx12.sum(0, dtype=acc_dtype)
            db12 = part if db12 is None else (db12 + part if functional else db12.add_(part))
        if need_w3:
            dw3 = _gemm.accumulate_mm(dw3, dy_t.t(), h, acc_dtype, functional)
        del dh, dx12, h  # h is the tile's own: freed before the next one is made
    if need_x and functional:
        dx = torch.cat(dx_parts).view(x_shape)
    dw12, db12, dw3 = (None if g is None else g.to(x2d.dtype) for g in (dw12, db12, dw3))
    dw1, dw2 = (dw12, None) if w2 is None or dw12 is None else (dw12[:H], dw12[H:])
    db1, db2 = (db12, None) if w2 is None or db12 is None else (db12[:H], db12[H:])
    db3 = dy2d.sum(0) if need_b3 else None
    return dx, dw1, db1, dw2, db2, dw3, db3
