"""``python -m swiglu_cupy bench``: arguments, their resolution into shapes
and settings, and the run that measures, writes and prints the report."""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from .compile_probe import bench_compile
from .config import CPU_PATH_DTYPES, CPU_PATH_QUICK_TOKENS, CPU_PATH_SHAPE, DTYPES, PRESETS, SMOKE_SHAPE, Settings, Shape
from .contenders import CONTENDERS, LABELS, LOWER_BOUND
from .environment import environment
from .measure import OVERHEAD_MODES, Clock, bench_copy, bench_cpu_path, bench_overhead, bench_shape, short_error
from .report import format_table, plot


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
                   help="llama7b and llama3-8b, bf16, 8192 tokens, few repeats (a few minutes on one GPU); "
                        f"on CPU: every ratio over 3 rounds, the CPU-path ones at M={CPU_PATH_QUICK_TOKENS} (a look, "
                        "not a measurement)")
    p.add_argument("--repeats", type=_positive_int, help="timed repeats per measurement")
    p.add_argument("--warmup", type=_non_negative_int, help="untimed warm-up calls per measurement")
    p.add_argument("--skip", nargs="+", choices=list(CONTENDERS), default=[], metavar="NAME",
                   help=f"contenders to leave out: {', '.join(CONTENDERS)}")
    p.add_argument("--sweep-launch", action="store_true",
                   help="instead of the comparison: time every launch candidate of the elementwise kernels "
                        "(CUDA only; bf16, M=8192, H=11008 and 14336 unless --tokens/--hidden/--preset/--dtype "
                        "say otherwise); writes sweep.json and sweep.txt")
    p.add_argument("--moe", action="store_true",
                   help="instead of the comparison: the MoE experts against Hugging Face's grouped_mm experts "
                        "(forward+backward time at E=8, top-2, D=256, I=512, 1024 tokens, fp32 and bf16 unless "
                        "--dtype says otherwise; bytes saved for backward per model family); writes moe.json and "
                        "moe.txt (needs transformers)")
    p.add_argument("--long-context", action="store_true",
                   help="instead of the comparison: peak memory (exact live bytes) and time of one MLP "
                        "forward+backward against sequence length for the untiled op, recompute_gate_up, "
                        "row tiles and DeepSpeed's TiledMLP (CPU: D=512, H=1408, fp32, 4096-32768 tokens, tiles "
                        "of 4096; GPU: Llama-3-8B's MLP, bf16, 8k-128k tokens, tiles of 8192; --dim/--hidden, "
                        "--tokens, --dtype and --tile-rows override); writes long_context.json, .txt and .png")
    p.add_argument("--tile-rows", type=_positive_int, help="rows per tile for --long-context")
    p.add_argument("--host-cost", action="store_true",
                   help="instead of the comparison: host time per call on the CPU (one thread) of SwiGLU, "
                        "swiglu, a patched LlamaMLP and patched Mixtral experts against their eager references, "
                        "on the CUDA route (the kernel path through a do-nothing launcher: a CUDA call's host "
                        "work without the GPU work) and the torch route side by side, at M=1 (D=64, H=176) and "
                        "M=64 (D=256, H=704), fp32: forward with grad, forward+backward and no_grad forward, "
                        "with the package's Python frames per call; --quick: 2 rounds of 2 calls (a look); "
                        "writes host_cost.json and host_cost.txt")
    p.add_argument("--out", default="bench-results",
                   help="directory for bench.json, bench.txt and bench.png (sweep.json, sweep.txt; the other "
                        "modes' files)")


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
    if on_cpu and args.quick:
        settings = Settings(device, True, 1, 3, 300, 32, ratio_rounds=3, cpu_path_tokens=CPU_PATH_QUICK_TOKENS)
    elif on_cpu:
        settings = Settings(device, False, 1, 3, 300, 32)
    elif args.quick:
        settings = Settings(device, True, 3, 10, 300, 512)
    else:
        settings = Settings(device, False, 5, 30, 300, 512)
    if args.warmup is not None:
        settings.warmup = args.warmup
    if args.repeats is not None:
        settings.repeats = args.repeats
    return shapes, settings


def run(args: argparse.Namespace) -> int:
    if args.sweep_launch:
        from .sweep import run as run_sweep
        return run_sweep(args)
    if args.moe:
        from .moe import run as run_moe
        return run_moe(args)
    if args.long_context:
        from .long_context import run as run_long_context
        return run_long_context(args)
    if args.host_cost:
        from .host_cost import run as run_host_cost
        return run_host_cost(args)
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
        print(f"note: --quick on CPU: the smoke configuration, every ratio over {settings.ratio_rounds} rounds, "
              f"the CPU-path ones at M={settings.cpu_path_tokens} (a look, not a measurement)",
              file=sys.stderr)

    dtypes = list(dict.fromkeys(s.dtype for s in shapes))
    # The CPU-path ratios run the dtypes --dtype names among theirs (all of them by default).
    cpu_path_dtypes = [d for d in CPU_PATH_DTYPES if not args.dtype or d in args.dtype]
    cpu_path_steps = 2 * len(cpu_path_dtypes) if device.type == "cpu" else 0
    total = len(shapes) * (len(CONTENDERS) + 2) + 1 + len(OVERHEAD_MODES) + cpu_path_steps + len(dtypes)
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
        report["copy"] = {"gbps": None, "error": f"failed: {short_error(exc)}"}
    report["host_overhead"] = [bench_overhead(clock, settings, skip, progress)]
    if device.type == "cpu" and not cpu_path_dtypes:
        report["cpu_path"] = {"error": f"not measured: --dtype names none of {', '.join(CPU_PATH_DTYPES)}"}
    elif device.type == "cpu":
        try:
            report["cpu_path"] = bench_cpu_path(clock, settings, progress, dtypes=cpu_path_dtypes,
                                                 shape=(*CPU_PATH_SHAPE[:2], settings.cpu_path_tokens))
        except Exception as exc:
            report["cpu_path"] = {"error": f"failed: {short_error(exc)}"}
    else:
        report["cpu_path"] = {"error": "not measured: the CPU-path ratios are measured by `bench --device cpu`"}
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
