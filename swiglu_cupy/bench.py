"""``python -m swiglu_cupy bench``: SwiGLU feed-forward contenders measured in one run.

Contenders (all with the same weights, no biases, as in Llama):

- ``eager_hf``: three ``nn.Linear`` and ``silu(gate) * up`` (Hugging Face style)
- ``eager_packed``: one ``nn.Linear`` to 2H, ``chunk``, ``silu(gate) * up``
- ``torch_compile``: ``torch.compile(eager_hf, dynamic=False)``
- ``liger``: Liger-Kernel's ``LigerSwiGLUMLP`` (when ``liger_kernel`` imports)
- ``swiglu_cupy``: this package's ``SwiGLU``

and ``gemm_lower_bound``: the GEMMs of ``SwiGLUFunction`` alone (``torch.mm``
into preallocated tensors): forward x@w12.T (gate and up in one GEMM) and
h@w3.T; backward dh = dy@w3, dx = dx12@w12, dw12 = dx12.T@x, dw3 = dy.T@h.

Measured: forward, backward and forward+backward time (CUDA events, or
``time.perf_counter`` on CPU; median, p10-p90, min/max over repeats after
warm-up), the elementwise kernels' bandwidth against a device copy, peak
memory (fwd+bwd and no-grad forward), host overhead per call at a tiny shape,
and the kernels' cold-compile and warm-start time in fresh processes.
Anything that needs CUDA is recorded as null with the reason on CPU.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import types
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

PRESETS = {
    "llama7b": (4096, 11008),
    "llama3-8b": (4096, 14336),
    "llama13b": (5120, 13824),
    "llama70b": (8192, 28672),
}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
LOWER_BOUND = "gemm_lower_bound"
CONTENDERS = ("eager_hf", "eager_packed", "torch_compile", "liger", "swiglu_cupy")
LABELS = {
    LOWER_BOUND: "GEMMs only (lower bound)",
    "eager_hf": "eager, 3x Linear (HF)",
    "eager_packed": "eager, packed w12",
    "torch_compile": "torch.compile(eager HF)",
    "liger": "Liger LigerSwiGLUMLP",
    "swiglu_cupy": "swiglu-cupy SwiGLU",
}
SMOKE_SHAPE = (64, 176, 32, "fp32")         # D, H, M, dtype: the CPU smoke configuration
OVERHEAD_SHAPE = (64, 64, 1)                # D, H, M for the host-overhead measurement
NEEDS_CUDA = "needs CUDA (running on CPU)"


# --------------------------------------------------------------------------- arguments

def _int_at_least(minimum: int, what: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value
    return parse


_positive_int = _int_at_least(1, "a positive integer")
_non_negative_int = _int_at_least(0, "an integer >= 0")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", nargs="+", choices=list(PRESETS), metavar="NAME",
                   help=f"model shapes: {', '.join(f'{k} (D={d}, H={h})' for k, (d, h) in PRESETS.items())}")
    p.add_argument("--dim", type=_positive_int, help="custom model dim D (with --hidden)")
    p.add_argument("--hidden", type=_positive_int, help="custom hidden dim H (with --dim)")
    p.add_argument("--tokens", nargs="+", type=_positive_int, metavar="M",
                   help="tokens per call (M = batch x sequence), one or more")
    p.add_argument("--dtype", nargs="+", choices=list(DTYPES), metavar="DTYPE",
                   help="fp16, bf16 or fp32, one or more (default bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="cuda, or cpu for a tiny smoke run (default: cuda when available)")
    p.add_argument("--quick", action="store_true",
                   help="llama7b and llama3-8b, bf16, 8192 tokens, few repeats (a few minutes on one GPU)")
    p.add_argument("--repeats", type=_positive_int, help="timed repeats per measurement")
    p.add_argument("--warmup", type=_non_negative_int, help="untimed warm-up calls per measurement")
    p.add_argument("--skip", nargs="+", choices=list(CONTENDERS), default=[], metavar="NAME",
                   help=f"contenders to leave out: {', '.join(CONTENDERS)}")
    p.add_argument("--out", default="bench-results", help="directory for bench.json, bench.txt and bench.png")


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


def resolve(args: argparse.Namespace) -> tuple[list[Shape], Settings]:
    """Shapes and settings from the arguments; raises ValueError for bad combinations."""
    if (args.dim is None) != (args.hidden is None):
        raise ValueError("--dim and --hidden go together (a custom shape needs both)")
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: no CUDA device is available to torch "
                           "(torch.cuda.is_available() is False); use --device cpu for the smoke run")
    on_cpu = device == "cpu"
    explicit_shape = bool(args.preset) or args.dim is not None
    dims: list[tuple[str, int, int]] = []
    if args.preset:
        dims += [(name, *PRESETS[name]) for name in args.preset]
    if args.dim is not None:
        dims.append(("custom", args.dim, args.hidden))
    if not dims:
        if on_cpu:
            dims = [("smoke", SMOKE_SHAPE[0], SMOKE_SHAPE[1])]
        elif args.quick:
            dims = [("llama7b", *PRESETS["llama7b"]), ("llama3-8b", *PRESETS["llama3-8b"])]
        else:
            dims = [(name, *dh) for name, dh in PRESETS.items()]
    if args.tokens:
        tokens = args.tokens
    elif on_cpu and not explicit_shape:
        tokens = [SMOKE_SHAPE[2]]
    elif args.quick:
        tokens = [8192]
    else:
        tokens = [2048, 8192] if not on_cpu else [SMOKE_SHAPE[2]]
    dtypes = args.dtype or ([SMOKE_SHAPE[3]] if on_cpu else ["bf16"])
    shapes = [Shape(name, D, H, M, dt) for dt in dtypes for (name, D, H) in dims for M in tokens]
    if on_cpu:
        settings = Settings(device, args.quick, 1, 3, 200, 32)
    elif args.quick:
        settings = Settings(device, True, 3, 10, 1000, 512)
    else:
        settings = Settings(device, False, 5, 30, 2000, 512)
    if args.warmup is not None:
        settings.warmup = args.warmup
    if args.repeats is not None:
        settings.repeats = args.repeats
    return shapes, settings


# --------------------------------------------------------------------------- timing

def stats(samples_ms: list[float]) -> dict:
    a = np.asarray(samples_ms, dtype=np.float64)
    return {
        "median": float(np.median(a)), "p10": float(np.percentile(a, 10)),
        "p90": float(np.percentile(a, 90)), "min": float(a.min()), "max": float(a.max()),
        "mean": float(a.mean()), "n": int(a.size),
    }


class Clock:
    """Times ``timed(prepare())`` per repeat: CUDA events on a GPU, perf_counter on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def wall(self, fn) -> float:
        """Seconds of one synchronized call."""
        self.sync()
        start = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - start

    def samples(self, timed, prepare=None, warmup: int = 1, repeats: int = 3) -> list[float]:
        for _ in range(warmup):
            state = prepare() if prepare else None
            timed(state)
            del state
        self.sync()
        if self.cuda:
            pairs = []
            for _ in range(repeats):
                state = prepare() if prepare else None
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                timed(state)
                end.record()
                pairs.append((start, end))
                del state
            self.sync()
            return [start.elapsed_time(end) for start, end in pairs]
        out = []
        for _ in range(repeats):
            state = prepare() if prepare else None
            start = time.perf_counter()
            timed(state)
            out.append((time.perf_counter() - start) * 1e3)
            del state
        return out


# --------------------------------------------------------------------------- contenders

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
    from ._launch import cuda_kernels_available
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
        torch._dynamo.reset()  # one compiled module at a time; no recompile limits
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
        from .module import SwiGLU
        impl = ours_implementation(device)
        if impl.startswith("unavailable"):
            raise Unavailable(impl)
        hf = eager_hf()
        return SwiGLU.from_gate_up_down(hf.gate_proj, hf.up_proj, hf.down_proj)
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


def peak_memory(clock: Clock, run, reset) -> int:
    """Bytes allocated at the peak of ``run()`` above what was allocated before
    it, after ``reset()`` (run once first, so lazy initialization and compiles
    are excluded). Gradients ``run`` leaves behind count in the peak."""
    run()
    reset()
    gc.collect()
    clock.sync()
    torch.cuda.reset_peak_memory_stats(clock.device)
    base = torch.cuda.memory_allocated(clock.device)
    run()
    clock.sync()
    return int(torch.cuda.max_memory_allocated(clock.device) - base)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    return first[:300]


def measure_runner(runner, clock: Clock, settings: Settings, lower_bound: bool) -> dict:
    res: dict = {"null_reasons": {}}
    w, r = settings.warmup, settings.repeats
    res["first_call_s"] = clock.wall(lambda: (runner.zero(), runner.fwd_bwd()))
    res["fwd_ms"] = stats(clock.samples(lambda _: runner.fwd(), runner.zero, w, r))
    res["bwd_ms"] = stats(clock.samples(runner.bwd, lambda: (runner.zero(), runner.fwd())[1], w, r))
    res["fwd_bwd_ms"] = stats(clock.samples(runner.fwd_bwd, runner.zero, w, r))
    for key in ("peak_mem_fwd_bwd_bytes", "peak_mem_nograd_fwd_bytes"):
        res[key] = None
    if not clock.cuda:
        res["null_reasons"]["peak_mem_fwd_bwd_bytes"] = NEEDS_CUDA
        res["null_reasons"]["peak_mem_nograd_fwd_bytes"] = NEEDS_CUDA
    elif lower_bound:
        reason = "every tensor is preallocated: nothing is allocated"
        res["null_reasons"]["peak_mem_fwd_bwd_bytes"] = reason
        res["null_reasons"]["peak_mem_nograd_fwd_bytes"] = reason
    else:
        runner.zero()
        res["peak_mem_fwd_bwd_bytes"] = peak_memory(clock, runner.fwd_bwd, runner.zero)
        res["peak_mem_nograd_fwd_bytes"] = peak_memory(clock, runner.nograd, runner.zero)
    runner.zero()
    return res


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    y, ref = y.detach().float(), ref.detach().float()
    return float((y - ref).norm() / ref.norm().clamp_min(1e-30))


def bench_shape(shape: Shape, clock: Clock, settings: Settings, skip, progress) -> dict:
    device, dtype = clock.device, DTYPES[shape.dtype]
    D, H, M = shape.D, shape.H, shape.M
    out = {"shape": asdict(shape), "contenders": {}}
    weights = master_weights(D, H, dtype, device)

    progress(f"{shape.label()} {LOWER_BOUND}")
    try:
        runner = GemmRunner(D, H, M, dtype, device, weights)
        entry = measure_runner(runner, clock, settings, lower_bound=True)
        entry.update(available=True, reason=None, label=LABELS[LOWER_BOUND])
    except Exception as exc:
        entry = {"available": False, "reason": f"failed: {_short(exc)}", "label": LABELS[LOWER_BOUND]}
    out["contenders"][LOWER_BOUND] = entry
    runner = None
    free_memory(device)

    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(M, D, generator=g, device=device, dtype=torch.float32).to(dtype).requires_grad_(True)
    dy = torch.randn(M, D, generator=g, device=device, dtype=torch.float32).to(dtype)
    ref = None
    for name in CONTENDERS:
        progress(f"{shape.label()} {name}")
        entry = {"label": LABELS[name]}
        if name in skip:
            entry.update(available=False, reason="skipped (--skip)")
            out["contenders"][name] = entry
            continue
        module = runner = None
        try:
            module = build_module(name, D, H, dtype, device, weights)
            runner = ModuleRunner(module, x, dy)
            # first_call_s (in measure_runner) includes torch.compile / kernel compiles.
            entry.update(measure_runner(runner, clock, settings, lower_bound=False))
            y = runner.fwd().detach()  # grad mode as timed (no extra torch.compile graph)
            if ref is None and name == "eager_hf":
                ref = y.clone()
            err = relative_error(y, ref) if ref is not None else None
            del y
            entry.update(available=True, reason=None, rel_err_vs_eager_hf=err)
            if name == "swiglu_cupy":
                entry["implementation"] = ours_implementation(device)
        except Unavailable as exc:
            entry.update(available=False, reason=str(exc))
        except Exception as exc:
            entry.update(available=False, reason=f"failed: {_short(exc)}")
        out["contenders"][name] = entry
        module = runner = None
        free_memory(device)

    progress(f"{shape.label()} elementwise bandwidth")
    try:
        out["elementwise"] = bench_elementwise(shape, clock, settings)
    except Exception as exc:
        out["elementwise"] = {"error": f"failed: {_short(exc)}"}
    x = dy = ref = weights = None
    free_memory(device)
    return out


def bench_elementwise(shape: Shape, clock: Clock, settings: Settings) -> dict:
    """The primitives alone: forward reads 2H and writes H elements per token;
    backward reads 2H (x12) + H (dh) and writes 2H (dx12) + H (h)."""
    from . import primitives

    device, dtype = clock.device, DTYPES[shape.dtype]
    M, H = shape.M, shape.H
    size = torch.finfo(dtype).bits // 8
    x12 = torch.randn(M, 2 * H, device=device, dtype=dtype)
    dh = torch.randn(M, H, device=device, dtype=dtype)
    h = torch.empty(M, H, device=device, dtype=dtype)
    dx12 = torch.empty(M, 2 * H, device=device, dtype=dtype)
    w, r = settings.warmup, settings.repeats
    fwd = stats(clock.samples(lambda _: primitives.swiglu_forward(x12, out=h), None, max(w, 1), r))
    bwd = stats(clock.samples(lambda _: primitives.swiglu_backward(x12, dh, dx12_out=dx12),
                              None, max(w, 1), r))
    fwd_bytes, bwd_bytes = M * 3 * H * size, M * 6 * H * size
    return {
        "implementation": ours_implementation(device),
        "fwd_ms": fwd, "bwd_ms": bwd, "fwd_bytes": fwd_bytes, "bwd_bytes": bwd_bytes,
        "fwd_gbps": fwd_bytes / (fwd["median"] * 1e-3) / 1e9,
        "bwd_gbps": bwd_bytes / (bwd["median"] * 1e-3) / 1e9,
    }


def bench_copy(clock: Clock, settings: Settings) -> dict:
    """Device-to-device copy bandwidth: dst.copy_(src), read + write bytes."""
    nbytes = settings.copy_mib * 2**20
    src = torch.empty(nbytes, dtype=torch.uint8, device=clock.device).random_(0, 255)
    dst = torch.empty_like(src)
    t = stats(clock.samples(lambda _: dst.copy_(src), None, max(settings.warmup, 1), max(settings.repeats, 5)))
    return {"buffer_bytes": nbytes, "ms": t, "gbps": 2 * nbytes / (t["median"] * 1e-3) / 1e9}


def bench_overhead(clock: Clock, settings: Settings, dtype_name: str, skip, progress) -> dict:
    """Wall-clock time per forward call (grad enabled) at a tiny shape, averaged over many calls."""
    D, H, M = OVERHEAD_SHAPE
    device, dtype = clock.device, DTYPES[dtype_name]
    calls = settings.overhead_calls
    out = {"shape": {"D": D, "H": H, "M": M, "dtype": dtype_name}, "calls": calls,
           "mode": "forward with grad enabled (weights require grad), synchronized once after all calls",
           "us_per_call": {}, "null_reasons": {}}
    weights = master_weights(D, H, dtype, device)
    for name in (LOWER_BOUND, *CONTENDERS):
        progress(f"host overhead M={M} D={D} H={H} {dtype_name} {name}")
        if name in skip:
            out["us_per_call"][name] = None
            out["null_reasons"][name] = "skipped (--skip)"
            continue
        try:
            if name == LOWER_BOUND:
                runner = GemmRunner(D, H, M, dtype, device, weights)
            else:
                x = torch.randn(M, D, device=device, dtype=dtype)
                runner = ModuleRunner(build_module(name, D, H, dtype, device, weights), x, x)
            for _ in range(max(settings.warmup, 1) + 10):
                runner.fwd()
            clock.sync()
            start = time.perf_counter()
            for _ in range(calls):
                runner.fwd()
            clock.sync()
            out["us_per_call"][name] = (time.perf_counter() - start) / calls * 1e6
        except Unavailable as exc:
            out["us_per_call"][name] = None
            out["null_reasons"][name] = str(exc)
        except Exception as exc:
            out["us_per_call"][name] = None
            out["null_reasons"][name] = f"failed: {_short(exc)}"
        runner = None
    if "torch_compile" not in skip:
        torch._dynamo.reset()
    return out


_COMPILE_PROBE = r"""
import json, sys, time
start = time.perf_counter()
import torch
import swiglu_cupy as sc
import_s = time.perf_counter() - start
dtype = getattr(torch, sys.argv[1])
dev = torch.device("cuda")
# Initialize CUDA, cuBLAS and autograd first so the timing below is the kernels' own.
lin = torch.nn.Linear(64, 128, bias=False, device=dev, dtype=dtype)
xx = torch.randn(8, 64, device=dev, dtype=dtype, requires_grad=True)
lin(xx).backward(torch.ones(8, 128, device=dev, dtype=dtype))
torch.cuda.synchronize()
m = sc.SwiGLU(64, 64, bias=False, device=dev, dtype=dtype)
x = torch.randn(8, 64, device=dev, dtype=dtype, requires_grad=True)
dy = torch.ones(8, 64, device=dev, dtype=dtype)
def call():
    t = time.perf_counter()
    m(x).backward(dy)
    torch.cuda.synchronize()
    return time.perf_counter() - t
first = call()
second = call()
from swiglu_cupy._launch import cupy_launcher
print("PROBE " + json.dumps({"import_s": import_s, "first_call_s": first, "second_call_s": second,
                             "modules_compiled_or_loaded": cupy_launcher().compile_count}))
"""


def _run_probe(dtype: torch.dtype, env: dict) -> dict:
    pkg_parent = str(Path(__file__).resolve().parent.parent)
    env = dict(env)
    env["PYTHONPATH"] = pkg_parent + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["SWIGLU_CUPY_STRICT"] = "1"
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _COMPILE_PROBE, str(dtype).replace("torch.", "")],
                          env=env, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - start
    for line in proc.stdout.splitlines():
        if line.startswith("PROBE "):
            result = json.loads(line[len("PROBE "):])
            result["process_wall_s"] = wall
            return result
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    raise RuntimeError(f"probe exited {proc.returncode}: {' | '.join(tail)}")


def bench_compile(clock: Clock, dtype_name: str) -> dict:
    """First SwiGLU fwd+bwd in a fresh process: with an empty CuPy cache (cold
    compile) and again with the cache that run populated (warm start)."""
    out = {"dtype": dtype_name, "cold": None, "warm": None, "null_reasons": {}}
    if not clock.cuda:
        out["null_reasons"] = {"cold": NEEDS_CUDA + ": the kernels compile for CUDA tensors only",
                               "warm": NEEDS_CUDA + ": the kernels compile for CUDA tensors only"}
        return out
    with tempfile.TemporaryDirectory(prefix="swiglu-cupy-cache-") as cache:
        env = dict(os.environ)
        env["CUPY_CACHE_DIR"] = cache
        env["CUPY_CACHE_IN_MEMORY"] = "0"
        cold_env = dict(env, CUDA_CACHE_DISABLE="1")  # no driver JIT cache either
        for key, e in (("cold", cold_env), ("warm", env)):
            try:
                out[key] = _run_probe(DTYPES[dtype_name], e)
            except Exception as exc:
                out["null_reasons"][key] = f"failed: {_short(exc)}"
    return out


# --------------------------------------------------------------------------- environment

def _version(module: str):
    try:
        mod = __import__(module)
        return getattr(mod, "__version__", "unknown")
    except Exception:
        return None


def environment(device: torch.device) -> dict:
    from ._version import __version__

    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(device),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cupy": _version("cupy"),
        "cuda_runtime": None,
        "nvrtc": None,
        "driver": None,
        "gpu_name": None,
        "gpu_capability": None,
        "gpu_memory_bytes": None,
        "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "swiglu_cupy": __version__,
        "liger_kernel": _version("liger_kernel"),
        "numpy": np.__version__,
        "torch_threads": torch.get_num_threads(),
        "git_commit": None,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["gpu_name"] = props.name
        env["gpu_capability"] = f"{props.major}.{props.minor}"
        env["gpu_memory_bytes"] = int(props.total_memory)
        try:
            import cupy
            rt = cupy.cuda.runtime.runtimeGetVersion()
            env["cuda_runtime"] = f"{rt // 1000}.{rt % 1000 // 10}"
            major, minor = cupy.cuda.nvrtc.getVersion()
            env["nvrtc"] = f"{major}.{minor}"
            dv = cupy.cuda.runtime.driverGetVersion()
            env["driver"] = f"CUDA {dv // 1000}.{dv % 1000 // 10}"
        except Exception:
            pass
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30)
            if smi.returncode == 0 and smi.stdout.strip():
                version = smi.stdout.strip().splitlines()[0]
                env["driver"] = version + (f" ({env['driver']})" if env["driver"] else "")
        except Exception:
            pass
    try:
        git = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent)
        if git.returncode == 0:
            env["git_commit"] = git.stdout.strip()
    except Exception:
        pass
    return env


# --------------------------------------------------------------------------- report

def _ms(s) -> str:
    if not s:
        return "-"
    return f"{s['median']:.3f} ({s['p10']:.3f}-{s['p90']:.3f})"


def _mib(b) -> str:
    return "-" if b is None else f"{b / 2**20:.1f}"


def format_table(report: dict) -> str:
    lines = []
    env = report["environment"]
    where = env["gpu_name"] or f"CPU ({env['cpu']})"
    lines.append(f"swiglu-cupy bench  {env['date']}  {where}  torch {env['torch']}  cupy {env['cupy']}")
    lines.append("times in ms: median (p10-p90); 'x GEMM' = fwd+bwd median / GEMM lower bound; "
                 "memory = peak above baseline, MiB")
    names = (LOWER_BOUND, *CONTENDERS)
    width = max(len(LABELS[n]) for n in names)
    for res in report["results"]:
        s = res["shape"]
        lines.append("")
        lines.append(f"== {s['name']}  D={s['D']} H={s['H']} M={s['M']} {s['dtype']}")
        lines.append(f"{'contender':<{width}}  {'fwd':>24}  {'bwd':>24}  {'fwd+bwd':>24}  "
                     f"{'x GEMM':>6}  {'mem fwd+bwd':>11}  {'mem no-grad':>11}  {'rel err':>8}")
        bound = res["contenders"].get(LOWER_BOUND, {}).get("fwd_bwd_ms")
        for name in names:
            e = res["contenders"].get(name)
            if e is None:
                continue
            if not e.get("available"):
                lines.append(f"{LABELS[name]:<{width}}  absent: {e.get('reason')}")
                continue
            ratio = (f"{e['fwd_bwd_ms']['median'] / bound['median']:.2f}" if bound else "-")
            err = e.get("rel_err_vs_eager_hf")
            lines.append(f"{LABELS[name]:<{width}}  {_ms(e['fwd_ms']):>24}  {_ms(e['bwd_ms']):>24}  "
                         f"{_ms(e['fwd_bwd_ms']):>24}  {ratio:>6}  {_mib(e['peak_mem_fwd_bwd_bytes']):>11}  "
                         f"{_mib(e['peak_mem_nograd_fwd_bytes']):>11}  "
                         f"{'-' if err is None else f'{err:.1e}':>8}")
    copy = report.get("copy")
    lines.append("")
    if copy and copy.get("gbps"):
        lines.append(f"device copy (dst.copy_(src), {copy['buffer_bytes'] // 2**20} MiB): {copy['gbps']:.1f} GB/s")
    lines.append("elementwise primitives (fwd: read 2H + write H; bwd: read 3H + write 3H elements per token):")
    for res in report["results"]:
        el = res.get("elementwise") or {}
        if "fwd_gbps" not in el:
            lines.append(f"  {res['shape']['name']} M={res['shape']['M']}: {el.get('error', 'not measured')}")
            continue
        pct = lambda v: f" ({100 * v / copy['gbps']:.0f}% of copy)" if copy and copy.get("gbps") else ""  # noqa: E731
        s = res["shape"]
        lines.append(f"  {s['name']} {s['dtype']} M={s['M']} [{el['implementation']}]: "
                     f"fwd {el['fwd_ms']['median']:.3f} ms {el['fwd_gbps']:.1f} GB/s{pct(el['fwd_gbps'])}; "
                     f"bwd {el['bwd_ms']['median']:.3f} ms {el['bwd_gbps']:.1f} GB/s{pct(el['bwd_gbps'])}")
    for ov in report.get("host_overhead", []):
        s = ov["shape"]
        lines.append(f"host overhead per forward call (M={s['M']}, D={s['D']}, H={s['H']}, {s['dtype']}, "
                     f"{ov['calls']} calls):")
        for name, us in ov["us_per_call"].items():
            text = f"{us:.1f} us" if us is not None else f"- ({ov['null_reasons'].get(name)})"
            lines.append(f"  {LABELS[name]:<{width}}  {text}")
    for comp in report.get("compile", []):
        parts = []
        for key in ("cold", "warm"):
            r = comp.get(key)
            parts.append(f"{key} {r['first_call_s']:.2f} s" if r else
                         f"{key} - ({comp['null_reasons'].get(key)})")
        lines.append(f"kernel compile, first fwd+bwd in a new process ({comp['dtype']}): {'; '.join(parts)}")
    lines.append(f"total bench time: {report['wall_s']:.1f} s")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> str | None:
    """Writes the PNG; returns None, or the reason nothing was written."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:
        return f"matplotlib is not importable ({_short(exc)}): install it with `pip install matplotlib`"
    names = [n for n in (LOWER_BOUND, *CONTENDERS)
             if any(r["contenders"].get(n, {}).get("available") for r in report["results"])]
    groups = [f"{r['shape']['name']}\n{r['shape']['dtype']} M={r['shape']['M']}" for r in report["results"]]
    panels = [("fwd_ms", "forward (ms)"), ("bwd_ms", "backward (ms)"), ("fwd_bwd_ms", "forward + backward (ms)"),
              ("peak_mem_fwd_bwd_bytes", "peak memory fwd+bwd (MiB)"),
              ("peak_mem_nograd_fwd_bytes", "peak memory no-grad forward (MiB)")]
    fig, axes = plt.subplots(2, 3, figsize=(18, 9))
    width = 0.8 / max(len(names), 1)
    for ax, (key, title) in zip(axes.flat, panels):
        ax.set_title(title)
        drawn = False
        for i, name in enumerate(names):
            xs, heights, lo, hi = [], [], [], []
            for g, res in enumerate(report["results"]):
                e = res["contenders"].get(name, {})
                value = e.get(key) if e.get("available") else None
                if value is None:
                    continue
                xs.append(g + (i - (len(names) - 1) / 2) * width)
                if key.endswith("_ms"):
                    heights.append(value["median"])
                    lo.append(value["median"] - value["p10"])
                    hi.append(value["p90"] - value["median"])
                else:
                    heights.append(value / 2**20)
                    lo.append(0.0)
                    hi.append(0.0)
            if xs:
                drawn = True
                ax.bar(xs, heights, width, label=LABELS[name], yerr=[lo, hi] if key.endswith("_ms") else None,
                       capsize=2)
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels(groups, fontsize=8)
        if not drawn:
            ax.set_yticks([])
            ax.text(0.5, 0.5, "not measured (needs CUDA)" if not key.endswith("_ms") else "no data",
                    ha="center", va="center", transform=ax.transAxes)
    absent = sorted({f"absent: {n} ({r['contenders'][n].get('reason', '')[:60]})"
                     for r in report["results"] for n in CONTENDERS
                     if n in r["contenders"] and not r["contenders"][n].get("available")})
    handles, labels = axes.flat[0].get_legend_handles_labels()
    last = axes.flat[5]
    last.axis("off")
    env = report["environment"]
    last.legend(handles, labels, loc="upper left", fontsize=9)
    last.text(0.0, 0.35, "\n".join([
        f"{env['gpu_name'] or 'CPU'}", f"torch {env['torch']}, cupy {env['cupy']}",
        f"CUDA {env['cuda_runtime'] or env['torch_cuda']}, driver {env['driver']}", env["date"],
        "bars: median; whiskers: p10-p90", *absent]), va="top", fontsize=9, transform=last.transAxes)
    fig.suptitle("SwiGLU feed-forward: swiglu-cupy and alternatives")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


# --------------------------------------------------------------------------- main

def run(args: argparse.Namespace) -> int:
    try:
        shapes, settings = resolve(args)
    except (ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device(settings.device)
    clock = Clock(device)
    skip = set(args.skip)
    if device.type == "cpu" and args.device == "auto":
        print("note: no CUDA device; running the CPU smoke configuration", file=sys.stderr)
    if device.type == "cpu":
        # One intra-op thread: on shared or CPU-quota'd machines more threads make
        # small CPU timings swing by orders of magnitude.
        torch.set_num_threads(1)
    if device.type == "cpu" and args.quick:
        print("note: --quick is a GPU preset; on CPU the smoke configuration runs", file=sys.stderr)

    dtypes = list(dict.fromkeys(s.dtype for s in shapes))
    total = len(shapes) * (len(CONTENDERS) + 2) + 1 + (len(CONTENDERS) + 1) + len(dtypes)
    step = [0]
    start = time.perf_counter()

    def progress(what: str) -> None:
        step[0] += 1
        print(f"[{step[0]}/{total} +{time.perf_counter() - start:.0f}s] {what} ...", file=sys.stderr, flush=True)

    report = {
        "schema": 1,
        "command": ["python", "-m", "swiglu_cupy", "bench", *sys.argv[2:]] if sys.argv[1:2] == ["bench"]
        else sys.argv,
        "settings": asdict(settings),
        "environment": environment(device),
        "contender_labels": {n: LABELS[n] for n in (LOWER_BOUND, *CONTENDERS)},
        "results": [],
    }
    for shape in shapes:
        report["results"].append(bench_shape(shape, clock, settings, skip, progress))
    progress("device copy bandwidth")
    try:
        report["copy"] = bench_copy(clock, settings)
    except Exception as exc:
        report["copy"] = {"gbps": None, "error": f"failed: {_short(exc)}"}
    report["host_overhead"] = [bench_overhead(clock, settings, dtypes[0], skip, progress)]
    report["compile"] = []
    for dt in dtypes:
        progress(f"kernel cold compile / warm start ({dt}, fresh processes)")
        report["compile"].append(bench_compile(clock, dt))
    report["wall_s"] = time.perf_counter() - start

    json_path, png_path, txt_path = out_dir / "bench.json", out_dir / "bench.png", out_dir / "bench.txt"
    reason = plot(report, png_path)
    report["plot"] = None if reason else png_path.name
    if reason:
        report["plot_missing_reason"] = reason
    json_path.write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
    table = format_table(report)
    txt_path.write_text(table + "\n")
    print(table)
    print(f"\nwrote {json_path}" + ("" if reason else f", {png_path}") + f", {txt_path}")
    if reason:
        print(f"no plot: {reason}", file=sys.stderr)
    return 0
