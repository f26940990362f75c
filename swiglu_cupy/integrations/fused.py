"""The fused forward a patched module runs, and the class machinery that
installs it: a patched module becomes an instance of ``Fused<its class>``, a
subclass with :class:`FusedGLUMLP`'s forward in front, whose per-instance
:class:`~swiglu_cupy.integrations.recognition.GLUPlan` says which children
hold the gate, the up and the down projection.

:func:`switched_class` is the one mechanism for such classes, here and for
torchtitan's, OLMo-core's and megatron-core's modules (``integrations.torchtitan``,
``integrations.olmo_core``, ``integrations.megatron``): one subclass per (kind,
base), which records its base and pickles as an instance of it."""
from __future__ import annotations

import functools
import importlib
import warnings

import torch
from torch import nn

from ..activations import GLUActivation
from ..kernels.launch import strict_mode
from .plan_runner import _zero3, fusion_of, run_plan, unproven_dropout_active
from .probe import choose_plan
from .recognition import Candidates, GLUPlan, hf_candidates

__all__ = ["FusedGLUMLP", "fused_class", "install", "install_pending", "CLASS_FORMS", "unmaterialised",
           "zero3_partitioned", "switched_class", "switched_base"]

class FusedGLUMLP(nn.Module):
    """The fused forward, mixed in front of a module's own class.

    ``Fused<cls>(FusedGLUMLP, cls)`` is built once per class; :func:`patch`
    (or ``hf.patch_model``) switches a built instance to it, ``hf.apply_to``
    makes the model build it. Instance attributes:

    - ``swiglu_plan``: its :class:`GLUPlan`, or None (the original forward runs);
    - ``swiglu_pending``: patched on the meta device, where nothing can be
      computed: the candidate plans, chosen (or all refused) by the probe at
      the first forward on real weights, before anything runs fused (or by
      patching again); None once decided;
    - ``recompute_gate_up``, ``inplace_backward``: the memory modes of the fused
      op (see :class:`swiglu_cupy.SwiGLUFunction`), settable at any time;
    - ``saved_x12``: None, or ``"fp8"`` to save x12 in 8 bits when the whole
      MLP runs fused (see :func:`swiglu_cupy.swiglu`);
    - ``tile_rows``: None, rows per tile or ``"auto"``: the whole fused MLP
      runs long inputs in row tiles (see :func:`swiglu_cupy.swiglu`).

    Pickling (``torch.save(model)``), ``copy.deepcopy`` and ``model.to(...)``
    work; a pickle names the original class, so it loads wherever that class
    imports.
    """
    swiglu_plan: GLUPlan | None = None
    swiglu_family: str = "hf"  # how the walk found it (built by an apply_to class: Hugging Face names)
    swiglu_pending: Candidates | None = None
    recompute_gate_up: bool = False
    inplace_backward: bool = False
    saved_x12: str | None = None
    tile_rows: int | str | None = None
    _swiglu_base: type = nn.Module

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # Built by a class patched with hf.apply_to: the class's form was
        # verified there; the activation depends on this instance's config.
        self.swiglu_plan = _plan_of_built_instance(self)
        if self.swiglu_plan is not None:
            _gather_as_leaf(self)  # built under deepspeed.zero.Init: whole from the first call
            _decide_now(self)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if self.swiglu_pending is not None:
            resolve_pending(self)
        plan = self.swiglu_plan
        if plan is None or args or kwargs or (plan.dropout_unproven and unproven_dropout_active(self, plan)):
            return super().forward(x, *args, **kwargs)
        return run_plan(self, x, plan, self.recompute_gate_up, self.inplace_backward, True, self.saved_x12,
                        self.tile_rows)  # positional: binding keywords costs more per call

    @property
    def swiglu_activation(self) -> GLUActivation | None:
        return None if self.swiglu_plan is None else self.swiglu_plan.activation

    def fusion(self) -> str | None:
        """What the next forward runs: ``"mlp"`` (the whole MLP fused),
        ``"activation"`` (the projections as their own modules, ``act(gate) * up``
        fused) or None (the original forward: unfused, or a dropout whose
        placement was unproven at the probe now drops)."""
        return fusion_of(self, self.swiglu_plan)


# ---- switched classes: one mechanism for every kind -----------------------------------------

#: Each kind's factory ``base -> switched class``, by name: a pickle loading
#: in a fresh process imports it (no import cycle between the kinds' modules).
SWITCH_FACTORIES = {"glu_mlp": (__name__, "fused_class"),
                    "torchtitan": ("swiglu_cupy.integrations.torchtitan", "fused_torchtitan_class"),
                    "olmo_core": ("swiglu_cupy.integrations.olmo_core", "fused_olmo_core_class"),
                    "megatron": ("swiglu_cupy.integrations.megatron", "fused_megatron_class")}
_SWITCHED: dict[tuple[str, type], type] = {}


def switched_class(kind: str, base: type, make) -> type:
    """The one subclass of ``base`` of this ``kind`` (a key of
    ``SWITCH_FACTORIES``) that a module is switched to in place. The first
    call makes it from ``make(base) -> (name, bases, namespace)``; it records
    ``_swiglu_base`` and ``_swiglu_kind``, and pickles (``torch.save``,
    ``copy.deepcopy``) as an instance of ``base`` switched back on load, so a
    pickle names the original class and loads wherever that class imports."""
    switched = _SWITCHED.get((kind, base))
    if switched is None:
        name, bases, namespace = make(base)
        switched = type(name, bases, {**namespace, "_swiglu_base": base, "_swiglu_kind": kind,
                                      "__reduce_ex__": _reduce_switched})
        _SWITCHED[(kind, base)] = switched
    return switched


def switched_base(module: nn.Module) -> type:
    """The class a switched module came from (else its own class)."""
    return getattr(type(module), "_swiglu_base", type(module))


def _reduce_switched(self, protocol):
    base = type(self)._swiglu_base
    return _rebuild_switched, (type(self)._swiglu_kind, base.__module__, base.__qualname__), self.__dict__.copy()


def _rebuild_switched(kind: str, module_name: str, qualname: str) -> nn.Module:
    """Unpickling: an empty instance of the switched class of the named
    original class (nn.Module.__setstate__ then restores its state)."""
    factory_module, factory = SWITCH_FACTORIES[kind]
    return object.__new__(getattr(importlib.import_module(factory_module), factory)(_resolve(module_name, qualname)))


def _rebuild(module_name: str, qualname: str) -> FusedGLUMLP:
    """What pickles written before ``switched_class`` name: a fused MLP."""
    return _rebuild_switched("glu_mlp", module_name, qualname)


def _resolve(module_name: str, qualname: str):
    obj = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def fused_class(cls: type) -> type:
    """``Fused<cls>``: FusedGLUMLP's forward in front of ``cls``, one per class
    (apply_to may have replaced the original class by it meanwhile)."""
    if issubclass(cls, FusedGLUMLP):
        return cls
    return switched_class("glu_mlp", cls, lambda base: (
        f"Fused{base.__name__}", (FusedGLUMLP, base),
        {"__module__": __name__,
         "__doc__": f"{base.__name__} with swiglu_cupy's fused forward (see FusedGLUMLP)."}))


def install(module: nn.Module, plan: GLUPlan | None, recompute_gate_up: bool, inplace_backward: bool,
            family: str = "hf") -> None:
    """Switch ``module`` to its fused class, running ``plan``. ``family``: the
    walk's name for how it was found (``"hf"`` names or ``"generic"``)."""
    module.__class__ = fused_class(type(module))
    module.swiglu_plan = plan
    module.swiglu_pending = None
    module.swiglu_family = family
    module.recompute_gate_up, module.inplace_backward = recompute_gate_up, inplace_backward
    _gather_as_leaf(module)
    _decide_now(module)


def _decide_now(module: nn.Module) -> None:
    """Whole MLP or activation only, decided when the plan is set (at patch
    time, or at the first forward of a pending module): each call then only
    compares the state it was decided on (``plan_runner.fusion_of``)."""
    if module.swiglu_plan is not None:
        fusion_of(module, module.swiglu_plan)


def _gather_as_leaf(module: nn.Module) -> None:
    """With DeepSpeed loaded, make ``module`` a ZeRO-3 leaf: the fused
    forward reads its children's weights without calling them, so under
    ZeRO-3 its own hooks must gather them (set before deepspeed.initialize,
    the children get no hooks at all). Harmless without ZeRO-3: only ZeRO-3
    reads the flag. Loaded only later: :func:`plan_runner.adopt_zero3`."""
    ds = _zero3()
    if ds is not None:
        ds.mark_zero3_leaf(module)


def on_meta(module: nn.Module) -> bool:
    return any(t.device.type == "meta" for t in (*module.parameters(), *module.buffers()))


def zero3_partitioned(module: nn.Module) -> bool:
    """Whether DeepSpeed ZeRO-3 holds some of ``module``'s parameters
    partitioned now (built under ``deepspeed.zero.Init``, or after
    ``deepspeed.initialize``, outside a forward): their data is empty."""
    ds = _zero3()
    return ds is not None and any(ds.zero3_partitioned(p) for p in module.parameters())


def unmaterialised(module: nn.Module) -> bool:
    """Nothing can be computed with ``module``'s weights now: on the meta
    device, or partitioned by ZeRO-3 (gathered in its forward)."""
    return on_meta(module) or zero3_partitioned(module)


def install_pending(module: nn.Module, cands: Candidates, recompute_gate_up: bool, inplace_backward: bool,
                    family: str) -> None:
    """Switch a module on the meta device (or partitioned by ZeRO-3) to its
    fused class, undecided: it runs its original forward until
    :func:`resolve_pending` (at its first forward on real, or gathered,
    weights) lets the probe choose among ``cands``."""
    install(module, None, recompute_gate_up, inplace_backward, family)
    module.swiglu_pending = cands


def _own_forward(module: FusedGLUMLP):
    """The module's original forward (what the probe compares with)."""
    return functools.partial(module._swiglu_base.forward, module)


_resolve_untraced = None


def resolve_pending(module: FusedGLUMLP) -> str | None:
    """:func:`_resolve_pending`, never traced (torch.compile runs it eagerly:
    one graph break at the first call). Wrapped at the first call, since
    ``torch.compiler.disable`` imports torch._dynamo (and FSDP with it)."""
    global _resolve_untraced
    if _resolve_untraced is None:
        _resolve_untraced = torch.compiler.disable(_resolve_pending)
    return _resolve_untraced(module)


def _resolve_pending(module: FusedGLUMLP) -> str | None:
    """Decide a module patched on the meta device (or partitioned by ZeRO-3),
    once its weights are real (or gathered: in its forward, ZeRO-3 gathered
    them as a leaf): the probe picks the plan (or refuses them all: then the
    original forward runs from now on, after one warning naming why;
    ``SWIGLU_CUPY_STRICT=1`` makes that an error). Returns the refusal's
    reason, or None. On meta still (a shape-only forward), or partitioned
    (outside a forward): nothing is decided yet."""
    cands = module.swiglu_pending
    if cands is None or unmaterialised(module):
        return None
    module.swiglu_pending = None
    plan, reason = choose_plan(module, cands, True, (module.recompute_gate_up, module.inplace_backward),
                               own_forward=_own_forward(module))
    module.swiglu_plan = plan
    _decide_now(module)
    if plan is None:
        message = (f"swiglu_cupy: a {module._swiglu_base.__name__} patched on the meta device (or partitioned by "
                   f"ZeRO-3) was checked at its first forward and runs its original forward: {reason}")
        refuse_at_first_forward(message, stacklevel=4)
    return reason


def refuse_at_first_forward(message: str, stacklevel: int) -> None:
    """A module decided at its first forward keeps its original forward:
    warn (``stacklevel`` counted from the caller of this function's caller
    frame, as ``warnings.warn``'s), or raise under ``SWIGLU_CUPY_STRICT=1``."""
    if strict_mode():
        raise RuntimeError(message)
    warnings.warn(message, RuntimeWarning, stacklevel=stacklevel)


# ---- classes verified as a whole (hf.apply_to) ----------------------------------------------

#: ``{original class: (layout, clamped)}`` for each class whose forward
#: ``hf.apply_to`` verified: ``"separate"`` (gate_proj/up_proj) or
#: ``"packed"`` (gate_up_proj, gate rows first), and whether it clamps by
#: ``self.limit`` (DeepSeek-V4); None where no form matched.
CLASS_FORMS: dict[type, tuple[str, bool] | None] = {}


def _plan_of_built_instance(module: nn.Module) -> GLUPlan | None:
    """The plan of an MLP built by a verified class: the class's form, the
    activation this instance's config chose (by value; an unknown one: None,
    the original forward)."""
    form = CLASS_FORMS.get(module._swiglu_base)
    cands = hf_candidates(module, extra_children_ok=False) if form is not None else None
    if cands is None or cands.reason is not None:
        return None
    clamped = form[1]
    return next((p for p in cands.plans if (p.activation.limit is not None) == clamped), None)
