"""What swiglu_cupy knows of DeepSpeed ZeRO-3, in one place: whether a
parameter is ZeRO-3's and partitioned now, its full shape, ZeRO-3 leaf
modules, and which hooks are ZeRO-3's own.

Each entry says, in one line, what breaks if DeepSpeed changes it; checked
with deepspeed 0.19.8 by ``tests/test_deepspeed.py`` (behaviour under real
ZeRO stages on 2 CPU ranks).

Nothing here imports deepspeed at module level, and the other integrations
import this module only when ``"deepspeed" in sys.modules``
(``plan_runner._zero3``), so users without DeepSpeed pay nothing.
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["zero3_param", "zero3_partitioned", "zero3_full_shape", "zero3_leaf", "mark_zero3_leaf",
           "zero3_hooks_only"]

# ZeRO-3 (deepspeed.zero.Init at construction, or deepspeed.initialize) turns
# every parameter into a partitioned one: it keeps its Parameter object, gains
# ds_id / ds_status / ds_shape, and its .data is an empty tensor except while
# gathered. A module's forward pre-hook gathers the parameters it owns (all
# of its subtree if it is a "leaf", see deepspeed.utils.set_z3_leaf_module).

def zero3_param(t) -> bool:
    """Whether ``t`` is a parameter that ZeRO-3 manages (partitioned or gathered)."""
    # If renamed: ZeRO-3 modules look like plain ones; patch() after
    # deepspeed.initialize probes empty weights and refuses them (tests: test_deepspeed).
    return hasattr(t, "ds_id") and hasattr(t, "ds_status")


def zero3_partitioned(t) -> bool:
    """Whether ``t`` is a ZeRO-3 parameter whose data is not gathered now."""
    # ds_status is a ZeroParamStatus (NOT_AVAILABLE, INFLIGHT, AVAILABLE),
    # compared by name so that this does not import deepspeed.
    status = getattr(t, "ds_status", None)
    return status is not None and getattr(status, "name", None) != "AVAILABLE"


def zero3_full_shape(t) -> torch.Size:
    """The shape of ``t`` as the model defines it, gathered or not."""
    # ds_shape: the full shape, kept while .data is empty (tests: test_deepspeed).
    return torch.Size(t.ds_shape) if zero3_partitioned(t) else t.shape


_z3_leaf_module = None  # deepspeed.utils.z3_leaf_module, looked up once (fusion_of asks at every call)


def zero3_leaf(module: nn.Module) -> bool:
    """Whether ZeRO-3 gathers ``module``'s whole subtree in its own hooks."""
    global _z3_leaf_module
    if _z3_leaf_module is None:
        from deepspeed.utils import z3_leaf_module  # public; deepspeed is loaded (the callers check)

        _z3_leaf_module = z3_leaf_module
    return bool(_z3_leaf_module(module))


def mark_zero3_leaf(module: nn.Module) -> None:
    """Make ``module`` a ZeRO-3 leaf: public API. Before deepspeed.initialize,
    its children get no hooks; after, its hooks read the flag at every fetch
    and release (forward, backward, checkpoint recompute) and gather the
    subtree, while the children's own hooks simply no longer run."""
    from deepspeed.utils import set_z3_leaf_module

    set_z3_leaf_module(module, True)


def _defined_in_zero3(fn) -> bool:
    # ZeRO-3's hooks are closures of DeepSpeedZeRoOffload._register_deepspeed_module
    # (module deepspeed.runtime.zero.parameter_offload); some are wrapped by
    # deepspeed.utils.nvtx.instrument_w_nvtx, whose wrapper keeps the hook in
    # its closure (no functools.wraps). If this changes: ZeRO-3's hooks are
    # taken for foreign ones and the MLP falls back to activation-only fusion
    # (tests: test_deepspeed, fusion "mlp" under ZeRO-3 after initialize).
    for _ in range(3):
        if (getattr(fn, "__module__", None) or "").startswith("deepspeed.runtime.zero."):
            return True
        inner = getattr(fn, "__wrapped__", None)
        if inner is None and (getattr(fn, "__module__", None) or "").startswith("deepspeed."):
            cells = [c.cell_contents for c in (getattr(fn, "__closure__", None) or ())]
            inner = next((c for c in cells if callable(c) and hasattr(c, "__code__")), None)
        if inner is None:
            return False
        fn = inner
    return False


def zero3_hooks_only(module: nn.Module) -> bool:
    """Whether every hook on ``module`` is one that ZeRO-3 registered (and
    there is at least one)."""
    hooks = [*module._forward_pre_hooks.values(), *module._forward_hooks.values(),
             *module._backward_pre_hooks.values(), *module._backward_hooks.values()]
    return bool(hooks) and all(_defined_in_zero3(h) for h in hooks)
