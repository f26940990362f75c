"""Layer 3: the ``SwiGLU`` module."""
from __future__ import annotations

import torch
from torch import nn

from .interface import swiglu


class SwiGLU(nn.Module):
    """SwiGLU feed-forward block: ``w3(silu(gate(x)) * up(x))``.

    Holds ``w12 = nn.Linear(in_features, 2 * hidden_features)`` (gate rows
    first, then up rows) and ``w3 = nn.Linear(hidden_features, out_features)``,
    so its state_dict keys are ``w12.weight``, ``w12.bias``, ``w3.weight`` and
    ``w3.bias``: the layout of xformers' packed ``SwiGLU``.

    ``recompute_gate_up=True`` saves only x for backward (one extra GEMM);
    ``inplace_backward=True`` reuses the saved x12 for dx12 (single backward).
    """

    def __init__(self, in_features: int, hidden_features: int, out_features: int | None = None,
                 bias: bool = True, device=None, dtype=None, *,
                 recompute_gate_up: bool = False, inplace_backward: bool = False) -> None:
        super().__init__()
        for name, value in (("in_features", in_features), ("hidden_features", hidden_features),
                            ("out_features", out_features)):
            if value is None and name == "out_features":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        out_features = in_features if out_features is None else out_features
        self.recompute_gate_up, self.inplace_backward = recompute_gate_up, inplace_backward
        self.in_features, self.hidden_features, self.out_features = in_features, hidden_features, out_features
        self.w12 = nn.Linear(in_features, 2 * hidden_features, bias=bias, device=device, dtype=dtype)
        self.w3 = nn.Linear(hidden_features, out_features, bias=bias, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu(x, self.w12.weight, self.w12.bias, self.w3.weight, self.w3.bias,
                      recompute_gate_up=self.recompute_gate_up, inplace_backward=self.inplace_backward)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, hidden_features={self.hidden_features}, "
                f"out_features={self.out_features}, bias={self.w12.bias is not None}")
