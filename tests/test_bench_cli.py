"""`python -m swiglu_cupy bench` and `selftest` on the CPU, run as subprocesses,
and the resolution of bench arguments into shapes and settings.

Timing values are never checked beyond being positive and finite."""
import argparse
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from swiglu_cupy.tools.bench import CONTENDERS, LOWER_BOUND, Settings, Shape, add_arguments, resolve

ENV_KEYS = ("date", "device", "python", "torch", "torch_cuda", "cupy", "cuda_runtime", "driver",
            "gpu_name", "swiglu_cupy")


def _cli(*args, timeout=240, pythonpath=None):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # the CPU path, even on a GPU machine
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.run([sys.executable, "-m", "swiglu_cupy", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    # --quick: the CPU-path ratios at a small M (the full M=2048 bf16 cases take ~5 minutes on CPUs
    # without bf16 instructions). The limit is a hang guard, not a speed check.
    proc = _cli("bench", "--device", "cpu", "--quick", "--out", str(out), timeout=900)
    return proc, out


def _positive_stats(s, what):
    assert s["n"] >= 1, what
    for key in ("median", "p10", "p90", "min", "max", "mean"):
        assert math.isfinite(s[key]) and s[key] > 0, f"{what}.{key} = {s[key]}"
    assert s["min"] <= s["p10"] <= s["median"] <= s["p90"] <= s["max"], what


def test_cpu_bench_exits_0_and_prints_table(cpu_run):
    proc, _ = cpu_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "== smoke  D=64 H=176 M=32 fp32" in proc.stdout
    for label in ("GEMMs only (lower bound)", "eager, 3x Linear (HF)", "swiglu-cupy SwiGLU"):
        assert label in proc.stdout
    assert "[1/" in proc.stderr  # progress lines


def test_cpu_bench_json(cpu_run):
    proc, out = cpu_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "bench.json").read_text())
    env = report["environment"]
    for key in ENV_KEYS:
        assert key in env, key
    assert env["device"] == "cpu" and env["torch"] == torch.__version__
    assert len(report["results"]) == 1
    res = report["results"][0]
    assert res["shape"] == {"name": "smoke", "D": 64, "H": 176, "M": 32, "dtype": "fp32"}
    assert set(res["contenders"]) == {LOWER_BOUND, *CONTENDERS}
    for name, entry in res["contenders"].items():
        if not entry["available"]:
            assert isinstance(entry["reason"], str) and entry["reason"], name
            assert not entry["reason"].startswith("failed"), (name, entry["reason"])
            continue
        for key in ("fwd_ms", "bwd_ms", "fwd_bwd_ms"):
            _positive_stats(entry[key], f"{name}.{key}")
        # CUDA-only measurements are null, each with its reason.
        for key in ("peak_mem_fwd_bwd_bytes", "peak_mem_nograd_fwd_bytes"):
            assert entry[key] is None and entry["null_reasons"][key], (name, key)
    # Everything but Liger (Triton: CUDA only) runs on CPU.
    for name in (LOWER_BOUND, "eager_hf", "eager_packed", "swiglu_cupy"):
        assert res["contenders"][name]["available"], (name, res["contenders"][name].get("reason"))
    for name in ("eager_packed", "swiglu_cupy"):
        assert res["contenders"][name]["rel_err_vs_eager_hf"] < 1e-5
    assert not res["contenders"]["liger"]["available"]  # never on CPU

    el = res["elementwise"]
    assert el["fwd_gbps"] > 0 and el["bwd_gbps"] > 0
    assert el["fwd_bytes"] == 32 * 3 * 176 * 4 and el["bwd_bytes"] == 32 * 6 * 176 * 4
    assert report["copy"]["gbps"] > 0
    overhead = report["host_overhead"][0]
    assert overhead["shape"] == {"D": 64, "H": 64, "M": 1, "dtype": "fp32"}
    assert (overhead["calls"], overhead["rounds"], overhead["reference"]) == (300, 3, "eager_hf")  # --quick
    for mode in ("grad", "no_grad"):
        timings, ratios = overhead["us_per_call"][mode], overhead["ratio_vs_reference"][mode]
        assert set(timings) == {LOWER_BOUND, *CONTENDERS}
        for name, us in timings.items():
            if us is None:
                assert overhead["null_reasons"][name], (mode, name)
                continue
            _positive_stats(us, f"{mode}.{name}")
            assert us["n"] == 3
            assert ratios[name] == pytest.approx(us["median"] / timings["eager_hf"]["median"])
        assert ratios["eager_hf"] == 1.0 and ratios["swiglu_cupy"] > 0
    cpu_path = report["cpu_path"]
    assert cpu_path["shape"] == {"D": 512, "H": 1408, "M": 256} and cpu_path["threads"] == 1
    assert cpu_path["rounds"] == 3
    assert [(c["what"], c["dtype"]) for c in cpu_path["cases"]] == [
        ("fwd_bwd", "fp32"), ("nograd_fwd", "fp32"), ("fwd_bwd", "bf16"), ("nograd_fwd", "bf16")]
    for case in cpu_path["cases"]:
        fp8 = {"swiglu_cupy_fp8"} if case["what"] == "fwd_bwd" else set()  # saved_x12="fp8": with a graph only
        assert set(case["ms"]) == {"eager_hf", "swiglu_cupy"} | fp8 and case["goal"] is not None
        if fp8:
            _positive_stats(case["ms"]["swiglu_cupy_fp8"], "fp8")
            assert case["fp8_ratio"] == pytest.approx(
                case["ms"]["swiglu_cupy_fp8"]["median"] / case["ms"]["eager_hf"]["median"])
        _positive_stats(case["ms"]["swiglu_cupy"], case["what"])
        assert case["ratio"] == pytest.approx(case["ms"]["swiglu_cupy"]["median"] / case["ms"]["eager_hf"]["median"])
    comp = report["compile"][0]
    assert comp["cold"] is None and comp["warm"] is None
    assert "CUDA" in comp["null_reasons"]["cold"]


def test_cpu_bench_png_and_text(cpu_run):
    proc, out = cpu_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    pytest.importorskip("matplotlib")
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = (out / "bench.txt").read_text()
    assert "GEMMs only" in text
    for mode in ("grad", "no_grad"):
        assert f"ratio ours / eager_hf, host overhead per call, {mode}: " in text
    for what in ("fwd+bwd fp32", "no-grad fwd fp32", "fwd+bwd bf16", "no-grad fwd bf16"):
        assert f"ratio ours / eager_hf, CPU path {what}: " in text


def test_custom_shape_and_sweep_without_matplotlib(tmp_path):
    """A --dim/--hidden x --tokens x --dtype sweep; with matplotlib unimportable
    the run still succeeds, says why there is no PNG, and writes the JSON."""
    fake = tmp_path / "fake"
    (fake / "matplotlib").mkdir(parents=True)
    (fake / "matplotlib" / "__init__.py").write_text("raise ImportError('matplotlib blocked by the test')\n")
    out = tmp_path / "out"
    proc = _cli("bench", "--device", "cpu", "--dim", "32", "--hidden", "40", "--tokens", "3", "5",
                "--dtype", "fp32", "fp16", "--repeats", "2", "--warmup", "0",
                "--skip", "torch_compile", "eager_packed", "--out", str(out), pythonpath=fake)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "no plot: matplotlib is not importable" in proc.stderr
    assert not (out / "bench.png").exists()
    report = json.loads((out / "bench.json").read_text())
    assert report["plot"] is None and "matplotlib" in report["plot_missing_reason"]
    shapes = [(r["shape"]["D"], r["shape"]["H"], r["shape"]["M"], r["shape"]["dtype"]) for r in report["results"]]
    assert shapes == [(32, 40, 3, "fp32"), (32, 40, 5, "fp32"), (32, 40, 3, "fp16"), (32, 40, 5, "fp16")]
    # --dtype also picks the CPU-path ratios' dtypes: fp32 only here (bf16 is not named).
    assert [(c["what"], c["dtype"]) for c in report["cpu_path"]["cases"]] == [("fwd_bwd", "fp32"), ("nograd_fwd", "fp32")]
    for res in report["results"]:
        assert res["contenders"]["torch_compile"]["reason"] == "skipped (--skip)"
        assert res["contenders"]["swiglu_cupy"]["available"]
        assert res["contenders"]["swiglu_cupy"]["fwd_ms"]["n"] == 2


@pytest.mark.parametrize("args, message", [
    (["--dtype", "fp8"], "invalid choice: 'fp8'"),
    (["--preset", "llama9000"], "invalid choice: 'llama9000'"),
    (["--tokens", "0"], "expected a positive integer"),
    (["--dim", "64"], "--dim and --hidden go together"),
])
def test_bench_argument_errors(tmp_path, args, message):
    proc = _cli("bench", "--device", "cpu", "--out", str(tmp_path), *args)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert not (tmp_path / "bench.json").exists()


def test_bench_cuda_without_cuda(tmp_path):
    proc = _cli("bench", "--device", "cuda", "--out", str(tmp_path))
    assert proc.returncode == 2
    assert "no CUDA device" in proc.stderr


def _resolve(*argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return resolve(parser.parse_args(argv))


def test_resolve_cpu_defaults_to_the_smoke_configuration():
    shapes, settings = _resolve("--device", "cpu")
    assert shapes == [Shape("smoke", 64, 176, 32, "fp32")]
    assert settings == Settings(device="cpu", quick=False, warmup=1, repeats=3, overhead_calls=300, copy_mib=32,
                                ratio_rounds=7)


def test_resolve_cpu_quick_shrinks_only_the_cpu_path_ratios():
    shapes, settings = _resolve("--device", "cpu", "--quick")
    assert shapes == [Shape("smoke", 64, 176, 32, "fp32")]
    assert settings == Settings(device="cpu", quick=True, warmup=1, repeats=3, overhead_calls=300, copy_mib=32,
                                ratio_rounds=3, cpu_path_tokens=256)


def test_resolve_sweeps_dtype_then_shape_then_tokens_and_overrides_counts():
    shapes, settings = _resolve("--device", "cpu", "--preset", "llama7b", "--dim", "8", "--hidden", "24",
                                "--tokens", "2", "4", "--dtype", "bf16", "fp16", "--repeats", "7", "--warmup", "0")
    assert [(s.name, s.D, s.H, s.M, s.dtype) for s in shapes] == [
        ("llama7b", 4096, 11008, 2, "bf16"), ("llama7b", 4096, 11008, 4, "bf16"),
        ("custom", 8, 24, 2, "bf16"), ("custom", 8, 24, 4, "bf16"),
        ("llama7b", 4096, 11008, 2, "fp16"), ("llama7b", 4096, 11008, 4, "fp16"),
        ("custom", 8, 24, 2, "fp16"), ("custom", 8, 24, 4, "fp16")]
    assert (settings.repeats, settings.warmup) == (7, 0)


def test_resolve_explicit_shape_on_cpu_keeps_the_smoke_token_count():
    shapes, _ = _resolve("--device", "cpu", "--dim", "8", "--hidden", "24")
    assert shapes == [Shape("custom", 8, 24, 32, "fp32")]


def test_resolve_rejects_a_half_custom_shape():
    with pytest.raises(ValueError, match="--dim and --hidden go together"):
        _resolve("--device", "cpu", "--hidden", "24")


def test_cpu_bench_long_context(tmp_path):
    """`bench --long-context` at a small custom shape: every contender's exact
    peak and largest allocation per length, the times, the ratios with their
    goals, DeepSpeed's TiledMLP measured (the `test` extra installs it), the plot."""
    from swiglu_cupy.tools.bench.long_context import CONTENDERS as LONG_CONTENDERS, GOALS

    proc = _cli("bench", "--long-context", "--device", "cpu", "--dim", "32", "--hidden", "48", "--tokens", "256",
                "1024", "--tile-rows", "128", "--repeats", "2", "--out", str(tmp_path), timeout=600)
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "long_context.json").read_text())
    result = report["result"]
    assert result["shape"] == {"D": 32, "H": 48, "dtype": "float32", "tile_rows": 128}
    assert not result["skipped"], result["skipped"]
    assert [e["tokens"] for e in result["memory"]] == [256, 1024]
    for entry in result["memory"]:
        for name in LONG_CONTENDERS:
            m = entry[name]
            assert 0 < m["largest_bytes"] <= m["peak_bytes"]
            assert m["rel_err_y"] < 1e-6 and m["rel_err_dx"] < 1e-6, (name, m)
        # recompute_gate_up's peak: (4H + 2D) x 4 bytes per token, plus at this small H the CPU path's
        # silu temporary of one row block (all rows here: at most H per token); the tiles' workspace is a tile's
        formula = entry["tokens"] * (4 * 48 + 2 * 32) * 4
        assert formula <= entry["recompute_gate_up"]["peak_bytes"] <= formula + entry["tokens"] * 48 * 4
        assert entry["tiled"]["largest_bytes"] <= 128 * 2 * 48 * 4 or entry["tokens"] <= 128
    for label, tokens in (("longest", 1024), ("one_tile", 128)):
        t = result["time"][label]
        assert t["tokens"] == tokens
        for stats in t["ms"].values():
            _positive_stats(stats, label)
    assert set(result["ratios"]) >= set(GOALS) and all(v > 0 for v in result["ratios"].values())
    assert (tmp_path / "long_context.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = (tmp_path / "long_context.txt").read_text()
    assert "peak_vs_recompute" in text and "goal <= 0.35" in text and "deepspeed_tiled_mlp" in text
