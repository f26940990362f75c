"""The autograd scaffolding the dense and MoE Functions share: the apply-only
base class, the one rule for when a graph is needed, autocast dispatch, and
the handling of an output that exists only to be saved."""
from __future__ import annotations

import functools
import inspect

import torch
from torch.autograd.function import once_differentiable

from ._torch_compat import cpp_apply, functorch_transforms_active, is_functorch_wrapped

__all__ = ["LeanApplyFunction", "graph_needed", "under_autocast", "mark_saved_only", "first_order_backward"]


class LeanApplyFunction(torch.autograd.Function):
    """torch.autograd.Function whose ``apply`` skips torch's per-call
    ``inspect.signature`` binding (~15 us). Every argument of ``forward`` is
    required and positional, so nothing is left to bind: a call with the
    wrong count fails the same way in eager and under torch.func. Under
    torch.func transforms, with a tensor left over from one, or where torch's
    C++ apply cannot be reached (see ``_torch_compat``), torch's own ``apply``
    runs unchanged."""

    _num_args: int = 0

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        params = inspect.signature(cls.forward).parameters.values()
        if any(p.default is not p.empty or p.kind is not p.POSITIONAL_OR_KEYWORD for p in params):
            raise TypeError(f"{cls.__name__}.forward must take required positional arguments only")
        cls._num_args = len(params)
        # torch's C++ apply bound to the class once (None: unavailable): a C call per apply.
        cls._bound_cpp_apply = None if cpp_apply is None else cpp_apply.__get__(None, cls)
        #: ``apply_unwrapped(*args)``: ``apply`` for a caller that knows no torch.func transform
        #: is active and no argument is a tensor from one (the dense API's eager common case,
        #: which asked): torch's C++ apply itself, without ``apply``'s per-argument loop and
        #: Python frame (~3 us of a decode-sized call). The same graph.
        cls.apply_unwrapped = cls.apply if cls._bound_cpp_apply is None else cls._bound_cpp_apply

    @classmethod
    def apply(cls, *args):
        if len(args) != cls._num_args:
            names = ", ".join(inspect.signature(cls.forward).parameters)
            raise TypeError(f"{cls.__name__}.apply takes {cls._num_args} positional arguments "
                            f"({names}), got {len(args)}")
        if cls._bound_cpp_apply is not None and not functorch_transforms_active():
            for a in args:
                # Transforms wrap into plain torch.Tensor objects (never Parameters or subclasses).
                if a.__class__ is torch.Tensor and is_functorch_wrapped(a):
                    break  # a tensor left over from a transform: torch's apply unwraps it
            else:
                return cls._bound_cpp_apply(*args)
        return super().apply(*args)


def graph_needed(*tensors) -> bool:
    """Whether the Function must be applied: grad mode (a graph may be
    recorded), a tracer, or a torch.func transform (active, or left on one of
    ``tensors``). Otherwise the forward computation runs bare (no graph,
    nothing to save): the no-grad inference path. Never keyed on
    requires_grad, so a checkpoint's recompute always saves."""
    return (torch.is_grad_enabled() or torch.compiler.is_compiling() or functorch_transforms_active()
            or any(t is not None and is_functorch_wrapped(t) for t in tensors))


def under_autocast(device_type: str, tensors: list, run):
    """``run(tensors)``; under ``torch.autocast`` every tensor (None stays None)
    is first cast to the autocast dtype, as nn.Linear's inputs are, and
    ``run`` sees autocast disabled (the Functions pick their own precision)."""
    if not torch.is_autocast_enabled(device_type):
        return run(tensors)
    dtype = torch.get_autocast_dtype(device_type)
    cast = [None if t is None else t.to(dtype) for t in tensors]
    with torch.autocast(device_type=device_type, enabled=False):
        return run(cast)


def mark_saved_only(ctx, *outputs: torch.Tensor) -> None:
    """``outputs`` are returned only so that ``setup_context`` may save them
    (torch.func requires saved tensors to be inputs or outputs): they are not
    differentiable, and no zero gradient is materialised for them (without
    this, every backward would first fill a tensor of their size with zeros)."""
    ctx.mark_non_differentiable(*outputs)
    ctx.set_materialize_grads(False)


def first_order_backward(backward):
    """torch's ``once_differentiable`` without its cost in the usual backward.
    That wrapper enters ``no_grad`` and returns at once when grad mode is off
    (~2.7 us a call), which it is in every backward without
    ``create_graph=True``: there ``backward`` runs bare, the same thing.
    With grad mode on, torch's wrapper runs as before (the outputs then
    raise if differentiated again)."""
    guarded = once_differentiable(backward)

    @functools.wraps(backward)
    def first_order(ctx, *grads):
        if torch.is_grad_enabled():
            return guarded(ctx, *grads)
        return backward(ctx, *grads)

    return first_order
