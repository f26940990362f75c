"""torchtitan integration: its FeedForward and MoE GroupedExperts on swiglu_cupy's ops.

Two ways in, for torchtitan's real model classes (checked against torchtitan 0.3.0):

* ``swiglu_cupy.patch(model)`` on a built model: the core walk fuses every
  ``FeedForward`` (``w1`` gate, ``w3`` up, ``w2`` down: torchtitan ``Linear``\\ s)
  and calls :func:`patch_torchtitan_class` for every ``GroupedExperts`` and
  for the modules of torchtitan's ``fused_swiglu`` overrides (``FusedSwiGLU``:
  one ``w13 [F, 2, D]`` gate/up parameter; ``FusedGroupedExperts``).
* The model-transform extension point, as torchtitan's quantization and LoRA
  converters do: a :class:`SwiGLUCupyConverter` (a
  ``torchtitan.protocols.model.ModelConfigConverter``) in the model spec's
  ``converters`` replaces the ``FeedForward`` / ``GroupedExperts`` /
  ``FusedSwiGLU`` / ``FusedGroupedExperts`` configs by configs of subclasses whose forward runs
  swiglu_cupy, before the model is built (on meta or anywhere)::

      from swiglu_cupy.integrations.torchtitan import SwiGLUCupyConverter
      spec = model_registry("debugmodel", converters=[SwiGLUCupyConverter.Config()])

  The built modules are instances of their torchtitan classes (subclasses),
  so ``verify_module_protocol``, ``init_states``, ``to_empty``, state_dict
  keys and torchtitan's parallelize/AC code see what they expect.

GroupedExperts keep torchtitan's numerics contract: operands cast to bf16
(as torchtitan's forward does, whatever the parameter dtype), output cast
back with ``type_as(x)``; the router scores stay where torchtitan applies
them (the token dispatcher's ``combine``, after the experts), so the experts
op runs with ``routing_weights=None``. The separate ``w1_EFD``/``w3_EFD``
layout runs ``grouped_experts_unpacked`` (the gate and up GEMMs write the
halves of one x12: the weights are not concatenated); the fused
``w13 [E, F, 2, D]`` layout is a view (interleaved gate/up) on
``grouped_experts``. Neither copies the weights beyond torchtitan's own bf16
casts (no copy for bf16 parameters). torchtitan's token dispatcher hands
GroupedExperts rows already sorted by expert, so ``grouped_experts`` saves
those rows as given (``x_RD``, or its bf16 cast where it is not bf16) and
x12: the least there is to save at that interface (``routed_experts``, which
routes the tokens itself, saves each token's input once instead of K rows).

This module imports torchtitan only when asked for the converter (the
``SwiGLUCupyConverter`` attribute) or for a fused class: the core walk can
call :func:`patch_torchtitan_class` on any module at no cost when
torchtitan was never imported.

Under torchtitan's parallelize: FSDP2 hands plain unsharded weights to the
forward (fused); with EP alone, the forward wrappers its ``Module.parallelize``
puts on each ``Linear`` redistribute nothing (checked per module, see
``_redistribution_is_noop``) and the dense feed-forwards stay fused; under TP
the projections hold DTensor shards and only the activation runs here
(``glu_mul`` on the local shards of the column-parallel gate and up).
"""
from __future__ import annotations

import dataclasses
import sys

import torch
from torch import nn

from .._validation import check_tile_rows
from ..activations import GLUActivation
from ..dense.api import glu_mul, swiglu, swiglu_unpacked
from ..moe.grouped import grouped_experts, grouped_experts_unpacked
from .plan_runner import is_dtensor, plain_linear
from .fused import switched_base, switched_class
from .switch_proof import probe_tensor, proven

__all__ = ["patch_torchtitan_class", "torchtitan_skip_reason", "fused_torchtitan_class",
           "is_torchtitan_switchable",
           "SwiGLUCupyConverter"]

_SILU = GLUActivation("silu")
_SILU_INTERLEAVED = GLUActivation("silu", interleaved=True)
_MOE = "torchtitan.models.common.moe"
_FUSED_OVERRIDES = "torchtitan.overrides.fused_swiglu"
_FF = "torchtitan.models.common.feed_forward"


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor parameter's local shard (torchtitan's experts do the same under EP)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def _redistribution_is_noop(module: nn.Module, parallel_dims) -> bool:
    """Whether the forward wrapper torchtitan's ``Module.parallelize`` gave
    ``module`` (redistribute inputs, an optional local_map, redistribute
    outputs, from its sharding config) does nothing: on the
    "partial_dtensor" backend, a boundary whose layouts resolve to no mesh is
    a no-op (``ParallelDims.resolve_shared_mesh``'s contract), e.g. the TP
    layouts of a dense Linear when TP (and CP) are off, as under EP alone.
    Any other backend, a local_map or a resolved mesh: not a no-op."""
    config = getattr(module, "_sharding_config", None)
    if config is None or getattr(parallel_dims, "spmd_backend", None) != "partial_dtensor":
        return False
    if config.local_map is not None or isinstance(config.out_src_shardings, tuple):
        return False
    src, dst = config.in_src_shardings or {}, config.in_dst_shardings or {}
    boundaries = [[src.get(n), dst.get(n)] for n in {*src, *dst}]
    boundaries.append([config.out_src_shardings, config.out_dst_shardings])
    boundaries += [[layout] for layout in (config.state_shardings or {}).values()]
    return all(parallel_dims.resolve_shared_mesh(b) is None for b in boundaries)


# ---- the fused forwards ----------------------------------------------------------------------

def _experts_forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
    """torchtitan's ``GroupedExperts.forward`` contract on ``swiglu_cupy.moe.grouped_experts``."""
    offsets_E = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
    w2_EDF = _local(self.w2_EDF).bfloat16()
    modes = {"recompute_gate_up": getattr(self, "_swiglu_cupy_recompute_gate_up", False),
             "tile_rows": getattr(self, "_swiglu_cupy_tile_rows", None)}
    if "w13" in self._parameters:
        w13 = _local(self.w13)
        E, F, _, D = w13.shape
        w12 = w13.bfloat16().reshape(E, 2 * F, D)  # rows g0, u0, g1, u1, ...: a view
        y = grouped_experts(x_RD.bfloat16(), offsets_E, w12, w2_EDF, activation=_SILU_INTERLEAVED, **modes)
    else:
        y = grouped_experts_unpacked(x_RD.bfloat16(), offsets_E, _local(self.w1_EFD).bfloat16(),
                                     _local(self.w3_EFD).bfloat16(), w2_EDF, activation=_SILU, **modes)
    return y.type_as(x_RD)


def _feed_forward_forward(self, x: torch.Tensor) -> torch.Tensor:
    """torchtitan's ``FeedForward.forward``, ``w2(silu(w1 x) * w3 x)``, fused:
    the whole MLP when the three projections are plain linears, else the
    activation only (LoRA, float8 or hooked projections run as themselves)."""
    w1, w2, w3 = self.w1, self.w2, self.w3
    noop = self.__dict__.get("_swiglu_cupy_noop_forwards", {})
    # noop: the forward wrappers torchtitan's parallelize installed that do nothing (_redistribution_is_noop)
    if all(plain_linear(m, noop.get(n)) for n, m in (("w1", w1), ("w2", w2), ("w3", w3))):
        return swiglu_unpacked(x, w1.weight, w1.bias, w3.weight, w3.bias, w2.weight, w2.bias,
                               recompute_gate_up=getattr(self, "_swiglu_cupy_recompute_gate_up", False),
                               tile_rows=getattr(self, "_swiglu_cupy_tile_rows", None))
    return w2(glu_mul(w1(x), w3(x)))


def _fused_swiglu_forward(self, x: torch.Tensor) -> torch.Tensor:
    """torchtitan's ``FusedSwiGLU.forward`` (gate/up from ``w13 [F, 2, D]``,
    ``w2`` down) fused: ``w13`` read as an interleaved ``w12 [2F, D]`` (rows
    g0, u0, g1, ...: a view); the activation only when ``w13`` is a DTensor
    shard or ``w2`` is not a plain linear."""
    w13, w2 = self.w13, self.w2
    F, _, D = w13.shape
    recompute = getattr(self, "_swiglu_cupy_recompute_gate_up", False)
    noop = self.__dict__.get("_swiglu_cupy_noop_forwards", {})
    if not is_dtensor(w13) and plain_linear(w2, noop.get("w2")):
        return swiglu(x, w13.reshape(2 * F, D), None, w2.weight, w2.bias, activation=_SILU_INTERLEAVED,
                      recompute_gate_up=recompute, tile_rows=getattr(self, "_swiglu_cupy_tile_rows", None))
    gate, up = nn.functional.linear(x, w13.flatten(0, 1)).unflatten(-1, (F, 2)).unbind(-1)
    return w2(glu_mul(gate, up))


# ---- probe inputs (the proof each switch makes: integrations.switch_proof) ----------------

#: Rows per expert of the experts' probe input: uneven, an expert without rows included.
_PROBE_COUNTS = (3, 0, 5, 2)


def _experts_probe(self) -> tuple:
    """``(x_RD, num_tokens_per_expert_E)`` in the parameters' dtype, rows sorted by expert."""
    w2 = _local(self.w2_EDF)
    E, D = w2.shape[0], w2.shape[1]
    counts = torch.tensor([_PROBE_COUNTS[e % len(_PROBE_COUNTS)] for e in range(E)], device=w2.device)
    return probe_tensor((int(counts.sum()), D), w2), counts


def _fused_swiglu_probe(self) -> tuple:
    w13 = _local(self.w13)
    return (probe_tensor((6, w13.shape[-1]), w13),)


def _feed_forward_probe(self) -> tuple:
    return (probe_tensor((6, self.w1.weight.shape[-1]), self.w1.weight),)


#: GroupedExperts computes in bf16 whatever its parameters' dtype (its output cast back).
_BF16 = {_experts_forward: lambda self: torch.bfloat16}
#: The torchtitan release whose fused_swiglu overrides (CUDA-only Triton
#: forwards) the fused forwards were checked against, on the GPU.
_OVERRIDES_PROVEN = ("0.3.0",)


def _overrides_unrunnable(self) -> tuple[bool, str | None]:
    """torchtitan's ``fused_swiglu`` overrides run a Triton kernel: on CUDA
    weights the proof runs it; elsewhere the switch is accepted only for the
    torchtitan release it was checked against."""
    if switched_base(self) not in (_fused_swiglu_base(), _fused_grouped_experts_base()) or any(
            p.device.type == "cuda" for p in self.parameters()):
        return False, None
    from importlib import metadata

    try:
        version = metadata.version("torchtitan")
    except metadata.PackageNotFoundError:
        version = None
    if version in _OVERRIDES_PROVEN:
        return True, None
    return True, (f"torchtitan {version}: its {switched_base(self).__name__} forward (a CUDA-only Triton kernel) "
                  "cannot run on these weights to prove the fused one equal, and this release is not the "
                  f"one it was checked against ({', '.join(_OVERRIDES_PROVEN)}); left as is")


_PROBES = {_experts_forward: _experts_probe, _fused_swiglu_forward: _fused_swiglu_probe,
           _feed_forward_forward: _feed_forward_probe}


# ---- fused subclasses of torchtitan's classes ------------------------------------------------

def _make_fused_class(base: type, forward) -> type:
    """``SwiGLUCupy<base>``: a subclass with ``forward`` replaced and its own
    ``Config`` (so torchtitan's ``Config.build()`` builds it: the converter),
    made once by the one switched-class mechanism (``fused.switched_class``)."""
    return switched_class("torchtitan", base, lambda base: _fused_class_parts(base, forward))


def _fused_class_parts(base: type, forward):
    name = f"SwiGLUCupy{base.__name__}"
    base_config = base.Config
    config_cls = dataclasses.dataclass(kw_only=True, slots=True)(
        type("Config", (base_config,), {"__module__": __name__, "__qualname__": f"{name}.Config",
                                        "__annotations__": {"recompute_gate_up": bool,
                                                            "tile_rows": int | str | None},
                                        "recompute_gate_up": False, "tile_rows": None}))

    def __init__(self, config):
        base.__init__(self, config)
        self._swiglu_cupy_recompute_gate_up = bool(getattr(config, "recompute_gate_up", False))
        self._swiglu_cupy_tile_rows = getattr(config, "tile_rows", None)

    return name, (base,), {"__module__": __name__, "__qualname__": name, "Config": config_cls,
                           "__init__": __init__, "forward": proven(forward, _PROBES[forward], _BF16.get(forward),
                                                     _overrides_unrunnable),
                           "parallelize": _parallelize}


def _parallelize(self, parallel_dims) -> None:
    """torchtitan's ``Module.parallelize`` (children first), then note which
    projections' new forward wrappers do nothing, so the fused forward may
    still call the whole MLP on their weights (EP without TP: the dense
    FFNs stay fused)."""
    type(self)._swiglu_base.parallelize(self, parallel_dims)
    self._swiglu_cupy_noop_forwards = {
        name: m.__dict__["forward"] for name, m in self.named_children()
        if "forward" in m.__dict__ and _redistribution_is_noop(m, parallel_dims)}


def _rebuild(fn, args, state):
    """What pickles written before ``fused.switched_class`` name: rebuilt as the
    torchtitan class, then switched."""
    obj = fn(*args)
    if state is not None:
        obj.__setstate__(state)
    obj.__class__ = fused_torchtitan_class(args[0])
    return obj


def _experts_bases() -> tuple[type, ...]:
    """The torchtitan experts classes whose forward we reproduce (exact forwards)."""
    bases = []
    moe = sys.modules.get(_MOE)
    if moe is not None:
        bases.append(moe.GroupedExperts)
    fused = sys.modules.get(_FUSED_OVERRIDES)
    if fused is not None and hasattr(fused, "FusedGroupedExperts"):
        bases.append(fused.FusedGroupedExperts)
    return tuple(bases)


def _fused_grouped_experts_base() -> type | None:
    """torchtitan's ``FusedGroupedExperts`` override, if loaded."""
    return getattr(sys.modules.get(_FUSED_OVERRIDES), "FusedGroupedExperts", None)


def _fused_swiglu_base() -> type | None:
    """torchtitan's ``FusedSwiGLU`` override (one ``w13`` gate/up parameter), if loaded."""
    return getattr(sys.modules.get(_FUSED_OVERRIDES), "FusedSwiGLU", None)


def _class_bases() -> tuple[type, ...]:
    """The torchtitan classes switched from their class alone (no probe: their
    forwards are reproduced exactly): the experts and ``FusedSwiGLU``."""
    fused_swiglu = _fused_swiglu_base()
    return _experts_bases() + ((fused_swiglu,) if fused_swiglu is not None else ())


def fused_torchtitan_class(base: type) -> type:
    """The swiglu_cupy subclass of a torchtitan ``FeedForward``, ``GroupedExperts``,
    ``FusedSwiGLU`` or ``FusedGroupedExperts`` class (exactly those: a
    subclass with its own forward is not reproduced)."""
    if base in _experts_bases():
        return _make_fused_class(base, _experts_forward)
    if base is _fused_swiglu_base():
        return _make_fused_class(base, _fused_swiglu_forward)
    ff = sys.modules.get(_FF)
    if ff is not None and base is ff.FeedForward:
        return _make_fused_class(base, _feed_forward_forward)
    raise TypeError(f"{base.__module__}.{base.__qualname__} is not torchtitan's FeedForward, GroupedExperts, "
                    "FusedSwiGLU or FusedGroupedExperts")


# ---- patching a built GroupedExperts or FusedSwiGLU ------------------------------------------

def _switchable_class_of(module: nn.Module) -> type | None:
    """The torchtitan class ``module`` is (or was switched from), if switched from its class alone."""
    cls = type(module)
    base = getattr(cls, "_swiglu_base", cls)
    return base if base in _class_bases() else None


def is_torchtitan_switchable(module: nn.Module) -> bool:
    """A torchtitan ``GroupedExperts`` or ``FusedSwiGLU`` (or a subclass,
    switched or not): the walk hands it to :func:`patch_torchtitan_class`."""
    moe = sys.modules.get(_MOE)
    fused_swiglu = _fused_swiglu_base()
    return ((moe is not None and isinstance(module, moe.GroupedExperts))
            or (fused_swiglu is not None and isinstance(module, fused_swiglu)))


def torchtitan_skip_reason(module: nn.Module) -> str | None:
    """Why a torchtitan ``GroupedExperts`` or ``FusedSwiGLU`` cannot be
    switched (a subclass with its own forward, a replaced ``_grouped_mm``
    seam such as MXFP8's, a replaced instance forward, unknown parameters),
    or None if it can be or ``module`` is neither."""
    if not is_torchtitan_switchable(module):
        return None
    cls = type(module)
    if getattr(cls, "_swiglu_base", None) in _class_bases():
        return None
    base = _switchable_class_of(module)
    if base is None:
        return f"{cls.__name__} subclasses {cls.__mro__[1].__name__} with its own forward, which swiglu_cupy " \
               "does not reproduce"
    if "forward" in module.__dict__:
        return "its forward is replaced on the instance, which would bypass the fusion"
    if base is _fused_swiglu_base():
        names, expected = set(module._parameters), ({"w13"},)
    else:
        moe = sys.modules[_MOE]
        if "_grouped_mm" in module.__dict__ or cls._grouped_mm is not moe.GroupedExperts._grouped_mm:
            return "its _grouped_mm seam is replaced (a low-precision grouped GEMM, e.g. MXFP8): left as is"
        names, expected = set(module._parameters), ({"w1_EFD", "w2_EDF", "w3_EFD"}, {"w13", "w2_EDF"})
    if names not in expected:
        return f"unexpected parameters {sorted(names)}"
    if any(p is not None and p.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64)
           for p in module.parameters()):
        return "non-floating weights"
    return None


def patch_torchtitan_class(module: nn.Module, recompute_gate_up: bool = False, tile_rows=None) -> str | None:
    """Switch a torchtitan ``GroupedExperts`` (``w1_EFD``/``w3_EFD`` or the
    fused ``w13`` override) or ``FusedSwiGLU`` in place so its forward runs
    :func:`swiglu_cupy.moe.grouped_experts` (experts) or
    :func:`swiglu_cupy.swiglu` (``FusedSwiGLU``), and return the line the patch
    report shows. None if ``module`` is neither or cannot be switched
    (:func:`torchtitan_skip_reason` says why).

    Decided from the class, so it works on the meta device (no probe: the
    class's forward is torchtitan's own, reproduced exactly). The instance
    keeps its class as a base (``isinstance`` and torchtitan's ``Module``
    protocol hold) and its parameters (state_dict keys unchanged). ``tile_rows``: see
    :func:`swiglu_cupy.swiglu` (rows of the grouped experts per tile)."""
    if not isinstance(recompute_gate_up, bool):
        raise TypeError(f"recompute_gate_up must be a bool, got {type(recompute_gate_up).__name__}")
    check_tile_rows(tile_rows)
    base = _switchable_class_of(module)
    if base is None or torchtitan_skip_reason(module) is not None:
        return None
    already = type(module) is not base
    module.__class__ = fused_torchtitan_class(base)
    module._swiglu_cupy_recompute_gate_up = recompute_gate_up
    module._swiglu_cupy_tile_rows = tile_rows
    tail = ((", recompute_gate_up" if recompute_gate_up else "") + ("" if tile_rows is None else f", tile_rows={tile_rows}")
            + (" (already fused)" if already else ""))
    if base is _fused_swiglu_base():
        return "swiglu_cupy.swiglu, w13 [F, 2, D] as interleaved w12 (a view)" + tail
    packed = "w13" in module._parameters
    layout = ("grouped_experts, w13 [E, F, 2, D] as interleaved w12 (a view)" if packed else
              "grouped_experts_unpacked, w1_EFD/w3_EFD as the gate and up weights (not concatenated)")
    return (f"swiglu_cupy.moe.{layout}, bf16 as torchtitan; router scores in the "
            f"dispatcher's combine" + tail)


# ---- torchtitan's model-transform extension point --------------------------------------------

def _build_converter_class() -> type:
    from torchtitan.models.common.feed_forward import FeedForward
    from torchtitan.models.common.moe import GroupedExperts
    from torchtitan.protocols.model import ModelConfigConverter
    from torchtitan.protocols.module import Module

    def targets() -> tuple[type, ...]:
        return (FeedForward, GroupedExperts, *_class_bases())

    class SwiGLUCupyConverter(ModelConfigConverter):
        """Runs torchtitan's ``FeedForward`` and ``GroupedExperts`` (and the
        ``FusedGroupedExperts`` override) on swiglu_cupy: their configs are
        replaced by configs of swiglu_cupy subclasses (same fields, same
        parameters and init, same state_dict), before the model is built."""

        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(ModelConfigConverter.Config):
            recompute_gate_up: bool = False
            """Save only each FFN's input and recompute the gate/up GEMM in backward."""
            tile_rows: int | str | None = None
            """Run long inputs in tiles of this many rows (or "auto"): see swiglu_cupy.swiglu."""

        def __init__(self, config: Config, **kwargs):
            self.config = config
            self.converted: list[str] = []
            self.left_alone: list[str] = []

        def convert(self, model_config: Module.Config) -> Module.Config:
            root = model_config
            bases = targets()
            for fqn, cfg, parent, attr in reversed(list(model_config.traverse(Module.Config, recurse=True))):
                owner = type(cfg)._owner
                if owner is None or getattr(owner, "_swiglu_base", None) is not None:
                    continue
                if owner not in bases:
                    if isinstance(owner, type) and issubclass(owner, (FeedForward, GroupedExperts)):
                        self.left_alone.append(f"{fqn} ({owner.__name__}: its own forward)")
                    continue
                fused = fused_torchtitan_class(owner)
                new = fused.Config(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.init},
                                   recompute_gate_up=self.config.recompute_gate_up,
                                   tile_rows=self.config.tile_rows)
                self.converted.append(fqn)
                if parent is None:
                    root = new
                elif isinstance(parent, list):
                    parent[attr] = new
                else:
                    setattr(parent, attr, new)
            return root

    SwiGLUCupyConverter.__module__ = __name__
    return SwiGLUCupyConverter


_CONVERTER: list[type] = []


def __getattr__(name: str):
    if name == "SwiGLUCupyConverter":  # needs torchtitan: built on first use
        if not _CONVERTER:
            _CONVERTER.append(_build_converter_class())
        return _CONVERTER[0]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
