"""Hugging Face integration: gated MLPs run the fused op and stay Hugging Face modules.

The narrow, Hugging Face entries of :func:`swiglu_cupy.patch` (which also finds
GLU feed-forwards under any other names and returns a report).

Patch a loaded model, or patch the classes before loading::

    from swiglu_cupy.hf import apply_to, patch_model

    model = AutoModelForCausalLM.from_pretrained(...)
    n = patch_model(model)              # number of MLPs now fused

    apply_to("llama")                   # before loading: the model is built fused
    model = AutoModelForCausalLM.from_pretrained(...)

A patched MLP is an instance of a subclass of its own class (``FusedLlamaMLP``
is a ``LlamaMLP`` and a :class:`SwiGLUMLP`). It keeps its children
``gate_proj``, ``up_proj``, ``down_proj`` (or the packed ``gate_up_proj`` of
Phi-3 and GLM, used in place) and its activation (the very same ``nn.Linear``
objects and parameters: nothing is copied, packed or shared), so
every state_dict key is an attribute path, and Hugging Face's loader,
``tp_plan``, ``_tied_weights_keys``, PEFT's ``target_modules``, accelerate and
quantizers see the model they expect. Only the forward changes:

- plain ``nn.Linear`` projections (no hooks, no replaced forward): the whole MLP
  runs fused (:func:`swiglu_cupy.swiglu_unpacked`: the gate and up GEMMs write
  the halves of one buffer, then one fused activation pass and the down GEMM;
  :func:`swiglu_cupy.swiglu` on a packed ``gate_up_proj.weight``);
- any other projection modules (PEFT LoRA layers, quantized linears, modules
  sharded by a tensor-parallel plan, whose hooks own the collectives): they run
  as themselves and only ``act(gate) * up`` is fused (:func:`swiglu_cupy.glu_mul`).
This is decided at every call, so e.g. PEFT's ``merge_and_unload()`` gives back
the fully fused path.

The activation is recognised by its values (SiLU, GELU tanh as Gemma, GELU
erf, ReLU, sigmoid, identity, quick GELU), never by its class name, with
DeepSeek-V4's clamp ``self.limit``; an MLP built by a patched class whose
activation is none of these runs its original forward. ``patch_model`` also checks each
module's own forward against the fused one on a probe input before patching it,
so look-alikes that compute something else are left alone.

Mixture-of-experts modules (``@use_experts_implementation`` experts) are
switched to swiglu_cupy's experts implementation by ``patch_model`` too and
counted among the patched; importing this module registers that
implementation with transformers' ``ExpertsInterface`` as ``"swiglu_cupy"``
(when transformers is installed, which it then imports), so
``from_pretrained(..., experts_implementation="swiglu_cupy")`` works. See
:mod:`swiglu_cupy.hf_experts`. Everything else works on any ``nn.Module``.
"""
from __future__ import annotations

import dataclasses
import importlib
import sys
import types

import torch
from torch import nn

from .._dtypes import SUPPORTED_DTYPES
from .._validation import check_flags
from ..activations import SILU
from ..reference import glu_reference
from . import hf_experts  # noqa: F401  (registers "swiglu_cupy" with transformers' ExpertsInterface)
from .plan_runner import linear_obstacle, run_plan
from .fused import CLASS_FORMS, FusedGLUMLP, fused_class
from .patching import walk
from .recognition import ACTIVATION_ATTRS, KNOWN_ACTIVATIONS, GLUPlan, hf_candidates, rows_agree

__all__ = ["SwiGLUMLP", "patch_model", "apply_to", "unapply", "patch_mapping", "is_swiglu_mlp", "ACTIVATIONS"]

_HF = ("gate_proj", "up_proj", "down_proj")

#: The fused mixin of a patched MLP (the same class serves every family).
SwiGLUMLP = FusedGLUMLP
#: The activations recognised by value (name -> GLUActivation).
ACTIVATIONS = KNOWN_ACTIVATIONS


def is_swiglu_mlp(module: nn.Module) -> bool:
    """True if ``module`` has plain ``nn.Linear`` ``gate_proj``/``up_proj``/
    ``down_proj`` of compatible shapes and dtype and a SiLU activation (checked
    by value), i.e. a module whose patched forward runs the whole MLP fused. It
    does not run the module's forward (``patch_model`` also does that)."""
    lins = [module._modules.get(name) for name in _HF]
    if not all(isinstance(lin, nn.Module) and linear_obstacle(lin) is None for lin in lins):
        return False  # quantized, LoRA, hooked, ...
    gate, up, down = lins
    w = gate.weight
    if w.dtype not in SUPPORTED_DTYPES or any(lin.weight.dtype != w.dtype or lin.weight.device != w.device
                                              for lin in lins):
        return False
    if up.weight.shape != w.shape or down.weight.shape[1] != w.shape[0]:
        return False
    cands = hf_candidates(module, extra_children_ok=False)
    return cands is not None and cands.reason is None and cands.plans[-1].activation == SILU


# ---- patching instances ----------------------------------------------------------------------

def patch_model(model: nn.Module, strict: bool = False, *, verify: bool = True,
                recompute_gate_up: bool = False, inplace_backward: bool = False, saved_x12=None) -> int:
    """Fuse every Hugging Face style gated MLP and MoE experts module in
    ``model`` in place and return how many were newly patched: the walk of
    :func:`swiglu_cupy.patch` narrowed to Hugging Face's names (the same
    candidates, probe and result for each module it looks at; ``patch`` also
    finds other names and returns a report).

    A module qualifies if it has ``gate_proj``/``up_proj``/``down_proj`` (or a
    packed ``gate_up_proj``, gate rows first, used in place: Phi-3, GLM) and
    an activation (``act_fn``, ``activation_fn`` or ``act``) that computes a
    known kind (SiLU, GELU tanh/erf, ReLU, sigmoid, identity, quick GELU;
    checked on a probe tensor; learnable activations never qualify), an
    optional clamp ``limit`` (DeepSeek-V4), and no other child than dropouts
    and norms. It becomes an instance of ``Fused<its class>`` (a subclass:
    ``isinstance`` checks still hold), with the same children and parameters;
    see :class:`SwiGLUMLP` for what its forward runs. ``recompute_gate_up`` /
    ``inplace_backward`` select the memory modes; ``saved_x12="fp8"`` saves
    x12 in 8 bits (see :func:`swiglu_cupy.patch`).

    With ``verify=True`` (the default) the module's own forward must also match
    the fused one on a probe input. On the meta device (a model built by
    ``from_pretrained`` before it loads weights) the structure check has to
    do. Modules whose ``forward`` was replaced on the instance (accelerate's
    hooks) are left alone: that wrapper would still call the original forward.
    Already patched MLPs and MLPs with unknown activations are untouched.
    ``strict=True`` raises ``ValueError`` if nothing was patched.
    """
    check_flags(strict=strict)
    report = walk(model, {"hf", "experts"}, verify=verify, recompute_gate_up=recompute_gate_up,
                  inplace_backward=inplace_backward, saved_x12=saved_x12)
    patched = len(report.fused) + len(report.partial) + len(report.pending) - len(report.already) + report.experts
    if strict and patched == 0:
        detail = "".join(f"\n  {p or '<model>'}: {r}" for p, r in list(report.skipped.items())[:4])
        detail = (" Candidates with gate/up/down projections whose forward does not compute "
                  f"down(act(gate(x)) * up(x)), or could not be probed:{detail}" if detail else "")
        raise ValueError(
            f"patch_model(strict=True): no GLU MLP found in {type(model).__name__}. A GLU MLP here is "
            "a module with gate_proj, up_proj and down_proj, or gate_up_proj and down_proj (nn.Linear, LoRA, "
            "quantized or other modules) and an activation (act_fn/activation_fn/act) of a known kind. "
            "swiglu_cupy.patch(model) also finds other names and reports why anything was left alone."
            + detail)
    return patched


# ---- patching classes ------------------------------------------------------------------------

# (layout, clamp limit stated as ``self.limit``) of every verified class.
_FORMS = (("separate", False), ("packed", False), ("separate", True), ("packed", True))
_PROBE_LIMIT = 1.5  # hit by the probe's N(0, 9) projections more often than not


def _class_form(cls: type) -> tuple[str, bool] | None:
    """How ``cls.forward`` computes ``down(act(gate(x)) * up(x))``: with
    ``gate_proj``/``up_proj`` (``"separate"``) or a packed ``gate_up_proj``
    (gate rows first), and whether it clamps by ``self.limit`` (DeepSeek-V4),
    checked for two activations on small instances built without
    ``cls.__init__`` (no config needed); None if no form matches."""
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        return None
    if cls in CLASS_FORMS:
        return CLASS_FORMS[cls]
    form = next((f for f in _FORMS if all(_class_matches(cls, *f, act) for act in ("silu", "gelu_tanh"))), None)
    CLASS_FORMS[cls] = form
    return form


def _class_matches(cls: type, layout: str, clamped: bool, act: str) -> bool:
    gen = torch.Generator().manual_seed(0)
    try:
        probe = cls.__new__(cls)
        nn.Module.__init__(probe)
        names = ("gate_proj", "up_proj", "down_proj") if layout == "separate" else ("gate_up_proj", "down_proj")
        widths = ((8, 12), (8, 12), (12, 8)) if layout == "separate" else ((8, 24), (12, 8))
        for name, (n_in, n_out) in zip(names, widths):
            lin = nn.Linear(n_in, n_out, device="meta")
            lin.weight = nn.Parameter(torch.randn(n_out, n_in, generator=gen, device="cpu"))
            lin.bias = nn.Parameter(torch.randn(n_out, generator=gen, device="cpu"))
            setattr(probe, name, lin)
        spec = ACTIVATIONS[act]
        for name in ACTIVATION_ATTRS:
            setattr(probe, name, _Act(spec))
        if clamped:
            probe.limit = _PROBE_LIMIT
            spec = dataclasses.replace(spec, limit=_PROBE_LIMIT)
        plan = GLUPlan(down="down_proj", activation=spec,
                       **(dict(gate="gate_proj", up="up_proj") if layout == "separate" else dict(packed="gate_up_proj")))
        x = torch.randn(6, 8, generator=gen, device="cpu")
        with torch.no_grad():
            return rows_agree(cls.forward(probe, x), run_plan(probe, x, plan), torch.float32)
    except Exception:
        return False


class _Act(nn.Module):
    """A parameter-free activation module computing a known spec (for class probes)."""

    def __init__(self, spec) -> None:
        super().__init__()
        self.spec = spec

    def forward(self, t):
        return glu_reference(t, torch.ones_like(t), self.spec)


def _mlp_classes(target) -> list[tuple[types.ModuleType, str, type]]:
    """``(module, attribute name, original class)`` for each SwiGLU MLP class
    of ``target``: a model type (``"llama"``: the module
    ``transformers.models.llama.modeling_llama``), a module, or a class."""
    if isinstance(target, str):
        name = f"transformers.models.{target}.modeling_{target}"
        try:
            target = importlib.import_module(name)
        except ImportError as e:
            raise ValueError(f"target={target!r}: cannot import {name} ({e}); pass a model type such as "
                             "'llama', a modeling module or an MLP class") from None
    if isinstance(target, types.ModuleType):
        found = []
        for attr, obj in vars(target).items():
            if not (isinstance(obj, type) and "MLP" in attr):
                continue
            base = obj._swiglu_base if issubclass(obj, SwiGLUMLP) else obj
            if base.__module__ == target.__name__ and _class_form(base) is not None:
                found.append((target, attr, base))
        if not found:
            raise ValueError(f"target: no SwiGLU MLP class (an *MLP class whose forward computes "
                             f"down(act(gate(x)) * up(x)) with gate_proj/up_proj or gate_up_proj) in "
                             f"{target.__name__}")
        return found
    if isinstance(target, type):
        base = target._swiglu_base if issubclass(target, SwiGLUMLP) else target
        if _class_form(base) is None:
            raise ValueError(f"target: {base.__qualname__} does not compute down_proj(act(gate(x)) * up(x)) "
                             "with its own gate_proj/up_proj (or gate_up_proj), down_proj and act_fn")
        return [(sys.modules[base.__module__], base.__name__, base)]
    raise TypeError(f"target must be a model type (str), a module or a class, got {type(target).__name__}")


def apply_to(target) -> list[type]:
    """Patch classes before loading: replace the SwiGLU MLP classes of
    ``target`` in their modeling module by their fused subclasses, so that
    models built afterwards (``from_pretrained`` with or without the meta
    device, ``from_config``, direct construction) are fused from the start and
    the loader writes the weights straight into them. ``target``: a model type
    (``"llama"``, ``"mistral"``, ``"qwen2"``, ...), a modeling module, or an MLP
    class. Returns the fused classes; :func:`unapply` restores the originals.
    Each class is checked first (its forward must compute the SwiGLU MLP), and
    each built MLP recognises its activation by value (a GELU config runs the
    original forward)."""
    installed = []
    for module, attr, base in _mlp_classes(target):
        fused = fused_class(base)
        setattr(module, attr, fused)
        installed.append(fused)
    return installed


def unapply(target) -> None:
    """Undo :func:`apply_to` for ``target`` (models already built stay fused)."""
    for module, attr, base in _mlp_classes(target):
        setattr(module, attr, base)


def patch_mapping(target) -> dict[str, type]:
    """``{class name: fused class}`` for ``target`` (as in :func:`apply_to`), for
    transformers' own registry, which swaps the classes only while
    ``from_pretrained`` / ``from_config`` build a model::

        from transformers.monkey_patching import register_patch_mapping
        register_patch_mapping(patch_mapping("llama"))
    """
    return {base.__name__: fused_class(base) for _, _, base in _mlp_classes(target)}
