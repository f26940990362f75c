"""swiglu_cupy's op objects for xformers' SwiGLU API, and how the walk
recognises an ``xformers.ops.SwiGLU`` (the public face, with
``patch_xformers``: :mod:`swiglu_cupy.xformers`).

    import xformers.ops as xops
    from swiglu_cupy.xformers import SwiGLUPackedFusedOp, patch_xformers

    patch_xformers(model)                                  # every xformers.ops.SwiGLU in model
    y = xops.swiglu(x, w1, b1, w2, b2, w3, b3, op=SwiGLUPackedFusedOp)

The two op objects follow xformers' ``SwiGLUOp`` protocol (``NAME``,
``PACKED_WEIGHTS``, ``supports(SwiGLUOpDispatch)``, ``__call__``) by duck
typing: this module never imports xformers, so xformers stays optional and
``import swiglu_cupy`` does not pull it in.

- :data:`SwiGLUPackedFusedOp` is called by xformers as ``op(x, w1w2, b1b2,
  w3, b3)`` with ``w1w2 = w12.weight.view(2, H, D)``; it hands the same
  storage to :func:`swiglu_cupy.swiglu` as ``[2H, D]`` (a view, so the
  gradients reach ``w12.weight`` through xformers' own views).
- :data:`SwiGLUFusedOp` is called as ``op(x, w1, b1, w2, b2, w3, b3)`` and
  runs :func:`swiglu_cupy.swiglu_unpacked` (the two GEMMs write the halves of
  one buffer: the weights are never concatenated).
"""
from __future__ import annotations

import sys

import torch
from torch import nn

from .._dtypes import SUPPORTED_DTYPES
from ..dense.api import swiglu, swiglu_unpacked

__all__ = ["SwiGLUPackedFusedOp", "SwiGLUFusedOp", "is_xformers_swiglu", "patch_xformers_module"]


def _stacked_rows(t: torch.Tensor) -> torch.Tensor | None:
    """``[2, H, ...]`` as the ``[2H, ...]`` view over the same storage, or
    None when its strides allow no such view (the halves are not adjacent)."""
    if t.stride(0) != t.shape[1] * t.stride(1):
        return None
    return t.view(-1, *t.shape[2:])


def _check_stacked(name: str, t, dims: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != dims or t.shape[0] != 2:
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a {layout} tensor, got {got}")


def _fused_packed(x, w1w2, b1b2, w3, b3):
    _check_stacked("w1w2", w1w2, 3, "[2, H, D] (w12.weight.view(2, H, D))")
    if b1b2 is not None:
        _check_stacked("b1b2", b1b2, 2, "[2, H] (w12.bias.view(2, H)) or None")
    w12 = _stacked_rows(w1w2)
    b12 = None if b1b2 is None else _stacked_rows(b1b2)
    if w12 is None or (b1b2 is not None and b12 is None):
        # Packed in one storage but not as adjacent row blocks: the halves are
        # still views, and swiglu_unpacked copies no weight.
        b1, b2 = (None, None) if b1b2 is None else (b1b2[0], b1b2[1])
        return swiglu_unpacked(x, w1w2[0], b1, w1w2[1], b2, w3, b3)
    return swiglu(x, w12, b12, w3, b3)


class _FusedSwiGLUOp:
    """One of swiglu_cupy's op objects for xformers (see the module doc).
    Module-level singletons: pickling and deepcopy keep the same object, so a
    patched model can be copied and saved whole."""

    def __init__(self, name: str, packed_weights: bool, function, attr: str) -> None:
        self.NAME = name
        self.PACKED_WEIGHTS = packed_weights
        self._function = function
        self._attr = attr

    def supports(self, op) -> bool:
        """``op``: an ``xformers.ops.SwiGLUOpDispatch`` (or anything with its
        ``device``, ``dtype`` and ``packed_weights``). True for float16,
        bfloat16, float32 and float64 on any device that holds data (CUDA runs
        the kernels, other devices the torch primitives); the packed op also
        needs packed weights."""
        if self.PACKED_WEIGHTS and not op.packed_weights:
            return False
        if torch.device(op.device).type == "meta":
            return False
        return op.dtype in SUPPORTED_DTYPES

    def __call__(self, *args: torch.Tensor | None) -> torch.Tensor:
        return self._function(*args)

    def __reduce__(self) -> str:
        return self._attr  # pickle / deepcopy: the module-level object of that name

    def __str__(self) -> str:
        return f"SwiGLUOp:{self.NAME}"

    def __repr__(self) -> str:
        return f"swiglu_cupy.xformers.{self._attr}"


#: Packed-weights op: ``op(x, w1w2 [2, H, D], b1b2 [2, H] or None, w3, b3)``.
SwiGLUPackedFusedOp = _FusedSwiGLUOp("swiglu_cupy.fused.packed", True, _fused_packed, "SwiGLUPackedFusedOp")
#: Separate-weights op: ``op(x, w1, b1, w2, b2, w3, b3)``.
SwiGLUFusedOp = _FusedSwiGLUOp("swiglu_cupy.fused", False, swiglu_unpacked, "SwiGLUFusedOp")


def _xformers_swiglu_class():
    """``xformers.ops.SwiGLU`` if xformers is already imported, else None: a
    model cannot hold an instance of a class that was never imported, so
    there is no need to import xformers to look for one."""
    module = sys.modules.get("xformers.ops.swiglu_op")
    return getattr(module, "SwiGLU", None)


def is_xformers_swiglu(module: nn.Module) -> bool:
    swiglu_class = _xformers_swiglu_class()
    return swiglu_class is not None and isinstance(module, swiglu_class)


def patch_xformers_module(module: nn.Module) -> str | None:
    """If ``module`` is an ``xformers.ops.SwiGLU``, set its ``.op`` to ours
    and say which (the note :func:`swiglu_cupy.patch` reports); else None."""
    if not is_xformers_swiglu(module):
        return None
    op = SwiGLUPackedFusedOp if module.w12 is not None else SwiGLUFusedOp
    already = getattr(module, "op", None) is op
    module.op = op
    return f"xformers.ops.SwiGLU, op={op!r}" + (" (already fused)" if already else "")


