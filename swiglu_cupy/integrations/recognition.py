"""What structure and values say about a module: the plans a GLU feed-forward
could run (:class:`GLUPlan`), the activations recognised by value
(:data:`KNOWN_ACTIVATIONS`, :func:`identify_activation`), the candidate plans
of a module under Hugging Face's names or any names (:func:`hf_candidates`,
:func:`generic_candidates`), and the one tolerance policy every probe uses
(:func:`rows_agree`). Nothing here changes a module."""
from __future__ import annotations

import dataclasses
import functools
import inspect
from dataclasses import dataclass

import torch
from torch import nn

from .._torch_compat import BATCH_NORM_CLASSES, DROPOUT_CLASSES
from ..activations import GLUActivation
from ..reference import glu_reference

__all__ = ["GLUPlan", "Candidates", "KNOWN_ACTIVATIONS", "identify_activation", "glu_candidates", "hf_candidates",
           "generic_candidates", "is_container", "rows_agree", "find_act", "limit_of"]

#: The elementwise activations recognised by value, as specs of ``act(gate) * up``
#: (``quick_gelu``, ``x * sigmoid(1.702 x)``, is the OAI form without offset).
KNOWN_ACTIVATIONS: dict[str, GLUActivation] = {
    "silu": GLUActivation("silu"), "gelu_tanh": GLUActivation("gelu_tanh"), "gelu": GLUActivation("gelu"),
    "relu": GLUActivation("relu"), "sigmoid": GLUActivation("sigmoid"), "identity": GLUActivation("identity"),
    "quick_gelu": GLUActivation("oai", alpha=1.702),
}
ACTIVATION_ATTRS = ("act_fn", "activation_fn", "act")
_LIMIT_NAMES = ("limit", "swiglu_limit", "clamp_limit")
_ORDERS = ("gate_first", "gate_last", "interleaved")


@dataclass(frozen=True)
class GLUPlan:
    """What a fused module's forward runs: ``post(down(mid(act(gate) * up)))``.

    ``gate``/``up``: child names of separate projections, or ``packed``: the
    child holding both, in ``order`` (``"gate_first"``: ``[gate | up]`` rows,
    ``"gate_last"``: ``[up | gate]``, ``"interleaved"``: ``[g0, u0, g1, ...]``).
    ``mid``: children applied to the product before ``down`` (dropout, norm);
    ``post``: children applied after ``down`` (dropout)."""
    down: str
    activation: GLUActivation
    gate: str | None = None
    up: str | None = None
    packed: str | None = None
    order: str = "gate_first"
    mid: tuple[str, ...] = ()
    post: tuple[str, ...] = ()
    #: Dropouts among ``mid``/``post`` whose placement the probe could not
    #: check (their rate was 0 then): while any of them drops (training, rate
    #: > 0) the module runs its own forward, never a guessed placement.
    dropout_unproven: tuple[str, ...] = ()

    @functools.cached_property
    def projections(self) -> tuple[str, ...]:
        """The projections' child names: packed and down, or gate, up and down."""
        return (self.packed, self.down) if self.packed else (self.gate, self.up, self.down)

    @functools.cached_property
    def packed_activation(self) -> GLUActivation:
        """The spec for the packed weight's layout, built once (the fused forward runs per token)."""
        return dataclasses.replace(self.activation, interleaved=True) if self.order == "interleaved" else self.activation

    def describe(self) -> str:
        if self.packed is not None:
            layout = f"{self.packed} ({self.order.replace('_', ' ')})"
        else:
            layout = f"{self.gate}/{self.up}"
        return f"{layout} -> {self.down}"


# ---- the one tolerance policy ---------------------------------------------------------------

#: ``(rtol, atol)`` per dtype: two computations of one formula agree when
#: each row's RMS error is at most ``rtol`` of that row's RMS plus ``atol``.
#: That is a few ulps (the fused op rounds h once, eager twice; GEMMs sum in
#: other orders), far below the O(1) error of a wrong formula.
AGREEMENT = {torch.float16: (2e-2, 0.0), torch.bfloat16: (5e-2, 0.0), torch.float32: (1e-4, 1e-6),
             torch.float64: (1e-9, 1e-12)}


def rows_agree(expected, actual, dtype: torch.dtype) -> bool:
    """The one comparison every probe of the package makes (module forwards,
    class forms, activations, experts gates): same shape, finite, and every
    row within :data:`AGREEMENT` for ``dtype``. Activations are compared
    value by value (one value per row), which tells GELU from its tanh form."""
    if not isinstance(expected, torch.Tensor) or not isinstance(actual, torch.Tensor) \
            or expected.shape != actual.shape or expected.dim() == 0:
        return False
    e, a = expected.double().reshape(expected.shape[0], -1), actual.double().reshape(actual.shape[0], -1)
    if not (torch.isfinite(e).all() and torch.isfinite(a).all()):
        return False
    rtol, atol = AGREEMENT.get(dtype, AGREEMENT[torch.float32])
    err = (e - a).pow(2).mean(1).sqrt()
    return bool((err <= rtol * e.pow(2).mean(1).sqrt() + atol).all())


def identify_activation(act, dtype=torch.float32) -> GLUActivation | None:
    """The known activation the parameter-free callable ``act`` computes
    (checked on a probe tensor, never by name), or None."""
    if not callable(act):
        return None
    if isinstance(act, nn.Module) and any(True for _ in act.parameters()):
        return None  # learnable: the fused ops would ignore its parameters
    t = torch.linspace(-12.0, 12.0, 1001, dtype=torch.float64 if dtype == torch.float64 else torch.float32,
                       device="cpu")  # explicit: a model may be built under `with torch.device("meta")`
    try:
        with torch.no_grad():
            out = act(t)
    except Exception:
        return None
    if not isinstance(out, torch.Tensor) or out.shape != t.shape:
        return None
    for spec in KNOWN_ACTIVATIONS.values():
        if rows_agree(glu_reference(t, torch.ones_like(t), spec).unsqueeze(1), out.to(t.dtype).unsqueeze(1), t.dtype):
            return spec
    return None


def find_act(module: nn.Module):
    """``(name, callable)`` of the module's activation attribute, or (None, None)."""
    for name in ACTIVATION_ATTRS:
        act = getattr(module, name, None)
        if act is not None:
            return name, act
    return None, None


def limit_of(module: nn.Module) -> float | None:
    """A clamp limit the module states as an attribute (DeepSeek-V4's ``limit``)."""
    for name in _LIMIT_NAMES:
        value = getattr(module, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return float(value)
    return None


def _shape(m: nn.Module) -> tuple[int | None, int | None] | None:
    """``(in, out)`` of a linear-like module (nn.Linear, LoRA, quantized), or
    of the one linear-like child of a wrapper (Gemma 4's ``ClippableLinear``:
    clamps as buffers around an ``nn.Linear``; litgpt's ``LoRALinear`` and
    adapter-v2 linears: an ``nn.Linear`` plus low-rank or scale parameters of
    their own), or None. A wrapper is not an ``nn.Linear``: it runs as itself
    and only the activation is fused; the probe decides whether it is one."""
    shape = _own_shape(m)
    if shape is not None:
        return shape
    children = [c for c in m.children() if not isinstance(c, _PASSIVE)]
    return _own_shape(children[0]) if len(children) == 1 else None


def _own_shape(m: nn.Module) -> tuple[int | None, int | None] | None:
    if isinstance(m, nn.Linear):
        return m.in_features, m.out_features
    n_in, n_out = getattr(m, "in_features", None), getattr(m, "out_features", None)
    weight = getattr(m, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        n_out, n_in = (n_out if isinstance(n_out, int) else weight.shape[0]), \
            (n_in if isinstance(n_in, int) else weight.shape[1])
    if isinstance(n_in, int) and not isinstance(n_in, bool):
        return n_in, n_out if isinstance(n_out, int) else None
    return None


_PASSIVE = (nn.Identity, DROPOUT_CLASSES)  # isinstance takes nested tuples (the fallback is one)
_NORMS = (nn.LayerNorm, nn.GroupNorm, BATCH_NORM_CLASSES) + \
    ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())


@dataclass
class Candidates:
    """What structure says about one module: the plans the probe chooses
    from (in order of preference) and the probe input's width; or a reason
    it looked like a GLU feed-forward but cannot be fused."""
    plans: list[GLUPlan]
    in_features: int | None
    named: bool  # roles stated by attribute names (HF): the probe only verifies
    reason: str | None = None


def _acts_for(module: nn.Module, act_name: str | None, act) -> list[GLUActivation] | str:
    """The activation specs to try: the recognised one (with the stated clamp,
    and without it, for the probe to decide), every known kind when the module
    has no activation attribute (DINOv2, torchtitan call F.silu), or a reason."""
    limit = limit_of(module)
    if act is None:
        kinds = list(KNOWN_ACTIVATIONS.values())
    else:
        spec = identify_activation(act)
        if spec is None:
            learnable = isinstance(act, nn.Module) and any(True for _ in act.parameters())
            return ("learnable activation" if learnable else "unknown activation") + \
                f" ({type(act).__name__}): left alone, never approximated"
        kinds = [spec]
    if limit is None:
        return kinds
    return [dataclasses.replace(k, limit=limit) for k in kinds] + kinds


def hf_candidates(module: nn.Module, extra_children_ok: bool = True) -> Candidates | None:
    """Hugging Face's names: ``gate_proj``/``up_proj``/``down_proj`` or a
    packed ``gate_up_proj`` (gate rows first: Phi-3, GLM), with ``act_fn``/
    ``activation_fn``/``act``."""
    mods = module._modules
    if all(isinstance(mods.get(n), nn.Module) for n in ("gate_proj", "up_proj", "down_proj")):
        roles, layout = ("gate_proj", "up_proj", "down_proj"), dict(gate="gate_proj", up="up_proj")
    elif isinstance(mods.get("gate_up_proj"), nn.Module) and isinstance(mods.get("down_proj"), nn.Module):
        roles, layout = ("gate_up_proj", "down_proj"), dict(packed="gate_up_proj", order="gate_first")
    else:
        return None
    act_name, act = find_act(module)
    if act is None:
        return None
    others = [n for n in mods if n not in (*roles, act_name)]
    if others and not extra_children_ok:
        return None
    mid, post, reason = _placement(module, others, roles[-1])
    if reason is None and (any(True for _ in module.parameters(recurse=False))
                           or any(True for _ in module.buffers(recurse=False))):
        reason = "has parameters or buffers of its own, which the fused forward would not use"
    shape = _shape(mods[roles[0]])
    in_features = shape[0] if shape else None
    if reason is not None:
        return Candidates([], in_features, True, reason)
    acts = _acts_for(module, act_name, act)
    if isinstance(acts, str):
        return Candidates([], in_features, True, acts)
    plans = [GLUPlan(down="down_proj", activation=a, mid=mid, post=post, **layout) for a in acts]
    return Candidates(plans, in_features, True)


def _placement(module: nn.Module, others: list[str], down: str):
    """Other children as ``mid`` (registered before ``down``) and ``post``
    (after); only dropout, identity and norms are allowed (the probe checks
    the placement, a training-mode probe that of dropout)."""
    names = list(module._modules)
    mid, post = [], []
    for n in others:
        child = module._modules[n]
        if child is None:
            continue
        if not isinstance(child, _PASSIVE + _NORMS):
            return (), (), f"child {n!r} ({type(child).__name__}) is neither a projection nor a dropout/norm"
        (mid if names.index(n) < names.index(down) else post).append(n)
    return tuple(mid), tuple(post), None


def takes_one_input(module: nn.Module) -> bool:
    """Its forward can be called with one tensor (a feed-forward's signature);
    containers without a forward (ModuleList, ModuleDict) cannot. Read once
    per class (a forward set on the instance: each time)."""
    forward = module.__dict__.get("forward")
    if forward is not None:
        return _forward_takes_one_input(forward)
    return _class_takes_one_input(type(module))


@functools.lru_cache(maxsize=None)
def _class_takes_one_input(cls: type) -> bool:
    if cls.forward is nn.Module.forward:
        return False
    return _forward_takes_one_input(functools.partial(cls.forward, None))


def _forward_takes_one_input(forward) -> bool:
    try:
        params = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):
        return True
    required = [p for p in params if p.default is p.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return bool(params) and len(required) <= 1


def generic_candidates(module: nn.Module) -> Candidates | None:
    """Any names: two linear-like children ``packed [2H, D]`` and ``down
    [O, H]``, or three, ``gate``/``up`` ``[H, D]`` and ``down [O, H]``; an
    optional activation child; dropout/norm children. All role assignments
    the shapes allow become plans; the probe picks."""
    if not takes_one_input(module):
        return None  # attention and other multi-input modules
    mods = {n: m for n, m in module._modules.items() if m is not None}
    shapes = {n: _shape(m) for n, m in mods.items()}
    lins = [n for n, s in shapes.items() if s is not None and s[1] is not None]
    if len(lins) not in (2, 3) or any(s is not None and s[1] is None for s in shapes.values()):
        return None
    act_name, act = find_act(module)
    rest = [n for n in mods if n not in lins and n != act_name]
    if act is None:  # an activation child under another name: the one parameter-free non-dropout/norm child
        odd = [n for n in rest if not isinstance(mods[n], _PASSIVE + _NORMS)]
        if len(odd) == 1 and not any(True for _ in mods[odd[0]].parameters()):
            act_name, act = odd[0], mods[odd[0]]
            rest.remove(act_name)
    if any(not isinstance(mods[n], _PASSIVE + _NORMS) for n in rest):
        return None
    layouts = []
    if len(lins) == 2:
        for p, d in ((lins[0], lins[1]), (lins[1], lins[0])):
            if shapes[p][1] == 2 * shapes[d][0]:
                layouts += [(dict(packed=p, order=o), d) for o in _ORDERS]
    else:
        for g in lins:
            for u in lins:
                for d in lins:
                    if len({g, u, d}) == 3 and shapes[g] == shapes[u] and shapes[d][0] == shapes[g][1]:
                        layouts.append((dict(gate=g, up=u), d))
    if not layouts:
        return None
    in_features = shapes[next(iter(layouts[0][0].values()))][0]
    if any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False)):
        return Candidates([], in_features, False, "has parameters or buffers of its own")
    acts = _acts_for(module, act_name, act)
    if isinstance(acts, str):
        return Candidates([], in_features, False, acts)
    plans = []
    for layout, down in layouts:
        mid, post, reason = _placement(module, rest, down)
        if reason is not None:
            return Candidates([], in_features, False, reason)
        plans += [GLUPlan(down=down, activation=a, mid=mid, post=post, **layout) for a in acts]
    return Candidates(plans, in_features, False)


def is_container(module: nn.Module) -> bool:
    """``nn.Sequential``/``ModuleList``/``ModuleDict`` (or a subclass keeping
    their forward): holders of modules, never a GLU feed-forward themselves.
    A Sequential's children can still look like projections (an
    ``xformers.ops.SwiGLU`` states ``in_features``/``out_features``)."""
    return isinstance(module, (nn.Sequential, nn.ModuleList, nn.ModuleDict)) \
        and type(module).forward in (nn.Sequential.forward, nn.Module.forward)


def glu_candidates(module: nn.Module) -> tuple[Candidates, str] | None:
    """What the walk asks of structure, whatever families it is narrowed to:
    ``(candidates, family)`` with family ``"hf"`` (Hugging Face's names) or
    ``"generic"`` (any names), or None (containers always)."""
    if is_container(module):
        return None
    cands = hf_candidates(module)
    if cands is not None:
        return cands, "hf"
    cands = generic_candidates(module)
    return None if cands is None else (cands, "generic")
