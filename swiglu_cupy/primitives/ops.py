"""The primitives as registered torch ops (``torch.ops.swiglu_cupy.*``), the
view that tracers and program transforms get of them.

Each op wraps one plain function below, so there is one implementation
(the primitives' ``run_*`` entry points: the arguments were validated once,
by the public API):
- eager calls never come here: ``dispatch`` runs them directly
  (the custom-op dispatcher costs ~13 us per call);
- torch.compile / torch.export trace the op: it stays in the graph as
  ``torch.ops.swiglu_cupy.*`` and runs our kernels (fake impls give shapes);
- torch.func (vmap, grad, jacrev) reaches the op whenever a tensor carries a
  transform: each op has a vmap rule that folds the batch into the rows (one
  launch), and the out-of-place ops have autograd formulas, so an exported
  program stays differentiable;
- ONNX export gets plain aten math (``torch_impl``), which maps to
  standard ONNX operators: traced directly (``torch.onnx.export(model)``);
  ``aten_decompositions()`` gives the same to any consumer of an
  ``ExportedProgram`` that needs aten ops only (``torch.onnx.export(ep)``
  after ``ep.run_decompositions(aten_decompositions())``). They are not put
  in torch's global decomposition table: Inductor then makes our ops
  fallbacks with a decomposition, which it refuses when the ``CI``
  environment variable is set (as on GitHub Actions: "a decomposition
  exists, we should switch to it"), and torch 2.11 refuses it once an op
  gained one after becoming a fallback.

The GLU variant travels as five plain op arguments (``kind: str``,
``limit: float?``, ``alpha: float``, ``up_offset: float``, ``interleaved:
bool``; ``spec_args``), so a traced or exported graph records it as
constants; ``route`` takes the ``GLUActivation`` itself.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from ..activations import GLUActivation
from . import dispatch, saved_x12, torch_impl
from .dispatch import batch_first, gate_half, h_over_gate

__all__ = ["aten_decompositions", "spec_args", "swiglu_forward_op", "swiglu_forward_inplace_op", "swiglu_backward_op",
           "swiglu_backward_inplace_op", "silu_mul_forward_op", "silu_mul_backward_op", "swiglu_forward_fp8_op",
           "swiglu_backward_fp8_op"]


def spec_args(spec: GLUActivation) -> tuple:
    """The spec as the ops' trailing arguments."""
    return spec.kind, spec.limit, spec.alpha, spec.up_offset, spec.interleaved


@functools.lru_cache(maxsize=256)
def _spec(kind: str = "silu", limit: Optional[float] = None, alpha: float = 1.0, up_offset: float = 0.0,
          interleaved: bool = False) -> GLUActivation:
    """The spec from the ops' arguments (a graph may omit those left at SwiGLU's defaults)."""
    return GLUActivation(kind, limit, alpha, up_offset, interleaved)


# ---- plain bodies (one implementation each) -------------------------------------------------
# Each takes the tensors, then the spec's five arguments (see spec_args),
# which default to SwiGLU's.

def _swiglu_forward_body(x12: torch.Tensor, kind: str = "silu", limit: Optional[float] = None,
                         alpha: float = 1.0, up_offset: float = 0.0, interleaved: bool = False
                         ) -> torch.Tensor:
    return dispatch.run_swiglu_forward(x12, activation=_spec(kind, limit, alpha, up_offset, interleaved))


def _swiglu_forward_inplace_body(x12: torch.Tensor, kind: str = "silu", limit: Optional[float] = None,
                                 alpha: float = 1.0, up_offset: float = 0.0, interleaved: bool = False
                                 ) -> None:
    """Writes h over the gate half of x12 (no-grad path; halves layout only)."""
    h_over_gate(x12, _spec(kind, limit, alpha, up_offset, interleaved))


def _swiglu_backward_body(x12: torch.Tensor, dh: torch.Tensor, kind: str = "silu",
                          limit: Optional[float] = None, alpha: float = 1.0, up_offset: float = 0.0,
                          interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    return dispatch.run_swiglu_backward(x12, dh, activation=_spec(kind, limit, alpha, up_offset, interleaved))


def _swiglu_backward_inplace_body(x12: torch.Tensor, dh: torch.Tensor, kind: str = "silu",
                                  limit: Optional[float] = None, alpha: float = 1.0, up_offset: float = 0.0,
                                  interleaved: bool = False) -> torch.Tensor:
    """Writes dx12 over x12 and returns the recomputed h."""
    spec = _spec(kind, limit, alpha, up_offset, interleaved)
    return dispatch.run_swiglu_backward(x12, dh, x12, activation=spec)[1]


def _silu_mul_forward_body(gate: torch.Tensor, up: torch.Tensor, kind: str = "silu",
                           limit: Optional[float] = None, alpha: float = 1.0, up_offset: float = 0.0,
                           interleaved: bool = False) -> torch.Tensor:
    return dispatch.run_silu_mul_forward(gate, up, activation=_spec(kind, limit, alpha, up_offset, interleaved))


def _silu_mul_backward_body(gate: torch.Tensor, up: torch.Tensor, dh: torch.Tensor, kind: str = "silu",
                            limit: Optional[float] = None, alpha: float = 1.0, up_offset: float = 0.0,
                            interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    spec = _spec(kind, limit, alpha, up_offset, interleaved)
    return dispatch.run_silu_mul_backward(gate, up, dh, activation=spec)


def _swiglu_forward_fp8_body(x12: torch.Tensor, kind: str = "silu", limit: Optional[float] = None,
                             alpha: float = 1.0, up_offset: float = 0.0, interleaved: bool = False
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, the 8-bit saved x12) (``saved_x12``)."""
    return dispatch.run_swiglu_forward_fp8(x12, activation=_spec(kind, limit, alpha, up_offset, interleaved))


def _swiglu_backward_fp8_body(saved: torch.Tensor, dh: torch.Tensor, kind: str = "silu",
                              limit: Optional[float] = None, alpha: float = 1.0, up_offset: float = 0.0,
                              interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx12, h) in dh's dtype from the 8-bit saved x12."""
    return dispatch.run_swiglu_backward_fp8(saved, dh, activation=_spec(kind, limit, alpha, up_offset, interleaved))


# ---- registration ---------------------------------------------------------------------------

def _op(name: str, fn, mutates=()):
    return torch.library.custom_op(f"swiglu_cupy::{name}", fn, mutates_args=mutates)


swiglu_forward_op = _op("swiglu_forward", _swiglu_forward_body)
swiglu_forward_inplace_op = _op("swiglu_forward_inplace", _swiglu_forward_inplace_body, ("x12",))
swiglu_backward_op = _op("swiglu_backward", _swiglu_backward_body)
swiglu_backward_inplace_op = _op("swiglu_backward_inplace", _swiglu_backward_inplace_body, ("x12",))
silu_mul_forward_op = _op("silu_mul_forward", _silu_mul_forward_body)
silu_mul_backward_op = _op("silu_mul_backward", _silu_mul_backward_body)
swiglu_forward_fp8_op = _op("swiglu_forward_fp8", _swiglu_forward_fp8_body)
swiglu_backward_fp8_op = _op("swiglu_backward_fp8", _swiglu_backward_fp8_body)


@swiglu_forward_op.register_fake
def _(x12, *spec):
    return x12.new_empty((x12.shape[0], x12.shape[1] // 2))


@swiglu_forward_inplace_op.register_fake
def _(x12, *spec):
    return None


@swiglu_backward_op.register_fake
def _(x12, dh, *spec):
    return torch.empty_like(x12, memory_format=torch.contiguous_format), dh.new_empty(dh.shape)


@swiglu_backward_inplace_op.register_fake
def _(x12, dh, *spec):
    return dh.new_empty(dh.shape)


@silu_mul_forward_op.register_fake
def _(gate, up, *spec):
    return gate.new_empty(gate.shape)


@silu_mul_backward_op.register_fake
def _(gate, up, dh, *spec):
    return gate.new_empty(gate.shape), gate.new_empty(gate.shape)


@swiglu_forward_fp8_op.register_fake
def _(x12, kind="silu", limit=None, alpha=1.0, up_offset=0.0, interleaved=False):
    H = x12.shape[1] // 2
    return (x12.new_empty((x12.shape[0], H)),
            x12.new_empty((x12.shape[0], saved_x12.saved_row_bytes(H, interleaved)), dtype=torch.uint8))


@swiglu_backward_fp8_op.register_fake
def _(saved, dh, *spec):
    return dh.new_empty((dh.shape[0], 2 * dh.shape[1])), dh.new_empty(dh.shape)


# Autograd formulas: used only where the ops are differentiated as ops (an
# exported program run with grad); SwiGLUFunction/SiluMulFunction own eager
# and compiled autograd.
_NO_SPEC_GRADS = (None,) * 5


def _save_tensors_and_spec(n_tensors: int):
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:n_tensors])
        ctx.spec = inputs[n_tensors:]
    return setup_context


def _swiglu_forward_grad(ctx, dh):
    (x12,) = ctx.saved_tensors
    return swiglu_backward_op(x12, dh, *ctx.spec)[0], *_NO_SPEC_GRADS


def _silu_mul_forward_grad(ctx, dh):
    gate, up = ctx.saved_tensors
    return *silu_mul_backward_op(gate, up, dh, *ctx.spec), *_NO_SPEC_GRADS


swiglu_forward_op.register_autograd(_swiglu_forward_grad, setup_context=_save_tensors_and_spec(1))
silu_mul_forward_op.register_autograd(_silu_mul_forward_grad, setup_context=_save_tensors_and_spec(2))


def _rows_with_batch(info, t: torch.Tensor, dim) -> torch.Tensor:
    """[M, C] with a vmap batch at ``dim`` (or none) -> [B * M, C], batch first."""
    return batch_first(info, t, dim).reshape(-1, t.shape[-1])


def _fold_rows(op, n_tensors: int, n_out: int):
    """vmap rule: fold the batch into the rows, one call of ``op`` (the
    spec arguments after the ``n_tensors`` tensors pass through)."""
    def rule(info, in_dims, *args):
        rows = [_rows_with_batch(info, t, d) for t, d in zip(args[:n_tensors], in_dims)]
        out = op(*rows, *args[n_tensors:])
        if n_out == 1:
            return out.view(info.batch_size, -1, out.shape[-1]), 0
        return tuple(o.view(info.batch_size, -1, o.shape[-1]) for o in out), (0,) * n_out
    return rule


swiglu_forward_op.register_vmap(_fold_rows(swiglu_forward_op, 1, 1))
swiglu_backward_op.register_vmap(_fold_rows(swiglu_backward_op, 2, 2))
silu_mul_forward_op.register_vmap(_fold_rows(silu_mul_forward_op, 2, 1))
silu_mul_backward_op.register_vmap(_fold_rows(silu_mul_backward_op, 3, 2))
swiglu_forward_fp8_op.register_vmap(_fold_rows(swiglu_forward_fp8_op, 1, 2))
swiglu_backward_fp8_op.register_vmap(_fold_rows(swiglu_backward_fp8_op, 2, 2))


# The torch implementation of each op, taking the op's spec arguments (same
# math, same single rounding, for every GLU variant).

def _forward_aten(x12, *spec, **named):
    return torch_impl.swiglu_forward_torch(x12, None, _spec(*spec, **named))


def _forward_inplace_aten(x12, *spec, **named):
    gate_half(x12).copy_(_forward_aten(x12, *spec, **named))


def _backward_aten(x12, dh, *spec, **named):
    return torch_impl.swiglu_backward_torch(x12, dh, activation=_spec(*spec, **named))


def _backward_inplace_aten(x12, dh, *spec, **named):
    dx12, h = _backward_aten(x12, dh, *spec, **named)
    x12.copy_(dx12)
    return h


def _silu_mul_forward_aten(gate, up, *spec, **named):
    return torch_impl.silu_mul_forward_torch(gate, up, None, _spec(*spec, **named))


def _silu_mul_backward_aten(gate, up, dh, *spec, **named):
    return torch_impl.silu_mul_backward_torch(gate, up, dh, activation=_spec(*spec, **named))


def _forward_fp8_aten(x12, *spec, **named):
    return dispatch.run_swiglu_forward_fp8(x12, "torch", None, _spec(*spec, **named))


def _backward_fp8_aten(saved, dh, *spec, **named):
    return dispatch.run_swiglu_backward_fp8(saved, dh, "torch", None, _spec(*spec, **named))


def _functional_aten() -> dict:
    """``{functional op: its torch implementation}``."""
    ops = torch.ops.swiglu_cupy
    return {
        ops.swiglu_forward.default: _forward_aten,
        ops.swiglu_backward.default: _backward_aten,
        ops.silu_mul_forward.default: _silu_mul_forward_aten,
        ops.silu_mul_backward.default: _silu_mul_backward_aten,
        ops.swiglu_forward_fp8.default: _forward_fp8_aten,
        ops.swiglu_backward_fp8.default: _backward_fp8_aten,
    }


def aten_decompositions() -> dict:
    """``{op: aten implementation}`` for every op above, for
    ``ExportedProgram.run_decompositions(table)`` when a consumer needs plain
    aten ops (the torch implementation of the primitives: same math, same
    single rounding, for every GLU variant)."""
    ops = torch.ops.swiglu_cupy
    return {
        **_functional_aten(),
        ops.swiglu_forward_inplace.default: _forward_inplace_aten,
        ops.swiglu_backward_inplace.default: _backward_inplace_aten,
    }
