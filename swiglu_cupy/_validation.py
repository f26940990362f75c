"""Argument checks for the public API, driven by each argument's role.

Every error names the argument. The hot calls first try one cheap pass
(``common_case`` / ``common_packed_case``) that proves every per-tensor check
holds; anything else takes the full checks, which raise the precise error
or accept the call (autocast's mixed dtypes, strided weights).
"""
from __future__ import annotations

import enum
import sys

import torch

from ._dtypes import FP8_SAVED_X12_DTYPES, SUPPORTED_DTYPES

_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


class Role(enum.Enum):
    """What an argument is to the op, which decides what it may be."""
    INPUT = "input"    # activations (x, gate, up): any strides, any tensor subclass
    WEIGHT = "weight"  # parameters (weights, biases): local and materialized


def _reject_dtensor(name: str, t: torch.Tensor) -> None:
    """A DTensor weight means a generic tensor-parallel style sharded it. Only
    a process that imported DTensor can hold one, so nothing is imported here."""
    dtensor_module = sys.modules.get("torch.distributed.tensor")
    if dtensor_module is None or not isinstance(t, dtensor_module.DTensor):
        return
    raise TypeError(
        f"swiglu_cupy: {name} is a DTensor with placements {tuple(t.placements)}; the fused "
        "op needs local tensors. A generic tensor-parallel style (ColwiseParallel on w12, "
        "RowwiseParallel on w3, or a Hugging Face tp_plan) shards the packed [gate; up] w12 "
        "so that ranks hold gate rows without their up rows. Parallelize the SwiGLU module "
        "with swiglu_cupy.parallel.SwiGLUTensorParallel instead: "
        "parallelize_module(mlp, tp_mesh, SwiGLUTensorParallel()).")


def reject_dtensors(**tensors) -> None:
    """``_reject_dtensor`` for each named tensor (None is skipped)."""
    for name, t in tensors.items():
        if t is not None and type(t) not in _PLAIN_TENSORS:
            _reject_dtensor(name, t)


def check_tensor(name: str, t, role: Role, optional: bool = False) -> None:
    if t is None and optional:
        return
    if not isinstance(t, torch.Tensor):
        kind = "a torch.Tensor or None" if optional else "a torch.Tensor"
        raise TypeError(f"{name} must be {kind}, got {type(t).__name__}")
    if role is Role.WEIGHT and type(t) not in _PLAIN_TENSORS:
        _reject_dtensor(name, t)
    if t.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} must be a floating tensor of dtype float16, bfloat16, float32 "
                        f"or float64, got {t.dtype}")
    if t.is_meta:
        raise ValueError(f"{name} is a meta tensor (no data); materialize it first, e.g. "
                         "module.to_empty(device=...) and re-initialize the parameters")
    if (role is Role.WEIGHT and not t.is_contiguous()
            and any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape))):
        raise ValueError(f"{name} is an expanded view (stride 0 along a dim of size > 1, strides "
                         f"{t.stride()}); pass a materialized tensor, e.g. {name}.contiguous()")


def check_same(tensors: dict, attr: str, error) -> None:
    """Every tensor in ``tensors`` has the ``attr`` of the first one."""
    (ref_name, ref), *_ = tensors.items()
    for name, t in tensors.items():
        if t is not None and getattr(t, attr) != getattr(ref, attr):
            raise error(f"{name} must have the same {attr} as {ref_name} ({getattr(ref, attr)}), "
                        f"got {getattr(t, attr)}")


def check_inputs(tensors: dict, roles: dict, optional: tuple = ()) -> None:
    """The full per-tensor checks of ``{name: tensor}``, each in its role
    (``roles[name]``), then one device for all, and one dtype unless autocast
    will cast them to one."""
    for name, t in tensors.items():
        check_tensor(name, t, roles[name], optional=name in optional)
    check_same(tensors, "device", ValueError)
    first = next(iter(tensors.values()))
    if not torch.is_autocast_enabled(first.device.type):
        check_same(tensors, "dtype", TypeError)


def check_flags(**flags) -> None:
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")


def check_saved_x12(saved_x12, recompute_gate_up: bool = False, inplace_backward: bool = False) -> bool:
    """Whether ``saved_x12`` asks for the 8-bit saved x12 (``"fp8"``); None
    keeps x12 in the compute dtype. The memory modes that already keep no
    x12 (``recompute_gate_up``) or reuse its buffer (``inplace_backward``)
    cannot take it."""
    if saved_x12 is None:
        return False
    if not isinstance(saved_x12, str) or saved_x12 != "fp8":
        raise ValueError(f"saved_x12 must be None (x12 saved in the compute dtype) or 'fp8' (float8 e4m3 "
                         f"with a float32 scale per 128 columns), got {saved_x12!r}")
    if recompute_gate_up:
        raise ValueError("saved_x12='fp8' cannot be combined with recompute_gate_up=True: that mode saves no "
                         "x12 at all (it recomputes it in backward); pick one of the two")
    if inplace_backward:
        raise ValueError("saved_x12='fp8' cannot be combined with inplace_backward=True: dx12 cannot be "
                         "written over an 8-bit x12 half its size; pick one of the two")
    return True


def check_tile_rows(tile_rows) -> None:
    """``tile_rows``: None (untiled), a positive int (rows per tile) or ``"auto"``."""
    if tile_rows is None or tile_rows == "auto" and isinstance(tile_rows, str):
        return
    if isinstance(tile_rows, bool) or not isinstance(tile_rows, int):
        raise TypeError(f"tile_rows must be None, a positive int or 'auto', got {tile_rows!r}")
    if tile_rows < 1:
        raise ValueError(f"tile_rows must be a positive number of rows (or None / 'auto'), got {tile_rows}")


def check_fp8_compute_dtype(dtype: torch.dtype) -> None:
    """The compute dtype (after autocast) of a call with saved_x12='fp8'."""
    if dtype not in FP8_SAVED_X12_DTYPES:
        raise TypeError(f"saved_x12='fp8' takes float32, bfloat16 or float16 compute, got {dtype} (float64 is "
                        "the checking dtype: its x12 is kept exact; pass saved_x12=None)")


def reject_jit() -> None:
    if torch.jit.is_tracing():  # (is_scripting is False wherever this Python runs: not asked, a frame less)
        raise RuntimeError(
            "swiglu_cupy does not support TorchScript (torch.jit.trace / torch.jit.script): its "
            "kernels run from Python. Use torch.export.export (or torch.compile) instead.")


# ---- shapes of the feed-forward's arguments --------------------------------------------------

def check_packed_shapes(x, w12, b12, w3, b3) -> None:
    if x.dim() < 1:
        raise ValueError("x must have shape [..., D], got a 0-d tensor")
    if w12.dim() != 2:
        raise ValueError(f"w12 must be 2-D [2H, D], got shape {tuple(w12.shape)}")
    rows, D = w12.shape
    if rows == 0 or rows % 2:
        raise ValueError(f"w12 must have 2H rows (gate rows then up rows, H >= 1), got {rows} rows")
    if D != x.shape[-1]:
        raise ValueError(f"w12 must be [2H, D] with D = x.shape[-1] = {x.shape[-1]}, "
                         f"got shape {tuple(w12.shape)}")
    if b12 is not None and tuple(b12.shape) != (rows,):
        raise ValueError(f"b12 must have shape ({rows},) = (2H,), got {tuple(b12.shape)}")
    check_down_shapes(w3, b3, rows // 2)


def check_unpacked_shapes(x, w1, b1, w2, b2, w3, b3) -> None:
    if x.dim() < 1:
        raise ValueError("x must have shape [..., D], got a 0-d tensor")
    D = x.shape[-1]
    if w1.dim() != 2 or w1.shape[0] < 1 or w1.shape[1] != D:
        raise ValueError(f"w1 must be 2-D [H, D] with D = x.shape[-1] = {D}, got shape {tuple(w1.shape)}")
    H = w1.shape[0]
    if tuple(w2.shape) != (H, D):
        raise ValueError(f"w2 must have the shape of w1 [H, D] = {(H, D)}, got {tuple(w2.shape)}")
    for name, b in (("b1", b1), ("b2", b2)):
        if b is not None and tuple(b.shape) != (H,):
            raise ValueError(f"{name} must have shape ({H},) = (H,), got {tuple(b.shape)}")
    check_down_shapes(w3, b3, H)


def check_down_shapes(w3, b3, H: int) -> None:
    if w3.dim() != 2 or w3.shape[1] != H:
        raise ValueError(f"w3 must be 2-D [O, H] with H = {H}, got shape {tuple(w3.shape)}")
    if b3 is not None and tuple(b3.shape) != (w3.shape[0],):
        raise ValueError(f"b3 must have shape ({w3.shape[0]},) = (O,), got {tuple(b3.shape)}")


# ---- the cheap pass --------------------------------------------------------------------------

def common_case(x, w1, b1, w2, b2, w3, b3, packed: bool) -> bool:
    """Whether a feed-forward call is the common one, in one pass (one frame
    on the hot path): plain dense tensors of one supported dtype and one
    device (not meta), contiguous weights, and shapes that fit (``packed``:
    ``w1``/``b1`` are w12 and b12, and ``w2``/``b2`` must be None; the shapes
    of ``check_packed_shapes`` or ``check_unpacked_shapes``). True: every
    check holds; False sends the call through the full checks, for the
    precise error. torch.compile traces it: only what Dynamo can trace here.

    A device is compared as (``get_device()``, ``is_meta``), an int and a
    bool each, not as a ``torch.device``: building those objects took ~4.5 us
    of a decode-sized call. That tells CUDA devices apart, each from the CPU
    (index -1), and meta (also -1) from both; two accelerator types at one
    index (CUDA and another, which no process mixes) would pass here and meet
    torch's own device-mismatch error in the first GEMM. Meta must be asked:
    ``F.linear`` of a CPU x and a meta weight returns zeros, raising nothing."""
    if type(x) not in _PLAIN_TENSORS or x.layout is not torch.strided or x.is_meta:
        return False
    dtype, index = x.dtype, x.get_device()
    if dtype not in SUPPORTED_DTYPES:
        return False
    try:  # non-strided layouts report non-contiguous (or raise); a rank other than 2 fails to unpack
        if w1 is None or w3 is None or (w2 is None) is not packed or (packed and b2 is not None):
            return False
        for t in (w1, w3, w2, b1, b2, b3):
            if t is not None and (type(t) not in _PLAIN_TENSORS or t.dtype is not dtype or t.get_device() != index
                                  or t.is_meta or not t.is_contiguous()):
                return False
        rows, D = w1.shape
        O, H = w3.shape
        if packed:  # w1 is w12 [2H, D]
            return (x.shape[-1] == D and rows == 2 * H and H > 0
                    and (b1 is None or b1.shape == (rows,)) and (b3 is None or b3.shape == (O,)))
        return (x.shape[-1] == D and H > 0 and rows == H and w2.shape == w1.shape
                and (b1 is None or b1.shape == (H,)) and (b2 is None or b2.shape == (H,))
                and (b3 is None or b3.shape == (O,)))
    except (ValueError, IndexError, RuntimeError):
        return False


# ---- mixture of experts ------------------------------------------------------------------

_MOE_ROLES = {"x_sorted": Role.INPUT, "hidden_states": Role.INPUT, "w12": Role.WEIGHT, "b12": Role.WEIGHT,
              "w1": Role.WEIGHT, "b1": Role.WEIGHT, "w2": Role.WEIGHT, "b2": Role.WEIGHT,
              "w3": Role.WEIGHT, "b3": Role.WEIGHT}


def check_expert_weights(x_name: str, x: torch.Tensor, w12, w3, b12, b3, transposed: bool) -> tuple[int, int]:
    """Checks of x and the expert weights (dtype, device, shapes); returns (E, I)."""
    check_inputs({x_name: x, "w12": w12, "w3": w3, "b12": b12, "b3": b3}, _MOE_ROLES, optional=("b12", "b3"))
    check_flags(transposed=transposed)
    D = x.shape[-1] if x.dim() else None
    E, I = _gate_up_stack_shape("w12", w12, x_name, D, transposed, packed=True)
    _check_expert_down_and_biases(w3, transposed, E, I, D, (("b12", b12, (E, 2 * I)), ("b3", b3, (E, D))))
    return E, I


def check_unpacked_expert_weights(x_name: str, x: torch.Tensor, w1, w2, w3, b1, b2, b3,
                                  transposed: bool) -> tuple[int, int]:
    """``check_expert_weights`` for separate gate (w1) and up (w2) weights; returns (E, I)."""
    check_inputs({x_name: x, "w1": w1, "w2": w2, "w3": w3, "b1": b1, "b2": b2, "b3": b3}, _MOE_ROLES,
                 optional=("b1", "b2", "b3"))
    check_flags(transposed=transposed)
    D = x.shape[-1] if x.dim() else None
    E, I = _gate_up_stack_shape("w1", w1, x_name, D, transposed, packed=False)
    if w2.shape != w1.shape:
        raise ValueError(f"w2 must have the shape of w1 = {tuple(w1.shape)}, got {tuple(w2.shape)}")
    _check_expert_down_and_biases(w3, transposed, E, I, D,
                                  (("b1", b1, (E, I)), ("b2", b2, (E, I)), ("b3", b3, (E, D))))
    return E, I


def _gate_up_stack_shape(name: str, w, x_name: str, D, transposed: bool, packed: bool) -> tuple[int, int]:
    """(E, I) of a 3-D gate/up stack: packed ``[E, 2I, D]``, or one of the separate
    gate and up ``[E, I, D]`` (``transposed``: D first)."""
    width = "2I" if packed else "I"
    layout = f"[E, D, {width}]" if transposed else f"[E, {width}, D]"
    if w.dim() != 3:
        raise ValueError(f"{name} must be 3-D {layout}, got shape {tuple(w.shape)}")
    E = w.shape[0]
    n, d = (w.shape[2], w.shape[1]) if transposed else (w.shape[1], w.shape[2])
    if E < 1 or n < (2 if packed else 1) or (packed and n % 2) or d != D:
        rule = "an even 2I >= 2" if packed else "I >= 1"
        raise ValueError(f"{name} must be {layout} with E >= 1, {rule} and D = {x_name}.shape[-1] = {D}, "
                         f"got shape {tuple(w.shape)}")
    return E, n // 2 if packed else n


def _check_expert_down_and_biases(w3, transposed: bool, E: int, I: int, D: int, biases) -> None:
    down = (E, I, D) if transposed else (E, D, I)
    if tuple(w3.shape) != down:
        raise ValueError(f"w3 must have shape {down} = {'[E, I, D]' if transposed else '[E, D, I]'} "
                         f"(E = {E}, I = {I}, D = {D}), got {tuple(w3.shape)}")
    for name, b, shape in biases:
        if b is not None and tuple(b.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(b.shape)}")


def check_routing_weights(name: str, rw, shape: tuple, x: torch.Tensor) -> None:
    if rw is None:
        return
    check_tensor(name, rw, Role.INPUT)
    if tuple(rw.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(rw.shape)}")
    if rw.device != x.device:
        raise ValueError(f"{name} must be on the device of the inputs ({x.device}), got {rw.device}")


def check_offsets(offsets, E: int, S: int, device: torch.device) -> None:
    if not isinstance(offsets, torch.Tensor):
        raise TypeError(f"offsets must be a torch.Tensor, got {type(offsets).__name__}")
    if offsets.dtype != torch.int32:
        raise TypeError(f"offsets must be int32 (the cumulative group ends grouped_mm takes), got "
                        f"{offsets.dtype}; convert with offsets.to(torch.int32)")
    if tuple(offsets.shape) != (E,):
        raise ValueError(f"offsets must have shape ({E},) = (E,), one end per expert, got {tuple(offsets.shape)}")
    if offsets.device != device:
        raise ValueError(f"offsets must be on the device of x_sorted ({device}), got {offsets.device}")
    if torch.compiler.is_compiling():
        return  # traced data: the values cannot be read here
    ends = offsets.tolist()  # one device-to-host copy, here only (the op itself does not check)
    if any(b < a for a, b in zip([0, *ends], ends)):
        raise ValueError(f"offsets must be non-decreasing cumulative ends starting at >= 0, got {ends[:16]}")
    if ends[-1] != S:
        raise ValueError(f"offsets must end at x_sorted.shape[0] = {S} (every row belongs to an expert), "
                         f"got offsets[-1] = {ends[-1]}")


def check_expert_ids(name: str, ids: torch.Tensor, E: int, allow_sentinels: bool = False) -> None:
    """Integer ids in [0, E) (ids >= E allowed as sentinels); one host copy of min/max."""
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor of expert ids, got {ids.dtype}")
    if ids.numel() == 0 or torch.compiler.is_compiling():
        return  # nothing to check, or traced data whose values cannot be read here
    lo, hi = torch.aminmax(ids)
    lo, hi = int(lo), int(hi)
    if lo < 0 or (hi >= E and not allow_sentinels):
        bad = lo if lo < 0 else hi
        raise ValueError(f"{name} holds expert id {bad}, outside [0, {E}) (E = w12.shape[0] experts)")


# ---- the primitives' tensors ---------------------------------------------------------------

def check_x12(x12: torch.Tensor) -> int:
    if not isinstance(x12, torch.Tensor):
        raise TypeError(f"x12 must be a torch.Tensor, got {type(x12).__name__}")
    if x12.dim() != 2:
        raise ValueError(f"x12 must be 2-D [M, 2H], got shape {tuple(x12.shape)}")
    if x12.shape[1] % 2:
        raise ValueError(f"x12 must have an even number of columns [M, 2H], got {x12.shape[1]}")
    if x12.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"x12 dtype must be one of {SUPPORTED_DTYPES}, got {x12.dtype}")
    return x12.shape[1] // 2


def check_gate(gate: torch.Tensor) -> None:
    if not isinstance(gate, torch.Tensor):
        raise TypeError(f"gate must be a torch.Tensor, got {type(gate).__name__}")
    if gate.dim() != 2:
        raise ValueError(f"gate must be 2-D [M, H], got shape {tuple(gate.shape)}")
    if gate.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"gate dtype must be one of {SUPPORTED_DTYPES}, got {gate.dtype}")


def check_like(name: str, t: torch.Tensor, shape: tuple[int, int], ref: torch.Tensor,
                ref_name: str = "x12") -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.shape != shape:  # torch.Size compares with a tuple
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if t.dtype != ref.dtype:
        raise TypeError(f"{name} dtype must match {ref_name} ({ref.dtype}), got {t.dtype}")
    if t.device != ref.device:
        raise ValueError(f"{name} must be on {ref_name}'s device ({ref.device}), got {t.device}")
