"""Locating CUDA headers shipped in pip wheels (no system toolkit needed)."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path


def _nvidia_roots() -> list[Path]:
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return []
    return [Path(p) for p in spec.submodule_search_locations]


def cuda_include_dirs() -> list[Path]:
    """Include dirs holding cuda_fp16.h, from the nvidia-* wheels (CUDA 13
    layout ``nvidia/cu13/include``, CUDA 12 layout ``nvidia/<pkg>/include``),
    then $CUDA_PATH / $CUDA_HOME as a fallback."""
    found: list[Path] = []
    for root in _nvidia_roots():
        for include in sorted(root.glob("*/include")):
            if include not in found and ((include / "cuda_fp16.h").is_file()
                                         or (include / "crt").is_dir()
                                         or (include / "nv").is_dir()):
                found.append(include)
    for var in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(var):
            include = Path(os.environ[var]) / "include"
            if (include / "cuda_fp16.h").is_file() and include not in found:
                found.append(include)
    return found


def missing_header_hint(header: str) -> str:
    return (f"{header} was not found in any pip-installed nvidia wheel; "
            "install nvidia-cuda-runtime (headers), nvidia-cuda-crt and nvidia-cuda-cccl, "
            "e.g. pip install 'swiglu-cupy[cuda13,test]'")


def cuda_tool(name: str) -> Path | None:
    """A CUDA binary utility (``cuobjdump``, ``nvdisasm``) from the nvidia-*
    wheels (``nvidia/cu13/bin``; ``nvidia-cuda-cuobjdump``,
    ``nvidia-cuda-nvdisasm``), else None: the machine-code checks need no
    system toolkit either."""
    for root in _nvidia_roots():
        for candidate in sorted(root.glob(f"*/bin/{name}")):
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return candidate
    return None
