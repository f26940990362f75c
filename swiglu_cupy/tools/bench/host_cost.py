"""``python -m swiglu_cupy bench --host-cost``: the host time of one call of
each of the package's entry points against its eager reference, on the CPU,
on the CUDA route and on the torch route side by side.

- **cuda route**: the call inside ``tools.host_cost.cuda_route()``, which
  forces the kernel path on CPU tensors through a launcher that launches
  nothing: every line of the package a CUDA call runs, without the GPU work
  (the GEMMs still run, on the CPU, in both routes and in the reference).
- **torch route**: the plain call on CPU tensors (the torch implementation).

Per shape (``config.HOST_COST_SHAPES``: decode, x [1, D]; decode as
transformers' decoder layers call an MLP, x [1, 1, D]; and a small training
shape), mode (``tools.host_cost.MODES``: forward with grad,
forward+backward, no_grad forward) and route, the entry points and their
eager references (``tools.host_cost.REFERENCES``) are timed interleaved
(``measure.interleaved``: rounds of one block of calls each, the order
rotated per round), by the calling thread's CPU time (steadier than wall
time on a shared machine), on one intra-op thread with denormals flushed
(the do-nothing launcher leaves its outputs uninitialized, and denormal
garbage would slow the GEMMs after it). Printed per entry point: the median
microseconds per call, the ratio of the medians to its reference in the same
route and rounds and that of the fastest blocks, the package's Python frames per call
(``tools.host_cost.package_frames``, deterministic) and on the CUDA route the
kernel launches per call. An entry point whose package is missing is reported
unavailable with the reason. Writes ``host_cost.json`` and ``host_cost.txt``
in ``--out``.
"""
from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

import torch

from .. import host_cost as harness
from .config import (DTYPES, HOST_COST_CALLS, HOST_COST_QUICK_CALLS, HOST_COST_QUICK_ROUNDS, HOST_COST_QUICK_WARMUP,
                     HOST_COST_ROUNDS, HOST_COST_SHAPES, HOST_COST_WARMUP)
from .environment import environment
from .measure import Clock, fastest_ratio, interleaved, median_ratio, short_error
from .report import write_report

__all__ = ["run", "bench_host_cost", "format_host_cost", "ROUTES", "ENTRIES"]

CUDA_ROUTE, TORCH_ROUTE = "cuda route", "torch route"
ROUTES = {CUDA_ROUTE: "the kernel path on CPU tensors through a do-nothing launcher: a CUDA call's host work, "
                      "without the GPU work",
          TORCH_ROUTE: "the plain call on CPU tensors (the torch implementation)"}
#: The package's entry points measured, each against ``harness.REFERENCES[name]``.
ENTRIES = tuple(harness.REFERENCES)
REFERENCE_NAMES = tuple(dict.fromkeys(harness.REFERENCES.values()))


def _route(route: str):
    return harness.cuda_route() if route == CUDA_ROUTE else contextlib.nullcontext(None)


def build_all(D: int, H: int, dtype: torch.dtype) -> tuple[dict, dict]:
    """``{name: (module, call)}`` for every entry point and reference that
    builds, and ``{name: reason}`` for the others (unavailable, or failed)."""
    built, reasons = {}, {}
    for name in (*ENTRIES, *REFERENCE_NAMES):
        try:
            built[name] = harness.build_entry(name, D, H, dtype)
        except harness.Unavailable as exc:
            reasons[name] = f"unavailable: {exc}"
        except Exception as exc:
            reasons[name] = f"failed: {short_error(exc)}"
    return built, reasons


def bench_case(built: dict, mode: str, route: str, x: torch.Tensor, dy: torch.Tensor, clock: Clock,
               rounds: int, calls: int, warmup: int) -> dict:
    """One (mode, route): every built entry point and reference warmed up,
    its frames and launches counted on one call, then all timed interleaved."""
    out = {"mode": mode, "route": route, "us_per_call": {}, "ratio_vs_reference": {},
           "fastest_ratio_vs_reference": {}, "package_frames": {}, "total_frames": {}, "launches_per_call": {},
           "null_reasons": {}}
    fns = {}
    with _route(route) as launcher, harness.MODES[mode]():
        for name, (module, call) in built.items():
            step = harness.mode_step(mode, module, call, x, dy)
            try:
                for _ in range(max(warmup, 1)):  # the first call fills caches: its frames are not a call's
                    step()
                before = launcher.launches if launcher is not None else 0
                frames = harness.package_frames(step)
            except Exception as exc:
                out["null_reasons"][name] = f"failed: {short_error(exc)}"
                continue
            out["package_frames"][name] = frames.package
            out["total_frames"][name] = frames.total
            out["launches_per_call"][name] = launcher.launches - before if launcher is not None else None
            fns[name] = step
        timings = interleaved(fns, clock, rounds, calls, unit="us", timer=time.thread_time)
    for name in (*ENTRIES, *REFERENCE_NAMES):
        out["us_per_call"][name] = timings.get(name)
        reference = harness.REFERENCES.get(name, name)
        out["ratio_vs_reference"][name] = median_ratio(timings, name, reference)
        out["fastest_ratio_vs_reference"][name] = fastest_ratio(timings, name, reference)
    return out


def bench_host_cost(shapes: dict, calls: dict, rounds: int, warmup: int, progress) -> list[dict]:
    """Every (shape, mode, route) case; ``shapes``: name -> (D, H, M, dtype),
    x being [M, D], or ``[*M, D]`` where M is a tuple of leading dims."""
    clock = Clock(torch.device("cpu"))
    cases = []
    for shape_name, (D, H, M, dtype_name) in shapes.items():
        dtype = DTYPES[dtype_name]
        progress(f"{shape_name}: build the entry points (D={D}, H={H}, {dtype_name})")
        built, reasons = build_all(D, H, dtype)
        g = torch.Generator().manual_seed(1)
        lead = M if isinstance(M, tuple) else (M,)
        x = torch.randn(*lead, D, generator=g, dtype=torch.float32).to(dtype).requires_grad_(True)
        dy = torch.randn(*lead, D, generator=g, dtype=torch.float32).to(dtype)
        for mode in harness.MODES:
            for route in ROUTES:
                progress(f"{shape_name} M={M}: {mode}, {route}, {len(built)} entry points interleaved")
                case = bench_case(built, mode, route, x, dy, clock, rounds, calls[shape_name], warmup)
                case["null_reasons"].update(reasons)
                case["shape"] = {"name": shape_name, "D": D, "H": H, "M": M, "dtype": dtype_name,
                                 "x_shape": list(x.shape)}
                case["calls"] = calls[shape_name]
                cases.append(case)
        built = x = dy = None
    return cases


def _us(s) -> str:
    return "-" if not s else f"{s['median']:.1f} ({s['p10']:.1f}-{s['p90']:.1f})"


def _ratio(ratio) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def _cells(case: dict, name: str) -> str:
    s = case["us_per_call"].get(name)
    if s is None:
        return f"{'-':>24}  {'-':>6}  {'-':>7}  {'-':>6}  {'-':>8}"
    launches = case["launches_per_call"].get(name)
    return (f"{_us(s):>24}  {_ratio(case['ratio_vs_reference'].get(name)):>6}  "
            f"{_ratio(case['fastest_ratio_vs_reference'].get(name)):>7}  "
            f"{case['package_frames'][name]:>6}  {'-' if launches is None else launches:>8}")


def format_host_cost(report: dict) -> str:
    env = report["environment"]
    lines = [f"swiglu-cupy bench --host-cost  {env['date']}  CPU ({env['cpu']})  torch {env['torch']}  "
             f"{report['threads']} thread(s)",
             f"host time per call, us: median (p10-p90) of {report['rounds']} interleaved rounds of a block of "
             f"calls, the calling thread's CPU time; {report['warmup']} warm-up calls",
             *(f"{route}: {what}" for route, what in report["routes"].items()),
             "ratio: / the reference's median in the same route and rounds (" +
             ", ".join(f"{n} -> {r}" for n, r in report["references"].items()) + "); fastest: the fastest "
             "blocks' ratio (load only adds time: steadier on a busy machine)",
             "frames: swiglu_cupy's Python frames per call; launches: kernel launches per call (cuda route)"]
    for name, reason in report["unavailable"].items():
        lines.append(f"{name}: {reason}")
    names = [*report["entries"], *dict.fromkeys(report["references"].values())]
    width = max(len(n) for n in names)
    head = f"{'us/call':>24}  {'ratio':>6}  {'fastest':>7}  {'frames':>6}  {'launches':>8}"
    cases = report["cases"]
    for shape_name in dict.fromkeys(c["shape"]["name"] for c in cases):
        shape_cases = [c for c in cases if c["shape"]["name"] == shape_name]
        s = shape_cases[0]["shape"]
        lines += ["", f"== {shape_name}  x {list(s['x_shape'])} D={s['D']} H={s['H']} {s['dtype']}, blocks of "
                      f"{shape_cases[0]['calls']} calls"]
        for mode in dict.fromkeys(c["mode"] for c in shape_cases):
            pair = [c for c in shape_cases if c["mode"] == mode]   # its routes, side by side
            lines.append(f"-- {mode}")
            lines.append(f"  {'':<{width}}" + "".join(f" | {c['route']:^{len(head)}}" for c in pair))
            lines.append(f"  {'entry point':<{width}}" + "".join(f" | {head}" for _ in pair))
            for name in names:
                reason = pair[0]["null_reasons"].get(name)
                if reason is not None and all(c["null_reasons"].get(name) == reason for c in pair):
                    lines.append(f"  {name:<{width}} | {reason}")
                    continue
                row = f"  {name:<{width}}" + "".join(f" | {_cells(c, name)}" for c in pair)
                failed = [f"{c['route']}: {c['null_reasons'][name]}" for c in pair if name in c["null_reasons"]]
                lines.append(row + (f"  ({'; '.join(failed)})" if failed else ""))
    lines.append(f"total bench time: {report['wall_s']:.1f} s")
    return "\n".join(lines)


def run(args) -> int:
    if args.device == "cuda":
        print("error: bench --host-cost measures on the CPU (it forces the CUDA route on CPU tensors); "
              "leave out --device cuda", file=sys.stderr)
        return 2
    quick = args.quick
    rounds = args.repeats or (HOST_COST_QUICK_ROUNDS if quick else HOST_COST_ROUNDS)
    warmup = args.warmup if args.warmup is not None else (HOST_COST_QUICK_WARMUP if quick else HOST_COST_WARMUP)
    calls = {name: HOST_COST_QUICK_CALLS if quick else HOST_COST_CALLS[name] for name in HOST_COST_SHAPES}
    if quick:
        print(f"note: --quick: {rounds} rounds of {HOST_COST_QUICK_CALLS} calls (a look, not a measurement)",
              file=sys.stderr)
    start = time.perf_counter()

    def progress(what: str) -> None:
        print(f"[host-cost +{time.perf_counter() - start:.0f}s] {what} ...", file=sys.stderr, flush=True)

    threads = torch.get_num_threads()
    # One intra-op thread, as the CPU bench: steadier small timings. Denormals flushed: the do-nothing
    # launcher leaves its outputs uninitialized (see the module docstring).
    torch.set_num_threads(1)
    flushed = torch.set_flush_denormal(True)
    try:
        report = {"schema": 1, "command": ["python", "-m", "swiglu_cupy", "bench", *sys.argv[2:]]
                  if sys.argv[1:2] == ["bench"] else sys.argv,
                  "environment": environment(torch.device("cpu")), "threads": torch.get_num_threads(),
                  "clock": "thread_time", "flush_denormal": flushed, "quick": quick, "rounds": rounds,
                  "warmup": warmup, "routes": dict(ROUTES), "modes": list(harness.MODES),
                  "entries": list(ENTRIES), "references": dict(harness.REFERENCES),
                  "shapes": {name: dict(zip(("D", "H", "M", "dtype"), shape))
                             for name, shape in HOST_COST_SHAPES.items()}}
        report["cases"] = bench_host_cost(HOST_COST_SHAPES, calls, rounds, warmup, progress)
    finally:
        torch.set_num_threads(threads)
        torch.set_flush_denormal(False)
    first = report["cases"][0]["null_reasons"] if report["cases"] else {}
    report["unavailable"] = {name: reason for name, reason in first.items() if reason.startswith("unavailable")}
    report["wall_s"] = time.perf_counter() - start
    write_report(Path(args.out), "host_cost", report, format_host_cost(report))
    return 0
