"""The private autograd/functorch/nn.Module internals of torch that swiglu_cupy uses,
in one place. Each has a public-API reason to exist (none covers it) and a
note of what breaks if torch changes it; ``tests/test_torch_compat.py`` fails
loudly on any such change. (DTensor/DCP internals: ``_distributed_compat``.)
"""
from __future__ import annotations

import warnings

import torch
from torch.nn.modules import module as _nn_module  # its global hook registries (read per patched call)


def _private(owner, name: str, fallback, consequence: str):
    """``owner.name``, or (torch moved it) ``fallback`` with one warning
    saying what is lost: ``import swiglu_cupy`` never fails on such a move."""
    found = getattr(owner, name, None)
    if found is not None:
        return found
    warnings.warn(f"swiglu_cupy: {owner.__name__}.{name} is gone in torch {torch.__version__}; "
                  f"{consequence}", RuntimeWarning, stacklevel=3)
    return fallback


# True for a tensor wrapped by a torch.func transform level (vmap/grad).
# If it goes: transformed calls would take the out=-buffer eager path and
# fail under vmap ("out= cannot hold a batch"); the lean apply below would
# skip torch's unwrapping of tensors left over from a transform.
is_functorch_wrapped = _private(torch._C._functorch, "is_functorch_wrapped_tensor", lambda t: False,
                                "torch.func transforms of the fused op may fail")

# True while any torch.func transform is active (inside vmap/grad/jacrev).
# If it goes: the no-grad eager shortcut could run inside a transform.
functorch_transforms_active = _private(torch._C, "_are_functorch_transforms_active", lambda: False,
                                       "torch.func transforms of the fused op may fail under no_grad")

# True inside a torch.jit.trace: torch.jit.is_tracing without its Python frame
# (and its is_scripting call, False wherever Python runs). Ask it outside a
# torch.compile trace only (Dynamo cannot trace it). If it goes: the public
# function, a frame slower.
jit_tracing = _private(torch._C, "_is_tracing", torch.jit.is_tracing, "each fused call is a little slower")

# ``torch.compiler.is_compiling()`` is ``not torch.jit.is_scripting() and
# _is_compiling_flag`` (2.11 to 2.14): two Python frames per call. The hot
# calls ask ``is_dynamo_compiling() or compiler_state._is_compiling_flag``,
# the same answer in one frame: Dynamo folds is_dynamo_compiling to True (so
# it never reads the flag, on which it would guard), and non-strict export and
# AOT tracing set the flag. Checked at import by the names is_compiling's code
# reads; if it ever reads more: ``compiler_state`` is a stand-in whose flag
# asks is_compiling itself (a frame more, the same answer).
def _is_compiling_is_its_flag() -> bool:
    code = getattr(getattr(torch.compiler, "is_compiling", None), "__code__", None)
    return (code is not None and "_is_compiling_flag" in code.co_names
            and set(code.co_names) <= {"torch", "jit", "is_scripting", "_is_compiling_flag"}
            and isinstance(getattr(torch.compiler, "_is_compiling_flag", None), bool))


class _AskIsCompiling:
    """``compiler_state`` where is_compiling is more than its flag."""

    @property
    def _is_compiling_flag(self) -> bool:
        return torch.compiler.is_compiling()


compiler_state = torch.compiler if _is_compiling_is_its_flag() else _AskIsCompiling()
is_dynamo_compiling = getattr(torch.compiler, "is_dynamo_compiling", lambda: False)

# ``ctx.save_for_backward(*tensors)`` is a Python method whose whole body is
# ``self.to_save = tensors`` (2.11 to 2.14): the hot ``setup_context`` sets
# that attribute itself where this holds, a Python frame less per call. If
# the method ever does more: the method, as torch defines it.
def _save_is_to_save() -> bool:
    method = getattr(getattr(torch.autograd.function, "FunctionCtx", None), "save_for_backward", None)
    code = getattr(method, "__code__", None)
    return code is not None and code.co_names == ("to_save",)


SAVE_IS_TO_SAVE: bool = _save_is_to_save()

# True while autocast is on for any device type: one C call with no argument,
# where asking for the input's device type first builds a torch.device and
# parses its name. If it goes: every call asks for its device type (a speed
# loss only, never a missed autocast).
any_autocast_enabled = _private(torch._C, "_is_any_autocast_enabled", lambda: True,
                                "each fused call checks autocast for its device type (slower)")

# torch.autograd.Function.apply is Python code that binds default arguments
# with inspect.signature (~15 us a call) and then calls this C++ apply; the
# lean apply calls it directly. If torch moves the C++ base class, the lean
# apply falls back to Function.apply (a speed loss, not a wrong result).
#: The C++ apply (a classmethod descriptor: ``cpp_apply.__get__(None, cls)`` is
#: ``cls.apply`` without the Python-level argument binding), or None where this
#: torch has none to call.
cpp_apply = getattr(_private(torch._C, "_FunctionBase", None, "the Functions take "
                             "torch.autograd.Function.apply (correct, ~15 us slower per call)"),
                    "__dict__", {}).get("apply")


# The raw cudaStream_t of a device's current stream, without building a
# torch.cuda.Stream (Inductor's generated code calls it per launch). Absent
# from CPU-only builds, and if it goes: torch.cuda.current_stream's handle,
# the same value, a few microseconds slower per launch.
_current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_raw_stream(index: int) -> int:
    """The raw handle of CUDA device ``index``'s current stream."""
    if _current_raw_stream is not None:
        return _current_raw_stream(index)
    return torch.cuda.current_stream(index).cuda_stream


def is_transformed(t: torch.Tensor) -> bool:
    """True if ``t`` is wrapped by a torch.func transform (vmap/grad level).
    Tracers see through such wrappers (and cannot call this check)."""
    return not torch.compiler.is_compiling() and is_functorch_wrapped(t)


# ``silu(input, out=...)`` straight from torch's C++ binding: the CPU path calls
# it once per row block, and it has half the call overhead of the public
# ``torch.ops.aten.silu.out`` (which takes the same arguments). If it goes:
# that public op runs instead (the same result, a little slower).
silu_into = _private(torch._C._nn, "silu", lambda t, out: torch.ops.aten.silu.out(t, out=out),
                     "the CPU path's silu takes torch.ops.aten.silu.out (same result, slower)")


# The base classes of nn's dropout and batch/instance-norm layers, for
# isinstance checks that cover every variant (Dropout1d/2d/3d, AlphaDropout,
# ...; BatchNorm*, InstanceNorm*, SyncBatchNorm). If they go: the public
# classes below are checked instead (a subclass of the base alone would no
# longer be recognised as a dropout or a norm).
DROPOUT_CLASSES = _private(torch.nn.modules.dropout, "_DropoutNd",
                           (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d,
                            torch.nn.AlphaDropout, torch.nn.FeatureAlphaDropout),
                           "dropout layers are recognised by the public classes only")
BATCH_NORM_CLASSES = _private(torch.nn.modules.batchnorm, "_NormBase",
                              (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d,
                               torch.nn.SyncBatchNorm, torch.nn.InstanceNorm1d, torch.nn.InstanceNorm2d,
                               torch.nn.InstanceNorm3d),
                              "norm layers are recognised by the public classes only")


def dispatch_mode_base():
    """torch's ``TorchDispatchMode`` (documented, but only importable from the
    private ``torch.utils._python_dispatch``) and ``tree_leaves`` (from
    ``torch.utils._pytree``), for the live-bytes tracker (a tool, not the op).
    If they go: the tracker cannot be built; nothing else uses them."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    return TorchDispatchMode, tree_leaves


# nn.Module's process-wide hooks (torch.nn.modules.module.register_module_*
# hooks) live in these private dicts. The fused HF forward skips calling the
# projections' own modules, so it must step aside while any is registered.
# If they go: the fused path would run even with global hooks registered,
# and those hooks would miss the projection calls.
#: The four registries themselves (torch fills and empties them in place):
#: ``any(GLOBAL_MODULE_HOOKS)`` asks without a Python frame.
GLOBAL_MODULE_HOOKS = (_nn_module._global_forward_pre_hooks, _nn_module._global_forward_hooks,
                       _nn_module._global_backward_pre_hooks, _nn_module._global_backward_hooks)


def global_module_hooks_active() -> bool:
    return any(GLOBAL_MODULE_HOOKS)


# ---- torch's clamp gradient at the bounds ---------------------------------------------------
# ``x.clamp(min=lo, max=hi)`` with scalar bounds passes the gradient to an
# element exactly at a bound up to torch 2.13 (``lo <= x <= hi``) and not
# from 2.14 on (``lo < x < hi``); NaN gets 0 in both. The clamped GLU variants
# (GPT-OSS, DeepSeek-V4, every ``limit=``) must cut where the installed torch
# cuts, or a patched model's gradients differ from its own eager model's at
# every element that lands on the limit. Found once, at import, by a tiny
# clamp backward (both bounds: tests/test_torch_compat.py checks they agree).

def _clamp_passes_gradient_at_bound() -> bool:
    try:
        # Explicit device and grad mode: the import may happen inside a
        # ``torch.device("meta")`` block, ``no_grad`` or ``inference_mode``.
        with torch.inference_mode(False), torch.enable_grad():
            x = torch.ones(2, dtype=torch.float32, device="cpu", requires_grad=True)
            x.mul(torch.tensor([1.0, -1.0], device="cpu")).clamp(min=-1.0, max=1.0).sum().backward()
            return bool((x.grad != 0).all().item())
    except Exception:  # a tracing/dispatch mode active at import: decide by the version that changed it
        return tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 14)


#: True where torch's scalar clamp passes the gradient at exactly a bound.
CLAMP_GRADIENT_AT_BOUND: bool = _clamp_passes_gradient_at_bound()


def clamp_gradient_at_bound() -> bool:
    """The rule in force (read at call time, so that tests can switch it)."""
    return CLAMP_GRADIENT_AT_BOUND
