"""Kernel cold-compile and warm-start time: the first SwiGLU fwd+bwd in fresh processes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from .config import DTYPES
from .measure import NEEDS_CUDA, Clock, short_error

_COMPILE_PROBE = r"""
import json, sys, time
start = time.perf_counter()
import torch
import swiglu_cupy as sc
import_s = time.perf_counter() - start
dtype = getattr(torch, sys.argv[1])
dev = torch.device("cuda")
# Initialize CUDA, cuBLAS and autograd first so the timing below is the kernels' own.
lin = torch.nn.Linear(64, 128, bias=False, device=dev, dtype=dtype)
xx = torch.randn(8, 64, device=dev, dtype=dtype, requires_grad=True)
lin(xx).backward(torch.ones(8, 128, device=dev, dtype=dtype))
torch.cuda.synchronize()
m = sc.SwiGLU(64, 64, bias=False, device=dev, dtype=dtype)
x = torch.randn(8, 64, device=dev, dtype=dtype, requires_grad=True)
dy = torch.ones(8, 64, device=dev, dtype=dtype)
def call():
    t = time.perf_counter()
    m(x).backward(dy)
    torch.cuda.synchronize()
    return time.perf_counter() - t
first = call()
second = call()
from swiglu_cupy.kernels.launch import cupy_launcher
print("PROBE " + json.dumps({"import_s": import_s, "first_call_s": first, "second_call_s": second,
                             "modules_compiled_or_loaded": cupy_launcher().compile_count}))
"""


def probe_env(env: dict) -> dict:
    """``env`` for a probe process: this very swiglu_cupy first on PYTHONPATH, strict mode."""
    pkg_parent = str(Path(__file__).resolve().parents[3])  # the directory holding swiglu_cupy/ (swiglu_cupy/tools/bench/this file)
    env = dict(env)
    env["PYTHONPATH"] = pkg_parent + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["SWIGLU_CUPY_STRICT"] = "1"
    return env


def _run_probe(dtype: torch.dtype, env: dict) -> dict:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _COMPILE_PROBE, str(dtype).replace("torch.", "")],
                          env=probe_env(env), capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - start
    for line in proc.stdout.splitlines():
        if line.startswith("PROBE "):
            result = json.loads(line[len("PROBE "):])
            result["process_wall_s"] = wall
            return result
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    raise RuntimeError(f"probe exited {proc.returncode}: {' | '.join(tail)}")


def bench_compile(clock: Clock, dtype_name: str) -> dict:
    """First SwiGLU fwd+bwd in a fresh process: with an empty CuPy cache (cold
    compile) and again with the cache that run populated (warm start)."""
    out = {"dtype": dtype_name, "cold": None, "warm": None, "null_reasons": {}}
    if not clock.cuda:
        out["null_reasons"] = {"cold": NEEDS_CUDA + ": the kernels compile for CUDA tensors only",
                               "warm": NEEDS_CUDA + ": the kernels compile for CUDA tensors only"}
        return out
    with tempfile.TemporaryDirectory(prefix="swiglu-cupy-cache-") as cache:
        env = dict(os.environ)
        env["CUPY_CACHE_DIR"] = cache
        env["CUPY_CACHE_IN_MEMORY"] = "0"
        cold_env = dict(env, CUDA_CACHE_DISABLE="1")  # no driver JIT cache either
        for key, e in (("cold", cold_env), ("warm", env)):
            try:
                out[key] = _run_probe(DTYPES[dtype_name], e)
            except Exception as exc:
                out["null_reasons"][key] = f"failed: {short_error(exc)}"
    return out
