"""The bench report's text table, built from a report dict alone."""
from swiglu_cupy.tools.bench.contenders import LABELS, LOWER_BOUND
from swiglu_cupy.tools.bench.report import format_table


def _stats(median):
    return {"median": median, "p10": median * 0.9, "p90": median * 1.1, "min": median * 0.8,
            "max": median * 1.2, "mean": median, "n": 3}


def _report():
    measured = {"available": True, "fwd_ms": _stats(1.0), "bwd_ms": _stats(2.0), "fwd_bwd_ms": _stats(3.0),
                "peak_mem_fwd_bwd_bytes": 3 * 2**20, "peak_mem_nograd_fwd_bytes": None,
                "rel_err_vs_eager_hf": 2.5e-7}
    return {
        "environment": {"gpu_name": "Test GPU", "cpu": "x86_64", "date": "2030-01-01T00:00:00+00:00",
                        "torch": "9.9", "cupy": "99.0"},
        "results": [{
            "shape": {"name": "tiny", "D": 8, "H": 12, "M": 4, "dtype": "bf16"},
            "contenders": {
                LOWER_BOUND: {"available": True, "fwd_ms": _stats(0.5), "bwd_ms": _stats(0.5),
                              "fwd_bwd_ms": _stats(1.5), "peak_mem_fwd_bwd_bytes": None,
                              "peak_mem_nograd_fwd_bytes": None},
                "swiglu_cupy": measured,
                "liger": {"available": False, "reason": "skipped (--skip)"},
            },
            "elementwise": {"implementation": "CuPy kernels", "fwd_ms": _stats(0.01), "bwd_ms": _stats(0.02),
                            "fwd_gbps": 50.0, "bwd_gbps": 100.0},
        }],
        "copy": {"buffer_bytes": 512 * 2**20, "gbps": 200.0},
        "host_overhead": [{"shape": {"D": 64, "H": 64, "M": 1, "dtype": "fp32"}, "calls": 10, "rounds": 7,
                           "reference": "eager_hf", "goals": {"grad": 1.25, "no_grad": 1.0},
                           "us_per_call": {"grad": {"eager_hf": _stats(12.5), "swiglu_cupy": _stats(25.0),
                                                    "liger": None},
                                           "no_grad": {"eager_hf": _stats(10.0), "swiglu_cupy": _stats(9.0),
                                                       "liger": None}},
                           "ratio_vs_reference": {"grad": {"eager_hf": 1.0, "swiglu_cupy": 2.0},
                                                  "no_grad": {"eager_hf": 1.0, "swiglu_cupy": 0.9}},
                           "null_reasons": {"liger": "skipped (--skip)"}}],
        "cpu_path": {"shape": {"D": 512, "H": 1408, "M": 2048}, "threads": 1, "rounds": 7, "reference": "eager_hf",
                     "cases": [{"what": "fwd_bwd", "dtype": "bf16", "goal": 1.15, "ratio": 1.1,
                                "ms": {"eager_hf": _stats(100.0), "swiglu_cupy": _stats(110.0),
                                       "swiglu_cupy_fp8": _stats(130.0)}, "fp8_ratio": 1.3}]},
        "compile": [{"dtype": "bf16", "cold": {"first_call_s": 1.25}, "warm": None,
                     "null_reasons": {"warm": "failed: boom"}}],
        "wall_s": 7.0,
    }


def test_table_rows_ratios_and_reasons():
    lines = format_table(_report()).splitlines()
    assert lines[0] == "swiglu-cupy bench  2030-01-01T00:00:00+00:00  Test GPU  torch 9.9  cupy 99.0"
    assert "== tiny  D=8 H=12 M=4 bf16" in lines
    ours = next(line for line in lines if line.startswith(LABELS["swiglu_cupy"]))
    # fwd+bwd 3.0 ms over the 1.5 ms GEMMs: 2.00; 3 MiB fwd+bwd; no no-grad figure.
    assert ours.split()[-4:] == ["2.00", "3.0", "-", "2.5e-07"]
    assert "3.000 (2.700-3.300)" in ours
    assert any(line.startswith(LABELS["liger"]) and line.endswith("absent: skipped (--skip)") for line in lines)
    assert not any(line.startswith(LABELS["eager_hf"]) for line in lines)  # no result entry, no row
    assert "device copy (dst.copy_(src), 512 MiB): 200.0 GB/s" in lines
    assert ("  tiny bf16 M=4 [CuPy kernels]: fwd 0.010 ms 50.0 GB/s (25% of copy); "
            "bwd 0.020 ms 100.0 GB/s (50% of copy)") in lines
    width = len(LABELS[LOWER_BOUND])
    assert lines.index(f"  {'contender':<{width}}  {'grad':>20}  {'ratio':>6}  {'no_grad':>20}  {'ratio':>6}") > 0
    assert f"  {LABELS['swiglu_cupy']:<{width}}  {'25.0 (22.5-27.5)':>20}  {'2.00x':>6}  " \
           f"{'9.0 (8.1-9.9)':>20}  {'0.90x':>6}" in lines
    assert f"  {LABELS['liger']:<{width}}  - (skipped (--skip))" in lines
    assert "ratio ours / eager_hf, host overhead per call, grad: 2.00x (goal <= 1.25x)" in lines
    assert "ratio ours / eager_hf, host overhead per call, no_grad: 0.90x (goal <= 1.00x)" in lines
    assert "CPU path (M=2048, D=512, H=1408, 1 thread(s); median of 7 interleaved calls each):" in lines
    assert ("ratio ours / eager_hf, CPU path fwd+bwd bf16: 1.10x (goal <= 1.15x)  "
            "(median ms: ours 110.0, ours with saved_x12='fp8' 130.0, eager_hf 100.0)") in lines
    assert "kernel compile, first fwd+bwd in a new process (bf16): cold 1.25 s; warm - (failed: boom)" in lines
    assert lines[-1] == "total bench time: 7.0 s"


def test_table_without_copy_rate_or_elementwise_says_so():
    report = _report()
    report["copy"] = {"gbps": None, "error": "failed: x"}
    report["results"][0]["elementwise"] = {"error": "failed: no kernels"}
    text = format_table(report)
    assert "device copy" not in text and "% of copy" not in text
    assert "  tiny M=4: failed: no kernels" in text.splitlines()


def test_table_says_why_cpu_path_ratios_are_missing():
    report = _report()
    report["cpu_path"] = {"error": "not measured: the CPU-path ratios are measured by `bench --device cpu`"}
    assert ("CPU path ratios: not measured: the CPU-path ratios are measured by `bench --device cpu`"
            in format_table(report).splitlines())
