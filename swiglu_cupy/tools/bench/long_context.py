"""``bench --long-context``: peak memory and time of one MLP forward+backward
against sequence length, for the untiled op, ``recompute_gate_up``, row tiles
(``tile_rows``) and DeepSpeed's ``TiledMLP`` (the generic tiled wrapper,
re-running an eager MLP forward per tile in backward) with the same number
of tiles, where deepspeed imports.

Memory is exact (``tools.live_bytes.LiveBytes``: every storage created during
the call): the peak of live bytes beyond the inputs, the weights and the
weight gradients, and the largest single allocation beside the outputs.
Time: forward+backward, interleaved rounds (``measure.interleaved``; the
thread's CPU time on the CPU), at the longest length, and at one tile
(where ``tile_rows`` takes the untiled path). Writes long_context.json,
long_context.txt and long_context.png (memory against tokens).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ...dense.module import SwiGLU
from ..live_bytes import LiveBytes
from .environment import environment
from .measure import Clock, interleaved, median_ratio, short_error
from .report import pyplot, write_report

__all__ = ["run", "CONTENDERS", "CPU_SHAPE", "GPU_SHAPE"]

#: (D, H, dtype, tile, token counts): the issue's CPU shape, and Llama-3-8B's MLP on a GPU.
CPU_SHAPE = (512, 1408, "fp32", 4096, (4096, 8192, 16384, 32768))
GPU_SHAPE = (4096, 14336, "bf16", 8192, (8192, 32768, 65536, 131072))
CONTENDERS = ("untiled", "recompute_gate_up", "tiled", "deepspeed_tiled_mlp")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: The issue's goals: peak ratios at the longest length, time ratios there and at one tile.
GOALS = {"peak_vs_recompute": 0.35, "time_vs_recompute": 1.10, "time_vs_deepspeed": 0.90, "time_one_tile": 1.02}


def _deepspeed_tiled_mlp():
    """DeepSpeed's TiledMLP Function, or the reason it is absent."""
    try:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP
    except Exception as exc:  # not installed, or an import of its own fails
        return None, f"absent: deepspeed does not import here ({short_error(exc)})"
    return TiledMLP, None


def _eager_mlp_forward(module: SwiGLU, x: torch.Tensor) -> torch.Tensor:
    """What TiledMLP wraps: the MLP's plain torch forward (the same weights)."""
    gate, up = module.w12(x).chunk(2, dim=-1)
    return module.w3(F.silu(gate) * up)


def _calls(module: SwiGLU, tile: int, rows: int) -> dict:
    """name -> x -> y for every contender that runs here (or name -> reason)."""
    w = (module.w12.weight, module.w12.bias, module.w3.weight, module.w3.bias)
    from ...dense.api import swiglu

    calls = {"untiled": lambda x: swiglu(x, *w),
             "recompute_gate_up": lambda x: swiglu(x, *w, recompute_gate_up=True),
             "tiled": lambda x: swiglu(x, *w, tile_rows=tile)}
    tiled_mlp, reason = _deepspeed_tiled_mlp()
    if tiled_mlp is None:
        calls["deepspeed_tiled_mlp"] = reason
    else:
        shards = -(-rows // tile)
        params = list(module.parameters())
        calls["deepspeed_tiled_mlp"] = lambda x: tiled_mlp.apply(_eager_mlp_forward, module, x, shards, params)
    return calls


def _step(call, module, x, dy):
    def run():
        x.grad = None
        module.zero_grad(set_to_none=True)
        call(x).backward(dy)
    return run


def measure_memory(module, x, dy, call) -> dict:
    """Exact bytes of one forward+backward: the peak beyond inputs, weights and
    weight gradients, and the largest allocation beside the outputs."""
    x.grad = None
    module.zero_grad(set_to_none=True)
    with LiveBytes() as live:
        y = call(x)
        y.backward(dy)
    grads = [p.grad for p in module.parameters()]
    largest = live.largest(exclude=[y, x.grad, *grads])
    return {"peak_bytes": live.peak_bytes(exclude=grads),
            "largest_bytes": None if largest is None else largest.nbytes,
            "largest": None if largest is None else f"{largest.op} {list(largest.shape)}",
            "y": y.detach(), "dx": x.grad.detach()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def bench_long_context(D: int, H: int, dtype: torch.dtype, tile: int, token_counts, device, rounds: int,
                       progress=print) -> dict:
    torch.manual_seed(0)
    module = SwiGLU(D, H, device=device, dtype=dtype)
    result = {"shape": {"D": D, "H": H, "dtype": str(dtype).replace("torch.", ""), "tile_rows": tile},
              "memory": [], "time": {}, "skipped": {}}
    for rows in token_counts:
        g = torch.Generator(device=device).manual_seed(rows)
        x = torch.randn(rows, D, device=device, dtype=dtype, generator=g).requires_grad_()
        dy = torch.randn(rows, D, device=device, dtype=dtype, generator=g)
        entry = {"tokens": rows}
        reference = None
        for name, call in _calls(module, tile, rows).items():
            if isinstance(call, str):
                result["skipped"][name] = call
                continue
            progress(f"memory {name} at {rows} tokens")
            m = measure_memory(module, x, dy, call)
            y, dx = m.pop("y"), m.pop("dx")
            if reference is None:
                reference = (y, dx)
            m["rel_err_y"], m["rel_err_dx"] = _rel(y, reference[0]), _rel(dx, reference[1])
            entry[name] = m
        result["memory"].append(entry)
    clock = Clock(torch.device(device))
    timer = time.perf_counter if clock.cuda else time.thread_time
    for label, rows in (("longest", max(token_counts)), ("one_tile", tile)):
        x = torch.randn(rows, D, device=device, dtype=dtype).requires_grad_()
        dy = torch.randn(rows, D, device=device, dtype=dtype)
        names = CONTENDERS if label == "longest" else ("untiled", "tiled")
        fns = {n: _step(c, module, x, dy) for n, c in _calls(module, tile, rows).items()
               if n in names and not isinstance(c, str)}
        progress(f"time at {rows} tokens ({label}): {', '.join(fns)}")
        for fn in fns.values():
            fn()  # warm-up
        result["time"][label] = {"tokens": rows, "ms": interleaved(fns, clock, rounds, calls=1, timer=timer),
                                 "clock": "wall" if clock.cuda else "thread_time"}
    longest = result["memory"][-1]
    ms, one = result["time"]["longest"]["ms"], result["time"]["one_tile"]["ms"]
    ratio = lambda a, b: None if a not in longest or b not in longest else (  # noqa: E731
        longest[a]["peak_bytes"] / longest[b]["peak_bytes"])
    result["ratios"] = {
        "peak_vs_recompute": ratio("tiled", "recompute_gate_up"),
        "peak_vs_deepspeed": ratio("tiled", "deepspeed_tiled_mlp"),
        "time_vs_recompute": median_ratio(ms, "tiled", "recompute_gate_up"),
        "time_vs_deepspeed": median_ratio(ms, "tiled", "deepspeed_tiled_mlp"),
        "time_one_tile": median_ratio(one, "tiled", "untiled"),
    }
    result["goals"] = GOALS
    result["tile_workspace_bytes"] = tile * 2 * H * dtype.itemsize
    return result


def format_long_context(report: dict) -> str:
    r = report["result"]
    s = r["shape"]
    lines = [f"long context: one MLP forward+backward, D={s['D']} H={s['H']} {s['dtype']}, tile_rows={s['tile_rows']} "
             f"({report['environment'].get('device', '?')}, {report['threads']} thread(s))",
             "peak live bytes beyond inputs, weights and weight grads (MiB) | largest allocation beside the outputs "
             "(MiB):"]
    names = [n for n in CONTENDERS if n not in r["skipped"]]
    lines.append(f"  {'tokens':>8}  " + "  ".join(f"{n:>24}" for n in names))
    for entry in r["memory"]:
        cells = [f"{entry[n]['peak_bytes'] / 2**20:>10.1f} | {entry[n]['largest_bytes'] / 2**20:>9.1f}" for n in names]
        lines.append(f"  {entry['tokens']:>8}  " + "  ".join(f"{c:>24}" for c in cells))
    lines.append(f"  a tile's x12 workspace: {r['tile_workspace_bytes'] / 2**20:.1f} MiB")
    for label, t in r["time"].items():
        clock = t["clock"]
        parts = ", ".join(f"{n} {v['median']:.1f} ms" for n, v in t["ms"].items())
        lines.append(f"time ({clock}, median, {label}, {t['tokens']} tokens): {parts}")
    for name, value in r["ratios"].items():
        goal = r["goals"].get(name)
        lines.append(f"  {name}: " + ("n/a" if value is None else f"{value:.3f}")
                     + ("" if goal is None else f" (goal <= {goal})"))
    for name, reason in r["skipped"].items():
        lines.append(f"  {name}: {reason}")
    return "\n".join(lines)


def plot_long_context(report: dict, path: Path) -> str | None:
    """Peak memory against tokens; returns why not, if matplotlib is missing."""
    plt, reason = pyplot()
    if plt is None:
        return reason
    r = report["result"]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name in CONTENDERS:
        points = [(e["tokens"], e[name]["peak_bytes"] / 2**20) for e in r["memory"] if name in e]
        if points:
            ax.plot(*zip(*points), marker="o", label=name)
    s = r["shape"]
    ax.set(xscale="log", yscale="log", xlabel="tokens", ylabel="peak live MiB (fwd+bwd)",
           title=f"MLP D={s['D']} H={s['H']} {s['dtype']}, tile_rows={s['tile_rows']}")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def run(args) -> int:
    device = "cuda" if args.device in ("auto", "cuda") and torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and device != "cuda":
        print("error: --device cuda: no CUDA device is available to torch", file=sys.stderr)
        return 2
    D, H, dt, tile, token_counts = CPU_SHAPE if device == "cpu" else GPU_SHAPE
    if (args.dim is None) != (args.hidden is None):
        print("error: --dim and --hidden go together (a custom shape needs both)", file=sys.stderr)
        return 2
    if args.dim is not None:
        D, H = args.dim, args.hidden
    token_counts = tuple(args.tokens) if args.tokens else token_counts
    tile = args.tile_rows or tile
    dt = args.dtype[0] if args.dtype else dt
    if device == "cpu":
        torch.set_num_threads(1)  # as the main bench: steadier CPU timings
    rounds = args.repeats or 3
    start = time.perf_counter()

    def progress(what: str) -> None:
        print(f"[long-context +{time.perf_counter() - start:.0f}s] {what} ...", file=sys.stderr, flush=True)

    report = {"schema": 1, "command": ["python", "-m", "swiglu_cupy", "bench", *sys.argv[2:]],
              "environment": environment(torch.device(device)), "threads": torch.get_num_threads(),
              "rounds": rounds,
              "result": bench_long_context(D, H, _DTYPES[dt], tile, token_counts, device, rounds, progress)}
    report["wall_s"] = time.perf_counter() - start
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    png = out_dir / "long_context.png"
    reason = plot_long_context(report, png)
    report["plot"] = None if reason else png.name
    write_report(out_dir, "long_context", report, format_long_context(report), () if reason else (png,))
    return 0
