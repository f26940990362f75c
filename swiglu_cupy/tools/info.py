"""``python -m swiglu_cupy info``: explains which path the op takes here and why."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from .._version import __version__
from ..kernels.cuda_headers import cuda_include_dirs
from ..kernels.launch import INSTALL_HINT, CudaUnavailableError, import_cupy, strict_mode
from ..kernels.sources import kernel_dir


def _cupy_cache_dir() -> Path:
    default = Path.home() / ".cupy" / "kernel_cache"
    return Path(os.environ.get("CUPY_CACHE_DIR", default))


def collect() -> dict:
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
    return info


def format_info(info: dict) -> str:
    width = max(map(len, info))
    return "\n".join(f"{key:<{width}}  {value}" for key, value in info.items())
