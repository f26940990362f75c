"""Compile the kernel module of every GLU variant for every dtype with NVRTC
for explicit GPU architectures, without a GPU or driver, and report
registers and spills (one program per (variant, dtype, arch): exactly the
text and options the runtime loader compiles).

CuPy's own compile helper asks the driver for the device, so this calls
NVRTC through CuPy's low-level binding with an explicit ``--gpu-architecture``
and the same expanded source and options the runtime loader uses.
"""
from __future__ import annotations

import ctypes
import os
import re
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .cuda_headers import cuda_include_dirs, missing_header_hint
from .sources import (DEFAULT_ARCHS, DEFAULT_VARIANT, SUPPORTED_DTYPES, VARIANTS, KernelVariant, compile_options,
                       module_source)


_ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(\w+)'")
_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")


@dataclass(frozen=True)
class KernelReport:
    dtype: torch.dtype
    arch: str
    kernel: str
    registers: int
    stack_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int
    seconds: float  # compile time of the whole module for this (variant, dtype, arch)

    @property
    def spills(self) -> bool:
        return self.spill_store_bytes > 0 or self.spill_load_bytes > 0


class CompileError(RuntimeError):
    pass


def _nvrtc():
    try:
        from cupy_backends.cuda.libs import nvrtc
    except Exception as exc:
        raise CompileError(f"NVRTC is not available through CuPy ({exc}); "
                           "pip install 'swiglu-cupy[cuda13]'") from exc
    return nvrtc


# ELF64 header fields that locate the program and section header tables.
_ELF_TABLES = struct.Struct("<32xQQ6xHHHH")  # e_phoff, e_shoff, e_phentsize, e_phnum, e_shentsize, e_shnum


def elf_declared_size(image: bytes) -> int:
    """The bytes an ELF64 image must hold to contain the header tables it declares."""
    phoff, shoff, phentsize, phnum, shentsize, shnum = _ELF_TABLES.unpack_from(image, 0)
    return max(phoff + phentsize * phnum, shoff + shentsize * shnum)


def _nvrtc_library():
    """NVRTC's shared library as CuPy loaded it (dlopen by soname finds the loaded copy)."""
    for name in ("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so", "nvrtc64_130_0.dll", "nvrtc64_120_0.dll"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def _whole_cubin(nvrtc, prog) -> bytes:
    """The cubin of a compiled program, all of it. CuPy 14.2's ``getCUBIN``
    returns one byte less than ``nvrtcGetCUBINSize`` reports (the last byte of
    the ELF program-header table), which cuobjdump and nvdisasm reject as
    invalid ELF; so the size and bytes come from NVRTC itself."""
    lib = _nvrtc_library()
    if lib is not None:
        size = ctypes.c_size_t()
        if lib.nvrtcGetCUBINSize(ctypes.c_void_p(prog), ctypes.byref(size)) == 0:
            buffer = ctypes.create_string_buffer(size.value)
            if lib.nvrtcGetCUBIN(ctypes.c_void_p(prog), buffer) == 0:
                return buffer.raw
    cubin = nvrtc.getCUBIN(prog)  # no handle on the library: complete the tables CuPy cut short
    return cubin + bytes(max(0, elf_declared_size(cubin) - len(cubin)))


def parse_ptxas_log(log: str) -> dict[str, tuple[int, int, int, int]]:
    """kernel -> (registers, stack, spill stores, spill loads) from -Xptxas=-v output."""
    result: dict[str, tuple[int, int, int, int]] = {}
    current = None
    stack = stores = loads = 0
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            current, stack, stores, loads = m.group(1), 0, 0, 0
        elif (m := _SPILLS.search(line)) and current:
            stack, stores, loads = (int(v) for v in m.groups())
        elif (m := _REGS.search(line)) and current:
            result[current] = (int(m.group(1)), stack, stores, loads)
            current = None
    return result


def compile_module(dtype: torch.dtype, arch: str, variant: KernelVariant = DEFAULT_VARIANT
                   ) -> tuple[list[KernelReport], bytes]:
    """Compile one variant's kernel module for one dtype and arch, exactly as
    the runtime loader would; returns the per-kernel report and the cubin."""
    reports, cubin, _ = compile_module_with_ptx(dtype, arch, variant)
    return reports, cubin


def compile_module_with_ptx(dtype: torch.dtype, arch: str, variant: KernelVariant = DEFAULT_VARIANT
                            ) -> tuple[list[KernelReport], bytes, str]:
    """``compile_module`` plus the PTX NVRTC generated on the way (one compile)."""
    options = [*compile_options(dtype), f"--gpu-architecture={arch}", "-Xptxas=-v"]
    parsed, cubin, ptx, seconds = _compile(module_source(variant), options, f"[{dtype}, {arch}, {variant}]")
    reports = [KernelReport(dtype, arch, name, *stats, seconds)
               for name, stats in sorted(parsed.items())]
    return reports, cubin, ptx


def compile_source(source: str, arch: str, options=()) -> tuple[list[KernelReport], bytes]:
    """Any CUDA source through the same NVRTC path, options and include dirs
    as the kernel modules (the machine-code checks' planted kernels use it);
    the reports' dtype is None."""
    parsed, cubin, _, seconds = _compile(source, [*options, f"--gpu-architecture={arch}", "-Xptxas=-v"],
                                         f"[{arch}, source]")
    return [KernelReport(None, arch, name, *stats, seconds) for name, stats in sorted(parsed.items())], cubin


def _compile(source: str, options: list[str], label: str) -> tuple[dict, bytes, str, float]:
    """(ptxas report per kernel, cubin, PTX, seconds) of one NVRTC program."""
    nvrtc = _nvrtc()
    includes = cuda_include_dirs()
    if not any((d / "cuda_fp16.h").is_file() for d in includes):
        raise CompileError(missing_header_hint("cuda_fp16.h"))
    options = [*options, *(f"-I{d}" for d in includes)]
    start = time.perf_counter()
    prog = nvrtc.createProgram(source, "swiglu_cupy.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, options)
        except Exception as exc:
            raise CompileError(f"kernels {label} failed: {exc}\n"
                               f"{nvrtc.getProgramLog(prog)}") from exc
        log = nvrtc.getProgramLog(prog)
        cubin = _whole_cubin(nvrtc, prog)
        ptx = nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)
    seconds = time.perf_counter() - start
    parsed = parse_ptxas_log(log)
    if not parsed:
        raise CompileError(f"kernels {label}: no ptxas report in the log:\n{log}")
    return parsed, cubin, ptx.decode() if isinstance(ptx, bytes) else ptx, seconds


def compile_jobs(jobs) -> list[tuple[list[KernelReport], bytes]]:
    """(reports, cubin) of every (dtype, arch, variant) job, compiled
    concurrently (NVRTC runs outside the GIL), in the jobs' order."""
    jobs = list(jobs)
    with ThreadPoolExecutor(max_workers=max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
        return list(pool.map(lambda job: compile_module(*job), jobs))


def compile_matrix(archs=DEFAULT_ARCHS, dtypes=SUPPORTED_DTYPES, variants=VARIANTS) -> list[KernelReport]:
    """Every (arch, dtype, variant) module, compiled concurrently (NVRTC runs
    outside the GIL), reported in a fixed order."""
    jobs = [(dtype, arch, variant) for arch in archs for dtype in dtypes for variant in variants]
    return [r for reports, _ in compile_jobs(jobs) for r in reports]


def format_table(reports: list[KernelReport]) -> str:
    header = f"{'arch':<7} {'dtype':<9} {'kernel':<44} {'regs':>4} {'stack':>5} {'spill st':>8} {'spill ld':>8}"
    lines = [header, "-" * len(header)]
    for r in reports:
        dtype = str(r.dtype).replace("torch.", "")
        lines.append(f"{r.arch:<7} {dtype:<9} {r.kernel:<44} {r.registers:>4} {r.stack_bytes:>5} "
                     f"{r.spill_store_bytes:>8} {r.spill_load_bytes:>8}")
    return "\n".join(lines)
