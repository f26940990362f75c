"""Timing and memory measurement: the clock, sample statistics, peak memory,
the device copy rate, and what is measured for each shape and contender."""
from __future__ import annotations

import gc
import time
from dataclasses import asdict

import numpy as np
import torch

from ..._dtypes import FP8_SAVED_X12_DTYPES
from .config import (CPU_PATH_DTYPES, CPU_PATH_GOALS, CPU_PATH_SHAPE, DTYPES, OVERHEAD_GOALS, OVERHEAD_SHAPE,
                     RATIO_REFERENCE, Settings, Shape)
from .contenders import (CONTENDERS, LABELS, LOWER_BOUND, OURS, OURS_FP8, GemmRunner, ModuleRunner, Unavailable,
                         build_module, master_weights, ours_implementation)

NEEDS_CUDA = "needs CUDA (running on CPU)"


def stats(samples_ms: list[float]) -> dict:
    a = np.asarray(samples_ms, dtype=np.float64)
    return {
        "median": float(np.median(a)), "p10": float(np.percentile(a, 10)),
        "p90": float(np.percentile(a, 90)), "min": float(a.min()), "max": float(a.max()),
        "mean": float(a.mean()), "n": int(a.size),
    }


_UNITS = {"ms": 1e3, "us": 1e6}


def interleaved(fns: dict, clock: "Clock", rounds: int, calls: int, unit: str = "ms",
                timer=time.perf_counter, samples: dict | None = None) -> dict:
    """Time per call of each callable in ``fns`` (stats in ``unit``) over
    ``rounds`` rounds. A round times one synchronized block of ``calls`` calls
    of every callable, in an order rotated per round, so a drift in machine
    load hits every callable alike and the medians can be compared.
    ``timer``: the clock read around each block (``time.thread_time`` counts
    the calling thread's CPU time only); ``samples``: a dict that receives
    each callable's per-round times, in round order."""
    names = list(fns)
    samples = {} if samples is None else samples
    samples.update({name: [] for name in names})
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            fn = fns[name]
            clock.sync()
            start = timer()
            for _ in range(calls):
                fn()
            clock.sync()
            samples[name].append((timer() - start) / calls * _UNITS[unit])
    return {name: stats(values) for name, values in samples.items()}


def median_ratio(timings: dict, name: str, reference: str) -> float | None:
    """median(name) / median(reference), None when either was not measured."""
    if timings.get(name) is None or timings.get(reference) is None:
        return None
    return timings[name]["median"] / timings[reference]["median"]


def fastest_ratio(timings: dict, name: str, reference: str) -> float | None:
    """min(name) / min(reference): the ratio of the fastest blocks, steadier
    than the medians' on a busy machine (load only ever adds time); None when
    either was not measured."""
    if timings.get(name) is None or timings.get(reference) is None:
        return None
    return timings[name]["min"] / timings[reference]["min"]


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


def elementwise_bytes(M: int, H: int, element_size: int) -> tuple[int, int]:
    """Bytes the elementwise primitives move for M rows: forward reads 2H (x12)
    and writes H (h) elements per row; backward reads 2H (x12) + H (dh) and
    writes 2H (dx12) + H (h)."""
    return M * 3 * H * element_size, M * 6 * H * element_size


def bench_elementwise(shape: Shape, clock: Clock, settings: Settings) -> dict:
    """The primitives alone, bytes counted by :func:`elementwise_bytes`."""
    from ... import primitives

    device, dtype = clock.device, DTYPES[shape.dtype]
    M, H = shape.M, shape.H
    x12 = torch.randn(M, 2 * H, device=device, dtype=dtype)
    dh = torch.randn(M, H, device=device, dtype=dtype)
    h = torch.empty(M, H, device=device, dtype=dtype)
    dx12 = torch.empty(M, 2 * H, device=device, dtype=dtype)
    w, r = settings.warmup, settings.repeats
    fwd = stats(clock.samples(lambda _: primitives.swiglu_forward(x12, out=h), None, max(w, 1), r))
    bwd = stats(clock.samples(lambda _: primitives.swiglu_backward(x12, dh, dx12_out=dx12),
                              None, max(w, 1), r))
    fwd_bytes, bwd_bytes = elementwise_bytes(M, H, torch.finfo(dtype).bits // 8)
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


OVERHEAD_MODES = {"grad": torch.enable_grad, "no_grad": torch.no_grad}


def bench_overhead(clock: Clock, settings: Settings, skip, progress) -> dict:
    """Host time per forward call at a tiny shape (weights require grad), with
    grad enabled and under ``no_grad``: per mode, the contenders interleaved
    (:func:`interleaved`, ``settings.ratio_rounds`` blocks of
    ``settings.overhead_calls`` calls each), and ours / eager HF as a ratio
    of the medians."""
    D, H, M, dtype_name = OVERHEAD_SHAPE
    device, dtype = clock.device, DTYPES[dtype_name]
    calls, rounds = settings.overhead_calls, settings.ratio_rounds
    out = {"shape": {"D": D, "H": H, "M": M, "dtype": dtype_name}, "calls": calls, "rounds": rounds,
           "reference": RATIO_REFERENCE, "goals": dict(OVERHEAD_GOALS),
           "mode": f"forward, weights require grad; per mode the median over {rounds} interleaved rounds "
                   f"of a block of {calls} calls synchronized at its ends",
           "us_per_call": {}, "ratio_vs_reference": {}, "null_reasons": {}}
    weights = master_weights(D, H, dtype, device)
    runners = {}
    for name in (LOWER_BOUND, *CONTENDERS):
        if name in skip:
            out["null_reasons"][name] = "skipped (--skip)"
            continue
        try:
            if name == LOWER_BOUND:
                runners[name] = GemmRunner(D, H, M, dtype, device, weights)
            else:
                x = torch.randn(M, D, device=device, dtype=dtype)
                runners[name] = ModuleRunner(build_module(name, D, H, dtype, device, weights), x, x)
        except Unavailable as exc:
            out["null_reasons"][name] = str(exc)
        except Exception as exc:
            out["null_reasons"][name] = f"failed: {short_error(exc)}"
    for mode, grad_mode in OVERHEAD_MODES.items():
        progress(f"host overhead M={M} D={D} H={H} {dtype_name}, {mode}, {len(runners)} contenders interleaved")
        fns = {}
        with grad_mode():
            for name, runner in runners.items():
                try:  # warm-up in this mode (torch.compile guards on the grad mode)
                    for _ in range(max(settings.warmup, 1) + 10):
                        runner.fwd()
                    fns[name] = runner.fwd
                except Exception as exc:
                    out["null_reasons"][f"{name} ({mode})"] = f"failed: {short_error(exc)}"
            timings = interleaved(fns, clock, rounds, calls, unit="us")
        out["us_per_call"][mode] = {name: timings.get(name) for name in (LOWER_BOUND, *CONTENDERS)}
        out["ratio_vs_reference"][mode] = {name: median_ratio(timings, name, RATIO_REFERENCE) for name in timings}
    runners = fns = None
    if "torch_compile" not in skip:
        torch.compiler.reset()
    return out


def bench_cpu_path(clock: Clock, settings: Settings, progress, shape=CPU_PATH_SHAPE,
                   dtypes=CPU_PATH_DTYPES) -> dict:
    """Ours against eager HF at a mid-size shape on the CPU: forward+backward
    and the no-grad forward, per dtype, interleaved (one call per round and
    contender, ``settings.ratio_rounds`` rounds); the ratio of the medians.
    The forward+backward also times ours with ``saved_x12="fp8"`` (``OURS_FP8``,
    its ratio to the reference as ``fp8_ratio``; no-grad saves nothing)."""
    D, H, M = shape
    device = clock.device
    out = {"shape": {"D": D, "H": H, "M": M}, "threads": torch.get_num_threads(),
           "rounds": settings.ratio_rounds, "reference": RATIO_REFERENCE, "cases": []}
    for dtype_name in dtypes:
        dtype = DTYPES[dtype_name]
        weights = master_weights(D, H, dtype, device)
        x = torch.randn(M, D, device=device, dtype=dtype).requires_grad_(True)
        dy = torch.randn(M, D, device=device, dtype=dtype)
        runners = {name: ModuleRunner(build_module(name, D, H, dtype, device, weights), x, dy)
                   for name in (RATIO_REFERENCE, OURS) + ((OURS_FP8,) if dtype in FP8_SAVED_X12_DTYPES else ())}
        cases = {
            # Gradients set to None before each step, as zero_grad() does.
            "fwd_bwd": {name: (lambda r=r: (r.zero(), r.fwd_bwd())) for name, r in runners.items()},
            "nograd_fwd": {name: r.nograd for name, r in runners.items() if name != OURS_FP8},
        }
        for what, fns in cases.items():
            progress(f"CPU path {what} M={M} D={D} H={H} {dtype_name}, ours and {RATIO_REFERENCE} interleaved")
            for fn in fns.values():
                for _ in range(max(settings.warmup, 1)):
                    fn()
            timings = interleaved(fns, clock, settings.ratio_rounds, calls=1, unit="ms")
            case = {"what": what, "dtype": dtype_name, "ms": timings,
                    "ratio": median_ratio(timings, OURS, RATIO_REFERENCE),
                    "goal": CPU_PATH_GOALS.get((what, dtype_name))}
            if OURS_FP8 in timings:
                case["fp8_ratio"] = median_ratio(timings, OURS_FP8, RATIO_REFERENCE)
            out["cases"].append(case)
        for r in runners.values():
            r.zero()
        runners = cases = x = dy = weights = None
    return out
