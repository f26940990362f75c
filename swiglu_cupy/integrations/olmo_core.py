"""OLMo-core's modules that ``patch()`` knows by their class: the stacked MoE
experts on ``swiglu_cupy.moe.grouped_experts_unpacked``, and nGPT's
``NormalizedFeedForward`` on ``swiglu_cupy.swiglu_unpacked``.

OLMo-core (checked against ai2-olmo-core 3.0.0) keeps all experts of an MoE
layer in three 2-D parameters of ``olmo_core.nn.moe.mlp``'s ``MoEMLP`` or
``DroplessMoEMLP`` (no projection modules: nothing the structural walk can
recognise), viewed per call as 3-D stacks. The activation is always SiLU
(``silu(w1) * w3``, then ``w2``); there are no biases.

* ``MoEMLP`` (``ParallelMLP``, capacity-padded): ``forward(x)`` with ``x``
  ``[E, C, D]`` (each expert's capacity ``C`` of rows, padding included),
  ``w1``/``w3`` viewed ``[E, D, H]`` and ``w2`` ``[E, H, D]``, run by
  ``torch.bmm`` in the weights' dtype, the output cast back to ``x``'s.
  Fused: the rows ``[E*C, D]`` (a view) with offsets ``C, 2C, ...``,
  ``transposed=True``; ``w1``/``w3`` are the gate and up weights and ``w2``
  the down weight as they are (views).
* ``DroplessMoEMLP`` (``ParallelDroplessMLP``): ``forward(x,
  batch_size_per_expert)`` with ``x`` ``[S, D]`` sorted by expert, ``w1``/``w3``
  viewed ``[E, H, D]`` (``x @ w1[e].T``) and ``w2`` ``[E, H, D]`` (``h @
  w2[e]``), run by grouped_gemm's ``gmm`` in bf16 when grouped_gemm is
  installed (bf16 operands and output, whatever the parameter dtype), else
  by a loop of GEMMs in the given dtypes. Fused: offsets are the cumulative
  ``batch_size_per_expert`` (int32); ``w1``/``w3`` are the gate and up
  weights ``[E, H, D]`` and ``w2`` enters as the down weight ``[E, D, H]``
  through ``transpose(1, 2)`` (views); with grouped_gemm installed the
  operands are cast to bf16 as OLMo-core's ``gmm`` does.

OLMo-core holds gate and up in two parameters; ``grouped_experts_unpacked``
runs their two GEMMs into the halves of one x12, so the weights are never
concatenated. It checks the offsets' values on the host: one device-to-host
copy per call.

Expert and tensor parallelism (``apply_ep``/``apply_tp``: the parameters
become DTensors sharded over experts): the fused forward takes the local
shards exactly as OLMo-core's does (``get_local_tensor`` of the 3-D view),
so the local experts run fused; not exercised by the tests here (no device
mesh on the CPU). Patch before ``fully_shard``: FSDP2 gives the module a
class of its own (``FSDP<class>``), which ``patch`` leaves alone, with that
reason.

nGPT's ``NormalizedFeedForward`` (``olmo_core.nn.feed_forward``, the
``ngpt_like`` builders) computes ``w2(silu(sw1 * w1(x)) * (sw3 * w3(x)))``
with learned per-channel scales ``sw1``/``sw3`` (times OLMo-core's constant
factors). A scale of a GEMM's output rows is a scale of the weight's rows,
``sw1 * (x W1^T) = x (sw1 W1)^T``, so the fused forward runs
``swiglu_unpacked`` on ``sw1[:, None] * w1.weight`` and
``sw3[:, None] * w3.weight``: two ``[H, D]`` products per call, built and
differentiated by autograd (``sw1``, ``sw3``, ``w1`` and ``w3`` get their
gradients through them) and held for the backward, which is what the fusion
costs here: 2·H·D elements per layer, against OLMo-core's five ``[T, H]``
intermediates (ours: x12, 2·T·H). The three linears are checked at every
call: hooks or DTensor weights put on them after patching (FSDP2 on a
child, ZeRO-3, a LoRA) make the call run OLMo-core's own forward.

Switched by class (no probe: the forwards above are OLMo-core's own,
reproduced), also on the meta device; the module keeps its class as a base
and its parameters (state_dict keys unchanged). Anything else deriving from
``MoEMLPBase``, a subclass of these classes with its own forward, a replaced
forward or ``gmm``, or a ``_gmm`` that is not grouped_gemm's is left alone
with its reason.
"""
from __future__ import annotations

import sys

import torch
from torch import nn

from .._validation import check_flags, check_saved_x12, check_tile_rows
from ..dense.api import swiglu_unpacked
from ..moe.grouped import grouped_experts_unpacked
from .plan_runner import is_dtensor, linear_obstacle, plain_linear
from .fused import switched_base, switched_class
from .switch_proof import probe_tensor, proven

__all__ = ["is_olmo_core_switchable", "patch_olmo_core_module", "olmo_core_skip_reason", "fused_olmo_core_class"]

_MLP = "olmo_core.nn.moe.mlp"
_FEED_FORWARD = "olmo_core.nn.feed_forward"
_DIST_UTILS = "olmo_core.distributed.utils"


def _local(t: torch.Tensor) -> torch.Tensor:
    """OLMo-core's own ``get_local_tensor`` (a DTensor's local shard, waited for)."""
    return sys.modules[_DIST_UTILS].get_local_tensor(t)


def _options(self) -> dict:
    return getattr(self, "_swiglu_cupy_options", {})


# ---- the fused forwards ----------------------------------------------------------------------

def _moe_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    """``MoEMLP.forward``: ``x`` [E, C, D] -> [E, C, D], in the weights' dtype, cast back to ``x``'s."""
    E, D, H = self.num_experts, self.d_model, self.hidden_size
    w1 = _local(self.w1.view(E, D, H))
    w2 = _local(self.w2.view(E, H, D))
    w3 = _local(self.w3.view(E, D, H))
    out_dtype = x.dtype
    x = x.type_as(w1)
    experts, capacity, _ = x.shape
    offsets = torch.arange(1, experts + 1, device=x.device, dtype=torch.int32) * capacity
    y = grouped_experts_unpacked(x.reshape(experts * capacity, D), offsets, w1, w3, w2, transposed=True,
                                 **_options(self))
    return y.view(experts, capacity, D).to(dtype=out_dtype)


def _dropless_forward(self, x: torch.Tensor, batch_size_per_expert: torch.Tensor) -> torch.Tensor:
    """``DroplessMoEMLP.forward``: ``x`` [S, D] sorted by expert, ``batch_size_per_expert`` [E]."""
    E, H, D = self.num_experts, self.hidden_size, self.d_model
    w1 = _local(self.w1.view(E, H, D))
    w2 = _local(self.w2.view(E, H, D))
    w3 = _local(self.w3.view(E, H, D))
    if self._gmm is not None:  # grouped_gemm's contract: bf16 operands and output
        x, w1, w2, w3 = (t.to(torch.bfloat16) for t in (x, w1, w2, w3))
    offsets = torch.cumsum(batch_size_per_expert.to(x.device), 0, dtype=torch.int32)
    return grouped_experts_unpacked(x, offsets, w1, w3, w2.transpose(1, 2), **_options(self))


def _normalized_forward(self, x: torch.Tensor) -> torch.Tensor:
    """``NormalizedFeedForward.forward``, its scales folded into the gate/up weights' rows."""
    if not all(plain_linear(m) for m in (self.w1, self.w3, self.w2)):
        return switched_base(self).forward(self, x)  # hooked or sharded after patching: OLMo-core's own
    sw1 = self.sw1 * ((self.sw_init_value / self.sw_init_scaling) * self.sqrt_d_model)  # as OLMo-core's
    sw3 = self.sw3 * (self.sw_init_value / self.sw_init_scaling)
    return swiglu_unpacked(x, sw1.unsqueeze(1) * self.w1.weight, None, sw3.unsqueeze(1) * self.w3.weight, None,
                           self.w2.weight, None, **_options(self))


# ---- probe inputs (the proof each switch makes: integrations.switch_proof) ----------------

#: Rows per expert of the dropless experts' probe input: uneven, an expert without rows included.
_PROBE_COUNTS = (3, 0, 5, 2)


def _moe_mlp_probe(self) -> tuple:
    """``x`` [E, C, D] in the weights' dtype, capacity 3."""
    w1 = _local(self.w1)
    E = self.num_experts
    x = probe_tensor((E * 3, self.d_model), w1)
    return (x.view(E, 3, self.d_model),)


def _dropless_probe(self) -> tuple:
    """``(x [S, D], batch_size_per_expert [E])``, rows sorted by expert."""
    w1 = _local(self.w1)
    counts = torch.tensor([_PROBE_COUNTS[e % len(_PROBE_COUNTS)] for e in range(self.num_experts)])
    return probe_tensor((int(counts.sum()), self.d_model), w1), counts


def _normalized_probe(self) -> tuple:
    return (probe_tensor((6, self.w1.weight.shape[-1]), self.w1.weight),)


# ---- the switched classes --------------------------------------------------------------------

_MOE_MLP_FORWARD = proven(_moe_mlp_forward, _moe_mlp_probe)
_DROPLESS_FORWARD = proven(_dropless_forward, _dropless_probe,  # grouped_gemm's gmm: bf16
                           lambda self: torch.bfloat16 if self._gmm is not None else self.w1.dtype)
_NORMALIZED_FORWARD = proven(_normalized_forward, _normalized_probe)


def _forwards() -> dict:
    """OLMo-core's switchable classes (of its modules already loaded) -> their fused forward."""
    forwards = {}
    mlp, feed_forward = sys.modules.get(_MLP), sys.modules.get(_FEED_FORWARD)
    if mlp is not None:
        forwards.update({mlp.MoEMLP: _MOE_MLP_FORWARD, mlp.DroplessMoEMLP: _DROPLESS_FORWARD})
    if feed_forward is not None:
        forwards[feed_forward.NormalizedFeedForward] = _NORMALIZED_FORWARD
    return forwards


def fused_olmo_core_class(base: type) -> type:
    """The swiglu_cupy subclass of OLMo-core's ``MoEMLP``, ``DroplessMoEMLP`` or
    ``NormalizedFeedForward`` (exactly those)."""
    forward = _forwards().get(base)
    if forward is None:
        raise TypeError(f"{base.__module__}.{base.__qualname__} is not OLMo-core's MoEMLP, DroplessMoEMLP or "
                        "NormalizedFeedForward")
    name = f"SwiGLUCupy{base.__name__}"
    return switched_class("olmo_core", base, lambda base: (
        name, (base,), {"__module__": __name__, "__qualname__": name, "forward": forward}))


def is_olmo_core_switchable(module: nn.Module) -> bool:
    """An OLMo-core ``MoEMLP``, ``DroplessMoEMLP`` or ``NormalizedFeedForward``
    (or a subclass, switched or not): the walk hands it to
    :func:`patch_olmo_core_module`."""
    classes = tuple(_forwards())
    return bool(classes) and isinstance(module, classes)


def olmo_core_skip_reason(module: nn.Module) -> str | None:
    """Why an OLMo-core module of those classes cannot be switched, or None
    if it can be (or ``module`` is none of them)."""
    if not is_olmo_core_switchable(module):
        return None
    base, cls = switched_base(module), type(module)
    if base not in _forwards():
        fsdp = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)
        if fsdp is not None and isinstance(module, fsdp):
            return ("wrapped by FSDP2 (fully_shard) before patch(): its class is FSDP's own; "
                    "call swiglu_cupy.patch before fully_shard")
        return f"{cls.__name__} subclasses {cls.__mro__[1].__name__} with its own forward, which swiglu_cupy " \
               "does not reproduce"
    if "forward" in module.__dict__:
        return "its forward is replaced on the instance, which would bypass the fusion"
    if base.__name__ == "NormalizedFeedForward":
        return _normalized_skip_reason(module)
    if base.__name__ == "DroplessMoEMLP":
        if "gmm" in module.__dict__:
            return "its gmm is replaced on the instance (another grouped GEMM): left as is"
        if module._gmm is not None and module._gmm is not getattr(sys.modules[_MLP], "gmm", None):
            return "its _gmm is not grouped_gemm's gmm (another grouped GEMM): left as is"
    if getattr(module, "hidden_sharding_degree", 1) != 1:
        return f"experts sharded along the hidden size (hidden_sharding_degree={module.hidden_sharding_degree})"
    names = set(module._parameters)
    if names != {"w1", "w2", "w3"}:
        return f"unexpected parameters {sorted(names)}"
    if any(not p.dtype.is_floating_point for p in module.parameters()):
        return "non-floating weights"
    return None


def _normalized_skip_reason(module: nn.Module) -> str | None:
    from .. import _distributed_compat  # OLMo-core is loaded: the compat entry may be read (not imported before)

    if set(module._parameters) != {"sw1", "sw3"} or set(module._modules) != {"w1", "w2", "w3"}:
        return f"unexpected parameters {sorted(module._parameters)} or children {sorted(module._modules)}"
    for name in ("w1", "w2", "w3"):
        linear = module._modules[name]
        obstacle = linear_obstacle(linear)
        if obstacle is not None:
            return f"{name}: {obstacle}"
        if is_dtensor(linear.weight) and not _distributed_compat.fsdp_managed(module):
            # (FSDP2's shards outside the forward are fine: its hooks unshard them around it)
            return f"{name}'s weight is a DTensor not managed by FSDP2 (tensor parallel?): left as is"
        if linear.bias is not None:
            return f"{name} has a bias, which NormalizedFeedForward's own never has"
    return None


def patch_olmo_core_module(module: nn.Module, recompute_gate_up: bool = False, inplace_backward: bool = False,
                           saved_x12=None, tile_rows=None) -> str | None:
    """Switch an OLMo-core ``MoEMLP``/``DroplessMoEMLP`` (its forward runs
    :func:`swiglu_cupy.moe.grouped_experts_unpacked`: ``recompute_gate_up``
    and ``tile_rows`` apply) or ``NormalizedFeedForward``
    (:func:`swiglu_cupy.swiglu_unpacked`: every memory mode applies) in place,
    and return the line the patch report shows; None if it cannot be
    (:func:`olmo_core_skip_reason` says why)."""
    check_flags(recompute_gate_up=recompute_gate_up, inplace_backward=inplace_backward)
    check_saved_x12(saved_x12, recompute_gate_up, inplace_backward)
    check_tile_rows(tile_rows)
    if not is_olmo_core_switchable(module) or olmo_core_skip_reason(module) is not None:
        return None
    base = switched_base(module)
    fused = fused_olmo_core_class(base)
    already = isinstance(module, fused)
    if not already:  # a subclass of the fused class (FSDP2's, after fully_shard) keeps its class
        module.__class__ = fused
    dense = base.__name__ == "NormalizedFeedForward"
    options = {"recompute_gate_up": recompute_gate_up, "tile_rows": tile_rows}
    if dense:
        options.update(inplace_backward=inplace_backward, saved_x12=saved_x12)
    module._swiglu_cupy_options = options
    tail = "".join(f", {k}" if v is True else f", {k}={v}" for k, v in options.items() if v not in (None, False))
    tail += " (already fused)" if already else ""
    if dense:
        return ("swiglu_cupy.swiglu_unpacked, silu: w1/w3 -> w2, the scales sw1/sw3 folded into per-call "
                "scaled copies of the w1/w3 rows (2*H*D elements, held for backward)" + tail)
    if base.__name__ == "MoEMLP":
        layout = ("capacity-padded rows [E*C, D] (a view); w1/w3 [E, D, H] as the gate and up weights, "
                  "w2 [E, H, D] as the down weight (views, not concatenated)")
    else:
        layout = ("rows sorted by expert, offsets from batch_size_per_expert; w1/w3 [E, H, D] as the gate and "
                  "up weights, w2 as the down weight [E, D, H] (views, not concatenated)"
                  + ("; bf16 as grouped_gemm" if module._gmm is not None else ""))
    return f"swiglu_cupy.moe.grouped_experts_unpacked, silu: {layout}" + tail
