"""Hugging Face MoE experts through the fused op (``swiglu_cupy.moe``).

transformers (5.17+) runs every experts module decorated with
``@use_experts_implementation`` (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3/V4,
GPT-OSS, ...) through a function picked by name from its
``ExpertsInterface``. Importing this module registers ours as
``"swiglu_cupy"`` (when transformers is installed), so that

    model = AutoModelForCausalLM.from_pretrained(..., experts_implementation="swiglu_cupy")
    # or, on a loaded model:
    n = patch_experts(model)      # experts modules switched to the fused op

The experts' weights stay where they are (``gate_up_proj [E, 2I, D]``,
``down_proj [E, D, I]``, GPT-OSS's transposed ``[E, D, 2I]`` / ``[E, I, D]``
and biases): checkpoints, FSDP and optimizers see the same parameters.

Each module's gate is honoured, never approximated:
- the default gate (``act_fn(gate) * up`` on the halves) maps to the
  ``GLUActivation`` of its ``act_fn`` (recognised by value);
- the known ``_apply_gate`` overrides map to their spec: GPT-OSS (OAI form,
  interleaved, ``alpha``/``limit`` from the module), DeepSeek-V4 (clamped
  SwiGLU, ``limit`` from the module);
- each mapping is checked once against the module's own ``_apply_gate`` on a
  probe tensor that crosses the clamps; an unknown override, a mismatch, a
  learnable activation or an ungated expert (``has_gate=False``) is left
  unfused, with one warning per class: that module keeps the implementation
  it had (Hugging Face's ``grouped_mm`` by default).
- then the whole experts forward is checked (fail closed: a transformers
  release that changes the routing, the combine, a layout or a flag's
  meaning): the fused forward and the implementation the module had (its
  class's own forward where that one cannot run) on a probe routed to two
  experts, in the module's dtype, must agree, or the module stays unfused
  with the reason. Weights that cannot be computed with yet (meta device,
  ZeRO-3 partitions) leave the plan pending: the check runs at the first
  forward on real weights (a refusal then warns, ``SWIGLU_CUPY_STRICT=1``
  raises). DTensor weights are checked on their local shards.
Flags: ``has_bias``, ``is_transposed``, ``has_post_expert_norm`` (the
routing weight then multiplies the normed output), and the expert-parallel
sentinels (``_is_expert_parallel``: ids >= num_experts contribute zero and no
router gradient; transformers releases without the flag always treat them
so). Each token's K expert outputs are summed in a fixed order in fp32, as
Hugging Face does.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from .._validation import check_flags, check_saved_x12, check_tile_rows
from ..activations import GPT_OSS, GLUActivation
from .._validation import check_expert_ids
from ..moe.routing import route_and_combine
from .fused import refuse_at_first_forward, unmaterialised
from .plan_runner import _zero3, is_dtensor
from .probe import describe_error
from .recognition import KNOWN_ACTIVATIONS, identify_activation, rows_agree
from .switch_proof import probe_tensor
from ..reference import glu_reference, split_gate_up

__all__ = ["NAME", "register", "patch_experts", "experts_plans", "experts_forward", "experts_plan", "is_hf_experts",
           "ExpertsPlan"]

NAME = "swiglu_cupy"
_PLAN_ATTR = "_swiglu_cupy_plan"
# The plain kinds among the activations recognised by value (quick GELU is an OAI form, not an act_fn kind).
_PLAIN_KINDS = tuple(s.kind for s in KNOWN_ACTIVATIONS.values() if s.kind != "oai")


@dataclass(frozen=True)
class ExpertsPlan:
    """How one experts module runs: fused with ``activation`` (None: left unfused)."""
    activation: GLUActivation | None
    transposed: bool = False
    recompute_gate_up: bool = False
    fallback: str = "grouped_mm"   # the implementation an unfused module keeps
    reason: str = ""
    saved_x12: str | None = None   # "fp8": x12 saved in 8 bits (see swiglu_cupy.swiglu)
    tile_rows: int | str | None = None   # tokens per tile, or "auto" (see swiglu_cupy.moe.routed_experts)
    #: The forward check waits for real weights (meta, ZeRO-3 partitions): made at the first forward.
    pending: bool = False


# ---- transformers hooks (imported lazily: 3 s) ---------------------------------------------

_WRAPPER_CODE = None


def _moe_module():
    import transformers.integrations.moe as moe_integration
    return moe_integration


def _wrapper_code():
    """The code object of the forward that ``@use_experts_implementation``
    installs on every experts class (one closure body for all of them)."""
    global _WRAPPER_CODE
    if _WRAPPER_CODE is None:
        class _Probe(nn.Module):
            def __init__(self, config):
                super().__init__()

            def forward(self, hidden_states, top_k_index, top_k_weights):
                return hidden_states

        _WRAPPER_CODE = _moe_module().use_experts_implementation(_Probe).forward.__code__
    return _WRAPPER_CODE


@functools.lru_cache(maxsize=None)
def _have_transformers() -> bool:
    return importlib.util.find_spec("transformers") is not None


def register() -> bool:
    """Register ``experts_forward`` under ``"swiglu_cupy"`` in transformers'
    ExpertsInterface (idempotent). False when transformers is not installed."""
    if not _have_transformers():
        return False
    interface = _moe_module().ExpertsInterface
    interface.register(NAME, experts_forward)
    return True


def is_hf_experts(module: nn.Module) -> bool:
    """True for an instance of a ``@use_experts_implementation`` experts class."""
    if not _have_transformers():
        return False
    return getattr(type(module).forward, "__code__", None) is _wrapper_code()


# ---- the gate: which activation spec, checked on a probe --------------------------------------

def _kind_of(act) -> str | None:
    """The plain GLU kind a parameter-free activation computes (by value, in
    float64), or None."""
    spec = identify_activation(act, torch.float64)
    return spec.kind if spec is not None and spec.kind in _PLAIN_KINDS else None


def _default_gate_spec(module) -> GLUActivation | None:
    kind = _kind_of(getattr(module, "act_fn", None))
    return None if kind is None else GLUActivation(kind)


def _gpt_oss_param(module, name: str, config_name: str, default: float) -> float:
    """GPT-OSS's gate constant as its ``_apply_gate`` reads it: the module's
    attribute (transformers 5.17 sets the constant there, 5.24 copies
    ``config.swiglu_*``), else the config's, else the published constant.
    ``_gate_matches`` verifies the result either way."""
    value = getattr(module, name, None)
    if value is None:
        value = getattr(getattr(module, "config", None), config_name, None)
    return float(default if value is None else value)


def _gpt_oss_spec(module) -> GLUActivation:
    return GLUActivation("oai", limit=_gpt_oss_param(module, "limit", "swiglu_limit", GPT_OSS.limit),
                         alpha=_gpt_oss_param(module, "alpha", "swiglu_alpha", GPT_OSS.alpha),
                         up_offset=1.0, interleaved=True)


def _deepseek_v4_spec(module) -> GLUActivation | None:
    kind = _kind_of(getattr(module, "act_fn", None))
    return None if kind is None else GLUActivation(kind, limit=module.limit)


# (module of the function, its qualname) -> spec builder. The default gate is
# the one use_experts_implementation installs when a class has none.
KNOWN_GATES = {
    ("transformers.integrations.moe", "_default_apply_gate"): _default_gate_spec,
    ("transformers.models.gpt_oss.modeling_gpt_oss", "GptOssExperts._apply_gate"): _gpt_oss_spec,
    ("transformers.models.deepseek_v4.modeling_deepseek_v4", "DeepseekV4Experts._apply_gate"): _deepseek_v4_spec,
}


def _gate_matches(module, spec: GLUActivation, two_i: int) -> bool:
    """The module's own ``_apply_gate`` equals the spec's formula on a float64
    probe whose values cross the clamp limits."""
    scale = 2.0 * (spec.limit if spec.limit is not None else 4.0)
    gen = torch.Generator().manual_seed(0)
    # On the CPU whatever the default device: patching under `with torch.device("meta")` must still probe.
    x12 = (torch.rand(6, two_i, generator=gen, dtype=torch.float64, device="cpu") * 2 - 1) * scale
    try:
        with torch.no_grad():
            got = module._apply_gate(x12.clone())
    except Exception:
        return False
    return rows_agree(glu_reference(*split_gate_up(x12, spec), spec), got, torch.float64)


def _resolve(module, recompute_gate_up: bool, fallback: str, saved_x12=None, tile_rows=None) -> ExpertsPlan:
    cls = type(module).__name__
    unfused = lambda reason: ExpertsPlan(None, fallback=fallback, reason=f"{cls}: {reason}")  # noqa: E731
    if not getattr(module, "has_gate", True):
        return unfused("has_gate=False (an ungated expert, not a GLU)")
    gate_fn = getattr(type(module), "_apply_gate", None)
    key = (getattr(gate_fn, "__module__", None), getattr(gate_fn, "__qualname__", None))
    builder = KNOWN_GATES.get(key)
    if builder is None:
        return unfused(f"_apply_gate is overridden by {key[0]}.{key[1]}, a gate swiglu_cupy does not know")
    spec = builder(module)
    if spec is None:
        return unfused("its act_fn is not a parameter-free silu/gelu/gelu_tanh/relu/sigmoid/identity")
    transposed = bool(getattr(module, "is_transposed", getattr(module, "experts_are_transposed", False)))
    w12, w3 = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(w12, torch.Tensor) and isinstance(w3, torch.Tensor)):
        return unfused("gate_up_proj/down_proj are not 3-D tensors")
    s12, s3 = _full_shape(w12), _full_shape(w3)
    if len(s12) != 3 or len(s3) != 3:
        return unfused("gate_up_proj/down_proj are not 3-D tensors")
    two_i = s12[2] if transposed else s12[1]
    down_i = s3[1] if transposed else s3[2]
    if two_i != 2 * down_i:
        return unfused(f"gate_up_proj {tuple(s12)} and down_proj {tuple(s3)} do not fit the "
                       f"{'transposed' if transposed else 'standard'} layout")
    if not _gate_matches(module, spec, two_i):
        return unfused(f"its _apply_gate does not compute {spec} on a probe")
    plan = ExpertsPlan(spec, transposed, recompute_gate_up, fallback, saved_x12=saved_x12, tile_rows=tile_rows)
    if unmaterialised(module):
        return dataclasses.replace(plan, pending=True)
    reason = _forward_mismatch(module, plan)
    return plan if reason is None else unfused(reason)


# ---- the forward check: the fused forward against the implementation the module had ----------

def _local_view(module: nn.Module) -> nn.Module:
    """``module``, or where its weights are DTensors (transformers'
    distributed engine) a shallow copy holding their local shards, with
    ``num_experts`` the local count: what one rank's experts compute."""
    if not any(is_dtensor(p) for p in module.parameters(recurse=False)):
        return module
    view = object.__new__(type(module))
    view.__dict__ = dict(module.__dict__)
    view._parameters = {k: (p.to_local() if is_dtensor(p) else p) for k, p in module._parameters.items()}
    view.num_experts = view._parameters["gate_up_proj"].shape[0]
    return view


def _probe_routing(module: nn.Module, plan: ExpertsPlan):
    """Six tokens in the weights' dtype and device, each routed to two
    experts (all of them when there are fewer than six), with unequal weights."""
    w12 = module.gate_up_proj
    experts = w12.shape[0]
    hidden = probe_tensor((6, w12.shape[1] if plan.transposed else w12.shape[2]), w12)
    k = min(2, experts)
    ids = (torch.arange(6).unsqueeze(1) + torch.arange(k).unsqueeze(0)) % experts
    weights = torch.linspace(0.2, 0.9, 6 * k, dtype=torch.float32).reshape(6, k)
    return hidden, ids.to(hidden.device), weights.to(hidden.device, hidden.dtype)


def _run_probe(fn):
    try:
        with torch.no_grad():
            return fn(), None
    except Exception as error:
        return None, error


def _forward_mismatch(module: nn.Module, plan: ExpertsPlan) -> str | None:
    """None when the fused forward agrees with the implementation the
    module had (``plan.fallback``; where that fails on the probe, the class's
    own forward) on a probe, else the reason."""
    view = _local_view(module)
    try:
        args = _probe_routing(view, plan)
    except Exception as error:
        return "its forward could not be checked: no probe input for its weights" + describe_error(error)
    own_forward = type(module).forward.__wrapped__
    expected, error = _run_probe(lambda: _fallback(view, plan.fallback)(view, *args))
    where = f"its {plan.fallback!r} implementation"
    if not isinstance(expected, torch.Tensor):
        expected, own_error = _run_probe(lambda: own_forward(view, *args))
        where = f"its own forward ({own_forward.__module__}.{own_forward.__qualname__})"
        if not isinstance(expected, torch.Tensor):
            return "could not be probed: its forward failed on a probe input" + describe_error(own_error or error)
    actual, error = _run_probe(lambda: _fused_forward(view, plan, *args))
    if not isinstance(actual, torch.Tensor):
        return "the fused forward failed on a probe input" + describe_error(error)
    if not rows_agree(expected, actual, args[0].dtype):
        return (f"probe mismatch: {where} disagrees with the fused experts forward on a probe input "
                f"({args[0].dtype}): a transformers version whose experts forward changed? left unfused")
    return None


def _full_shape(t: torch.Tensor) -> torch.Size:
    """``t``'s shape, also while DeepSpeed ZeRO-3 holds it partitioned (its
    data is empty then; the forward runs on the weights ZeRO-3 gathered)."""
    ds = _zero3()
    return t.shape if ds is None else ds.zero3_full_shape(t)


_WARNED: set = set()


def experts_plan(module: nn.Module) -> ExpertsPlan:
    """The module's plan (resolved once, then kept on the module; a pending
    one is shown as it will run once its forward check passes)."""
    plan = module.__dict__.get(_PLAN_ATTR)
    if plan is None:
        plan = _resolve_once(module)
    return plan


@torch.compiler.disable
def _resolve_once(module: nn.Module) -> ExpertsPlan:
    plan = _resolve(module, False, "grouped_mm")
    _store(module, plan)
    return plan


@torch.compiler.disable
def _settle(module: nn.Module, plan: ExpertsPlan) -> ExpertsPlan:
    """A pending plan's forward check, at a forward on real weights (ZeRO-3
    has gathered them here); still unmaterialised: pending, unfused meanwhile."""
    if unmaterialised(module):
        return plan
    reason = _forward_mismatch(module, plan)
    if reason is None:
        settled = dataclasses.replace(plan, pending=False)
    else:
        settled = ExpertsPlan(None, fallback=plan.fallback, reason=f"{type(module).__name__}: {reason}")
    module.__dict__[_PLAN_ATTR] = settled
    if reason is not None:
        refuse_at_first_forward(f"swiglu_cupy: an experts module patched on the meta device (or partitioned) was "
                                f"checked at its first forward and stays unfused: {settled.reason}", stacklevel=4)
    return settled


def _store(module: nn.Module, plan: ExpertsPlan) -> None:
    module.__dict__[_PLAN_ATTR] = plan
    if plan.activation is None and type(module) not in _WARNED:
        _WARNED.add(type(module))
        warnings.warn(f"swiglu_cupy: {plan.reason}; this experts module stays unfused "
                      f"(experts implementation {plan.fallback!r})", stacklevel=3)


# ---- the experts function -------------------------------------------------------------------

def experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts-function signature: ``[T, D]`` from the top-k routing."""
    plan = experts_plan(self)
    if plan.pending:
        plan = _settle(self, plan)
    if plan.activation is None or plan.pending:
        return _fallback(self, plan.fallback)(self, hidden_states, top_k_index, top_k_weights)
    return _fused_forward(self, plan, hidden_states, top_k_index, top_k_weights)


def _fallback(module: nn.Module, name: str):
    """The experts function ``name`` of transformers (its class's own forward for ``"eager"``)."""
    return _moe_module().ALL_EXPERTS_FUNCTIONS.get_interface(name, type(module).forward.__wrapped__)


def _fused_forward(self: nn.Module, plan: ExpertsPlan, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                   top_k_weights: torch.Tensor) -> torch.Tensor:
    w12, w3 = self.gate_up_proj, self.down_proj
    has_bias = getattr(self, "has_bias", False)
    b12 = self.gate_up_proj_bias if has_bias else None
    b3 = self.down_proj_bias if has_bias else None
    # transformers before the flag masked the sentinels always.
    sentinels = bool(getattr(self, "_is_expert_parallel", True))
    if not torch.compiler.is_compiling() and top_k_index.device.type == "cpu":  # no sync to pay on the CPU
        check_expert_ids("top_k_index", top_k_index, w12.shape[0], allow_sentinels=sentinels)
    x = hidden_states
    if x.dtype != w12.dtype and not torch.is_autocast_enabled(x.device.type):
        x = x.to(w12.dtype)  # e.g. an fp32 norm output into bf16 experts, as transformers does
    post = self.post_expert_norm if getattr(self, "has_post_expert_norm", False) else None
    out = route_and_combine(x, top_k_index, top_k_weights, w12, b12, w3, b3, plan.activation, plan.transposed,
                            plan.recompute_gate_up, sentinels, post, saved_x12_fp8=plan.saved_x12 == "fp8",
                            tile_rows=plan.tile_rows)
    return out.to(hidden_states.dtype)


def patch_experts(model: nn.Module, *, recompute_gate_up: bool = False, saved_x12=None, tile_rows=None) -> int:
    """Switch every ``@use_experts_implementation`` experts module of
    ``model`` to the fused op; returns how many run fused. Modules whose gate
    cannot be fused exactly stay on the implementation they had (one warning
    per class). ``recompute_gate_up`` saves only the token inputs (each once) for
    backward (x12 is recomputed: one grouped GEMM more); ``saved_x12="fp8"``
    saves x12 in 8 bits (see ``swiglu_cupy.swiglu``); ``tile_rows`` (an int or
    ``"auto"``) runs long inputs a tile of tokens at a time (see
    ``swiglu_cupy.moe.routed_experts``). Call it before torch.compile."""
    plans = experts_plans(model, recompute_gate_up=recompute_gate_up, saved_x12=saved_x12, tile_rows=tile_rows)
    return sum(plan.activation is not None for plan in plans.values())


def experts_plans(model: nn.Module, *, recompute_gate_up: bool = False, saved_x12=None,
                  tile_rows=None) -> dict[str, ExpertsPlan]:
    """:func:`patch_experts`, returning each experts module's plan by its path
    (an unfused one carries the reason: ``patch()`` reports it as skipped)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    check_flags(recompute_gate_up=recompute_gate_up)
    check_saved_x12(saved_x12, recompute_gate_up)
    check_tile_rows(tile_rows)
    if not register():
        return {}
    plans = {}
    had = {}  # id(config) -> its implementation before this call (modules share their config)
    for path, module in model.named_modules():
        if not is_hf_experts(module):
            continue
        config = module.config
        current = had.setdefault(id(config), getattr(config, "_experts_implementation", None))
        previous = module.__dict__.get(_PLAN_ATTR)
        if current == NAME:
            fallback = previous.fallback if previous is not None else "grouped_mm"
        else:
            fallback = current if current is not None else "grouped_mm"
        plan = _resolve(module, recompute_gate_up, fallback, saved_x12, tile_rows)
        _store(module, plan)
        config._experts_implementation = NAME
        plans[path] = plan
    return plans


def _register_on_import() -> None:
    try:
        register()
    except ImportError:  # a transformers without ExpertsInterface (before 5.x): nothing to hook
        pass


_register_on_import()
