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

import torch
import torch.nn.functional as F

from .._sources import FULL_PRECISION_DTYPES as _FULL_PRECISION


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


def silu_mul_forward_torch(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
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
                      dgate_out: torch.Tensor | None = None, dup_out: torch.Tensor | None = None):
    return _backward_in_blocks(gate, up, dh, dgate_out, dup_out, None, want_h=False)[:2]


def _split(x12: torch.Tensor):
    return x12.chunk(2, 1)  # both halves in one call (slicing costs ~1.5 us a view)


def swiglu_forward_torch(x12: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    return silu_mul_forward_torch(*_split(x12), out)


def swiglu_backward_torch(x12: torch.Tensor, dh: torch.Tensor, dx12_out: torch.Tensor | None = None,
                    h_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if dx12_out is None:
        dgate, dup, h = _backward_in_blocks(*_split(x12), dh, None, None, h_out, want_h=True)
        return torch.cat([dgate, dup], dim=1), h
    _backward_in_blocks(*_split(x12), dh, *_split(dx12_out), h_out, want_h=True)
    return dx12_out, h_out
