"""CPU implementation of the primitives in torch (also the slow reference for
the kernels). Same contract and same single-rounding math as kernels_cu/."""
from __future__ import annotations

import torch


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _split(x12: torch.Tensor):
    H = x12.shape[1] // 2
    return x12[:, :H], x12[:, H:]


def _emit(value: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return value.to(dtype)
    out.copy_(value)  # one rounding, into the caller's buffer
    return out


def _backward_math(gate: torch.Tensor, up: torch.Tensor, dh: torch.Tensor):
    """(dgate, dup, silu(g), u) in the math dtype. All but u (which may be
    ``up`` itself) are new tensors: compute everything needed from them
    before writing into a buffer that aliases the inputs."""
    acc = _math_dtype(gate.dtype)
    g, u, d = gate.to(acc), up.to(acc), dh.to(acc)
    s = torch.sigmoid(g)
    silu = g * s
    return d * u * s * (1 + g * (1 - s)), d * silu, silu, u


def silu_mul_forward(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    acc = _math_dtype(gate.dtype)
    g = gate.to(acc)
    return _emit(g * torch.sigmoid(g) * up.to(acc), gate.dtype, out)


def silu_mul_backward(gate: torch.Tensor, up: torch.Tensor, dh: torch.Tensor,
                      dgate_out: torch.Tensor | None = None, dup_out: torch.Tensor | None = None):
    dg, du, _, _ = _backward_math(gate, up, dh)
    return _emit(dg, gate.dtype, dgate_out), _emit(du, gate.dtype, dup_out)


def swiglu_forward(x12: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    return silu_mul_forward(*_split(x12), out)


def swiglu_backward(x12: torch.Tensor, dh: torch.Tensor, dx12_out: torch.Tensor | None = None):
    dg, du, silu, u = _backward_math(*_split(x12), dh)
    h = (silu * u).to(x12.dtype)
    if dx12_out is None:
        return torch.cat([dg, du], dim=1).to(x12.dtype), h
    H = dg.shape[1]
    dx12_out[:, :H].copy_(dg)
    dx12_out[:, H:].copy_(du)
    return dx12_out, h
