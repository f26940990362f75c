"""The probe that decides: a module's own forward and a candidate plan must
agree on a probe input (rows large enough to cross any clamp included), or
the module is left alone with a reason (:func:`choose_plan`)."""
from __future__ import annotations

import dataclasses
import itertools
import math

import torch
from torch import nn
from torch.func import functional_call

from .._torch_compat import DROPOUT_CLASSES
from .._dtypes import SUPPORTED_DTYPES
from .plan_runner import run_plan
from .recognition import Candidates, GLUPlan, rows_agree

__all__ = ["choose_plan", "describe_error"]


def describe_error(error: BaseException | None) -> str:
    """``" (Type: first line of its message)"``, what a reason says of an
    exception; empty for None."""
    if error is None:
        return ""
    lines = str(error).strip().splitlines()
    return f" ({type(error).__name__}: {lines[0]})" if lines else f" ({type(error).__name__})"

# Without a stated limit, the probe's large rows reach this far, so a clamp
# written into a forward below it shows up as a mismatch.
_HIDDEN_CLAMP_REACH = 32.0

# ---- the probe -------------------------------------------------------------------------------

def _device_dtype(module: nn.Module, first: nn.Module):
    tensors = [*module.parameters(), *module.buffers()]
    device = tensors[0].device if tensors else torch.device("cpu")
    dtype = next((p.dtype for p in first.parameters() if p.dtype in SUPPORTED_DTYPES), torch.get_default_dtype())
    return device, dtype


class _Probe:
    """One module's probe: the input, and its own forward's output on it."""

    def __init__(self, module: nn.Module, cands: Candidates, own_forward):
        plan = cands.plans[0]
        first = module._modules[plan.packed or plan.gate]
        self.module, self.device, self.dtype = module, *_device_dtype(module, first)
        gen = torch.Generator(device="cpu").manual_seed(1234)
        x = torch.randn(4, cands.in_features, generator=gen, dtype=torch.float32, device="cpu")
        x = x.to(self.device, self.dtype)
        # Two more rows, scaled so that the projections reach past any clamp
        # (the stated limit, or _HIDDEN_CLAMP_REACH).
        limit = max((p.activation.limit or 0.0) for p in cands.plans) or _HIDDEN_CLAMP_REACH / 4
        try:
            with torch.no_grad():
                reach = max(module._modules[n](x).abs().max().item() for n in (plan.packed, plan.gate, plan.up) if n)
        except Exception:
            reach = 0.0  # the forward's own failure is reported below
        scale = max(1.0, 4.0 * limit / reach) if reach > 0 and math.isfinite(reach) else 1.0
        self.x = torch.cat([x, x[:2] * scale])
        self.own_forward = own_forward
        #: The exception the last :meth:`run` raised (None if it returned).
        self.error: BaseException | None = None
        self.expected = self.run(own_forward)
        self.own_error = self.error

    def run(self, fn, training=False, seed=None):
        training_was = self.module.training
        self.module.train(training)
        self.error = None
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
                torch.manual_seed(0 if seed is None else seed)
                return fn(self.x)
        except Exception as error:
            self.error = error
            return None
        finally:
            self.module.train(training_was)

    def matches(self, fn) -> bool:
        expected = self.expected
        if expected is None:
            return False
        actual = self.run(fn)
        if not isinstance(expected, torch.Tensor) or not isinstance(actual, torch.Tensor):
            return False
        if not torch.isfinite(expected[4:]).all():
            # The scaled rows overflowed the module's dtype: compare the others.
            expected, actual = expected[:4], actual[:4]
        return rows_agree(expected, actual, self.dtype)

    def dropout_placement_matches(self, plan: GLUPlan, fn) -> bool:
        """In training mode with the same RNG state, dropout masks are drawn in
        the same order and shapes only if the plan puts each dropout where the
        module's forward applies it."""
        mods = self.module._modules
        if not any(isinstance(mods[n], DROPOUT_CLASSES) and mods[n].p > 0
                   for n in (*plan.mid, *plan.post)):
            return True
        expected = self.run(self.own_forward, training=True, seed=7)
        actual = self.run(fn, training=True, seed=7)
        if expected is None or actual is None:
            return False
        return rows_agree(expected[:4], actual[:4], self.dtype)


class _PlanReference(nn.Module):
    """``plan``'s plain-torch reference on ``inner``'s children, as a module
    for ``functional_call`` (which substitutes ``inner.*`` parameters)."""

    def __init__(self, inner: nn.Module, plan: GLUPlan):
        super().__init__()
        self.inner, self.plan = inner, plan

    def forward(self, x):
        return run_plan(self.inner, x, self.plan, fused=False)


def _tell_apart_in_float64(probe: _Probe, plans: list[GLUPlan]) -> tuple[list[GLUPlan], str | None]:
    """Plans whose activations differ but agree within a 16-bit dtype's
    rounding (exact GELU and its tanh form; quick GELU), decided in float64:
    the module's own forward and each plan's reference on a float64 copy of
    its parameters and buffers, on the CPU (no device memory). ``(the plans
    that agree there, None)``, or ``([], reason)``."""
    module = probe.module
    state = {name: t.detach().to("cpu", torch.float64 if t.is_floating_point() else t.dtype)
             for name, t in itertools.chain(module.named_parameters(), module.named_buffers())}
    x = probe.x.to("cpu", torch.float64)
    forms = " and ".join(str(p.activation) for p in plans)
    try:
        with torch.no_grad():
            was_training = module.training
            module.train(False)
            try:
                expected = functional_call(module, state, (x,))
                kept = [plan for plan in plans
                        if rows_agree(expected, functional_call(_PlanReference(module, plan),
                                                                {f"inner.{k}": v for k, v in state.items()}, (x,)),
                                      torch.float64)]
            finally:
                module.train(was_training)
    except Exception as error:
        return [], (f"its forward agrees with {forms} within {probe.dtype}'s rounding and could not run in float64 "
                    f"to tell them apart" + describe_error(error))
    if not kept:
        return [], f"its forward agrees with {forms} within {probe.dtype}'s rounding and with none in float64"
    return kept, None


def choose_plan(module: nn.Module, cands: Candidates, verify: bool, modes: tuple[bool, bool], own_forward=None):
    """``(plan, None)`` or ``(None, reason)``: the first candidate the module's
    own forward (``own_forward``, default ``module.forward``) agrees with,
    checked again through the fused op itself. ``verify=False`` trusts an
    unambiguous structure stated by Hugging Face names without probing."""
    if "forward" in module.__dict__:
        return None, "its forward is replaced on the instance (accelerate hooks?), which would bypass the fusion"
    if not verify:
        if cands.named and len({(p.activation.kind, p.activation.alpha) for p in cands.plans}) == 1:
            return cands.plans[0], None
        return None, "verify=False, and the roles or activation are not stated by the names"
    if any(t.device.type == "meta" for t in (*module.parameters(), *module.buffers())):
        return None, "on the meta device: nothing to probe with"
    if cands.in_features is None:
        return None, "could not be probed: the input width of its projections is unknown"
    probe = _Probe(module, cands, own_forward or module.forward)
    if probe.expected is None:
        return None, "could not be probed: its forward failed on a probe input" + describe_error(probe.own_error)
    misplaced = None

    def agrees(plan: GLUPlan) -> bool:
        return probe.matches(lambda x: run_plan(module, x, plan, fused=False))

    for i, plan in enumerate(cands.plans):
        if not agrees(plan):
            continue
        if probe.dtype in (torch.bfloat16, torch.float16):
            # Later candidates with the same roles and another activation may agree within 16 bits too.
            roles = dataclasses.replace(plan, activation=None)
            rivals = [p for p in cands.plans[i + 1:] if p.activation != plan.activation
                      and dataclasses.replace(p, activation=None) == roles and agrees(p)]
            if rivals:
                kept, reason = _tell_apart_in_float64(probe, [plan, *rivals])
                if reason:
                    return None, reason
                plan = kept[0]
        def fused(x, plan=plan):
            return run_plan(module, x, plan, *modes)
        if not probe.matches(fused):
            return None, f"the fused op disagrees with its forward ({plan.activation}, {probe.dtype})"
        if not probe.dropout_placement_matches(plan, fused):
            misplaced = "dropout placement differs from its forward in training mode"
            continue  # another candidate may place it where the forward does
        mods = module._modules
        unproven = tuple(n for n in (*plan.mid, *plan.post) if isinstance(mods[n], DROPOUT_CLASSES) and mods[n].p == 0)
        return (dataclasses.replace(plan, dropout_unproven=unproven) if unproven else plan), None
    if misplaced:
        return None, misplaced
    kinds = sorted({str(p.activation) for p in cands.plans})
    roles = cands.plans[0].describe().split(" -> ")[0]
    return None, (f"probe mismatch: its forward is not down(act(gate) * up) with the roles its names "
                  f"state ({roles}) and {', '.join(kinds)}" if cands.named else
                  "probe mismatch: no role assignment and known activation reproduces its forward")
