"""``bench --sweep-launch`` without a GPU: its arguments, the runtime estimate,
the best-candidate selection and table from synthetic results, the no-CUDA
exit, and one shape swept end to end with the host-executed kernels."""
import argparse
import math
import os
import subprocess
import sys

import pytest
import torch

from swiglu_cupy.tools.bench import add_arguments
from swiglu_cupy.tools.bench.config import Settings
from swiglu_cupy.tools.bench.measure import Clock, elementwise_bytes
from swiglu_cupy.tools.bench.sweep import (KERNELS, SweepShape, best_per_kernel, describe_estimate, estimate_seconds,
                                     format_sweep, recommend, resolve_sweep, sweep_shape)
from swiglu_cupy.kernels.launch_config import DEFAULT_LAUNCH, LAUNCH_CANDIDATES, LaunchConfig

FAST = LaunchConfig(2, 256, None)
SLOW = LaunchConfig(1, 128, 1)


def _args(*argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--sweep-launch", *argv])


def test_defaults_are_the_llama_shapes_and_every_candidate():
    plan = resolve_sweep(_args())
    assert plan.shapes == [SweepShape(8192, 11008, "bf16"), SweepShape(8192, 14336, "bf16")]
    assert plan.candidates == LAUNCH_CANDIDATES and len(plan.candidates) == 27
    assert (plan.settings.device, plan.settings.warmup, plan.settings.repeats) == ("cuda", 3, 10)


def test_overrides_tokens_hidden_preset_dtype_and_counts():
    plan = resolve_sweep(_args("--tokens", "1024", "4096", "--preset", "llama70b", "--hidden", "4096",
                               "--dtype", "fp16", "--quick", "--repeats", "4"))
    assert plan.shapes == [SweepShape(1024, 28672, "fp16"), SweepShape(4096, 28672, "fp16"),
                           SweepShape(1024, 4096, "fp16"), SweepShape(4096, 4096, "fp16")]
    assert (plan.settings.quick, plan.settings.warmup, plan.settings.repeats) == (True, 2, 4)


def test_dim_is_rejected_by_name():
    with pytest.raises(ValueError, match="--dim means nothing to --sweep-launch"):
        resolve_sweep(_args("--dim", "4096"))


def test_estimate_counts_every_timing_and_follows_its_model():
    plan = resolve_sweep(_args())
    est = estimate_seconds(plan)
    assert est["timings"] == 27 * 2 * 2 and est["calls_per_timing"] == 3 + 10 + 1
    assert est["total_s"] == pytest.approx(est["compile_s"] + est["timing_s"])
    # More repeats cost more; the bytes of a bigger H cost more.
    assert estimate_seconds(resolve_sweep(_args("--repeats", "50")))["timing_s"] > est["timing_s"]
    assert estimate_seconds(resolve_sweep(_args("--hidden", "28672")))["timing_s"] > \
        estimate_seconds(resolve_sweep(_args("--hidden", "11008")))["timing_s"]
    text = describe_estimate(plan, est)
    assert text.startswith("sweep: 27 candidates x 2 kernels x 2 shapes = 108 timings of 14 calls; estimated ~")
    assert "assumed costs, not measured" in text


def _stats(median):
    return {"median": median, "p10": median * 0.95, "p90": median * 1.05, "min": median * 0.9,
            "max": median * 1.1, "mean": median, "n": 5}


def _entry(config, fwd_ms, bwd_ms, copy_gbps=4000.0, nbytes=(600e6, 1200e6)):
    entry = {"config": {"packs_per_thread": config.packs_per_thread, "threads_per_block": config.threads_per_block,
                        "grid_waves": config.grid_waves},
             "label": config.label, "is_default": config == DEFAULT_LAUNCH, "bitwise_equal_to_default": True}
    for kernel, ms, b in zip(KERNELS, (fwd_ms, bwd_ms), nbytes):
        gbps = b / (ms * 1e-3) / 1e9
        entry[kernel] = {"ms": _stats(ms), "gbps": gbps, "pct_of_copy": 100 * gbps / copy_gbps}
    return entry


def _result(H, entries):
    res = {"shape": {"M": 8192, "H": H, "dtype": "bf16"}, "bytes": {"forward": 600e6, "backward": 1200e6},
           "candidates": entries}
    res["best"] = best_per_kernel(res)
    return res


def _report(results):
    return {"environment": {"date": "2030-01-01", "gpu_name": "Test GPU", "torch": "9.9", "cupy": "99"},
            "copy": {"buffer_bytes": 512 * 2**20, "gbps": 4000.0}, "results": results,
            "recommendation": recommend(results), "wall_s": 12.0, "estimate": {"total_s": 40.0}}


def test_best_per_kernel_and_recommended_default():
    # FAST wins forward everywhere, SLOW wins backward at one shape only.
    results = [_result(11008, [_entry(DEFAULT_LAUNCH, 0.20, 0.40), _entry(FAST, 0.15, 0.38),
                               _entry(SLOW, 0.30, 0.37)]),
               _result(14336, [_entry(DEFAULT_LAUNCH, 0.26, 0.52), _entry(FAST, 0.20, 0.50),
                               _entry(SLOW, 0.40, 0.60)])]
    assert results[0]["best"] == {"forward": FAST.label, "backward": SLOW.label}
    assert results[1]["best"] == {"forward": FAST.label, "backward": FAST.label}
    rec = recommend(results)
    ratios = [0.15 / 0.20, 0.38 / 0.40, 0.20 / 0.26, 0.50 / 0.52]
    assert rec["label"] == FAST.label and rec["change_default"]
    assert rec["geomean_time_vs_default"] == pytest.approx(math.exp(sum(map(math.log, ratios)) / 4))
    assert rec["new_line"] == "DEFAULT_LAUNCH = LaunchConfig(packs_per_thread=2, threads_per_block=256, " \
                              "grid_waves=None)"
    # The current line is the one launch_config.py holds.
    import swiglu_cupy.kernels.launch_config as lc
    with open(lc.__file__) as fh:
        assert rec["current_line"] in fh.read().splitlines()

    lines = format_sweep(_report(results)).splitlines()
    assert "device copy (dst.copy_(src), 512 MiB): 4000.0 GB/s" in lines
    assert "== M=8192 H=11008 bf16  (forward moves 600.0 MB, backward 1200.0 MB)" in lines
    row = next(line for line in lines if line.startswith(FAST.label))
    # forward: 0.15 ms, 600 MB -> 4000 GB/s = 100% of copy, fastest (*).
    assert "  0.1500 (0.1425-0.1575)    4000.0   100%*" in row
    assert any(line.startswith(DEFAULT_LAUNCH.label + " (default)") for line in lines)
    assert f"best backward at M=8192 H=11008 bf16: {SLOW.label}  0.3700 (0.3515-0.3885)    3243.2    81%" in lines
    i = lines.index("to make it the default, in swiglu_cupy/kernels/launch_config.py replace")
    assert lines[i + 1:i + 4] == [f"    {rec['current_line']}", "with", f"    {rec['new_line']}"]
    assert lines[-1] == "total sweep time: 12.0 s (estimated ~40 s)"


def test_keeps_the_default_within_noise_and_skips_failed_candidates():
    broken = {"config": {"packs_per_thread": 4, "threads_per_block": 512, "grid_waves": 4},
              "label": LaunchConfig(4, 512, 4).label, "is_default": False, "bitwise_equal_to_default": False,
              "error": "outputs differ from the default launch's (...): not timed"}
    results = [_result(11008, [_entry(DEFAULT_LAUNCH, 0.20, 0.40), _entry(FAST, 0.199, 0.399), broken])]
    assert results[0]["best"] == {"forward": FAST.label, "backward": FAST.label}
    rec = recommend(results)
    assert rec["label"] == FAST.label and not rec["change_default"]  # 0.4% faster: noise
    text = format_sweep(_report(results))
    assert f"keep the default (DEFAULT_LAUNCH = {DEFAULT_LAUNCH!r}): no candidate is more than 2% faster overall" in text
    assert f"{broken['label']}" in text and "outputs differ from the default" in text
    assert f"FAILED (1): {broken['label']} at M=8192 H=11008" in text


def test_no_recommendation_without_the_default():
    assert recommend([_result(11008, [_entry(FAST, 0.2, 0.4)])]) is None


def test_without_cuda_exits_2_and_writes_nothing(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "swiglu_cupy", "bench", "--sweep-launch", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2
    assert "bench --sweep-launch times the CUDA kernels and needs a CUDA GPU" in proc.stderr
    assert "Nothing was run." in proc.stderr and not any(tmp_path.iterdir())


class _SkippingLauncher:
    """The host launcher, except that launches with ``skip``'s block size do
    nothing: a launch shape that misses elements (a fault of the shape, as on
    a GPU, so the config's own self-check probe meets it too)."""

    def __init__(self, launcher, skip):
        self.launcher, self.skip = launcher, skip

    def launch(self, name, dtype, device, grid, block, args):
        if block[0] * block[1] * block[2] != self.skip.threads_per_block:
            self.launcher.launch(name, dtype, device, grid, block, args)


def test_one_shape_swept_with_host_executed_kernels(host_launcher, monkeypatch):
    M, H = 40, 72   # vector path for bf16 (H % 8 == 0)
    settings = Settings("cpu", True, warmup=0, repeats=2, overhead_calls=0, copy_mib=1)
    candidates = (DEFAULT_LAUNCH, FAST, SLOW)
    # The self-check on: SLOW's own probe catches it (it would run torch), and it is not timed.
    with pytest.warns(RuntimeWarning, match="self-check FAILED.*" + SLOW.label):
        res = sweep_shape(SweepShape(M, H, "bf16"), candidates, Clock(torch.device("cpu")), settings, 10.0,
                          progress=lambda _: None, launcher=_SkippingLauncher(host_launcher, SLOW))
    refused = next(c for c in res["candidates"] if c["label"] == SLOW.label)
    assert "self-check failed" in refused["error"] and not any(k in refused for k in KERNELS)
    # The self-check off: the sweep's own comparison with the default's outputs catches it.
    monkeypatch.setenv("SWIGLU_CUPY_SELFCHECK", "0")
    res = sweep_shape(SweepShape(M, H, "bf16"), candidates, Clock(torch.device("cpu")), settings, 10.0,
                      progress=lambda _: None, launcher=_SkippingLauncher(host_launcher, SLOW))
    assert res["bytes"] == dict(zip(KERNELS, elementwise_bytes(M, H, 2)))
    by_label = {c["label"]: c for c in res["candidates"]}
    for config in (DEFAULT_LAUNCH, FAST):
        entry = by_label[config.label]
        assert entry["bitwise_equal_to_default"] and "error" not in entry
        for kernel in KERNELS:
            m = entry[kernel]
            assert m["ms"]["n"] == 2 and m["ms"]["median"] > 0
            assert m["gbps"] == pytest.approx(res["bytes"][kernel] / (m["ms"]["median"] * 1e-3) / 1e9)
            assert m["pct_of_copy"] == pytest.approx(100 * m["gbps"] / 10.0)
    skipped = by_label[SLOW.label]
    assert skipped["bitwise_equal_to_default"] is False and "not timed" in skipped["error"]
    assert not any(k in skipped for k in KERNELS)
    assert set(res["best"].values()) <= {DEFAULT_LAUNCH.label, FAST.label}
