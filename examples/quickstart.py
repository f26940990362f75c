"""Quickstart: a small stack of SwiGLU blocks trained for a few steps with
activation checkpointing, checked step by step against an eager reference.

    python examples/quickstart.py
"""
import copy

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import swiglu_cupy as sc
from swiglu_cupy import cuda_kernels_available


class EagerSwiGLU(nn.Module):
    """The same block written with plain torch ops (the reference)."""

    def __init__(self, fused: sc.SwiGLU):
        super().__init__()
        self.w12, self.w3 = copy.deepcopy(fused.w12), copy.deepcopy(fused.w3)

    def forward(self, x):
        return sc.swiglu_reference(x, self.w12.weight, self.w12.bias, self.w3.weight, self.w3.bias)


class Stack(nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(b.w12.in_features, device=b.w12.weight.device) for b in blocks)
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x):
        for norm, block in zip(self.norms, self.blocks):
            # Non-reentrant activation checkpointing around every block.
            x = x + checkpoint(block, norm(x), use_reentrant=False)
        return x


def main():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = ("CUDA kernels (CuPy)" if device == "cuda" and cuda_kernels_available()
            else f"torch implementation of the primitives on {device}")
    torch.manual_seed(0)
    dim, hidden, n_blocks, tokens = 128, 344, 4, 512
    fused = Stack([sc.SwiGLU(dim, hidden, device=device) for _ in range(n_blocks)])
    eager = copy.deepcopy(fused)
    eager.blocks = nn.ModuleList(EagerSwiGLU(b) for b in fused.blocks)

    opt_fused = torch.optim.AdamW(fused.parameters(), lr=1e-3)
    opt_eager = torch.optim.AdamW(eager.parameters(), lr=1e-3)
    x = torch.randn(tokens, dim, device=device)
    target = torch.randn(tokens, dim, device=device)

    print(f"swiglu-cupy {sc.__version__}: running on {device}, elementwise path: {path}")
    worst = 0.0
    for step in range(5):
        losses = []
        for model, opt in ((fused, opt_fused), (eager, opt_eager)):
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(model(x), target)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        rel = abs(losses[0] - losses[1]) / abs(losses[1])
        worst = max(worst, rel)
        print(f"step {step}: loss {losses[0]:.6f} (eager reference {losses[1]:.6f}, rel diff {rel:.1e})")
    matches = worst < 1e-4  # fp32 throughout: only rounding-order differences
    print(f"matches eager reference: {'yes' if matches else 'NO'} (worst rel diff {worst:.1e})")
    return 0 if matches else 1


if __name__ == "__main__":
    raise SystemExit(main())
