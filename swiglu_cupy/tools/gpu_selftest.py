"""``python -m swiglu_cupy selftest --out DIR``: the one-command GPU check,
within a time budget (8 minutes on one GPU: GPU time is scarce).

0. quick facts (``tools/quick_facts.py``, first, before anything is even
   counted, stopped after ``QUICK_FACTS_LIMIT_S``): every GLU variant's
   self-check, ours against eager on one LLaMA shape, the peak-memory ratio;
   a failed self-check fails the selftest with its figures,
1. ``pytest -m gpu -q`` on the checkout's ``tests/`` (log and junit XML in DIR),
2. ``python -m swiglu_cupy bench --quick --out DIR``,
3. ``python -m swiglu_cupy bench --moe --out DIR`` (the MoE experts against
   Hugging Face's grouped_mm: time and saved bytes),
4. ``python -m swiglu_cupy bench --sweep-launch --out DIR`` (``--quick`` when
   the full sweep no longer fits the budget),
5. a summary in ``DIR/selftest.json`` and ``DIR/selftest.txt`` with each
   step's seconds next to its estimate.

Before anything runs it prints an estimate per step and in total, from a
simple model: the GPU tests are counted (``pytest --collect-only``) and
charged an assumed cost each, the quick bench an assumed total, the sweep its
own model (``bench.sweep.estimate_seconds``). Each step is stopped when it
overruns its share of the budget (what is left, less the estimates of the
steps after it), so the whole check ends within the budget.

Exit codes: 0 when every step ran and passed, 1 when one failed, overran or
did not fit, 2 when this machine cannot run the check (no CUDA device, or no
``tests/``).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

import torch

BUDGET_S = 480.0
# The estimate's assumed costs (not measured): most GPU tests take well under
# a second, the torchrun ones tens of seconds; the quick bench is dominated by
# torch.compile of eager HF per shape and the two fresh compile-probe processes.
ASSUMED_S_PER_GPU_TEST = 1.5
ASSUMED_BENCH_QUICK_S = 180.0
ASSUMED_BENCH_MOE_S = 45.0   # two dtypes x 20 rounds of a small experts layer, plus 7 tiny models on the CPU
SWEEP_STEP = "bench --sweep-launch"
QUICK_STEP = "quick facts"
ASSUMED_QUICK_FACTS_S = 60.0  # 31 module compiles + checks, one LLaMA shape timed twice x 5 rounds
QUICK_FACTS_LIMIT_S = 120.0


@dataclass
class Step:
    name: str
    command: list[str]
    estimate_s: float
    log: str
    result: dict = field(default_factory=dict)


def _tee(cmd: list[str], cwd: Path, log: Path, limit_s: float) -> tuple[int, bool]:
    """Runs ``cmd``, echoing its output and writing it to ``log``; stops its
    whole process group after ``limit_s``. Returns (exit code, overran)."""
    overran = threading.Event()
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)

        def stop() -> None:
            overran.set()
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

        timer = threading.Timer(max(limit_s, 0.0), stop)
        timer.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                sys.stdout.write(line)
                sys.stdout.flush()
                fh.write(line)
            rc = proc.wait()
        finally:
            timer.cancel()
        if overran.is_set():
            fh.write(f"\n[selftest] stopped after {limit_s:.0f} s: over this step's share of the budget\n")
    return rc, overran.is_set()


def _junit_counts(path: Path) -> dict | None:
    try:
        root = ET.parse(path).getroot()
    except Exception:
        return None
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for suite in suites:
        for key in counts:
            counts[key] += int(suite.get(key, 0))
    return counts


def count_gpu_tests(root: Path, tests: Path) -> int | None:
    """The number of tests ``pytest -m gpu`` selects, or None if collection failed."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "--collect-only", "-q", str(tests)],
                          cwd=root, capture_output=True, text=True)
    ids = [line for line in proc.stdout.splitlines() if "::" in line]
    return len(ids) if proc.returncode == 0 else None


def sweep_estimates() -> dict[str, float]:
    """The launch sweep's estimated seconds, full and ``--quick``."""
    from .bench import add_arguments
    from .bench.sweep import estimate_seconds, resolve_sweep

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return {mode: estimate_seconds(resolve_sweep(parser.parse_args(["--sweep-launch", *extra])))["total_s"]
            for mode, extra in (("full", []), ("quick", ["--quick"]))}


def tests_estimate(n_tests: int | None) -> float:
    """Seconds for the GPU tests: an assumed cost per test (100 tests when
    they could not be counted)."""
    return ASSUMED_S_PER_GPU_TEST * (n_tests if n_tests is not None else 100)


def choose_sweep(left_s: float, estimates: dict[str, float]) -> str | None:
    """"full" if the full sweep fits ``left_s``, else "quick" if that fits, else None."""
    for mode in ("full", "quick"):
        if estimates[mode] <= left_s:
            return mode
    return None


def format_estimate(steps: list[Step], budget_s: float) -> str:
    total = sum(s.estimate_s for s in steps)
    lines = [f"selftest: estimated ~{total:.0f} s of the {budget_s:.0f} s budget (an estimate from assumed costs: "
             f"{ASSUMED_S_PER_GPU_TEST} s per GPU test, {ASSUMED_BENCH_QUICK_S:.0f} s for bench --quick, the "
             "sweep's own model; not a measurement)"]
    lines += [f"  [{i}/{len(steps)}] {s.name}: ~{s.estimate_s:.0f} s" for i, s in enumerate(steps, 1)]
    return "\n".join(lines)


def run(out: str, budget_s: float = BUDGET_S) -> int:
    if not torch.cuda.is_available():
        print("selftest needs a CUDA GPU: torch.cuda.is_available() is False on this machine "
              f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}). Nothing was run.",
              file=sys.stderr)
        return 2
    root = Path(__file__).resolve().parents[2]  # the checkout: swiglu_cupy/tools/gpu_selftest.py
    tests = root / "tests"
    if not tests.is_dir():
        print(f"selftest runs the GPU tests from a source checkout, but {tests} does not exist "
              "(run it from a checkout installed with `pip install -e`).", file=sys.stderr)
        return 2
    out_dir = Path(out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    summary: dict = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "budget_s": budget_s,
    }

    py = [sys.executable, "-m"]
    quick = quick_facts_step(py, out_dir)
    print(f"== [0] {QUICK_STEP} (~{quick.estimate_s:.0f} s, stopped after {QUICK_FACTS_LIMIT_S:.0f} s; "
          f"log: {out_dir / quick.log})", flush=True)
    quick.result = _run_step(quick, root, out_dir, QUICK_FACTS_LIMIT_S)
    summary["quick_facts"] = _quick_facts_lines(out_dir)

    collect_start = time.perf_counter()
    n_tests = count_gpu_tests(root, tests)
    collect_s = time.perf_counter() - collect_start
    sweeps = sweep_estimates()
    junit = out_dir / "pytest-gpu.xml"
    steps = [
        Step("GPU tests (pytest -m gpu)", [*py, "pytest", "-m", "gpu", "-q", f"--junitxml={junit}", str(tests)],
             tests_estimate(n_tests), "pytest-gpu.log"),
        Step("bench --quick", [*py, "swiglu_cupy", "bench", "--quick", "--out", str(out_dir)],
             ASSUMED_BENCH_QUICK_S, "bench.log"),
        Step("bench --moe", [*py, "swiglu_cupy", "bench", "--moe", "--out", str(out_dir)],
             ASSUMED_BENCH_MOE_S, "moe.log"),
        Step(SWEEP_STEP, [*py, "swiglu_cupy", "bench", "--sweep-launch", "--out", str(out_dir)],
             sweeps["full"], "sweep.log"),
    ]
    summary["estimate"] = {"collect_s": collect_s, "gpu_tests": n_tests, "quick_facts_s": quick.result["seconds"],
                           "steps": {s.name: s.estimate_s for s in steps},
                           "total_s": quick.result["seconds"] + collect_s + sum(s.estimate_s for s in steps),
                           "assumed": {"s_per_gpu_test": ASSUMED_S_PER_GPU_TEST,
                                       "bench_quick_s": ASSUMED_BENCH_QUICK_S, "sweep_s": sweeps}}
    print(format_estimate(steps, budget_s) + f"\n  (counted {n_tests} GPU tests in {collect_s:.0f} s)", flush=True)

    for i, step in enumerate(steps):
        left = budget_s - (time.perf_counter() - start)
        if step.name == SWEEP_STEP:
            mode = choose_sweep(left, sweeps)
            if mode == "quick":
                step.command.append("--quick")
                step.estimate_s = sweeps["quick"]
            if mode is None:
                step.result = {"ran": False, "passed": False, "seconds": 0.0, "reason":
                               f"did not fit: {left:.0f} s left, the quick sweep needs ~{sweeps['quick']:.0f} s"}
                print(f"== [{i + 1}/{len(steps)}] {step.name}: {step.result['reason']}", flush=True)
                continue
        # What is left, less the cheapest estimates of the steps after this one.
        reserve = sum(sweeps["quick"] if s.name == SWEEP_STEP else s.estimate_s for s in steps[i + 1:])
        limit = left - reserve
        if limit < 1.0:
            step.result = {"ran": False, "passed": False, "seconds": 0.0,
                           "reason": f"did not fit: {left:.0f} s left, ~{reserve:.0f} s kept for the steps after it"}
            print(f"== [{i + 1}/{len(steps)}] {step.name}: {step.result['reason']}", flush=True)
            continue
        print(f"== [{i + 1}/{len(steps)}] {' '.join(step.command[2:])}  (estimate ~{step.estimate_s:.0f} s, "
              f"stopped after {limit:.0f} s; log: {out_dir / step.log})", flush=True)
        step.result = _run_step(step, root, out_dir, limit)
    steps = [quick, *steps]
    summary["steps"] = {s.name: s.result for s in steps}
    if steps[1].result["ran"]:
        summary["steps"][steps[1].name]["counts"] = _junit_counts(junit)
    summary["total_s"] = time.perf_counter() - start
    ok = all(s.result["passed"] for s in steps)
    summary["passed"] = ok
    (out_dir / "selftest.json").write_text(json.dumps(summary, indent=2) + "\n")
    text = format_summary(summary)
    (out_dir / "selftest.txt").write_text(text + "\n")
    print("\n" + text)
    return 0 if ok else 1


def quick_facts_step(py: list[str], out_dir: Path) -> Step:
    return Step(QUICK_STEP, [*py, "swiglu_cupy.tools.quick_facts", "--out", str(out_dir)], ASSUMED_QUICK_FACTS_S,
                "quick_facts.log")


def _run_step(step: Step, root: Path, out_dir: Path, limit: float) -> dict:
    step_start = time.perf_counter()
    rc, overran = _tee(step.command, root, out_dir / step.log, limit)
    return {"ran": True, "exit_code": rc, "overran": overran, "passed": rc == 0 and not overran,
            "seconds": time.perf_counter() - step_start, "estimate_s": step.estimate_s,
            "limit_s": limit, "command": step.command[2:], "log": step.log}


def _quick_facts_lines(out_dir: Path) -> list[str]:
    """The quick facts' summary lines (quick_facts.json), or why there are none."""
    try:
        return json.loads((out_dir / "quick_facts.json").read_text())["summary"]
    except Exception as exc:
        return [f"no quick facts ({type(exc).__name__}: the step wrote no quick_facts.json; see quick_facts.log)"]


def format_summary(summary: dict) -> str:
    lines = [f"selftest {'PASSED' if summary['passed'] else 'FAILED'}  {summary['date']}  {summary['gpu']}  "
             f"{summary['total_s']:.0f} s of the {summary['budget_s']:.0f} s budget "
             f"(estimated ~{summary['estimate']['total_s']:.0f} s)"]
    lines += [f"quick facts: {line}" for line in summary.get("quick_facts", [])]
    for name, r in summary["steps"].items():
        if not r["ran"]:
            lines.append(f"{name}: not run ({r['reason']})")
            continue
        state = f"stopped after {r['limit_s']:.0f} s (over budget)" if r["overran"] else f"exit {r['exit_code']}"
        counts = r.get("counts")
        extra = ("  " + ", ".join(f"{k} {v}" for k, v in counts.items())) if counts else ""
        lines.append(f"{' '.join(r['command'])}: {state}{extra}  ({r['seconds']:.0f} s, estimated "
                     f"~{r['estimate_s']:.0f} s)")
    lines.append("files (of the steps that ran): quick_facts.log/json, pytest-gpu.log/xml, bench.log/json/txt/png, moe.log/json/txt, "
                 "sweep.log/json/txt, selftest.json/txt")
    return "\n".join(lines)
