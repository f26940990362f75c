"""``python -m swiglu_cupy info`` (and ``swiglu_cupy.info()``): explains which
path the op takes here and why, and lists each kernel module loaded in this
process with its first-use self-check result."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from .._version import __version__
from ..kernels.cuda_headers import cuda_include_dirs
from ..kernels.launch import INSTALL_HINT, CudaUnavailableError, import_cupy, strict_mode
from ..kernels.sources import kernel_dir
from ..primitives import first_use_check


def _cupy_cache_dir() -> Path:
    default = Path.home() / ".cupy" / "kernel_cache"
    return Path(os.environ.get("CUPY_CACHE_DIR", default))


def collect(check_default_modules: bool = False) -> dict:
    """The facts; ``check_default_modules`` (the CLI) first self-checks
    SwiGLU's fp16/bf16/fp32 modules on cuda:0 when the kernels can run, so a
    fresh process has results to list."""
    info: dict = {
        "swiglu_cupy": __version__,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available() else [],
        "kernel_sources": str(kernel_dir()),
        "cuda_header_dirs": [str(d) for d in cuda_include_dirs()],
        "strict": strict_mode(),
    }
    try:  # the same check that decides between kernels and fallback at run time
        cupy = import_cupy()
        from cupy_backends.cuda.libs import nvrtc

        info["cupy"] = cupy.__version__
        info["nvrtc"] = ".".join(map(str, nvrtc.getVersion()))
    except CudaUnavailableError as exc:
        info["cupy"] = None
        info["cupy_error"] = str(exc.__cause__ or exc)
    cache = _cupy_cache_dir()
    probe = cache if cache.exists() else cache.parent
    info["cupy_cache_dir"] = str(cache)
    info["cupy_cache_writable"] = probe.exists() and os.access(probe, os.W_OK)
    if not info["cuda_available"]:
        info["cuda_path"] = "no CUDA device: CPU tensors use the torch implementation (fp32 math)"
    elif info["cupy"] is not None:
        info["cuda_path"] = "CUDA tensors run the CuPy kernels"
    elif info["strict"]:
        info["cuda_path"] = f"CUDA tensors will raise (SWIGLU_CUPY_STRICT is set). Fix: {INSTALL_HINT}"
    else:
        info["cuda_path"] = f"CUDA tensors fall back to the torch implementation. Fix: {INSTALL_HINT}"
    if check_default_modules and info["cuda_available"] and info["cupy"] is not None:
        first_use_check.warmup("cuda:0")
    info["self_check"] = "on" if first_use_check.enabled() else f"off ({first_use_check.ENV}=0)"
    info["self_checks"] = first_use_check.format_results() or ["no kernel module loaded in this process yet"]
    return info


def info() -> dict:
    """``python -m swiglu_cupy info``'s facts for this process, as a dict
    (``self_checks``: one line per kernel module used so far)."""
    return collect()


def format_info(info: dict) -> str:
    width = max(map(len, info))
    lines = []
    for key, value in info.items():
        if key == "self_checks":
            lines += [f"{key:<{width}}  {line}" if i == 0 else f"{'':<{width}}  {line}" for i, line in enumerate(value)]
        else:
            lines.append(f"{key:<{width}}  {value}")
    return "\n".join(lines)
