"""The one place where a primitive call is decided, kernels or torch, and
dispatched: the CUDA kernels (``cuda_impl``, through a launcher whose
self-check passed for the call's GLU variant, dtype, device and launch
config) or the torch implementation (``torch_impl``).

Two ways in, on arguments valid by construction (the public API validated
them once: the checks are a measurable part of a small call's host time):

- **Decided once per call** (``lasting_path``, ``eager_path``): the dense
  API decides each call once (and keeps lasting decisions with the call's
  settings) and hands the answer, a :class:`KernelPath` or
  :class:`TorchPath`, down in the Function's options; the forward runs it
  without asking again, and the backward asks once for itself
  (``eager_path``). Under a tracer or a torch.func transform there is no
  eager path (None): ``route`` decides per primitive there.
- **Per primitive** (``run_*``): the checked public primitives
  (``primitives/__init__``), the registered ops' eager bodies (``ops``), the
  MoE op and ``route``'s eager branch; ``implementation=`` and ``launcher=``
  force a choice. They run the decided path too.

All look the decision up in one cache (``_PATHS``), keyed by identity, so
a repeated call costs a dict lookup; ``first_use_check.reset`` empties it.
A :class:`KernelPath` holds its launch plans and device, so its launches
look nothing up.
"""
from __future__ import annotations

import functools

import torch

from .. import _torch_compat
from .._dtypes import FULL_PRECISION_DTYPES as _FULL_PRECISION
from .._torch_compat import compiler_state, functorch_transforms_active, is_dynamo_compiling, is_functorch_wrapped
from ..activations import SILU, GLUActivation
from ..kernels.launch import cuda_kernels_available
from ..kernels.launch_config import current_launch_config, forced_launcher
from . import cuda_impl as kernels
from . import first_use_check, saved_x12, torch_impl
from .first_use_check import kernels_usable

__all__ = ["eager_path", "lasting_path", "path_for", "KernelPath", "TorchPath", "run_swiglu_forward",
           "run_swiglu_backward", "run_silu_mul_forward", "run_silu_mul_backward", "run_swiglu_forward_fp8",
           "run_swiglu_backward_fp8", "h_over_gate", "gate_half", "batch_first"]


def _or_new(out: torch.Tensor | None, shape: tuple, like: torch.Tensor) -> torch.Tensor:
    """The caller's buffer, or a new one: the torch implementation writes
    given buffers in one pass per output (its functional form, with no
    buffers, is for tracers)."""
    return torch.empty(shape, dtype=like.dtype, device=like.device) if out is None else out


def _or_new_if_half(out: torch.Tensor | None, shape: tuple, like: torch.Tensor) -> torch.Tensor | None:
    """Like ``_or_new`` for fp16/bf16, where the buffered store saves a
    rounding pass; fp32/fp64 outputs come as fast from the functional op,
    without the allocation call."""
    return out if out is not None or like.dtype in _FULL_PRECISION else _or_new(out, shape, like)


class KernelPath:
    """The kernels, for one (launcher, GLU spec, dtype, device, launch
    config, clamp rule) whose self-check passed (``launcher`` None: CuPy's).
    It holds its two launch plans and its device: a call on it looks
    nothing up."""
    __slots__ = ("launcher", "spec", "config", "device", "_forward", "_backward", "forward", "forward_halves")
    #: Separate weights' gate and up may stay two tensors (``*_halves``): the kernels read each
    #: where it lies, with the same math whatever the layout.
    halves_apart = True

    def __init__(self, launcher, spec: GLUActivation, config, dtype: torch.dtype, device: torch.device) -> None:
        self.launcher, self.spec, self.config, self.device = launcher, spec, config, device
        self._forward = kernels.launch_plan("swiglu_forward", spec, dtype, config)
        self._backward = kernels.launch_plan("swiglu_backward", spec, dtype, config)
        # The two hot forwards, bound (a Python frame less per call than a method):
        #: ``forward(x12)``: h [M, H] from x12 [M, 2H].
        self.forward = functools.partial(kernels.swiglu_forward_on, self._forward, launcher, device)
        #: ``forward_halves(gate, up)``: a new h = act(gate) * up from separate gate and up (halves specs).
        self.forward_halves = functools.partial(kernels.silu_mul_forward_on, self._forward, launcher, device)

    def forward_inplace(self, x12: torch.Tensor) -> torch.Tensor:
        """h over the gate half of x12 (an interleaved x12: a new h)."""
        if self.spec.interleaved:
            return self.forward(x12)
        gate, up = x12.chunk(2, 1)  # one call for both views: slicing costs ~1.5 us each
        return kernels.silu_mul_forward_on(self._forward, self.launcher, self.device, gate, up, gate)

    def forward_over_gate(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """h = act(gate) * up written over ``gate`` ([M, H] each, halves specs)."""
        return kernels.silu_mul_forward_on(self._forward, self.launcher, self.device, gate, up, gate)

    def backward_halves(self, gate: torch.Tensor, up: torch.Tensor, dh: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """(dx12 [M, 2H], h), both new, from separate gate and up (halves specs)."""
        return kernels.swiglu_backward_halves_on(self._backward, self.launcher, self.device, gate, up, dh)

    def forward_fp8(self, x12: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return kernels.launch_swiglu_forward_fp8(x12, self.launcher, self.config, self.spec)

    def backward(self, x12: torch.Tensor, dh: torch.Tensor, inplace: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(dx12, h); ``inplace``: dx12 over x12."""
        return kernels.swiglu_backward_on(self._backward, self.launcher, self.device, x12, dh,
                                          x12 if inplace else None)

    def backward_fp8(self, saved: torch.Tensor, dh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return kernels.launch_swiglu_backward_fp8(saved, dh, self.launcher, self.config, self.spec)


class TorchPath:
    """The torch implementation, for one GLU spec."""
    __slots__ = ("spec",)
    launcher = False  # no launcher: the torch implementation
    #: One x12 always: torch's CPU loops round a row's vector tail apart from its body, so the
    #: bits would depend on the layout (and the memory modes, which need one x12, would differ).
    halves_apart = False

    def __init__(self, spec: GLUActivation) -> None:
        self.spec = spec

    def forward(self, x12: torch.Tensor) -> torch.Tensor:
        return torch_impl.swiglu_forward_torch(x12, _or_new_if_half(None, (x12.shape[0], x12.shape[1] // 2), x12),
                                               self.spec)

    def forward_inplace(self, x12: torch.Tensor) -> torch.Tensor:
        if self.spec.interleaved:
            return self.forward(x12)
        gate, up = x12.chunk(2, 1)
        return torch_impl.silu_mul_forward_torch(gate, up, gate, self.spec)

    def forward_fp8(self, x12: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.forward(x12), saved_x12.quantize_torch(x12, self.spec)

    def backward(self, x12: torch.Tensor, dh: torch.Tensor, inplace: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return torch_impl.swiglu_backward_torch(x12, dh, x12 if inplace else _or_new(None, tuple(x12.shape), x12),
                                                h_out=_or_new(None, tuple(dh.shape), x12), activation=self.spec)

    def backward_fp8(self, saved: torch.Tensor, dh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x12 = saved_x12.dequantize_torch(saved, dh.shape[1], self.spec)
        dx12, h = torch_impl.swiglu_backward_torch(x12, dh.float(), activation=self.spec)
        return dx12.to(dh.dtype), h.to(dh.dtype)


#: (id(launcher), id(spec), dtype, device, id(config), clamp rule) -> (launcher, spec, config, path):
#: keyed by identity (hashing the dataclasses is a Python call each); the entry holds the objects,
#: so their ids stay theirs. The clamps' gradient rule (``_torch_compat``) is in the key because a
#: path holds launch plans built with it. Only lasting decisions are kept: a passed self-check, or
#: no kernels for the device; a failed or deferred one is asked again (STRICT raises each time).
_PATHS: dict[tuple, tuple] = {}
_MAX_PATHS = 1024
first_use_check.on_reset.append(_PATHS.clear)


def path_for(x: torch.Tensor, spec: GLUActivation, launcher=None):
    """The path for a call on ``x`` (kernels or torch), ``launcher`` None: the
    forced one (``using_launcher``), else CuPy's for CUDA tensors."""
    if launcher is None:
        launcher = forced_launcher()
    config = current_launch_config()
    key = _path_key(launcher, spec, x, config)
    entry = _PATHS.get(key)
    if entry is not None:  # these very objects: the entry keeps them alive, and live objects' ids are unique
        return entry[3]
    return _decide(launcher, spec, x, config, key)


def _path_key(launcher, spec: GLUActivation, x: torch.Tensor, config) -> tuple:
    return id(launcher), id(spec), x.dtype, x.device, id(config), _torch_compat.CLAMP_GRADIENT_AT_BOUND


def _decide(launcher, spec, x, config, key):
    if launcher is None and not x.is_cuda:
        path = TorchPath(spec)  # no kernels off CUDA without a substitute launcher
    elif launcher is None and not cuda_kernels_available():
        return TorchPath(spec)  # asked again: STRICT raises, and the warning is given once there
    elif kernels_usable(launcher, spec, x.dtype, x.device, config):
        path = KernelPath(launcher, spec, config, x.dtype, x.device)
    else:
        return TorchPath(spec)
    if len(_PATHS) >= _MAX_PATHS:
        _PATHS.clear()
    _PATHS[key] = (launcher, spec, config, path)
    return path


def eager_path(x: torch.Tensor, spec: GLUActivation):
    """The call's path, decided once at the API: None under a tracer or a
    torch.func transform (``route`` decides per primitive there)."""
    # torch.compiler.is_compiling(), a frame less (``_torch_compat.compiler_state``)
    if (is_dynamo_compiling() or compiler_state._is_compiling_flag or functorch_transforms_active()
            or is_functorch_wrapped(x)):
        return None
    # path_for's lookup and ``_path_key`` inline (Python frames less on every call).
    launcher, config = forced_launcher(), current_launch_config()
    key = (id(launcher), id(spec), x.dtype, x.device, id(config), _torch_compat.CLAMP_GRADIENT_AT_BOUND)
    entry = _PATHS.get(key)
    return entry[3] if entry is not None else _decide(launcher, spec, x, config, key)


def lasting_path(x: torch.Tensor, spec: GLUActivation):
    """(path, lasting) for an eager call on ``x`` (the caller made
    ``eager_path``'s tracer checks): ``lasting`` when the decision is kept
    until ``first_use_check.reset`` (which a caller keeping it must follow)."""
    launcher, config = forced_launcher(), current_launch_config()
    key = _path_key(launcher, spec, x, config)
    entry = _PATHS.get(key)
    if entry is not None:
        return entry[3], True
    path = _decide(launcher, spec, x, config, key)
    return path, key in _PATHS


def _kernel_path(x12: torch.Tensor, implementation: str | None, launcher, spec: GLUActivation):
    """The :class:`KernelPath` to run the kernels with (its plans and device
    held: the launches look nothing up), or None for the torch
    implementation: also when the module (variant, dtype, device, launcher,
    launch config) failed its first-use self-check (``first_use_check``)."""
    if implementation is None:
        path = path_for(x12, spec, launcher)
        return None if path.launcher is False else path
    if implementation not in ("torch", "kernels"):
        raise ValueError(f"implementation must be None, 'torch' or 'kernels', got {implementation!r}")
    if implementation == "torch":
        return None
    chosen = launcher if launcher is not None else forced_launcher()
    config = current_launch_config()
    if not kernels_usable(chosen, spec, x12.dtype, x12.device, config):
        return None
    return KernelPath(chosen, spec, config, x12.dtype, x12.device)


def run_swiglu_forward(x12, out=None, implementation=None, launcher=None, activation=SILU) -> torch.Tensor:
    path = _kernel_path(x12, implementation, launcher, activation)
    if path is not None:
        return path.forward(x12, out)
    return torch_impl.swiglu_forward_torch(x12, _or_new_if_half(out, (x12.shape[0], x12.shape[1] // 2), x12),
                                           activation)


def run_swiglu_backward(x12, dh, dx12_out=None, implementation=None, launcher=None, activation=SILU):
    path = _kernel_path(x12, implementation, launcher, activation)
    if path is not None:
        return kernels.swiglu_backward_on(path._backward, path.launcher, path.device, x12, dh, dx12_out)
    return torch_impl.swiglu_backward_torch(x12, dh, _or_new(dx12_out, tuple(x12.shape), x12),
                                            h_out=_or_new(None, tuple(dh.shape), x12), activation=activation)


def run_silu_mul_forward(gate, up, out=None, implementation=None, launcher=None, activation=SILU) -> torch.Tensor:
    path = _kernel_path(gate, implementation, launcher, activation)
    if path is not None:
        return path.forward_halves(gate, up, out)
    return torch_impl.silu_mul_forward_torch(gate, up, _or_new_if_half(out, gate.shape, gate), activation)


def run_silu_mul_backward(gate, up, dh, dgate_out=None, dup_out=None, implementation=None, launcher=None,
                          activation=SILU):
    path = _kernel_path(gate, implementation, launcher, activation)
    if path is not None:
        return kernels.launch_silu_mul_backward(gate, up, dh, dgate_out, dup_out, path.launcher, path.config,
                                                activation)
    shape = gate.shape
    return torch_impl.silu_mul_backward_torch(gate, up, dh, _or_new(dgate_out, shape, gate),
                                             _or_new(dup_out, shape, gate), activation)


def gate_half(x12: torch.Tensor) -> torch.Tensor:
    return x12.chunk(2, 1)[0]


def h_over_gate(x12: torch.Tensor, spec: GLUActivation) -> torch.Tensor:
    """h = act(gate) * up written over the gate half of x12 (the silu_mul
    primitive on x12's two halves); returns that strided [M, H] view."""
    gate, up = x12.chunk(2, 1)  # one call for both views: slicing costs ~1.5 us each
    return run_silu_mul_forward(gate, up, gate, activation=spec)


def batch_first(info, t: torch.Tensor, dim) -> torch.Tensor:
    """``t`` with its vmap batch (at ``dim``, or none: then broadcast) as dim 0."""
    return t.expand(info.batch_size, *t.shape) if dim is None else t.movedim(dim, 0)


# ---- the 8-bit saved x12 (saved_x12="fp8", see saved_x12.py) --------------------------------

def run_swiglu_forward_fp8(x12, implementation=None, launcher=None, activation=SILU):
    """(h, saved): h from x12 as ``run_swiglu_forward``, and x12 quantized to
    the 8-bit saved tensor, in one kernel pass (the torch path: two)."""
    path = _kernel_path(x12, implementation, launcher, activation)
    if path is not None:
        return path.forward_fp8(x12)
    h = run_swiglu_forward(x12, None, "torch", None, activation)
    return h, saved_x12.quantize_torch(x12, activation)


def run_swiglu_backward_fp8(saved, dh, implementation=None, launcher=None, activation=SILU):
    """(dx12, h) in dh's dtype from the 8-bit saved x12: the backward of the
    dequantized x12 (fp32 math, each output rounded once)."""
    path = _kernel_path(dh, implementation, launcher, activation)
    if path is not None:
        return path.backward_fp8(saved, dh)
    x12 = saved_x12.dequantize_torch(saved, dh.shape[1], activation)
    dx12, h = torch_impl.swiglu_backward_torch(x12, dh.float(), activation=activation)
    return dx12.to(dh.dtype), h.to(dh.dtype)
