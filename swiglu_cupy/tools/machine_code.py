"""What the kernels' machine code predicts, per kernel: local memory, the
width of each global access, CALLs and paired fp32 math (sm_100) in the hot loop, and a static
issue/memory model. Predicted from the SASS of the cubins
``compile_check`` builds (no GPU), not measured.

The issue/memory model
----------------------
For each kernel, one thread of the default launch is walked through the
SASS (``sass_walk.walk``): the launch's real arguments and shape (recorded
from ``primitives.cuda_impl``, which builds them for a GPU launch) sit in
constant bank 0, so the walk goes round each loop as often as that thread
does (the grid-stride loops once: the default launch is one tile per
thread), takes the in-bounds side of every bounds test, and takes a math
routine's fast path where a branch depends on data (``sass_walk._policy``).
Every instruction on the path counts, predicated or not; the encoders and
quantizers of the 8-bit kernels have no data-dependent branch, so their
whole cost counts. The walked thread is lane 5 of an in-bounds warp of an
[8, 65536] problem (``launch_for``). Then, per element (the thread's tile:
pack width N x packs per thread; an 8-bit lane's ``fp8_lane_columns``
columns of its block, half that many h columns when interleaved)::

    issue time  = instr_per_elem / 32 / (SMs * 4 * clock)     4 schedulers, 1 warp instruction/clock each
    MUFU time   = mufu_per_elem / (SMs * 16 * clock)          16 MUFU lanes/clock/SM
    memory time = bytes_per_elem / DRAM bandwidth
    ratio       = max(issue time, MUFU time) / memory time

A ratio under 1 says the part's DRAM, not instruction issue, bounds the
kernel; the goals (``goal_for``) keep headroom under it. Assumptions: a warp is
converged and all its lanes take the walked path; no stall is modelled
(latency, dependencies, memory-pipe throughput: it is a bound on issue, not a
time); fp64 math issues like fp32 (the fp64 kernels are the checking dtype,
not the fast one); every byte moves once between DRAM and the SM (the 8-bit
kernels' lanes all read their block's scales: one cached line).

Bytes per element (h column; es = the element size):

- forward: reads gate and up, writes h: 3 es.
- backward: reads gate, up and dh, writes dgate, dup and h: 6 es. SwiGLU's
  autograd backward (``launch_swiglu_backward``) passes h, which the MLP's
  dW3 needs; ``silu_mul``'s backward passes none (5 es there).
- 8-bit forward (``saved_x12="fp8"``, format in ``primitives/saved_x12.py``):
  reads gate and up, writes h, the e4m3 x12 (2 B) and the fp32 scales (4 B per
  128-column block of x12: 1/16 B per h element in both layouts):
  3 es + 2 + 1/16.
- 8-bit backward: reads the e4m3 x12 and scales (2 + 1/16 B) and dh, writes
  dgate, dup and h: 4 es + 2 + 1/16.
"""
from __future__ import annotations

import functools
import os
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from ..kernels import sass
from ..kernels.launch import kernel_argument_bytes
from ..kernels.sass_walk import Thread, Trace, WalkError, constant_bank, walk
from ..kernels.sources import (DEFAULT_VARIANT, FP8_KERNEL_KINDS, KERNEL_KINDS, PAIRED_MATH_KINDS, KernelVariant,
                               fp8_lane_columns, kernel_name, vector_width)
from ..kernels.launch_config import DEFAULT_LAUNCH, GRID_WAVES, PACKS_PER_THREAD, LaunchConfig


class ModelError(RuntimeError):
    pass


@dataclass(frozen=True)
class Part:
    name: str
    arch: str            # the cubin it runs
    sms: int
    clock_ghz: float     # boost clock
    dram_tbs: float      # DRAM bandwidth, TB/s

    def times(self, instr_per_elem: float, mufu_per_elem: float, bytes_per_elem: float
              ) -> tuple[float, float, float]:
        """(issue, MUFU, memory) seconds per element over the whole part."""
        clock = self.clock_ghz * 1e9
        issue = instr_per_elem / 32 / (self.sms * ISSUE_PER_CLOCK * clock)
        mufu = mufu_per_elem / (self.sms * MUFU_LANES_PER_CLOCK * clock)
        memory = bytes_per_elem / (self.dram_tbs * 1e12)
        return issue, mufu, memory


ISSUE_PER_CLOCK = 4          # warp instructions per clock per SM (4 schedulers)
MUFU_LANES_PER_CLOCK = 16    # MUFU results per clock per SM
# Published figures (SXM parts, boost clocks).
PARTS = (Part("A100", "sm_80", 108, 1.41, 2.0), Part("H100", "sm_90", 132, 1.98, 3.35),
         Part("H200", "sm_90", 132, 1.98, 4.8), Part("B200", "sm_100", 148, 1.9, 8.0))
PART_BY_NAME = {p.name: p for p in PARTS}

FP8_BLOCK = 128  # columns per scale block (primitives/saved_x12.BLOCK)


# ---- the kernel instances ------------------------------------------------------------------

@dataclass(frozen=True)
class Instance:
    kind: str          # "swiglu_forward", "swiglu_backward", "swiglu_forward_fp8", "swiglu_backward_fp8"
    vectorized: bool
    packs: int

    @property
    def fp8(self) -> bool:
        return self.kind in FP8_KERNEL_KINDS

    @property
    def direction(self) -> str:
        return "backward" if "backward" in self.kind else "forward"


def instance_of(name: str, variant: KernelVariant = DEFAULT_VARIANT) -> Instance:
    for kind in (*KERNEL_KINDS, *FP8_KERNEL_KINDS):
        for vectorized in (True, False):
            for packs in PACKS_PER_THREAD:
                if kernel_name(kind, vectorized, packs, variant) == name:
                    return Instance(kind, vectorized, packs)
    raise ModelError(f"{name!r} is not a kernel of variant {variant}")


def activation_of(variant: KernelVariant):
    """A GLU spec that runs ``variant`` (the clamp limit and OAI's constants
    are kernel arguments: any value gives the same machine code)."""
    from ..activations import GLUActivation

    oai = variant.kind == "oai"
    return GLUActivation(variant.kind, limit=7.0 if variant.clamp else None, alpha=1.702 if oai else 1.0,
                         up_offset=1.0 if oai else 0.0, interleaved=variant.interleaved)


def bytes_per_element(instance: Instance, dtype: torch.dtype) -> float:
    """DRAM bytes per h element (see the module docstring)."""
    es = torch.empty((), dtype=dtype).element_size()
    scales = 4 / FP8_BLOCK * 2  # 4 B per 128 x12 columns; 2 x12 columns per h element
    if instance.kind == "swiglu_forward":
        return 3 * es
    if instance.kind == "swiglu_backward":
        return 6 * es
    if instance.kind == "swiglu_forward_fp8":
        return 3 * es + 2 + scales
    return 4 * es + 2 + scales


def elements_per_thread(instance: Instance, dtype: torch.dtype, variant: KernelVariant) -> int:
    """h elements one thread's tile holds."""
    if instance.fp8:  # a lane holds fp8_lane_columns x12 columns of a block (of each half: as many h columns)
        per_lane = fp8_lane_columns(dtype) // (2 if variant.interleaved else 1)
        return per_lane * instance.packs
    return (vector_width(dtype) if instance.vectorized else 1) * instance.packs


# ---- the launch, as the host builds it -----------------------------------------------------

@dataclass(frozen=True)
class KernelLaunch:
    """A concrete launch of one kernel and what one thread of it covers."""
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    args: tuple            # ints (pointers) and numpy scalars, as passed to the kernel
    elements_per_thread: int
    bytes_per_element: float
    thread: tuple[int, int, int] = (5, 0, 0)   # threadIdx of the walked thread
    block_idx: tuple[int, int, int] = (0, 0, 0)

    def walked(self, lane_offset: int = 0) -> Thread:
        tx, ty, tz = self.thread
        return Thread(self.block, self.grid, (tx + lane_offset, ty, tz), self.block_idx)


class _Recorder:
    def __init__(self):
        self.calls = []

    def launch(self, name, dtype, device, grid, block, args):
        self.calls.append((name, tuple(grid), tuple(block), tuple(args)))


# The problem the walk launches: wide enough that every pack of the walked
# thread's tile is in bounds for every instance (4 packs of 128 threads x 8
# elements; the 8-bit kernels' lanes need far fewer columns).
MODEL_ROWS = 8
MODEL_H = 65536


def launch_for(name: str, dtype: torch.dtype, variant: KernelVariant = DEFAULT_VARIANT,
               config: LaunchConfig | None = None) -> KernelLaunch:
    """The launch of kernel ``name`` that the host code builds for an
    [8, 65536] problem (65535 for the scalar instances, which the host picks
    when H is not a multiple of the vector width, or of 4 for the 8-bit kernels), with ``config`` (default:
    ``DEFAULT_LAUNCH`` with the instance's packs per thread). The walked
    thread is lane 5 of the middle row of blocks, x-block 0."""
    from ..primitives import cuda_impl, saved_x12

    instance = instance_of(name, variant)
    config = config or LaunchConfig(instance.packs, DEFAULT_LAUNCH.threads_per_block, DEFAULT_LAUNCH.grid_waves)
    spec = activation_of(variant)
    H = MODEL_H if instance.vectorized else MODEL_H - 1
    M = MODEL_ROWS
    rec = _Recorder()
    x12 = torch.empty((M, 2 * H), dtype=dtype)
    dh = torch.empty((M, H), dtype=dtype)
    if instance.kind == "swiglu_forward":
        cuda_impl.launch_swiglu_forward(x12, None, launcher=rec, launch_config=config, activation=spec)
    elif instance.kind == "swiglu_backward":
        cuda_impl.launch_swiglu_backward(x12, dh, None, launcher=rec, launch_config=config, activation=spec)
    elif instance.kind == "swiglu_forward_fp8":
        cuda_impl.launch_swiglu_forward_fp8(x12, launcher=rec, launch_config=config, activation=spec)
    else:
        saved = saved_x12.new_saved(M, H, variant.interleaved, "cpu")
        cuda_impl.launch_swiglu_backward_fp8(saved, dh, launcher=rec, launch_config=config, activation=spec)
    if len(rec.calls) != 1 or rec.calls[0][0] != name:
        raise ModelError(f"the host launched {[c[0] for c in rec.calls]} for {name} (dtype {dtype})")
    _, grid, block, args = rec.calls[0]
    by = grid[1] // 2
    thread, block_idx = (5, block[1] - 1, 0), (0, by, 0)
    columns = cuda_impl.fp8_launch_columns(H, spec, dtype) if instance.fp8 else H
    vec = vector_width(dtype) if instance.vectorized and not instance.fp8 else 1
    tiles = tiles_of_thread(grid, block, thread, block_idx, M, columns, vec, config.packs_per_thread)
    return KernelLaunch(grid, block, args, tiles * elements_per_thread(instance, dtype, variant),
                        bytes_per_element(instance, dtype), thread=thread, block_idx=block_idx)


def tiles_of_thread(grid, block, thread, block_idx, rows: int, columns: int, vec: int, packs: int) -> int:
    """The tiles one thread covers: the kernels' grid-stride loops
    (``SWIGLU_FOR_EACH_TILE_OF``) over rows, then over its row's tile
    columns. One on an uncapped launch; on a capped grid each thread loops,
    and its prologue is shared by every tile it covers."""
    row_loop = range(block_idx[1] * block[1] + thread[1], rows, grid[1] * block[1])
    column_loop = range((block_idx[0] * block[0] * packs + thread[0]) * vec, columns, grid[0] * block[0] * packs * vec)
    return len(row_loop) * len(column_loop)


def pack_params(args, layout: sass.ParamLayout | None = None) -> bytes:
    """The argument bytes as the kernel sees them (each aligned to its size;
    checked against the cubin's own parameter table when given)."""
    out = bytearray()
    offsets = []
    for a in args:
        raw = np.asarray(a).tobytes() if isinstance(a, np.generic) else kernel_argument_bytes(a)
        out += bytes(-len(out) % len(raw))
        offsets.append((len(out), len(raw)))
        out += raw
    if layout is not None and layout.params and tuple(offsets) != layout.params:
        raise ModelError(f"kernel arguments {offsets} do not match the cubin's parameters {layout.params}")
    return bytes(out)


# ---- the analysis of one kernel ------------------------------------------------------------

@dataclass
class Prediction:
    """The model's figures for one kernel on one part."""
    part: str
    issue_ratio: float      # issue time / memory time
    mufu_ratio: float       # MUFU time / memory time

    @property
    def ratio(self) -> float:
        return max(self.issue_ratio, self.mufu_ratio)



@dataclass
class KernelCode:
    """What one kernel's machine code says (static) and predicts (the walk)."""
    kernel: str
    arch: str
    variant: KernelVariant | None = None
    dtype: torch.dtype | None = None
    registers: int | None = None
    stack_bytes: int = 0
    spill_bytes: int = 0
    local_accesses: list[str] = field(default_factory=list)    # LDL/STL instructions
    hot_loop_accesses: Counter = field(default_factory=Counter)  # "LDG.E.128" -> count in the hot loop
    all_accesses: Counter = field(default_factory=Counter)
    hot_loop_calls: int = 0
    hot_loop_paired: int = 0   # paired fp32 instructions (FADD2/FMUL2/FFMA2, sm_100+) in the hot loop
    unflushed_fp32: list[str] = field(default_factory=list)  # fp32 math without .FTZ (FLUSHING_FP32_OPCODES)
    calls: int = 0
    hot_loops: int = 0
    # the walk (None when no launch was given)
    instructions: int | None = None
    elements: int | None = None
    mufu: int | None = None
    bytes_per_element: float | None = None
    walked_bytes_per_element: float | None = None   # distinct bytes the walked thread touched
    sector_efficiency: float | None = None           # useful / moved bytes of a warp's accesses
    policy_branches: int = 0
    unmodelled: list[str] = field(default_factory=list)  # integer opcodes on the path the walk cannot evaluate
    predictions: dict[str, Prediction] = field(default_factory=dict)
    walk_error: str | None = None

    @property
    def instr_per_element(self) -> float | None:
        return None if self.instructions is None else self.instructions / self.elements

    @property
    def mufu_per_element(self) -> float | None:
        return None if self.mufu is None else self.mufu / self.elements

    @property
    def uses_local_memory(self) -> bool:
        return bool(self.local_accesses) or self.stack_bytes > 0 or self.spill_bytes > 0


def _width_of(name: str) -> int:
    mods = name.split(".")[1:]
    for mod in mods:
        if mod in sass._WIDTH_BY_MOD:
            return sass._WIDTH_BY_MOD[mod]
    return 4


def _sector_efficiency(a: list, b: list, lane: int) -> float | None:
    """Useful / moved bytes of the warp's global accesses, with lanes spaced
    as the two walked neighbours (``lane`` and the next) are (32-byte
    sectors; both must take the same path)."""
    if len(a) != len(b) or any(x.pc != y.pc for x, y in zip(a, b)):
        return None
    useful = moved = 0
    for x, y in zip(a, b):
        if x.address is None or y.address is None:
            return None
        stride = y.address - x.address
        useful += x.width * (1 if stride == 0 else 32)
        moved += 32 * _warp_sectors((x.address - lane * stride) % 32, stride, x.width)
    return useful / moved if moved else None


@functools.lru_cache(maxsize=4096)
def _warp_sectors(offset: int, stride: int, width: int) -> int:
    """32-byte sectors touched by 32 lanes at offset + k * stride, width bytes each."""
    sectors = set()
    for k in range(32):
        start = offset + k * stride
        sectors.update(range(start // 32, (start + width - 1) // 32 + 1))
    return len(sectors)


def _distinct_bytes(accesses) -> int | None:
    spans = []
    for a in accesses:
        if a.address is None:
            return None
        spans.append((a.address, a.address + a.width))
    spans.sort()
    total, end = 0, -1
    for lo, hi in spans:
        if hi <= end:
            continue
        total += hi - max(lo, end)
        end = hi
    return total


def analyze_function(fn: sass.SassFunction, functions: dict[str, sass.SassFunction],
                     launch: KernelLaunch | None = None, layout: sass.ParamLayout | None = None,
                     report=None) -> KernelCode:
    """The static checks' facts and, given a launch, the walk's prediction."""
    code = KernelCode(fn.name, fn.arch)
    if report is not None:
        code.registers, code.stack_bytes = report.registers, report.stack_bytes
        code.spill_bytes = report.spill_store_bytes + report.spill_load_bytes
    code.local_accesses = [f"{i.address:#06x} {i.text}" for i in fn.local_accesses]
    code.hot_loop_accesses = Counter(i.name for i in fn.hot_loop_accesses)
    code.all_accesses = Counter(i.name for i in fn.global_accesses)
    code.hot_loop_calls = len(fn.hot_loop_calls)
    code.hot_loop_paired = sum(1 for i in fn.in_loops(fn.hot_loops) if i.opcode.split(".")[0] in PAIRED_FP32_OPCODES)
    code.unflushed_fp32 = [f"{i.address:#06x} {i.text}" for i in fn.instructions
                           if i.opcode in FLUSHING_FP32_OPCODES and "FTZ" not in i.modifiers]
    code.calls = len(fn.calls)
    code.hot_loops = len(fn.hot_loops)
    if launch is None:
        return code
    if layout is None:
        raise ModelError(f"{fn.name}: no parameter layout in the cubin")
    params = pack_params(launch.args, layout)
    try:
        traces = [walk(fn, functions, constant_bank(fn.arch, launch.walked(k), layout.base, params),
                       launch.walked(k)) for k in (0, 1)]
    except WalkError as exc:
        code.walk_error = str(exc)
        return code
    trace: Trace = traces[0]
    code.instructions = trace.instructions
    code.elements = launch.elements_per_thread
    code.mufu = trace.count("MUFU")
    code.bytes_per_element = launch.bytes_per_element
    distinct = _distinct_bytes(trace.accesses)
    code.walked_bytes_per_element = None if distinct is None else distinct / launch.elements_per_thread
    code.sector_efficiency = _sector_efficiency(traces[0].accesses, traces[1].accesses, launch.walked().lane)
    code.policy_branches = sum(trace.policy_branches.values())
    code.unmodelled = sorted(trace.unmodelled)
    for part in PARTS:
        if part.arch != fn.arch:
            continue
        issue, mufu, memory = part.times(code.instr_per_element, code.mufu_per_element, launch.bytes_per_element)
        code.predictions[part.name] = Prediction(part.name, issue / memory, mufu / memory)
    return code


def analyze_module(variant: KernelVariant, dtype: torch.dtype, arch: str, cubin: bytes,
                   reports=(), walk_kernels=None) -> list[KernelCode]:
    """Every kernel of one compiled module (``compile_check.compile_module``'s
    cubin and reports), each walked on its default launch (only those
    ``walk_kernels(name)`` accepts, when given: the static facts are read
    for all)."""
    functions = sass.disassemble(cubin)
    layouts = sass.param_layouts(cubin)
    by_name = {r.kernel: r for r in reports}
    out = []
    for name in sorted(by_name or (n for n in functions if layouts.get(n) is not None)):
        if name not in functions:
            raise ModelError(f"{name} is not in the cubin for {variant} {dtype} {arch}")
        launch = launch_for(name, dtype, variant) if walk_kernels is None or walk_kernels(name) else None
        code = analyze_function(functions[name], functions, launch, layouts.get(name), by_name.get(name))
        code.variant, code.dtype = variant, dtype
        out.append(code)
    return out


# ---- the checks (issue 42): each returns what is wrong, empty when nothing is ----------------

def local_memory_problems(code: KernelCode) -> list[str]:
    """No local memory: no LDL/STL, and ptxas reports no stack frame or spills."""
    out = []
    if code.local_accesses:
        more = len(code.local_accesses) - 3
        out.append(f"{len(code.local_accesses)} local memory instructions: {'; '.join(code.local_accesses[:3])}"
                   + (f"; ... {more} more" if more > 0 else ""))
    if code.stack_bytes or code.spill_bytes:
        out.append(f"ptxas: {code.stack_bytes} bytes stack frame, {code.spill_bytes} bytes spilled")
    return out


def access_width_problems(code: KernelCode, vectorized: bool, fp8: bool = False) -> list[str]:
    """A 16-byte (``_vec_``) instance moves 16 bytes per lane in every global
    access, except the 8-bit saved x12's, whose 16-byte instances make no 1-
    or 2-byte access per lane in their hot loop (issue 42's coalescing goal:
    their codes move as 4-byte words, an interleaved h as 8 bytes); the
    other instances never move 16 bytes (they take any alignment)."""
    out = []
    if vectorized and fp8:
        narrow = {n: k for n, k in code.hot_loop_accesses.items() if _width_of(n) < 4}
        if narrow or not code.hot_loop_accesses:
            out.append(f"1-2 B per lane in the hot loop: {_widths(Counter(narrow))}")
    elif vectorized:
        narrow = {n: k for n, k in code.all_accesses.items() if _width_of(n) != 16}
        if narrow or not code.all_accesses:
            out.append(f"narrower than 16 B in a 16-byte instance: {_widths(Counter(narrow))}")
    else:
        wide = {n: k for n, k in code.all_accesses.items() if _width_of(n) == 16}
        if wide:
            out.append(f"16-byte accesses in an any-alignment instance: {_widths(Counter(wide))}")
    return out


def hot_loop_call_problems(code: KernelCode) -> list[str]:
    if code.hot_loop_calls:
        return [f"{code.hot_loop_calls} CALLs in the hot loop"]
    if not code.hot_loops:
        return ["no hot loop found (no loop holds the kernel's stores)"]
    return []


#: sm_100's paired fp32 instructions: two lanes each (PTX add/sub/mul/fma .f32x2).
PAIRED_FP32_OPCODES = frozenset({"FADD2", "FMUL2", "FFMA2"})
#: fp32 math that carries .FTZ in SASS when the module is built with ``-ftz=true``, as CuPy
#: builds every module (``sources.compile_options``): one without it is code that never runs.
FLUSHING_FP32_OPCODES = frozenset({"FADD", "FMUL", "FFMA", "FSETP", *PAIRED_FP32_OPCODES})
PAIRED_FP32_ARCHS = frozenset({"sm_100"})


def pairs_expected(variant: KernelVariant, dtype: torch.dtype, arch: str) -> bool:
    """Whether a kernel's activation math must issue paired fp32 instructions:
    on sm_100, for the kinds written over pairs, with fp32 math (fp64 storage
    computes in fp64)."""
    return arch in PAIRED_FP32_ARCHS and variant.kind in PAIRED_MATH_KINDS and dtype != torch.float64


def paired_math_problems(code: KernelCode) -> list[str]:
    """Issue 42's paired math on sm_100: the hot loop issues FADD2/FMUL2/FFMA2
    (a kernel whose math NVRTC left scalar has none: it pairs nothing by itself)."""
    if not code.hot_loop_paired:
        return ["no paired fp32 instruction (FADD2/FMUL2/FFMA2) in the hot loop"]
    return []


def denormal_flush_problems(code: KernelCode) -> list[str]:
    """The module was built as CuPy builds it at run time, flushing fp32
    denormals: every fp32 add, multiply, FMA and compare carries .FTZ."""
    if not code.unflushed_fp32:
        return []
    more = len(code.unflushed_fp32) - 3
    return [f"{len(code.unflushed_fp32)} fp32 instructions without .FTZ (built without -ftz=true?): "
            + "; ".join(code.unflushed_fp32[:3]) + (f"; ... {more} more" if more > 0 else "")]


def ratio_problems(code: KernelCode, goal: Goal) -> list[str]:
    if code.walk_error or code.instructions is None:
        return [f"no prediction: {code.walk_error or 'not walked'}"]
    out = []
    for part in goal.parts:
        if part not in code.predictions:
            continue
        p = code.predictions[part]
        if p.ratio > goal.max_ratio:
            out.append(f"{part} issue/memory {p.ratio:.3f} > {goal.max_ratio:.2f} "
                       f"({code.instr_per_element:.2f} instr/elem, {code.bytes_per_element:g} B/elem)")
    return out


# ---- goals ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Goal:
    parts: tuple[str, ...]
    max_ratio: float
    what: str


def goal_for(variant: KernelVariant, dtype: torch.dtype, kernel: str) -> Goal | None:
    """Issue 42's goal for a kernel's issue/memory ratio on the default
    launch (``*_vec_p1``), or None (other instances, and float64, the
    checking dtype, have no goal)."""
    if dtype == torch.float64 or not kernel.endswith("_p1"):
        return None
    instance = instance_of(kernel, variant)
    if not instance.vectorized:
        return None
    if instance.fp8:
        parts = ("H100", "B200") if variant == DEFAULT_VARIANT else ("H100",)
        return Goal(parts, 1.0, "8-bit saved x12 kernels: <= 1.0")
    if variant == DEFAULT_VARIANT:
        return Goal(("H100", "B200"), 0.60, "SwiGLU: <= 0.60 on H100 and B200")
    return Goal(("H100",), 0.80, "other GLU variants: <= 0.80 on H100")


# ---- the report ----------------------------------------------------------------------------

REPORT_HEADER = """\
Predicted from the machine code (SASS of the NVRTC cubins, read with cuobjdump), not measured.
instr/elem: instructions one thread executes per h element on the default launch
  (DEFAULT_LAUNCH: one pack per thread, the grid capped at one wave, so each thread
  loops over several tiles and shares its prologue among them), walked through the
  SASS with the launch's real arguments:
  loops run as often as they do for that thread, bounds tests go in bounds, a math
  routine's data-dependent branch takes its fast path, predicated instructions count.
B/elem: DRAM bytes per h element (forward 3 es; backward 6 es: it writes h;
  8-bit forward 3 es + 2 + 1/16, 8-bit backward 4 es + 2 + 1/16).
<part>: max(issue, MUFU) time / memory time, issue = instr/elem / 32 / (SMs x 4 x clock),
  MUFU = mufu/elem / (SMs x 16 x clock), memory = B/elem / DRAM bandwidth
  (A100 108 SMs 1.41 GHz 2.0 TB/s, H100 132/1.98/3.35, H200 132/1.98/4.8, B200 148/1.9/8.0;
  sm_80 code for A100, sm_90 for H100/H200, sm_100 for B200). Under 1: memory-bound.
  No stall, latency or cache effect is modelled; a converged warp is assumed.
local: LDL/STL instructions + ptxas stack/spill bytes. widths: global accesses in the hot
  loop (the grid-stride loop's body), bytes per lane. sect: useful/moved bytes of the
  warp's accesses, per instruction (32-byte sectors). CALL: subroutine CALLs in the hot loop.
x2: paired fp32 instructions (FADD2/FMUL2/FFMA2: two lanes each, sm_100) in the hot loop."""


def _widths(counter: Counter) -> str:
    parts = Counter()
    for name, n in counter.items():
        op = name.split(".")[0]
        parts[f"{op}{_width_of(name)}"] += n
    return " ".join(f"{k}x{v}" for k, v in sorted(parts.items()))


def format_report(codes: list[KernelCode]) -> str:
    part_names = [p.name for p in PARTS]
    header = (f"{'variant':<22} {'dtype':<8} {'arch':<6} {'kernel':<44} {'instr/el':>8} {'mufu/el':>7} "
              f"{'B/el':>6} " + " ".join(f"{p:>6}" for p in part_names) +
              f" {'local':>5} {'sect':>5} {'CALL':>4} {'x2':>4}  widths")
    lines = [REPORT_HEADER, "", header, "-" * len(header)]
    for c in codes:
        variant = "silu (SwiGLU)" if c.variant == DEFAULT_VARIANT else (c.variant.tag if c.variant else "-")
        dtype = str(c.dtype).replace("torch.", "") if c.dtype is not None else "-"
        if c.instructions is None:
            figures = f"{'-':>8} {'-':>7} {'-':>6} " + " ".join(f"{'-':>6}" for _ in part_names)
        else:
            ratios = " ".join(f"{c.predictions[p].ratio:>6.2f}" if p in c.predictions else f"{'':>6}"
                              for p in part_names)
            figures = (f"{c.instr_per_element:>8.2f} {c.mufu_per_element:>7.3f} {c.bytes_per_element:>6.2f} "
                       + ratios)
        local = len(c.local_accesses) + c.stack_bytes + c.spill_bytes
        sect = "-" if c.sector_efficiency is None else f"{c.sector_efficiency:.0%}"
        lines.append(f"{variant:<22} {dtype:<8} {c.arch:<6} {c.kernel:<44} {figures} {local:>5} {sect:>5} "
                     f"{c.hot_loop_calls:>4} {c.hot_loop_paired:>4}  {_widths(c.hot_loop_accesses)}"
                     + (f"  [walk: {c.walk_error}]" if c.walk_error else ""))
    return "\n".join(lines)


def report_modules(jobs, modules, workers: int | None = None) -> str:
    """The report of compiled modules: ``jobs`` are (dtype, arch, variant) and
    ``modules`` their (reports, cubin), as ``compile_check.compile_jobs``
    returns them, analysed in ``workers`` processes (default: one per CPU).
    Ends with a summary of the checks and goals."""
    work = [(variant, dtype, arch, cubin, reports) for (dtype, arch, variant), (reports, cubin) in zip(jobs, modules)]
    workers = max(1, min(len(work), workers or os.cpu_count() or 1))
    if workers > 1:
        with ProcessPoolExecutor(workers) as pool:
            results = list(pool.map(_analyze_job, work))
    else:
        results = [_analyze_job(w) for w in work]
    codes = [c for module in results for c in module]
    text = format_report(codes) + "\n\n" + summarize(codes)
    swiglu = {(dtype, arch): module for (dtype, arch, variant), module in zip(jobs, modules)
              if variant == DEFAULT_VARIANT and dtype != torch.float64}
    return text + ("\n\n" + format_launch_scores(score_launches(swiglu)) if swiglu else "")


# ---- the default launch, chosen by the model ------------------------------------------------

#: The candidates for the default launch: each compiled packs-per-thread
#: instance, uncapped (one tile per thread) or grid-stride over a capped grid,
#: at the default block size (the block size does not change a thread's code).
LAUNCH_CHOICES = tuple(LaunchConfig(p, DEFAULT_LAUNCH.threads_per_block, w) for p in PACKS_PER_THREAD for w in GRID_WAVES)


@dataclass(frozen=True)
class LaunchScore:
    config: LaunchConfig
    worst: float          # the highest issue/memory ratio of the scored kernels on their parts
    registers: int        # the most registers one of them uses (occupancy: not in the model)
    instructions: float   # their instr/elem, summed


def score_launches(modules, configs=LAUNCH_CHOICES, variant: KernelVariant = DEFAULT_VARIANT) -> list[LaunchScore]:
    """Each config's score over the 16-byte elementwise kernels (forward and
    backward) of ``variant`` in ``modules``: (dtype, arch) -> (reports,
    cubin), each kernel walked on that launch. Best first: the lowest worst
    ratio (to 0.01), then the fewest registers, then the fewest instructions."""
    scores = []
    walked = {}
    for (dtype, arch), (reports, cubin) in modules.items():
        functions, layouts = sass.disassemble(cubin), sass.param_layouts(cubin)
        by_name = {r.kernel: r for r in reports}
        for config in configs:
            for kind in KERNEL_KINDS:
                name = kernel_name(kind, True, config.packs_per_thread, variant)
                code = analyze_function(functions[name], functions, launch_for(name, dtype, variant, config),
                                        layouts.get(name), by_name.get(name))
                if code.walk_error:
                    raise ModelError(f"{name} ({dtype}, {arch}, {config.label}): {code.walk_error}")
                walked.setdefault(config, []).append(code)
    for config, codes in walked.items():
        worst = max(p.ratio for c in codes for p in c.predictions.values())
        scores.append(LaunchScore(config, worst, max(c.registers or 0 for c in codes),
                                  sum(c.instr_per_element for c in codes)))
    return sorted(scores, key=lambda s: (round(s.worst, 2), s.registers, s.instructions))


def format_launch_scores(scores: list[LaunchScore]) -> str:
    lines = ["The default launch by the model (SwiGLU's 16-byte forward and backward kernels; worst predicted "
             "issue/memory ratio, most registers, instr/elem summed; best first):"]
    for s in scores:
        mark = "  <- DEFAULT_LAUNCH" if s.config == DEFAULT_LAUNCH else ""
        lines.append(f"  {s.config.label:<32} worst {s.worst:5.2f}  regs {s.registers:>3}  "
                     f"instr/elem {s.instructions:7.2f}{mark}")
    return "\n".join(lines)


def _analyze_job(work) -> list[KernelCode]:
    variant, dtype, arch, cubin, reports = work
    return analyze_module(variant, dtype, arch, cubin, reports)


def summarize(codes: list[KernelCode]) -> str:
    """One line per check: how many kernels break it (the goals of issue 42)."""
    local = [c for c in codes if local_memory_problems(c)]
    widths = [c for c in codes if access_width_problems(c, *_width_rule(c))]
    calls = [c for c in codes if c.hot_loop_calls]
    over = [c for c in codes if (g := goal_for(c.variant, c.dtype, c.kernel)) is not None and ratio_problems(c, g)]
    goals = [c for c in codes if (g := goal_for(c.variant, c.dtype, c.kernel)) is not None
             and any(p in c.predictions for p in g.parts)]
    paired_due = [c for c in codes if c.variant is not None and c.dtype is not None
                  and pairs_expected(c.variant, c.dtype, c.arch)]
    unpaired = [c for c in paired_due if paired_math_problems(c)]
    failed_walks = [c for c in codes if c.walk_error]
    flushing_due = [c for c in codes if c.dtype != torch.float64]  # float64 math is double, which -ftz leaves
    unflushed = [c for c in flushing_due if denormal_flush_problems(c)]
    lines = [f"{len(codes)} kernels: {len(local)} use local memory; {len(widths)} break the access-width rule "
             f"(16 B in vector instances, no 1-2 B per lane in the 8-bit kernels' hot loop); "
             f"{len(calls)} CALL a subroutine in the hot loop; {len(over)} of {len(goals)} default-launch "
             f"kernels exceed their issue/memory goal; {len(unpaired)} of {len(paired_due)} sm_100 kernels with "
             f"paired math issue no paired fp32 instruction in the hot loop; {len(unflushed)} of "
             f"{len(flushing_due)} kernels not in float64 have fp32 math without .FTZ (not built as CuPy builds)"
             + (f"; {len(failed_walks)} not walked" if failed_walks else "")]
    return "\n".join(lines)


def _width_rule(code: KernelCode) -> tuple[bool, bool]:
    """(vectorized, fp8) of a project kernel, for ``access_width_problems``."""
    instance = instance_of(code.kernel, code.variant)
    return instance.vectorized, instance.fp8
