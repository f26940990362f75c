"""Slow eager references: the formulas in plain torch ops, for tests and
for users checking the fused op (layouts as in ``functions.py``)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["swiglu_reference", "silu_mul_reference", "glu_reference", "glu_ffn_reference", "split_gate_up"]


def swiglu_reference(x: torch.Tensor, w12: torch.Tensor, b12: torch.Tensor | None,
                     w3: torch.Tensor, b3: torch.Tensor | None) -> torch.Tensor:
    """The packed feed-forward in three torch ops."""
    gate, up = F.linear(x, w12, b12).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w3, b3)


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` (two torch ops)."""
    return F.silu(gate) * up


def split_gate_up(x12: torch.Tensor, activation) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up) views of a packed ``[..., 2H]`` tensor in the spec's layout."""
    from .activations import resolve_activation

    if resolve_activation(activation).interleaved:
        return x12[..., 0::2], x12[..., 1::2]
    return x12.chunk(2, dim=-1)


def glu_reference(gate: torch.Tensor, up: torch.Tensor, activation="silu") -> torch.Tensor:
    """``act(gate) * up`` for any ``GLUActivation`` (or a plain form's name),
    written as the models write it (HF's eager expressions), so autograd of
    this is the reference gradient, clamp boundaries included."""
    from .activations import resolve_activation

    spec = resolve_activation(activation)
    if spec.limit is not None:
        gate = gate.clamp(max=spec.limit)
        up = up.clamp(min=-spec.limit, max=spec.limit)
    if spec.kind == "oai":
        return (up + spec.up_offset) * (gate * torch.sigmoid(gate * spec.alpha))
    act = {"silu": F.silu, "gelu_tanh": lambda g: F.gelu(g, approximate="tanh"), "gelu": F.gelu,
           "relu": F.relu, "sigmoid": torch.sigmoid, "identity": lambda g: g}[spec.kind]
    return act(gate) * up


def glu_ffn_reference(x: torch.Tensor, w12: torch.Tensor, b12: torch.Tensor | None,
                      w3: torch.Tensor, b3: torch.Tensor | None, activation="silu") -> torch.Tensor:
    """The packed feed-forward with any activation spec (x12 in its layout)."""
    return F.linear(glu_reference(*split_gate_up(F.linear(x, w12, b12), activation), activation), w3, b3)
