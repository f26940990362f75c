"""NVRTC compile matrix without a GPU: every kernel x dtype x GLU variant
compiles for every arch (sm_80, sm_90, sm_100: the whole matrix of
``python -m swiglu_cupy compile``; a third of it by default, the rest or the
whole by ``SWIGLU_COMPILE_MATRIX``, below), uses no spills, and the vector
kernels really issue 16-byte accesses (interleaved ones included; PTX of sm_90)."""
import os
import re
import subprocess
import sys

import nvrtc_modules
import pytest
import torch

from swiglu_cupy.kernels import compile_check
from swiglu_cupy.kernels.sources import (DEFAULT_ARCHS, DEFAULT_VARIANT, FP8_KERNEL_KINDS, FP8_LANE_PACKS,
                                         SUPPORTED_DTYPES, VARIANTS, kernel_name, kernel_names, max_threads_per_block,
                                         variant_of_kernel)
from swiglu_cupy.kernels.launch_config import DEFAULT_LAUNCH, LAUNCH_CANDIDATES, MAX_THREADS_PER_BLOCK, PACKS_PER_THREAD

ARCHS = ("sm_80", "sm_90", "sm_100")
PTX_ARCH = "sm_90"  # whose PTX is checked for 16-byte accesses
# "sm_90" (the default): every variant for sm_90 and SwiGLU's for every arch,
# 120 of the 336 modules (about 290 CPU seconds). "rest": the 216 others
# (about 430 CPU seconds; their PTX is not for sm_90, so the 128-bit access
# check has none to read): the floor run of .ci/run, beside the first run (the
# README's command), so that CI compiles every module once. "full": all 336,
# the CLI's whole matrix (about 720 CPU seconds).
MATRIX = os.environ.get("SWIGLU_COMPILE_MATRIX", "sm_90")
if MATRIX not in nvrtc_modules.MATRIX_SETTINGS:
    raise ValueError(f"SWIGLU_COMPILE_MATRIX must be one of {nvrtc_modules.MATRIX_SETTINGS}, got {MATRIX!r}")
WHOLE = [(v, d, a) for a in ARCHS for v in VARIANTS for d in SUPPORTED_DTYPES]
DEFAULT_THIRD = [(v, d, a) for v, d, a in WHOLE if a == PTX_ARCH or v == DEFAULT_VARIANT]
JOBS = {"full": WHOLE, "sm_90": DEFAULT_THIRD, "rest": [j for j in WHOLE if j not in DEFAULT_THIRD]}[MATRIX]


@pytest.fixture(scope="module")
def modules():
    """(variant, dtype, arch) -> (reports, ptx) of every job, one NVRTC
    compile each (minutes on 2 cores; the CLI compiles the same). The cubins
    stay in nvrtc_modules for test_machine_code.py, which reads them."""
    done = nvrtc_modules.compiled(JOBS, ptx_archs=(PTX_ARCH,))
    return {job: (reports, ptx) for job, (reports, _, ptx) in done.items()}


@pytest.fixture(scope="module")
def matrix(modules):
    return [r for reports, _ in modules.values() for r in reports]


def test_every_kernel_dtype_and_arch_compiles_without_spills(matrix):
    """Every launch candidate's kernel (all packs-per-thread instances) of
    every GLU variant for every dtype and arch; no 8-bit saved x12 kernel
    for float64, which refuses saved_x12="fp8"."""
    assert ARCHS == DEFAULT_ARCHS  # the CLI's default matrix
    seen = {(r.kernel, r.dtype, r.arch) for r in matrix}
    expected = {(k, d, a) for v, d, a in JOBS for k in kernel_names(v, d)}
    third = (len(VARIANTS) + len(ARCHS) - 1) * len(SUPPORTED_DTYPES)
    assert len(WHOLE) == len(ARCHS) * len(VARIANTS) * len(SUPPORTED_DTYPES) == 336
    assert len(JOBS) == {"full": len(WHOLE), "sm_90": third, "rest": len(WHOLE) - third}[MATRIX] > 0
    assert seen == expected
    assert len(kernel_names()) == (2 * 2 + 2 * 2) * len(PACKS_PER_THREAD)  # + the 8-bit saved x12, both widths
    assert len(kernel_names(DEFAULT_VARIANT, torch.float64)) == 2 * 2 * len(PACKS_PER_THREAD)
    fp8 = {kernel_name(kind, False, p, v) for kind in FP8_KERNEL_KINDS for p in PACKS_PER_THREAD for v in VARIANTS}
    assert {r.dtype for r in matrix if r.kernel in fp8} == {torch.float32, torch.bfloat16, torch.float16}
    for r in matrix:
        assert not r.spills and r.stack_bytes == 0, r
        # The largest block the launcher gives it must launch: registers x threads <= 64K.
        threads = max_threads_per_block(variant_of_kernel(r.kernel), int(r.kernel.rsplit("_p", 1)[1]))
        assert 0 < r.registers * threads <= 65536, r
        if r.kernel.startswith("swiglu_") and r.kernel.endswith("_p1"):
            if "_fp8_" in r.kernel:
                # Two packs a lane: the default launch's resident threads x packs per lane (16-byte
                # loads in flight) stay at least those of one pack at 64 registers.
                block = DEFAULT_LAUNCH.threads_per_block
                assert 65536 // (r.registers * block) * block * FP8_LANE_PACKS >= 65536 // 64, r
            else:
                assert r.registers <= 64, r       # SwiGLU's default launch keeps its occupancy


def test_launch_candidates_only_use_compiled_instances_and_block_sizes():
    assert DEFAULT_LAUNCH in LAUNCH_CANDIDATES
    for c in LAUNCH_CANDIDATES:
        assert c.packs_per_thread in PACKS_PER_THREAD
        assert c.threads_per_block <= MAX_THREADS_PER_BLOCK


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES)
def test_vector_kernels_use_128_bit_loads_and_stores(dtype, modules):
    if MATRIX == "rest":
        pytest.skip("SWIGLU_COMPILE_MATRIX=rest compiles no sm_90 module: the default setting reads their PTX")
    for variant in VARIANTS:
        _check_vector_accesses(modules[variant, dtype, PTX_ARCH][1], variant, dtype)


def _check_vector_accesses(ptx: str, variant, dtype):
    entries = re.split(r"\.entry\s+", ptx)[1:]
    bodies = {e.split("(", 1)[0].strip(): e for e in entries}
    assert set(bodies) == set(kernel_names(variant, dtype))
    for name, body in bodies.items():
        vector_access = re.search(r"(ld|st)\.global\.v(4|2)\.(u32|b32|f32|u64|b64|f64)", body)
        if "_fp8_" in name:
            # The 8-bit kernels: x12, h and dh move as 16-byte packs (an interleaved h
            # and dh as 8-byte ones, e.g. ld.global.v4.u16), the codes as 4-byte words;
            # no access of 1 or 2 bytes.
            narrow = re.search(r"(ld|st)\.global\.((u8|b8|s8|u16|b16|s16|f16)|v2\.(u8|b8|s8))\s", body)
            if "_vec_" in name:
                assert not narrow, name
                assert re.search(r"(ld|st)\.global\.v4\.(u32|b32|f32)", body), name
            else:
                assert not vector_access, name
        elif "_vec_" in name:
            # Each pack of a thread's tile is one 16-byte load per input (gate,
            # up, and dh in backward) and one 16-byte store per output (h; or
            # dgate, dup, h), with no access split into narrower ones. An
            # interleaved x12 is two 16-byte loads per pack (its gate/up
            # pairs), and so is its dx12 store.
            packs = int(name.rsplit("_p", 1)[1])
            inputs, outputs = (2, 1) if "forward" in name else (3, 3)
            assert len(re.findall(r"ld\.global\.v(4\.(u32|b32|f32)|2\.(u64|b64|f64))", body)) == packs * inputs, name
            assert len(re.findall(r"st\.global\.v(4\.(u32|b32|f32)|2\.(u64|b64|f64))", body)) == packs * outputs, name
            assert not re.search(r"(ld|st)\.global\.(v2\.(u16|b16|f16|u32|b32|f32)|u16|b16|u32|b32|f32|u64|f64)\s", body), name
        else:
            assert not vector_access, name


def test_the_cubin_is_whole_elf_that_cuobjdump_reads():
    """CuPy 14.2's getCUBIN drops the last byte NVRTC reports, which leaves
    an ELF that cuobjdump rejects ("does not contain device code"): the
    compile check returns all of it."""
    import tempfile

    from swiglu_cupy.kernels.cuda_headers import cuda_tool

    reports, cubin = compile_check.compile_module(torch.bfloat16, "sm_90")
    assert cubin[:4] == b"\x7fELF" and len(cubin) == compile_check.elf_declared_size(cubin)
    cuobjdump = cuda_tool("cuobjdump")
    if cuobjdump is None:
        pytest.skip("cuobjdump not installed (pip install nvidia-cuda-cuobjdump: the test extra has it)")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        listed = subprocess.run([str(cuobjdump), "-res-usage", f.name], capture_output=True, text=True, check=True)
        short = cubin[:-1]  # what getCUBIN alone gives
        f.seek(0)
        f.truncate()
        f.write(short)
        f.flush()
        rejected = subprocess.run([str(cuobjdump), "-res-usage", f.name], capture_output=True, text=True)
    assert {r.kernel for r in reports} <= set(re.findall(r"Function (\w+):", listed.stdout))
    assert "Function" not in rejected.stdout  # the one-byte-short image: no device code read


def test_parse_ptxas_log():
    log = """ptxas info    : Compiling entry function 'k_a' for 'sm_90'
ptxas info    : Function properties for k_a
ptxas         .     16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 40 registers, used 0 barriers
ptxas info    : Compiling entry function 'k_b' for 'sm_90'
ptxas info    : Function properties for k_b
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 12 registers, used 0 barriers"""
    assert compile_check.parse_ptxas_log(log) == {"k_a": (40, 16, 8, 4), "k_b": (12, 0, 0, 0)}


def test_compile_error_reports_the_log():
    with pytest.raises(compile_check.CompileError, match="sm_12345"):
        compile_check.compile_module(torch.float32, "sm_12345")


def test_cli_compile_prints_table_and_time():
    proc = subprocess.run([sys.executable, "-m", "swiglu_cupy", "compile", "--arch", "sm_80", "--kind", "identity"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "glu_backward_identity_clamp_pairs_vec_p4" in proc.stdout and "bfloat16" in proc.stdout
    count = 4 * sum(len(kernel_names(DEFAULT_VARIANT, d)) for d in SUPPORTED_DTYPES)  # 4 variants: clamp x layout
    assert re.search(rf"compiled {count} kernels \(4 GLU variants\) for sm_80 in [\d.]+ s", proc.stdout)
    assert "spills: 0" in proc.stdout


def test_cli_compile_fails_cleanly_on_bad_arch():
    proc = subprocess.run([sys.executable, "-m", "swiglu_cupy", "compile", "--arch", "sm_1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert "error:" in proc.stderr and "Traceback" not in proc.stderr
