"""The compile probe: null with a reason on the CPU, and its process imports
this very swiglu_cupy (the probe itself only runs on a GPU)."""
import os
import subprocess
import sys
from pathlib import Path

import torch

import swiglu_cupy
from swiglu_cupy.tools.bench.compile_probe import bench_compile, probe_env
from swiglu_cupy.tools.bench.measure import Clock


def test_compile_is_null_with_a_reason_on_cpu():
    out = bench_compile(Clock(torch.device("cpu")), "bf16")
    assert out["cold"] is None and out["warm"] is None
    for key in ("cold", "warm"):
        assert "needs CUDA" in out["null_reasons"][key]


def test_probe_process_imports_this_package(tmp_path):
    env = probe_env({k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert env["SWIGLU_CUPY_STRICT"] == "1"
    proc = subprocess.run([sys.executable, "-c", "import swiglu_cupy; print(swiglu_cupy.__file__)"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()).resolve() == Path(swiglu_cupy.__file__).resolve()
