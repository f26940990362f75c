"""The primitives as registered torch ops (``torch.ops.swiglu_cupy.*``), the
view that tracers and program transforms get of them.

Each op wraps one plain function below, so there is one implementation
(the primitives' ``run_*`` entry points: the arguments were validated once,
by the public API):
- eager calls use the plain function directly (the custom-op dispatcher
  costs ~13 us per call);
- torch.compile / torch.export trace the op: it stays in the graph as
  ``torch.ops.swiglu_cupy.*`` and runs our kernels (fake impls give shapes);
- torch.func (vmap, grad, jacrev) reaches the op whenever a tensor carries a
  transform: each op has a vmap rule that folds the batch into the rows (one
  launch), and the out-of-place ops have autograd formulas, so an exported
  program stays differentiable;
- ONNX export gets plain aten math (``torch_impl``), which maps to
  standard ONNX operators: traced directly (``torch.onnx.export(model)``), or
  through torch's decomposition table when an ``ExportedProgram`` is exported
  (``torch.onnx.export(ep)``); ``aten_decompositions()`` gives the same to any
  consumer of an ``ExportedProgram`` that needs aten ops only.
"""
from __future__ import annotations

import torch

from . import primitives
from ._torch_compat import is_functorch_wrapped as _is_wrapped
from ._torch_compat import register_global_decomposition
from .primitives import torch_impl


def is_transformed(t: torch.Tensor) -> bool:
    """True if ``t`` is wrapped by a torch.func transform (vmap/grad level).
    Tracers see through such wrappers (and cannot call this check)."""
    return not torch.compiler.is_compiling() and _is_wrapped(t)


def _gate_half(x12: torch.Tensor) -> torch.Tensor:
    return x12.chunk(2, 1)[0]


def _h_over_gate(x12: torch.Tensor) -> torch.Tensor:
    """h = silu(gate) * up written over the gate half of x12 (the silu_mul
    primitive on x12's two halves); returns that strided [M, H] view."""
    gate, up = x12.chunk(2, 1)  # one call for both views: slicing costs ~1.5 us each
    return primitives.run_silu_mul_forward(gate, up, gate)


# ---- plain bodies (one implementation each) -------------------------------------------------

def _swiglu_forward_body(x12: torch.Tensor) -> torch.Tensor:
    return primitives.run_swiglu_forward(x12)


def _swiglu_forward_inplace_body(x12: torch.Tensor) -> None:
    """Writes h over the gate half of x12 (no-grad path)."""
    _h_over_gate(x12)


def _swiglu_backward_body(x12: torch.Tensor, dh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return primitives.run_swiglu_backward(x12, dh)


def _swiglu_backward_inplace_body(x12: torch.Tensor, dh: torch.Tensor) -> torch.Tensor:
    """Writes dx12 over x12 and returns the recomputed h."""
    return primitives.run_swiglu_backward(x12, dh, x12)[1]


def _silu_mul_forward_body(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return primitives.run_silu_mul_forward(gate, up)


def _silu_mul_backward_body(gate: torch.Tensor, up: torch.Tensor, dh: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    return primitives.run_silu_mul_backward(gate, up, dh)


# ---- registration ---------------------------------------------------------------------------

def _op(name: str, fn, mutates=()):
    return torch.library.custom_op(f"swiglu_cupy::{name}", fn, mutates_args=mutates)


swiglu_forward_op = _op("swiglu_forward", _swiglu_forward_body)
swiglu_forward_inplace_op = _op("swiglu_forward_inplace", _swiglu_forward_inplace_body, ("x12",))
swiglu_backward_op = _op("swiglu_backward", _swiglu_backward_body)
swiglu_backward_inplace_op = _op("swiglu_backward_inplace", _swiglu_backward_inplace_body, ("x12",))
silu_mul_forward_op = _op("silu_mul_forward", _silu_mul_forward_body)
silu_mul_backward_op = _op("silu_mul_backward", _silu_mul_backward_body)


@swiglu_forward_op.register_fake
def _(x12):
    return x12.new_empty((x12.shape[0], x12.shape[1] // 2))


@swiglu_forward_inplace_op.register_fake
def _(x12):
    return None


@swiglu_backward_op.register_fake
def _(x12, dh):
    return torch.empty_like(x12, memory_format=torch.contiguous_format), dh.new_empty(dh.shape)


@swiglu_backward_inplace_op.register_fake
def _(x12, dh):
    return dh.new_empty(dh.shape)


@silu_mul_forward_op.register_fake
def _(gate, up):
    return gate.new_empty(gate.shape)


@silu_mul_backward_op.register_fake
def _(gate, up, dh):
    return gate.new_empty(gate.shape), gate.new_empty(gate.shape)


# Autograd formulas: used only where the ops are differentiated as ops (an
# exported program run with grad); SwiGLUFunction/SiluMulFunction own eager
# and compiled autograd.
def _save_inputs(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _swiglu_forward_grad(ctx, dh):
    (x12,) = ctx.saved_tensors
    return swiglu_backward_op(x12, dh)[0]


def _silu_mul_forward_grad(ctx, dh):
    gate, up = ctx.saved_tensors
    return silu_mul_backward_op(gate, up, dh)


swiglu_forward_op.register_autograd(_swiglu_forward_grad, setup_context=_save_inputs)
silu_mul_forward_op.register_autograd(_silu_mul_forward_grad, setup_context=_save_inputs)


def batch_first(info, t: torch.Tensor, dim) -> torch.Tensor:
    """``t`` with its vmap batch (at ``dim``, or none: then broadcast) as dim 0."""
    return t.expand(info.batch_size, *t.shape) if dim is None else t.movedim(dim, 0)


def _rows_with_batch(info, t: torch.Tensor, dim) -> torch.Tensor:
    """[M, C] with a vmap batch at ``dim`` (or none) -> [B * M, C], batch first."""
    return batch_first(info, t, dim).reshape(-1, t.shape[-1])


def _fold_rows(op, n_out: int):
    """vmap rule: fold the batch into the rows, one call of ``op``."""
    def rule(info, in_dims, *tensors):
        rows = [_rows_with_batch(info, t, d) for t, d in zip(tensors, in_dims)]
        out = op(*rows)
        if n_out == 1:
            return out.view(info.batch_size, -1, out.shape[-1]), 0
        return tuple(o.view(info.batch_size, -1, o.shape[-1]) for o in out), (0,) * n_out
    return rule


swiglu_forward_op.register_vmap(_fold_rows(swiglu_forward_op, 1))
swiglu_backward_op.register_vmap(_fold_rows(swiglu_backward_op, 2))
silu_mul_forward_op.register_vmap(_fold_rows(silu_mul_forward_op, 1))
silu_mul_backward_op.register_vmap(_fold_rows(silu_mul_backward_op, 2))


def _functional_aten() -> dict:
    """``{functional op: its torch implementation}`` (same math, same single rounding)."""
    ops = torch.ops.swiglu_cupy
    return {
        ops.swiglu_forward.default: torch_impl.swiglu_forward_torch,
        ops.swiglu_backward.default: torch_impl.swiglu_backward_torch,
        ops.silu_mul_forward.default: torch_impl.silu_mul_forward_torch,
        ops.silu_mul_backward.default: torch_impl.silu_mul_backward_torch,
    }


def aten_decompositions() -> dict:
    """``{op: aten implementation}`` for every op above, for
    ``ExportedProgram.run_decompositions(table)`` when a consumer needs plain
    aten ops (the torch implementation of the primitives: same math, same
    single rounding)."""
    ops = torch.ops.swiglu_cupy

    def forward_inplace(x12):
        _gate_half(x12).copy_(torch_impl.swiglu_forward_torch(x12))

    def backward_inplace(x12, dh):
        dx12, h = torch_impl.swiglu_backward_torch(x12, dh)
        x12.copy_(dx12)
        return h

    return {
        **_functional_aten(),
        ops.swiglu_forward_inplace.default: forward_inplace,
        ops.swiglu_backward_inplace.default: backward_inplace,
    }


# torch.onnx.export(exported_program) has no ONNX translation for our ops; it
# decomposes every op that torch's global decomposition table holds, so the
# functional ops are registered there (exported programs hold no in-place op:
# see forward_inplace). torch.export's default decompositions and Inductor's
# table are separate lists: they keep our ops (and our kernels).
for _overload, _aten in _functional_aten().items():
    register_global_decomposition(_overload, _aten)


# ---- dispatch: plain function, registered op, or aten math ----------------------------------

def _route(*tensors: torch.Tensor) -> str:
    if torch.compiler.is_compiling():
        # ONNX has no operator for ours: hand it aten math it can translate.
        return "aten" if torch.onnx.is_in_onnx_export() else "op"
    return "op" if any(_is_wrapped(t) for t in tensors) else "eager"


def forward(x12: torch.Tensor) -> torch.Tensor:
    route = _route(x12)
    if route == "aten":
        return torch_impl.swiglu_forward_torch(x12)
    return (swiglu_forward_op if route == "op" else _swiglu_forward_body)(x12)


def forward_inplace(x12: torch.Tensor) -> torch.Tensor:
    """h written over the gate half of x12; returns that strided [M, H] view."""
    route = _route(x12)
    if route == "aten":
        return torch_impl.swiglu_forward_torch(x12)  # functional: nothing to save there
    if route == "op":
        if torch.compiler.is_exporting():
            # An exported program must hold functional ops only: the mutating op would
            # be wrapped in auto_functionalized_v2, which neither ONNX nor
            # aten_decompositions() can translate. torch.compile keeps the in-place op
            # (Inductor re-inplaces it).
            return swiglu_forward_op(x12)
        swiglu_forward_inplace_op(x12)
        return _gate_half(x12)
    return _h_over_gate(x12)


def backward(x12: torch.Tensor, dh: torch.Tensor, inplace: bool) -> tuple[torch.Tensor, torch.Tensor]:
    route = _route(x12, dh)
    if route == "aten":
        return torch_impl.swiglu_backward_torch(x12, dh)
    use_op = route == "op"
    if inplace:
        return x12, (swiglu_backward_inplace_op if use_op else _swiglu_backward_inplace_body)(x12, dh)
    return (swiglu_backward_op if use_op else _swiglu_backward_body)(x12, dh)


def silu_mul_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    route = _route(gate, up)
    if route == "aten":
        return torch_impl.silu_mul_forward_torch(gate, up)
    return (silu_mul_forward_op if route == "op" else _silu_mul_forward_body)(gate, up)


def silu_mul_backward(gate: torch.Tensor, up: torch.Tensor, dh: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    route = _route(gate, up, dh)
    if route == "aten":
        return torch_impl.silu_mul_backward_torch(gate, up, dh)
    return (silu_mul_backward_op if route == "op" else _silu_mul_backward_body)(gate, up, dh)
