"""Machine-code checks (issue 42), without a GPU: the SASS of the NVRTC
cubins, read with cuobjdump (``swiglu_cupy/kernels/sass.py``), walked on the
default launch (``sass_walk.py``) and held to issue 42's goals
(``machine_code.py``). Per kernel:

1. no local memory (no LDL/STL, no ptxas stack frame or spill);
2. access widths: 16 bytes per lane in every access of a ``_vec_``
   instance, none in the instances that take any alignment, and no 1- or
   2-byte access per lane in the 8-bit kernels' hot loop (coalesced);
3. no CALL in the hot loop;
4. the model's issue/memory ratio under the kernel class's goal
   (``machine_code.goal_for``) on the default launch;
5. on sm_100, paired fp32 math (FADD2/FMUL2/FFMA2) in the hot loop of
   every kernel whose activation is written over pairs
   (``machine_code.pairs_expected``).

The kernels that fail a check today are listed, with the figure measured,
in ``machine_code_known_failures.tsv`` beside this file: their tests are
``xfail(strict=True)``, so a kernel fixed there XPASSes, which fails until its
line is deleted. Nothing else may fail.

Which modules: a small set by default (SwiGLU bf16 and fp32 for sm_90 and
sm_100, the other SiLU variants bf16 for sm_90, the clamped ones fp32 for
sm_100), the whole matrix when
``SWIGLU_COMPILE_MATRIX=full`` is set (minutes: ~390 CPU seconds of NVRTC,
shared with test_compile_check.py in the same session). Planted kernels
(a small .cu compiled through the same NVRTC path) show each check can fail.
"""
from __future__ import annotations

import csv
import io
from pathlib import Path

import numpy as np
import nvrtc_modules
import pytest
import torch

from swiglu_cupy.kernels import compile_check, sass, sass_walk, sources
from swiglu_cupy.tools import machine_code as mc
from swiglu_cupy.kernels.cuda_headers import cuda_tool
from swiglu_cupy.kernels.sources import (DEFAULT_ARCHS, DEFAULT_VARIANT, SUPPORTED_DTYPES, VARIANTS, KernelVariant,
                                         kernel_names, variant_of_kernel)

HAVE_CUOBJDUMP = cuda_tool("cuobjdump") is not None
needs_cuobjdump = pytest.mark.skipif(not HAVE_CUOBJDUMP, reason="cuobjdump not installed "
                                     "(pip install nvidia-cuda-cuobjdump: the test extra has it)")

FULL = nvrtc_modules.matrix_setting() == "full"
SILU_VARIANTS = tuple(v for v in VARIANTS if v.kind == "silu")
# The clamped SiLUs' fp32 on sm_100 too: there NVVM once split their 16-byte gate loads.
SUBSET = ([(DEFAULT_VARIANT, d, a) for a in ("sm_90", "sm_100") for d in (torch.bfloat16, torch.float32)]
          + [(v, torch.bfloat16, "sm_90") for v in SILU_VARIANTS if v != DEFAULT_VARIANT]
          + [(v, torch.float32, "sm_100") for v in SILU_VARIANTS if v.clamp])
JOBS = ([(v, d, a) for a in DEFAULT_ARCHS for v in VARIANTS for d in SUPPORTED_DTYPES] if FULL else SUBSET)


def variant_label(variant: KernelVariant) -> str:
    return "swiglu" if variant == DEFAULT_VARIANT else variant.tag


def dtype_label(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# ---- the kernels that fail today, in one place ----------------------------------------------

KNOWN_FAILURES_FILE = Path(__file__).with_name("machine_code_known_failures.tsv")
CHECKS = ("local", "widths", "call", "ratio", "paired")


def nvrtc_version() -> str:
    """The NVRTC compiling the modules, as "major.minor" ("" without NVRTC)."""
    try:
        return "%d.%d" % compile_check._nvrtc().getVersion()
    except Exception:
        return ""


def load_known_failures(text: str, nvrtc: str) -> dict:
    """(check, variant, dtype, arch, kernel) -> the figure measured when listed.
    A line with a seventh field holds only under that NVRTC ("13.0"): the
    machine code, and so the figure, depends on the compiler's release."""
    rows = csv.reader((line for line in io.StringIO(text) if line.strip() and not line.startswith("#")),
                      delimiter="\t")
    known = {}
    for row in rows:
        check, variant, dtype, arch, kernel, figure, *release = row
        assert check in CHECKS and len(release) <= 1, row
        if not release or release[0] == nvrtc:
            known[check, variant, dtype, arch, kernel] = figure + (f" (NVRTC {release[0]})" if release else "")
    return known


NVRTC = nvrtc_version()
KNOWN = load_known_failures(KNOWN_FAILURES_FILE.read_text(), NVRTC)


def cases(check: str, select=lambda variant, dtype, arch, kernel: True):
    out = []
    for variant, dtype, arch in JOBS:
        for kernel in kernel_names(variant, dtype):
            if not select(variant, dtype, arch, kernel):
                continue
            key = (check, variant_label(variant), dtype_label(dtype), arch, kernel)
            marks = [needs_cuobjdump]
            if key in KNOWN:
                marks.append(pytest.mark.xfail(strict=True, reason=f"fails today: {KNOWN[key]}"))
            out.append(pytest.param((variant, dtype, arch), kernel, marks=marks,
                                    id=f"{key[1]}-{key[2]}-{arch}-{kernel}"))
    return out


def has_goal(variant, dtype, arch, kernel) -> bool:
    goal = mc.goal_for(variant, dtype, kernel)
    return goal is not None and any(mc.PART_BY_NAME[p].arch == arch for p in goal.parts)


def walked(variant, dtype, arch, kernel) -> bool:
    """The walk is what the ratio check reads: the default-launch kernels."""
    return kernel.endswith("_p1")


# ---- the real modules, read once per session --------------------------------------------------

_codes: dict = {}


def module_codes(job) -> dict[str, mc.KernelCode]:
    """kernel -> KernelCode of one module (every job compiled at the first
    call, in parallel, once per session and shared with test_compile_check;
    each module disassembled and walked once)."""
    if job not in _codes:
        variant, dtype, arch = job
        reports, cubin, _ = nvrtc_modules.compiled(JOBS)[job]
        codes = mc.analyze_module(variant, dtype, arch, cubin, reports,
                                  walk_kernels=lambda name: walked(variant, dtype, arch, name))
        _codes[job] = {c.kernel: c for c in codes}
    return _codes[job]


@pytest.mark.parametrize("job, kernel", cases("local"))
def test_no_local_memory(job, kernel):
    code = module_codes(job)[kernel]
    assert not mc.local_memory_problems(code), mc.local_memory_problems(code)


@pytest.mark.parametrize("job, kernel", cases("widths"))
def test_access_widths(job, kernel):
    code = module_codes(job)[kernel]
    instance = mc.instance_of(kernel, job[0])
    problems = mc.access_width_problems(code, instance.vectorized, instance.fp8)
    assert not problems, problems


@pytest.mark.parametrize("job, kernel", cases("call"))
def test_no_call_in_the_hot_loop(job, kernel):
    code = module_codes(job)[kernel]
    assert not mc.hot_loop_call_problems(code), mc.hot_loop_call_problems(code)


@pytest.mark.parametrize("job, kernel", cases("ratio", has_goal))
def test_issue_memory_ratio_meets_the_goal(job, kernel):
    variant, dtype, arch = job
    code = module_codes(job)[kernel]
    problems = mc.ratio_problems(code, mc.goal_for(variant, dtype, kernel))
    assert not problems, problems


@pytest.mark.parametrize("job, kernel", cases("paired", lambda v, d, a, k: mc.pairs_expected(v, d, a)))
def test_paired_fp32_math_on_sm100(job, kernel):
    code = module_codes(job)[kernel]
    assert not mc.paired_math_problems(code), mc.paired_math_problems(code)


def test_paired_math_stays_scalar_where_the_arch_has_none():
    """sm_90's code of the same kernels is the FloatPair operators' scalar
    twins: no paired instruction in any kernel."""
    codes = module_codes((DEFAULT_VARIANT, torch.bfloat16, "sm_90"))
    assert codes and all(c.hot_loop_paired == 0 for c in codes.values())


@needs_cuobjdump
@pytest.mark.parametrize("job", [j for j in JOBS if j[1] != torch.float64],
                         ids=lambda j: f"{variant_label(j[0])}-{dtype_label(j[1])}-{j[2]}")
def test_fp32_math_flushes_denormals_as_built_at_run_time(job):
    """The cubins read here are built as CuPy builds them at run time, with
    ``-ftz=true``: every fp32 add, multiply, FMA and compare of every kernel
    carries .FTZ. (float64 modules compute in double, which -ftz leaves
    alone; their division's range test is an fp32 compare on a double's
    high word, unflushed by design.)"""
    problems = {k: mc.denormal_flush_problems(c) for k, c in module_codes(job).items()}
    assert problems and not any(problems.values()), {k: p for k, p in problems.items() if p}


def test_every_known_failure_names_a_real_kernel():
    """The list may only name kernels that exist (a renamed kernel must not
    leave a stale line that silently never runs)."""
    for check, variant, dtype, arch, kernel in KNOWN:
        assert arch in DEFAULT_ARCHS and dtype in {dtype_label(d) for d in SUPPORTED_DTYPES}
        owner = variant_of_kernel(kernel)
        assert variant_label(owner) == variant, (variant, kernel)
        assert kernel in kernel_names(owner, getattr(torch, dtype)), kernel


@needs_cuobjdump
@pytest.mark.parametrize("job", [j for j in JOBS if j[1] != torch.float64])
def test_the_walk_is_faithful(job):
    """The walk of each default-launch kernel (not the 8-bit ones) touches
    exactly the bytes the model charges it, once each (so it went through
    one tile, in bounds, and stored every output), entered each loop of the
    hot nest once, and met no integer instruction it cannot evaluate."""
    variant, dtype, arch = job
    for kernel, code in module_codes(job).items():
        if not walked(variant, dtype, arch, kernel) or mc.instance_of(kernel, variant).fp8:
            continue
        assert code.walk_error is None, (kernel, code.walk_error)
        assert not code.unmodelled, (kernel, code.unmodelled)
        assert code.walked_bytes_per_element == code.bytes_per_element, kernel
        assert code.policy_branches >= 0
        if mc.instance_of(kernel, variant).vectorized:
            # Halves: every warp access is 512 contiguous bytes. Interleaved:
            # each lane reads (and writes) 32 contiguous bytes as two 16-byte
            # accesses, which use half of the sectors each.
            assert code.sector_efficiency == (0.6 if variant.interleaved else 1.0), (kernel, code.sector_efficiency)


@needs_cuobjdump
def test_the_8bit_walk_covers_a_lanes_columns():
    """A lane of the 8-bit kernels holds FP8_LANE_PACKS (2) 16-byte packs'
    columns of its block (16 in bf16). In the 16-byte instances the walked
    lane touches the model's bytes per element (its codes, h and dh, and the
    block's scales), once, in 16-byte accesses and 4-byte code words,
    nothing narrower."""
    variant, dtype, arch = SUBSET[0]
    assert sources.FP8_LANE_PACKS == 2
    for kernel, code in module_codes(SUBSET[0]).items():
        instance = mc.instance_of(kernel, variant)
        if kernel.endswith("_p1") and instance.fp8:
            assert code.walk_error is None, code.walk_error
            assert mc.elements_per_thread(instance, dtype, variant) == 16, kernel  # per tile
            assert code.elements % 16 == 0, kernel                                  # whole tiles walked
            if instance.vectorized:
                # lane 5 writes no scale (lane 0 does); each lane reads its block's scales (a cached 4 B each)
                assert code.bytes_per_element - 1 / 16 <= code.walked_bytes_per_element <= code.bytes_per_element + 1
                assert {mc._width_of(n) for n in code.hot_loop_accesses} <= {4, 16}, (kernel, code.hot_loop_accesses)


@needs_cuobjdump
def test_disassembly_finds_the_wheels_nvdisasm(monkeypatch, tmp_path):
    """``cuobjdump -sass`` runs nvdisasm from PATH: with a PATH that holds
    none (a fresh venv with no system toolkit, as in CI), the wheel's is used."""
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("NVDISASM_PATH", raising=False)
    _, cubin = compile_check.compile_source(PLANTED, "sm_90")
    assert "planted_clean" in sass.disassemble(cubin)


def test_missing_nvdisasm_is_named(monkeypatch):
    """Without nvdisasm the error says what to install, not cuobjdump's own message."""
    real = sass.cuda_tool
    monkeypatch.setattr(sass, "cuda_tool", lambda name: None if name == "nvdisasm" else real(name))
    if real("cuobjdump") is None:
        pytest.skip("cuobjdump not installed")
    with pytest.raises(sass.SassError, match="pip install nvidia-cuda-nvdisasm"):
        sass.disassemble(b"not a cubin")


@needs_cuobjdump
def test_cli_compile_report(capsys, monkeypatch):
    """``compile --report`` prints the predicted table with its header."""
    from swiglu_cupy import subcommands as cli

    # Serve the session's compiles (the CLI would compile the same modules again).
    monkeypatch.setattr(compile_check, "compile_jobs",
                        lambda jobs: [nvrtc_modules.compiled([(v, d, a)])[(v, d, a)][:2] for d, a, v in jobs])
    assert cli.main(["compile", "--report", "--arch", "sm_90", "--kind", "silu", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "Predicted from the machine code" in out and "not measured" in out
    assert "swiglu_forward_vec_p1" in out and "glu_backward_fp8_silu_clamp_pairs_scalar_p4" in out
    assert "instr/el" in out and "H100" in out and "B200" in out
    assert "96 kernels:" in out
    assert "The default launch by the model" in out and "<- DEFAULT_LAUNCH" in out


@needs_cuobjdump
def test_the_default_launch_is_the_models_choice():
    """``DEFAULT_LAUNCH`` is the launch the issue/memory model ranks first for
    SwiGLU's 16-byte kernels on the session's modules (candidates: each
    packs-per-thread instance, uncapped or capped at 1 or 4 waves), and on it
    a thread's prologue is shared by its tiles: fewer instructions than one
    tile per thread."""
    from swiglu_cupy.kernels.launch_config import DEFAULT_LAUNCH, LaunchConfig

    compiled = nvrtc_modules.compiled(JOBS)
    modules = {(d, a): compiled[(v, d, a)][:2] for v, d, a in JOBS if v == DEFAULT_VARIANT and d != torch.float64}
    scores = mc.score_launches(modules)
    assert scores[0].config == DEFAULT_LAUNCH, mc.format_launch_scores(scores)
    one_tile = next(s for s in scores if s.config == LaunchConfig(1, DEFAULT_LAUNCH.threads_per_block, None))
    assert scores[0].instructions < 0.8 * one_tile.instructions and scores[0].worst < one_tile.worst


def test_a_capped_launch_counts_every_tile_of_the_walked_thread():
    """The walked thread's elements: one tile uncapped; on a grid capped at
    one wave of the host's stand-in SM count, the tiles of its grid-stride
    loops over rows and columns."""
    from swiglu_cupy.kernels.launch_config import LaunchConfig

    one = mc.launch_for("swiglu_forward_vec_p1", torch.bfloat16, DEFAULT_VARIANT, LaunchConfig(1, 256, None))
    capped = mc.launch_for("swiglu_forward_vec_p1", torch.bfloat16, DEFAULT_VARIANT, LaunchConfig(1, 256, 1))
    assert one.elements_per_thread == 8 and capped.grid == (8, 1, 1) and capped.block == (128, 2, 1)
    # rows 1, 3, 5, 7 of 8; columns 40 + k * 8 * 128 * 8 of 65536: 4 x 8 tiles of 8 elements
    assert capped.elements_per_thread == 4 * 8 * 8
    # rows 1, 7, 13, 19 of 20; columns 64 and 192 of 300 (stride 2 x 32 x 2 packs)
    assert mc.tiles_of_thread((2, 3, 1), (32, 2, 1), (0, 1, 0), (1, 0, 0), 20, 300, 1, 2) == 4 * 2


# ---- parsing, on fixed text ----------------------------------------------------------------------

SASS_TEXT = """
	code for sm_90
	.target	sm_90

		Function : k_demo
	.headerflags	@"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                              /* 0x00000a00ff017b82 */
                                                                                       /* 0x000fe20000000800 */
        /*0010*/                   S2R R2, SR_TID.X ;                                  /* 0x0000000000027919 */
                                                                                       /* 0x000e2e0000002100 */
        /*0020*/                   ISETP.GE.U32.AND P0, PT, R2, c[0x0][0x210], PT ;    /* 0x0000840002007a0c */
                                                                                       /* 0x000fda0003f06070 */
        /*0030*/               @P0 EXIT ;                                              /* 0x000000000000094d */
                                                                                       /* 0x000fea0003800000 */
        /*0040*/                   IMAD.MOV.U32 R3, RZ, RZ, RZ ;                       /* 0x000000ffff037224 */
                                                                                       /* 0x000fe200078e00ff */
        /*0050*/                   LDG.E.128 R4, desc[UR4][R8.64+-0x10] ;              /* 0x0000000408047981 */
                                                                                       /* 0x000ea8000c1e1d00 */
        /*0060*/                   ISETP.GT.U32.AND P1, PT, R4, 0x1ffffff, PT ;        /* 0x01ffffff0400780c */
                                                                                       /* 0x000fda0003f24070 */
        /*0070*/               @P1 BRA 0xa0 ;                                          /* 0x0000000000081947 */
                                                                                       /* 0x000fea0003800000 */
        /*0080*/                   MOV R12, 0xa0 ;                                     /* 0x000000a0000c7802 */
                                                                                       /* 0x000fce0000000f00 */
        /*0090*/                   CALL.REL.NOINC 0x100 ;                              /* 0x0000000000187944 */
                                                                                       /* 0x000fea0003c00000 */
        /*00a0*/                   STG.E.U8 desc[UR4][R8.64], R4 ;                     /* 0x0000000408007986 */
                                                                                       /* 0x000fe2000c101104 */
        /*00b0*/                   IADD3 R3, R3, 0x1, RZ ;                             /* 0x0000000103037810 */
                                                                                       /* 0x000fc80007ffe0ff */
        /*00c0*/                   ISETP.NE.AND P2, PT, R3, 0x3, PT ;                  /* 0x000000030300780c */
                                                                                       /* 0x000fda0003f45270 */
        /*00d0*/               @P2 BRA 0x50 ;                                          /* 0x0000000000d82947 */
                                                                                       /* 0x000fea000383ffff */
        /*00e0*/                   STL [R1+0x4], R3 ;                                  /* 0x0000040301007387 */
                                                                                       /* 0x000fe20000100800 */
        /*00f0*/                   EXIT ;                                              /* 0x000000000000794d */
                                                                                       /* 0x000fea0003800000 */
        /*0100*/                   MUFU.RCP R5, R4 ;                                   /* 0x0000000400057308 */
                                                                                       /* 0x000e220000001000 */
        /*0110*/                   RET.REL.NODEC R12 0x0 ;                             /* 0xffffffec0c007950 */
                                                                                       /* 0x001fea0003c3ffff */
		..........
"""


def test_parse_instructions():
    fns = sass.parse_sass(SASS_TEXT)
    fn = fns["k_demo"]
    assert fn.arch == "sm_90" and len(fn.instructions) == 18
    ldg = fn.at(0x50)
    assert (ldg.opcode, ldg.modifiers, ldg.operands) == ("LDG", ("E", "128"), ("R4", "desc[UR4][R8.64+-0x10]"))
    assert ldg.access_width == 16 and ldg.is_global_access and not ldg.is_global_store
    assert ldg.decoded[1] == ("m", 8, True, None, -0x10)
    exit_ = fn.at(0x30)
    assert exit_.predicate == "P0" and exit_.guard == ("p", 0, False) and exit_.opcode == "EXIT"
    isetp = fn.at(0x20)
    assert isetp.modifiers == ("GE", "U32", "AND")
    assert isetp.decoded[3] == ("c", 0, None, 0x210, False, False, False)
    assert isetp.decoded[1] == ("p", sass.PT, False)
    assert fn.at(0x60).decoded[3] == ("i", 0x1FFFFFF)
    assert fn.at(0x70).target == 0xA0 and fn.at(0xD0).target == 0x50 and fn.at(0xD0).is_backward_branch
    assert fn.at(0x90).is_call and fn.at(0x90).target == 0x100
    assert fn.at(0x110).operands == ("R12", "0x0")
    assert fn.at(0xA0).access_width == 1 and fn.at(0xA0).is_global_store
    assert sass.decode_operand("-R14") == ("r", 14, True, False, False, ())
    assert sass.decode_operand("|R31|.reuse") == ("r", 31, False, False, True, ())
    assert sass.decode_operand("-0x81") == ("i", 0xFFFFFF7F)
    assert sass.decode_operand("1.4426950216293334961") == ("f", 1.4426950216293334961)
    assert sass.decode_operand("c[0x0][RZ]") == ("c", 0, ("r", sass.RZ), 0, False, False, False)
    assert sass.decode_operand("!UP0") == ("up", 0, True)
    assert sass.decode_operand("SR_CTAID.Y") == ("s", "SR_CTAID.Y")
    assert sass.decode_operand("[R1+0x8]") == ("m", 1, False, None, 8)


def test_structure_of_parsed_function():
    fn = sass.parse_sass(SASS_TEXT)["k_demo"]
    assert fn.loops == [sass.Loop(0x50, 0xD0)]
    assert fn.hot_loops == [sass.Loop(0x50, 0xD0)]
    assert [i.address for i in fn.calls] == [0x90] and [i.address for i in fn.hot_loop_calls] == [0x90]
    assert fn.subroutine_entries == {0x100} and 0x100 not in fn.main_body and 0x100 in fn.subroutines
    assert [i.address for i in fn.local_accesses] == [0xE0]
    assert sorted(i.name for i in fn.hot_loop_accesses) == ["LDG.E.128", "STG.E.U8"]


def test_sm80_loop_exit_call_is_a_jump_not_a_call():
    """sm_80 code leaves a loop with ``@P CALL.REL.NOINC <after the loop>``:
    no RET follows it, so it is not a subroutine CALL."""
    text = "\n".join(f"        /*{a:04x}*/ {t} ;" for a, t in [
        (0x00, "S2R R2, SR_TID.X"), (0x10, "STG.E [R4.64], R2"), (0x20, "IADD3 R2, R2, 0x1, RZ"),
        (0x30, "ISETP.GE.AND P0, PT, R2, 0x4, PT"), (0x40, "@P0 CALL.REL.NOINC 0x60"), (0x50, "BRA 0x10"),
        (0x60, "EXIT")])
    fn = sass.parse_sass("\t.target sm_80\n\t\tFunction : k\n" + text)["k"]
    assert fn.loops == [sass.Loop(0x10, 0x50)] and not fn.calls and not fn.hot_loop_calls
    assert 0x60 in fn.main_body
    trace = sass_walk.walk(fn, {"k": fn}, {}, sass_walk.Thread((32, 1, 1), (1, 1, 1), (1, 0, 0), (0, 0, 0)))
    assert trace.counts[0x10] == 3 and trace.counts[0x60] == 1 and trace.calls == 0


def _sm80_shuffle_loop(fallback_jumps_back: bool) -> sass.SassFunction:
    """A loop whose shuffle has ptxas's sm_80 divergence path: ``BRA.DIV`` to
    code after EXIT that CALLs a WARPSYNC + SHFL subroutine and jumps back
    into the loop (or, with ``fallback_jumps_back`` False, the same CALL
    planted in the loop itself)."""
    loop = [(0x00, "S2R R2, SR_TID.X"), (0x10, "BRA.DIV ~URZ, 0x80"), (0x20, "SHFL.BFLY PT, R3, R2, 0x1, 0x1f"),
            (0x30, "STG.E [R4.64], R3"), (0x40, "IADD3 R2, R2, 0x1, RZ"), (0x50, "ISETP.GE.AND P0, PT, R2, 0x4, PT"),
            (0x60, "@!P0 BRA 0x10"), (0x70, "EXIT")]
    fallback = [(0x80, "MOV R4, 0xa0"), (0x90, "CALL.REL.NOINC 0xc0"), (0xa0, "BRA 0x30"), (0xb0, "BRA 0xb0"),
                (0xc0, "WARPSYNC R10"), (0xd0, "SHFL.BFLY PT, R8, R3, R8, R9"), (0xe0, "RET.REL.NODEC R4 0x0")]
    if not fallback_jumps_back:
        loop[2] = (0x20, "CALL.REL.NOINC 0xc0")
    text = "\n".join(f"        /*{a:04x}*/ {t} ;" for a, t in loop + fallback)
    return sass.parse_sass("\t.target sm_80\n\t\tFunction : k\n" + text)["k"]


def test_divergence_path_call_is_not_in_the_hot_loop():
    """sm_80: a warp not converged at a shuffle leaves through ``BRA.DIV``
    for a CALLed WARPSYNC + SHFL and jumps back; a converged warp never
    runs that path, and its jump back is no loop. The same CALL inside the
    loop still counts."""
    fn = _sm80_shuffle_loop(fallback_jumps_back=True)
    assert 0x90 in fn.main_body and 0x90 not in fn.converged_body
    assert fn.loops == [sass.Loop(0x10, 0x60)] and fn.hot_loops == [sass.Loop(0x10, 0x60)]
    assert [i.address for i in fn.calls] == [0x90] and not fn.hot_loop_calls
    planted = _sm80_shuffle_loop(fallback_jumps_back=False)
    assert [i.address for i in planted.hot_loop_calls] == [0x20]


ELF_TEXT = """
.nv.info.k_demo
	<0x1>
	Attribute:	EIATTR_KPARAM_INFO
	Format:	EIFMT_SVAL
	Value:	Index : 0x0	Ordinal : 0x1	Offset  : 0x8	Size    : 0x8
		Pointee's logAlignment : 0x0	Space : 0x0	cbank : 0x1f	Parameter Space : CBANK
	<0x2>
	Attribute:	EIATTR_KPARAM_INFO
	Format:	EIFMT_SVAL
	Value:	Index : 0x0	Ordinal : 0x0	Offset  : 0x0	Size    : 0x4
		Pointee's logAlignment : 0x0	Space : 0x0	cbank : 0x1f	Parameter Space : CBANK
	<0x3>
	Attribute:	EIATTR_PARAM_CBANK
	Format:	EIFMT_SVAL
	Value:	0x46 0x100210

.nv.info.other
"""


def test_parse_param_layout():
    layout = sass.parse_param_layouts(ELF_TEXT)["k_demo"]
    assert (layout.base, layout.size, layout.params) == (0x210, 0x10, ((0x0, 4), (0x8, 8)))
    assert mc.pack_params((np.int32(7), np.uint64(9)), layout) == (b"\x07\0\0\0" + bytes(4) + b"\x09" + bytes(7))
    with pytest.raises(mc.ModelError):
        mc.pack_params((np.uint64(1), np.uint64(9)), layout)


# ---- the walk, on fixed text ---------------------------------------------------------------------

def test_walk_runs_loops_by_their_counter_and_takes_the_fast_path():
    """k_demo: thread 2 < n passes the bounds test, runs the loop 3 times
    (its counter is evaluated), takes the data-dependent branch past the
    CALL every time (the policy), and counts predicated instructions."""
    fn = sass.parse_sass(SASS_TEXT)["k_demo"]
    thread = sass_walk.Thread((32, 1, 1), (1, 1, 1), (2, 0, 0), (0, 0, 0))
    bank = sass_walk.constant_bank("sm_90", thread, 0x210, np.int32(100).tobytes())
    trace = sass_walk.walk(fn, {"k_demo": fn}, bank, thread, record_path=True)
    assert trace.counts[0x30] == 1 and trace.counts[0x40] == 1
    assert trace.counts[0x50] == 3 and trace.counts[0x80] == 0 and trace.counts[0x90] == 0
    assert trace.counts[0xE0] == 1 and trace.calls == 0
    assert sum(trace.policy_branches.values()) == 3
    assert trace.instructions == 5 + 3 * 7 + 2
    # Out of bounds (n = 2): the predicated EXIT is taken, and it counted.
    bank = sass_walk.constant_bank("sm_90", thread, 0x210, np.int32(2).tobytes())
    trace = sass_walk.walk(fn, {"k_demo": fn}, bank, thread)
    assert trace.instructions == 4 and not trace.accesses


def _run(lines, regs=None, preds=None, arch="sm_90"):
    """Execute straight-line SASS on one thread; returns the machine."""
    text = "\n".join(f"        /*{16 * i:04x}*/ {t} ;" for i, t in enumerate([*lines, "EXIT"]))
    fn = sass.parse_sass(f"\t.target {arch}\n\t\tFunction : t\n" + text)["t"]
    thread = sass_walk.Thread((128, 2, 1), (4, 3, 1), (5, 1, 0), (2, 1, 0))
    machine = sass_walk._Machine(fn, {}, sass_walk.constant_bank(arch, thread, 0x210, bytes(8)), thread,
                                 sass_walk.Trace())
    for k, v in (regs or {}).items():
        machine.r[k] = v
    for k, v in (preds or {}).items():
        machine.p[k] = v
    for ins in fn.instructions[:-1]:
        sass_walk._SEMANTICS[ins.opcode](machine, ins)
    return machine


def test_integer_semantics():
    m = _run(["IMAD.WIDE.U32 R4, R2, R3, R6", "IADD3 R8, P0, P1, R2, -R3, RZ", "IADD3.X R9, R10, ~R11, RZ, P0, !PT"],
             regs={2: 0xFFFF_FFFF, 3: 0x10, 6: 5, 7: 1, 10: 7, 11: 2})
    assert m.r[4] | m.r[5] << 32 == 0xFFFF_FFFF * 0x10 + (1 << 32 | 5)
    assert m.r[8] == 0xFFFF_FFEF and m.p[0] is True and m.p[1] is False   # no borrow
    assert m.r[9] == 7 + (~2 & 0xFFFF_FFFF) + 1 & 0xFFFF_FFFF == 5
    m = _run(["IMAD.HI.U32 R3, R8, R9, R6", "LEA R4, P0, R2, R5, 0x3", "LEA.HI.X R7, R2, R10, R11, 0x3, P0",
              "SHF.L.U64.HI R12, R2, 0x4, R11", "SHF.R.S32.HI R13, RZ, 0x1f, R14", "LOP3.LUT P1, R15, R2, 0xff, RZ, 0xc0, !PT"],
             regs={8: 0x8000_0000, 9: 4, 6: 7, 7: 0, 2: 0xF000_0001, 5: 0x8000_0000, 10: 1, 11: 2, 14: 0x8000_0000})
    assert m.r[3] == 2                                   # (2^31 * 4 + 7) >> 32
    assert m.r[4] == 8 and m.p[0] is True                # 0x80000008 + 0x80000000: carries
    assert m.r[7] == ((2 << 32 | 0xF000_0001) << 3 >> 32 & 0xFFFF_FFFF) + 1 + 1
    assert m.r[12] == ((2 << 32 | 0xF000_0001) << 4) >> 32 & 0xFFFF_FFFF
    assert m.r[13] == 0xFFFF_FFFF and m.r[15] == 1 and m.p[1] is True
    m = _run(["ISETP.GE.U32.AND P0, PT, R2, R4, PT", "ISETP.GE.AND.EX P0, PT, R3, R5, PT, P0",
              "ISETP.LT.AND P1, P2, R2, RZ, PT", "PRMT R6, R2, 0x7632, R6", "HFMA2.MMA R7, -RZ, RZ, 3.7421875, 0",
              "S2R R8, SR_CTAID.X", "LDC R9, c[0x0][0x4]", "SEL R10, R2, R4, P0"],
             regs={2: 0x1234_5678, 3: 1, 4: 0xFFFF_FFFF, 5: 0, 6: 0})
    assert m.p[0] is True and m.p[1] is False and m.p[2] is True   # (1:0x12345678) >= (0:0xffffffff)
    assert m.r[6] == 0x1234 and m.r[7] == 0x437C_0000 and m.r[8] == 2 and m.r[9] == 2 and m.r[10] == 0x1234_5678
    m = _run(["LDG.E R2, desc[UR4][R4.64]", "IADD3 R3, R2, 0x1, RZ", "ISETP.NE.AND P0, PT, R3, RZ, PT"],
             regs={2: 1, 4: 0, 5: 0})
    assert m.r[2] is None and m.r[3] is None and m.p[0] is None   # data from memory is unknown


def test_driver_constants_by_arch():
    thread = sass_walk.Thread((128, 2, 1), (64, 4, 1), (5, 1, 0), (0, 2, 0))
    assert sass_walk.constant_bank("sm_90", thread, 0x210, b"")[0xC] == 64
    bank = sass_walk.constant_bank("sm_100", thread, 0x380, b"\x01\0\0\0")
    assert bank[0x360] == 128 and bank[0x364] == 2 and bank[0x370] == 64 and bank[0x380] == 1


# ---- planted kernels: each check can fail ---------------------------------------------------------

PLANTED = r"""
// A rolled grid-stride loop, as the project's kernels have.
#define GRID_STRIDE(i, n)                                                          \
    _Pragma("unroll 1")                                                            \
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < (n);   \
         i += (long long)gridDim.x * blockDim.x)

// Passes every check: 16-byte accesses, a few instructions per element.
extern "C" __global__ void planted_clean(const float4* a, float4* b, long long n) {
    GRID_STRIDE(i, n) {
        float4 v = a[i];
        v.x *= 2.0f; v.y *= 2.0f; v.z *= 2.0f; v.w *= 2.0f;
        b[i] = v;
    }
}

// The same math as planted_clean on two lanes per instruction (sm_100's FMUL2; scalar below sm_100).
extern "C" __global__ void planted_paired(const float4* a, float4* b, long long n) {
    GRID_STRIDE(i, n) {
        float4 v = a[i];
#if __CUDA_ARCH__ >= 1000
        unsigned long long xy, zw, two;
        asm("mov.b64 %0, {%1, %2};" : "=l"(xy) : "f"(v.x), "f"(v.y));
        asm("mov.b64 %0, {%1, %2};" : "=l"(zw) : "f"(v.z), "f"(v.w));
        asm("mov.b64 %0, {%1, %1};" : "=l"(two) : "f"(2.0f));
        asm("mul.rn.f32x2 %0, %0, %1;" : "+l"(xy) : "l"(two));
        asm("mul.rn.f32x2 %0, %0, %1;" : "+l"(zw) : "l"(two));
        asm("mov.b64 {%0, %1}, %2;" : "=f"(v.x), "=f"(v.y) : "l"(xy));
        asm("mov.b64 {%0, %1}, %2;" : "=f"(v.z), "=f"(v.w) : "l"(zw));
#else
        v.x *= 2.0f; v.y *= 2.0f; v.z *= 2.0f; v.w *= 2.0f;
#endif
        b[i] = v;
    }
}

// Local memory: an array indexed by data cannot live in registers.
extern "C" __global__ void planted_local(const float4* a, float4* b, long long n) {
    GRID_STRIDE(i, n) {
        float4 v = a[i];
        float t[64];
#pragma unroll
        for (int k = 0; k < 64; ++k) t[k] = v.x * (float)k;
        t[__float_as_int(v.y) & 63] += v.w;
        v.x = t[__float_as_int(v.z) & 63];
        b[i] = v;
    }
}

// A CALL in the loop: a function ptxas keeps out of line.
__device__ __noinline__ float planted_helper(float x) { return x * 3.0f + 1.0f; }
extern "C" __global__ void planted_call(const float4* a, float4* b, long long n) {
    GRID_STRIDE(i, n) {
        float4 v = a[i];
        v.x = planted_helper(v.x);
        b[i] = v;
    }
}

// IEEE division: the division's slow path is a subroutine.
extern "C" __global__ void planted_division(const float4* a, float4* b, long long n) {
    GRID_STRIDE(i, n) {
        float4 v = a[i];
        v.x = 1.0f / (1.0f + v.y);
        b[i] = v;
    }
}

// Byte-wide accesses: one byte per lane per load and store.
extern "C" __global__ void planted_bytes(const unsigned char* a, unsigned char* b, long long n) {
    GRID_STRIDE(i, n) { b[i] = (unsigned char)(a[i] * 3u + 1u); }
}

// A long dependent math chain: far more instructions than bytes.
extern "C" __global__ void planted_chain(const float4* a, float4* b, long long n) {
    GRID_STRIDE(i, n) {
        float4 v = a[i];
#pragma unroll
        for (int k = 0; k < 64; ++k) {
            v.x = v.x * v.x + 0.5f; v.y = v.y * v.y + 0.5f; v.z = v.z * v.z + 0.5f; v.w = v.w * v.w + 0.5f;
        }
        b[i] = v;
    }
}
"""
SWIGLU_GOAL = mc.Goal(("H100", "B200"), 0.60, "SwiGLU's goal")


@pytest.fixture(scope="module", params=["sm_90", "sm_100"])
def planted(request):
    if not HAVE_CUOBJDUMP:
        pytest.skip("cuobjdump not installed")
    reports, cubin = compile_check.compile_source(PLANTED, request.param)
    functions, layouts = sass.disassemble(cubin), sass.param_layouts(cubin)
    codes = {}
    for r in reports:
        byte_wide = r.kernel == "planted_bytes"
        # 2^20 elements, one per thread (bytes) or four (float4), 256-thread blocks: one pass each.
        n = (1 << 20) // (1 if byte_wide else 4)
        launch = mc.KernelLaunch((n // 256, 1, 1), (256, 1, 1),
                                 (np.uint64(0x7F00_0000_0000), np.uint64(0x7F10_0000_0000), np.int64(n)),
                                 elements_per_thread=1 if byte_wide else 4,
                                 bytes_per_element=2.0 if byte_wide else 8.0, block_idx=(7, 0, 0))
        codes[r.kernel] = mc.analyze_function(functions[r.kernel], functions, launch, layouts[r.kernel], r)
    return codes


def test_planted_clean_kernel_passes_every_check(planted):
    code = planted["planted_clean"]
    assert not mc.local_memory_problems(code)
    assert not mc.access_width_problems(code, vectorized=True)
    assert not mc.hot_loop_call_problems(code)
    assert not mc.ratio_problems(code, SWIGLU_GOAL)
    assert code.sector_efficiency == 1.0 and code.walked_bytes_per_element == 8.0


def test_planted_scalar_math_trips_the_paired_math_check(planted):
    """sm_100: scalar fp32 math has no paired instruction (NVRTC pairs
    nothing by itself), the same math through PTX's .f32x2 has; below sm_100
    neither has any."""
    clean, paired = planted["planted_clean"], planted["planted_paired"]
    assert "no paired fp32 instruction" in " ".join(mc.paired_math_problems(clean))
    if paired.arch == "sm_100":
        assert not mc.paired_math_problems(paired) and paired.hot_loop_paired == 2
        assert paired.instructions < clean.instructions  # two FMUL2 in place of four FMUL
    else:
        assert mc.paired_math_problems(paired)


def test_planted_math_built_without_ftz_trips_the_denormal_flush_check(planted):
    """PLANTED is compiled without ``-ftz=true``: its fp32 math has no .FTZ,
    which the check names; the same source built with it passes."""
    clean = planted["planted_clean"]
    assert "without .FTZ" in " ".join(mc.denormal_flush_problems(clean))
    _, cubin = compile_check.compile_source(PLANTED, clean.arch, ("-ftz=true",))
    functions = sass.disassemble(cubin)
    flushed = mc.analyze_function(functions["planted_clean"], functions)
    assert flushed.unflushed_fp32 == [] and not mc.denormal_flush_problems(flushed)


def test_planted_local_array_trips_the_local_memory_check(planted):
    problems = mc.local_memory_problems(planted["planted_local"])
    assert problems and "local memory instructions" in problems[0]


@pytest.mark.parametrize("kernel", ["planted_call", "planted_division"])
def test_planted_call_trips_the_hot_loop_call_check(planted, kernel):
    assert "CALL" in " ".join(mc.hot_loop_call_problems(planted[kernel]))
    assert not mc.local_memory_problems(planted[kernel])


def test_planted_byte_accesses_trip_the_width_checks(planted):
    code = planted["planted_bytes"]
    assert "1-2 B per lane in the hot loop" in " ".join(mc.access_width_problems(code, vectorized=True, fp8=True))
    assert "narrower than 16 B" in " ".join(mc.access_width_problems(code, vectorized=True))
    assert code.sector_efficiency == 1.0  # contiguous bytes: coalesced, just narrow


def test_planted_math_chain_trips_the_ratio_check(planted):
    code = planted["planted_chain"]
    problems = mc.ratio_problems(code, SWIGLU_GOAL)
    assert problems and "issue/memory" in problems[0]
    assert code.instr_per_element > 64   # 64 dependent FMAs per element, at least
    assert not mc.hot_loop_call_problems(code) and not mc.local_memory_problems(code)


def test_known_failures_may_hold_for_one_nvrtc_release_only():
    text = ("ratio\tswiglu\tbfloat16\tsm_90\tk_a\t1.01 > 1.00\t13.0\n"
            "ratio\tswiglu\tbfloat16\tsm_90\tk_b\t0.9 > 0.6\n# a comment\n")
    assert load_known_failures(text, "13.0") == {
        ("ratio", "swiglu", "bfloat16", "sm_90", "k_a"): "1.01 > 1.00 (NVRTC 13.0)",
        ("ratio", "swiglu", "bfloat16", "sm_90", "k_b"): "0.9 > 0.6"}
    assert list(load_known_failures(text, "13.5")) == [("ratio", "swiglu", "bfloat16", "sm_90", "k_b")]
