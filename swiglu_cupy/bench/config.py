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
OVERHEAD_SHAPE = (64, 64, 1)                # D, H, M for the host-overhead measurement


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
    overhead_calls: int
    copy_mib: int
