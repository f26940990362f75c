"""CPU implementation of the primitives in torch (also the slow reference for
the kernels). Same contract and same single-rounding math as kernels_cu/."""
from __future__ import annotations

import torch


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _split(x12: torch.Tensor):
    H = x12.shape[1] // 2
    acc = _math_dtype(x12.dtype)
    return x12[:, :H].to(acc), x12[:, H:].to(acc)


def _emit(value: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return value.to(dtype)
    out.copy_(value)  # one rounding, into the caller's buffer
    return out


def swiglu_forward(x12: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    g, u = _split(x12)
    return _emit(g * torch.sigmoid(g) * u, x12.dtype, out)


def swiglu_backward(x12: torch.Tensor, dh: torch.Tensor, dx12_out: torch.Tensor | None = None):
    g, u = _split(x12)  # copies: safe even when dx12_out aliases x12
    d = dh.to(g.dtype)
    s = torch.sigmoid(g)
    silu = g * s
    h = (silu * u).to(x12.dtype)
    dg = d * u * s * (1 + g * (1 - s))
    du = d * silu
    H = g.shape[1]
    if dx12_out is None:
        dx12 = torch.cat([dg, du], dim=1).to(x12.dtype)
    else:
        dx12 = dx12_out
        dx12[:, :H].copy_(dg)
        dx12[:, H:].copy_(du)
    return dx12, h
