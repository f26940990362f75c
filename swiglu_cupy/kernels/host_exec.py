"""Host execution of the CUDA kernel sources.

The expanded ``kernels_cu`` source is built as host C++ by g++, one shared
library per dtype holding every GLU variant's entry points (the kernel files
as NVRTC compiles them, then each variant's entries exactly as in its own
module: one build instead of 28 amortizes the CUDA headers' parse), with a
small compatibility header that turns the grid into loops. ``HostLauncher`` implements the launcher interface, so the Python code
that picks vector widths, grids and arguments is the same as on a GPU.

The kernels have no intra-block cooperation (no shared memory, no barriers),
so running each thread to completion one after another is faithful.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from .launch_config import is_probing
from .cuda_headers import cuda_include_dirs, missing_header_hint
from .sources import (VARIANTS, compile_options, kernel_files_source, kernel_names, variant_entries,
                        variant_of_kernel)

_COMPAT_HEADER = r"""
// Host-side stand-ins for the CUDA execution model (forced include).
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <utility>
#undef __global__
#define __global__
#undef __device__
#define __device__
#undef __forceinline__
#define __forceinline__ inline
#undef __launch_bounds__
#define __launch_bounds__(...)
#undef __noinline__
#define __noinline__ __attribute__((noinline))
static thread_local uint3 threadIdx, blockIdx;
static thread_local dim3 blockDim, gridDim;
"""

_LAUNCHER_TEMPLATE = r"""
template <typename... A, std::size_t... I>
static void swiglu_host_call(void (*kernel)(A...), void** params, std::index_sequence<I...>) {
    kernel(*static_cast<A*>(params[I])...);
}
template <typename... A>
static void swiglu_host_launch(void (*kernel)(A...), const unsigned* g, const unsigned* b, void** params) {
    gridDim = dim3(g[0], g[1], g[2]);
    blockDim = dim3(b[0], b[1], b[2]);
    for (unsigned bz = 0; bz < g[2]; ++bz)
    for (unsigned by = 0; by < g[1]; ++by)
    for (unsigned bx = 0; bx < g[0]; ++bx)
    for (unsigned tz = 0; tz < b[2]; ++tz)
    for (unsigned ty = 0; ty < b[1]; ++ty)
    for (unsigned tx = 0; tx < b[0]; ++tx) {
        blockIdx.x = bx; blockIdx.y = by; blockIdx.z = bz;
        threadIdx.x = tx; threadIdx.y = ty; threadIdx.z = tz;
        swiglu_host_call(kernel, params, std::index_sequence_for<A...>{});
    }
}
"""

_WRAPPER_TEMPLATE = (
    'extern "C" void host_launch_{name}(const unsigned* g, const unsigned* b, void** p) '
    "{{ swiglu_host_launch({name}, g, b, p); }}\n"
)


# Optimization of the host build: -O1 builds every variant's kernels several
# times faster than -O2 and runs the test-sized launches about as fast; IEEE
# results do not depend on it (no fast-math, no FMA contraction on x86-64).
HOST_OPT_LEVEL = "-O1"


def compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise RuntimeError("host execution needs a C++ compiler (g++); set $CXX")
    return cxx


def _cache_dir() -> Path:
    root = Path(os.environ.get("SWIGLU_CUPY_HOST_CACHE", Path(tempfile.gettempdir()) / "swiglu_cupy_host"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def host_source(dtype: torch.dtype) -> str:
    entries = "\n".join(variant_entries(v) for v in VARIANTS)
    wrappers = "".join(_WRAPPER_TEMPLATE.format(name=n) for v in VARIANTS for n in kernel_names(v, dtype))
    return f"{kernel_files_source()}\n{entries}\n{_LAUNCHER_TEMPLATE}\n{wrappers}"


def build_library(dtype: torch.dtype) -> Path:
    """Compile every variant's kernels for one dtype into a shared library
    (cached by the hash of everything that goes into it)."""
    includes = cuda_include_dirs()
    if not any((d / "cuda_fp16.h").is_file() for d in includes):
        raise RuntimeError(missing_header_hint("cuda_fp16.h"))
    source = host_source(dtype)
    defines = [o for o in compile_options(dtype) if o.startswith("-D")]
    flags = ["-x", "c++", "-std=c++17", HOST_OPT_LEVEL, "-fPIC", "-shared", "-w",
             *defines, *(f"-I{d}" for d in includes)]
    digest = hashlib.sha256("\0".join([_COMPAT_HEADER, source, compiler(), *flags]).encode()).hexdigest()[:20]
    out = _cache_dir() / f"swiglu_kernels_{digest}.so"
    if out.is_file():
        return out
    work = Path(tempfile.mkdtemp(prefix="swiglu_host_", dir=_cache_dir()))
    (work / "compat.h").write_text(_COMPAT_HEADER)
    (work / "kernel.cpp").write_text(source)
    tmp_out = work / out.name
    cmd = [compiler(), *flags, "-include", str(work / "compat.h"), str(work / "kernel.cpp"), "-o", str(tmp_out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"host build of the kernels ({dtype}) failed:\n{' '.join(cmd)}\n{proc.stderr}")
    os.replace(tmp_out, out)  # atomic: concurrent builders never see half a file
    shutil.rmtree(work, ignore_errors=True)
    return out


class HostLauncher:
    """Launcher that runs kernels on the CPU, on torch CPU tensors."""

    def __init__(self) -> None:
        self._libs: dict[torch.dtype, ctypes.CDLL] = {}
        self._lock = threading.Lock()
        self.launches: list[tuple[str, tuple, tuple]] = []  # (name, grid, block), for tests
        self.probe_launches: list[tuple[str, tuple, tuple]] = []  # the same, of self-check probes

    def _library(self, dtype: torch.dtype) -> ctypes.CDLL:
        lib = self._libs.get(dtype)
        if lib is None:
            path = build_library(dtype)  # outside the lock: builds may run in parallel
            with self._lock:
                lib = self._libs.setdefault(dtype, ctypes.CDLL(str(path)))
        return lib

    def warm(self, dtypes: Sequence[torch.dtype]) -> None:
        """Build the libraries of ``dtypes`` now, one g++ per core."""
        with ThreadPoolExecutor(max_workers=max(1, min(len(dtypes), os.cpu_count() or 1))) as pool:
            list(pool.map(self._library, dtypes))

    def launch(self, name, dtype, device, grid, block, args):
        if torch.device(device).type != "cpu":
            raise ValueError(f"HostLauncher runs CPU tensors only, got device {device}")
        variant_of_kernel(name)  # a clear ValueError for an unknown name
        lib = self._library(dtype)
        # Each argument lives in its own C object; params holds their addresses,
        # exactly like cuLaunchKernel's kernelParams.
        holders = []
        for a in args:
            if isinstance(a, np.uint64):
                holders.append(ctypes.c_uint64(int(a)))
            elif isinstance(a, np.int64):
                holders.append(ctypes.c_int64(int(a)))
            elif isinstance(a, np.float32):
                holders.append(ctypes.c_float(float(a)))
            elif isinstance(a, np.float64):
                holders.append(ctypes.c_double(float(a)))
            else:
                raise TypeError(f"kernel arguments must be numpy-typed scalars, got {type(a).__name__}")
        params = (ctypes.c_void_p * len(holders))(*[ctypes.addressof(h) for h in holders])
        g = (ctypes.c_uint * 3)(*grid)
        b = (ctypes.c_uint * 3)(*block)
        (self.probe_launches if is_probing() else self.launches).append((name, tuple(grid), tuple(block)))
        getattr(lib, f"host_launch_{name}")(g, b, params)
