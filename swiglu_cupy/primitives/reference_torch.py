"""CPU implementation of the primitives in torch (also the slow reference for
the kernels). Same contract and same single-rounding math as kernels_cu/.

Math runs in fp32 (fp64 for float64): half-precision inputs are widened
once, torch's fused ``silu`` / ``silu_backward`` do the rest, and each output
is rounded to the storage dtype once.

Outputs: a buffer given as ``out``/``*_out`` is written in place
(mixed-dtype ``torch.mul(fp32, half, out=half)`` computes in fp32 and rounds
once on the store: one pass per output, the fast CPU path that
``primitives`` takes). An output left as None comes back as a new tensor
from functional ops only, which tracers and decompositions require.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

_FULL_PRECISION = (torch.float32, torch.float64)  # storage dtype == math dtype


def _widen(t: torch.Tensor) -> torch.Tensor:
    """``t`` in the math dtype (itself for fp32/fp64)."""
    return t if t.dtype in _FULL_PRECISION else t.float()


def _mul(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None) -> torch.Tensor:
    """a * b computed in the math dtype, rounded once to ``dtype``."""
    if out is not None:
        return torch.mul(a, b, out=out)
    product = torch.mul(a, b)
    return product if product.dtype is dtype else product.to(dtype)


def _is_same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.stride() == b.stride()


def silu_mul_forward(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    if out is not None and gate.dtype in _FULL_PRECISION and _is_same_memory(out, gate):
        silu = F.silu(gate, inplace=True)  # h overwrites gate anyway: no temporary
    else:
        silu = F.silu(_widen(gate))
    return _mul(silu, up, gate.dtype, out)


def _backward(gate, up, dh, dgate_out, dup_out, h_out, want_h: bool):
    """(dgate, dup, h or None). Outputs may alias inputs (dgate_out = gate,
    dup_out = up): every input is read before, or in the same elementwise
    pass as, the write over it."""
    dtype = gate.dtype
    g = _widen(gate)
    silu = F.silu(g)
    h = _mul(silu, up, dtype, h_out) if want_h else None
    dh_up = torch.mul(dh, up) if dh.dtype in _FULL_PRECISION else torch.mul(dh.float(), up)  # last read of up
    dup = _mul(dh, silu, dtype, dup_out)
    if dgate_out is not None and g is gate:
        # Element i is read and written by the same pass: safe when dgate_out aliases gate.
        dgate = torch.ops.aten.silu_backward.grad_input(dh_up, g, grad_input=dgate_out)
    else:
        dgate_math = torch.ops.aten.silu_backward(dh_up, g)
        dgate = dgate_math.to(dtype) if dgate_out is None else dgate_out.copy_(dgate_math)
    return dgate, dup, h


def silu_mul_backward(gate: torch.Tensor, up: torch.Tensor, dh: torch.Tensor,
                      dgate_out: torch.Tensor | None = None, dup_out: torch.Tensor | None = None):
    return _backward(gate, up, dh, dgate_out, dup_out, None, want_h=False)[:2]


def _split(x12: torch.Tensor):
    return x12.chunk(2, 1)  # both halves in one call (slicing costs ~1.5 us a view)


def swiglu_forward(x12: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    return silu_mul_forward(*_split(x12), out)


def swiglu_backward(x12: torch.Tensor, dh: torch.Tensor, dx12_out: torch.Tensor | None = None,
                    h_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if dx12_out is None:
        dgate, dup, h = _backward(*_split(x12), dh, None, None, h_out, want_h=True)
        return torch.cat([dgate, dup], dim=1), h
    _backward(*_split(x12), dh, *_split(dx12_out), h_out, want_h=True)
    return dx12_out, h_out
