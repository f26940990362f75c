"""``python -m swiglu_cupy selftest --out DIR``: the one-command GPU check.

1. ``pytest -m gpu -q`` on the checkout's ``tests/`` (log and junit XML in DIR),
2. ``python -m swiglu_cupy bench --quick --out DIR``,
3. a summary in ``DIR/selftest.json`` and ``DIR/selftest.txt``.

Exit codes: 0 when both steps pass, 1 when the tests or the bench fail, 2 when
this machine cannot run the check (no CUDA device, or no ``tests/``).
"""
from __future__ import annotations

import datetime
import json
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import torch


def _tee(cmd: list[str], cwd: Path, log: Path) -> int:
    """Runs ``cmd``, echoing its output and writing it to ``log``; returns the exit code."""
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            fh.write(line)
        return proc.wait()


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


def run(out: str) -> int:
    if not torch.cuda.is_available():
        print("selftest needs a CUDA GPU: torch.cuda.is_available() is False on this machine "
              f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}). Nothing was run.",
              file=sys.stderr)
        return 2
    root = Path(__file__).resolve().parent.parent
    tests = root / "tests"
    if not tests.is_dir():
        print(f"selftest runs the GPU tests from a source checkout, but {tests} does not exist "
              "(run it from a checkout installed with `pip install -e`).", file=sys.stderr)
        return 2
    out_dir = Path(out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    summary: dict = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
    }

    start = time.perf_counter()
    junit, test_log = out_dir / "pytest-gpu.xml", out_dir / "pytest-gpu.log"
    print(f"== [1/2] python -m pytest -m gpu -q  (log: {test_log})", flush=True)
    test_rc = _tee([sys.executable, "-m", "pytest", "-m", "gpu", "-q", f"--junitxml={junit}", str(tests)],
                   root, test_log)
    summary["tests"] = {"exit_code": test_rc, "passed": test_rc == 0, "counts": _junit_counts(junit),
                        "seconds": time.perf_counter() - start, "log": test_log.name, "junit": junit.name}

    start = time.perf_counter()
    bench_log = out_dir / "bench.log"
    print(f"== [2/2] python -m swiglu_cupy bench --quick --out {out_dir}  (log: {bench_log})", flush=True)
    bench_rc = _tee([sys.executable, "-m", "swiglu_cupy", "bench", "--quick", "--out", str(out_dir)],
                    root, bench_log)
    summary["bench"] = {"exit_code": bench_rc, "passed": bench_rc == 0, "seconds": time.perf_counter() - start,
                        "log": bench_log.name, "json": "bench.json", "png": "bench.png"}

    ok = test_rc == 0 and bench_rc == 0
    summary["passed"] = ok
    counts = summary["tests"]["counts"] or {}
    text = "\n".join([
        f"selftest {'PASSED' if ok else 'FAILED'}  {summary['date']}  {summary['gpu']}",
        f"gpu tests: exit {test_rc}  " + ", ".join(f"{k} {v}" for k, v in counts.items()) +
        f"  ({summary['tests']['seconds']:.0f} s)",
        f"bench --quick: exit {bench_rc}  ({summary['bench']['seconds']:.0f} s)",
        f"files in {out_dir}: pytest-gpu.log, pytest-gpu.xml, bench.log, bench.json, bench.txt, bench.png",
    ])
    (out_dir / "selftest.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out_dir / "selftest.txt").write_text(text + "\n")
    print("\n" + text)
    return 0 if ok else 1
