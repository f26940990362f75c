"""Hugging Face integration: SwiGLU MLPs run the fused op and stay Hugging Face modules.

Patch a loaded model, or patch the classes before loading::

    from swiglu_cupy.hf import apply_to, patch_model

    model = AutoModelForCausalLM.from_pretrained(...)
    n = patch_model(model)              # number of MLPs now fused

    apply_to("llama")                   # before loading: the model is built fused
    model = AutoModelForCausalLM.from_pretrained(...)

A patched MLP is an instance of a subclass of its own class (``FusedLlamaMLP``
is a ``LlamaMLP`` and a :class:`SwiGLUMLP`). It keeps its children
``gate_proj``, ``up_proj``, ``down_proj`` and its activation (the very same
``nn.Linear`` objects and parameters: nothing is copied, packed or shared), so
every state_dict key is an attribute path, and Hugging Face's loader,
``tp_plan``, ``_tied_weights_keys``, PEFT's ``target_modules``, accelerate and
quantizers see the model they expect. Only the forward changes:

- plain ``nn.Linear`` projections (no hooks, no replaced forward): the whole MLP
  runs fused (:func:`swiglu_cupy.swiglu_unpacked`: the gate and up GEMMs write
  the halves of one buffer, then one fused activation pass and the down GEMM);
- any other projection modules (PEFT LoRA layers, quantized linears, modules
  sharded by a tensor-parallel plan, whose hooks own the collectives): they run
  as themselves and only ``act(gate) * up`` is fused (:func:`swiglu_cupy.silu_mul`).
This is decided at every call, so e.g. PEFT's ``merge_and_unload()`` gives back
the fully fused path.

The activation is recognised by its values (today: SiLU), never by its class
name; an MLP built by a patched class whose activation is something else (a
GELU config) runs its original forward. ``patch_model`` also checks each
module's own forward against the fused one on a probe input before patching it,
so look-alikes that compute something else are left alone.

This module does not import ``transformers`` (``apply_to("llama")`` imports the
modeling module it names); it works on any ``nn.Module``.
"""
from __future__ import annotations

import importlib
import sys
import types
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ._sources import SUPPORTED_DTYPES
from ._torch_compat import global_module_hooks_active
from .api import silu_mul, swiglu_unpacked
from .module import SwiGLU, _registered

__all__ = ["SwiGLUMLP", "patch_model", "apply_to", "unapply", "patch_mapping", "is_swiglu_mlp", "ACTIVATIONS"]

_ACT_NAMES = ("act_fn", "activation_fn", "act")
_HF = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class GatedActivation:
    """One gated activation ``h = act(gate) * up``: how it is recognised and what runs it.

    ``reference`` is the elementwise ``act`` the probe compares a module's
    activation with; ``module`` builds it as an ``nn.Module`` (to verify a
    class); ``mlp`` is the whole fused MLP with separate weights
    (``swiglu_unpacked``'s signature); ``glu`` fuses ``act(gate) * up`` alone.
    """
    name: str
    reference: Callable[[torch.Tensor], torch.Tensor]
    module: Callable[[], nn.Module]
    mlp: Callable[..., torch.Tensor]
    glu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


ACTIVATIONS: dict[str, GatedActivation] = {
    "silu": GatedActivation("silu", F.silu, nn.SiLU, swiglu_unpacked, silu_mul),
}


# ---- what a module is ------------------------------------------------------------------------

def _find_act(module: nn.Module):
    for name in _ACT_NAMES:
        act = getattr(module, name, None)
        if act is not None:
            return name, act
    return None, None


def _identify(act, device, dtype) -> str | None:
    """The name of the entry of ACTIVATIONS that the parameter-free callable
    ``act`` computes (checked on a probe tensor), or None."""
    if not callable(act):
        return None
    if isinstance(act, nn.Module) and any(True for _ in act.parameters()):
        return None  # learnable activation: the fused ops would ignore its parameters
    if device is None or device.type == "meta":
        device = torch.device("cpu")
    t = torch.linspace(-12.0, 12.0, 1001, dtype=torch.float32, device=device)
    # Probe in the model's dtype when it is float64; low-precision activations
    # are compared in float32 (their values are identical).
    if dtype == torch.float64:
        t = t.double()
    try:
        with torch.no_grad():
            out = act(t)
    except Exception:
        return None
    if not isinstance(out, torch.Tensor) or out.shape != t.shape:
        return None
    for name, glu in ACTIVATIONS.items():
        if torch.allclose(out.to(t.dtype), glu.reference(t), rtol=1e-5, atol=1e-6):
            return name
    return None


def _activation_of(module: nn.Module) -> str | None:
    """The gated activation of a ``gate_proj``/``up_proj``/``down_proj`` MLP
    with nothing else the fused forward would skip (no other child module, no
    parameter or buffer of its own), or None."""
    if not all(isinstance(getattr(module, name, None), nn.Module) for name in _HF):
        return None
    act_name, act = _find_act(module)
    if act is None:
        return None
    if any(name not in (*_HF, act_name) for name, _ in module.named_children()):
        return None
    if any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False)):
        return None
    spec = _probe_spec(module)
    device, dtype = (spec[1], spec[2]) if spec is not None else (None, torch.get_default_dtype())
    return _identify(act, device, dtype)


def is_swiglu_mlp(module: nn.Module) -> bool:
    """True if ``module`` has plain ``nn.Linear`` ``gate_proj``/``up_proj``/
    ``down_proj`` of compatible shapes and dtype and a SiLU activation (checked
    by value), i.e. a module whose patched forward runs the whole MLP fused. It
    does not run the module's forward (``patch_model`` also does that)."""
    lins = [getattr(module, name, None) for name in _HF]
    if not all(type(lin) is nn.Linear for lin in lins):  # not subclasses (quantized, LoRA, ...)
        return False
    gate, up, down = lins
    w = gate.weight
    if w.dtype not in SUPPORTED_DTYPES or any(lin.weight.dtype != w.dtype or lin.weight.device != w.device
                                              for lin in lins):
        return False
    if up.weight.shape != w.shape or down.weight.shape[1] != w.shape[0]:
        return False
    return _activation_of(module) == "silu"


def _probe_spec(module: nn.Module) -> tuple[int, torch.device, torch.dtype] | None:
    """``(in_features, device, dtype)`` of a probe input for an MLP whose
    projections are arbitrary modules, or None if the input width is unknown.
    The width is ``gate_proj.in_features`` (nn.Linear, PEFT and quantized
    layers have it) or the second dim of a 2-D ``gate_proj.weight``; the
    dtype is that of gate_proj's first floating parameter (a quantized base
    weight is not floating; LoRA adapters come after the base layer)."""
    gate = module.gate_proj
    in_features = getattr(gate, "in_features", None)
    weight = getattr(gate, "weight", None)
    if not isinstance(in_features, int) and isinstance(weight, torch.Tensor) and weight.dim() == 2:
        in_features = weight.shape[1]
    if not isinstance(in_features, int) or isinstance(in_features, bool) or in_features < 1:
        return None
    tensors = [*module.parameters(), *module.buffers()]
    device = tensors[0].device if tensors else torch.device("cpu")
    dtype = next((p.dtype for p in gate.parameters() if p.dtype in SUPPORTED_DTYPES), torch.get_default_dtype())
    return in_features, device, dtype


def _outputs_match(expected_fn, actual_fn, in_features: int, device: torch.device, dtype: torch.dtype) -> bool:
    """Run both on a probe input of ``in_features`` (``device``, ``dtype``):
    equal up to rounding? (A gate/up swap or any other formula differs by O(1).)"""
    if device.type == "meta":
        return True  # nothing to compute with; the structure check has to do
    gen = torch.Generator(device="cpu").manual_seed(1234)
    x = torch.randn(4, in_features, generator=gen, dtype=torch.float32).to(device, dtype)
    try:
        with torch.no_grad():
            expected, actual = expected_fn(x), actual_fn(x)
    except Exception:
        return False
    if not isinstance(expected, torch.Tensor) or not isinstance(actual, torch.Tensor) \
            or expected.shape != actual.shape:
        return False
    e, a = expected.double(), actual.double()
    if not (torch.isfinite(e).all() and torch.isfinite(a).all()):
        return False
    scale = e.pow(2).mean().sqrt().item()
    if scale == 0.0:
        return a.abs().max().item() == 0.0
    # Both sides round differently (fused: one rounding of h); the error is a
    # few ulps of the dtype, relative. A wrong formula is off by O(1).
    tol = {torch.float16: 2e-2, torch.bfloat16: 5e-2}.get(dtype, 1e-4)
    return (e - a).pow(2).mean().sqrt().item() <= tol * scale


# ---- the fused forward -----------------------------------------------------------------------

def _plain_linear(m: nn.Module) -> bool:
    """An ``nn.Linear`` whose call is exactly its forward: no hooks (torch's
    parallel styles, PEFT, offloading) and no replaced forward (Hugging Face's
    tensor-parallel styles and accelerate's hooks replace ``module.forward``)."""
    return (type(m) is nn.Linear and not (m._forward_pre_hooks or m._forward_hooks or m._backward_pre_hooks
                                          or m._backward_hooks) and "forward" not in m.__dict__)


def _fully_fusable(gate: nn.Module, up: nn.Module, down: nn.Module) -> bool:
    return (_plain_linear(gate) and _plain_linear(up) and _plain_linear(down)
            and not global_module_hooks_active())  # global hooks must see each projection's call


def _fused_forward(module: nn.Module, x: torch.Tensor, glu: GatedActivation, recompute_gate_up: bool,
                   inplace_backward: bool) -> torch.Tensor:
    mods = module._modules  # decoding calls this once per token: no nn.Module.__getattr__
    gate, up, down = mods["gate_proj"], mods["up_proj"], mods["down_proj"]
    if _fully_fusable(gate, up, down):
        w = [_registered(lin, "_parameters", name) for lin in (gate, up, down) for name in ("weight", "bias")]
        return glu.mlp(x, *w, recompute_gate_up=recompute_gate_up, inplace_backward=inplace_backward)
    return down(glu.glu(gate(x), up(x)))


class SwiGLUMLP(nn.Module):
    """The fused forward, mixed in front of a model's own MLP class.

    ``FusedLlamaMLP(SwiGLUMLP, LlamaMLP)`` is built once per class (by
    :func:`patch_model`, :func:`apply_to` or :func:`patch_mapping`); the model
    class's ``__init__`` builds it (class-level patching) or ``patch_model``
    switches a built instance to it. Instance attributes:

    - ``swiglu_activation``: the key of :data:`ACTIVATIONS` its activation was
      recognised as, or None (then the original forward runs);
    - ``recompute_gate_up``, ``inplace_backward``: the memory modes of the fused
      op (see :class:`swiglu_cupy.SwiGLUFunction`), settable at any time.

    Pickling (``torch.save(model)``), ``copy.deepcopy`` and ``model.to(...)``
    work; a pickle names the original class, so it loads wherever that class
    imports.
    """
    swiglu_activation: str | None = None
    recompute_gate_up: bool = False
    inplace_backward: bool = False
    _swiglu_base: type = nn.Module

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # Built by a patched class: the class's forward was verified by apply_to /
        # patch_mapping; the activation depends on this instance's config.
        self.swiglu_activation = _activation_of(self)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        glu = ACTIVATIONS.get(self.swiglu_activation)
        if glu is None or args or kwargs:
            return super().forward(x, *args, **kwargs)
        return _fused_forward(self, x, glu, self.recompute_gate_up, self.inplace_backward)

    def fusion(self) -> str | None:
        """What the next forward runs: ``"mlp"`` (the whole MLP fused),
        ``"activation"`` (the projections as their own modules, ``act(gate) * up``
        fused) or None (the original forward)."""
        if self.swiglu_activation not in ACTIVATIONS:
            return None
        return "mlp" if _fully_fusable(self.gate_proj, self.up_proj, self.down_proj) else "activation"

    def __reduce_ex__(self, protocol):
        base = self._swiglu_base
        return _rebuild, (base.__module__, base.__qualname__), self.__dict__.copy()


def _resolve(module_name: str, qualname: str):
    obj = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _rebuild(module_name: str, qualname: str) -> SwiGLUMLP:
    """Unpickling: an empty instance of the fused class of the named original
    class (which apply_to may have replaced by its fused class meanwhile)."""
    cls = _resolve(module_name, qualname)
    return object.__new__(_fused_class(cls))


_FUSED_CLASSES: dict[type, type] = {}


def _fused_class(cls: type) -> type:
    """``Fused<cls>``: SwiGLUMLP's forward in front of ``cls``, one per class."""
    if issubclass(cls, SwiGLUMLP):
        return cls
    fused = _FUSED_CLASSES.get(cls)
    if fused is None:
        fused = type(f"Fused{cls.__name__}", (SwiGLUMLP, cls),
                     {"__module__": __name__, "_swiglu_base": cls,
                      "__doc__": f"{cls.__name__} with swiglu_cupy's fused forward (see SwiGLUMLP)."})
        _FUSED_CLASSES[cls] = fused
    return fused


# ---- patching instances ----------------------------------------------------------------------

def patch_model(model: nn.Module, strict: bool = False, *, verify: bool = True,
                recompute_gate_up: bool = False, inplace_backward: bool = False) -> int:
    """Fuse every SwiGLU MLP in ``model`` in place and return how many were patched.

    A module qualifies if it has ``gate_proj``/``up_proj``/``down_proj`` modules
    and an activation (``act_fn``, ``activation_fn`` or ``act``) that computes
    SiLU (checked on a probe tensor; learnable activations never qualify), and
    no other child module, parameter or buffer. It becomes an instance of
    ``Fused<its class>`` (a subclass: ``isinstance`` checks still hold), with the
    same children and parameters; see :class:`SwiGLUMLP` for what its forward
    runs. ``recompute_gate_up`` / ``inplace_backward`` select the memory modes.

    With ``verify=True`` (the default) the module's own forward must also match
    the fused one on a probe input (so a module whose forward is not
    ``down(silu(gate(x)) * up(x))`` is left alone; projections whose input width
    cannot be told are then left alone too). On the meta device (a model built
    by ``from_pretrained`` before it loads weights) the structure check has to
    do. Modules whose ``forward`` was replaced on the instance (accelerate's
    hooks) are left alone: that wrapper would still call the original forward.
    Already patched MLPs and other MLPs (GELU, GeGLU, ...) are untouched.
    ``strict=True`` raises ``ValueError`` if nothing was patched.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    for name, value in (("recompute_gate_up", recompute_gate_up), ("inplace_backward", inplace_backward),
                        ("verify", verify), ("strict", strict)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    candidates = [(name, module, act) for name, module in model.named_modules()
                  if not isinstance(module, (SwiGLUMLP, SwiGLU)) and (act := _activation_of(module)) is not None]
    patched, skipped = 0, []
    for name, module, act in candidates:
        if "forward" in module.__dict__ or (verify and not _forward_matches(module, act, recompute_gate_up,
                                                                             inplace_backward)):
            skipped.append(name or type(module).__name__)
            continue
        module.__class__ = _fused_class(type(module))
        module.swiglu_activation = act
        module.recompute_gate_up, module.inplace_backward = recompute_gate_up, inplace_backward
        patched += 1
    if strict and patched == 0:
        detail = (f" {len(skipped)} candidate(s) had gate/up/down projections and a SiLU activation "
                  f"but a forward that does not compute down(silu(gate(x)) * up(x)) (or could not be probed): "
                  f"{skipped[:4]}."
                  if skipped else "")
        raise ValueError(
            f"patch_model(strict=True): no SwiGLU MLP found in {type(model).__name__}. A SwiGLU MLP is "
            "a module with gate_proj, up_proj and down_proj (nn.Linear, LoRA, quantized or other "
            "modules) and a SiLU activation (act_fn/activation_fn/act); GELU and GeGLU MLPs are not "
            "patched." + detail)
    return patched


def _forward_matches(module: nn.Module, act: str, recompute_gate_up: bool, inplace_backward: bool) -> bool:
    """The module's own forward and the fused one agree on a probe input (eval
    mode: no dropout)."""
    spec = _probe_spec(module)
    if spec is None:
        return False
    glu, training = ACTIVATIONS[act], module.training
    module.eval()
    try:
        return _outputs_match(module.forward,
                              lambda x: _fused_forward(module, x, glu, recompute_gate_up, inplace_backward), *spec)
    finally:
        module.train(training)


# ---- patching classes ------------------------------------------------------------------------

def _class_computes_swiglu(cls: type) -> bool:
    """``cls.forward`` computes ``down(act(gate(x)) * up(x))`` for every
    activation of ACTIVATIONS, checked on a small instance built without
    ``cls.__init__`` (no config needed): three ``nn.Linear`` and the activation."""
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        return False
    gen = torch.Generator().manual_seed(0)
    for glu in ACTIVATIONS.values():
        probe = cls.__new__(cls)
        nn.Module.__init__(probe)
        for name, (n_in, n_out) in zip(_HF, ((8, 12), (8, 12), (12, 8))):
            lin = nn.Linear(n_in, n_out, device="meta")
            lin.weight = nn.Parameter(torch.randn(n_out, n_in, generator=gen))
            lin.bias = nn.Parameter(torch.randn(n_out, generator=gen))
            setattr(probe, name, lin)
        for name in _ACT_NAMES:
            setattr(probe, name, glu.module())
        if not _outputs_match(lambda x: cls.forward(probe, x), lambda x: _fused_forward(probe, x, glu, False, False),
                              8, torch.device("cpu"), torch.float32):
            return False
    return True


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
            if base.__module__ == target.__name__ and _class_computes_swiglu(base):
                found.append((target, attr, base))
        if not found:
            raise ValueError(f"target: no SwiGLU MLP class (an *MLP class whose forward computes "
                             f"down(silu(gate_proj(x)) * up_proj(x))) in {target.__name__}")
        return found
    if isinstance(target, type):
        base = target._swiglu_base if issubclass(target, SwiGLUMLP) else target
        if not _class_computes_swiglu(base):
            raise ValueError(f"target: {base.__qualname__} does not compute down_proj(silu(gate_proj(x)) * "
                             "up_proj(x)) with its own gate_proj/up_proj/down_proj/act_fn")
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
        fused = _fused_class(base)
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
    return {base.__name__: _fused_class(base) for _, _, base in _mlp_classes(target)}
