"""``patch(model)``: every GLU feed-forward of a model runs the fused op, found by
structure and decided by a probe, with a report of what was done and why.

    report = swiglu_cupy.patch(model)
    print(report)

One walk (:func:`walk`) for every family; the narrow entries are filters over
it. A patched module stays an instance of its own
class: it is switched in place to ``Fused<its class>``, a subclass with
:class:`FusedGLUMLP`'s forward in front (``isinstance`` still holds), and keeps
its children and parameters (state_dict keys unchanged; a packed
``gate_up_proj``/``w12``/``fc1`` is used in place, no copy). What the forward
runs is a per-instance :class:`GLUPlan`: which children hold the gate, the up
(or the packed pair and its order), the down projection, the
:class:`~swiglu_cupy.activations.GLUActivation`, and the children between
the product and ``down`` (dropout, norm) or after it.

Plans come from structure (two or three linear-like children of matching
shapes, an optional activation child recognised by its values), and the probe
decides: the module's own forward and the candidate plan must agree on a probe
input (including rows large enough to hit a clamp), or the module is left alone
with a reason. Where a module's attribute names state the roles
(``gate_proj``/``up_proj``/``down_proj``, ``gate_up_proj``: Hugging Face) the
names are trusted and the probe only verifies them, so a swapped gate order is
caught; elsewhere (``w1``/``w3``/``w2``, ``fc1_g``/``fc1_x``/``fc2``, a packed
``fc1`` with the gate first or last) the probe picks the roles, the order and
the activation among the known kinds. Unknown activations are never
approximated.
"""
from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from typing import Callable

from torch import nn

from .._torch_compat import DROPOUT_CLASSES, global_module_hooks_active
from .._validation import check_flags, check_saved_x12, check_tile_rows
from ..dense.module import SwiGLU
from .plan_runner import _is_noop, _zero3, linear_obstacle, zero3_gathers
from .fused import (FusedGLUMLP, install, install_pending, resolve_pending, switched_base, unmaterialised,
                    zero3_partitioned)
from .olmo_core import is_olmo_core_switchable, olmo_core_skip_reason, patch_olmo_core_module
from .megatron import is_megatron_mlp, megatron_skip_reason, patch_megatron_mlp
from .glu_source import glu_form_reason
from .probe import choose_plan
from .switch_proof import check_switch
from .recognition import GLUPlan, glu_candidates, is_container, takes_one_input
from .torchtitan import is_torchtitan_switchable, patch_torchtitan_class, torchtitan_skip_reason
from .xformers_ops import is_xformers_swiglu, patch_xformers_module

__all__ = ["patch", "PatchReport", "walk", "FAMILIES"]

# ---- the report ------------------------------------------------------------------------------

@dataclass
class PatchReport:
    """What :func:`patch` did. ``fused``: path -> what runs fully fused;
    ``partial``: path -> why only ``act(gate) * up`` is fused (the projections
    run as themselves); ``skipped``: path -> why a module that looked like a GLU
    feed-forward was left alone. ``experts``: Hugging Face MoE experts modules
    switched to the fused implementation. ``classes``: path -> class name.
    The root module's path is ``""``, shown as ``<model>``."""
    fused: dict[str, str] = dataclasses.field(default_factory=dict)
    partial: dict[str, str] = dataclasses.field(default_factory=dict)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    experts: int = 0
    classes: dict[str, str] = dataclasses.field(default_factory=dict)
    #: path -> what is left to decide: modules patched on the meta device,
    #: whose probe runs at their first forward on real weights (or when
    #: ``patch`` is called again after the weights are materialised).
    pending: dict[str, str] = dataclasses.field(default_factory=dict)
    #: Paths among ``fused``/``partial`` that were fused before this call.
    already: list[str] = dataclasses.field(default_factory=list)
    #: path -> why a module of the walk's families that is recognised by its
    #: class (xformers' ``SwiGLU``, torchtitan's) was not patched: it lies
    #: inside a module the walk handled (the GLU feed-forward it is a
    #: projection of, say), which the walk does not look inside.
    unreached: dict[str, str] = dataclasses.field(default_factory=dict)
    #: engine -> what runs under it, for the distributed engines found in the
    #: model (``"DeepSpeed ZeRO-3"``: its parameters are partitioned).
    engines: dict[str, str] = dataclasses.field(default_factory=dict)

    def __len__(self) -> int:
        """Modules whose forward now runs fused code (whole or activation), or
        will once the probe confirms them (``pending``)."""
        return len(self.fused) + len(self.partial) + len(self.pending) + self.experts

    def __str__(self) -> str:
        head = (f"swiglu_cupy.patch: {len(self.fused)} fused, {len(self.partial)} activation only, "
                f"{len(self.skipped)} skipped" + (f", {len(self.pending)} pending" if self.pending else "")
                + (f", {self.experts} MoE experts" if self.experts else ""))
        rows = [(p, self.classes.get(p, ""), status, text)
                for status, table in (("fused", self.fused), ("activation", self.partial),
                                      ("pending", self.pending), ("skipped", self.skipped))
                for p, text in table.items()]
        head += "".join(f"\n  {engine}: {what}" for engine, what in self.engines.items())
        if not rows:
            return head + "\n  (no GLU feed-forward found)"
        rows = [(p or "<model>", c, s, t) for p, c, s, t in rows]
        widths = [max(len(r[i]) for r in rows + [("path", "class", "status", "")]) for i in range(3)]
        lines = [head, "  " + "  ".join(h.ljust(w) for h, w in zip(("path", "class", "status"), widths)) + "  detail"]
        lines += ["  " + "  ".join(v.ljust(w) for v, w in zip(r[:3], widths)) + "  " + r[3] for r in rows]
        return "\n".join(lines)


def _partial_reason(module: nn.Module, plan: GLUPlan) -> str:
    mods = module._modules
    why = []
    projections = [n for n in (plan.packed, plan.gate, plan.up, plan.down) if n]
    gathered = zero3_gathers(module)
    odd = [(n, why_not) for n in projections
           if (why_not := linear_obstacle(mods[n], zero3_gathered=gathered)) is not None]
    if odd:
        why.append(f"{'/'.join(n for n, _ in odd)} run as themselves: " + "; ".join(
            dict.fromkeys(reason for _, reason in odd)))
    for n in plan.mid:
        m = mods[n]
        if not _is_noop(m):
            what = f"{type(m).__name__} p={m.p:g} in training" if isinstance(m, DROPOUT_CLASSES) \
                else type(m).__name__
            why.append(f"{n} ({what}) between the product and {plan.down} runs as itself")
    if not why and global_module_hooks_active():
        why.append("global module hooks are registered")
    return f"{plan.activation}; " + "; ".join(why)


_ZERO3_NOTE = " (DeepSpeed ZeRO-3: parameters gathered as a leaf module)"


def _under_zero3(module: nn.Module) -> bool:
    ds = _zero3()
    return ds is not None and any(ds.zero3_param(p) for p in module.parameters())


def _record(report: PatchReport, path: str, module: nn.Module, note: str = "") -> None:
    plan = module.swiglu_plan
    report.classes[path] = module._swiglu_base.__name__
    if _under_zero3(module) and zero3_gathers(module):
        note += _ZERO3_NOTE
    if module.fusion() == "mlp":
        report.fused[path] = f"{plan.activation}: {plan.describe()}{note}"
    else:
        report.partial[path] = _partial_reason(module, plan) + note


def _record_pending(report: PatchReport, path: str, module: nn.Module) -> None:
    cands = module.swiglu_pending
    report.classes[path] = module._swiglu_base.__name__
    kinds = "; ".join(dict.fromkeys(str(p.activation) for p in cands.plans))
    if zero3_partitioned(module):
        report.pending[path] = (f"partitioned by DeepSpeed ZeRO-3: the probe picks among {len(cands.plans)} plan(s) "
                                f"({kinds}) at its first forward, on the weights its hooks gather as a leaf module")
        return
    report.pending[path] = (f"on the meta device: the probe picks among {len(cands.plans)} plan(s) ({kinds}) "
                            "at its first forward on real weights (or at patch() again)")


def _engine_notes(model: nn.Module, report: PatchReport) -> None:
    """``report.engines``: what runs under DeepSpeed ZeRO-3 when it manages ``model``."""
    if not _under_zero3(model):
        return
    mlps = [m for m in model.modules() if isinstance(m, FusedGLUMLP) and zero3_gathers(m)]
    what = (f"{len(mlps)} fused MLP(s) are leaf modules: their hooks gather gate/up/down once per call "
            "(forward, backward, checkpoint recompute) and the whole MLP runs fused")
    if report.experts:
        what += (f"; {report.experts} MoE experts module(s) run fused on the weights their own (or their "
                 "MoE block's) hooks gather")
    report.engines["DeepSpeed ZeRO-3"] = what


def patch_hf_experts(model: nn.Module, report: PatchReport, recompute_gate_up: bool = False, saved_x12=None,
                     tile_rows=None) -> None:
    """Switch the Hugging Face MoE experts modules of ``model`` to swiglu_cupy's
    experts implementation (:mod:`swiglu_cupy.hf_experts`): ``report.experts``
    counts those that run fused, ``report.skipped`` names the others with the
    reason (they keep the implementation they had)."""
    if "transformers.integrations.moe" not in sys.modules:
        return  # no experts class was ever defined in this process: none can be in the model
    from . import hf_experts

    plans = hf_experts.experts_plans(model, recompute_gate_up=recompute_gate_up, saved_x12=saved_x12,
                                     tile_rows=tile_rows)
    for path, plan in plans.items():
        if plan.activation is None:
            report.classes[path] = type(model.get_submodule(path)).__name__
            report.skipped[path] = f"Hugging Face experts, left on {plan.fallback!r}: {plan.reason}"
    report.experts = sum(plan.activation is not None for plan in plans.values())


#: What a walk can be narrowed to: Hugging Face's MLP names, GLU feed-forwards
#: under any other names, xformers' SwiGLU, Hugging Face MoE experts,
#: torchtitan's MoE ``GroupedExperts``, OLMo-core's stacked MoE experts and nGPT
#: feed-forward, megatron-core's ``MLP`` (dense and SequentialMLP's experts). The
#: narrow entries (``hf.patch_model``, ``xformers.patch_xformers``) are
#: :func:`walk` over some of them: the same candidates, probe and result.
FAMILIES = frozenset({"hf", "generic", "xformers", "experts", "torchtitan", "olmo_core", "megatron"})
_FAMILY_WORDS = {"hf": "under Hugging Face's names", "generic": "under other names"}
_FAMILY_ENTRY = {"hf": "swiglu_cupy.patch or hf.patch_model", "generic": "swiglu_cupy.patch"}


@dataclasses.dataclass(frozen=True)
class _ClassSwitch:
    """A library whose modules the walk knows by their class and switches
    (``fused.switched_class``) without a probe: its family, its name in the
    report, and its module's test and patch (``patch(module, options)``: the
    walk's options by name -> the report line, or None exactly when
    ``skip_reason(module)`` says why not)."""
    family: str
    name: str
    matches: Callable[[nn.Module], bool]
    patch: Callable[[nn.Module, dict], str | None]  # (module, options)
    skip_reason: Callable[[nn.Module], str | None]
    #: Whether the switch is proved by running the module's own forward
    #: against the fused one (``integrations.switch_proof``) before it is kept.
    proved: bool = True


_CLASS_SWITCHES = (
    _ClassSwitch("torchtitan", "torchtitan", is_torchtitan_switchable,
                 lambda m, options: patch_torchtitan_class(m, options["recompute_gate_up"], options["tile_rows"]),
                 torchtitan_skip_reason),
    _ClassSwitch("olmo_core", "OLMo-core", is_olmo_core_switchable,
                 lambda m, options: patch_olmo_core_module(m, **options), olmo_core_skip_reason),
    _ClassSwitch("megatron", "megatron-core", is_megatron_mlp, lambda m, options: patch_megatron_mlp(m, **options),
                 megatron_skip_reason, proved=False),  # accepted from its version and config: integrations.megatron
)


def _class_switch(module: nn.Module) -> _ClassSwitch | None:
    return next((library for library in _CLASS_SWITCHES if library.matches(module)), None)


def _family_of_class(module: nn.Module) -> str | None:
    """The family of a module recognised by its class alone (not by structure)."""
    if is_xformers_swiglu(module):
        return "xformers"
    library = _class_switch(module)
    return None if library is None else library.family


#: GLU experts classes of other libraries that the walk recognises by class
#: (module path, class name; subclasses included) and leaves alone, with the
#: reason, so that nothing it meets and does not fuse goes unreported. Looked
#: up only where the library is already imported.
#: (OLMo-core's ``MoEMLP`` and ``DroplessMoEMLP`` themselves are fused by
#: ``integrations.olmo_core`` before this lookup; what else derives from their base
#: is named here.)
KNOWN_UNFUSED = {
    ("olmo_core.nn.moe.mlp", "MoEMLPBase"): (
        "OLMo-core's stacked experts of a class other than MoEMLP or DroplessMoEMLP, whose forward "
        "swiglu_cupy does not reproduce; left as is"),
    ("olmo_core.nn.moe.v2.routed_experts", "RoutedExperts"): (
        "OLMo-core's v2 routed experts (moe_fused_v2: packed w_up_gate, its own activations and "
        "grouped GEMMs): not a class swiglu_cupy fuses yet; left as is"),
    ("megatron.core.transformer.moe.experts", "GroupedMLP"): (
        "megatron-core's GroupedMLP (weight1/weight2 stacked over the local experts, run by the grouped_gemm "
        "CUDA package, which it requires to be built: it cannot run on the CPU, so its parity is unchecked): "
        "not fused; left as is (SequentialMLP's experts are megatron MLPs, fused)"),
    ("megatron.core.extensions.transformer_engine", "TEGroupedMLP"): (
        "megatron-core's TEGroupedMLP: Transformer Engine's grouped linears; left as is"),
}


def known_unfused_reason(module: nn.Module) -> str | None:
    """Why ``module``, an instance of a class in ``KNOWN_UNFUSED``, is left alone; else None."""
    for (module_name, class_name), reason in KNOWN_UNFUSED.items():
        cls = getattr(sys.modules.get(module_name), class_name, None)
        if cls is not None and isinstance(module, cls):
            return reason
    return None


def _fsdp2_reason(module: nn.Module) -> str | None:
    """Why ``module`` is not probed, where FSDP2 had sharded it before patch():
    outside the forward of the module ``fully_shard`` got, its weights are
    DTensor shards (the probe's call fails), and where ``fully_shard`` got a
    projection itself (litgpt's parallelize_fn shards every Linear) the
    probe's call would run that projection's FSDP hooks before the root's
    first forward: FSDP's lazy init takes it for a root, and the first
    training step raises ("FSDP requires running forward through the root
    module first")."""
    if "torch.distributed.fsdp" not in sys.modules:
        return None  # FSDP2 cannot manage a module of a process that never imported it
    from .. import _distributed_compat

    if not _distributed_compat.fsdp_managed(module):
        return None
    return ("not probed: sharded by FSDP2 (fully_shard on it or an ancestor) before patch(), its weights are "
            "DTensor shards outside the forward of the module fully_shard got; left as is (patch before sharding)")


def walk(model: nn.Module, families=FAMILIES, *, verify: bool = True, recompute_gate_up: bool = False,
         inplace_backward: bool = False, saved_x12=None, tile_rows=None) -> PatchReport:
    """The one walk over ``model`` (itself included): each module is looked at
    once, outermost first; a module that is handled (fused, skipped with a
    reason, or left out by ``families``) is not searched inside. Containers
    (``nn.Sequential``, ``ModuleList``, ``ModuleDict``) are never candidates,
    and a candidate under other names that is refused is always searched
    inside, whatever ``families`` holds: every narrowed walk reaches exactly
    the modules of its families that the whole walk reaches."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    check_flags(verify=verify, recompute_gate_up=recompute_gate_up, inplace_backward=inplace_backward)
    check_saved_x12(saved_x12, recompute_gate_up, inplace_backward)
    check_tile_rows(tile_rows)
    unknown = set(families) - FAMILIES
    if unknown:
        raise ValueError(f"families must be a subset of {sorted(FAMILIES)}, got {sorted(unknown)}")
    report = PatchReport()
    handled: dict[str, str] = {}  # path -> what the walk took it for (it does not look inside)
    modes = (recompute_gate_up, inplace_backward)
    options = {"recompute_gate_up": recompute_gate_up, "inplace_backward": inplace_backward,
               "saved_x12": saved_x12, "tile_rows": tile_rows}
    for path, module in model.named_modules(remove_duplicate=True):
        outer = next((p for p in handled if p == "" or path.startswith(p + ".")), None)
        if outer is not None:  # inside a module already handled: its projections
            if _family_of_class(module) in families:
                report.unreached[path] = f"inside {outer or '<model>'} ({handled[outer]})"
            continue
        if isinstance(module, SwiGLU):
            handled[path] = "swiglu_cupy.SwiGLU"
            continue
        if isinstance(module, FusedGLUMLP):
            handled[path] = f"{module._swiglu_base.__name__}, already switched to the fused class"
            if module.swiglu_family not in families:
                continue
            pending = module.swiglu_pending is not None
            refused = resolve_pending(module) if pending else None
            if refused is not None:
                report.classes[path] = module._swiglu_base.__name__
                report.skipped[path] = f"patched on the meta device, then refused by the probe: {refused}"
            elif module.swiglu_pending is not None:
                _record_pending(report, path, module)
            elif module.swiglu_plan is not None:
                _record(report, path, module, " (decided now: patched on the meta device)" if pending
                        else " (already fused)")
                report.already.append(path)
            continue
        if is_xformers_swiglu(module):
            handled[path] = "xformers.ops.SwiGLU"
            if "xformers" in families:
                report.classes[path] = type(module).__name__
                report.fused[path] = patch_xformers_module(module)
            continue
        library = _class_switch(module)
        if library is not None:
            base = switched_base(module).__name__
            handled[path] = f"{library.name} {base}"
            if library.family in families:
                report.classes[path] = base
                note = library.patch(module, options)
                refused, pending = check_switch(module) if note is not None and library.proved else (None, False)
                if note is None:  # the patch refuses exactly when there is a reason
                    report.skipped[path] = library.skip_reason(module)
                elif refused is not None:
                    report.skipped[path] = refused
                else:
                    if note.endswith("(already fused)"):
                        report.already.append(path)
                    if pending:
                        note += ("; proved against its own forward at its first forward on real weights "
                                 "(its own forward runs until then)")
                    report.fused[path] = note
            continue
        found = glu_candidates(module)
        if found is None:
            reason = known_unfused_reason(module)
            if reason is not None:  # experts of a known library, not fused: said, never silent
                handled[path] = type(module).__name__
                report.classes[path] = type(module).__name__
                report.skipped[path] = reason
            continue
        cands, family = found
        # Decided alike in every walk, whatever its families: whether the walk
        # looks inside a generic candidate depends on the probe's verdict.
        plan, reason = None, cands.reason
        pending = reason is None and verify and unmaterialised(module)
        if reason is None and not pending and (family in families or family == "generic"):
            reason = _fsdp2_reason(module)
            if reason is None:
                plan, reason = choose_plan(module, cands, verify, modes)
        if family in families:
            report.classes[path] = type(module).__name__
            if reason is not None:
                report.skipped[path] = reason
            elif pending:
                install_pending(module, cands, recompute_gate_up, inplace_backward, family)
                module.saved_x12, module.tile_rows = saved_x12, tile_rows
                _record_pending(report, path, module)
            else:
                install(module, plan, recompute_gate_up, inplace_backward, family)
                module.saved_x12, module.tile_rows = saved_x12, tile_rows
                _record(report, path, module)
        if reason is not None and family == "generic":
            continue  # shaped like one by accident (a block of blocks?): look inside
        handled[path] = f"{type(module).__name__}: a GLU feed-forward {_FAMILY_WORDS[family]}" + (
            "" if family in families else f" (left to {_FAMILY_ENTRY[family]})") + (
            f", left alone: {reason}" if reason is not None else "") + ", whose children are its projections"
    if "experts" in families:
        patch_hf_experts(model, report, recompute_gate_up, saved_x12, tile_rows)
    if "generic" in families:
        _name_unrecognised_gated_units(model, report, handled)
    _engine_notes(model, report)
    return report


def _name_unrecognised_gated_units(model: nn.Module, report: PatchReport, handled: dict) -> None:
    """The walk's safety net: a feed-forward or experts module it did not
    recognise whose forward computes a gated unit (read from its source,
    :mod:`.glu_source`) goes into ``report.skipped`` with the reason, never
    unreported. Innermost first; not inside a handled module, nor around a
    module handled, reported, or of Hugging Face's experts (their MoE blocks
    gate shared experts: not a feed-forward of their own)."""
    experts_class = _hf_experts_test()
    taken = set(handled) | set(report.fused) | set(report.partial) | set(report.skipped) | set(report.pending)
    modules = list(model.named_modules(remove_duplicate=True))
    taken |= {path for path, module in modules if experts_class(module)}
    around = {a for t in taken for a in _ancestors(t)}  # paths that hold a taken module

    for path, module in reversed(modules):
        if path in taken or path in around or is_container(module) or any(a in handled for a in _ancestors(path)):
            continue
        reason = glu_form_reason(module, takes_one_input)
        if reason is not None:
            report.classes[path] = type(module).__name__
            report.skipped[path] = reason
            taken.add(path)
            around.update(_ancestors(path))


def _ancestors(path: str) -> list[str]:
    """The paths of the modules that hold the one at ``path`` ("" is the model)."""
    if not path:
        return []
    parts = path.split(".")
    return [""] + [".".join(parts[:i]) for i in range(1, len(parts))]


def _hf_experts_test() -> Callable[[nn.Module], bool]:
    if "transformers.integrations.moe" not in sys.modules:
        return lambda module: False
    from . import hf_experts

    return hf_experts.is_hf_experts


def patch(model: nn.Module, *, strict: bool = False, verify: bool = True, recompute_gate_up: bool = False,
          inplace_backward: bool = False, saved_x12=None, tile_rows=None) -> PatchReport:
    """Fuse every GLU feed-forward in ``model`` (the model itself included), in
    place, and return a :class:`PatchReport`.

    It walks the model once and finds, by structure: Hugging Face MLPs
    (``gate_proj``/``up_proj``/``down_proj`` or a packed ``gate_up_proj``,
    with any known activation and a stated clamp ``limit``), xformers'
    ``SwiGLU`` (given swiglu_cupy's op), packed-``w12`` modules (DINOv2),
    timm's ``GluMlp`` (either gate order), ``SwiGLU`` and ``SwiGLUPacked``,
    three-projection modules under any names (torchtitan's ``w1``/``w3``/
    ``w2``), torchtitan's MoE ``GroupedExperts`` (``w1_EFD``/``w3_EFD`` or the
    fused ``w13``; decided from the class, also on meta), OLMo-core's stacked
    MoE experts (``MoEMLP``, ``DroplessMoEMLP``) and nGPT's ``NormalizedFeedForward``
    (from the class), megatron-core's ``MLP`` with the local linears (dense, and
    SequentialMLP's experts; decided from the class and config, TP included) and
    Hugging Face MoE experts. On the meta device, where nothing can be computed, modules are
    switched undecided (``report.pending``) and the probe decides at their
    first forward on real weights. A module is patched only if its own
    forward agrees with the fused one on a probe input (``verify=False``
    trusts Hugging Face names without probing). Fused modules keep their
    children and parameters: state_dict keys and checkpoints stay those of the
    unpatched model. Patching again changes nothing; already fused modules are
    reported again as such. ``recompute_gate_up``/``inplace_backward`` select
    the memory modes; ``saved_x12="fp8"`` saves x12 in 8 bits in the fused
    MLPs (whole-MLP fusion) and Hugging Face experts (torchtitan's and
    OLMo-core's experts and xformers' modules keep theirs). ``tile_rows`` (an int or ``"auto"``) runs the
    whole-MLP fused modules and the Hugging Face experts in row tiles for long inputs
    (see :func:`swiglu_cupy.swiglu`). ``strict=True`` raises ``ValueError`` if nothing is fused.
    """
    check_flags(strict=strict)
    report = walk(model, FAMILIES, verify=verify, recompute_gate_up=recompute_gate_up,
                  inplace_backward=inplace_backward, saved_x12=saved_x12, tile_rows=tile_rows)
    if strict and not len(report):
        detail = "".join(f"\n  {p or '<model>'}: {r}" for p, r in list(report.skipped.items())[:8])
        raise ValueError(f"patch(strict=True): nothing fused in {type(model).__name__}: no GLU feed-forward "
                         "(gate/up/down projections, packed or not, with a known activation) whose forward "
                         "the probe could confirm." + (" Left alone:" + detail if detail else ""))
    return report
