"""The contenders, built with the same weights, and the runners that call them.

- ``eager_hf``: three ``nn.Linear`` and ``silu(gate) * up`` (Hugging Face style)
- ``eager_packed``: one ``nn.Linear`` to 2H, ``chunk``, ``silu(gate) * up``
- ``torch_compile``: ``torch.compile(eager_hf, dynamic=False)``
- ``liger``: Liger-Kernel's ``LigerSwiGLUMLP`` (when ``liger_kernel`` imports)
- ``swiglu_cupy``: this package's ``SwiGLU``

and ``swiglu_cupy_fp8``: the same with ``saved_x12="fp8"`` (timed in the
CPU-path ratios' forward+backward, next to the default mode)

and ``gemm_lower_bound``: the GEMMs of ``SwiGLUFunction`` alone (``torch.mm``
into preallocated tensors): forward x@w12.T (gate and up in one GEMM) and
h@w3.T; backward dh = dy@w3, dx = dx12@w12, dw12 = dx12.T@x, dw3 = dy.T@h.
"""
from __future__ import annotations

import types
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from ..._dtypes import FP8_SAVED_X12_DTYPES

LOWER_BOUND = "gemm_lower_bound"
OURS = "swiglu_cupy"
OURS_FP8 = "swiglu_cupy_fp8"
CONTENDERS = ("eager_hf", "eager_packed", "torch_compile", "liger", "swiglu_cupy")
LABELS = {
    LOWER_BOUND: "GEMMs only (lower bound)",
    "eager_hf": "eager, 3x Linear (HF)",
    "eager_packed": "eager, packed w12",
    "torch_compile": "torch.compile(eager HF)",
    "liger": "Liger LigerSwiGLUMLP",
    "swiglu_cupy": "swiglu-cupy SwiGLU",
    OURS_FP8: "swiglu-cupy SwiGLU, saved_x12='fp8'",
}


class Unavailable(Exception):
    """A contender that cannot run here; the message is the reason."""


class EagerHF(nn.Module):
    def __init__(self, D: int, H: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(D, H, bias=False)
        self.up_proj = nn.Linear(D, H, bias=False)
        self.down_proj = nn.Linear(H, D, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _load_gate_up_down(module: nn.Module, weights) -> nn.Module:
    """Copy (gate, up, down) into a module with HF-style gate_proj/up_proj/down_proj."""
    with torch.no_grad():
        for name, w in zip(("gate_proj", "up_proj", "down_proj"), weights):
            getattr(module, name).weight.copy_(w)
    return module


class EagerPacked(nn.Module):
    def __init__(self, D: int, H: int) -> None:
        super().__init__()
        self.w12 = nn.Linear(D, 2 * H, bias=False)
        self.w3 = nn.Linear(H, D, bias=False)

    def forward(self, x):
        gate, up = self.w12(x).chunk(2, dim=-1)
        return self.w3(F.silu(gate) * up)


def ours_implementation(device: torch.device) -> str:
    if device.type != "cuda":
        return "torch implementation (CPU tensors)"
    from ...kernels.launch import cuda_kernels_available
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            ok = cuda_kernels_available()
        except Exception as exc:  # strict mode raises
            return f"unavailable: {exc}"
    return "CuPy kernels" if ok else "torch fallback (CuPy not importable)"


def build_module(name: str, D: int, H: int, dtype: torch.dtype, device: torch.device, weights):
    """The contender ``name`` on ``device`` holding ``weights`` = (gate, up, down)."""
    def eager_hf():
        with torch.device(device):
            return _load_gate_up_down(EagerHF(D, H).to(dtype), weights)

    if name == "eager_hf":
        return eager_hf()
    if name == "torch_compile":
        torch.compiler.reset()  # one compiled module at a time; no recompile limits
        return torch.compile(eager_hf(), dynamic=False)
    if name == "eager_packed":
        with torch.device(device):
            m = EagerPacked(D, H).to(dtype)
        with torch.no_grad():
            m.w12.weight.copy_(torch.cat(weights[:2]))
            m.w3.weight.copy_(weights[2])
        return m
    if name == "liger":
        try:
            from liger_kernel.transformers.swiglu import LigerSwiGLUMLP
        except Exception as exc:
            raise Unavailable(f"liger_kernel is not importable ({type(exc).__name__}: {exc})") from None
        if device.type != "cuda":
            raise Unavailable("Liger-Kernel runs Triton kernels, which need a CUDA device")
        config = types.SimpleNamespace(hidden_size=D, intermediate_size=H, hidden_act="silu")
        with torch.device(device):
            return _load_gate_up_down(LigerSwiGLUMLP(config).to(dtype), weights)
    if name == "swiglu_cupy":
        from ...dense.module import SwiGLU
        impl = ours_implementation(device)
        if impl.startswith("unavailable"):
            raise Unavailable(impl)
        hf = eager_hf()
        return SwiGLU.from_gate_up_down(hf.gate_proj, hf.up_proj, hf.down_proj)
    if name == OURS_FP8:
        if dtype not in FP8_SAVED_X12_DTYPES:
            raise Unavailable(f"saved_x12='fp8' takes float32, bfloat16 or float16 compute, not {dtype}")
        module = build_module(OURS, D, H, dtype, device, weights)
        module.saved_x12 = "fp8"
        return module
    raise ValueError(f"unknown contender {name!r}")


class ModuleRunner:
    def __init__(self, module: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> None:
        self.module, self.x, self.dy = module, x, dy
        self.params = [p for p in module.parameters()]

    def zero(self):
        for p in self.params:
            p.grad = None
        self.x.grad = None

    def fwd(self):
        return self.module(self.x)

    def bwd(self, y):
        y.backward(self.dy)

    def fwd_bwd(self, _=None):
        self.module(self.x).backward(self.dy)

    def nograd(self):
        with torch.no_grad():
            return self.module(self.x)


class GemmRunner:
    """The GEMMs of SwiGLUFunction alone, on preallocated tensors."""

    def __init__(self, D: int, H: int, M: int, dtype: torch.dtype, device: torch.device, weights) -> None:
        wg, wu, wd = weights
        new = lambda *s: torch.randn(*s, dtype=dtype, device=device)  # noqa: E731
        self.x, self.dy = new(M, D), new(M, D)
        self.w12 = torch.cat([wg, wu]).contiguous()
        self.w3 = wd.contiguous()
        self.x12, self.h, self.y = new(M, 2 * H), new(M, H), new(M, D)
        self.dh, self.dx12, self.dx = new(M, H), new(M, 2 * H), new(M, D)
        self.dw12, self.dw3 = torch.empty_like(self.w12), torch.empty_like(self.w3)

    def zero(self):
        pass

    def fwd(self):
        torch.mm(self.x, self.w12.t(), out=self.x12)
        torch.mm(self.h, self.w3.t(), out=self.y)
        return self.y

    def bwd(self, _=None):
        torch.mm(self.dy, self.w3, out=self.dh)
        torch.mm(self.dx12, self.w12, out=self.dx)
        torch.mm(self.dx12.t(), self.x, out=self.dw12)
        torch.mm(self.dy.t(), self.h, out=self.dw3)

    def fwd_bwd(self, _=None):
        self.fwd()
        self.bwd()

    def nograd(self):
        return self.fwd()


def master_weights(D: int, H: int, dtype: torch.dtype, device: torch.device):
    g = torch.Generator(device=device).manual_seed(0)
    scale_in, scale_out = D ** -0.5, H ** -0.5
    wg = (torch.randn(H, D, generator=g, device=device, dtype=torch.float32) * scale_in).to(dtype)
    wu = (torch.randn(H, D, generator=g, device=device, dtype=torch.float32) * scale_in).to(dtype)
    wd = (torch.randn(D, H, generator=g, device=device, dtype=torch.float32) * scale_out).to(dtype)
    return wg, wu, wd
