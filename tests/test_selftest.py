"""``python -m swiglu_cupy selftest`` without a GPU: the no-CUDA exit, and the
pieces that keep it within its budget (estimate, sweep choice, step limit)."""
import os
import subprocess
import sys
import time

import pytest
import torch

from swiglu_cupy.tools import gpu_selftest
from swiglu_cupy.tools.gpu_selftest import Step, _tee, choose_sweep, format_estimate, format_summary, sweep_estimates


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
    assert gpu_selftest.tests_estimate(40) == pytest.approx(40 * gpu_selftest.ASSUMED_S_PER_GPU_TEST)
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


def test_quick_facts_run_first_and_a_failed_self_check_fails_the_selftest(tmp_path, monkeypatch, capsys):
    """The orchestration without a GPU: the quick-facts step runs before the
    GPU tests are even counted, its summary leads selftest.txt, and a failed
    self-check in it (its exit code 1) fails the selftest."""
    import json

    order = []

    def fake_tee(cmd, cwd, log, limit_s):
        order.append(cmd[2] if cmd[2] != "swiglu_cupy" else " ".join(cmd[2:4]))
        if cmd[2] == "swiglu_cupy.tools.quick_facts":
            out = gpu_selftest.Path(cmd[cmd.index("--out") + 1])
            lines = ["self-checks: 30 passed, 1 failed, 0 skipped or not reached, of 31 modules",
                     "  FAILED glu_gelu [bfloat16, NVIDIA X (sm_90, cuda:0)]: failed, 24 launches, 3.0 ms; "
                     "glu_forward_gelu_vec_p1 h: worst |diff| 0.5 = 9e+03 x its bound"]
            (out / "quick_facts.json").write_text(json.dumps({"summary": lines}))
            return 1, False
        return 0, False

    monkeypatch.setattr(gpu_selftest.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_selftest.torch.cuda, "get_device_name", lambda i=0: "NVIDIA X")
    monkeypatch.setattr(gpu_selftest, "_tee", fake_tee)
    monkeypatch.setattr(gpu_selftest, "count_gpu_tests", lambda root, tests: order.append("count") or 3)
    monkeypatch.setattr(gpu_selftest, "sweep_estimates", lambda: {"full": 40.0, "quick": 10.0})
    assert gpu_selftest.run(str(tmp_path / "out")) == 1
    assert order == ["swiglu_cupy.tools.quick_facts", "count", "pytest", "swiglu_cupy bench", "swiglu_cupy bench",
                     "swiglu_cupy bench"]
    text = (tmp_path / "out" / "selftest.txt").read_text().splitlines()
    assert text[0].startswith("selftest FAILED")
    assert text[1] == "quick facts: self-checks: 30 passed, 1 failed, 0 skipped or not reached, of 31 modules"
    assert text[2].startswith("quick facts:   FAILED glu_gelu [bfloat16") and "9e+03 x its bound" in text[2]
    assert text[3].startswith("swiglu_cupy.tools.quick_facts --out ") and "exit 1" in text[3]


def test_quick_facts_summary():
    from swiglu_cupy.tools.quick_facts import modules_to_check, summarize

    pairs = modules_to_check()
    assert len(pairs) == 31 and pairs[0][0].kind == "silu" and pairs[0][1] is torch.bfloat16
    assert len({p for p in pairs}) == 31
    checks = [{"status": "passed", "line": "swiglu ...: passed"}, {"status": "skipped", "line": "x"}]
    llama = {"shape": {"M": 4096, "D": 4096, "H": 11008, "dtype": "bfloat16"},
             "fwd_bwd_ms": {"eager_hf": 12.0, "swiglu_cupy": 10.0},
             "peak_bytes": {"eager_hf": 1000 * 2**20, "swiglu_cupy": 700 * 2**20}}
    lines, ok = summarize(checks, llama)
    assert ok and lines[0] == "self-checks: 1 passed, 0 failed, 1 skipped or not reached, of 2 modules"
    assert lines[1] == ("LLaMA M=4096 D=4096 H=11008 bfloat16 fwd+bwd: swiglu-cupy 10.00 ms, eager 12.00 ms: "
                        "1.20x faster; peak memory 0.70x eager's (700 / 1000 MiB)")
    llama["fwd_bwd_ms"]["swiglu_cupy_fp8"], llama["peak_bytes"]["swiglu_cupy_fp8"] = 11.0, 630 * 2**20
    assert summarize(checks, llama)[0][2] == ("  saved_x12='fp8': 11.00 ms (1.10x the default's time), peak memory "
                                              "0.90x the default's (630 MiB)")
    lines, ok = summarize(checks + [{"status": "failed", "line": "glu_relu [...]: failed; worst"}],
                          {"error": "OutOfMemoryError: x"})
    assert not ok and lines[1] == "  FAILED glu_relu [...]: failed; worst"
    assert lines[2] == "LLaMA shape: not measured (OutOfMemoryError: x)"


def test_quick_facts_order_deadline_and_exit_code(tmp_path, monkeypatch, capsys):
    """quick_facts.run without a GPU: SwiGLU bf16 is checked first, then the
    LLaMA shape is timed, then the other modules until the deadline; a
    failed check makes it exit 1 with the check's figures printed."""
    import json

    from swiglu_cupy.primitives import first_use_check
    from swiglu_cupy.tools import quick_facts

    events = []

    def fake_check(launcher, spec, dtype, device):
        events.append(("check", str(spec), dtype))
        failed = spec.kind == "oai" and spec.limit is not None and spec.interleaved   # the last variant
        return first_use_check.CheckResult(
            first_use_check.kernel_variant(spec), dtype, "GPU X", "failed" if failed else "passed",
            "glu_forward_oai_clamp_pairs_vec_p1 h: worst |diff| 3 = 7 x its bound" if failed else "ok", 0.002, 24, 1)

    monkeypatch.setattr(quick_facts.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(quick_facts.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(first_use_check, "check_module", fake_check)
    monkeypatch.setattr(first_use_check, "describe_device", lambda launcher, device: "GPU X")
    monkeypatch.setattr(quick_facts, "time_llama", lambda device: events.append(("llama",)) or {
        "shape": {"M": 1, "D": 2, "H": 3, "dtype": "bfloat16"}, "fwd_bwd_ms": {"eager_hf": 2.0, "swiglu_cupy": 1.0},
        "peak_bytes": {"eager_hf": 2 * 2**20, "swiglu_cupy": 2**20}})
    assert quick_facts.run(str(tmp_path), deadline_s=60) == 1
    assert events[0] == ("check", "silu", torch.bfloat16) and events[1] == ("llama",)
    assert len(events) == 32                                   # 31 modules + the LLaMA case
    out = capsys.readouterr().out
    assert "quick facts FAILED" in out and "FAILED glu_oai_clamp_pairs [bfloat16, GPU X]: failed" in out
    assert "7 x its bound" in out and "2.00x faster" in out
    report = json.loads((tmp_path / "quick_facts.json").read_text())
    assert report["passed"] is False and len(report["self_checks"]) == 31

    events.clear()
    monkeypatch.setattr(quick_facts.time, "perf_counter", iter(range(0, 10_000, 5)).__next__)
    assert quick_facts.run(str(tmp_path), deadline_s=60) == 0  # the failing one is not reached in time
    checked = [e for e in events if e[0] == "check"]
    assert 1 < len(checked) < 31
    report = json.loads((tmp_path / "quick_facts.json").read_text())
    assert sum(c["status"] == "not reached" for c in report["self_checks"]) == 31 - len(checked)
