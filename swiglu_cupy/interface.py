"""Layers 2 and 3: the autograd Function, the public functional API and the
eager reference.

Weight layout (xformers' packed ``w12``, Phi-3's ``gate_up_proj``):
    x   [..., D]
    w12 [2H, D]   rows 0..H-1 = gate (w1), rows H..2H-1 = up (w2)
    b12 [2H] or None
    w3  [O, H]    down projection
    b3  [O] or None
    y = (silu(x @ w1.T + b1) * (x @ w2.T + b2)) @ w3.T + b3

``SwiGLUFunction`` is only ever called through ``.apply()``: its forward
always saves the same tensors (x, w12, w3 and x12, never h), whatever
requires grad, so activation checkpointing in both modes sees identical
forwards (the bug that broke xformers' fused op).
"""
from __future__ import annotations

import importlib
import math

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from . import ops
from ._sources import SUPPORTED_DTYPES

__all__ = ["SwiGLUFunction", "SiluMulFunction", "swiglu", "swiglu_unpacked", "swiglu_reference",
           "silu_mul", "silu_mul_reference"]


def _linear_2d(inp: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """inp @ weight.T (+ bias), with the bias folded into the GEMM (addmm)."""
    if out is None:
        return F.linear(inp, weight, bias)  # addmm, with the transpose done in C++
    if bias is None:
        return torch.mm(inp, weight.t(), out=out)
    return torch.addmm(bias, inp, weight.t(), out=out)


def _functional(t: torch.Tensor) -> bool:
    """Use out=-free ops: a tracer (torch.compile / torch.export / ONNX) records
    this call, or ``t`` carries a torch.func transform (out= buffers cannot
    hold a vmap batch)."""
    return torch.compiler.is_compiling() or ops.is_transformed(t)


def _gate_up(x2d: torch.Tensor, w1: torch.Tensor, b1, w2, b2, functional: bool) -> torch.Tensor:
    """x12 = [gate | up] as one [M, 2H] tensor. Packed weights (``w2 is None``:
    ``w1`` is w12) take one GEMM; separate ones write their halves of one
    buffer, so no weight is ever concatenated."""
    if w2 is None:
        return _linear_2d(x2d, w1, b1)
    if functional:
        return torch.cat([_linear_2d(x2d, w1, b1), _linear_2d(x2d, w2, b2)], dim=1)
    H = w1.shape[0]
    x12 = torch.empty((x2d.shape[0], 2 * H), dtype=x2d.dtype, device=x2d.device)
    _linear_2d(x2d, w1, b1, out=x12[:, :H])
    _linear_2d(x2d, w2, b2, out=x12[:, H:])
    return x12


def _down(h: torch.Tensor, w3: torch.Tensor, b3, out_shape, functional: bool) -> torch.Tensor:
    """y = h @ w3.T + b3 in ``out_shape`` (None: 2-D x, y is the GEMM's own
    output), allocated in that shape (not a view, which FSDP2 warns about)
    outside tracing."""
    if out_shape is None:
        return _linear_2d(h, w3, b3)
    if functional:
        return _linear_2d(h, w3, b3).view(out_shape)
    y = torch.empty(out_shape, dtype=h.dtype, device=h.device)
    _linear_2d(h, w3, b3, out=y.view(-1, w3.shape[0]))
    return y


_is_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


class _LeanApplyFunction(torch.autograd.Function):
    """torch.autograd.Function whose ``apply`` skips torch's per-call
    ``inspect.signature`` binding of default arguments (~15 us; our callers
    pass every argument positionally). Under torch.func transforms, or with a
    tensor left over from one, torch's own ``apply`` runs unchanged."""

    @classmethod
    def apply(cls, *args):
        if not torch._C._are_functorch_transforms_active():
            for a in args:
                # Transforms wrap into plain torch.Tensor objects (never Parameters or subclasses).
                if a.__class__ is torch.Tensor and _is_functorch_wrapped(a):
                    break  # a tensor left over from a transform: torch's apply unwraps it
            else:
                # torch.autograd.Function.apply minus the binding: the C++ apply.
                return super(torch.autograd.Function, cls).apply(*args)
        return super().apply(*args)


class SwiGLUFunction(_LeanApplyFunction):
    """Fused SwiGLU: 3 GEMMs forward, 4 GEMMs + one elementwise pass backward.

    ``apply(x, w1, b1, w2, b2, w3, b3, recompute_gate_up, inplace_backward,
    inference) -> (y, x12)`` (positional; ``swiglu`` and ``swiglu_unpacked``
    are the public entry points and return ``y`` alone):
    - packed weights: ``w2 = b2 = None`` and ``w1``/``b1`` are ``w12 [2H, D]``
      and ``b12 [2H]``; separate weights: ``w1``, ``w2`` are ``[H, D]``.
    - ``recompute_gate_up``: save only x and recompute x12 in backward (one
      extra GEMM, D instead of D + 2H saved elements per token).
    - ``inplace_backward``: write dx12 over the saved x12 (one [M, 2H] buffer
      less); the graph can then be backpropagated only once.
    - ``inference``: pass ``not torch.is_grad_enabled()`` (``swiglu`` does).
      Then h is written over the gate half of x12 and the down projection
      reads that strided view: nothing is allocated besides x12 and y.
    The second output ``x12`` is returned only so that ``setup_context`` can
    save it (torch.func requires saved tensors to be inputs or outputs); it is
    non-differentiable and its content is unspecified after ``inference``.
    """

    @staticmethod
    def forward(x, w1, b1, w2, b2, w3, b3, recompute_gate_up=False, inplace_backward=False,
                inference=False):
        return _forward_pass(x, w1, b1, w2, b2, w3, b3, inference, _functional(x))

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, w1, b1, w2, b2, w3, b3, recompute_gate_up, inplace_backward, inference = inputs
        ctx.mark_non_differentiable(output[1])
        if inference:
            return  # no graph is recorded under no_grad, so nothing can be saved
        if recompute_gate_up:
            ctx.save_for_backward(x, w1, b1, w2, b2, w3)
        else:
            ctx.save_for_backward(x, w1, w2, w3, output[1])
        ctx.recompute_gate_up = recompute_gate_up
        ctx.inplace_backward = inplace_backward
        ctx.backward_done = False

    @staticmethod
    @once_differentiable
    def backward(ctx, dy, _dx12_unused):
        if ctx.inplace_backward and ctx.backward_done:
            raise RuntimeError(
                "swiglu_cupy: this graph was built with inplace_backward=True, whose first "
                "backward overwrote the saved x12; a second backward (retain_graph=True) "
                "cannot run. Use inplace_backward=False to backpropagate more than once.")
        ctx.backward_done = True
        if ctx.recompute_gate_up:
            x, w1, b1, w2, b2, w3 = ctx.saved_tensors
            x2d = x.reshape(-1, x.shape[-1])
            x12 = _gate_up(x2d, w1, b1, w2, b2, _functional(x2d))          # extra GEMM
        else:
            x, w1, w2, w3, x12 = ctx.saved_tensors
            x2d = x.reshape(-1, x.shape[-1])
        need_x, need_w1, need_b1, need_w2, need_b2, need_w3, need_b3 = ctx.needs_input_grad[:7]
        dy2d = dy.reshape(-1, w3.shape[0])
        dh = torch.mm(dy2d, w3)                                            # GEMM 1
        # In-place reuse is always safe for the recomputed x12 (nobody else
        # holds it), but not under torch.func, where dh may carry a vmap batch.
        inplace = (ctx.inplace_backward or ctx.recompute_gate_up) and not ops.is_transformed(dh)
        dx12, h = ops.backward(x12, dh, inplace)                           # one fused pass
        dx = dw1 = db1 = dw2 = db2 = dw3 = db3 = None
        H = dh.shape[1]
        if need_x:
            dx = _input_grad(dx12, w1, w2, x.shape)                        # GEMM 2
        if need_w1 or need_w2:
            dw12 = torch.mm(dx12.t(), x2d)                                 # GEMM 3
            dw1, dw2 = (dw12, None) if w2 is None else (dw12[:H], dw12[H:])
        if need_b1 or need_b2:
            db12 = dx12.sum(0)
            db1, db2 = (db12, None) if w2 is None else (db12[:H], db12[H:])
        if need_w3:
            dw3 = torch.mm(dy2d.t(), h)                                    # GEMM 4
        if need_b3:
            db3 = dy2d.sum(0)
        return dx, dw1, db1, dw2, db2, dw3, db3, None, None, None

    @staticmethod
    def vmap(info, in_dims, x, w1, b1, w2, b2, w3, b3, *modes):
        return _vmap_rule(info, in_dims, (x, w1, b1, w2, b2, w3, b3), modes)


def _forward_pass(x, w1, b1, w2, b2, w3, b3, inference: bool, functional: bool):
    """The forward's computation: (y, x12). ``inference`` comes from the
    caller's grad mode (forward itself runs without grad), never from
    requires_grad: checkpoint recomputes, which run with grad enabled, always
    take the saving path."""
    flat = x.dim() == 2
    x12 = _gate_up(x if flat else x.reshape(-1, x.shape[-1]), w1, b1, w2, b2, functional)
    h = ops.forward_inplace(x12) if inference else ops.forward(x12)
    return _down(h, w3, b3, None if flat else (*x.shape[:-1], w3.shape[0]), functional), x12


def _input_grad(dx12: torch.Tensor, w1: torch.Tensor, w2, x_shape) -> torch.Tensor:
    """dx = dx12 @ w12 (separate weights: dgate @ w1 + dup @ w2, no concatenation,
    except in 16-bit dtypes: there the sum of two GEMMs rounds dx twice, so one
    GEMM reads a transient [w1; w2] and dx is rounded once, as with packed weights)."""
    D = w1.shape[1]
    H = dx12.shape[1] // 2
    if w2 is not None and dx12.dtype in (torch.float16, torch.bfloat16):
        w1, w2 = torch.cat([w1, w2]), None
    if _functional(dx12):
        dx = torch.mm(dx12, w1) if w2 is None else torch.addmm(torch.mm(dx12[:, :H], w1), dx12[:, H:], w2)
        return dx.view(x_shape)
    dx = torch.empty(x_shape, dtype=dx12.dtype, device=dx12.device)
    dx2d = dx.view(-1, D)
    if w2 is None:
        torch.mm(dx12, w1, out=dx2d)
    else:
        torch.mm(dx12[:, :H], w1, out=dx2d)
        dx2d.addmm_(dx12[:, H:], w2)
    return dx


def _vmap_rule(info, in_dims, tensors, modes):
    """torch.func.vmap of SwiGLUFunction. A batch of inputs with shared
    weights folds into the token rows: one call, one launch per kernel. Batched
    weights (ensembles) run one call per member (the documented slower path)."""
    x, *weights = tensors
    x_dim, *weight_dims = in_dims
    if all(d is None for d in weight_dims):
        y, x12 = SwiGLUFunction.apply(ops.batch_first(info, x, x_dim), *weights, *modes)
        return (y, x12.view(info.batch_size, -1, x12.shape[-1])), (0, 0)
    members = []
    for i in range(info.batch_size):
        pick = lambda t, d: t if t is None or d is None else t.select(d, i)  # noqa: E731
        members.append(SwiGLUFunction.apply(*(pick(t, d) for t, d in zip(tensors, in_dims)), *modes))
    return tuple(torch.stack(outs) for outs in zip(*members)), (0, 0)


def _check_tensor(name: str, t, optional: bool = False) -> None:
    if t is None and optional:
        return
    if not isinstance(t, torch.Tensor):
        kind = "a torch.Tensor or None" if optional else "a torch.Tensor"
        raise TypeError(f"{name} must be {kind}, got {type(t).__name__}")
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter and name not in ("x", "gate", "up"):
        from .parallel import reject_distributed_weights  # a subclass: maybe a DTensor weight
        reject_distributed_weights(**{name: t})
    if t.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} must be a floating tensor of dtype float16, bfloat16, float32 "
                        f"or float64, got {t.dtype}")
    if t.is_meta:
        raise ValueError(f"{name} is a meta tensor (no data); materialize it first, e.g. "
                         "module.to_empty(device=...) and re-initialize the parameters")
    if (name not in ("x", "gate", "up") and not t.is_contiguous()
            and any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape))):
        raise ValueError(f"{name} is an expanded view (stride 0 along a dim of size > 1, strides "
                         f"{t.stride()}); pass a materialized tensor, e.g. {name}.contiguous()")


def _check_shapes(x, w12, b12, w3, b3) -> None:
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
    _check_down(w3, b3, rows // 2)


def _check_unpacked_shapes(x, w1, b1, w2, b2, w3, b3) -> None:
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
    _check_down(w3, b3, H)


def _check_down(w3, b3, H: int) -> None:
    if w3.dim() != 2 or w3.shape[1] != H:
        raise ValueError(f"w3 must be 2-D [O, H] with H = {H}, got shape {tuple(w3.shape)}")
    if b3 is not None and tuple(b3.shape) != (w3.shape[0],):
        raise ValueError(f"b3 must have shape ({w3.shape[0]},) = (O,), got {tuple(b3.shape)}")


def _check_same(tensors: dict, attr: str, error) -> None:
    ref_name, ref = "x", tensors["x"]
    for name, t in tensors.items():
        if t is not None and getattr(t, attr) != getattr(ref, attr):
            raise error(f"{name} must have the same {attr} as {ref_name} ({getattr(ref, attr)}), "
                        f"got {getattr(t, attr)}")


def _check_flags(**flags) -> None:
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")


def _reject_jit() -> None:
    if torch.jit.is_tracing() or torch.jit.is_scripting():
        raise RuntimeError(
            "swiglu_cupy does not support TorchScript (torch.jit.trace / torch.jit.script): its "
            "kernels run from Python. Use torch.export.export (or torch.compile) instead.")


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _common_case(x, weights, biases) -> bool:
    """The cheap pass: plain dense tensors of one supported dtype and one
    device (not meta), contiguous weights. There every per-tensor check
    holds, so only the shapes are left to check; anything else takes the
    full checks, which raise the precise error or accept it (autocast's mixed
    dtypes, strided weights)."""
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


def _common_packed_case(x, w12, b12, w3, b3) -> bool:
    """``_common_case`` and ``_check_shapes`` in one pass, for the hot
    packed call; False sends the call through both for the precise error."""
    if not _common_case(x, (w12, w3), (b12, b3)):
        return False
    try:
        rows, D = w12.shape
        O, H = w3.shape
        return (x.shape[-1] == D and rows == 2 * H and H > 0
                and (b12 is None or b12.shape == (rows,)) and (b3 is None or b3.shape == (O,)))
    except (ValueError, IndexError):  # a rank other than 2, or a 0-d x
        return False


def _check_inputs(tensors: dict, optional: tuple) -> None:
    """The full per-tensor checks, each error naming its argument."""
    for name, t in tensors.items():
        _check_tensor(name, t, optional=name in optional)
    _check_same(tensors, "device", ValueError)
    if not torch.is_autocast_enabled(tensors["x"].device.type):  # autocast casts them to one dtype
        _check_same(tensors, "dtype", TypeError)


def _run(args: list, flags: tuple) -> torch.Tensor:
    """The one place SwiGLUFunction is applied. Under autocast every input is
    cast to the autocast dtype, like nn.Linear."""
    device_type = args[0].device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        args = [None if t is None else t.to(dtype) for t in args]
        with torch.autocast(device_type=device_type, enabled=False):
            return _forward_or_apply(args, flags)
    return _forward_or_apply(args, flags)


def _forward_or_apply(args: list, flags: tuple) -> torch.Tensor:
    if torch.is_grad_enabled() or torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return SwiGLUFunction.apply(*args, *flags, not torch.is_grad_enabled())[0]
    # No grad: no graph can be recorded, so the Function (whose only job is
    # the graph) is skipped; the same forward pass runs, in inference mode.
    return _forward_pass(*args, True, False)[0]  # inference, eager (no tracer, no transform)


def swiglu(x: torch.Tensor, w12: torch.Tensor, b12: torch.Tensor | None,
           w3: torch.Tensor, b3: torch.Tensor | None, *,
           recompute_gate_up: bool = False, inplace_backward: bool = False) -> torch.Tensor:
    """Fused SwiGLU feed-forward: returns [..., O] (layout in the module doc).

    ``recompute_gate_up`` and ``inplace_backward`` are the memory modes of
    ``SwiGLUFunction``. Under ``torch.autocast`` the inputs are cast to the autocast dtype (as
    ``nn.Linear`` does), and the gradients flow back in each input's dtype.
    """
    _reject_jit()
    if not _common_packed_case(x, w12, b12, w3, b3):
        _check_inputs({"x": x, "w12": w12, "b12": b12, "w3": w3, "b3": b3}, optional=("b12", "b3"))
        _check_shapes(x, w12, b12, w3, b3)
    if type(recompute_gate_up) is not bool or type(inplace_backward) is not bool:
        _check_flags(recompute_gate_up=recompute_gate_up, inplace_backward=inplace_backward)
    return _run([x, w12, b12, None, None, w3, b3], (recompute_gate_up, inplace_backward))


def swiglu_unpacked(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None,
                    w2: torch.Tensor, b2: torch.Tensor | None, w3: torch.Tensor,
                    b3: torch.Tensor | None, *, recompute_gate_up: bool = False,
                    inplace_backward: bool = False) -> torch.Tensor:
    """``swiglu`` with separate gate (``w1 [H, D]``, ``b1``) and up (``w2``,
    ``b2``) projections: ``w3(silu(x @ w1.T + b1) * (x @ w2.T + b2)) + b3``.

    The two GEMMs write the halves of one x12 buffer, so the weights are never
    concatenated; the same Function, kernels and guarantees as ``swiglu``.
    """
    _reject_jit()
    if not _common_case(x, (w1, w2, w3), (b1, b2, b3)):
        _check_inputs({"x": x, "w1": w1, "b1": b1, "w2": w2, "b2": b2, "w3": w3, "b3": b3},
                      optional=("b1", "b2", "b3"))
    _check_unpacked_shapes(x, w1, b1, w2, b2, w3, b3)
    if type(recompute_gate_up) is not bool or type(inplace_backward) is not bool:
        _check_flags(recompute_gate_up=recompute_gate_up, inplace_backward=inplace_backward)
    return _run([x, w1, b1, w2, b2, w3, b3], (recompute_gate_up, inplace_backward))


def swiglu_reference(x: torch.Tensor, w12: torch.Tensor, b12: torch.Tensor | None,
                     w3: torch.Tensor, b3: torch.Tensor | None) -> torch.Tensor:
    """Slow eager reference with the same layout (three torch ops)."""
    gate, up = F.linear(x, w12, b12).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w3, b3)


class SiluMulFunction(_LeanApplyFunction):
    """``h = silu(gate) * up`` for two tensors of one shape ``[..., H]``: one
    fused kernel each way (fp32 math, one rounding). Saves its two inputs
    only, whatever requires grad. Apply-only, like SwiGLUFunction."""

    @staticmethod
    def forward(gate, up):
        return ops.silu_mul_forward(_rows(gate), _rows(up)).view(gate.shape)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    @once_differentiable
    def backward(ctx, dh):
        gate, up = ctx.saved_tensors
        dgate, dup = ops.silu_mul_backward(_rows(gate), _rows(up), _rows(dh))
        return dgate.view(gate.shape), dup.view(up.shape)

    @staticmethod
    def vmap(info, in_dims, gate, up):
        # Elementwise: give both the batch dim in front; the rows fold into one launch.
        batched = [ops.batch_first(info, t, d) for t, d in zip((gate, up), in_dims)]
        return SiluMulFunction.apply(*batched), 0


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., H] -> [M, H] (a view where possible; explicit M keeps H = 0 or M = 0 valid)."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def _from_dlpack_module(array):
    """The array library of a DLPack-exporting ``array`` (numpy, cupy, ...),
    used to hand the result back as the same kind of array."""
    library = importlib.import_module(type(array).__module__.split(".")[0])
    if not hasattr(library, "from_dlpack"):
        raise TypeError(f"gate is a {type(array).__name__} that exports DLPack, but its library "
                        f"{library.__name__} has no from_dlpack to receive the result")
    return library


def silu_mul(gate, up):
    """Fused ``silu(gate) * up`` (SwiGLU's activation, for models whose
    projections stay their own modules, e.g. LoRA or quantized layers).

    ``gate`` and ``up``: one shape ``[..., H]``, one dtype (float16, bfloat16,
    float32 or float64), one device. torch tensors go through the apply-only
    ``SiluMulFunction`` (autograd, checkpointing, torch.compile, torch.func).
    Any other array that exports DLPack (``__dlpack__``: NumPy on the CPU,
    CuPy on a GPU) is read without a copy and the result comes back as the
    same kind of array (no autograd there).
    """
    _reject_jit()
    if not isinstance(gate, torch.Tensor) and hasattr(gate, "__dlpack__"):
        if not hasattr(up, "__dlpack__") or isinstance(up, torch.Tensor):
            raise TypeError(f"up must be a DLPack array like gate ({type(gate).__name__}), "
                            f"got {type(up).__name__}")
        library = _from_dlpack_module(gate)
        h = silu_mul(torch.from_dlpack(gate), torch.from_dlpack(up))
        return library.from_dlpack(h.detach())
    tensors = {"gate": gate, "up": up}
    for name, t in tensors.items():
        _check_tensor(name, t)
    if gate.dim() < 1:
        raise ValueError("gate must have shape [..., H], got a 0-d tensor")
    if up.shape != gate.shape:
        raise ValueError(f"up must have the shape of gate {tuple(gate.shape)}, got {tuple(up.shape)}")
    if up.device != gate.device:
        raise ValueError(f"up must be on the device of gate ({gate.device}), got {up.device}")
    if up.dtype != gate.dtype:
        raise TypeError(f"up must have the dtype of gate ({gate.dtype}), got {up.dtype}")
    return SiluMulFunction.apply(gate, up)


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Slow eager reference: ``F.silu(gate) * up`` (two torch ops)."""
    return F.silu(gate) * up
