"""Kernel implementation of the primitives: layout checks, the vector-width
choice and the launch shape, then one call to a launcher (CuPy on a GPU, or
the host harness in CI). Tensors are passed as raw pointers, never copied
(except a non-unit inner stride, which the kernels cannot step).

Every primitive reaches the same two kernel kinds through one cached
:class:`LaunchPlan` per kind (``launch_plan``), handed raw pointers and row
strides (``LaunchPlan.launch_rows``): gate and up are separate pointers with
their own row strides, so the packed x12 is simply gate = x12's pointer and
up = the one H elements on (no views are made). An interleaved x12
(``activation.interleaved``) runs its own entry points, which read gate/up
pairs from x12 with 16-byte loads.

The GLU variant (``activation``, a ``GLUActivation``) picks the compiled
instance; its limit, alpha and up_offset, and the clamps' gradient bound (the
installed torch's rule at the limit), are kernel arguments in the math
dtype (numpy float32, or float64 for float64 storage: never a Python float,
which CuPy would pass as a C double).

The launch shape comes from ``launch_config=`` or, when None, from
``swiglu_cupy.kernels.launch_config.current_launch_config()`` (see that module).
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np
import torch

from ..kernels.launch import cupy_launcher, device_index, i64, pointer
from ..kernels.sources import fp8_lane_columns, kernel_name, kernel_variant, max_threads_per_block, vector_width
from .. import _torch_compat
from .._validation import check_fp8_compute_dtype
from ..activations import SILU, GLUActivation
from ..kernels.launch_config import LaunchConfig, current_launch_config
from . import saved_x12

_I64 = np.int64  # the kernels' integer argument type (pointers are ints: ``launch.pointer``)
MAX_BLOCK_X = 128   # threads across a row; the rest of the block covers rows
MAX_GRID_Y = 65535  # CUDA's limit; rows beyond it are covered by the grid-stride loop
HOST_SM_COUNT = 1   # stand-in for launchers without a GPU, so capped grids stay small


def _leading_dim(t: torch.Tensor) -> int:
    # A single row (or size-1 dims) can report any stride; it is never used to step.
    return t.stride(0) if t.shape[0] > 1 else t.shape[1]


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (a fixed stand-in off CUDA)."""
    return _cuda_sm_count(device_index(device)) if device.type == "cuda" else HOST_SM_COUNT


def launch_shape(M: int, H: int, vec: int, config: LaunchConfig, sm_count: int
                 ) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """x threads cover the packs of a row (``config.packs_per_thread`` each),
    y covers rows; with a grid cap the kernels' grid-stride loops cover the
    rest (columns first when one row alone needs more blocks than the cap)."""
    packs = -(-H // vec)
    per_thread = config.packs_per_thread
    block_x = min(MAX_BLOCK_X, config.threads_per_block, -(-packs // (32 * per_thread)) * 32)
    block_y = config.threads_per_block // block_x
    grid_x = -(-packs // (block_x * per_thread))
    grid_y = min(-(-M // block_y), MAX_GRID_Y)
    if config.grid_waves is not None:
        cap = config.max_blocks(sm_count)
        grid_x = min(grid_x, cap)
        grid_y = max(1, min(grid_y, cap // grid_x))
    return (grid_x, grid_y, 1), (block_x, block_y, 1)


def effective_launch_config(config: LaunchConfig, variant) -> LaunchConfig:
    """``config`` with its block capped to what the instance was compiled for
    (``kernels.sources.max_threads_per_block``); the same config otherwise."""
    limit = max_threads_per_block(variant, config.packs_per_thread)
    if config.threads_per_block <= limit:
        return config
    return dataclasses.replace(config, threads_per_block=limit)


@dataclasses.dataclass(frozen=True, eq=False)
class LaunchPlan:
    """What a launch of one kernel kind needs that does not depend on the
    tensors: built once per (kind, GLU spec, dtype, launch config, clamp
    rule) by :func:`launch_plan`, so a call only looks it up (or holds it: a
    decided ``dispatch.KernelPath`` does), checks its pointers' alignment and
    computes the grid."""
    names: tuple[str, str]       # the entry point for (1-element, 16-byte) accesses
    dtype: torch.dtype           # the storage dtype it was built for
    interleaved: bool            # the spec's layout: gate/up pairs, or halves
    vec: int                     # elements per 16-byte access in this dtype
    itemsize: int                # bytes per element of this dtype
    config: LaunchConfig         # capped to what the instance was compiled for
    scalar_args: tuple           # (limit, alpha, up_offset, grad_bound) in the math dtype
    capped: bool                 # whether the grid needs the device's SM count
    #: (M, columns, vec, device) -> (grid, block): ``launch_shape``'s answers, bounded
    shapes: dict = dataclasses.field(default_factory=dict)
    #: (M, H, row strides, device) -> (wide, narrow, tail) for ``launch_rows``: the (name, grid,
    #: block) of the 16-byte instance (None where H or a stride forbids it) and of the
    #: 1-element one, and the arguments after the pointers (numpy-typed once), bounded
    rows: dict = dataclasses.field(default_factory=dict)

    def launch_rows(self, launcher, device: torch.device, M: int, H: int, pointers: tuple, strides: tuple) -> None:
        """A row kernel over [M, H] on ``device``: arguments ``pointers...,
        M, H, strides...`` (pointers: ints, passed as they are, see
        ``launch.pointer``; element row strides; pointer 0 with stride 0 for
        an absent output). The 16-byte instance runs when H, every pointer
        and (past one row, which never steps) every row stride allow it."""
        if M == 0 or H == 0:
            return  # an empty grid is a CUDA launch error; there is nothing to do
        entry = self.rows.get((M, H, strides, device))
        if entry is None:
            entry = self._row_entry(M, H, strides, device)
        wide, chosen, tail = entry
        if wide is not None:
            chosen = wide
            for p in pointers:
                if p % 16:
                    chosen = entry[1]
                    break
        name, grid, block = chosen
        (launcher or cupy_launcher()).launch(name, self.dtype, device, grid, block, (*pointers, *tail))

    def _row_entry(self, M: int, H: int, strides: tuple, device: torch.device) -> tuple:
        vec = self.vec
        if H % vec or (M > 1 and any(ld % vec for ld in strides)):
            vec = 1
        wide = None if vec == 1 else (self.names[1], *self._shape(M, H, vec, device))
        narrow = (self.names[0], *self._shape(M, H, 1, device))
        if len(self.rows) >= 256:
            self.rows.clear()
        entry = self.rows[(M, H, strides, device)] = (
            wide, narrow, (_I64(M), _I64(H), *map(_I64, strides), *self.scalar_args))
        return entry

    def _shape(self, M: int, columns: int, vec: int, device: torch.device) -> tuple:
        shape = self.shapes.get((M, columns, vec, device))
        if shape is None:
            if len(self.shapes) >= 256:
                self.shapes.clear()
            shape = self.shapes[(M, columns, vec, device)] = launch_shape(
                M, columns, vec, self.config, sm_count(device) if self.capped else 0)
        return shape

    def launch(self, launcher, device: torch.device, M: int, columns: int, vec: int, args: tuple,
               vectorized: bool | None = None) -> None:
        """One launch on ``device`` over M rows of ``columns`` (``vec``: 1 or
        ``self.vec``) of the wide instance when ``vectorized`` (default:
        ``vec > 1``); nothing for an empty tile."""
        if M == 0 or columns == 0:
            return  # an empty grid is a CUDA launch error; there is nothing to do
        grid, block = self._shape(M, columns, vec, device)
        (launcher or cupy_launcher()).launch(self.names[vec > 1 if vectorized is None else vectorized], self.dtype,
                                             device, grid, block, (*args, *self.scalar_args))


#: (kind, id(spec), dtype, id(config), clamp rule) -> (spec, config, plan): keyed by the
#: specs' and configs' identity (hashing a dataclass is a Python call per launch); the entry
#: holds both, so their ids stay theirs, and a different but equal object only adds an entry.
#: Bounded: a caller that makes a new spec or config per call refills it from empty.
_PLANS: dict[tuple, tuple] = {}
_MAX_PLANS = 1024


def launch_plan(kind: str, activation: GLUActivation, dtype: torch.dtype, config: LaunchConfig | None
                ) -> LaunchPlan:
    """The cached :class:`LaunchPlan` (``config`` None: the current one); the
    clamps' gradient rule is read at each call (tests switch it)."""
    config = config or current_launch_config()
    key = (kind, id(activation), dtype, id(config), _torch_compat.CLAMP_GRADIENT_AT_BOUND)
    entry = _PLANS.get(key)
    if entry is None:  # else these very objects: the entry keeps them alive, and live objects' ids are unique
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        entry = _PLANS[key] = (activation, config, _build_plan(kind, activation, dtype, config, key[-1]))
    return entry[2]


def _build_plan(kind, activation, dtype, config, gradient_at_bound) -> LaunchPlan:
    variant = kernel_variant(activation)
    config = effective_launch_config(config, variant)
    names = (kernel_name(kind, False, config.packs_per_thread, variant),
             kernel_name(kind, True, config.packs_per_thread, variant))
    itemsize = dtype.itemsize
    return LaunchPlan(names, dtype, activation.interleaved, vector_width(dtype), itemsize, config,
                      _scalar_args(activation, dtype is torch.float64, gradient_at_bound), config.grid_waves is not None)


def _scalar_args(activation: GLUActivation, double: bool, gradient_at_bound: bool) -> tuple:
    """(limit, alpha, up_offset, grad_bound) in the kernels' math dtype (the
    limit and grad_bound are read only by clamped instances, alpha and
    up_offset only by OAI's). The clamps' gradient passes where
    |x| <= grad_bound: the limit itself where torch's clamp passes the
    gradient at exactly the bound, else the next value below it (x < L is
    x <= nextafter(L, -inf) in the math dtype)."""
    scalar = np.float64 if double else np.float32
    limit = scalar(0.0 if activation.limit is None else activation.limit)
    grad_bound = limit if gradient_at_bound else np.nextafter(limit, scalar(-np.inf))
    return limit, scalar(activation.alpha), scalar(activation.up_offset), grad_bound


def _unit_rows(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``t`` with unit inner stride (the kernels step rows, not columns), and
    its row stride: ``t`` itself, or a contiguous copy (for an output, a
    stand-in that :func:`_copy_back` copies to ``t`` after)."""
    ld, step = t.stride()  # one call for both (each stride(i) call parses its argument)
    return (t, ld) if step == 1 or t.shape[1] <= 1 else (t.contiguous(), t.shape[1])


def _copy_back(target: torch.Tensor, out: torch.Tensor) -> None:
    """An output written through a contiguous stand-in goes to the caller's view."""
    if target is not out:
        out.copy_(target)


# Each primitive's launch is one ``*_on`` body taking its plan and device as given: a decided
# ``dispatch.KernelPath`` holds both, so its calls look nothing up. The ``launch_*`` entry points
# (per-primitive dispatch, the self-check, tools) look the plan up and take the device from a tensor.

def silu_mul_forward_on(plan: LaunchPlan, launcher, device: torch.device, gate: torch.Tensor, up: torch.Tensor,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """h = act(gate) * up [M, H] (``out``: written there, e.g. over gate)."""
    # ``_unit_rows`` and ``_copy_back`` inline: separate weights' gate and up take this hot path.
    M, H = gate.shape
    gate_ld, step = gate.stride()  # one call for both (each stride(i) call parses its argument)
    if step != 1 and H > 1:
        gate, gate_ld = gate.contiguous(), H
    up_ld, step = up.stride()
    if step != 1 and H > 1:
        up, up_ld = up.contiguous(), H
    if out is None:
        h = target = gate.new_empty(M, H)
        h_ld = H
    else:
        h, (target, h_ld) = out, _unit_rows(out)
    plan.launch_rows(launcher, device, M, H, (gate.data_ptr(), up.data_ptr(), target.data_ptr()),
                     (gate_ld, up_ld, h_ld))
    if target is not h:
        h.copy_(target)
    return h


def launch_silu_mul_forward(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None,
                            launcher=None, launch_config: LaunchConfig | None = None,
                            activation: GLUActivation = SILU) -> torch.Tensor:
    return silu_mul_forward_on(launch_plan("swiglu_forward", activation, gate.dtype, launch_config), launcher,
                               gate.device, gate, up, out)


def launch_silu_mul_backward(gate: torch.Tensor, up: torch.Tensor, dh: torch.Tensor,
                             dgate_out: torch.Tensor | None, dup_out: torch.Tensor | None,
                             launcher=None, launch_config: LaunchConfig | None = None,
                             activation: GLUActivation = SILU) -> tuple[torch.Tensor, torch.Tensor]:
    M, H = gate.shape
    (gate, gate_ld), (up, up_ld), (dh, dh_ld) = _unit_rows(gate), _unit_rows(up), _unit_rows(dh)
    dgate = gate.new_empty(M, H) if dgate_out is None else dgate_out
    dup = gate.new_empty(M, H) if dup_out is None else dup_out
    (dgate_target, dgate_ld), (dup_target, dup_ld) = _unit_rows(dgate), _unit_rows(dup)
    launch_plan("swiglu_backward", activation, gate.dtype, launch_config).launch_rows(
        launcher, gate.device, M, H,
        (gate.data_ptr(), up.data_ptr(), dh.data_ptr(), dgate_target.data_ptr(), dup_target.data_ptr(), 0),
        (gate_ld, up_ld, dh_ld, dgate_ld, dup_ld, 0))
    _copy_back(dgate_target, dgate)
    _copy_back(dup_target, dup)
    return dgate, dup


def swiglu_forward_on(plan: LaunchPlan, launcher, device: torch.device, x12: torch.Tensor,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """h [M, H] from x12 [M, 2H]. Halves: gate and up are x12's pointer and
    the one H elements on, with x12's row stride (no views are made)."""
    M, N = x12.shape
    ld, step = x12.stride()  # one call for both (each stride(i) call parses its argument)
    if step != 1 and N > 1:
        x12 = x12.contiguous()  # the kernels step rows, not columns (``_unit_rows``, inline on this hot path)
        ld = N
    H = N // 2
    if out is None:  # sizes as separate ints: a tuple costs torch's argument parser ~1 us more
        h = target = x12.new_empty(M, H)
        h_ld = H
    else:
        h, (target, h_ld) = out, _unit_rows(out)
    x = x12.data_ptr()
    if plan.interleaved:
        plan.launch_rows(launcher, device, M, H, (x, target.data_ptr()), (ld, h_ld))
    else:
        plan.launch_rows(launcher, device, M, H, (x, x + H * plan.itemsize, target.data_ptr()), (ld, ld, h_ld))
    if target is not h:
        h.copy_(target)  # written through a contiguous stand-in: back to the caller's view
    return h


def launch_swiglu_forward(x12: torch.Tensor, out: torch.Tensor | None, launcher=None,
                          launch_config: LaunchConfig | None = None,
                          activation: GLUActivation = SILU) -> torch.Tensor:
    return swiglu_forward_on(launch_plan("swiglu_forward", activation, x12.dtype, launch_config), launcher,
                             x12.device, x12, out)


def swiglu_backward_on(plan: LaunchPlan, launcher, device: torch.device, x12: torch.Tensor, dh: torch.Tensor,
                       dx12_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx12, h) from x12 and dh; dx12 may be x12 itself (in place)."""
    M, N = x12.shape
    ld, step = x12.stride()  # one call for both (each stride(i) call parses its argument)
    if step != 1 and N > 1:
        x12, ld = x12.contiguous(), N
    H = N // 2
    dh_ld, step = dh.stride()
    if step != 1 and H > 1:
        dh, dh_ld = dh.contiguous(), H
    if dx12_out is None:
        dx12 = target = x12.new_empty(M, N)
        dx_ld = N
    else:
        dx12, (target, dx_ld) = dx12_out, _unit_rows(dx12_out)
    h = x12.new_empty(M, H)
    x, dx = x12.data_ptr(), target.data_ptr()
    if plan.interleaved:
        plan.launch_rows(launcher, device, M, H, (x, dh.data_ptr(), dx, h.data_ptr()), (ld, dh_ld, dx_ld, H))
    else:
        up = H * plan.itemsize
        plan.launch_rows(launcher, device, M, H, (x, x + up, dh.data_ptr(), dx, dx + up, h.data_ptr()),
                         (ld, ld, dh_ld, dx_ld, dx_ld, H))
    if target is not dx12:
        dx12.copy_(target)  # written through a contiguous stand-in: back to the caller's view
    return dx12, h


def launch_swiglu_backward(x12: torch.Tensor, dh: torch.Tensor, dx12_out: torch.Tensor | None,
                           launcher=None, launch_config: LaunchConfig | None = None,
                           activation: GLUActivation = SILU) -> tuple[torch.Tensor, torch.Tensor]:
    return swiglu_backward_on(launch_plan("swiglu_backward", activation, x12.dtype, launch_config), launcher,
                              x12.device, x12, dh, dx12_out)


def swiglu_backward_halves_on(plan: LaunchPlan, launcher, device: torch.device, gate: torch.Tensor,
                              up: torch.Tensor, dh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx12 [M, 2H], h), both new, from separate gate and up [M, H] (halves
    specs): the kernel of ``swiglu_backward_on`` with its own pointer and row
    stride for each half."""
    M, H = gate.shape
    # ``_unit_rows`` inline: separate weights' backward takes this hot path.
    gate_ld, step = gate.stride()
    if step != 1 and H > 1:
        gate, gate_ld = gate.contiguous(), H
    up_ld, step = up.stride()
    if step != 1 and H > 1:
        up, up_ld = up.contiguous(), H
    dh_ld, step = dh.stride()
    if step != 1 and H > 1:
        dh, dh_ld = dh.contiguous(), H
    dx12 = gate.new_empty(M, 2 * H)
    h = gate.new_empty(M, H)
    dx = dx12.data_ptr()
    plan.launch_rows(launcher, device, M, H,
                     (gate.data_ptr(), up.data_ptr(), dh.data_ptr(), dx, dx + H * plan.itemsize, h.data_ptr()),
                     (gate_ld, up_ld, dh_ld, 2 * H, 2 * H, H))
    return dx12, h


def launch_swiglu_backward_halves(gate: torch.Tensor, up: torch.Tensor, dh: torch.Tensor, launcher=None,
                                  launch_config: LaunchConfig | None = None,
                                  activation: GLUActivation = SILU) -> tuple[torch.Tensor, torch.Tensor]:
    return swiglu_backward_halves_on(launch_plan("swiglu_backward", activation, gate.dtype, launch_config),
                                     launcher, gate.device, gate, up, dh)


# ---- the 8-bit saved x12 (format: saved_x12.py) ------------------------------------------------
# 128 / vec lanes per 128-column block (16 for 16-bit types, 32 for fp32), vec columns each:
# launched like packs with N = 1 over a row's lane slots, rounded up to whole warps. The 16-byte
# instances need what the other kernels' do: H, every row stride and every pointer at vec elements.

def _fp8_vectorized(H: int, M: int, tensors: tuple[torch.Tensor, ...]) -> bool:
    """Whether the 16-byte instance can run on ``tensors`` (the 16/32-bit
    operands; the saved tensor's rows are 4-byte aligned, which its word
    accesses need): :meth:`LaunchPlan.launch_rows`'s rule, which that hot
    path keeps inline (a call there is a frame on every dense launch)."""
    vec = vector_width(tensors[0].dtype)
    if H % vec:
        return False
    for t in tensors:
        if t.data_ptr() % 16 or (M > 1 and t.stride(0) % vec):
            return False
    return True


def launch_swiglu_forward_fp8(x12: torch.Tensor, launcher=None, launch_config: LaunchConfig | None = None,
                              activation: GLUActivation = SILU) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, the saved tensor [M, R] uint8) from x12, in one pass."""
    check_fp8_compute_dtype(x12.dtype)  # float64's modules hold no 8-bit kernels
    x12 = _unit_rows(x12)[0]
    M, H = x12.shape[0], x12.shape[1] // 2
    h = x12.new_empty(M, H)
    saved = saved_x12.new_saved(M, H, activation.interleaved, x12.device)
    q, scales = saved_x12.saved_views(saved, H, activation.interleaved)
    tail = [pointer(q), pointer(scales), i64(M), i64(H)]
    strides = [i64(_leading_dim(h)), i64(saved.stride(0)), i64(saved.stride(0) // 4)]
    if activation.interleaved:
        args = [pointer(x12), pointer(h), *tail, i64(_leading_dim(x12)), *strides]
    else:
        args = [pointer(x12), pointer(x12[:, H:]), pointer(h), *tail, i64(_leading_dim(x12)),
                i64(_leading_dim(x12)), *strides]
    launch_plan("swiglu_forward_fp8", activation, x12.dtype, launch_config).launch(
        launcher, x12.device, M, fp8_launch_columns(H, activation, x12.dtype), 1, tuple(args),
        vectorized=_fp8_vectorized(H, M, (x12, h)))
    return h, saved


def launch_swiglu_backward_fp8(saved: torch.Tensor, dh: torch.Tensor, launcher=None,
                               launch_config: LaunchConfig | None = None,
                               activation: GLUActivation = SILU) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx12, h) in dh's dtype from the saved tensor."""
    check_fp8_compute_dtype(dh.dtype)  # float64's modules hold no 8-bit kernels
    dh = _unit_rows(dh)[0]
    M, H = dh.shape
    if saved.stride(0) != saved.shape[1] or saved.data_ptr() % 4:
        saved = saved.contiguous()  # rows of whole 4-byte scales (a view of it need not be)
    q, scales = saved_x12.saved_views(saved, H, activation.interleaved)
    dx12 = dh.new_empty(M, 2 * H)
    h = dh.new_empty(M, H)
    head = [pointer(q), pointer(scales), pointer(dh)]
    strides = [i64(saved.stride(0)), i64(saved.stride(0) // 4), i64(_leading_dim(dh))]
    if activation.interleaved:
        args = [*head, pointer(dx12), pointer(h), i64(M), i64(H), *strides, i64(2 * H), i64(_leading_dim(h))]
    else:
        args = [*head, pointer(dx12), pointer(dx12[:, H:]), pointer(h), i64(M), i64(H), *strides,
                i64(2 * H), i64(2 * H), i64(_leading_dim(h))]
    launch_plan("swiglu_backward_fp8", activation, dh.dtype, launch_config).launch(
        launcher, dh.device, M, fp8_launch_columns(H, activation, dh.dtype), 1, tuple(args),
        vectorized=_fp8_vectorized(H, M, (dh, dx12, h)))
    return dx12, h


def fp8_launch_columns(H: int, activation: GLUActivation, dtype: torch.dtype) -> int:
    """The lane slots the 8-bit saved x12's kernels spread over threads, per
    row: 128 / ``fp8_lane_columns`` lanes per block of a row (halves: per
    gate block; its lanes also take the up block beside it), rounded up to
    whole warps."""
    blocks = saved_x12.scale_blocks(H, activation.interleaved)
    lanes = saved_x12.BLOCK // fp8_lane_columns(dtype)
    return -(-lanes * (blocks if activation.interleaved else blocks // 2) // 32) * 32
