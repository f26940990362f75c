"""What a bench run measures: model shapes, dtypes and the per-run settings."""
from __future__ import annotations

from dataclasses import dataclass

import torch

PRESETS = {
    "llama7b": (4096, 11008),
    "llama3-8b": (4096, 14336),
    "llama13b": (5120, 13824),
    "llama70b": (8192, 28672),
}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
SMOKE_SHAPE = (64, 176, 32, "fp32")         # D, H, M, dtype: the CPU smoke configuration
OVERHEAD_SHAPE = (64, 64, 1, "fp32")        # D, H, M, dtype for the host-overhead measurement
CPU_PATH_SHAPE = (512, 1408, 2048)          # D, H, M for the CPU-path ratios (bench --device cpu)
CPU_PATH_QUICK_TOKENS = 256                 # M of the CPU-path ratios under --quick (a look, not a measurement)
CPU_PATH_DTYPES = ("fp32", "bf16")
# bench --host-cost (CPU, one thread): the host time per call of the package's entry points, CUDA route
# and torch route, at decode shapes and a small training shape; D, H, M, dtype as above, where M may be
# x's leading dims: transformers' decoder layers call an MLP on [batch, tokens, D], (1, 1) when decoding.
HOST_COST_DECODE_SHAPE = (64, 176, 1, "fp32")
HOST_COST_HF_DECODE_SHAPE = (64, 176, (1, 1), "fp32")
HOST_COST_TRAIN_SHAPE = (256, 704, 64, "fp32")
HOST_COST_SHAPES = {"decode": HOST_COST_DECODE_SHAPE, "decode 3-D": HOST_COST_HF_DECODE_SHAPE,
                    "train": HOST_COST_TRAIN_SHAPE}
# Calls per timed block (--quick: HOST_COST_QUICK_CALLS).
HOST_COST_CALLS = {"decode": 50, "decode 3-D": 50, "train": 10}
HOST_COST_ROUNDS = 21                            # interleaved rounds behind each median (--repeats)
HOST_COST_WARMUP = 10                            # untimed calls per entry point, mode and route (--warmup)
HOST_COST_QUICK_CALLS, HOST_COST_QUICK_ROUNDS, HOST_COST_QUICK_WARMUP = 2, 2, 2   # --quick: a look, not a measurement
RATIO_REFERENCE = "eager_hf"                # ratios are ours / this contender
# Issue 11's goals for ours / eager HF, printed next to each measured ratio.
OVERHEAD_GOALS = {"grad": 1.25, "no_grad": 1.0}
CPU_PATH_GOALS = {("fwd_bwd", "fp32"): 1.05, ("fwd_bwd", "bf16"): 1.15,
                  ("nograd_fwd", "fp32"): 1.0, ("nograd_fwd", "bf16"): 1.0}


@dataclass
class Shape:
    name: str
    D: int
    H: int
    M: int
    dtype: str

    def label(self) -> str:
        return f"{self.name} {self.dtype} M={self.M}"


@dataclass
class Settings:
    device: str
    quick: bool
    warmup: int
    repeats: int
    overhead_calls: int     # calls per timed block of the host-overhead measurement
    copy_mib: int
    ratio_rounds: int = 7   # interleaved rounds behind each ratio's medians
    cpu_path_tokens: int = CPU_PATH_SHAPE[2]  # M of the CPU-path ratios
