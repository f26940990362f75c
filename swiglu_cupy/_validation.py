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

from ._sources import SUPPORTED_DTYPES

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


def reject_jit() -> None:
    if torch.jit.is_tracing() or torch.jit.is_scripting():
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

def common_case(x, weights, biases) -> bool:
    """Plain dense tensors of one supported dtype and one device (not meta),
    contiguous weights: every per-tensor check holds, only shapes are left."""
    if type(x) not in _PLAIN_TENSORS or x.layout is not torch.strided:
        return False
    dtype, device = x.dtype, x.device
    if dtype not in SUPPORTED_DTYPES or device.type == "meta":
        return False
    try:  # non-strided layouts report non-contiguous (or raise)
        for w in weights:
            if type(w) not in _PLAIN_TENSORS or w.dtype is not dtype or w.device != device or not w.is_contiguous():
                return False
        for b in biases:
            if b is not None and (type(b) not in _PLAIN_TENSORS or b.dtype is not dtype or b.device != device
                                  or not b.is_contiguous()):
                return False
    except Exception:
        return False
    return True


def common_packed_case(x, w12, b12, w3, b3) -> bool:
    """``common_case`` and ``check_packed_shapes`` in one pass, for the hot
    packed call; False sends the call through both for the precise error."""
    if not common_case(x, (w12, w3), (b12, b3)):
        return False
    try:
        rows, D = w12.shape
        O, H = w3.shape
        return (x.shape[-1] == D and rows == 2 * H and H > 0
                and (b12 is None or b12.shape == (rows,)) and (b3 is None or b3.shape == (O,)))
    except (ValueError, IndexError):  # a rank other than 2, or a 0-d x
        return False
