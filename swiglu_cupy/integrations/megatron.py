"""Megatron-core integration: its ``MLP`` (``gated_linear_unit=True``, the local
spec's ``ColumnParallelLinear`` fc1 and ``RowParallelLinear`` fc2) on the fused op.

Checked against megatron-core 0.16.1, on the CPU (gloo) at tensor-parallel
sizes 1 and 2 (``tests/test_megatron.py``). ``swiglu_cupy.patch(model)``
switches every such ``MLP`` in place to a subclass whose forward runs, on each
rank's own shards:

* ``copy_to_tensor_model_parallel_region`` on the input (what fc1's backward
  all-reduce of the input gradient does), except where fc1 skips it itself
  (MoE experts under TP or EP: their token dispatcher communicates;
  ``disable_grad_reduce``);
* :func:`swiglu_cupy.swiglu` on fc1's ``[gate_r; up_r]`` rows (megatron's GLU
  chunks fc1's local output in halves, gate first), fc1's bias, and fc2's
  column shard, without fc2's bias;
* ``reduce_from_tensor_model_parallel_region`` on the partial output (fc2's
  all-reduce; again not for experts under TP/EP), then megatron's return
  contract: ``(output, fc2.bias)``, or the bias added here when fc2 was built
  without ``skip_bias_add``; with a ``per_token_scale`` (MoE probabilities),
  the output rows are scaled (a per-row scale commutes with fc2 and with the
  reduction) and a bias is added scaled, as megatron does.

Decided from the class, the installed version and the config: no probe (a
probe under TP would run collectives, and megatron's CUDA-only paths cannot
run here). Only what was proven equal is fused: the megatron-core versions in
:data:`MEGATRON_VERSIONS_PROVEN` (read with ``importlib.metadata``) and the
config values in ``_PROVEN_CONFIG`` (an allow-list: another value, or a field
the config no longer has, is refused). What is refused, with the reason in
the report: another version, Transformer Engine linears or
activation, a subclass with its own forward, ``sequence_parallel`` (the
unpatched MLP cannot run on the CPU, so there is nothing to check parity
against: megatron allocates its all-gather buffer with
``torch.cuda.current_device()``, megatron/core/utils.py:631), gradient
accumulation fusion (main_grad written by a CUDA kernel), delayed wgrad,
fp8/fp4, activations the fused op has no form for.

megatron is imported only by code that finds it in ``sys.modules``: the walk
calls :func:`is_megatron_mlp` on every module at no cost without it.
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

from .._validation import check_saved_x12, check_tile_rows
from ..activations import GLUActivation
from ..dense.api import swiglu
from .fused import switched_base, switched_class

__all__ = ["is_megatron_mlp", "megatron_skip_reason", "patch_megatron_mlp", "fused_megatron_class",
           "megatron_activation"]

_MLP = "megatron.core.transformer.mlp"
_LAYERS = "megatron.core.tensor_parallel.layers"
_MAPPINGS = "megatron.core.tensor_parallel.mappings"
_ACTIVATIONS = "megatron.core.activations"

#: The megatron-core releases whose MLP forward the fused one was proven
#: equal to (tests/test_megatron.py; its CUDA-only paths cannot run here, so
#: the switch is not probed: it is accepted from the version and the config).
#: Any other installed version is refused, with the reason.
MEGATRON_VERSIONS_PROVEN = ("0.16.1",)

#: The config values under which megatron's linears were proven to compute
#: what the fused op does (field -> (allowed values, why other values are
#: refused)). A value outside, or a field missing from the config (a release
#: that renamed it), is refused: an allow-list, so what was not proven is not fused.
_PROVEN_CONFIG = {
    "sequence_parallel": ((False,), (
        "sequence_parallel: not reproduced, since the unpatched MLP cannot run on the CPU to check it "
        "(megatron's sequence-parallel all-gather buffer is allocated with torch.cuda.current_device(), "
        "megatron/core/utils.py:631); left as is")),
    "gradient_accumulation_fusion": ((False,), (
        "gradient_accumulation_fusion: megatron's CUDA kernel accumulates the weight gradients into main_grad; "
        "left as is")),
    "delay_wgrad_compute": ((False,), "delay_wgrad_compute: the weight gradients are deferred to backward_dw; "
                                      "left as is"),
    "fp8": ((None,), "fp8: megatron's linears run in fp8 (Transformer Engine); left as is"),
    "fp4": ((None,), "fp4: megatron's linears run in fp4 (Transformer Engine); left as is"),
    "use_te_activation_func": ((False,), "use_te_activation_func: Transformer Engine's activation module; "
                                         "left as is"),
    "defer_embedding_wgrad_compute": ((False,), "defer_embedding_wgrad_compute: fc1 buffers its inputs; "
                                                "left as is"),
    "cpu_offloading": ((False,), "cpu_offloading: megatron offloads the linears' inputs itself; left as is"),
    "bias_activation_fusion": ((False, True), "bias_activation_fusion: a value other than True/False"),
    "add_bias_linear": ((False, True), "add_bias_linear: a value other than True/False"),
}


#: SHA-256 of the source of megatron's ``MLP.forward`` in those releases: a
#: forward replaced since (a patch of the installed package, a monkeypatch)
#: is not the one proven, and is refused.
_PROVEN_FORWARD_SHA256 = {"c68406f3ca95514d26cb5a883f94aa2308eb7fbd3ed5da190da355fbcebab61d"}


def _forward_reason(base: type) -> str | None:
    """Why ``base.forward`` is not the megatron ``MLP.forward`` proven, or None."""
    import hashlib
    import inspect

    try:
        source = inspect.getsource(base.forward)
    except (OSError, TypeError) as error:
        return f"the source of {base.__name__}.forward cannot be read ({type(error).__name__}): left as is"
    if hashlib.sha256(source.encode()).hexdigest() not in _PROVEN_FORWARD_SHA256:
        return (f"{base.__module__}.{base.__qualname__}.forward is not the forward proven equal to the fused one "
                f"(megatron-core {', '.join(MEGATRON_VERSIONS_PROVEN)}): replaced or changed; left as is")
    return None


def megatron_version() -> str | None:
    """The installed megatron-core's version (``importlib.metadata``), or None."""
    from importlib import metadata

    try:
        return metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        return None


def megatron_version_reason() -> str | None:
    """Why the installed megatron-core is not one the fused MLP was proven
    equal to, or None if it is."""
    version = megatron_version()
    if version in MEGATRON_VERSIONS_PROVEN:
        return None
    return (f"megatron-core {version} is installed: its MLP forward was proven equal to the fused one only "
            f"for {', '.join(MEGATRON_VERSIONS_PROVEN)} (its CUDA-only paths cannot be probed here); left as is")


def _config_reason(config) -> str | None:
    """Why ``config`` holds a value outside the allow-list, or None."""
    for field, (allowed, why) in _PROVEN_CONFIG.items():
        if not hasattr(config, field):
            return (f"its config has no {field} (a megatron-core release other than the one checked?): "
                    "left as is")
        value = getattr(config, field)
        if not any(value is a or (type(value) is type(a) and value == a) for a in allowed):
            return why if why.endswith("left as is") else f"{why} ({value!r}); left as is"
    return None


def _mlp_class():
    return getattr(sys.modules.get(_MLP), "MLP", None)


def is_megatron_mlp(module: nn.Module) -> bool:
    """A megatron-core ``MLP`` (or a subclass: TE's ``TEFusedMLP``, switched or not)."""
    cls = _mlp_class()
    return cls is not None and isinstance(module, cls)


def megatron_activation(config, bias_activation_fusion: bool | None = None) -> tuple[GLUActivation | None, str]:
    """The activation megatron's ``MLP.forward`` applies to fc1's output for
    ``config`` (without ``per_token_scale``), or None and why there is none
    that swiglu_cupy reproduces.

    Megatron's own paths: with ``bias_activation_fusion``, F.silu runs
    ``bias_swiglu_impl`` (clamp and offset not applied) and F.gelu runs
    ``bias_geglu_impl``, the tanh approximation; without it, its ``glu``
    clamps the gate (max) and up (both sides) by ``activation_func_clamp_value``
    and adds ``glu_linear_offset`` to up, for any ``activation_func``."""
    fn = config.activation_func
    fusion = config.bias_activation_fusion if bias_activation_fusion is None else bias_activation_fusion
    quick_gelu = getattr(sys.modules.get(_ACTIVATIONS), "quick_gelu", None)
    name = getattr(fn, "__name__", type(fn).__name__)
    if fusion:
        if fn is F.silu:
            return GLUActivation("silu"), ""
        if fn is F.gelu:
            return GLUActivation("gelu_tanh"), ""
        return None, (f"bias_activation_fusion with activation_func={name}: megatron's fused kernel for it "
                      "is not reproduced; left as is")
    limit = config.activation_func_clamp_value
    offset = float(config.glu_linear_offset or 0.0)
    if quick_gelu is not None and fn is quick_gelu:
        return GLUActivation("oai", limit=limit, alpha=1.702, up_offset=offset), ""
    kind = {F.silu: "silu", F.gelu: "gelu", F.relu: "relu", torch.sigmoid: "sigmoid"}.get(fn)
    if kind is None:
        return None, f"activation_func={name} has no swiglu_cupy form; left as is"
    if offset != 0.0:
        return None, f"glu_linear_offset={offset:g} with {kind}: no swiglu_cupy form; left as is"
    return GLUActivation(kind, limit=limit), ""


def megatron_linear_impl(cls: type):
    """The GEMM seam of megatron's ``ColumnParallelLinear``/``RowParallelLinear``
    class ``cls``: its private ``_forward_impl`` (megatron-core 0.16.1), which a
    subclass overrides to run another GEMM. The fused MLP reproduces the
    local linears only where it is megatron's own. If renamed: this returns
    None for every class, so every megatron MLP still compares equal and is
    fused; ``tests/test_megatron.py`` checks that the name exists."""
    return getattr(cls, "_forward_impl", None)


def _linear_obstacle(m: nn.Module, role: str, base_name: str) -> str | None:
    """Why calling fc1/fc2 is not megatron's local linear on its own shard."""
    layers = sys.modules.get(_LAYERS)
    base = getattr(layers, base_name, None)
    if base is None or not isinstance(m, base):
        return (f"{role} is {type(m).__name__}, not megatron's {base_name} (the local spec; Transformer "
                "Engine's linears run their own GEMMs); left as is")
    if type(m).forward is not base.forward or megatron_linear_impl(type(m)) is not megatron_linear_impl(base):
        return f"{role} ({type(m).__name__}) overrides {base_name}'s forward; left as is"
    if m._forward_pre_hooks or m._forward_hooks or m._backward_pre_hooks or m._backward_hooks:
        return f"{role} has hooks; left as is"
    if "forward" in m.__dict__:
        return f"{role} has its forward replaced on the instance; left as is"
    if m.weight is None:
        return f"{role} has no weight of its own (skip_weight_param_allocation); left as is"
    return None


def megatron_skip_reason(module: nn.Module) -> str | None:
    """Why a megatron ``MLP`` cannot be switched, or None if it can be (or is
    no megatron ``MLP``)."""
    if not is_megatron_mlp(module):
        return None
    base = _mlp_class()
    cls = switched_base(module)
    if cls is not base:
        return f"{cls.__name__} subclasses megatron's MLP with its own forward, which swiglu_cupy does not reproduce"
    if "forward" in module.__dict__:
        return "its forward is replaced on the instance, which would bypass the fusion"
    config = module.config
    if not config.gated_linear_unit:
        return "gated_linear_unit=False: not a GLU feed-forward; left as is"
    why = megatron_version_reason() or _forward_reason(base) or _config_reason(config)
    if why is not None:
        return why
    for role, name, base_name in (("linear_fc1", "linear_fc1", "ColumnParallelLinear"),
                                  ("linear_fc2", "linear_fc2", "RowParallelLinear")):
        why = _linear_obstacle(module._modules[name], role, base_name)
        if why is not None:
            return why
    fc1, fc2 = module.linear_fc1, module.linear_fc2
    if fc1.gather_output or not fc1.skip_bias_add or not fc2.input_is_parallel:
        return "linear_fc1 gathers its output or adds its bias itself, or linear_fc2's input is not parallel"
    if fc1.weight.shape[0] % 2:
        return f"linear_fc1 has an odd number of rows ({fc1.weight.shape[0]}): no [gate; up] halves"
    if module.activation_func is not config.activation_func:
        return "the instance's activation_func differs from its config's; left as is"
    act, why = megatron_activation(config)
    if act is None:
        return why
    if any(p.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64)
           for p in module.parameters()):
        return "non-floating weights"
    return None


def _hooked(m: nn.Module) -> bool:
    return bool(m._forward_pre_hooks or m._forward_hooks or m._backward_pre_hooks or m._backward_hooks
                or "forward" in m.__dict__)


def _mappings():
    return sys.modules[_MAPPINGS]


def _mlp_forward(self, hidden_states, per_token_scale=None, **kwargs):
    """megatron's ``MLP.forward`` contract, the whole MLP in the fused op on this rank's shards."""
    config = self.config
    fc1, fc2 = self.linear_fc1, self.linear_fc2
    if _hooked(fc1) or _hooked(fc2) or (config.bias_activation_fusion and per_token_scale is not None and (
            self.activation_func is not F.silu or fc1.bias is not None)):
        # Hooks put on fc1/fc2 after patching (megatron DDP's overlap_param_gather waits for each
        # module's parameter all-gather in a forward pre-hook) must see their calls: megatron's forward.
        # megatron's weighted fused kernels: only silu without fc1 bias (weighted_bias_swiglu_impl);
        # the others raise there (gelu's ValueError, the bias's NotImplementedError): as megatron does
        return type(self)._swiglu_base.forward(self, hidden_states, per_token_scale=per_token_scale, **kwargs)
    activation = self._swiglu_cupy_activation
    mappings = _mappings()
    x = hidden_states
    if not (fc1.explicit_expert_comm or fc1.disable_grad_reduce):
        # fc1's backward all-reduces the input gradient across TP (an identity at TP 1)
        x = mappings.copy_to_tensor_model_parallel_region(x, group=fc1.tp_group)
    y = swiglu(x, fc1.weight, fc1.bias, fc2.weight, None, activation=activation,
               recompute_gate_up=self.recompute_gate_up, inplace_backward=self.inplace_backward,
               saved_x12=self.saved_x12, tile_rows=self.tile_rows)
    if per_token_scale is not None:
        # megatron scales the activation rows before fc2: the same, as fc2 and the reduction are linear
        y = (y * per_token_scale.unsqueeze(-1)).to(y.dtype)
    if not fc2.explicit_expert_comm:
        y = mappings.reduce_from_tensor_model_parallel_region(y, group=fc2.tp_group)
    bias = fc2.bias
    if bias is not None and not fc2.skip_bias_add:
        y, bias = y + bias, None
    if per_token_scale is not None and bias is not None:
        y = y + bias.unsqueeze(0) * per_token_scale.unsqueeze(-1)
        bias = None
    return y, bias


def fused_megatron_class(base: type) -> type:
    """The swiglu_cupy subclass of megatron's ``MLP`` (exactly that class)."""
    if base is not _mlp_class():
        raise TypeError(f"{base.__module__}.{base.__qualname__} is not megatron-core's MLP")
    return switched_class("megatron", base, lambda base: (
        f"SwiGLUCupy{base.__name__}", (base,),
        {"__module__": __name__, "__qualname__": f"SwiGLUCupy{base.__name__}", "forward": _mlp_forward,
         "__doc__": "megatron-core's MLP, the whole GLU feed-forward in swiglu_cupy's fused op."}))


def patch_megatron_mlp(module: nn.Module, recompute_gate_up: bool = False, inplace_backward: bool = False,
                       saved_x12=None, tile_rows=None) -> str | None:
    """Switch a megatron ``MLP`` in place to the fused forward and return the
    line the patch report shows; None if it is none or cannot be switched
    (:func:`megatron_skip_reason` says why). Parameters, state_dict and
    ``sharded_state_dict`` stay megatron's."""
    check_saved_x12(saved_x12, recompute_gate_up, inplace_backward)
    check_tile_rows(tile_rows)
    if not is_megatron_mlp(module) or megatron_skip_reason(module) is not None:
        return None
    already = type(module) is not _mlp_class()
    activation, _ = megatron_activation(module.config)
    module.__class__ = fused_megatron_class(_mlp_class())
    module._swiglu_cupy_activation = activation
    module.recompute_gate_up, module.inplace_backward = recompute_gate_up, inplace_backward
    module.saved_x12, module.tile_rows = saved_x12, tile_rows
    fc1, fc2 = module.linear_fc1, module.linear_fc2
    tp = fc1.tp_group.size() if fc1.tp_group is not None else 1
    comm = ("no TP collectives (experts: the token dispatcher communicates)" if fc1.explicit_expert_comm
            else f"TP {tp}: megatron's copy-to / reduce-from tensor-parallel region around the local op")
    bias = ("fc1 bias in the op, fc2 bias returned as megatron returns it" if fc2.bias is not None
            else "no biases" if fc1.bias is None else "fc1 bias in the op")
    tail = "".join(f", {name}" for name in ("recompute_gate_up", "inplace_backward") if getattr(module, name))
    tail += "" if saved_x12 is None else f", saved_x12={saved_x12}"
    tail += "" if tile_rows is None else f", tile_rows={tile_rows}"
    return (f"{activation}: swiglu_cupy.swiglu on linear_fc1 [gate_r; up_r] -> linear_fc2; {comm}; {bias}"
            + tail + (" (already fused)" if already else ""))
