"""OLMo-core's stacked MoE experts on ``swiglu_cupy.moe.grouped_experts_unpacked``.

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

Switched by class (no probe: the forwards above are OLMo-core's own,
reproduced), also on the meta device; the module keeps its class as a base
and its parameters (state_dict keys unchanged). Anything else deriving from
``MoEMLPBase``, a replaced forward or ``gmm``, or a ``_gmm`` that is not
grouped_gemm's is left alone with its reason.
"""
from __future__ import annotations

import sys

import torch
from torch import nn

from .._validation import check_tile_rows
from ..moe.grouped import grouped_experts_unpacked
from .fused import switched_base, switched_class

__all__ = ["is_olmo_core_experts", "patch_olmo_core_experts", "olmo_core_skip_reason", "fused_olmo_core_class"]

_MLP = "olmo_core.nn.moe.mlp"
_DIST_UTILS = "olmo_core.distributed.utils"


def _classes() -> tuple[type, ...]:
    """OLMo-core's ``MoEMLP`` and ``DroplessMoEMLP``, if OLMo-core's MoE module is loaded."""
    mlp = sys.modules.get(_MLP)
    return () if mlp is None else (mlp.MoEMLP, mlp.DroplessMoEMLP)


def _local(t: torch.Tensor) -> torch.Tensor:
    """OLMo-core's own ``get_local_tensor`` (a DTensor's local shard, waited for)."""
    return sys.modules[_DIST_UTILS].get_local_tensor(t)


def _modes(self) -> dict:
    return {"recompute_gate_up": getattr(self, "_swiglu_cupy_recompute_gate_up", False),
            "tile_rows": getattr(self, "_swiglu_cupy_tile_rows", None)}


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
                                 **_modes(self))
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
    return grouped_experts_unpacked(x, offsets, w1, w3, w2.transpose(1, 2), **_modes(self))


# ---- the switched classes --------------------------------------------------------------------

def fused_olmo_core_class(base: type) -> type:
    """The swiglu_cupy subclass of OLMo-core's ``MoEMLP`` or ``DroplessMoEMLP`` (exactly those)."""
    classes = _classes()
    if base not in classes:
        raise TypeError(f"{base.__module__}.{base.__qualname__} is not OLMo-core's MoEMLP or DroplessMoEMLP")
    forward = _moe_mlp_forward if base is classes[0] else _dropless_forward
    name = f"SwiGLUCupy{base.__name__}"
    return switched_class("olmo_core", base, lambda base: (
        name, (base,), {"__module__": __name__, "__qualname__": name, "forward": forward}))


def is_olmo_core_experts(module: nn.Module) -> bool:
    """An OLMo-core ``MoEMLP`` or ``DroplessMoEMLP`` (or a subclass, switched
    or not): the walk hands it to :func:`patch_olmo_core_experts`."""
    classes = _classes()
    return bool(classes) and isinstance(module, classes)


def olmo_core_skip_reason(module: nn.Module) -> str | None:
    """Why an OLMo-core ``MoEMLP``/``DroplessMoEMLP`` cannot be switched, or
    None if it can be (or ``module`` is neither)."""
    if not is_olmo_core_experts(module):
        return None
    classes = _classes()
    base, cls = switched_base(module), type(module)
    if base not in classes:
        fsdp = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)
        if fsdp is not None and isinstance(module, fsdp):
            return ("wrapped by FSDP2 (fully_shard) before patch(): its class is FSDP's own; "
                    "call swiglu_cupy.patch before fully_shard")
        return f"{cls.__name__} subclasses {cls.__mro__[1].__name__} with its own forward, which swiglu_cupy " \
               "does not reproduce"
    if "forward" in module.__dict__:
        return "its forward is replaced on the instance, which would bypass the fusion"
    if base is classes[1]:
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


def patch_olmo_core_experts(module: nn.Module, recompute_gate_up: bool = False, tile_rows=None) -> str | None:
    """Switch an OLMo-core ``MoEMLP``/``DroplessMoEMLP`` in place so its
    forward runs :func:`swiglu_cupy.moe.grouped_experts_unpacked`, and return the
    line the patch report shows; None if it cannot be
    (:func:`olmo_core_skip_reason` says why)."""
    if not isinstance(recompute_gate_up, bool):
        raise TypeError(f"recompute_gate_up must be a bool, got {type(recompute_gate_up).__name__}")
    check_tile_rows(tile_rows)
    if not is_olmo_core_experts(module) or olmo_core_skip_reason(module) is not None:
        return None
    base = switched_base(module)
    fused = fused_olmo_core_class(base)
    already = isinstance(module, fused)
    if not already:  # a subclass of the fused class (FSDP2's, after fully_shard) keeps its class
        module.__class__ = fused
    module._swiglu_cupy_recompute_gate_up = recompute_gate_up
    module._swiglu_cupy_tile_rows = tile_rows
    tail = ((", recompute_gate_up" if recompute_gate_up else "") + ("" if tile_rows is None else f", tile_rows={tile_rows}")
            + (" (already fused)" if already else ""))
    if base is _classes()[0]:
        layout = ("capacity-padded rows [E*C, D] (a view); w1/w3 [E, D, H] as the gate and up weights, "
                  "w2 [E, H, D] as the down weight (views, not concatenated)")
    else:
        layout = ("rows sorted by expert, offsets from batch_size_per_expert; w1/w3 [E, H, D] as the gate and "
                  "up weights, w2 as the down weight [E, D, H] (views, not concatenated)"
                  + ("; bf16 as grouped_gemm" if module._gmm is not None else ""))
    return f"swiglu_cupy.moe.grouped_experts_unpacked, silu: {layout}" + tail
