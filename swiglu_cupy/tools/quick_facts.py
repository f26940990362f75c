"""The selftest's first step, the basic questions answered in about a minute
(``python -m swiglu_cupy.tools.quick_facts --out DIR``):

1. does SwiGLU's bf16 module pass its self-check (first: everything else
   depends on it),
2. do the kernels beat eager on one LLaMA shape (``LLAMA``: M=4096,
   D=4096, H=11008, bf16): median fwd+bwd time of ``SwiGLU`` against three
   ``nn.Linear`` + ``silu(gate) * up``, and the peak-memory ratio; the same
   for ``saved_x12="fp8"`` against the default (issue 26's 8-bit mode),
3. does every GLU variant pass its self-check: all 28 in bf16, SwiGLU in
   fp16, fp32 and fp64 too.

Each result is printed as it comes, so a short GPU window still returns the
first ones; ``DIR/quick_facts.json`` holds them all. Exit code 1 when a
self-check failed (its figures are printed) or the LLaMA case could not run.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

LLAMA = {"M": 4096, "D": 4096, "H": 11008, "dtype": torch.bfloat16}
ROUNDS = 5
DEADLINE_S = 100.0   # modules not reached by then are reported unchecked (the GPU tests check them)


def modules_to_check():
    """(spec, dtype) pairs in check order: SwiGLU bf16 first."""
    from ..activations import SILU
    from ..kernels.sources import VARIANTS
    from ..primitives.first_use_check import probe_spec

    pairs = [(SILU, torch.bfloat16)]
    pairs += [(probe_spec(v), torch.bfloat16) for v in VARIANTS[1:]]
    pairs += [(SILU, dtype) for dtype in (torch.float16, torch.float32, torch.float64)]
    return pairs


def time_llama(device: torch.device, shape=LLAMA, rounds: int = ROUNDS) -> dict:
    """Median fwd+bwd ms and peak bytes of eager HF, of ours and of ours with
    ``saved_x12="fp8"`` at ``shape``."""
    from .bench.contenders import OURS_FP8, ModuleRunner, build_module, master_weights
    from .bench.measure import Clock, interleaved, peak_memory

    clock = Clock(device)
    M, D, H, dtype = shape["M"], shape["D"], shape["H"], shape["dtype"]
    weights = master_weights(D, H, dtype, device)
    x = torch.randn(M, D, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(M, D, device=device, dtype=dtype)
    runners = {name: ModuleRunner(build_module(name, D, H, dtype, device, weights), x, dy)
               for name in ("eager_hf", "swiglu_cupy", OURS_FP8)}
    for runner in runners.values():      # compiles, cuBLAS heuristics, the self-check
        runner.fwd_bwd()
        runner.zero()
    times = interleaved({n: (lambda r=r: (r.zero(), r.fwd_bwd())) for n, r in runners.items()}, clock,
                        rounds=rounds, calls=1)
    peaks = {n: peak_memory(clock, r.fwd_bwd, r.zero) for n, r in runners.items()}
    return {"shape": {k: str(v).replace("torch.", "") for k, v in shape.items()},
            "fwd_bwd_ms": {n: t["median"] for n, t in times.items()},
            "peak_bytes": peaks}


def summarize(checks: list[dict], llama: dict | None) -> tuple[list[str], bool]:
    """The report lines and whether every fact is good (CPU-testable)."""
    lines, ok = [], True
    failed = [c for c in checks if c["status"] == "failed"]
    passed = sum(c["status"] == "passed" for c in checks)
    lines.append(f"self-checks: {passed} passed, {len(failed)} failed, "
                 f"{len(checks) - passed - len(failed)} skipped or not reached, of {len(checks)} modules")
    for c in failed:
        ok = False
        lines.append(f"  FAILED {c['line']}")
    if llama is None or "error" in (llama or {}):
        ok = False
        lines.append(f"LLaMA shape: not measured ({(llama or {}).get('error', 'not run')})")
    else:
        ms, peak = llama["fwd_bwd_ms"], llama["peak_bytes"]
        speedup = ms["eager_hf"] / ms["swiglu_cupy"]
        memory = peak["swiglu_cupy"] / peak["eager_hf"]
        s = llama["shape"]
        lines.append(f"LLaMA M={s['M']} D={s['D']} H={s['H']} {s['dtype']} fwd+bwd: swiglu-cupy "
                     f"{ms['swiglu_cupy']:.2f} ms, eager {ms['eager_hf']:.2f} ms: {speedup:.2f}x "
                     f"{'faster' if speedup > 1 else 'NOT faster'}; peak memory {memory:.2f}x eager's "
                     f"({peak['swiglu_cupy'] / 2**20:.0f} / {peak['eager_hf'] / 2**20:.0f} MiB)")
        if "swiglu_cupy_fp8" in ms:
            lines.append(f"  saved_x12='fp8': {ms['swiglu_cupy_fp8']:.2f} ms "
                         f"({ms['swiglu_cupy_fp8'] / ms['swiglu_cupy']:.2f}x the default's time), peak memory "
                         f"{peak['swiglu_cupy_fp8'] / peak['swiglu_cupy']:.2f}x the default's "
                         f"({peak['swiglu_cupy_fp8'] / 2**20:.0f} MiB)")
    return lines, ok


def _check_dict(result) -> dict:
    return {"kernel": result.kernel, "dtype": str(result.dtype).replace("torch.", ""), "device": result.device,
            "status": result.status, "detail": result.detail, "ms": result.seconds * 1e3, "line": result.line()}


def run(out: str, deadline_s: float = DEADLINE_S) -> int:
    from ..primitives import first_use_check

    if not torch.cuda.is_available():
        print("quick facts need a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    checks, llama = [], None

    def check(spec, dtype):
        result = first_use_check.check_module(None, spec, dtype, device)
        checks.append(_check_dict(result))
        print(f"[{time.perf_counter() - start:5.1f} s] self-check {result.line()}", flush=True)

    pairs = modules_to_check()
    check(*pairs[0])
    try:
        llama = time_llama(device)
    except Exception as exc:   # out of memory on a small GPU, ...
        llama = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    print(f"[{time.perf_counter() - start:5.1f} s] {summarize([], llama)[0][-1]}", flush=True)
    torch.cuda.empty_cache()
    for spec, dtype in pairs[1:]:
        if time.perf_counter() - start > deadline_s:   # compiles slower than assumed: report, do not overrun
            checks.append({"status": "not reached", "line": f"{spec} [{dtype}]: not reached within {deadline_s:.0f} s"})
            continue
        check(spec, dtype)
    lines, ok = summarize(checks, llama)
    report = {"device": first_use_check.describe_device(None, device), "seconds": time.perf_counter() - start,
              "passed": ok, "self_checks": checks, "llama": llama, "summary": lines}
    (out_dir / "quick_facts.json").write_text(json.dumps(report, indent=2) + "\n")
    print("quick facts " + ("PASSED" if ok else "FAILED") + f" in {report['seconds']:.0f} s:\n  " + "\n  ".join(lines),
          flush=True)
    return 0 if ok else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m swiglu_cupy.tools.quick_facts")
    parser.add_argument("--out", required=True)
    return run(parser.parse_args(argv).out)


if __name__ == "__main__":
    sys.exit(main())
