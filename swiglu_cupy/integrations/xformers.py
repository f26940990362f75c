"""xformers integration: the fused op back inside xformers' own SwiGLU API.

    import xformers.ops as xops
    from swiglu_cupy.xformers import SwiGLUPackedFusedOp, patch_xformers

    patch_xformers(model)                                  # every xformers.ops.SwiGLU in model
    y = xops.swiglu(x, w1, b1, w2, b2, w3, b3, op=SwiGLUPackedFusedOp)

The op objects and their protocol: :mod:`swiglu_cupy.integrations.xformers_ops`.
``patch_xformers`` is :func:`swiglu_cupy.patch`'s walk narrowed to xformers' modules.
"""
from __future__ import annotations

import warnings

from torch import nn

from .._validation import check_flags
from .patching import walk
from .xformers_ops import SwiGLUFusedOp, SwiGLUPackedFusedOp, _xformers_swiglu_class, patch_xformers_module

__all__ = ["SwiGLUPackedFusedOp", "SwiGLUFusedOp", "patch_xformers", "patch_xformers_module"]


def patch_xformers(model: nn.Module, strict: bool = False) -> int:
    """Set ``.op`` on every ``xformers.ops.SwiGLU`` in ``model`` (the model
    itself included) and return how many were set: packed modules (the
    default) get :data:`SwiGLUPackedFusedOp`, ``_pack_weights=False`` ones
    :data:`SwiGLUFusedOp`. Weights, parameter names and state_dict stay
    xformers'. ``strict=True`` raises ``ValueError`` if there was none;
    otherwise, when ``model`` holds xformers ``SwiGLU`` modules but none could be
    patched (each lies inside a module the walk handles, e.g. as the
    projection of a GLU feed-forward), it warns, naming the first and why.

    The narrow entry for xformers modules; :func:`swiglu_cupy.patch` does
    this and fuses every other GLU feed-forward too (DINOv2's ``SwiGLUFFN``
    under ``XFORMERS_DISABLED=1``, timm, Hugging Face), with a report."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    check_flags(strict=strict)
    report = walk(model, {"xformers"})
    patched = len(report)
    if patched == 0 and report.unreached:
        path, why = next(iter(report.unreached.items()))
        message = (f"none of the {len(report.unreached)} xformers.ops.SwiGLU in {type(model).__name__} could "
                   f"be patched: the first, {path}, lies {why}, and the walk does not look inside a module it "
                   "handles. swiglu_cupy.patch(model) reports what it does with that module.")
        if strict:
            raise ValueError(f"patch_xformers(strict=True): {message}")
        warnings.warn(f"patch_xformers: {message}", UserWarning, stacklevel=2)
    elif strict and patched == 0:
        why = ("xformers is not imported, so the model holds no xformers.ops.SwiGLU"
               if _xformers_swiglu_class() is None else f"{type(model).__name__} contains no xformers.ops.SwiGLU")
        raise ValueError(f"patch_xformers(strict=True): nothing to patch: {why}. For any other GLU "
                         "feed-forward (DINOv2's SwiGLUFFN with XFORMERS_DISABLED=1, timm, Hugging Face) "
                         "use swiglu_cupy.patch(model), which reports what it found.")
    return patched
