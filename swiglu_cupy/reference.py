"""Slow eager references: the formulas in plain torch ops, for tests and
for users checking the fused op (layouts as in ``functions.py``)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["swiglu_reference", "silu_mul_reference"]


def swiglu_reference(x: torch.Tensor, w12: torch.Tensor, b12: torch.Tensor | None,
                     w3: torch.Tensor, b3: torch.Tensor | None) -> torch.Tensor:
    """The packed feed-forward in three torch ops."""
    gate, up = F.linear(x, w12, b12).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w3, b3)


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` (two torch ops)."""
    return F.silu(gate) * up
