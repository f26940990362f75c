"""The proof a class switch makes before it fuses (issue 39, fail closed).

torchtitan's and OLMo-core's modules are recognised by their class and
switched to a subclass whose forward is swiglu_cupy's reproduction of the
upstream forward. A library release that changes that forward (or the
activation it calls) would otherwise be computed with the old math: so the
walk runs the module's own (upstream) forward and the fused forward on a
probe input in the module's dtype, and keeps the switch only if they agree
(:func:`prove_switch`); else the module is switched back, with the reason.

Modules whose weights cannot be computed with when they are patched (the
meta device, DeepSpeed ZeRO-3 partitions, DTensor shards) are proved at
their first forward on real weights, as the structural walk's pending
modules are (:func:`proven`'s wrapper): until then, and after a refusal,
the module's own forward runs; a refusal warns once (``SWIGLU_CUPY_STRICT=1``
makes it an error)."""
from __future__ import annotations

import functools

import torch
from torch import nn

from .fused import refuse_at_first_forward, switched_base, unmaterialised
from .plan_runner import is_dtensor
from .probe import describe_error
from .recognition import rows_agree

__all__ = ["proven", "prove_switch", "PENDING", "probe_tensor"]

#: ``module._swiglu_cupy_proof``: None (proved, or never asked), PENDING (proved
#: at the first forward on real weights) or the refusal's reason.
PENDING = "pending"


def probe_tensor(shape, like: torch.Tensor, scale_rows: int = 2) -> torch.Tensor:
    """A probe input of ``shape`` in ``like``'s dtype and device: standard
    normal rows, the last ``scale_rows`` of them (along dim 0) scaled by 8 so
    the projections reach past a clamp written into a forward."""
    gen = torch.Generator(device="cpu").manual_seed(1234)
    x = torch.randn(*shape, generator=gen, dtype=torch.float32)
    if scale_rows and x.shape[0] > scale_rows:
        x[-scale_rows:] *= 8.0
    dtype = like.dtype if like.dtype.is_floating_point else torch.get_default_dtype()
    return x.to(like.device if like.device.type != "meta" else "cpu", dtype)


def proven(fused_forward, probe_inputs, compute_dtype=None, unrunnable=None):
    """The switched class's forward: ``fused_forward`` once proved equal to
    the base class's forward on ``probe_inputs(module) -> args``; the base's
    own forward while the proof is pending and cannot be made, or refused.
    ``compute_dtype(module)``: the dtype the upstream forward computes in,
    whose tolerance the comparison takes, where it is not its output's (bf16
    operands cast back); default the output's. ``unrunnable(module)``: where
    the upstream forward cannot run on this machine (CUDA-only kernels on CPU
    weights), ``(True, None)`` to accept the switch without the proof (an
    installed version proven equal) or ``(True, reason)`` to refuse it;
    ``(False, None)`` where it can run (then the proof decides)."""

    @functools.wraps(fused_forward)
    def forward(self, *args, **kwargs):
        if getattr(self, "_swiglu_cupy_proof", None) is not None:
            reason = _settle(self)
            if reason is not None:
                return switched_base(self).forward(self, *args, **kwargs)
        return fused_forward(self, *args, **kwargs)

    forward.swiglu_fused_forward = fused_forward
    forward.swiglu_probe_inputs = probe_inputs
    forward.swiglu_compute_dtype = compute_dtype
    forward.swiglu_unrunnable = unrunnable
    return forward


def _not_computable(module: nn.Module) -> bool:
    return unmaterialised(module) or any(is_dtensor(p) for p in module.parameters())


_settle_untraced = None


def _settle(module: nn.Module) -> str | None:
    """A pending proof made now (never traced: torch.compile runs it eagerly),
    or the stored refusal; None when fused."""
    global _settle_untraced
    if _settle_untraced is None:
        _settle_untraced = torch.compiler.disable(_settle_now)
    return _settle_untraced(module)


def _settle_now(module: nn.Module) -> str | None:
    state = module._swiglu_cupy_proof
    if state != PENDING:
        return state
    if _not_computable(module):
        return PENDING  # a shape-only forward (meta) or still sharded: the own forward runs meanwhile
    reason = prove_switch(module)
    if reason is None:
        module._swiglu_cupy_proof = None
        return None
    module._swiglu_cupy_proof = reason
    message = (f"swiglu_cupy: a {switched_base(module).__name__} switched on the meta device (or with sharded "
               f"weights) was checked at its first forward and runs its original forward: {reason}")
    refuse_at_first_forward(message, stacklevel=5)
    return reason


def _run(fn):
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return fn(), None
    except Exception as error:
        return None, error


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1]) if t.dim() > 1 else t.reshape(-1, 1)


def prove_switch(module: nn.Module) -> str | None:
    """Run ``module``'s base-class forward and its fused forward (``module``
    is switched already) on the class's probe input; None if they agree,
    else the reason. Does not change the module."""
    base = switched_base(module)
    forward = type(module).forward
    fused_forward = getattr(forward, "swiglu_fused_forward", None)
    if fused_forward is None:
        return f"{type(module).__name__}'s forward has no proof: left as is"
    try:
        args = forward.swiglu_probe_inputs(module)
    except Exception as error:
        return "could not be probed: no probe input for its weights" + describe_error(error)
    where = f"{base.__module__}.{base.__qualname__}.forward"
    if forward.swiglu_unrunnable is not None:
        unrunnable, reason = forward.swiglu_unrunnable(module)
        if unrunnable:
            return reason
    expected, error = _run(lambda: base.forward(module, *args))
    if not isinstance(expected, torch.Tensor):
        return ("could not be probed: its forward failed on a probe input" + describe_error(error) if error
                else f"could not be probed: {where} returned {type(expected).__name__}, not a tensor")
    actual, error = _run(lambda: fused_forward(module, *args))
    if not isinstance(actual, torch.Tensor):
        return "the fused forward failed on a probe input" + describe_error(error)
    compute_dtype = forward.swiglu_compute_dtype
    dtype = expected.dtype if compute_dtype is None else compute_dtype(module)
    if expected.shape != actual.shape or actual.dtype != expected.dtype or not rows_agree(_rows(expected), _rows(actual),
                                                                                  dtype):
        return (f"probe mismatch: its own forward ({where}) disagrees with swiglu_cupy's reproduction of it on a "
                f"probe input ({dtype}): a library version whose forward or activation changed? left as is")
    return None


def check_switch(module: nn.Module) -> tuple[str | None, bool]:
    """After a class switch of the walk: prove it now, or mark it pending
    (weights not computable yet). ``(reason, pending)``; on a refusal the
    module is switched back to its own class (or, where its class is not the
    switched class itself, its forward runs its own from now on)."""
    if _not_computable(module):
        if "_swiglu_cupy_proof" in module.__dict__ and module.__dict__["_swiglu_cupy_proof"] is None:
            return None, False  # proved by an earlier patch(), now sharded: stays proved
        module._swiglu_cupy_proof = PENDING
        return None, True
    reason = prove_switch(module)
    if reason is None:
        module._swiglu_cupy_proof = None
        return None, False
    if type(module).__dict__.get("_swiglu_kind") is not None:
        module.__class__ = switched_base(module)
        module.__dict__.pop("_swiglu_cupy_proof", None)
    else:
        module._swiglu_cupy_proof = reason
    return reason, False
