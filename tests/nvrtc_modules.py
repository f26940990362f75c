"""NVRTC compiles of the kernel modules, shared by the tests of one pytest
session (test_compile_check.py compiles the matrix; test_machine_code.py
reads the same cubins instead of compiling them again).

``SWIGLU_COMPILE_MATRIX`` picks the matrix: "sm_90" (the default of
test_compile_check) is every variant for sm_90 and SwiGLU's for every arch;
"rest" the other modules (the floor run of .ci/run); "full" every variant x
dtype x arch (test_machine_code reads the whole matrix only then).
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

from swiglu_cupy.kernels import compile_check

_lock = threading.Lock()
_done: dict = {}   # (variant, dtype, arch) -> (reports, cubin, ptx or None)


MATRIX_SETTINGS = ("sm_90", "rest", "full")


def matrix_setting() -> str | None:
    """SWIGLU_COMPILE_MATRIX as set (None when unset)."""
    value = os.environ.get("SWIGLU_COMPILE_MATRIX")
    if value is not None and value not in MATRIX_SETTINGS:
        raise ValueError(f"SWIGLU_COMPILE_MATRIX must be one of {MATRIX_SETTINGS}, got {value!r}")
    return value


def compiled(jobs, ptx_archs=()) -> dict:
    """(variant, dtype, arch) -> (reports, cubin, ptx) for every job, compiling
    those not compiled yet in this session (concurrently: NVRTC runs outside
    the GIL). The PTX is kept only for ``ptx_archs`` (None otherwise)."""
    jobs = list(jobs)
    with _lock:
        missing = [j for j in jobs if j not in _done or (j[2] in ptx_archs and _done[j][2] is None)]
        if missing:
            with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
                results = pool.map(lambda job: compile_check.compile_module_with_ptx(job[1], job[2], job[0]),
                                   missing)
                for job, (reports, cubin, ptx) in zip(missing, results):
                    _done[job] = (reports, cubin, ptx if job[2] in ptx_archs else None)
        return {j: _done[j] for j in jobs}
