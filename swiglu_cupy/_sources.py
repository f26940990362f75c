"""Kernel sources: where the ``.cu`` files live, how they are expanded, and
the compile options. Shared by the CuPy loader, the NVRTC compile check and
the host-execution harness, so all three build exactly the same text.

Local ``#include "..."`` lines are inlined here because CuPy's disk cache is
keyed on the source string and options only: an edited header must change the
source, or a stale binary would be served after an upgrade.
"""
from __future__ import annotations

import functools
import re
from pathlib import Path

import torch

from ._version import __version__

# The wheel carries the sources inside the package; an editable install or a
# plain checkout finds them at the repository's top level.
_PACKAGE_DIR = Path(__file__).resolve().parent
_CANDIDATE_DIRS = (_PACKAGE_DIR / "kernels_cu", _PACKAGE_DIR.parent / "kernels_cu")

KERNEL_FILES = ("swiglu_forward.cu", "swiglu_backward.cu")

CTYPE_OF_DTYPE = {
    torch.float16: "__half",
    torch.bfloat16: "__nv_bfloat16",
    torch.float32: "float",
    torch.float64: "double",
}
SUPPORTED_DTYPES = tuple(CTYPE_OF_DTYPE)

_LOCAL_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"[ \t]*$', re.MULTILINE)
_PRAGMA_ONCE = re.compile(r"^[ \t]*#[ \t]*pragma[ \t]+once[ \t]*$", re.MULTILINE)
_KERNEL_DECL = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(\w+)\s*\(')


def kernel_dir() -> Path:
    for candidate in _CANDIDATE_DIRS:
        if (candidate / KERNEL_FILES[0]).is_file():
            return candidate
    searched = ", ".join(str(c) for c in _CANDIDATE_DIRS)
    raise FileNotFoundError(f"swiglu-cupy kernel sources not found; searched {searched}")


def _expand(path: Path, seen: set[Path]) -> str:
    text = path.read_text()
    seen.add(path.resolve())

    def inline(match: re.Match) -> str:
        target = (path.parent / match.group(1)).resolve()
        if target in seen:  # every local header uses #pragma once
            return f"// (already inlined: {match.group(1)})"
        body = _PRAGMA_ONCE.sub("", _expand(target, seen))
        return f"// ---- begin {match.group(1)} ----\n{body}\n// ---- end {match.group(1)} ----"

    return _LOCAL_INCLUDE.sub(inline, text)


@functools.lru_cache(maxsize=None)
def module_source() -> str:
    """The self-contained source of the kernel module: every kernel file, with
    local headers inlined once (files are read from disk once per process).
    One module per (device, dtype) is compiled from it."""
    seen: set = set()
    parts = [f"// swiglu-cupy {__version__}"]
    for filename in KERNEL_FILES:
        parts.append(f"// ==== {filename} ====\n{_expand(kernel_dir() / filename, seen)}")
    return "\n".join(parts)


@functools.lru_cache(maxsize=None)
def kernel_names() -> tuple[str, ...]:
    """Every kernel entry point in the module."""
    return tuple(_KERNEL_DECL.findall(module_source()))


def compile_options(dtype: torch.dtype) -> tuple[str, ...]:
    """NVRTC options for one storage dtype (the arch is added by the caller)."""
    return ("--std=c++17", f"-DSWIGLU_SCALAR={CTYPE_OF_DTYPE[dtype]}")


def vector_width(dtype: torch.dtype) -> int:
    """Elements per 16-byte access, as SWIGLU_VEC_WIDTH in the kernels."""
    return 16 // torch.empty((), dtype=dtype).element_size()
