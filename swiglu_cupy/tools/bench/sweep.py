"""``python -m swiglu_cupy bench --sweep-launch``: every launch candidate of the
elementwise kernels, timed on a GPU.

For each shape (bf16, M=8192, H in {11008, 14336} unless ``--tokens``,
``--hidden``, ``--preset`` or ``--dtype`` say otherwise) and each
``LaunchConfig`` in ``LAUNCH_CANDIDATES``, the primitives
``swiglu_forward(x12)`` and ``swiglu_backward(x12, dh)`` run under
``using_launch_config``. A candidate's outputs must be bitwise equal to the
default's before it is timed. Each timing gives the median (p10-p90) over the
repeats, GB/s from :func:`measure.elementwise_bytes`, and % of the
device-to-device copy rate measured in the same run.

The report names the fastest candidate per kernel and shape, and one config
for both kernels and every shape (``DEFAULT_LAUNCH`` is one config): the
candidate with the smallest geometric mean of its time relative to the
default's, with the exact line to write into ``launch_config.py``.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ...activations import SILU
from ...kernels.launch_config import DEFAULT_LAUNCH, LAUNCH_CANDIDATES, LaunchConfig, using_launch_config
from ...primitives import first_use_check
from .config import DTYPES, PRESETS, Settings
from .contenders import ours_implementation
from .environment import environment
from .measure import Clock, bench_copy, elementwise_bytes, short_error, stats
from .report import write_report

SWEEP_HIDDEN = (PRESETS["llama7b"][1], PRESETS["llama3-8b"][1])   # 11008, 14336
SWEEP_TOKENS = (8192,)
KERNELS = ("forward", "backward")
# A winner must beat the default by more than this (geometric mean over
# kernels and shapes) to be worth a change; smaller gains are run-to-run noise.
NOISE_MARGIN = 0.02
# The runtime estimate's model. Assumed, not measured: every call is timed as
# if it ran at SLOWEST_GBPS plus a launch's host time; NVRTC compiles the
# kernel module once per dtype.
ASSUMED_COMPILE_S = 30.0
ASSUMED_SLOWEST_GBPS = 1000.0
ASSUMED_LAUNCH_S = 50e-6
ASSUMED_PER_CANDIDATE_S = 0.02      # Python, the bitwise check's compare, statistics
LAUNCH_CONFIG_FILE = "swiglu_cupy/kernels/launch_config.py"
NEEDS_CUDA_MESSAGE = ("bench --sweep-launch times the CUDA kernels and needs a CUDA GPU: {why}. Nothing was run.")


@dataclass
class SweepShape:
    M: int
    H: int
    dtype: str

    def label(self) -> str:
        return f"M={self.M} H={self.H} {self.dtype}"


@dataclass
class SweepPlan:
    shapes: list[SweepShape]
    candidates: tuple[LaunchConfig, ...]
    settings: Settings


def resolve_sweep(args: argparse.Namespace) -> SweepPlan:
    """The sweep's shapes and repeats from the bench arguments; ValueError for
    arguments that mean nothing here."""
    if args.dim is not None:
        raise ValueError("--dim means nothing to --sweep-launch (the elementwise kernels see only M and H); "
                         "give --hidden")
    hidden = [PRESETS[name][1] for name in args.preset or []]
    if args.hidden is not None:
        hidden.append(args.hidden)
    hidden = list(dict.fromkeys(hidden)) or list(SWEEP_HIDDEN)
    tokens = args.tokens or list(SWEEP_TOKENS)
    dtypes = args.dtype or ["bf16"]
    shapes = [SweepShape(M, H, dt) for dt in dtypes for H in hidden for M in tokens]
    settings = Settings("cuda", args.quick, 2 if args.quick else 3, 5 if args.quick else 10,
                        overhead_calls=0, copy_mib=512)
    if args.warmup is not None:
        settings.warmup = args.warmup
    if args.repeats is not None:
        settings.repeats = args.repeats
    return SweepPlan(shapes, LAUNCH_CANDIDATES, settings)


def estimate_seconds(plan: SweepPlan) -> dict:
    """The sweep's runtime from the assumed costs above (an estimate)."""
    calls = plan.settings.warmup + plan.settings.repeats + 1   # +1: the bitwise check
    timing_s = 0.0
    for shape in plan.shapes:
        size = torch.finfo(DTYPES[shape.dtype]).bits // 8
        per_candidate = sum(calls * (nbytes / (ASSUMED_SLOWEST_GBPS * 1e9) + ASSUMED_LAUNCH_S)
                            for nbytes in elementwise_bytes(shape.M, shape.H, size))
        timing_s += len(plan.candidates) * (per_candidate + ASSUMED_PER_CANDIDATE_S)
    compile_s = ASSUMED_COMPILE_S * len({s.dtype for s in plan.shapes})
    return {
        "timings": len(plan.candidates) * len(KERNELS) * len(plan.shapes),
        "calls_per_timing": calls,
        "compile_s": compile_s,
        "timing_s": timing_s,
        "total_s": compile_s + timing_s,
        "model": (f"NVRTC compile {ASSUMED_COMPILE_S:.0f} s per dtype, every call at {ASSUMED_SLOWEST_GBPS:.0f} GB/s "
                  f"+ {ASSUMED_LAUNCH_S * 1e6:.0f} us launch, {ASSUMED_PER_CANDIDATE_S * 1e3:.0f} ms per candidate "
                  "(assumed costs, not measured)"),
    }


def describe_estimate(plan: SweepPlan, estimate: dict) -> str:
    return (f"sweep: {len(plan.candidates)} candidates x {len(KERNELS)} kernels x {len(plan.shapes)} shapes = "
            f"{estimate['timings']} timings of {estimate['calls_per_timing']} calls; estimated "
            f"~{estimate['total_s']:.0f} s ({estimate['model']})")


def sweep_shape(shape: SweepShape, candidates, clock: Clock, settings: Settings, copy_gbps: float | None,
                progress, launcher=None) -> dict:
    """Checks and times every candidate at one shape. ``launcher`` substitutes
    the kernel launcher (the host-execution harness, for CPU tests)."""
    from ... import primitives

    device, dtype = clock.device, DTYPES[shape.dtype]
    M, H = shape.M, shape.H
    g = torch.Generator(device=device).manual_seed(0)
    x12 = (torch.randn(M, 2 * H, generator=g, device=device, dtype=torch.float32) * 2).to(dtype)
    dh = torch.randn(M, H, generator=g, device=device, dtype=torch.float32).to(dtype)
    h, dx12 = torch.empty(M, H, device=device, dtype=dtype), torch.empty_like(x12)
    with using_launch_config(DEFAULT_LAUNCH):
        h_ref = primitives.swiglu_forward(x12, implementation="kernels", launcher=launcher)
        dx12_ref, _ = primitives.swiglu_backward(x12, dh, implementation="kernels", launcher=launcher)
    nbytes = dict(zip(KERNELS, elementwise_bytes(M, H, torch.finfo(dtype).bits // 8)))
    timed = {
        "forward": lambda _: primitives.swiglu_forward(x12, out=h, implementation="kernels", launcher=launcher),
        "backward": lambda _: primitives.swiglu_backward(x12, dh, dx12_out=dx12, implementation="kernels",
                                                         launcher=launcher),
    }
    out = {"shape": asdict(shape), "bytes": nbytes, "candidates": []}
    for config in candidates:
        progress(f"{shape.label()} {config.label}")
        entry: dict = {"config": asdict(config), "label": config.label, "is_default": config == DEFAULT_LAUNCH}
        try:
            # A config its self-check refuses would run (and be timed as) the torch implementation.
            if not first_use_check.kernels_usable(launcher, SILU, dtype, device, config):
                entry["error"] = "its first-use self-check failed (see the warning): not timed"
                out["candidates"].append(entry)
                continue
            with using_launch_config(config):
                # NaN in the outputs first: an element a launch shape misses cannot pass.
                h.fill_(float("nan"))
                dx12.fill_(float("nan"))
                timed["forward"](None)
                _, h_bwd = timed["backward"](None)
                clock.sync()
                equal = torch.equal(h, h_ref) and torch.equal(h_bwd, h_ref) and torch.equal(dx12, dx12_ref)
                entry["bitwise_equal_to_default"] = equal
                if not equal:
                    entry["error"] = f"outputs differ from the default launch's ({DEFAULT_LAUNCH.label}): not timed"
                else:
                    for kernel in KERNELS:
                        t = stats(clock.samples(timed[kernel], None, settings.warmup, settings.repeats))
                        gbps = nbytes[kernel] / (t["median"] * 1e-3) / 1e9
                        entry[kernel] = {"ms": t, "gbps": gbps,
                                         "pct_of_copy": 100 * gbps / copy_gbps if copy_gbps else None}
        except Exception as exc:
            entry["error"] = f"failed: {short_error(exc)}"
        out["candidates"].append(entry)
    out["best"] = best_per_kernel(out)
    return out


def best_per_kernel(shape_result: dict) -> dict:
    """Per kernel, the label of the measured candidate with the smallest median (None if none)."""
    best = {}
    for kernel in KERNELS:
        measured = [c for c in shape_result["candidates"] if kernel in c]
        best[kernel] = min(measured, key=lambda c: c[kernel]["ms"]["median"])["label"] if measured else None
    return best


def recommend(results: list[dict]) -> dict | None:
    """The one config for both kernels and every shape: the smallest geometric
    mean of time / the default's time. Only candidates measured everywhere
    compete; None when the default itself was not measured everywhere."""
    pairs = [(r, k) for r in results for k in KERNELS]

    def default_ms(r, k):
        return next((c[k]["ms"]["median"] for c in r["candidates"] if c["is_default"] and k in c), None)

    defaults = [default_ms(r, k) for r, k in pairs]
    if not pairs or None in defaults:
        return None
    scores = {}
    for i, cand in enumerate(results[0]["candidates"]):
        logs = []
        for (r, k), base in zip(pairs, defaults):
            match = next((c for c in r["candidates"] if c["label"] == cand["label"]), None)
            if match is None or k not in match:
                break
            logs.append(math.log(match[k]["ms"]["median"] / base))
        else:
            scores[cand["label"]] = (math.exp(sum(logs) / len(logs)), cand["config"])
    label, (geomean, config) = min(scores.items(), key=lambda item: item[1][0])
    winner = LaunchConfig(**config)
    change = winner != DEFAULT_LAUNCH and geomean < 1 - NOISE_MARGIN
    return {"label": label, "config": config, "geomean_time_vs_default": geomean, "change_default": change,
            "current_line": f"DEFAULT_LAUNCH = {DEFAULT_LAUNCH!r}", "new_line": f"DEFAULT_LAUNCH = {winner!r}"}


def _cell(entry: dict, kernel: str) -> str:
    m = entry.get(kernel)
    if not m:
        return f"{'-':>46}"
    pct = "-" if m["pct_of_copy"] is None else f"{m['pct_of_copy']:.0f}%"
    t = m["ms"]
    return f"{t['median']:8.4f} ({t['p10']:.4f}-{t['p90']:.4f})  {m['gbps']:8.1f}  {pct:>5}"


def format_sweep(report: dict) -> str:
    """The sweep's text report, from the report dict alone."""
    env, copy = report["environment"], report.get("copy") or {}
    lines = [f"swiglu-cupy launch sweep  {env['date']}  {env['gpu_name'] or 'no GPU'}  torch {env['torch']}  "
             f"cupy {env['cupy']}",
             "per kernel: median ms (p10-p90), GB/s, % of the device copy rate; * = fastest, "
             "(default) = DEFAULT_LAUNCH"]
    if copy.get("gbps"):
        lines.append(f"device copy (dst.copy_(src), {copy['buffer_bytes'] // 2**20} MiB): {copy['gbps']:.1f} GB/s")
    else:
        lines.append(f"device copy: {copy.get('error', 'not measured')}")
    width = max((len(c["label"]) for r in report["results"] for c in r["candidates"]), default=10) + 10
    for res in report["results"]:
        s, b = res["shape"], res["bytes"]
        lines += ["", f"== M={s['M']} H={s['H']} {s['dtype']}  (forward moves {b['forward'] / 1e6:.1f} MB, "
                      f"backward {b['backward'] / 1e6:.1f} MB)",
                  f"{'launch config':<{width}}  {'forward':^46}  {'backward':^46}"]
        for c in res["candidates"]:
            name = c["label"] + (" (default)" if c["is_default"] else "")
            if "error" in c:
                lines.append(f"{name:<{width}}  {c['error']}")
                continue
            marks = "".join("*" if res["best"][k] == c["label"] else " " for k in KERNELS)
            lines.append(f"{name:<{width}}  {_cell(c, 'forward')}{marks[0]} {_cell(c, 'backward')}{marks[1]}")
        for kernel in KERNELS:
            best = res["best"][kernel]
            entry = next((c for c in res["candidates"] if c["label"] == best), None)
            lines.append(f"best {kernel} at M={s['M']} H={s['H']} {s['dtype']}: " +
                         (f"{best}  {_cell(entry, kernel).strip()}" if entry else "none measured"))
    rec = report.get("recommendation")
    lines.append("")
    if rec is None:
        lines.append("no recommendation: the default launch was not measured at every shape")
    else:
        lines.append(f"best for both kernels and every shape: {rec['label']} "
                     f"(geometric mean of time vs the default: {rec['geomean_time_vs_default']:.3f})")
        if rec["change_default"]:
            lines += [f"to make it the default, in {LAUNCH_CONFIG_FILE} replace",
                      f"    {rec['current_line']}", "with", f"    {rec['new_line']}"]
        else:
            lines.append(f"keep the default ({rec['current_line']}): no candidate is more than "
                         f"{NOISE_MARGIN:.0%} faster overall")
    failed = [f"{c['label']} at M={r['shape']['M']} H={r['shape']['H']}"
              for r in report["results"] for c in r["candidates"] if "error" in c]
    if failed:
        lines.append(f"FAILED ({len(failed)}): " + "; ".join(failed))
    lines.append(f"total sweep time: {report['wall_s']:.1f} s (estimated ~{report['estimate']['total_s']:.0f} s)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Exit 0 when every candidate matched the default, 1 on any mismatch or
    failure, 2 when this machine cannot run the sweep (no CUDA, no kernels)."""
    try:
        plan = resolve_sweep(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.device == "cpu":
        print(NEEDS_CUDA_MESSAGE.format(why="--device cpu was given"), file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print(NEEDS_CUDA_MESSAGE.format(why=f"torch.cuda.is_available() is False on this machine (torch "
                                            f"{torch.__version__}, built for CUDA {torch.version.cuda})"),
              file=sys.stderr)
        return 2
    device = torch.device("cuda")
    implementation = ours_implementation(device)
    if implementation != "CuPy kernels":
        print(NEEDS_CUDA_MESSAGE.format(why=f"CUDA tensors take the {implementation} path here "
                                            "(see `python -m swiglu_cupy info`)"), file=sys.stderr)
        return 2
    estimate = estimate_seconds(plan)
    print(describe_estimate(plan, estimate), file=sys.stderr, flush=True)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    clock = Clock(device)
    start = time.perf_counter()
    total = len(plan.shapes) * len(plan.candidates) + 1
    step = [0]

    def progress(what: str) -> None:
        step[0] += 1
        print(f"[{step[0]}/{total} +{time.perf_counter() - start:.0f}s] {what} ...", file=sys.stderr, flush=True)

    report = {"schema": 1, "command": ["python", "-m", "swiglu_cupy", "bench", *sys.argv[2:]],
              "environment": environment(device), "settings": asdict(plan.settings), "estimate": estimate,
              "default": asdict(DEFAULT_LAUNCH), "results": []}
    progress("device copy bandwidth")
    try:
        report["copy"] = bench_copy(clock, plan.settings)
    except Exception as exc:
        report["copy"] = {"gbps": None, "error": f"failed: {short_error(exc)}"}
    for shape in plan.shapes:
        report["results"].append(sweep_shape(shape, plan.candidates, clock, plan.settings,
                                             report["copy"].get("gbps"), progress))
        torch.cuda.empty_cache()
    report["recommendation"] = recommend(report["results"])
    report["wall_s"] = time.perf_counter() - start
    failed = any("error" in c for r in report["results"] for c in r["candidates"])
    report["passed"] = not failed
    write_report(out_dir, "sweep", report, format_sweep(report))
    return 1 if failed else 0
