"""The torch implementation of the primitives: the production path for CPU
(and any non-CUDA) tensors, and what tracers and ONNX export see. Same contract and
same single-rounding math as kernels_cu/.

Math runs in fp32 (fp64 for float64): half-precision inputs are widened
once (explicit conversions: torch's mixed-dtype ops cast through slow
temporaries), torch's fused ``silu`` / ``silu_backward`` do the rest, and
each output is rounded to the storage dtype once, on its store.

Outputs: a buffer given as ``out``/``*_out`` is written in place (the fast
CPU path that ``primitives`` takes: fp32/fp64 results go straight into it,
in cache-sized blocks of rows). An output left as None comes back as a new
tensor from functional ops only, which tracers and decompositions require.
"""
from __future__ import annotations

import functools
import itertools
import math

import torch
import torch.nn.functional as F

from .._torch_compat import clamp_gradient_at_bound, silu_into
from .._dtypes import FULL_PRECISION_DTYPES as _FULL_PRECISION
from ..activations import SILU, GLUActivation


# Buffered outputs are computed in blocks of rows of about this many
# elements per [rows, H] operand (fp32), through math-dtype workspaces
# allocated once per call and reused by every block, so the block's
# operands stay in cache; a half-precision x12 is widened, and dx12 rounded,
# in one copy each. On two cores this took the bf16 backward of
# [2048, 2 x 512] from 6.5 to 3.0 ms and its forward from 2.1 to 1.3 ms.
# Half-precision blocks have half the rows: their fp32 copies sit beside
# the storage-dtype operands, so the same rows need about twice the cache
# (on an Intel Xeon with 2 MB of L2 per core, bf16 [2048, 2 x 512]:
# forward 1.44 -> 1.23 ms, backward 3.67 -> 3.19 ms; fp32 best as it was).
_BLOCK_ELEMENTS = 1 << 17

_silu_into = silu_into  # silu(input, out=...), see _torch_compat
_silu_backward_into = torch.ops.aten.silu_backward.grad_input


def _is_plain_silu(spec: GLUActivation) -> bool:
    """silu without a clamp: the tuned path; the rest of the family takes the generic one."""
    return spec.kind == "silu" and spec.limit is None


def _widen(t: torch.Tensor) -> torch.Tensor:
    """``t`` in the math dtype (itself for fp32/fp64)."""
    return t if t.dtype in _FULL_PRECISION else t.float()


def _round(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``value`` (math dtype) rounded once to ``dtype``, as a new tensor."""
    return value if value.dtype is dtype else value.to(dtype)


def _store(value: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None) -> torch.Tensor:
    """``value`` (math dtype) rounded once to ``dtype``: into ``out``, or new."""
    return _round(value, dtype) if out is None else out.copy_(value)


def _is_same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (a.data_ptr() == b.data_ptr() and a.stride() == b.stride())


def _block_rows(cols: int, dtype: torch.dtype) -> int:
    """Rows per block: ``_BLOCK_ELEMENTS`` elements, half that for a dtype that is widened."""
    elements = _BLOCK_ELEMENTS if dtype in _FULL_PRECISION else _BLOCK_ELEMENTS // 2
    return max(1, elements // max(cols, 1))


class _Workspace:
    """Math-dtype buffers reused by every block of one call (a call of one
    block allocates nothing ahead: its temporaries are its buffers). ``pair``
    holds gate and up side by side, so that the backward's dgate/dup
    overwrite them and leave in one copy."""

    def __init__(self, like: torch.Tensor, rows: int):
        self.like, self.rows = like, rows
        self.buffers: dict = {}
        self.views: dict = {}  # (name, n) -> buf[:n], and its halves: made once, not per block

    def get(self, name: str, n: int, cols: int) -> torch.Tensor:
        view = self.views.get((name, n))
        if view is None:
            buf = self.buffers.get(name)
            if buf is None:
                math = torch.float32 if self.like.dtype not in _FULL_PRECISION else self.like.dtype
                buf = self.buffers[name] = self.like.new_empty((self.rows, cols), dtype=math)
            view = self.views[(name, n)] = buf if n == self.rows else buf[:n]
        return view

    def halves(self, pair: torch.Tensor, activation: GLUActivation):
        """``_split(pair, activation)`` of a workspace buffer, made once."""
        key = ("halves", pair.shape[0])
        found = self.views.get(key)
        if found is None:
            found = self.views[key] = _split(pair, activation)
        return found


def _widened_pair(gate, up, x12, activation: GLUActivation, ws: _Workspace | None) -> torch.Tensor:
    """A half-precision block's gate and up in fp32, side by side in one
    [n, 2H] tensor (in the activation's layout): a packed ``x12`` (gate and
    up are its halves) is widened in one copy, cheaper than two strided ones."""
    n, cols = gate.shape
    if ws is None and x12 is not None:
        return x12.float()
    pair = gate.new_empty((n, 2 * cols), dtype=torch.float32) if ws is None else ws.get("pair", n, 2 * cols)
    if x12 is not None:
        return pair.copy_(x12)
    g, u = _halves(pair, activation, ws)
    g.copy_(gate)
    u.copy_(up)
    return pair


def _halves(pair: torch.Tensor, activation: GLUActivation, ws: _Workspace | None):
    return _split(pair, activation) if ws is None else ws.halves(pair, activation)


def _in_row_blocks(block_fn, like: torch.Tensor, *tensors: torch.Tensor | None) -> None:
    """``block_fn(ws, *blocks)`` on each ``_BLOCK_ELEMENTS``-sized block of
    rows of the 2-D ``tensors`` (all with ``like``'s rows; None stays None),
    with one workspace for all blocks; one block covering every row gets the
    whole tensors and no workspace."""
    rows, cols = like.shape
    step = _block_rows(cols, like.dtype)
    if rows <= step:
        block_fn(None, *tensors)
        return
    ws = _Workspace(like, step)
    # One split per tensor (its blocks as views, made in one call) costs far
    # less per block than slicing each tensor in Python.
    per_tensor = [itertools.repeat(None) if t is None else t.split(step) for t in tensors]
    for blocks in zip(*per_tensor):
        block_fn(ws, *blocks)


def _forward_block(activation: GLUActivation, ws: _Workspace | None, gate, up, out, x12) -> None:
    if gate.dtype in _FULL_PRECISION:
        if _is_same_memory(out, gate):  # h overwrites gate anyway: silu in place, nothing allocated
            silu = F.silu(gate, inplace=True)
        else:
            silu = F.silu(gate) if ws is None else _silu_into(gate, out=ws.get("silu", gate.shape[0], gate.shape[1]))
        torch.mul(silu, up, out=out)
        return
    g, u = _halves(_widened_pair(gate, up, x12, activation, ws), activation, ws)
    torch.mul(F.silu(g, inplace=True), u, out=out)  # the fp32 product, rounded once on the store


def _forward_into(gate, up, out, x12=None, activation: GLUActivation = SILU) -> torch.Tensor:
    """h into ``out`` (which may be gate itself), block by block; ``x12``:
    the packed tensor gate and up come from, if any."""
    _in_row_blocks(functools.partial(_forward_block, activation), gate, gate, up, out, x12)
    return out


def silu_mul_forward_torch(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None,
                           activation: GLUActivation = SILU) -> torch.Tensor:
    if not _is_plain_silu(activation):
        return _glu_forward_math(gate, up, out, activation)
    if out is None:
        return _forward_functional(gate, up)
    return _forward_into(gate, up, out)


def _forward_functional(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    g = _widen(gate)
    return _round(F.silu(g) * _widen(up), gate.dtype)


def _backward_functional(gate, up, dh, want_h: bool):
    """(dgate, dup, h or None) as new tensors: the form tracers see."""
    dtype = gate.dtype
    g, u, d = _widen(gate), _widen(up), _widen(dh)
    silu = F.silu(g)
    h = _round(silu * u, dtype) if want_h else None
    return (_round(torch.ops.aten.silu_backward(d * u, g), dtype), _round(d * silu, dtype), h)


def _backward_block(activation: GLUActivation, ws: _Workspace | None, gate, up, dh, dgate_out, dup_out, h_out,
                    x12, dx12_out) -> None:
    n, cols = gate.shape
    wide = gate.dtype not in _FULL_PRECISION
    pair = None
    if wide:
        pair = _widened_pair(gate, up, x12, activation, ws)
        gate, up = _halves(pair, activation, ws)
        dh = dh.float() if ws is None else ws.get("dh", n, cols).copy_(dh)
        # dgate/dup overwrite the widened gate/up; rounded once on the copy out.
        dgate, dup = gate, up
    else:
        dgate, dup = dgate_out, dup_out
    silu = F.silu(gate) if ws is None else _silu_into(gate, out=ws.get("silu", n, cols))
    if h_out is not None:
        torch.mul(silu, up, out=h_out)
    torch.mul(dh, up, out=dup)                        # dh * up (the last read of up)
    _silu_backward_into(dup, gate, grad_input=dgate)  # elementwise: dgate may alias gate
    torch.mul(dh, silu, out=dup)
    if wide and dx12_out is not None:
        dx12_out.copy_(pair)
    elif wide:
        dgate_out.copy_(dgate)
        dup_out.copy_(dup)


def _backward_into(gate, up, dh, dgate_out, dup_out, h_out, x12=None, dx12_out=None,
                   activation: GLUActivation = SILU) -> None:
    """dgate, dup (and h when ``h_out`` is given) into the buffers, block by
    block. dgate_out may be gate and dup_out may be up: each block reads its
    inputs before it writes over them. ``x12``/``dx12_out``: the packed
    tensors the halves belong to, if any."""
    _in_row_blocks(functools.partial(_backward_block, activation), gate, gate, up, dh, dgate_out, dup_out, h_out,
                   x12, dx12_out)


def silu_mul_backward_torch(gate: torch.Tensor, up: torch.Tensor, dh: torch.Tensor,
                            dgate_out: torch.Tensor | None = None, dup_out: torch.Tensor | None = None,
                            activation: GLUActivation = SILU):
    if not _is_plain_silu(activation):
        return _glu_backward_math(gate, up, dh, dgate_out, dup_out, None, False, activation)[:2]
    if dgate_out is None:  # the buffers come both or neither (primitives.run_* gives both)
        return _backward_functional(gate, up, dh, want_h=False)[:2]
    _backward_into(gate, up, dh, dgate_out, dup_out, None)
    return dgate_out, dup_out


# ---- the rest of the GLU family: act(gate) * up with clamps and the OAI form ----------------
# One generic pass per output (every value is computed before any store, so
# outputs may alias inputs); plain silu keeps the tuned path above.

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _act(g: torch.Tensor, spec: GLUActivation, want_grad: bool):
    """(act(g), act'(g) or None) in g's (math) dtype."""
    kind = spec.kind
    if kind in ("silu", "oai"):
        s = torch.sigmoid(g * spec.alpha if kind == "oai" else g)
        a = g * s
        da = s * (1 + (g * spec.alpha if kind == "oai" else g) * (1 - s)) if want_grad else None
    elif kind == "gelu_tanh":  # 0.5 (1 + tanh y) = sigmoid(2 y), as the kernels: 1 + tanh(y) cancels for g << 0
        z = 2 * _SQRT_2_OVER_PI * (g + 0.044715 * g * g * g)
        s = torch.sigmoid(z)
        a = g * s
        da = (s + 2 * g * (s * torch.sigmoid(-z)) * (_SQRT_2_OVER_PI * (1 + 3 * 0.044715 * g * g))
              if want_grad else None)
    elif kind == "gelu":
        cdf = 0.5 * (1 + torch.erf(g * _INV_SQRT_2))
        a = g * cdf
        da = cdf + g * torch.exp(-0.5 * g * g) * _INV_SQRT_2PI if want_grad else None
    elif kind == "relu":
        a = torch.relu(g)
        da = (g > 0).to(g.dtype) if want_grad else None
    elif kind == "sigmoid":
        a = torch.sigmoid(g)
        da = a * (1 - a) if want_grad else None
    else:  # identity
        a = g
        da = torch.ones_like(g) if want_grad else None
    return a, da


def _clamped(gate: torch.Tensor, up: torch.Tensor, spec: GLUActivation):
    """(gate, up) widened, clamped, and up shifted by the OAI offset."""
    g, u = _widen(gate), _widen(up)
    if spec.limit is not None:
        g, u = g.clamp(max=spec.limit), u.clamp(min=-spec.limit, max=spec.limit)
    if spec.up_offset:
        u = u + spec.up_offset
    return g, u


def _glu_forward_math(gate, up, out, spec: GLUActivation) -> torch.Tensor:
    g, u = _clamped(gate, up, spec)
    return _store(_act(g, spec, False)[0] * u, gate.dtype, out)


def _glu_backward_math(gate, up, dh, dgate_out, dup_out, h_out, want_h: bool, spec: GLUActivation):
    dtype = gate.dtype
    g, u = _clamped(gate, up, spec)
    d = _widen(dh)
    a, da = _act(g, spec, True)
    dup, dgate = d * a, d * u * da
    if spec.limit is not None:  # the clamps pass the gradient where the installed torch's clamp does
        inside = torch.le if clamp_gradient_at_bound() else torch.lt  # at the bound: 2.13 passes, 2.14 cuts
        dgate = torch.where(inside(_widen(gate), spec.limit), dgate, 0.0)    # NaN: 0 under both rules
        dup = torch.where(inside(_widen(up).abs(), spec.limit), dup, 0.0)
    h = a * u if want_h else None
    results = (_store(dgate, dtype, dgate_out), _store(dup, dtype, dup_out),
               None if h is None else _store(h, dtype, h_out))
    return results


def _split(x12: torch.Tensor, activation: GLUActivation = SILU):
    if activation.interleaved:
        return x12[:, 0::2], x12[:, 1::2]
    return x12.chunk(2, 1)  # both halves in one call (slicing costs ~1.5 us a view)


def _join(dgate: torch.Tensor, dup: torch.Tensor, activation: GLUActivation) -> torch.Tensor:
    """[dgate | dup] (or interleaved) as one new [M, 2H] tensor."""
    if activation.interleaved:
        return torch.stack([dgate, dup], dim=2).view(dgate.shape[0], -1)
    return torch.cat([dgate, dup], dim=1)


def swiglu_forward_torch(x12: torch.Tensor, out: torch.Tensor | None = None,
                         activation: GLUActivation = SILU) -> torch.Tensor:
    if out is None or not _is_plain_silu(activation):
        return silu_mul_forward_torch(*_split(x12, activation), out, activation)
    return _forward_into(*_split(x12, activation), out, x12, activation)


def swiglu_backward_torch(x12: torch.Tensor, dh: torch.Tensor, dx12_out: torch.Tensor | None = None,
                          h_out: torch.Tensor | None = None, activation: GLUActivation = SILU
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx12, h). Buffered (``dx12_out`` and ``h_out`` given) or functional
    (neither: new tensors, the form tracers see)."""
    generic = not _is_plain_silu(activation)
    gate, up = _split(x12, activation)
    if dx12_out is None:
        if generic:
            dgate, dup, h = _glu_backward_math(gate, up, dh, None, None, None, True, activation)
        else:
            dgate, dup, h = _backward_functional(gate, up, dh, want_h=True)
        return _join(dgate, dup, activation), h
    if generic:
        h = _glu_backward_math(gate, up, dh, *_split(dx12_out, activation), h_out, True, activation)[2]
        return dx12_out, h
    _backward_into(gate, up, dh, *_split(dx12_out, activation), h_out, x12, dx12_out, activation)
    return dx12_out, h_out
