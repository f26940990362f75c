"""Kernel sources: where the ``.cu`` files live, how they are expanded, and
the compile options. Shared by the CuPy loader, the NVRTC compile check and
the host-execution harness, so all three build exactly the same text.

Local ``#include "..."`` lines are inlined here because CuPy's disk cache is
keyed on the source string and options only: an edited header must change the
source, or a stale binary would be served after an upgrade.

Each GLU variant (``KernelVariant``: activation kind x clamp x layout) is its
own module of 24 entry points (direction x access width x packs per thread,
for the default kernels and for the 8-bit saved x12's; 12 for float64, which
refuses ``saved_x12="fp8"``, so no 8-bit kernel of it would ever run),
compiled lazily per (device, dtype, variant): SwiGLU alone compiles what it
did before the other variants existed, and a model pays only for the
variants it runs.
"""
from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import NamedTuple

import torch

from .._dtypes import FP8_SAVED_X12_DTYPES, SUPPORTED_DTYPES  # noqa: F401 (SUPPORTED_DTYPES re-exported)
from .._version import __version__
from ..activations import KINDS, GLUActivation
from .launch_config import MAX_THREADS_PER_BLOCK, PACKS_PER_THREAD

# The wheel carries the sources inside the package; an editable install or a
# plain checkout finds them at the repository's top level.
_PACKAGE_DIR = Path(__file__).resolve().parent.parent  # swiglu_cupy/ (the wheel puts kernels_cu/ there)
_CANDIDATE_DIRS = (_PACKAGE_DIR / "kernels_cu", _PACKAGE_DIR.parent / "kernels_cu")

KERNEL_FILES = ("swiglu_forward.cu", "swiglu_backward.cu", "swiglu_fp8.cu")
KERNEL_HEADERS = ("swiglu_common.cuh", "glu_activations.cuh", "fp8_e4m3.cuh")  # inlined by the files above
KERNEL_KINDS = ("swiglu_forward", "swiglu_backward")  # each defines GLU_<DIR>[_PAIRS]_ENTRY(name, GLU, N, PACKS)
# The 8-bit saved x12's kernels (swiglu_fp8.cu: GLU_<DIR>_FP8[_PAIRS]_ENTRY); their "vec" instances
# move 16-byte packs of x12, h and dh (and the codes as 4-byte words), the "scalar" ones one element.
FP8_KERNEL_KINDS = ("swiglu_forward_fp8", "swiglu_backward_fp8")
# 16-byte packs per lane of the 8-bit kernels' 128-column blocks (SWIGLU_FP8_LANE_PACKS): a
# block's fixed work (amax shuffles, quantizer, index math) is shared by this many packs per lane.
FP8_LANE_PACKS = 2

CTYPE_OF_DTYPE = {
    torch.float16: "__half",
    torch.bfloat16: "__nv_bfloat16",
    torch.float32: "float",
    torch.float64: "double",
}
assert tuple(CTYPE_OF_DTYPE) == SUPPORTED_DTYPES
# GPU architectures the compile check builds for (Ampere, Hopper, Blackwell).
DEFAULT_ARCHS = ("sm_80", "sm_90", "sm_100")

_LOCAL_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"[ \t]*$', re.MULTILINE)
_PRAGMA_ONCE = re.compile(r"^[ \t]*#[ \t]*pragma[ \t]+once[ \t]*$", re.MULTILINE)


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


class KernelVariant(NamedTuple):
    """The compile-time identity of a GLU variant: its activation kind, clamp
    on/off and layout (the limit, alpha and up_offset are kernel arguments)."""
    kind: str
    clamp: bool
    interleaved: bool

    @property
    def tag(self) -> str:
        """The variant's part of its kernels' names (empty for SwiGLU)."""
        if self == DEFAULT_VARIANT:
            return ""
        return self.kind + ("_clamp" if self.clamp else "") + ("_pairs" if self.interleaved else "")


DEFAULT_VARIANT = KernelVariant("silu", False, False)  # SwiGLU: today's kernels and names
# Every compiled variant, SwiGLU first: kinds x clamp x layout.
VARIANTS = tuple(KernelVariant(kind, clamp, interleaved) for interleaved in (False, True)
                 for clamp in (False, True) for kind in KINDS)

# The kinds whose math glu_activations.cuh writes over pairs of fp32 lanes (``kPaired``:
# one FADD2/FMUL2 per operation on sm_100); erf-GELU and ReLU run per lane (erff, selects).
PAIRED_MATH_KINDS = frozenset({"silu", "oai", "gelu_tanh", "sigmoid", "identity"})

# The functor of each activation kind in glu_activations.cuh.
_ACT_FUNCTOR = {"silu": "SiluAct", "gelu_tanh": "GeluTanhAct", "gelu": "GeluAct", "relu": "ReluAct",
                "sigmoid": "SigmoidAct", "identity": "IdentityAct", "oai": "OaiAct"}


def kernel_variant(spec: GLUActivation) -> KernelVariant:
    """The compiled variant that runs ``spec``."""
    return KernelVariant(spec.kind, spec.limit is not None, spec.interleaved)


@functools.lru_cache(maxsize=None)
def _kernel_files_source() -> str:
    """Every kernel file with local headers inlined once (read from disk once per process)."""
    seen: set = set()
    return "\n".join(f"// ==== {filename} ====\n{_expand(kernel_dir() / filename, seen)}"
                     for filename in KERNEL_FILES)


@functools.lru_cache(maxsize=None)
def module_source(variant: KernelVariant = DEFAULT_VARIANT) -> str:
    """The self-contained source of one variant's kernel module: every kernel
    file, then the variant's functor type and its entry points. One module per
    (device, dtype, variant) is compiled from it, on first use; the text
    covers everything the binary depends on (CuPy's disk cache key)."""
    # The variants other than SwiGLU load 16-bit packs through PTX on sm_100 (swiglu_common.cuh says why).
    prologue = [] if variant == DEFAULT_VARIANT else ["#define SWIGLU_PTX_LOADS_16BIT 1"]
    return "\n".join([f"// swiglu-cupy {__version__}", *prologue, _kernel_files_source(),
                      "// ==== entry points (generated by _sources.py) ====", variant_entries(variant)])


def variant_entries(variant: KernelVariant) -> str:
    """One variant's functor typedef and its 24 entry points (appended to
    the kernel files; the host harness appends several variants' at once).
    The 8-bit saved x12's are built only where ``SWIGLU_FP8_SAVED_X12`` is
    1 (:func:`compile_options`: not for float64)."""
    functor = f"glu_{variant.kind}{'_clamp' if variant.clamp else ''}_t"
    # SwiGLU keeps ptxas's own register choice (as before the other variants
    # existed). The others allow up to 65536 / 512 registers: left to its
    # heuristic, ptxas capped some of them at 64 on sm_90 and spilled.
    # Every variant's 8-bit saved x12's kernels allow 65536 / 512 registers too: a lane holds
    # FP8_LANE_PACKS packs of each operand, and SwiGLU's spilled when held to 64 (two resident
    # 512-thread blocks). A warp's bytes in flight grew with its registers.
    min_blocks = "" if variant == DEFAULT_VARIANT else ", 1"
    fp8_min_blocks = ", 1"
    lines = [f"typedef Glu<{_ACT_FUNCTOR[variant.kind]}, {'true' if variant.clamp else 'false'}> {functor};"]
    for kind, vectorized, packs in _instances():
        width = "SWIGLU_VEC_WIDTH" if vectorized else "1"
        fp8 = "_FP8" if kind in FP8_KERNEL_KINDS else ""
        macro = f"GLU_{kind.split('_')[1].upper()}{fp8}{'_PAIRS' if variant.interleaved else ''}_ENTRY"
        entry = ["#undef SWIGLU_LAUNCH_BOUNDS",
                 f"#define SWIGLU_LAUNCH_BOUNDS __launch_bounds__({max_threads_per_block(variant, packs)}"
                 f"{fp8_min_blocks if kind in FP8_KERNEL_KINDS else min_blocks})",
                 f"{macro}({kernel_name(kind, vectorized, packs, variant)}, {functor}, {width}, {packs})"]
        lines += ["#if SWIGLU_FP8_SAVED_X12", *entry, "#endif"] if kind in FP8_KERNEL_KINDS else entry
    return "\n".join(lines)


# The other variants' 4-pack instances hold too many values per thread for
# the 128 registers a 512-thread block leaves (fp64, and the GELU-tanh
# backward, spilled on sm_100): they are built for blocks of at most 256
# threads (up to 255 registers), and the launcher caps their blocks to that.
_WIDE_TILE_MAX_THREADS = 256


def max_threads_per_block(variant: KernelVariant, packs_per_thread: int) -> int:
    """The largest block an instance is compiled (and launched) for."""
    if variant != DEFAULT_VARIANT and packs_per_thread == 4:
        return _WIDE_TILE_MAX_THREADS
    return MAX_THREADS_PER_BLOCK


def kernel_files_source() -> str:
    """The kernel files with their headers inlined, without entry points."""
    return f"// swiglu-cupy {__version__}\n{_kernel_files_source()}"


def clear_source_cache() -> None:
    """Forget the expanded sources (they are read from disk once per process)."""
    _kernel_files_source.cache_clear()
    module_source.cache_clear()


def builds_fp8_kernels(dtype: torch.dtype | None) -> bool:
    """Whether ``dtype``'s modules hold the 8-bit saved x12's kernels (None: any dtype's)."""
    return dtype is None or dtype in FP8_SAVED_X12_DTYPES


def _instances(dtype: torch.dtype | None = None):
    """(kind, vectorized, packs) of every entry point of ``dtype``'s modules
    (None: of the source, i.e. of the dtypes that build them all)."""
    fp8_kinds = FP8_KERNEL_KINDS if builds_fp8_kernels(dtype) else ()
    return [(kind, vectorized, packs) for kind in (*KERNEL_KINDS, *fp8_kinds)
            for vectorized in (True, False) for packs in PACKS_PER_THREAD]


def kernel_name(kind: str, vectorized: bool, packs_per_thread: int,
                variant: KernelVariant = DEFAULT_VARIANT) -> str:
    """The entry point for one kernel kind, access width, packs per thread and
    variant: ``swiglu_forward_vec_p1`` for SwiGLU, ``glu_forward_gelu_tanh_vec_p1``,
    ``glu_backward_oai_clamp_pairs_scalar_p4``, ... for the others."""
    width = f"{'vec' if vectorized else 'scalar'}_p{packs_per_thread}"
    if variant == DEFAULT_VARIANT:
        return f"{kind}_{width}"
    return f"{kind.replace('swiglu_', 'glu_', 1)}_{variant.tag}_{width}"


@functools.lru_cache(maxsize=None)
def kernel_names(variant: KernelVariant = DEFAULT_VARIANT, dtype: torch.dtype | None = None) -> tuple[str, ...]:
    """Every kernel entry point in one variant's module for ``dtype`` (None:
    every one its source defines; float64's module lacks the 8-bit saved x12's)."""
    return tuple(kernel_name(*instance, variant) for instance in _instances(dtype))


@functools.lru_cache(maxsize=None)
def _variant_by_kernel() -> dict[str, KernelVariant]:
    return {name: variant for variant in VARIANTS for name in kernel_names(variant)}


def variant_of_kernel(name: str) -> KernelVariant:
    """The variant whose module defines kernel ``name`` (ValueError if none)."""
    try:
        return _variant_by_kernel()[name]
    except KeyError:
        raise ValueError(f"unknown kernel {name!r}; kernels are named like "
                         f"{kernel_names()[0]!r} or {kernel_names(VARIANTS[-1])[0]!r}") from None


def compile_options(dtype: torch.dtype) -> tuple[str, ...]:
    """NVRTC options for one storage dtype (the arch is added by the caller):
    the loader's (``launch.CupyLauncher``) and ``compile_check``'s, whose
    cubins the machine-code checks read. ``-ftz=true`` (fp32 denormals
    flushed) is what CuPy's RawModule adds to every compile; stated here, the
    checks read the code that runs (without it, 21 of SwiGLU's 24 float32
    kernels for sm_90 compile to other instructions). CuPy's copy of it is then a
    duplicate, which NVRTC compiles to the same cubin."""
    return ("--std=c++17", "-ftz=true", f"-DSWIGLU_MAX_THREADS_PER_BLOCK={MAX_THREADS_PER_BLOCK}",
            f"-DSWIGLU_FP8_SAVED_X12={int(builds_fp8_kernels(dtype))}", f"-DSWIGLU_FP8_LANE_PACKS={FP8_LANE_PACKS}",
            f"-DSWIGLU_SCALAR={CTYPE_OF_DTYPE[dtype]}")


def vector_width(dtype: torch.dtype) -> int:
    """Elements per 16-byte access, as SWIGLU_VEC_WIDTH in the kernels."""
    return 16 // dtype.itemsize


def fp8_lane_columns(dtype: torch.dtype) -> int:
    """Columns of a 128-column block one lane of the 8-bit kernels holds
    (SWIGLU_FP8_COLS): ``FP8_LANE_PACKS`` 16-byte packs."""
    return vector_width(dtype) * FP8_LANE_PACKS
