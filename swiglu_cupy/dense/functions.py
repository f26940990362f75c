"""Layer 2: the autograd Functions (GEMMs plus the primitives), apply-only.

Weight layout (xformers' packed ``w12``, Phi-3's ``gate_up_proj``):
    x   [..., D]
    w12 [2H, D]   rows 0..H-1 = gate (w1), rows H..2H-1 = up (w2)
    b12 [2H] or None
    w3  [O, H]    down projection
    b3  [O] or None
    y = (silu(x @ w1.T + b1) * (x @ w2.T + b2)) @ w3.T + b3
The GLU variant (``activation``, a ``GLUActivation``) replaces silu, adds
its clamps, and with ``interleaved`` the rows of w12 (and columns of x12)
alternate gate/up: ``[g0, u0, g1, u1, ...]``.

``SwiGLUFunction`` is only ever called through ``.apply()``: its forward
always saves the same tensors (x, w12, w3 and x12, or gate and up apart;
never h), whatever requires grad, so activation checkpointing in both modes
sees identical forwards (the bug that broke xformers' fused op). The arguments were
validated once by the public API (``api.py``); nothing here checks them.
"""
from __future__ import annotations

import math
import threading
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .._autograd import LeanApplyFunction, first_order_backward, mark_saved_only
from .._dtypes import FULL_PRECISION_DTYPES
from .._torch_compat import SAVE_IS_TO_SAVE, is_functorch_wrapped, is_transformed
from ..activations import SILU, GLUActivation
from ..primitives import dispatch, route
from ..primitives.dispatch import batch_first
from . import gemm as _gemm
from . import tiled_passes

__all__ = ["SwiGLUFunction", "SiluMulFunction", "SwiGLUOptions"]


class SwiGLUOptions(NamedTuple):
    """The settings of a ``SwiGLUFunction`` call that are not tensors, decided
    once by the API and handed down whole (checked there, not here):
    ``activation`` (a ``GLUActivation``), the memory modes
    ``recompute_gate_up``, ``inplace_backward`` and ``saved_x12_fp8`` (x12
    saved in 8 bits; exclusive with the other two), and
    ``tile_grads_fp32`` (the tiled path's weight-gradient accumulation), and
    ``path``: the call's kernels-or-torch decision (``primitives.dispatch``,
    made by the API per call; None: decided per primitive, as under a
    tracer or torch.func). Immutable; a named tuple rather than a dataclass because torch.compile
    builds named tuples inside a trace on every supported torch (2.11's
    Dynamo cannot build a dataclass holding a ``GLUActivation`` there)."""
    activation: GLUActivation = SILU
    recompute_gate_up: bool = False
    inplace_backward: bool = False
    saved_x12_fp8: bool = False
    tile_grads_fp32: bool = True
    path: object = None


class SwiGLUFunction(LeanApplyFunction):
    """Fused SwiGLU: 3 GEMMs forward; backward 4 GEMMs with packed weights
    (5 with separate gate/up weights: dx takes one per half) + one
    elementwise pass.

    ``apply(x, w1, b1, w2, b2, w3, b3, options, inference, tile_rows) -> (y, x12)``
    (all ten positional and required; ``swiglu`` and ``swiglu_unpacked`` are the public entry points
    and return ``y``). With ``options.path`` set (the API's eager calls) it returns ``y`` alone
    and saves x12 (or, separate weights, gate and up: :func:`swiglu_forward_pass`) without
    returning it:
    - packed weights: ``w2 = b2 = None`` and ``w1``/``b1`` are ``w12 [2H, D]``
      and ``b12 [2H]``; separate weights: ``w1``, ``w2`` are ``[H, D]``.
    - ``options``: a :class:`SwiGLUOptions`, the call's settings, decided once
      by the API (the fields below):
    - ``activation``: a ``GLUActivation`` (``swiglu_cupy.activations.SILU``
      for SwiGLU); separate weights take halves-layout specs only.
    - ``recompute_gate_up``: save only x and recompute x12 in backward (one
      extra GEMM, D instead of D + 2H saved elements per token).
    - ``inplace_backward``: write dx12 over the saved x12 (one [M, 2H] buffer
      less); the graph can then be backpropagated only once.
    - ``saved_x12_fp8``: save x12 as the 8-bit tensor of
      ``primitives.saved_x12`` (float8 e4m3fn with a float32 scale per 128
      columns; the second output is then that uint8 tensor), written by the
      forward's elementwise pass and read by the backward's; exclusive with
      the two modes above (the API refuses the combinations).
    - ``tile_rows``: 0 (untiled), or rows per tile (``dense.tiled_passes``,
      more rows than one tile): the forward and the backward run tile by
      tile, nothing of ``tokens x H`` elements exists, and only x (with fp8:
      the tiles' 8-bit x12) is saved; ``tile_grads_fp32`` accumulates the 16-bit
      weights' gradients across tiles in float32. The second output is then
      empty (or the 8-bit x12).
    - ``inference``: pass ``not torch.is_grad_enabled()`` (``swiglu`` does).
      Then h is written over the gate half of x12 and the down projection
      reads that strided view: nothing is allocated besides x12 and y.
    The second output ``x12`` is returned only so that ``setup_context`` can
    save it (torch.func requires saved tensors to be inputs or outputs); it is
    non-differentiable and its content is unspecified after ``inference``.
    The eager form has no such output: each extra output costs torch's apply
    ~2 us per call, and eager saving takes any tensor.
    """

    @staticmethod
    def forward(x, w1, b1, w2, b2, w3, b3, options, inference, tile_rows):
        path = options.path  # decided by the API for this call: eager, so out= buffers are fine
        outputs = swiglu_forward_pass(x, w1, b1, w2, b2, w3, b3, options.activation, inference,
                                      path is None and _gemm.functional(x), options.saved_x12_fp8, tile_rows, path,
                                      options.inplace_backward)
        if path is None:
            return outputs  # traced or transformed: what is saved must be an output
        _eager_saved.tensors = outputs[1:]  # eager: y alone is returned, setup_context saves these
        return outputs[0]

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, w1, b1, w2, b2, w3, b3, options, inference, tile_rows = inputs
        if options.path is None:
            saved = output[1:]
            mark_saved_only(ctx, *saved)
        else:  # handed over by this thread's forward, just before
            saved, _eager_saved.tensors = _eager_saved.tensors, None
        if inference:
            return  # no graph is recorded under no_grad, so nothing can be saved
        ctx.options, ctx.tile_rows = options, tile_rows
        if tile_rows:  # x, the weights and the tiles' 8-bit x12 (empty: recomputed per tile)
            ctx.save_for_backward(x, w1, b1, w2, b2, w3, saved[0])
        elif options.recompute_gate_up:
            ctx.save_for_backward(x, w1, b1, w2, b2, w3)
        elif SAVE_IS_TO_SAVE and options.path is not None:
            # save_for_backward's own body, inline, eager only (a frame less; Dynamo models the method)
            ctx.to_save = (x, w1, w2, w3, *saved)  # x12, or gate and up apart (``swiglu_forward_pass``)
        else:
            ctx.save_for_backward(x, w1, w2, w3, *saved)
        if options.inplace_backward:
            ctx.backward_done = False

    @staticmethod
    @first_order_backward
    def backward(ctx, dy, *_saved_only_grads):
        if dy is None:  # y's gradient is undefined (grads are not materialised): nothing flows back
            return (None,) * 10
        options = ctx.options
        if options.inplace_backward:
            if ctx.backward_done and not ctx.tile_rows:
                raise RuntimeError(
                    "swiglu_cupy: this graph was built with inplace_backward=True, whose first "
                    "backward overwrote the saved x12; a second backward (retain_graph=True) "
                    "cannot run. Use inplace_backward=False to backpropagate more than once.")
            ctx.backward_done = True
        activation = options.activation
        if ctx.tile_rows:
            x, w1, b1, w2, b2, w3, saved = ctx.saved_tensors
            grads = tiled_passes.tiled_backward(dy.reshape(-1, w3.shape[0]), x.reshape(-1, x.shape[-1]), w1, b1,
                                                w2, b2, w3, saved, activation, ctx.tile_rows,
                                                ctx.needs_input_grad[:7], options.tile_grads_fp32, x.shape)
            return (*grads,) + (None,) * 3
        if options.recompute_gate_up:
            x, w1, b1, w2, b2, w3 = ctx.saved_tensors
            x2d = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
            x12 = _gemm.gate_up(x2d, w1, b1, w2, b2, _gemm.functional(x2d))  # extra GEMM
        else:
            x, w1, w2, w3, *saved = ctx.saved_tensors
            x2d = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
            x12 = saved[0] if len(saved) == 1 else None  # else gate and up apart
        need_x, need_w1, need_b1, need_w2, need_b2, need_w3, need_b3 = ctx.needs_input_grad[:7]
        dy2d = dy if dy.dim() == 2 else dy.reshape(-1, w3.shape[0])
        dh = torch.mm(dy2d, w3)                                            # GEMM 1
        # Decided once for this backward (None: traced or transformed, route decides per primitive;
        # also for an x12 left wrapped by a transform).
        path = dispatch.eager_path(dh, activation)
        if path is not None and x12 is not None and is_functorch_wrapped(x12):
            path = None
        if x12 is None and (path is None or not path.halves_apart):
            x12 = torch.cat(saved, dim=1)  # backward runs where the forward's kernels do not: one x12
        if x12 is None:
            dx12, h = path.backward_halves(*saved, dh)
        elif options.saved_x12_fp8:  # x12 is the 8-bit saved tensor: dequantized in the same pass
            dx12, h = (route.backward_fp8(x12, dh, activation) if path is None
                       else path.backward_fp8(x12, dh))
        else:
            # In-place reuse is always safe for the recomputed x12 (nobody else
            # holds it), but not under torch.func, where dh may carry a vmap batch.
            inplace = (options.inplace_backward or options.recompute_gate_up) and (
                path is not None or not is_transformed(dh))
            dx12, h = (route.backward(x12, dh, inplace, activation) if path is None  # one fused pass
                       else path.backward(x12, dh, inplace))
        dx = dw1 = db1 = dw2 = db2 = dw3 = db3 = None
        # Separate weights: dgate and dup, the halves of dx12, viewed once for every GEMM below
        # (.T and chunk: one cheap call each; .t() and each slice cost the argument parser ~1 us).
        dgate, dup = (None, None) if w2 is None else dx12.chunk(2, 1)
        if need_x:  # a 2-D x (16-bit separate weights aside): the GEMMs themselves, as ``gemm`` would run them
            if x.dim() != 2 or (w2 is not None and dx12.dtype not in FULL_PRECISION_DTYPES):
                dx = _gemm.input_grad(dx12, w1, w2, x.shape)              # GEMM 2 (one: see input_grad_weights)
            else:
                dx = torch.mm(dx12, w1) if w2 is None else torch.mm(dgate, w1).addmm_(dup, w2)  # GEMM 2 (and 3)
        if need_w1 or need_w2:
            if w2 is None:
                dw1 = torch.mm(dx12.T, x2d)                                # GEMM
            else:  # each half's own GEMM: its gradient is a tensor of its own, not a view of both
                dw1 = torch.mm(dgate.T, x2d) if need_w1 else None
                dw2 = torch.mm(dup.T, x2d) if need_w2 else None
        if need_b1 or need_b2:
            db12 = dx12.sum(0)
            db1, db2 = (db12, None) if w2 is None else db12.chunk(2)
        if need_w3:
            dw3 = torch.mm(dy2d.T, h)                                      # GEMM
        if need_b3:
            db3 = dy2d.sum(0)
        return dx, dw1, db1, dw2, db2, dw3, db3, None, None, None

    @staticmethod
    def vmap(info, in_dims, x, w1, b1, w2, b2, w3, b3, options, inference, tile_rows):
        # in_dims[:7]: the tensors' (the options, a named tuple, has one per field, all None).
        return _swiglu_vmap_rule(info, in_dims[:7], (x, w1, b1, w2, b2, w3, b3), (options, inference, tile_rows))


#: The eager forward's tensors to save, handed to ``setup_context``: torch's apply calls
#: the two back to back on one thread, so one slot per thread holds them in between. A
#: second output would carry them instead, at ~2 us more per call (torch.func needs that
#: form: saved tensors must be inputs or outputs there, so the traced and transformed
#: forward returns them).
_eager_saved = threading.local()


def swiglu_forward_pass(x, w1, b1, w2, b2, w3, b3, activation, inference: bool, is_functional: bool,
                        saved_x12_fp8: bool = False, tile_rows: int = 0, path=None, x12_buffer: bool = False):
    """The forward's computation: (y, x12), or (y, the 8-bit saved x12) with
    ``saved_x12_fp8`` (not under ``inference``). With separate weights on the
    kernels' decided ``path`` (``halves_apart``), gate and up stay their
    GEMMs' own outputs (no x12 buffer to allocate and split): (y, gate, up),
    or under ``inference`` (y, h) with h written over gate; ``x12_buffer``
    keeps them in one x12 (``inplace_backward`` writes dx12 over it).
    ``inference`` comes from the caller's grad mode (forward itself runs without grad), never from
    requires_grad: checkpoint recomputes, which run with grad enabled, always
    take the saving path. The API calls this directly under no_grad (no
    graph, so the Function has no job there). ``path``: the call's decided
    kernels-or-torch path (``dispatch.eager_path``), or None: ``route``
    decides per primitive."""
    flat = x.dim() == 2
    if tile_rows:  # rows per tile, more rows than one tile (dense.tiled_passes)
        return tiled_passes.tiled_forward(x if flat else x.reshape(-1, x.shape[-1]), w1, b1, w2, b2, w3, b3,
                                          activation, tile_rows, inference, is_functional, saved_x12_fp8,
                                          None if flat else (*x.shape[:-1], w3.shape[0]))
    x2d = x if flat else x.reshape(-1, x.shape[-1])
    lead = None if flat else x.shape[:-1]  # x's leading dims (y's, with w3's rows)
    if w2 is not None and path is not None and path.halves_apart and (
            inference or not (saved_x12_fp8 or x12_buffer)):
        # The GEMMs themselves, as ``gemm`` would run them (a Python frame less each on every call):
        # gate and up, and a 2-D x's down projection.
        gate, up = F.linear(x2d, w1, b1), F.linear(x2d, w2, b2)
        h = path.forward_over_gate(gate, up) if inference else path.forward_halves(gate, up)
        y = F.linear(h, w3, b3) if flat else _gemm.down(h, w3, b3, lead, is_functional)
        return (y, h) if inference else (y, gate, up)
    # Packed weights' x12, and a 2-D x's down projection: the GEMMs themselves, as above.
    x12 = F.linear(x2d, w1, b1) if w2 is None else _gemm.gate_up(x2d, w1, b1, w2, b2, is_functional)
    # No path object is made under a tracer (path None): Dynamo would have to build it.
    if inference:
        h = route.forward_inplace(x12, activation) if path is None else path.forward_inplace(x12)
    elif saved_x12_fp8:  # h and the 8-bit x12 in one pass; x12 itself is dropped
        h, x12 = route.forward_fp8(x12, activation) if path is None else path.forward_fp8(x12)
    else:
        h = route.forward(x12, activation) if path is None else path.forward(x12)
    return F.linear(h, w3, b3) if flat else _gemm.down(h, w3, b3, lead, is_functional), x12


def _swiglu_vmap_rule(info, in_dims, tensors, modes):
    """torch.func.vmap of SwiGLUFunction. A batch of inputs with shared
    weights folds into the token rows: one call, one launch per kernel. Batched
    weights (ensembles) run one call per member (the documented slower path)."""
    x, *weights = tensors
    x_dim, *weight_dims = in_dims
    if all(d is None for d in weight_dims):
        y, x12 = SwiGLUFunction.apply(batch_first(info, x, x_dim), *weights, *modes)
        return (y, x12.view(info.batch_size, x12.shape[0] // info.batch_size, x12.shape[-1])), (0, 0)
    members = []
    for i in range(info.batch_size):
        pick = lambda t, d: t if t is None or d is None else t.select(d, i)  # noqa: E731
        members.append(SwiGLUFunction.apply(*(pick(t, d) for t, d in zip(tensors, in_dims)), *modes))
    return tuple(torch.stack(outs) for outs in zip(*members)), (0, 0)


class SiluMulFunction(LeanApplyFunction):
    """``h = act(gate) * up`` (silu for SwiGLU) for two tensors of one shape
    ``[..., H]``: one fused kernel each way (fp32 math, one rounding). Saves
    its two inputs only, whatever requires grad. Apply-only, like
    SwiGLUFunction: ``apply(gate, up, activation)`` with a halves-layout
    ``GLUActivation``."""

    @staticmethod
    def forward(gate, up, activation):
        return route.silu_mul_forward(_rows(gate), _rows(up), activation).view(gate.shape)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:2])
        ctx.activation = inputs[2]

    @staticmethod
    @first_order_backward
    def backward(ctx, dh):
        gate, up = ctx.saved_tensors
        dgate, dup = route.silu_mul_backward(_rows(gate), _rows(up), _rows(dh), ctx.activation)
        return dgate.view(gate.shape), dup.view(up.shape), None

    @staticmethod
    def vmap(info, in_dims, gate, up, activation):
        # Elementwise: give both the batch dim in front; the rows fold into one launch.
        batched = [batch_first(info, t, d) for t, d in zip((gate, up), in_dims)]
        return SiluMulFunction.apply(*batched, activation), 0


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., H] -> [M, H] (a view where possible; explicit M keeps H = 0 or M = 0 valid)."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])
