"""The bench's measuring pieces on the CPU: statistics, the clock, a runner's
measurement record, the copy rate and how failures are recorded."""
import time

import pytest
import torch

from swiglu_cupy.tools.bench.config import Settings
from swiglu_cupy.tools.bench.contenders import ModuleRunner, build_module, master_weights
from swiglu_cupy.tools.bench.measure import (NEEDS_CUDA, Clock, bench_copy, bench_cpu_path, bench_overhead,
                                       elementwise_bytes, interleaved, measure_runner, median_ratio,
                                       relative_error, short_error, stats)

CPU = torch.device("cpu")
SETTINGS = Settings(device="cpu", quick=False, warmup=1, repeats=3, overhead_calls=10, copy_mib=1,
                    ratio_rounds=3)


def test_stats_of_known_samples():
    s = stats([float(v) for v in range(10, 0, -1)])  # order must not matter
    assert s == {"median": 5.5, "p10": pytest.approx(1.9), "p90": pytest.approx(9.1),
                 "min": 1.0, "max": 10.0, "mean": 5.5, "n": 10}


def test_clock_calls_prepare_before_each_timed_call_and_times_it():
    clock = Clock(CPU)
    assert not clock.cuda
    prepared, timed = [], []

    def prepare():
        prepared.append(len(prepared))
        return prepared[-1]

    def run(state):
        timed.append(state)
        time.sleep(0.002)

    samples = clock.samples(run, prepare, warmup=2, repeats=4)
    assert timed == prepared == list(range(6))  # each call got its own prepared state
    assert len(samples) == 4 and all(ms >= 2.0 for ms in samples)  # sleep lasts at least its time
    assert clock.wall(lambda: time.sleep(0.002)) >= 0.002


def test_measure_runner_records_times_and_null_memory_on_cpu():
    D, H, M = 8, 12, 3
    weights = master_weights(D, H, torch.float32, CPU)
    x = torch.randn(M, D, requires_grad=True)
    runner = ModuleRunner(build_module("eager_hf", D, H, torch.float32, CPU, weights), x, torch.randn(M, D))
    res = measure_runner(runner, Clock(CPU), SETTINGS, lower_bound=False)
    for key in ("fwd_ms", "bwd_ms", "fwd_bwd_ms"):
        assert res[key]["n"] == SETTINGS.repeats and res[key]["min"] > 0, key
    assert res["first_call_s"] > 0
    for key in ("peak_mem_fwd_bwd_bytes", "peak_mem_nograd_fwd_bytes"):
        assert res[key] is None and res["null_reasons"][key] == NEEDS_CUDA
    assert x.grad is None  # the runner is left with no gradients


def test_copy_rate_counts_read_and_write_bytes():
    res = bench_copy(Clock(CPU), SETTINGS)
    assert res["buffer_bytes"] == 2**20
    assert res["ms"]["n"] == 5  # at least five repeats
    assert res["gbps"] == pytest.approx(2 * 2**20 / (res["ms"]["median"] * 1e-3) / 1e9)


def test_relative_error():
    ref = torch.tensor([3.0, 4.0])
    assert relative_error(ref * 1.01, ref) == pytest.approx(0.01, rel=1e-5)
    assert relative_error(ref, ref) == 0.0


def test_short_error_is_one_bounded_line_naming_the_type():
    text = short_error(RuntimeError("first line " + "x" * 400 + "\nsecond line"))
    assert text.startswith("RuntimeError: first line") and "second" not in text and len(text) == 300
    assert short_error(KeyError()) == "KeyError:"


def test_interleaved_rotates_the_order_and_times_each_block_per_call():
    order = []

    def slow():
        order.append("slow")
        time.sleep(0.004)

    fns = {"slow": slow, "a": lambda: order.append("a"), "b": lambda: order.append("b")}
    timings = interleaved(fns, Clock(CPU), rounds=3, calls=2, unit="ms")
    # Round r starts at the r-th name; each name runs one block of 2 calls per round.
    blocks = [order[i] for i in range(0, len(order), 2)]
    assert blocks == ["slow", "a", "b", "a", "b", "slow", "b", "slow", "a"]
    assert {name: t["n"] for name, t in timings.items()} == {"slow": 3, "a": 3, "b": 3}
    assert timings["slow"]["min"] >= 4.0 > timings["a"]["max"]  # per call, not per block
    assert median_ratio(timings, "slow", "a") == pytest.approx(timings["slow"]["median"] / timings["a"]["median"])
    assert median_ratio(timings, "slow", "absent") is None


def test_interleaved_takes_a_timer_and_hands_back_the_samples():
    """time.thread_time counts the calling thread's CPU time: a sleep costs
    none of it, a busy loop does; ``samples`` gets each round's time."""
    def busy():
        end = time.thread_time() + 0.003
        while time.thread_time() < end:
            pass

    samples = {}
    timings = interleaved({"sleep": lambda: time.sleep(0.01), "busy": busy}, Clock(CPU), rounds=3, calls=1,
                          unit="ms", timer=time.thread_time, samples=samples)
    assert list(samples) == ["sleep", "busy"] and all(len(v) == 3 for v in samples.values())
    assert max(samples["sleep"]) < 3.0 <= min(samples["busy"])
    assert timings["busy"]["median"] == stats(samples["busy"])["median"]


def test_elementwise_bytes_formula():
    # forward: read gate and up (2H), write h (H); backward: read x12 (2H) and dh (H), write dx12 (2H) and h (H).
    assert elementwise_bytes(M=8192, H=11008, element_size=2) == (8192 * 11008 * 2 * 3, 8192 * 11008 * 2 * 6)
    assert elementwise_bytes(M=1, H=1, element_size=4) == (12, 24)


def test_overhead_record_has_both_modes_and_ratios_to_eager_hf():
    steps = []
    res = bench_overhead(Clock(CPU), SETTINGS, skip={"torch_compile", "liger"}, progress=steps.append)
    assert len(steps) == 2 and "grad" in steps[0] and "no_grad" in steps[1]
    assert res["shape"] == {"D": 64, "H": 64, "M": 1, "dtype": "fp32"}
    assert res["null_reasons"] == {"torch_compile": "skipped (--skip)", "liger": "skipped (--skip)"}
    for mode in ("grad", "no_grad"):
        timings = res["us_per_call"][mode]
        assert timings["torch_compile"] is None and timings["liger"] is None
        for name in ("gemm_lower_bound", "eager_hf", "eager_packed", "swiglu_cupy"):
            assert timings[name]["n"] == SETTINGS.ratio_rounds and timings[name]["min"] > 0, (mode, name)
        assert res["ratio_vs_reference"][mode]["swiglu_cupy"] == pytest.approx(
            timings["swiglu_cupy"]["median"] / timings["eager_hf"]["median"])
    assert res["goals"] == {"grad": 1.25, "no_grad": 1.0}


def test_cpu_path_record_per_dtype_and_case():
    res = bench_cpu_path(Clock(CPU), SETTINGS, progress=lambda _: None, shape=(8, 12, 5), dtypes=("fp32", "bf16"))
    assert res["shape"] == {"D": 8, "H": 12, "M": 5} and res["reference"] == "eager_hf"
    assert [(c["what"], c["dtype"], c["goal"]) for c in res["cases"]] == [
        ("fwd_bwd", "fp32", 1.05), ("nograd_fwd", "fp32", 1.0), ("fwd_bwd", "bf16", 1.15), ("nograd_fwd", "bf16", 1.0)]
    for case in res["cases"]:
        timed = {"eager_hf": 3, "swiglu_cupy": 3}
        if case["what"] == "fwd_bwd":   # saved_x12="fp8" beside the default (no-grad saves nothing)
            timed["swiglu_cupy_fp8"] = 3
            assert case["fp8_ratio"] == pytest.approx(case["ms"]["swiglu_cupy_fp8"]["median"]
                                                      / case["ms"]["eager_hf"]["median"])
        assert {name: t["n"] for name, t in case["ms"].items()} == timed
        assert case["ratio"] == pytest.approx(case["ms"]["swiglu_cupy"]["median"] / case["ms"]["eager_hf"]["median"])
