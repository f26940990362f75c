"""Mixture-of-experts: the GLU feed-forward of E experts over tokens grouped by expert.

Layout (Hugging Face's packed 3-D expert weights; ``transposed=True`` is GPT-OSS's):

    x_sorted  [S, D]      routed rows, grouped by expert (rows of expert e are
                          ``offsets[e-1]:offsets[e]``)
    offsets   [E] int32   cumulative group ends, as torch.nn.functional.grouped_mm takes them
    w12       [E, 2I, D]  gate/up rows in the activation's layout (halves: gate first;
                          interleaved: g0, u0, g1, ...);  transposed: [E, D, 2I]
    b12       [E, 2I] or None
    w3        [E, D, I]   down projection;  transposed: [E, I, D]
    b3        [E, D] or None
    routing_weights [S] or None (any floating dtype)

``grouped_experts_unpacked`` takes gate and up as two stacks, w1 and w2 [E, I, D]
(transposed: [E, D, I]); inside, ``w12`` is then the gate stack and ``w_up`` the up
stack, and the two GEMMs fill the halves of one x12 (the loop writes them in place;
grouped_mm, which has no out=, returns each half, copied in: a transient [S, I]).

    y[r] = w[r] * (act(x[r] @ W12[e].T + b12[e]) @ W3[e].T + b3[e])   for row r of expert e

The routing weight multiplies the down output, bias included
(``w * (h W3 + b3)``, which differs from ``(w * h) W3 + b3``), and its
gradient ``dy . (h W3 + b3)`` is returned, so it reaches the router. ``y`` has
the dtype torch's promotion gives ``z * w`` (a bf16 expert output times fp32
routing weights is fp32, as in Hugging Face's experts).

One apply-only Function (``MoEExpertsFunction``) holds the graph. It
saves its inputs and x12 (never h or the down output), the same tensors
whatever requires grad, so checkpoint recomputes match;
``recompute_gate_up`` drops x12 and recomputes it in backward (one grouped
GEMM more). Two ways in:

- rows (``grouped_experts``): the caller's ``x_sorted`` [S, D] is the only
  copy of the inputs there is, so it is saved as given (a reference: no
  new memory where the caller keeps it) with x12: D + 2I elements per row;
- tokens (``routed_experts``, the Hugging Face experts): ``x`` [T, D] and
  ``perm`` [T*K] (``tokens``: row r is token ``perm[r] // K``). The forward
  gathers the rows itself, and the backward gathers them again for the
  gate/up weight gradient, so each token's input is saved once: D + K*2I
  elements per token, plus ``perm`` (int32) and the routing weights in
  token order (the router's own tensor) instead of the three index vectors
  and a gathered copy of the weights. With ``combine_dtype`` the output is
  each token's K rows summed (``tokens.sum_per_token``), and dx is each
  token's K row gradients summed the same way: gathers, no scatter-add.

``saved_x12="fp8"`` saves x12 as float8 e4m3 with a float32 scale per 128
columns (``primitives.saved_x12``: one uint8 tensor in x12's place), either
way in.

The GEMMs are ``torch.nn.functional.grouped_mm`` (2-D x 3-D, int32 offsets)
where it runs: floating dtypes it takes, CUDA compute capability 8.0+, and
row strides and base pointers 16-byte aligned (its CPU kernel refuses the
rest). Elsewhere (float64, odd widths, older GPUs) each expert's rows take a
plain GEMM, after one device-to-host copy of the offsets (as does a grouped
path that failed its first-use self-check, ``moe/grouped_path_check.py``).
The activation is one fused launch over all routed rows
(``primitives.dispatch.run_swiglu_forward``), whatever E is; the backward is one
fused pass too.

Expert parallelism: rows past ``offsets[-1]`` may be an expert-parallel
sentinel tail (ids of experts held by other ranks): the private entry
``run_experts(..., tail=True)`` gives them zero output and zero gradients
without a GEMM. The public ``grouped_experts`` requires offsets[-1] == S.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .. import _validation as check
from .._dtypes import FULL_PRECISION_DTYPES
from .._autograd import LeanApplyFunction, first_order_backward, graph_needed, mark_saved_only, under_autocast
from .._tile_size import HALF_DTYPES, resolve_tile_rows, tile_slices
from ..activations import GLUActivation, resolve_activation, resolve_halves_activation
from ..primitives import dispatch
from ..primitives.ops import spec_args
from ..primitives.saved_x12 import saved_row_bytes
from . import grouped_path_check
from .tokens import TokenRows

__all__ = ["grouped_experts", "grouped_experts_unpacked", "MoEExpertsFunction", "run_experts", "grouped_mm_runs"]

_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ---- the groups: grouped_mm or a loop of GEMMs ----------------------------------------------

@functools.lru_cache(maxsize=None)
def _cuda_grouped_mm_device(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 0)


def _aligned(t: torch.Tensor) -> bool:
    """grouped_mm's layout rule: base pointer and every non-unit stride of a
    dim longer than 1 a multiple of 16 bytes."""
    size = t.element_size()
    return t.data_ptr() % 16 == 0 and all(
        (st * size) % 16 == 0 for st, n in zip(t.stride(), t.shape) if st != 1 and n > 1)


def grouped_mm_runs(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether torch.nn.functional.grouped_mm takes these operands (``x`` the
    grouped rows, ``weights`` the 3-D experts); every other operand the op
    builds is a fresh contiguous tensor whose width is one of the weights'."""
    if not hasattr(F, "grouped_mm") or x.dtype not in _GROUPED_MM_DTYPES:
        return False
    if x.is_cuda and not _cuda_grouped_mm_device(x.device.index if x.device.index is not None
                                                 else torch.cuda.current_device()):
        return False
    if not (x.is_cuda or x.device.type == "cpu"):
        return False
    size = x.element_size()
    widths = {x.shape[1], *(n for w in weights for n in w.shape[1:])}
    return all((n * size) % 16 == 0 for n in widths) and _aligned(x) and all(_aligned(w) for w in weights)


def _grouped(x, w12, w3, w_up, activation: GLUActivation) -> bool:
    """grouped_mm for this call: where it runs and the grouped path passed its
    first-use self-check (``moe.grouped_path_check``); else the per-expert loop."""
    weights = (w12, w3) if w_up is None else (w12, w_up, w3)
    return grouped_mm_runs(x, *weights) and grouped_path_check.grouped_path_trusted(
        x, activation, _forward_body, _backward_body)


class _Groups:
    """The row groups of one call: device offsets, and (loop mode) the host bounds."""

    def __init__(self, offsets: torch.Tensor, rows: int, grouped: bool, tail: bool):
        self.offsets = offsets
        self.rows = rows
        self.experts = offsets.shape[0]
        self.grouped = grouped
        self.tail = tail
        self.bounds = None
        if not grouped:  # one device-to-host copy; the loop needs the bounds on the host
            ends = offsets.tolist()
            self.bounds = list(zip([0, *ends[:-1]], ends))

    def row_expert(self) -> torch.Tensor:
        """The expert of each row ([S] int64; tail rows get the last expert)."""
        rows = torch.arange(self.rows, device=self.offsets.device, dtype=self.offsets.dtype)
        return torch.searchsorted(self.offsets, rows, right=True).clamp_(max=self.experts - 1)

    def zero_tail(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` [S, ...] with the sentinel-tail rows (past offsets[-1]) zeroed, in place."""
        if self.tail and self.rows:
            rows = torch.arange(self.rows, device=t.device)
            t.masked_fill_((rows >= self.offsets[-1]).view(-1, *([1] * (t.dim() - 1))), 0)
        return t

    def segment_sums(self, t: torch.Tensor) -> torch.Tensor:
        """[E, N]: the sum of each group's rows of ``t`` [S, N] (fp32 accumulation, deterministic)."""
        if self.bounds is not None:
            return torch.stack([t[s:e].sum(0) for s, e in self.bounds])
        lengths = torch.diff(self.offsets, prepend=self.offsets.new_zeros(1))
        if self.tail:
            lengths = torch.cat([lengths, (self.rows - self.offsets[-1]).view(1)])
        wide = t if t.dtype in FULL_PRECISION_DTYPES else t.float()
        return torch.segment_reduce(wide, "sum", lengths=lengths, axis=0)[:self.experts].to(t.dtype)


def _rows_linear(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, groups: _Groups,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """[S, N]: the rows of expert e times ``b[e]`` ([E, K, N], any strides), plus ``bias[e]``,
    in ``out`` where given (any row stride: a half of x12). Rows past the last group (a
    sentinel tail) are left unspecified."""
    if groups.grouped:
        result = F.grouped_mm(a, b, offs=groups.offsets)  # grouped_mm has no out=
        result = result if out is None else out.copy_(result)
        if bias is not None:  # grouped_mm's bias= is refused on CPU
            result.add_(bias.index_select(0, groups.row_expert()))
        return result
    out = a.new_empty(a.shape[0], b.shape[2]) if out is None else out
    for e, (s, t) in enumerate(groups.bounds):
        if t > s:
            if bias is None:
                torch.mm(a[s:t], b[e], out=out[s:t])
            else:
                torch.addmm(bias[e], a[s:t], b[e], out=out[s:t])
    return out


def _weight_grad(a: torch.Tensor, b: torch.Tensor, groups: _Groups) -> torch.Tensor:
    """[E, K, N]: ``a_e.T @ b_e`` for the rows of each expert (zeros for an empty one)."""
    if groups.grouped:
        return F.grouped_mm(a.t(), b, offs=groups.offsets)
    out = a.new_zeros((groups.experts, a.shape[1], b.shape[1]))
    for e, (s, t) in enumerate(groups.bounds):
        if t > s:
            torch.mm(a[s:t].t(), b[s:t], out=out[e])
    return out


def _kn(w: torch.Tensor, transposed: bool) -> torch.Tensor:
    """The weight as [E, K, N] (input width first): a view."""
    return w if transposed else w.transpose(1, 2)


# Separate gate/up weights (``w_up`` not None: ``w12`` holds the gate weight, [E, I, D] or
# transposed [E, D, I], and ``w_up`` the up weight alike): the gate and up GEMMs write the
# two halves of one x12, so x12, the kernels and what is saved are the packed layout's,
# and the weights are never concatenated.

def _gate_up_rows(rows, w12, w_up, b12, transposed: bool, groups: _Groups) -> torch.Tensor:
    """x12 [S, 2I]: the rows' gate/up projection (one GEMM, or one per half)."""
    if w_up is None:
        return _rows_linear(rows, _kn(w12, transposed), b12, groups)
    gate, up = _kn(w12, transposed), _kn(w_up, transposed)
    I = gate.shape[2]
    x12 = rows.new_empty(rows.shape[0], 2 * I)
    _rows_linear(rows, gate, None if b12 is None else b12[:, :I], groups, out=x12[:, :I])
    _rows_linear(rows, up, None if b12 is None else b12[:, I:], groups, out=x12[:, I:])
    return x12


def _gate_up_input_grad(dx12, w12, w_up, transposed: bool, groups: _Groups) -> torch.Tensor:
    """dx [S, D] = dx12 @ W12[e] (separate weights: dgate @ Wgate[e] + dup @ Wup[e])."""
    if w_up is None:
        return _rows_linear(dx12, _kn(w12, transposed).transpose(1, 2), None, groups)
    I = dx12.shape[1] // 2
    dx = _rows_linear(dx12[:, :I], _kn(w12, transposed).transpose(1, 2), None, groups)
    return dx.add_(_rows_linear(dx12[:, I:], _kn(w_up, transposed).transpose(1, 2), None, groups))


def _gate_up_weight_grads(rows, dx12, separate: bool, transposed: bool, groups: _Groups) -> tuple:
    """(dW12, None), or with separate weights (dWgate, dWup): each in its weight's layout."""
    I = dx12.shape[1] // 2
    halves = (dx12[:, :I], dx12[:, I:]) if separate else (dx12,)
    grads = tuple(_weight_grad(rows, d, groups) if transposed else _weight_grad(d, rows, groups) for d in halves)
    return grads if separate else (grads[0], None)


def _row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-row dot product, [S]: accumulated in fp32 (fp64 for float64), the
    products and the result in the storage dtype, as the eager router
    gradient ``(dy * z).sum(-1)`` has them (widening both operands first
    costs two more passes over [S, I])."""
    return torch.linalg.vecdot(a, b)


# ---- the computation (plain bodies; the registered ops below wrap them) --------------------

def _token_rows(perm, top_k: int) -> TokenRows | None:
    return None if perm is None else TokenRows(perm, top_k)


def _forward_body(x, offsets, w12, b12, w3, b3, rw, activation: GLUActivation, transposed: bool, tail: bool,
                  perm, top_k: int, combine_dtype, fp8: bool = False, w_up=None):
    tokens = _token_rows(perm, top_k)
    rows = x if tokens is None else tokens.gather(x)                         # the routed rows, not saved
    if tokens is not None and rw is not None:
        rw = tokens.slots_to_rows(rw)
    groups = _Groups(offsets, rows.shape[0], _grouped(x, w12, w3, w_up, activation), tail)
    x12 = _gate_up_rows(rows, w12, w_up, b12, transposed, groups)            # GEMM 1 (2 separate)
    del rows  # the gathered copy is not kept
    if fp8:  # h and the 8-bit saved x12 (returned in x12's place) in one pass
        h, x12 = dispatch.run_swiglu_forward_fp8(x12, None, None, activation)
    else:
        # One launch over every row; the buffer lets the CPU path work in cache-sized row blocks.
        h = dispatch.run_swiglu_forward(x12, x12.new_empty(x12.shape[0], x12.shape[1] // 2), None, None, activation)
    z = _rows_linear(h, _kn(w3, transposed), b3, groups)                     # GEMM 2
    if rw is not None:
        w = rw.unsqueeze(1)
        z = z.mul_(w) if torch.result_type(z, w) == z.dtype else z * w
    z = groups.zero_tail(z)
    return (z if combine_dtype is None else tokens.sum_per_token(z, combine_dtype)), x12


def _backward_body(dy, x, x12, offsets, w12, b12, w3, b3, rw, activation: GLUActivation, transposed: bool,
                   tail: bool, needs: tuple, perm, top_k: int, combine_dtype, fp8: bool = False, w_up=None):
    """(dx, dw12, db12, dw3, db3, drw, dw_up); ``need_w12`` covers ``w_up`` too."""
    need_x, need_w12, need_b12, need_w3, need_b3, need_rw = needs
    # Autograd may hand any strides (y.sum().backward(): an expanded, zero-stride dy),
    # which grouped_mm refuses; a no-op for the usual contiguous gradient.
    dy = dy.contiguous()
    tokens = _token_rows(perm, top_k)
    if tokens is not None:
        if combine_dtype is not None:
            dy = tokens.gather(dy)                                           # each row's token gradient
        if rw is not None:
            rw = tokens.slots_to_rows(rw)
    groups = _Groups(offsets, x.shape[0] if tokens is None else perm.shape[0],
                     _grouped(x, w12, w3, w_up, activation), tail)
    # The routed rows, gathered again from the tokens only where a GEMM reads them.
    rows = x if tokens is None else None
    recomputed = x12 is None
    if recomputed:
        rows = rows if rows is not None else tokens.gather(x)
        x12 = _gate_up_rows(rows, w12, w_up, b12, transposed, groups)       # recompute_gate_up: GEMM
    dtype = x.dtype
    w = None if rw is None else rw.unsqueeze(1)
    dyw = dy.to(dtype) if w is None else (dy * w).to(dtype)                  # d(down output), one rounding
    dy = dy.to(dtype)
    w3_t = _kn(w3, transposed).transpose(1, 2)                               # [E, D, I]
    g = None
    if w is not None and need_rw:
        g = _rows_linear(dy, w3_t, None, groups)                             # GEMM: dy @ W3 (unweighted)
        dh = (g * w).to(dtype)
    else:
        dh = _rows_linear(dyw, w3_t, None, groups)                           # GEMM: dyw @ W3
    # One fused pass: dx12 and the recomputed h. A recomputed x12 is ours to
    # overwrite; else a buffer is given (the CPU path then writes it in cache-sized
    # row blocks instead of joining two halves afterwards).
    if fp8:  # x12 is the 8-bit saved tensor
        dx12, h = dispatch.run_swiglu_backward_fp8(x12, dh, None, None, activation)
    else:
        dx12, h = dispatch.run_swiglu_backward(x12, dh, x12 if recomputed else torch.empty_like(x12), None, None,
                                          activation)
    dx = dw12 = db12 = dw3 = db3 = drw = dw_up = None
    if g is not None:
        drw = _row_dot(g, h)                                                 # dy . (h W3 + b3)
        if b3 is not None:
            drw = drw + _row_dot(dy, b3.index_select(0, groups.row_expert()))
        drw = groups.zero_tail(drw.to(rw.dtype))
        if tokens is not None:
            drw = tokens.rows_to_slots(drw)
    if need_w3:
        dw3 = _weight_grad(h, dyw, groups) if transposed else _weight_grad(dyw, h, groups)
    if need_b3:
        db3 = groups.segment_sums(dyw)
    if need_x:
        dx = groups.zero_tail(_gate_up_input_grad(dx12, w12, w_up, transposed, groups))
        if tokens is not None:
            dx = tokens.sum_per_token(dx, x.dtype)                           # each token's K row gradients
    if need_w12:
        rows = rows if rows is not None else tokens.gather(x)
        dw12, dw_up = _gate_up_weight_grads(rows, dx12, w_up is not None, transposed, groups)
    if need_b12:
        db12 = groups.segment_sums(dx12)
    return dx, dw12, db12, dw3, db3, drw, dw_up


# ---- registered ops: what torch.compile / torch.export trace --------------------------------

@torch.library.custom_op("swiglu_cupy::moe_experts_forward", mutates_args=())
def _forward_op(x: torch.Tensor, offsets: torch.Tensor, w12: torch.Tensor, b12: torch.Tensor | None,
                w3: torch.Tensor, b3: torch.Tensor | None, rw: torch.Tensor | None, kind: str,
                limit: float | None, alpha: float, up_offset: float, interleaved: bool, transposed: bool,
                tail: bool, perm: torch.Tensor | None, top_k: int,
                combine_dtype: torch.dtype | None, fp8: bool = False,
                w_up: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    spec = GLUActivation(kind, limit, alpha, up_offset, interleaved)
    return _forward_body(x, offsets, w12, b12, w3, b3, rw, spec, transposed, tail, perm, top_k, combine_dtype, fp8,
                         w_up)


@_forward_op.register_fake
def _(x, offsets, w12, b12, w3, b3, rw, kind, limit, alpha, up_offset, interleaved, transposed, tail, perm, top_k,
      combine_dtype, fp8=False, w_up=None):
    two_i = (w12.shape[2] if transposed else w12.shape[1]) * (1 if w_up is None else 2)
    rows = x.shape[0] if perm is None else perm.shape[0]
    if combine_dtype is not None:
        y = x.new_empty(x.shape[0], x.shape[1], dtype=combine_dtype)
    else:
        y = x.new_empty(rows, x.shape[1], dtype=x.dtype if rw is None else torch.promote_types(x.dtype, rw.dtype))
    if fp8:
        return y, x.new_empty(rows, saved_row_bytes(two_i // 2, interleaved), dtype=torch.uint8)
    return y, x.new_empty(rows, two_i)


@torch.library.custom_op("swiglu_cupy::moe_experts_backward", mutates_args=())
def _backward_op(dy: torch.Tensor, x: torch.Tensor, x12: torch.Tensor | None, offsets: torch.Tensor,
                 w12: torch.Tensor, b12: torch.Tensor | None, w3: torch.Tensor, b3: torch.Tensor | None,
                 rw: torch.Tensor | None, kind: str, limit: float | None, alpha: float, up_offset: float,
                 interleaved: bool, transposed: bool, tail: bool, needs: list[bool], perm: torch.Tensor | None,
                 top_k: int, combine_dtype: torch.dtype | None, fp8: bool = False,
                 w_up: torch.Tensor | None = None) -> list[torch.Tensor]:
    spec = GLUActivation(kind, limit, alpha, up_offset, interleaved)
    grads = _backward_body(dy, x, x12, offsets, w12, b12, w3, b3, rw, spec, transposed, tail, tuple(needs),
                           perm, top_k, combine_dtype, fp8, w_up)
    return [x.new_empty(0) if g is None else g for g in grads]  # an op returns tensors only


@_backward_op.register_fake
def _(dy, x, x12, offsets, w12, b12, w3, b3, rw, kind, limit, alpha, up_offset, interleaved, transposed, tail,
      needs, perm, top_k, combine_dtype, fp8=False, w_up=None):
    like = (x, w12, b12, w3, b3, rw, w_up)  # dx is per token, drw per slot, on the tokens path
    needs = (*needs, needs[1])  # need_w12 covers w_up
    return [t.new_empty(t.shape) if need and t is not None else x.new_empty(0) for need, t in zip(needs, like)]


def _forward(x, offsets, w12, b12, w3, b3, rw, activation, transposed, tail, perm, top_k, combine_dtype, fp8,
             w_up=None):
    if torch.compiler.is_compiling():
        return _forward_op(x, offsets, w12, b12, w3, b3, rw, *spec_args(activation), transposed, tail, perm, top_k,
                           combine_dtype, fp8, w_up)
    return _forward_body(x, offsets, w12, b12, w3, b3, rw, activation, transposed, tail, perm, top_k, combine_dtype,
                         fp8, w_up)


def _backward(dy, x, x12, offsets, w12, b12, w3, b3, rw, activation, transposed, tail, needs, perm, top_k,
              combine_dtype, fp8, w_up=None):
    """(dx, dw12, db12, dw3, db3, drw, dw_up), None where not needed."""
    if torch.compiler.is_compiling():
        grads = _backward_op(dy, x, x12, offsets, w12, b12, w3, b3, rw, *spec_args(activation), transposed,
                             tail, list(needs), perm, top_k, combine_dtype, fp8, w_up)
        needed = (*needs, needs[1] and w_up is not None)
        return tuple(g if need else None for g, need in zip(grads, needed))
    return _backward_body(dy, x, x12, offsets, w12, b12, w3, b3, rw, activation, transposed, tail, needs,
                          perm, top_k, combine_dtype, fp8, w_up)


# ---- row tiles (tile_rows=): the same bodies a tile at a time -------------------------------

def _tile_parts(n: int, tile: int, top_k: int, tokens: bool):
    """(tile index, its slice of ``x``'s first dim, its slice of the routed rows
    and slots): on the tokens path a tile of tokens owns exactly their K slots."""
    for i, items in enumerate(tile_slices(n, tile)):
        yield i, items, (slice(items.start * top_k, items.stop * top_k) if tokens else items)


def rows_tile_offsets(offsets: torch.Tensor, rows: int, tile: int) -> torch.Tensor:
    """[n_tiles, E]: each row tile's own cumulative group ends (rows already grouped
    by expert: a tile's groups are the global ones clipped to it)."""
    return torch.stack([offsets.clamp(part.start, part.stop) - part.start for part in tile_slices(rows, tile)])


def _tiled_forward(x, offsets, w12, b12, w3, b3, rw, activation, transposed, tail, perm, top_k, combine_dtype,
                   fp8, tile, w_up=None):
    """The forward a tile at a time: ``offsets`` [n_tiles, E] and ``perm`` (tokens
    path) tile-local. Returns (y, the 8-bit x12 of every row with ``fp8``, else an
    empty [rows, 0]: nothing of x12 is kept)."""
    tokens = perm is not None
    functional = torch.compiler.is_compiling()
    y = saved = None
    y_parts, saved_parts = [], []
    rows_total = perm.shape[0] if tokens else x.shape[0]
    for i, items, rows in _tile_parts(x.shape[0], tile, top_k, tokens):
        y_t, x12_t = _forward(x[items], offsets[i], w12, b12, w3, b3, None if rw is None else rw[rows], activation,
                              transposed, tail, perm[rows] if tokens else None, top_k, combine_dtype, fp8, w_up)
        out_rows = items if combine_dtype is not None else rows
        if functional:
            y_parts.append(y_t)
            if fp8:
                saved_parts.append(x12_t)
        else:
            if y is None:
                y = y_t.new_empty(x.shape[0] if combine_dtype is not None else rows_total, y_t.shape[1])
            y[out_rows].copy_(y_t)
            if fp8:
                if saved is None:
                    saved = x12_t.new_empty(rows_total, x12_t.shape[1])
                saved[rows].copy_(x12_t)
        del y_t, x12_t  # freed before the next tile's workspace is made
    if functional:
        y = torch.cat(y_parts)
        saved = torch.cat(saved_parts) if fp8 else None
    return y, (saved if saved is not None else x.new_empty(rows_total, 0))


def _tiled_backward(dy, x, saved, offsets, w12, b12, w3, b3, rw, activation, transposed, tail, needs, perm, top_k,
                    combine_dtype, fp8, tile, grads_fp32, w_up=None):
    """The backward a tile at a time (x12 recomputed per tile, or read from the 8-bit
    rows); the weight and bias gradients of the tiles are summed, in float32 for 16-bit
    weights with ``grads_fp32``, and rounded once at the end."""
    need_x, need_w12, need_b12, need_w3, need_b3, need_rw = needs
    tokens = perm is not None
    functional = torch.compiler.is_compiling()
    acc_dtype = torch.float32 if grads_fp32 and w12.dtype in HALF_DTYPES else None
    dx = x.new_empty(x.shape) if need_x and not functional else None
    drw = rw.new_empty(rw.shape) if need_rw and not functional else None
    dx_parts, drw_parts, sums = [], [], [None] * 5    # dw12, db12, dw3, db3, dw_up
    for i, items, rows in _tile_parts(x.shape[0], tile, top_k, tokens):
        dy_t = dy[items] if combine_dtype is not None or not tokens else dy[rows]
        dx_t, dw12_t, db12_t, dw3_t, db3_t, drw_t, dw_up_t = _backward(
            dy_t, x[items], saved[rows] if fp8 else None, offsets[i], w12, b12, w3, b3,
            None if rw is None else rw[rows], activation, transposed, tail, needs,
            perm[rows] if tokens else None, top_k, combine_dtype, fp8, w_up)
        for j, part in enumerate((dw12_t, db12_t, dw3_t, db3_t, dw_up_t)):
            if part is not None:
                part = part if acc_dtype is None else part.to(acc_dtype)
                sums[j] = part if sums[j] is None else (sums[j] + part if functional else sums[j].add_(part))
        if need_x:
            dx_parts.append(dx_t) if functional else dx[items].copy_(dx_t)
        if need_rw:
            drw_parts.append(drw_t) if functional else drw[rows].copy_(drw_t)
        del dx_t, drw_t, dw12_t, dw3_t, dw_up_t
    if functional:
        dx = torch.cat(dx_parts) if need_x else None
        drw = torch.cat(drw_parts) if need_rw else None
    dw12, db12, dw3, db3, dw_up = (None if g is None else g.to(w12.dtype) for g in sums)
    return dx, dw12, db12, dw3, db3, drw, dw_up


# ---- the Function --------------------------------------------------------------------------

class MoEExpertsFunction(LeanApplyFunction):
    """The experts feed-forward, apply-only (layouts in the module docstring).

    ``apply(x, offsets, w12, b12, w3, b3, routing_weights, activation,
    transposed, recompute_gate_up, tail, perm, top_k, combine_dtype,
    saved_x12_fp8, tile, tile_grads_fp32, w_up) -> (y, x12)``, all positional: the arguments were validated by the caller
    (``grouped_experts`` / ``routed_experts`` / the Hugging Face experts
    function). ``perm`` None: ``x`` holds the grouped rows [S, D] and
    ``routing_weights`` is [S]. Else ``x`` holds T tokens [T, D],
    ``perm`` [T*K] the slots in expert order (``tokens.TokenRows``),
    ``routing_weights`` is in token order [T*K], and ``y`` is each token's K
    rows summed in ``combine_dtype`` ([T, D]), or with ``combine_dtype`` None
    the rows themselves ([S, D]). It saves the same tensors whatever requires
    grad: x, offsets, perm, the weights, the routing weights and x12 (not x12
    with ``recompute_gate_up``; the 8-bit saved x12 with ``saved_x12_fp8``).
    ``x12`` is returned only so that it can be saved; it is non-differentiable.
    ``tile`` > 0: the forward and backward run ``tile`` rows (tokens, on the
    tokens path) at a time, ``offsets`` is [n_tiles, E] and ``perm`` tile-local
    (``rows_tile_offsets``, ``routing.sort_by_expert_in_tiles``); nothing of
    x12 is saved (the tiles' 8-bit x12 with ``saved_x12_fp8``), and the tiles'
    weight gradients sum in float32 for 16-bit weights (``tile_grads_fp32``).
    ``w_up`` not None: separate gate (``w12``) and up (``w_up``) weights,
    ``[E, I, D]`` each (transposed ``[E, D, I]``), halves-layout activation;
    ``b12`` stays packed ``[E, 2I]``.
    """

    @staticmethod
    def forward(x, offsets, w12, b12, w3, b3, routing_weights, activation, transposed, recompute_gate_up, tail,
                perm, top_k, combine_dtype, saved_x12_fp8, tile, tile_grads_fp32, w_up):
        if tile:
            return _tiled_forward(x, offsets, w12, b12, w3, b3, routing_weights, activation, transposed, tail, perm,
                                  top_k, combine_dtype, saved_x12_fp8, tile, w_up)
        return _forward(x, offsets, w12, b12, w3, b3, routing_weights, activation, transposed, tail, perm, top_k,
                        combine_dtype, saved_x12_fp8, w_up)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, offsets, w12, b12, w3, b3, rw, activation, transposed, recompute_gate_up, tail, perm, top_k, \
            combine_dtype, saved_x12_fp8, tile, tile_grads_fp32, w_up = inputs
        mark_saved_only(ctx, output[1])
        keep_x12 = not recompute_gate_up and (saved_x12_fp8 or not tile)
        ctx.save_for_backward(x, offsets, w12, b12, w3, b3, rw, perm, output[1] if keep_x12 else None, w_up)
        ctx.modes = (activation, transposed, tail)
        ctx.tokens = (top_k, combine_dtype, saved_x12_fp8)
        ctx.tile = (tile, tile_grads_fp32)

    @staticmethod
    @first_order_backward
    def backward(ctx, dy, _dx12_unused):
        if dy is None:  # y's gradient is undefined (grads are not materialised): nothing flows back
            return (None,) * 18
        x, offsets, w12, b12, w3, b3, rw, perm, x12, w_up = ctx.saved_tensors
        need_x, _, need_w12, need_b12, need_w3, need_b3, need_rw = ctx.needs_input_grad[:7]
        need_w_up = w_up is not None and ctx.needs_input_grad[17]
        needs = (need_x, need_w12 or need_w_up, need_b12 and b12 is not None, need_w3, need_b3 and b3 is not None,
                 need_rw and rw is not None)
        if ctx.tile[0]:
            grads = _tiled_backward(dy, x, x12, offsets, w12, b12, w3, b3, rw, *ctx.modes, needs, perm, *ctx.tokens,
                                    *ctx.tile, w_up)
        else:
            grads = _backward(dy, x, x12, offsets, w12, b12, w3, b3, rw, *ctx.modes, needs, perm, *ctx.tokens,
                              w_up)
        dx, dw12, db12, dw3, db3, drw, dw_up = grads
        return ((dx, None, dw12 if need_w12 else None, db12, dw3, db3, drw) + (None,) * 10
                + (dw_up if need_w_up else None,))


def run_experts(x, offsets, w12, b12, w3, b3, routing_weights, activation: GLUActivation, transposed: bool,
                recompute_gate_up: bool, tail: bool, perm: torch.Tensor | None = None, top_k: int = 1,
                combine_dtype: torch.dtype | None = None, saved_x12_fp8: bool = False, tile: int = 0,
                tile_grads_fp32: bool = True, w_up: torch.Tensor | None = None) -> torch.Tensor:
    """The Function on arguments valid by construction (no checks): the one
    place it is applied (``perm``, ``top_k``, ``combine_dtype``: the tokens
    way in, see ``MoEExpertsFunction``). Under autocast, x and the weights
    are cast to the autocast dtype (as nn.Linear does); under no_grad the
    forward runs without the Function (no graph, nothing to save).
    ``saved_x12_fp8``: see ``grouped_experts``'s ``saved_x12`` (checked by
    the caller). ``tile``: rows (tokens) per tile, with ``offsets`` and ``perm``
    prepared for it (see ``MoEExpertsFunction``), or 0. ``w_up``: the separate
    up weight (``w12`` then holds the gate weight), or None."""
    def run(tensors):
        x, w12, b12, w3, b3, w_up = tensors
        if graph_needed(x, w12, w3, w_up):
            if saved_x12_fp8:
                check.check_fp8_compute_dtype(x.dtype)
            return MoEExpertsFunction.apply(x, offsets, w12, b12, w3, b3, routing_weights, activation, transposed,
                                            recompute_gate_up, tail, perm, top_k, combine_dtype, saved_x12_fp8,
                                            tile, tile_grads_fp32, w_up)[0]
        if tile:
            return _tiled_forward(x, offsets, w12, b12, w3, b3, routing_weights, activation, transposed, tail, perm,
                                  top_k, combine_dtype, False, tile, w_up)[0]
        return _forward_body(x, offsets, w12, b12, w3, b3, routing_weights, activation, transposed, tail, perm,
                             top_k, combine_dtype, False, w_up)[0]
    return under_autocast(x.device.type, [x, w12, b12, w3, b3, w_up], run)


# ---- public API ----------------------------------------------------------------------------

def grouped_experts(x_sorted: torch.Tensor, offsets: torch.Tensor, w12: torch.Tensor, w3: torch.Tensor,
                    b12: torch.Tensor | None = None, b3: torch.Tensor | None = None, *,
                    routing_weights: torch.Tensor | None = None, activation="silu", transposed: bool = False,
                    recompute_gate_up: bool = False, saved_x12=None, tile_rows=None,
                    tile_grads_fp32: bool = True) -> torch.Tensor:
    """The experts GLU feed-forward over rows already grouped by expert: ``y [S, D]``.

    ``offsets`` are int32 cumulative group ends (``offsets[-1] == S``; empty
    experts repeat the previous end), as ``torch.nn.functional.grouped_mm``
    takes them. ``activation``: a ``GLUActivation`` or a plain form's name
    (its ``interleaved`` flag names w12's gate/up layout). ``routing_weights``
    [S] multiply each row's down output, bias included. Checking the offsets'
    values copies them to the host once (use ``routed_experts`` to route from
    top-k ids). Saved for backward: ``x_sorted`` itself (the only copy of the
    inputs this entry sees; ``routed_experts`` saves each token's input once
    instead of K rows) and x12 [S, 2I], plus offsets and routing weights.
    ``saved_x12="fp8"`` saves x12 in 8 bits (as ``swiglu``'s; not with
    ``recompute_gate_up``). ``tile_rows`` (an int or ``"auto"``: a 256 MiB x12 workspace)
    runs the rows a tile at a time, forward and backward, saving nothing of x12 (or
    the 8-bit x12 with ``saved_x12="fp8"``); ``tile_grads_fp32`` as ``swiglu``'s.
    Layouts: the module docstring.
    """
    check.reject_jit()
    _check_rows(x_sorted)
    E, I = check.check_expert_weights("x_sorted", x_sorted, w12, w3, b12, b3, transposed)
    return _run_grouped(x_sorted, offsets, E, I, w12, b12, w3, b3, None, routing_weights, resolve_activation(activation),
                        transposed, recompute_gate_up, saved_x12, tile_rows, tile_grads_fp32)


def grouped_experts_unpacked(x_sorted: torch.Tensor, offsets: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                             w3: torch.Tensor, b1: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                             b3: torch.Tensor | None = None, *, routing_weights: torch.Tensor | None = None,
                             activation="silu", transposed: bool = False, recompute_gate_up: bool = False,
                             saved_x12=None, tile_rows=None, tile_grads_fp32: bool = True) -> torch.Tensor:
    """``grouped_experts`` with separate gate (``w1``, ``b1``) and up (``w2``, ``b2``) weights:
    ``w1``/``w2`` ``[E, I, D]`` each (``transposed``: ``[E, D, I]``), ``w3`` ``[E, D, I]``
    (``[E, I, D]``), ``b1``/``b2`` ``[E, I]``, ``b3`` ``[E, D]``.

    The gate and up GEMMs fill the two halves of one x12 buffer, so the
    weights are never concatenated (no per-call ``[E, 2I, D]`` copy, nothing of
    them saved beyond the parameters themselves); the same Function, kernels,
    saved tensors and options as ``grouped_experts``. The backward takes one
    GEMM more (dx is ``dgate W1 + dup W2``). Halves-layout activations only.
    The biases, if any, are packed per call (``[E, 2I]``: small).
    """
    check.reject_jit()
    _check_rows(x_sorted)
    E, I = check.check_unpacked_expert_weights("x_sorted", x_sorted, w1, w2, w3, b1, b2, b3, transposed)
    spec = resolve_halves_activation(activation, "w1 and w2")
    b12 = None
    if b1 is not None or b2 is not None:
        zeros = (b1 if b1 is not None else b2).new_zeros((E, I))
        b12 = torch.cat([b1 if b1 is not None else zeros, b2 if b2 is not None else zeros], dim=1)
    return _run_grouped(x_sorted, offsets, E, I, w1, b12, w3, b3, w2, routing_weights, spec, transposed,
                        recompute_gate_up, saved_x12, tile_rows, tile_grads_fp32)


def _check_rows(x_sorted) -> None:
    if not isinstance(x_sorted, torch.Tensor) or x_sorted.dim() != 2:
        shape = tuple(x_sorted.shape) if isinstance(x_sorted, torch.Tensor) else type(x_sorted).__name__
        raise ValueError(f"x_sorted must be a 2-D tensor [S, D], got {shape}")


def _run_grouped(x_sorted, offsets, E: int, I: int, w12, b12, w3, b3, w_up, routing_weights, spec, transposed,
                 recompute_gate_up, saved_x12, tile_rows, tile_grads_fp32) -> torch.Tensor:
    """The checks and the run both rows entries share (their weights already checked)."""
    check.check_flags(recompute_gate_up=recompute_gate_up, tile_grads_fp32=tile_grads_fp32)
    check.check_tile_rows(tile_rows)
    fp8 = check.check_saved_x12(saved_x12, recompute_gate_up)
    S = x_sorted.shape[0]
    check.check_offsets(offsets, E, S, x_sorted.device)
    check.check_routing_weights("routing_weights", routing_weights, (S,), x_sorted)
    tile = resolve_tile_rows(tile_rows, S, I, compute_dtype(x_sorted))
    if tile:
        offsets = rows_tile_offsets(offsets, S, tile)
    return run_experts(x_sorted, offsets, w12, b12, w3, b3, routing_weights, spec, transposed,
                       recompute_gate_up, False, saved_x12_fp8=fp8, tile=tile, tile_grads_fp32=tile_grads_fp32,
                       w_up=w_up)


def expert_width(w12: torch.Tensor, transposed: bool) -> int:
    """I: each expert's hidden width."""
    return (w12.shape[2] if transposed else w12.shape[1]) // 2


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the experts compute in: autocast's where it is on (as nn.Linear)."""
    return torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
