"""Where each primitive call goes when no path was decided for the call (see
``dispatch``): eager calls straight to ``dispatch`` (the
kernels or the torch implementation), tracers (torch.compile / torch.export)
and torch.func to the registered ops (``ops``), ONNX export to aten math
(``torch_impl``). The Functions call these; the registered-ops module is
never on the eager path.

An interleaved x12 never takes h over itself (``forward_inplace`` then
returns a new h): independent threads cannot compact the pairs in place."""
from __future__ import annotations

import torch

from .._torch_compat import is_functorch_wrapped as _is_wrapped
from ..activations import SILU, GLUActivation
from . import dispatch, ops, torch_impl

__all__ = ["forward", "forward_inplace", "backward", "silu_mul_forward", "silu_mul_backward", "forward_fp8",
           "backward_fp8"]


def _route(*tensors: torch.Tensor) -> str:
    if torch.compiler.is_compiling():
        # ONNX has no operator for ours: hand it aten math it can translate.
        return "aten" if torch.onnx.is_in_onnx_export() else "op"
    for t in tensors:
        if _is_wrapped(t):
            return "op"
    return "eager"


def forward(x12: torch.Tensor, spec: GLUActivation = SILU) -> torch.Tensor:
    if not (torch.compiler.is_compiling() or _is_wrapped(x12)):  # eager: _route's answer, one frame less
        return dispatch.run_swiglu_forward(x12, activation=spec)
    route = _route(x12)
    if route == "aten":
        return torch_impl.swiglu_forward_torch(x12, None, spec)
    if route == "op":
        return ops.swiglu_forward_op(x12, *ops.spec_args(spec))
    return dispatch.run_swiglu_forward(x12, activation=spec)


def forward_inplace(x12: torch.Tensor, spec: GLUActivation = SILU) -> torch.Tensor:
    """h written over the gate half of x12; returns that strided [M, H] view
    (an interleaved x12: a new h, see the module docstring)."""
    if spec.interleaved:
        return forward(x12, spec)
    route = _route(x12)
    if route == "aten":
        return torch_impl.swiglu_forward_torch(x12, None, spec)  # functional: nothing to save there
    if route == "op":
        if torch.compiler.is_exporting():
            # An exported program must hold functional ops only: the mutating op would
            # be wrapped in auto_functionalized_v2, which neither ONNX nor
            # aten_decompositions() can translate. torch.compile keeps the in-place op
            # (Inductor re-inplaces it).
            return ops.swiglu_forward_op(x12, *ops.spec_args(spec))
        ops.swiglu_forward_inplace_op(x12, *ops.spec_args(spec))
        return dispatch.gate_half(x12)
    return dispatch.h_over_gate(x12, spec)


def backward(x12: torch.Tensor, dh: torch.Tensor, inplace: bool, spec: GLUActivation = SILU
             ) -> tuple[torch.Tensor, torch.Tensor]:
    if torch.compiler.is_compiling() or _is_wrapped(x12) or _is_wrapped(dh):
        route = _route(x12, dh)
    else:
        route = "eager"
    if route == "aten":
        return torch_impl.swiglu_backward_torch(x12, dh, activation=spec)
    if route == "op":
        if inplace:
            return x12, ops.swiglu_backward_inplace_op(x12, dh, *ops.spec_args(spec))
        return ops.swiglu_backward_op(x12, dh, *ops.spec_args(spec))
    if inplace:
        return x12, dispatch.run_swiglu_backward(x12, dh, x12, activation=spec)[1]
    return dispatch.run_swiglu_backward(x12, dh, activation=spec)


def silu_mul_forward(gate: torch.Tensor, up: torch.Tensor, spec: GLUActivation = SILU) -> torch.Tensor:
    route = _route(gate, up)
    if route == "aten":
        return torch_impl.silu_mul_forward_torch(gate, up, None, spec)
    if route == "op":
        return ops.silu_mul_forward_op(gate, up, *ops.spec_args(spec))
    return dispatch.run_silu_mul_forward(gate, up, activation=spec)


def silu_mul_backward(gate: torch.Tensor, up: torch.Tensor, dh: torch.Tensor, spec: GLUActivation = SILU
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    route = _route(gate, up, dh)
    if route == "aten":
        return torch_impl.silu_mul_backward_torch(gate, up, dh, activation=spec)
    if route == "op":
        return ops.silu_mul_backward_op(gate, up, dh, *ops.spec_args(spec))
    return dispatch.run_silu_mul_backward(gate, up, dh, activation=spec)


def forward_fp8(x12: torch.Tensor, spec: GLUActivation = SILU) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, the 8-bit saved x12): see ``saved_x12``."""
    route = _route(x12)
    if route == "op":
        return ops.swiglu_forward_fp8_op(x12, *ops.spec_args(spec))
    return dispatch.run_swiglu_forward_fp8(x12, "torch" if route == "aten" else None, None, spec)


def backward_fp8(saved: torch.Tensor, dh: torch.Tensor, spec: GLUActivation = SILU
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx12, h) from the 8-bit saved x12."""
    route = _route(saved, dh)
    if route == "op":
        return ops.swiglu_backward_fp8_op(saved, dh, *ops.spec_args(spec))
    return dispatch.run_swiglu_backward_fp8(saved, dh, "torch" if route == "aten" else None, None, spec)
