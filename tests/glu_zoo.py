"""GLU feed-forward modules as other projects define them, written here from
their published forward definitions (the real timm needs a torchvision build
that does not install beside the CPU torch used in CI; DINOv2 is not a
package). Each computes exactly what its original computes; parameter names
match the originals, so state_dict keys do too.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class TimmGluMlp(nn.Module):
    """timm.layers.mlp.GluMlp: packed ``fc1`` [2H, D]; ``gate_last=True`` (the
    default) makes the SECOND half the gate: ``x1 * act(x2)``. Optional norm
    between the product and ``fc2``; dropouts after each."""

    def __init__(self, in_features, hidden_features, out_features=None, act_layer=nn.Sigmoid,
                 norm_layer=None, bias=True, drop=0.0, gate_last=True):
        super().__init__()
        out_features = out_features or in_features
        assert hidden_features % 2 == 0
        self.chunk_dim = -1
        self.gate_last = gate_last
        self.fc1 = nn.Linear(in_features, hidden_features, bias=bias)
        self.act = act_layer()
        self.drop1 = nn.Dropout(drop)
        self.norm = norm_layer(hidden_features // 2) if norm_layer is not None else nn.Identity()
        self.fc2 = nn.Linear(hidden_features // 2, out_features, bias=bias)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x):
        x = self.fc1(x)
        x1, x2 = x.chunk(2, dim=self.chunk_dim)
        x = x1 * self.act(x2) if self.gate_last else self.act(x1) * x2
        x = self.drop1(x)
        x = self.norm(x)
        x = self.fc2(x)
        return self.drop2(x)


def timm_swiglu_packed(in_features, hidden_features, **kwargs):
    """timm.layers.mlp.SwiGLUPacked: GluMlp with SiLU and the gate first."""
    return TimmGluMlp(in_features, hidden_features, act_layer=nn.SiLU, gate_last=False, **kwargs)


class TimmSwiGLU(nn.Module):
    """timm.layers.mlp.SwiGLU: separate ``fc1_g`` (gate) and ``fc1_x`` (up)."""

    def __init__(self, in_features, hidden_features, out_features=None, act_layer=nn.SiLU,
                 norm_layer=None, bias=True, drop=0.0):
        super().__init__()
        out_features = out_features or in_features
        self.fc1_g = nn.Linear(in_features, hidden_features, bias=bias)
        self.fc1_x = nn.Linear(in_features, hidden_features, bias=bias)
        self.act = act_layer()
        self.drop1 = nn.Dropout(drop)
        self.norm = norm_layer(hidden_features) if norm_layer is not None else nn.Identity()
        self.fc2 = nn.Linear(hidden_features, out_features, bias=bias)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x):
        x_gate = self.fc1_g(x)
        x = self.fc1_x(x)
        x = self.act(x_gate) * x
        x = self.drop1(x)
        x = self.norm(x)
        x = self.fc2(x)
        return self.drop2(x)


class Dinov2SwiGLUFFN(nn.Module):
    """DINOv2's own ``SwiGLUFFN`` (what ``SwiGLUFFNFused`` subclasses when
    ``XFORMERS_DISABLED`` is set): ``w12`` -> chunk -> ``silu(x1) * x2`` -> ``w3``."""

    def __init__(self, in_features, hidden_features=None, out_features=None, act_layer=None,
                 drop=0.0, bias=True):
        super().__init__()
        out_features = out_features or in_features
        hidden_features = hidden_features or in_features
        self.w12 = nn.Linear(in_features, 2 * hidden_features, bias=bias)
        self.w3 = nn.Linear(hidden_features, out_features, bias=bias)

    def forward(self, x):
        x12 = self.w12(x)
        x1, x2 = x12.chunk(2, dim=-1)
        hidden = F.silu(x1) * x2
        return self.w3(hidden)


class TorchtitanFeedForward(nn.Module):
    """torchtitan / Meta Llama ``FeedForward``: ``w1`` gate, ``w3`` up, ``w2``
    down (the same names as xformers' with another meaning)."""

    def __init__(self, dim, hidden_dim):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class RenamedGeGLU(nn.Module):
    """A three-projection GLU under names no family uses, with GELU (tanh)."""

    def __init__(self, dim, hidden):
        super().__init__()
        self.wi_0 = nn.Linear(dim, hidden, bias=False)
        self.wi_1 = nn.Linear(dim, hidden, bias=False)
        self.wo = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.wo(F.gelu(self.wi_0(x), approximate="tanh") * self.wi_1(x))


class SwappedGateLookAlike(nn.Module):
    """Shaped like a Llama MLP but with gate and up swapped in the forward:
    a probe must leave it alone."""

    def __init__(self, dim, hidden):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.gate_proj(x) * self.act_fn(self.up_proj(x)))
