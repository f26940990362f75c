"""The bench's measuring pieces on the CPU: statistics, the clock, a runner's
measurement record, the copy rate and how failures are recorded."""
import time

import pytest
import torch

from swiglu_cupy.bench.config import Settings
from swiglu_cupy.bench.contenders import ModuleRunner, build_module, master_weights
from swiglu_cupy.bench.measure import (NEEDS_CUDA, Clock, bench_copy, measure_runner, relative_error,
                                       short_error, stats)

CPU = torch.device("cpu")
SETTINGS = Settings(device="cpu", quick=False, warmup=1, repeats=3, overhead_calls=10, copy_mib=1)


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
