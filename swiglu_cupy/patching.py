"""``patch(model)``: every GLU feed-forward of a model runs the fused op, found by
structure and decided by a probe, with a report of what was done and why.

    report = swiglu_cupy.patch(model)
    print(report)

One mechanism for every family. A patched module stays an instance of its own
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
import functools
import importlib
import inspect
import math
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ._sources import SUPPORTED_DTYPES
from ._torch_compat import global_module_hooks_active
from ._validation import check_flags
from .activations import GLUActivation
from .api import glu_mul, swiglu, swiglu_unpacked
from .module import SwiGLU, _registered
from .reference import glu_reference

__all__ = ["patch", "PatchReport", "GLUPlan", "FusedGLUMLP", "KNOWN_ACTIVATIONS"]

#: The elementwise activations recognised by value, as specs of ``act(gate) * up``
#: (``quick_gelu``, ``x * sigmoid(1.702 x)``, is the OAI form without offset).
KNOWN_ACTIVATIONS: dict[str, GLUActivation] = {
    "silu": GLUActivation("silu"), "gelu_tanh": GLUActivation("gelu_tanh"), "gelu": GLUActivation("gelu"),
    "relu": GLUActivation("relu"), "sigmoid": GLUActivation("sigmoid"), "identity": GLUActivation("identity"),
    "quick_gelu": GLUActivation("oai", alpha=1.702),
}
_ACT_NAMES = ("act_fn", "activation_fn", "act")
_LIMIT_NAMES = ("limit", "swiglu_limit", "clamp_limit")
_ORDERS = ("gate_first", "gate_last", "interleaved")
# Without a stated limit, the probe's large rows reach this far, so a clamp
# written into a forward below it shows up as a mismatch.
_HIDDEN_CLAMP_REACH = 32.0


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


# ---- the fused forward -----------------------------------------------------------------------

def _plain_linear(m: nn.Module) -> bool:
    """An ``nn.Linear`` whose call is exactly its forward: no hooks (torch's
    parallel styles, PEFT, offloading) and no replaced forward (Hugging Face's
    tensor-parallel styles and accelerate's hooks replace ``module.forward``)."""
    return (type(m) is nn.Linear and not (m._forward_pre_hooks or m._forward_hooks or m._backward_pre_hooks
                                          or m._backward_hooks) and "forward" not in m.__dict__)


def _is_noop(m: nn.Module) -> bool:
    """A child between the product and ``down`` that does nothing now."""
    if isinstance(m, nn.Identity):
        return True
    return isinstance(m, nn.modules.dropout._DropoutNd) and (m.p == 0 or not m.training)


def _params(lin: nn.Module):
    return _registered(lin, "_parameters", "weight"), _registered(lin, "_parameters", "bias")


def _whole_mlp(x, plan: GLUPlan, mods, recompute_gate_up: bool, inplace_backward: bool):
    """The whole MLP in the fused op, the weights used in place (views)."""
    wd, bd = _params(mods[plan.down])
    modes = dict(recompute_gate_up=recompute_gate_up, inplace_backward=inplace_backward)
    if plan.packed is None:
        (wg, bg), (wu, bu) = _params(mods[plan.gate]), _params(mods[plan.up])
        return swiglu_unpacked(x, wg, bg, wu, bu, wd, bd, activation=plan.activation, **modes)
    w, b = _params(mods[plan.packed])
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
    """``"mlp"``, ``"activation"`` or None: what ``run_plan`` runs now."""
    if plan is None:
        return None
    mods = module._modules
    lins = [mods[n] for n in (plan.packed, plan.down) if n] if plan.packed else \
        [mods[plan.gate], mods[plan.up], mods[plan.down]]
    whole = (all(_plain_linear(m) for m in lins) and all(_is_noop(mods[n]) for n in plan.mid)
             and not global_module_hooks_active())  # global hooks must see each projection's call
    return "mlp" if whole else "activation"


def run_plan(module: nn.Module, x: torch.Tensor, plan: GLUPlan, recompute_gate_up: bool = False,
             inplace_backward: bool = False, fused: bool = True) -> torch.Tensor:
    """``module``'s GLU feed-forward as ``plan`` says: the whole MLP fused when
    the projections are plain ``nn.Linear`` and nothing runs between the
    product and ``down``; else the children run as themselves and only
    ``act(gate) * up`` is fused. ``fused=False``: plain torch ops
    (:func:`~swiglu_cupy.glu_reference`), what the probe compares with."""
    mods = module._modules  # decoding calls this once per token: no nn.Module.__getattr__
    if fused and fusion_of(module, plan) == "mlp":
        out = _whole_mlp(x, plan, mods, recompute_gate_up, inplace_backward)
    else:
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


class FusedGLUMLP(nn.Module):
    """The fused forward, mixed in front of a module's own class.

    ``Fused<cls>(FusedGLUMLP, cls)`` is built once per class; :func:`patch`
    (or ``hf.patch_model``) switches a built instance to it, ``hf.apply_to``
    makes the model build it. Instance attributes:

    - ``swiglu_plan``: its :class:`GLUPlan`, or None (the original forward runs);
    - ``recompute_gate_up``, ``inplace_backward``: the memory modes of the fused
      op (see :class:`swiglu_cupy.SwiGLUFunction`), settable at any time.

    Pickling (``torch.save(model)``), ``copy.deepcopy`` and ``model.to(...)``
    work; a pickle names the original class, so it loads wherever that class
    imports.
    """
    swiglu_plan: GLUPlan | None = None
    recompute_gate_up: bool = False
    inplace_backward: bool = False
    _swiglu_base: type = nn.Module

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # Built by a class patched with hf.apply_to: the class's form was
        # verified there; the activation depends on this instance's config.
        from .hf import _plan_of_built_instance
        self.swiglu_plan = _plan_of_built_instance(self)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        plan = self.swiglu_plan
        if plan is None or args or kwargs:
            return super().forward(x, *args, **kwargs)
        return run_plan(self, x, plan, self.recompute_gate_up, self.inplace_backward)

    @property
    def swiglu_activation(self) -> GLUActivation | None:
        return None if self.swiglu_plan is None else self.swiglu_plan.activation

    def fusion(self) -> str | None:
        """What the next forward runs: ``"mlp"`` (the whole MLP fused),
        ``"activation"`` (the projections as their own modules, ``act(gate) * up``
        fused) or None (the original forward)."""
        return fusion_of(self, self.swiglu_plan)

    def __reduce_ex__(self, protocol):
        base = self._swiglu_base
        return _rebuild, (base.__module__, base.__qualname__), self.__dict__.copy()


def _resolve(module_name: str, qualname: str):
    obj = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _rebuild(module_name: str, qualname: str) -> FusedGLUMLP:
    """Unpickling: an empty instance of the fused class of the named original
    class (which apply_to may have replaced by its fused class meanwhile)."""
    return object.__new__(fused_class(_resolve(module_name, qualname)))


_FUSED_CLASSES: dict[type, type] = {}


def fused_class(cls: type) -> type:
    """``Fused<cls>``: FusedGLUMLP's forward in front of ``cls``, one per class."""
    if issubclass(cls, FusedGLUMLP):
        return cls
    fused = _FUSED_CLASSES.get(cls)
    if fused is None:
        fused = type(f"Fused{cls.__name__}", (FusedGLUMLP, cls),
                     {"__module__": __name__, "_swiglu_base": cls,
                      "__doc__": f"{cls.__name__} with swiglu_cupy's fused forward (see FusedGLUMLP)."})
        _FUSED_CLASSES[cls] = fused
    return fused


def install(module: nn.Module, plan: GLUPlan, recompute_gate_up: bool, inplace_backward: bool) -> None:
    module.__class__ = fused_class(type(module))
    module.swiglu_plan = plan
    module.recompute_gate_up, module.inplace_backward = recompute_gate_up, inplace_backward


# ---- recognising activations and structures --------------------------------------------------

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
    # float32 activations match to a few ulps; a float64 probe asks for float64 agreement.
    rtol, atol = (1e-9, 1e-12) if t.dtype == torch.float64 else (1e-5, 1e-6)
    for spec in KNOWN_ACTIVATIONS.values():
        if torch.allclose(out.to(t.dtype), glu_reference(t, torch.ones_like(t), spec), rtol=rtol, atol=atol):
            return spec
    return None


def find_act(module: nn.Module):
    """``(name, callable)`` of the module's activation attribute, or (None, None)."""
    for name in _ACT_NAMES:
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
    """``(in, out)`` of a linear-like module (nn.Linear, LoRA, quantized), or None."""
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


_PASSIVE = (nn.Identity, nn.modules.dropout._DropoutNd)
_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase) + \
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


def _takes_one_input(module: nn.Module) -> bool:
    """Its forward can be called with one tensor (a feed-forward's signature)."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
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
    if not _takes_one_input(module):
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


# ---- the probe -------------------------------------------------------------------------------

def _device_dtype(module: nn.Module, first: nn.Module):
    tensors = [*module.parameters(), *module.buffers()]
    device = tensors[0].device if tensors else torch.device("cpu")
    dtype = next((p.dtype for p in first.parameters() if p.dtype in SUPPORTED_DTYPES), torch.get_default_dtype())
    return device, dtype


def _rows_match(expected, actual, dtype) -> bool:
    """Equal up to rounding, row by row (a wrong formula is off by O(1))."""
    if not isinstance(expected, torch.Tensor) or not isinstance(actual, torch.Tensor) \
            or expected.shape != actual.shape:
        return False
    e, a = expected.double().flatten(1), actual.double().flatten(1)
    if not (torch.isfinite(e).all() and torch.isfinite(a).all()):
        return False
    # Both sides round differently (fused: one rounding of h); the error is a
    # few ulps of the dtype, relative.
    tol = {torch.float16: 2e-2, torch.bfloat16: 5e-2}.get(dtype, 1e-4)
    scale = e.pow(2).mean(1).sqrt()
    err = (e - a).pow(2).mean(1).sqrt()
    return bool((err <= tol * scale).all()) and bool((a[scale == 0] == 0).all())


class _Probe:
    """One module's probe: the input, and its own forward's output on it."""

    def __init__(self, module: nn.Module, cands: Candidates):
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
        self.expected = self.run(module.forward)

    def run(self, fn, training=False, seed=None):
        training_was = self.module.training
        self.module.train(training)
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
                torch.manual_seed(0 if seed is None else seed)
                return fn(self.x)
        except Exception:
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
        return _rows_match(expected, actual, self.dtype)

    def dropout_placement_matches(self, plan: GLUPlan, fn) -> bool:
        """In training mode with the same RNG state, dropout masks are drawn in
        the same order and shapes only if the plan puts each dropout where the
        module's forward applies it."""
        mods = self.module._modules
        if not any(isinstance(mods[n], nn.modules.dropout._DropoutNd) and mods[n].p > 0
                   for n in (*plan.mid, *plan.post)):
            return True
        expected = self.run(self.module.forward, training=True, seed=7)
        actual = self.run(fn, training=True, seed=7)
        if expected is None or actual is None:
            return False
        return _rows_match(expected[:4], actual[:4], self.dtype)


def choose_plan(module: nn.Module, cands: Candidates, verify: bool, modes: tuple[bool, bool]):
    """``(plan, None)`` or ``(None, reason)``: the first candidate the module's
    own forward agrees with, checked again through the fused op itself."""
    if "forward" in module.__dict__:
        return None, "its forward is replaced on the instance (accelerate hooks?), which would bypass the fusion"
    meta = any(t.device.type == "meta" for t in (*module.parameters(), *module.buffers()))
    if meta or not verify:
        # Nothing to compute with (meta device), or trusted: only an
        # unambiguous structure will do.
        if cands.named and len({(p.activation.kind, p.activation.alpha) for p in cands.plans}) == 1:
            return cands.plans[0], None
        return None, ("on the meta device: roles and activation cannot be probed" if meta else
                      "verify=False, and the roles or activation are not stated by the names")
    if cands.in_features is None:
        return None, "could not be probed: the input width of its projections is unknown"
    probe = _Probe(module, cands)
    if probe.expected is None:
        return None, "could not be probed: its forward failed on a probe input"
    for plan in cands.plans:
        def reference(x, plan=plan):
            return run_plan(module, x, plan, fused=False)
        if not probe.matches(reference):
            continue
        def fused(x, plan=plan):
            return run_plan(module, x, plan, *modes)
        if not probe.matches(fused):
            return None, f"the fused op disagrees with its forward ({plan.activation}, {probe.dtype})"
        if not probe.dropout_placement_matches(plan, fused):
            return None, "dropout placement differs from its forward in training mode"
        return plan, None
    kinds = sorted({str(p.activation) for p in cands.plans})
    roles = cands.plans[0].describe().split(" -> ")[0]
    return None, (f"probe mismatch: its forward is not down(act(gate) * up) with the roles its names "
                  f"state ({roles}) and {', '.join(kinds)}" if cands.named else
                  f"probe mismatch: no role assignment and known activation reproduces its forward")


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

    def __len__(self) -> int:
        """Modules whose forward now runs fused code (whole or activation)."""
        return len(self.fused) + len(self.partial) + self.experts

    def __str__(self) -> str:
        head = (f"swiglu_cupy.patch: {len(self.fused)} fused, {len(self.partial)} activation only, "
                f"{len(self.skipped)} skipped" + (f", {self.experts} MoE experts" if self.experts else ""))
        rows = [(p, self.classes.get(p, ""), status, text)
                for status, table in (("fused", self.fused), ("activation", self.partial),
                                      ("skipped", self.skipped)) for p, text in table.items()]
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
    odd = [n for n in projections if not _plain_linear(mods[n])]
    if odd:
        why.append(f"{'/'.join(odd)} not plain nn.Linear ({type(mods[odd[0]]).__name__}: LoRA, quantized "
                   "or hooked) run as themselves")
    for n in plan.mid:
        m = mods[n]
        if not _is_noop(m):
            what = f"{type(m).__name__} p={m.p:g} in training" if isinstance(m, nn.modules.dropout._DropoutNd) \
                else type(m).__name__
            why.append(f"{n} ({what}) between the product and {plan.down} runs as itself")
    if not why and global_module_hooks_active():
        why.append("global module hooks are registered")
    return f"{plan.activation}; " + "; ".join(why)


def _record(report: PatchReport, path: str, module: nn.Module, note: str = "") -> None:
    plan = module.swiglu_plan
    report.classes[path] = module._swiglu_base.__name__
    if module.fusion() == "mlp":
        report.fused[path] = f"{plan.activation}: {plan.describe()}{note}"
    else:
        report.partial[path] = _partial_reason(module, plan) + note


def patch_hf_experts(model: nn.Module, recompute_gate_up: bool = False) -> int:
    """Switch the Hugging Face MoE experts modules of ``model`` to swiglu_cupy's
    experts implementation (:mod:`swiglu_cupy.hf_experts`); how many run fused."""
    if "transformers.integrations.moe" not in sys.modules:
        return 0  # no experts class was ever defined in this process: none can be in the model
    from . import hf_experts

    return hf_experts.patch_experts(model, recompute_gate_up=recompute_gate_up)


def patch(model: nn.Module, *, strict: bool = False, verify: bool = True, recompute_gate_up: bool = False,
          inplace_backward: bool = False) -> PatchReport:
    """Fuse every GLU feed-forward in ``model`` (the model itself included), in
    place, and return a :class:`PatchReport`.

    It walks the model once and finds, by structure: Hugging Face MLPs
    (``gate_proj``/``up_proj``/``down_proj`` or a packed ``gate_up_proj``,
    with any known activation and a stated clamp ``limit``), xformers'
    ``SwiGLU`` (given swiglu_cupy's op), packed-``w12`` modules (DINOv2),
    timm's ``GluMlp`` (either gate order), ``SwiGLU`` and ``SwiGLUPacked``,
    three-projection modules under any names (torchtitan's ``w1``/``w3``/
    ``w2``), and Hugging Face MoE experts. A module is patched only if its own
    forward agrees with the fused one on a probe input (``verify=False``
    trusts Hugging Face names without probing). Fused modules keep their
    children and parameters: state_dict keys and checkpoints stay those of the
    unpatched model. Patching again changes nothing; already fused modules are
    reported again as such. ``recompute_gate_up``/``inplace_backward`` select
    the memory modes. ``strict=True`` raises ``ValueError`` if nothing is fused.
    """
    from .xformers import patch_xformers_module

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    check_flags(strict=strict, verify=verify, recompute_gate_up=recompute_gate_up,
                 inplace_backward=inplace_backward)
    report, done = PatchReport(), []
    for path, module in model.named_modules(remove_duplicate=True):
        if any(path.startswith(p + ".") or p == "" for p in done):
            continue  # inside a module already handled: its projections
        if isinstance(module, SwiGLU):
            done.append(path)
            continue
        if isinstance(module, FusedGLUMLP):
            done.append(path)
            if module.swiglu_plan is not None:
                _record(report, path, module, " (already fused)")
            continue
        xformers_note = patch_xformers_module(module)
        if xformers_note is not None:
            done.append(path)
            report.classes[path] = type(module).__name__
            report.fused[path] = xformers_note
            continue
        cands = hf_candidates(module) or generic_candidates(module)
        if cands is None:
            continue
        done.append(path)
        report.classes[path] = type(module).__name__
        if cands.reason is not None:
            report.skipped[path] = cands.reason
            continue
        plan, reason = choose_plan(module, cands, verify, (recompute_gate_up, inplace_backward))
        if plan is None:
            report.skipped[path] = reason
            continue
        install(module, plan, recompute_gate_up, inplace_backward)
        _record(report, path, module)
    report.experts = patch_hf_experts(model, recompute_gate_up)
    if strict and not len(report):
        detail = "".join(f"\n  {p or '<model>'}: {r}" for p, r in list(report.skipped.items())[:8])
        raise ValueError(f"patch(strict=True): nothing fused in {type(model).__name__}: no GLU feed-forward "
                         "(gate/up/down projections, packed or not, with a known activation) whose forward "
                         "the probe could confirm." + (" Left alone:" + detail if detail else ""))
    return report
