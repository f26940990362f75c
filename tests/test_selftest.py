"""``python -m swiglu_cupy selftest`` without a GPU: the no-CUDA exit, and the
pieces that keep it within its budget (estimate, sweep choice, step limit)."""
import os
import subprocess
import sys
import time

import pytest

from swiglu_cupy.tools import selftest
from swiglu_cupy.tools.selftest import Step, _tee, choose_sweep, format_estimate, format_summary, sweep_estimates


def test_without_cuda_exits_2_and_runs_nothing(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "swiglu_cupy", "selftest", "--out", str(out)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2
    assert "selftest needs a CUDA GPU" in proc.stderr and "Nothing was run." in proc.stderr
    assert "estimated" not in proc.stdout and not out.exists()


def test_step_limit_stops_the_whole_process_group(tmp_path):
    log = tmp_path / "step.log"
    # The grandchild inherits stdout: only stopping the group ends the step.
    script = ("import subprocess, sys, time; print('started', flush=True); "
              "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)")
    start = time.perf_counter()
    rc, overran = _tee([sys.executable, "-c", script], tmp_path, log, limit_s=2.0)
    assert overran and rc != 0
    assert time.perf_counter() - start < 30
    text = log.read_text()
    assert text.startswith("started\n") and "stopped after 2 s: over this step's share of the budget" in text


def test_step_within_its_limit_keeps_its_exit_code(tmp_path):
    log = tmp_path / "step.log"
    rc, overran = _tee([sys.executable, "-c", "print('done'); raise SystemExit(3)"], tmp_path, log, limit_s=60)
    assert (rc, overran) == (3, False) and log.read_text() == "done\n"


def test_sweep_estimates_and_choice():
    est = sweep_estimates()
    assert 0 < est["quick"] < est["full"]
    assert choose_sweep(est["full"], est) == "full"
    assert choose_sweep(est["full"] - 0.1, est) == "quick"
    assert choose_sweep(est["quick"] - 0.1, est) is None


def test_estimate_lists_every_step_and_the_total():
    assert selftest.tests_estimate(40) == pytest.approx(40 * selftest.ASSUMED_S_PER_GPU_TEST)
    steps = [Step("GPU tests (pytest -m gpu)", [], 60.0, "a.log"), Step("bench --quick", [], 180.0, "b.log"),
             Step("bench --sweep-launch", [], 40.4, "c.log")]
    lines = format_estimate(steps, 480).splitlines()
    assert lines[0].startswith("selftest: estimated ~280 s of the 480 s budget (an estimate from assumed costs")
    assert "not a measurement" in lines[0]
    assert lines[1:] == ["  [1/3] GPU tests (pytest -m gpu): ~60 s", "  [2/3] bench --quick: ~180 s",
                         "  [3/3] bench --sweep-launch: ~40 s"]


def test_summary_reports_seconds_estimates_overruns_and_skips():
    summary = {
        "passed": False, "date": "2030-01-01", "gpu": "Test GPU", "total_s": 470.0, "budget_s": 480.0,
        "estimate": {"total_s": 400.0},
        "steps": {
            "GPU tests (pytest -m gpu)": {"ran": True, "exit_code": 0, "overran": False, "passed": True,
                                          "seconds": 100.0, "estimate_s": 120.0, "limit_s": 250.0,
                                          "command": ["pytest", "-m", "gpu", "-q"], "log": "pytest-gpu.log",
                                          "counts": {"tests": 80, "failures": 0, "errors": 0, "skipped": 2}},
            "bench --quick": {"ran": True, "exit_code": -9, "overran": True, "passed": False, "seconds": 370.0,
                              "estimate_s": 180.0, "limit_s": 370.0, "command": ["swiglu_cupy", "bench", "--quick"],
                              "log": "bench.log"},
            "bench --sweep-launch": {"ran": False, "passed": False, "seconds": 0.0,
                                     "reason": "did not fit: 10 s left, the quick sweep needs ~35 s"},
        },
    }
    lines = format_summary(summary).splitlines()
    assert lines[0] == "selftest FAILED  2030-01-01  Test GPU  470 s of the 480 s budget (estimated ~400 s)"
    assert lines[1] == ("pytest -m gpu -q: exit 0  tests 80, failures 0, errors 0, skipped 2  "
                        "(100 s, estimated ~120 s)")
    assert lines[2] == "swiglu_cupy bench --quick: stopped after 370 s (over budget)  (370 s, estimated ~180 s)"
    assert lines[3] == "bench --sweep-launch: not run (did not fit: 10 s left, the quick sweep needs ~35 s)"
