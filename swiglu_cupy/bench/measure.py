"""Timing and memory measurement: the clock, sample statistics, peak memory,
the device copy rate, and what is measured for each shape and contender."""
from __future__ import annotations

import gc
import time
from dataclasses import asdict

import numpy as np
import torch

from .config import DTYPES, OVERHEAD_SHAPE, Settings, Shape
from .contenders import (CONTENDERS, LABELS, LOWER_BOUND, GemmRunner, ModuleRunner, Unavailable,
                         build_module, master_weights, ours_implementation)

NEEDS_CUDA = "needs CUDA (running on CPU)"


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


def short_error(exc: BaseException) -> str:
    """A failure as one line of at most 300 characters, for a result's ``reason``."""
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
        entry = {"available": False, "reason": f"failed: {short_error(exc)}", "label": LABELS[LOWER_BOUND]}
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
            entry.update(available=False, reason=f"failed: {short_error(exc)}")
        out["contenders"][name] = entry
        module = runner = None
        free_memory(device)

    progress(f"{shape.label()} elementwise bandwidth")
    try:
        out["elementwise"] = bench_elementwise(shape, clock, settings)
    except Exception as exc:
        out["elementwise"] = {"error": f"failed: {short_error(exc)}"}
    x = dy = ref = weights = None
    free_memory(device)
    return out


def bench_elementwise(shape: Shape, clock: Clock, settings: Settings) -> dict:
    """The primitives alone: forward reads 2H and writes H elements per token;
    backward reads 2H (x12) + H (dh) and writes 2H (dx12) + H (h)."""
    from .. import primitives

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
            out["null_reasons"][name] = f"failed: {short_error(exc)}"
        runner = None
    if "torch_compile" not in skip:
        torch._dynamo.reset()
    return out
