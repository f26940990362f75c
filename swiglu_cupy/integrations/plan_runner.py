"""What a patched module's forward computes for a :class:`GLUPlan`: the whole
MLP in the fused op when the projections are plain ``nn.Linear`` and nothing
runs between the product and ``down``, else the children as themselves
around the fused ``act(gate) * up`` (:func:`run_plan`); with ``fused=False``
the same in plain torch ops, what the probe compares with."""
from __future__ import annotations

import sys

import torch
from torch import nn

from .._torch_compat import DROPOUT_CLASSES, GLOBAL_MODULE_HOOKS, global_module_hooks_active
from .._validation import common_case
from ..dense.api import check_unpacked_call, glu_mul, run_feed_forward, swiglu, swiglu_unpacked
from ..dense.module import linear_params
from ..reference import glu_reference
from .recognition import GLUPlan

__all__ = ["run_plan", "fusion_of", "linear_obstacle", "plain_linear", "is_dtensor", "zero3_gathers"]


def _zero3():
    """:mod:`.deepspeed_zero3`, or None when deepspeed is not loaded (then
    nothing can be ZeRO-3's, and nothing is imported)."""
    if "deepspeed" not in sys.modules:
        return None
    from . import deepspeed_zero3

    return deepspeed_zero3


def zero3_gathers(module: nn.Module) -> bool:
    """Whether DeepSpeed ZeRO-3 gathers all of ``module``'s parameters (its
    children's included) in ``module``'s own hooks: it is a ZeRO-3 leaf."""
    ds = _zero3()
    return ds is not None and ds.zero3_leaf(module)


def linear_obstacle(m: nn.Module, known_noop_forward=None, zero3_gathered: bool = False) -> str | None:
    """Why calling ``m`` is not exactly ``F.linear(x, m.weight, m.bias)``, or
    None: ``m`` is an ``nn.Linear`` (or a subclass that keeps its forward, as
    torchtitan's ``Linear``) with no hooks (torch's parallel styles, PEFT,
    offloading) and no forward replaced on the instance (Hugging Face's
    tensor-parallel styles, accelerate's hooks), except by
    ``known_noop_forward``: a wrapper the caller knows to call
    ``nn.Linear.forward`` and nothing else. ``zero3_gathered``: the parent is
    a ZeRO-3 leaf (:func:`zero3_gathers`), whose hooks gather this module's
    parameters, so ZeRO-3's own hooks on ``m`` (which would only gather and
    release them again) are no obstacle."""
    if not isinstance(m, nn.Linear):
        return f"{type(m).__name__} is not an nn.Linear (LoRA, quantized?)"
    if type(m).forward is not nn.Linear.forward:
        return f"{type(m).__name__} overrides nn.Linear.forward"
    if m._forward_pre_hooks or m._forward_hooks or m._backward_pre_hooks or m._backward_hooks:
        if not (zero3_gathered and _zero3().zero3_hooks_only(m)):
            return f"{type(m).__name__} has hooks"
    if "forward" in m.__dict__ and (known_noop_forward is None or m.__dict__["forward"] is not known_noop_forward):
        return f"{type(m).__name__} has its forward replaced on the instance"
    return None


def is_dtensor(t) -> bool:
    return hasattr(t, "to_local") and hasattr(t, "placements")


def plain_linear(m: nn.Module, known_noop_forward=None) -> bool:
    """Calling ``m`` is exactly ``F.linear`` on plain (not DTensor) weights
    (:func:`linear_obstacle`, checked where a class-switched forward runs)."""
    return linear_obstacle(m, known_noop_forward) is None and not is_dtensor(m.weight)




def _is_noop(m: nn.Module) -> bool:
    """A child between the product and ``down`` that does nothing now."""
    if isinstance(m, nn.Identity):
        return True
    return isinstance(m, DROPOUT_CLASSES) and (m.p == 0 or not m.training)


def _packed_mlp(x, plan: GLUPlan, mods, recompute_gate_up: bool, inplace_backward: bool, saved_x12=None,
                tile_rows=None):
    """The whole MLP of a packed gate/up projection in the fused op, the
    weights used in place (views). ``run_plan`` runs the usual separate
    projections itself."""
    modes = dict(recompute_gate_up=recompute_gate_up, inplace_backward=inplace_backward, saved_x12=saved_x12,
                 tile_rows=tile_rows)
    wd, bd = linear_params(mods[plan.down])
    w, b = linear_params(mods[plan.packed])
    if plan.order in ("gate_first", "interleaved"):
        return swiglu(x, w, b, wd, bd, activation=plan.packed_activation, **modes)
    h = w.shape[0] // 2  # gate last: the row halves as views, up first in storage
    return swiglu_unpacked(x, w[h:], None if b is None else b[h:], w[:h], None if b is None else b[:h],
                           wd, bd, activation=plan.activation, **modes)


def _split(y: torch.Tensor, order: str):
    """(gate, up) views of a packed projection's output."""
    if order == "interleaved":
        return y[..., 0::2], y[..., 1::2]
    first, second = y.chunk(2, dim=-1)
    return (first, second) if order == "gate_first" else (second, first)


def fusion_of(module: nn.Module, plan: GLUPlan | None) -> str | None:
    """``"mlp"``, ``"activation"`` or None: what ``run_plan`` runs now.
    Decided once and kept on the module with the state it was decided on;
    any change to that state decides again.

    The state is everything the fusion depends on, cheap to read at each
    call: the plan, torch's global module hooks, each projection's identity,
    class, whether it has a forward of its own, and its hooks, and each
    module between the product and ``down`` with its mode and rate. Without
    DeepSpeed loaded any hook is an obstacle, whichever it is, so only their
    presence counts; with it, whether the module is a ZeRO-3 leaf and which
    hooks each projection has (handle ids are never reused), since ZeRO-3's
    own hooks are none. The usual state (no DeepSpeed, no hook anywhere) is
    kept also as tuples that :func:`run_plan` compares in place at each call
    before it asks here."""
    if plan is None or (plan.dropout_unproven and unproven_dropout_active(module, plan)):
        return None
    state = _fusion_state(module, plan, module._modules)
    kept = module.__dict__.get(_FUSION_ATTR)
    if kept is not None and kept[0] == state:
        return kept[1]
    fusion = _decide_fusion(module, plan)
    module.__dict__[_FUSION_ATTR] = (state, fusion, _usual_state(state, plan))
    return fusion


def _fusion_state(module: nn.Module, plan: GLUPlan, mods) -> list:
    """The state a fusion is decided on (``fusion_of``), as one list: the plan,
    whether global hooks are registered, whether the module is a ZeRO-3 leaf,
    then (id, class, own forward, hooks) per projection and (id, class,
    training, rate) per module between the product and ``down``."""
    ds = _zero3() if "deepspeed" in sys.modules else None
    # The plan itself (compared by identity first), not its id: a new plan may reuse a freed id.
    state = [plan, any(GLOBAL_MODULE_HOOKS), ds is not None and ds.zero3_leaf(module)]
    for name in plan.projections:
        # A reused id (a child replaced by another) shows the class, forward and hooks the
        # decision reads, which is all it reads.
        m = mods.get(name)
        attrs = m.__dict__
        pre, post, bpre, bpost = (attrs["_forward_pre_hooks"], attrs["_forward_hooks"],
                                  attrs["_backward_pre_hooks"], attrs["_backward_hooks"])
        hooked = bool(pre or post or bpre or bpost)
        if hooked and ds is not None:
            hooked = (tuple(pre), tuple(post), tuple(bpre), tuple(bpost))
        state += (id(m), m.__class__, "forward" in attrs, hooked)
    for name in plan.mid:
        m = mods.get(name)
        state += (id(m), m.__class__, getattr(m, "training", None), getattr(m, "p", None))
    return state


def _usual_state(state: list, plan: GLUPlan) -> tuple | None:
    """``state`` as ``fusion_of`` compares it in place: (plan, (name, id,
    class, own forward) per projection, (name, id, class, training, rate) per
    module between); None unless it is the usual one (no DeepSpeed, no global
    hook, no projection hooked)."""
    if state[1] or "deepspeed" in sys.modules:
        return None
    n = len(plan.projections)
    projections = [state[3 + 4 * i:7 + 4 * i] for i in range(n)]  # id, class, own forward, hooks
    mids = [state[3 + 4 * n + 4 * i:7 + 4 * n + 4 * i] for i in range(len(plan.mid))]  # id, class, training, rate
    if any(hooks for *_, hooks in projections):
        return None
    return (plan, tuple((name, *each[:3]) for name, each in zip(plan.projections, projections)),
            tuple((name, *each) for name, each in zip(plan.mid, mids)))


def unproven_dropout_active(module: nn.Module, plan: GLUPlan) -> bool:
    """Whether a dropout whose placement the probe could not check now drops:
    the module must run its own forward (``GLUPlan.dropout_unproven``)."""
    mods = module._modules
    for name in plan.dropout_unproven:
        m = mods[name]
        if m.training and m.p > 0:
            return True
    return False


_FUSION_ATTR = "_swiglu_fusion"  # (state, fusion, usual state) of the last decision (picklable values only)


def _decide_fusion(module: nn.Module, plan: GLUPlan) -> str:
    mods = module._modules
    lins = _projections(mods, plan)
    gathered = zero3_gathers(module)
    whole = (all(linear_obstacle(m, zero3_gathered=gathered) is None for m in lins)
             and all(_is_noop(mods[n]) for n in plan.mid)
             and not global_module_hooks_active())  # global hooks must see each projection's call
    return "mlp" if whole else "activation"


def _projections(mods, plan: GLUPlan) -> list[nn.Module]:
    return [mods[n] for n in plan.projections]


def adopt_zero3(module: nn.Module, plan: GLUPlan) -> bool:
    """Make ``module`` a ZeRO-3 leaf when deepspeed.initialize put ZeRO-3's
    hooks on its projections (patched before deepspeed was imported, so
    :func:`~swiglu_cupy.integrations.fused.install` could not): from its next
    call its own hooks gather the projections, and the whole MLP runs fused.
    This call's projections were not gathered: they run as themselves."""
    ds = _zero3()
    if ds is None or ds.zero3_leaf(module):
        return False
    hooked = [m for m in _projections(module._modules, plan)
              if m._forward_pre_hooks or m._forward_hooks or m._backward_pre_hooks or m._backward_hooks]
    if not hooked or not all(ds.zero3_hooks_only(m) for m in hooked):
        return False
    ds.mark_zero3_leaf(module)
    return True


def run_plan(module: nn.Module, x: torch.Tensor, plan: GLUPlan, recompute_gate_up: bool = False,
             inplace_backward: bool = False, fused: bool = True, saved_x12=None, tile_rows=None) -> torch.Tensor:
    """``module``'s GLU feed-forward as ``plan`` says: the whole MLP fused when
    the projections are plain ``nn.Linear`` and nothing runs between the
    product and ``down``; else the children run as themselves and only
    ``act(gate) * up`` is fused. ``fused=False``: plain torch ops
    (:func:`~swiglu_cupy.glu_reference`), what the probe compares with.
    ``saved_x12`` and ``tile_rows`` reach the whole-MLP op (the activation-only
    fusion saves gate and up, as their modules gave them, and is not tiled)."""
    mods = module._modules  # decoding calls this once per token: no nn.Module.__getattr__
    fusion = None
    if fused:
        # ``fusion_of``'s answer while its usual state holds, compared here in place (a frame less
        # per call): no DeepSpeed, no global hook, and each projection the very module it was, of
        # its class, its own forward as it was and no hook, each module between unchanged.
        kept = module.__dict__.get(_FUSION_ATTR)
        usual = None if kept is None else kept[2]
        if (usual is not None and usual[0] is plan and "deepspeed" not in sys.modules
                and not any(GLOBAL_MODULE_HOOKS)
                and not (plan.dropout_unproven and unproven_dropout_active(module, plan))):
            for name, ident, cls, own_forward in usual[1]:
                m = mods.get(name)
                attrs = m.__dict__  # every nn.Module has its four hook dicts there (an attribute lookup costs more)
                if (id(m) != ident or m.__class__ is not cls or ("forward" in attrs) is not own_forward
                        or attrs["_forward_pre_hooks"] or attrs["_forward_hooks"] or attrs["_backward_pre_hooks"]
                        or attrs["_backward_hooks"]):
                    break
            else:
                for name, ident, cls, training, rate in usual[2]:
                    m = mods.get(name)
                    if (id(m) != ident or m.__class__ is not cls or getattr(m, "training", None) != training
                            or getattr(m, "p", None) != rate):
                        break
                else:
                    fusion = kept[1]
        if fusion is None:
            fusion = fusion_of(module, plan)
    if fusion == "mlp":  # the whole MLP in the fused op, the weights used in place
        if plan.packed is not None:
            out = _packed_mlp(x, plan, mods, recompute_gate_up, inplace_backward, saved_x12, tile_rows)
        else:  # the usual HF MLP, here (a frame less per call); its modes passed as they are
            try:  # ``linear_params``'s registry reads inline: three frames less on every call
                gate, up, down = mods[plan.gate]._parameters, mods[plan.up]._parameters, mods[plan.down]._parameters
                wg, bg, wu, bu, wd, bd = (gate["weight"], gate["bias"], up["weight"], up["bias"], down["weight"],
                                          down["bias"])
            except KeyError:  # a parametrization or FSDP1's views replaced a registered entry
                (wg, bg), (wu, bu), (wd, bd) = (linear_params(mods[plan.gate]), linear_params(mods[plan.up]),
                                                linear_params(mods[plan.down]))
            # ``swiglu_unpacked``'s body, here: a frame less per call.
            common = common_case(x, wg, bg, wu, bu, wd, bd, False)
            if not common:
                check_unpacked_call(x, wg, bg, wu, bu, wd, bd)
            out = run_feed_forward([x, wg, bg, wu, bu, wd, bd], plan.activation, recompute_gate_up,
                                   inplace_backward, saved_x12, tile_rows, True, True, common)
    else:
        if fused:
            adopt_zero3(module, plan)
        if plan.packed is not None:
            gate, up = _split(mods[plan.packed](x), plan.order)
        else:
            gate, up = mods[plan.gate](x), mods[plan.up](x)
        h = glu_mul(gate, up, plan.activation) if fused else glu_reference(gate, up, plan.activation)
        for name in plan.mid:
            h = mods[name](h)
        out = mods[plan.down](h)
    for name in plan.post:
        out = mods[name](out)
    return out
