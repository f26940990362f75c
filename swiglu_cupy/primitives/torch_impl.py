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

import math

import torch
import torch.nn.functional as F

from .._sources import FULL_PRECISION_DTYPES as _FULL_PRECISION
from ..activations import SILU, GLUActivation


# Buffered outputs are computed in blocks of rows of about this many
# elements, so the math-dtype temporaries of one block stay in cache (on two
# cores this cut the fp32/bf16 passes by 1.2-2x at M=2048, H=1408).
_BLOCK_ELEMENTS = 1 << 18


def _widen(t: torch.Tensor) -> torch.Tensor:
    """``t`` in the math dtype (itself for fp32/fp64)."""
    return t if t.dtype in _FULL_PRECISION else t.float()


def _store(value: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None) -> torch.Tensor:
    """``value`` (math dtype) rounded once to ``dtype``: into ``out``, or new."""
    if out is not None:
        return out.copy_(value)
    return value if value.dtype is dtype else value.to(dtype)


def _mul_store(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None) -> torch.Tensor:
    """a * b (both in the math dtype) rounded once to ``dtype``; in full
    precision the product is written straight into ``out``."""
    if out is not None and a.dtype is dtype:
        return torch.mul(a, b, out=out)
    return _store(torch.mul(a, b), dtype, out)


def _is_same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (a.data_ptr() == b.data_ptr() and a.stride() == b.stride())


def _in_row_blocks(fn, *tensors: torch.Tensor | None) -> None:
    """``fn`` on each block of rows of the 2-D ``tensors`` (all with the
    same rows; None stays None)."""
    rows, cols = tensors[0].shape
    step = max(1, _BLOCK_ELEMENTS // max(cols, 1))
    if rows <= step:
        fn(*tensors)
        return
    for start in range(0, rows, step):
        fn(*(None if t is None else t[start:start + step] for t in tensors))


def _forward_math(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if gate.dtype not in _FULL_PRECISION:
        return _store(F.silu(gate.float(), inplace=True).mul_(up.float()), gate.dtype, out)
    if out is not None and _is_same_memory(out, gate):
        silu = F.silu(gate, inplace=True)  # h overwrites gate anyway: no temporary
    else:
        silu = F.silu(gate)
    return _mul_store(silu, up, gate.dtype, out)


def silu_mul_forward_torch(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None,
                           activation: GLUActivation = SILU) -> torch.Tensor:
    if activation.kind != "silu" or activation.limit is not None:
        return _glu_forward_math(gate, up, out, activation)
    if out is None:
        return _forward_math(gate, up, None)
    _in_row_blocks(_forward_math, gate, up, out)
    return out


def _backward_math(gate, up, dh, dgate_out, dup_out, h_out, want_h: bool):
    """(dgate, dup, h or None). Outputs may alias inputs (dgate_out = gate,
    dup_out = up): every input is read before, or in the same elementwise
    pass as, the write over it."""
    dtype = gate.dtype
    g, u, d = _widen(gate), _widen(up), _widen(dh)
    silu = F.silu(g)
    h = _mul_store(silu, u, dtype, h_out) if want_h else None
    dh_up = torch.mul(d, u)  # the last read of up
    dup = _mul_store(d, silu, dtype, dup_out)
    if dgate_out is not None and g is gate:
        # Element i is read and written by the same pass: safe when dgate_out aliases gate.
        dgate = torch.ops.aten.silu_backward.grad_input(dh_up, g, grad_input=dgate_out)
    else:
        dgate = _store(torch.ops.aten.silu_backward(dh_up, g), dtype, dgate_out)
    return dgate, dup, h


def _backward_in_blocks(gate, up, dh, dgate_out, dup_out, h_out, want_h: bool):
    """``_backward_math``, in row blocks when every output has a buffer."""
    if dgate_out is None or dup_out is None or (want_h and h_out is None):
        return _backward_math(gate, up, dh, dgate_out, dup_out, h_out, want_h)
    _in_row_blocks(lambda *blocks: _backward_math(*blocks, want_h), gate, up, dh, dgate_out, dup_out, h_out)
    return dgate_out, dup_out, h_out


def silu_mul_backward_torch(gate: torch.Tensor, up: torch.Tensor, dh: torch.Tensor,
                            dgate_out: torch.Tensor | None = None, dup_out: torch.Tensor | None = None,
                            activation: GLUActivation = SILU):
    if activation.kind != "silu" or activation.limit is not None:
        return _glu_backward_math(gate, up, dh, dgate_out, dup_out, None, False, activation)[:2]
    return _backward_in_blocks(gate, up, dh, dgate_out, dup_out, None, want_h=False)[:2]


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
    elif kind == "gelu_tanh":
        inner = _SQRT_2_OVER_PI * (g + 0.044715 * g * g * g)
        t = torch.tanh(inner)
        a = 0.5 * g * (1 + t)
        da = (0.5 * (1 + t) + 0.5 * g * (1 - t * t) * _SQRT_2_OVER_PI * (1 + 3 * 0.044715 * g * g)
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
    if spec.limit is not None:  # torch's clamp passes the gradient where min <= x <= max (0 for NaN)
        raw_gate, raw_up = _widen(gate), _widen(up)
        dgate = torch.where(raw_gate <= spec.limit, dgate, 0.0)
        dup = torch.where((raw_up >= -spec.limit) & (raw_up <= spec.limit), dup, 0.0)
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
    return silu_mul_forward_torch(*_split(x12, activation), out, activation)


def swiglu_backward_torch(x12: torch.Tensor, dh: torch.Tensor, dx12_out: torch.Tensor | None = None,
                          h_out: torch.Tensor | None = None, activation: GLUActivation = SILU
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    generic = activation.kind != "silu" or activation.limit is not None
    if dx12_out is None:
        if generic:
            dgate, dup, h = _glu_backward_math(*_split(x12, activation), dh, None, None, h_out, True, activation)
        else:
            dgate, dup, h = _backward_in_blocks(*_split(x12, activation), dh, None, None, h_out, want_h=True)
        return _join(dgate, dup, activation), h
    if generic:
        _, _, h = _glu_backward_math(*_split(x12, activation), dh, *_split(dx12_out, activation), h_out, True,
                                     activation)
        return dx12_out, h
    _backward_in_blocks(*_split(x12, activation), dh, *_split(dx12_out, activation), h_out, want_h=True)
    return dx12_out, h_out
