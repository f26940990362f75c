"""The private autograd/functorch/nn.Module internals of torch that swiglu_cupy uses,
in one place. Each has a public-API reason to exist (none covers it) and a
note of what breaks if torch changes it; ``tests/test_torch_compat.py`` fails
loudly on any such change. (DTensor/DCP internals: ``_distributed_compat``.)
"""
from __future__ import annotations

import torch

# True for a tensor wrapped by a torch.func transform level (vmap/grad).
# If it goes: transformed calls would take the out=-buffer eager path and
# fail under vmap ("out= cannot hold a batch"); the lean apply below would
# skip torch's unwrapping of tensors left over from a transform.
is_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor

# True while any torch.func transform is active (inside vmap/grad/jacrev).
# If it goes: the no-grad eager shortcut could run inside a transform.
functorch_transforms_active = torch._C._are_functorch_transforms_active

# torch.autograd.Function.apply is Python code that binds default arguments
# with inspect.signature (~15 us a call) and then calls this C++ apply; the
# lean apply calls it directly. If torch moves the C++ base class, the lean
# apply must fall back to Function.apply (a speed loss, not a wrong result).
_CPP_APPLY = torch._C._FunctionBase.__dict__["apply"]  # a classmethod descriptor


def cpp_function_apply(cls, *args):
    """``cls.apply(*args)`` without the Python-level argument binding."""
    return _CPP_APPLY.__get__(None, cls)(*args)


# torch.onnx.export(exported_program) decomposes the ops found in torch's
# global decomposition table (torch._decomp) and has no other way to learn
# ours. If it goes: exporting an ExportedProgram holding our functional ops
# to ONNX fails ("no translation"); export of the model itself still works.
def register_global_decomposition(op, implementation) -> None:
    import torch._decomp

    torch._decomp.register_decomposition(op)(implementation)


# nn.Module's process-wide hooks (torch.nn.modules.module.register_module_*
# hooks) live in these private dicts. The fused HF forward skips calling the
# projections' own modules, so it must step aside while any is registered.
# If they go: the fused path would run even with global hooks registered,
# and those hooks would miss the projection calls.
def global_module_hooks_active() -> bool:
    from torch.nn.modules import module as nn_module

    return bool(nn_module._global_forward_pre_hooks or nn_module._global_forward_hooks
                or nn_module._global_backward_pre_hooks or nn_module._global_backward_hooks)
