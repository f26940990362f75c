"""Layer 3, functional: ``swiglu``, ``swiglu_unpacked``, ``silu_mul`` and
``glu_mul``. Each takes ``activation=`` (a plain form's name or a
``GLUActivation``; default ``"silu"``: SwiGLU).

Each validates its arguments once (``_validation``), then applies the
apply-only Function (``functions``); under no_grad, where no graph can be
recorded, the same forward pass runs without the Function.
"""
from __future__ import annotations

import importlib
import sys

import torch

from .. import _torch_compat
from .. import _validation as check
from .._autograd import under_autocast
from .._torch_compat import (any_autocast_enabled, compiler_state, functorch_transforms_active, is_dynamo_compiling,
                             is_functorch_wrapped, jit_tracing)
from .._tile_size import resolve_tile_rows
from .._validation import Role
from ..activations import GLUActivation, resolve_activation, resolve_halves_activation
from ..kernels.launch_config import current_launch_config, forced_launcher
from ..primitives import dispatch, first_use_check
from .functions import SiluMulFunction, SwiGLUFunction, SwiGLUOptions, swiglu_forward_pass

__all__ = ["swiglu", "swiglu_unpacked", "silu_mul", "glu_mul"]

_W = Role.WEIGHT
_PACKED_ROLES = {"x": Role.INPUT, "w12": _W, "b12": _W, "w3": _W, "b3": _W}
_UNPACKED_ROLES = {"x": Role.INPUT, "w1": _W, "b1": _W, "w2": _W, "b2": _W, "w3": _W, "b3": _W}
_SILU_MUL_ROLES = {"gate": Role.INPUT, "up": Role.INPUT}
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


#: (activation, recompute_gate_up, inplace_backward, saved_x12, tile_grads_fp32, halves_only, id(launcher),
#: dtype, device, id(launch config), clamp rule) -> (activation, launcher, config, options): each
#: eager call's decision, its path bound in. A repeated call is this one lookup. A spec is keyed
#: by identity (hashing the dataclass is a Python call per call) and the entry holds it (and the
#: launcher and config), so their ids stay their own; a name by itself. Only exact bools and
#: None/"fp8" reach it (1 == True would otherwise share True's entry), and only lasting path
#: decisions (``dispatch.lasting_path``), forgotten with them on a self-check reset. Bounded.
_DECIDED: dict[tuple, tuple] = {}
first_use_check.on_reset.append(_DECIDED.clear)


def run_feed_forward(args: list, activation, recompute_gate_up, inplace_backward, saved_x12, tile_rows,
                     tile_grads_fp32, halves_only: bool, common: bool) -> torch.Tensor:
    """The one place a feed-forward call is decided and SwiGLUFunction
    applied. Decided once, here: the settings (checked; each bad one raises,
    naming its argument), the route and the path (kernels or torch,
    self-check verdict included), bound into the call's
    :class:`SwiGLUOptions`; under a tracer or a torch.func transform there is
    no path (decided per primitive there); inside torch.jit.trace it raises.
    ``common``: the arguments passed ``check.common_case``; such an eager
    call with no tensor left wrapped by a transform (asked here, where Dynamo
    never traces) applies the Function without torch's unwrapping. Under
    autocast every input is first cast to the autocast dtype, like
    nn.Linear, and the Function runs with autocast off (it picks its own
    precision), decided for the cast dtype. ``swiglu``, ``swiglu_unpacked``
    and a patched MLP's ``run_plan`` call it after their input checks."""
    x = args[0]
    if any_autocast_enabled() and torch.is_autocast_enabled(x.device.type):
        return under_autocast(x.device.type, args, lambda cast: run_feed_forward(
            cast, activation, recompute_gate_up, inplace_backward, saved_x12, tile_rows, tile_grads_fp32,
            halves_only, common))
    if tile_rows is not None:
        check.check_tile_rows(tile_rows)
    options = None
    # torch.compiler.is_compiling(), a frame less (``_torch_compat.compiler_state``). Dynamo folds
    # it to True: the eager branches below (the cache, whose contents it would guard on, and the
    # C-level jit check it cannot trace) are never traced.
    if is_dynamo_compiling() or compiler_state._is_compiling_flag:
        pass
    elif jit_tracing():
        check.reject_jit()
    elif not (functorch_transforms_active() or is_functorch_wrapped(x)):  # eager: a path, kept when lasting
        launcher, config = forced_launcher(), current_launch_config()
        key = entry = None
        if (recompute_gate_up.__class__ is bool and inplace_backward.__class__ is bool
                and tile_grads_fp32.__class__ is bool and (saved_x12 is None or saved_x12.__class__ is str)
                and (activation.__class__ is str or activation.__class__ is GLUActivation)):
            key = (activation if activation.__class__ is str else id(activation), recompute_gate_up,
                   inplace_backward, saved_x12, tile_grads_fp32, halves_only, id(launcher), x.dtype, x.device,
                   id(config), _torch_compat.CLAMP_GRADIENT_AT_BOUND)
            entry = _DECIDED.get(key)  # an entry holds its spec, launcher and config: their ids are their own
        options = entry[3] if entry is not None else _decide_eager(
            x, key, (activation, launcher, config), recompute_gate_up, inplace_backward, saved_x12,
            tile_grads_fp32, halves_only)
        if common:  # a tensor left over from a transform needs torch's apply, which unwraps it
            for t in args:  # transforms wrap into plain torch.Tensor objects, never Parameters; x was asked above
                if t.__class__ is torch.Tensor and t is not x and is_functorch_wrapped(t):
                    common = False
                    break
    if options is None:  # traced or transformed: no path
        options = _checked_options(activation, recompute_gate_up, inplace_backward, saved_x12, tile_grads_fp32,
                                   halves_only)
    # Untiled (the default) costs nothing more on this per-call path.
    tile = 0 if tile_rows is None else resolve_tile_rows(tile_rows, x.numel() // max(x.shape[-1], 1),
                                                         args[5].shape[1], x.dtype)
    path = options.path
    # Traced or transformed (no path), a graph is always recorded; eager, when grad mode is on.
    if path is None or torch.is_grad_enabled():
        if options.saved_x12_fp8:
            check.check_fp8_compute_dtype(x.dtype)
        if path is None:  # x12 comes back as a second output there (see SwiGLUFunction)
            return SwiGLUFunction.apply(*args, options, not torch.is_grad_enabled(), tile)[0]
        # An eager path: no transform is active and, in the common case, no tensor is wrapped (above).
        return (SwiGLUFunction.apply_unwrapped if common else SwiGLUFunction.apply)(*args, options, False, tile)
    # No grad: no graph can be recorded, so the Function (whose only job is
    # the graph) is skipped; the same forward pass runs, in inference mode.
    return swiglu_forward_pass(*args, options.activation, True, False, False, tile, path)[0]  # inference, eager


def _decide_eager(x, key, held: tuple, recompute_gate_up, inplace_backward, saved_x12, tile_grads_fp32,
                  halves_only: bool) -> SwiGLUOptions:
    """An eager call not decided before: checked options with the path for
    ``x`` bound in, kept under ``key`` (None: not kept) with ``held``
    (activation, launcher, config: what the key names by id) when lasting."""
    options = _checked_options(held[0], recompute_gate_up, inplace_backward, saved_x12, tile_grads_fp32,
                               halves_only)
    path, lasting = dispatch.lasting_path(x, options.activation)
    options = options._replace(path=path)
    if key is not None and lasting:
        if len(_DECIDED) >= 1024:
            _DECIDED.clear()
        _DECIDED[key] = (*held, options)
    return options


def _checked_options(activation, recompute_gate_up, inplace_backward, saved_x12, tile_grads_fp32,
                     halves_only: bool) -> SwiGLUOptions:
    """The call's settings, checked (each bad one raises, naming its argument); no path."""
    check.check_flags(recompute_gate_up=recompute_gate_up, inplace_backward=inplace_backward,
                      tile_grads_fp32=tile_grads_fp32)
    fp8 = check.check_saved_x12(saved_x12, recompute_gate_up, inplace_backward)
    spec = (resolve_halves_activation(activation, "w1 and w2") if halves_only
            else resolve_activation(activation))
    return SwiGLUOptions(spec, recompute_gate_up, inplace_backward, fp8, tile_grads_fp32)


def swiglu(x: torch.Tensor, w12: torch.Tensor, b12: torch.Tensor | None,
           w3: torch.Tensor, b3: torch.Tensor | None, *, activation="silu",
           recompute_gate_up: bool = False, inplace_backward: bool = False, saved_x12=None,
           tile_rows=None, tile_grads_fp32: bool = True) -> torch.Tensor:
    """Fused SwiGLU feed-forward: returns [..., O] (layout in ``functions.py``).

    ``activation`` picks the GLU variant (``"gelu_tanh"``, ...,
    ``swiglu_cupy.activations.GPT_OSS``; an interleaved spec means w12's rows
    alternate gate/up). ``recompute_gate_up`` and ``inplace_backward`` are the memory modes of
    ``SwiGLUFunction``. ``saved_x12="fp8"`` keeps x12 for backward as float8 e4m3 with a float32
    scale per 128 columns (about 0.52x the bytes of a bf16 x12; default None: the compute dtype;
    float32/bfloat16/float16 compute, see docs/design.md). Under ``torch.autocast`` the inputs are
    cast to the autocast dtype (as ``nn.Linear`` does), and the gradients flow back in each input's
    dtype.

    ``tile_rows`` (long sequences; default None: untiled) runs the whole op ``tile_rows`` rows
    at a time, forward and backward, so no ``[tokens, H]``-sized tensor exists and only x is
    saved (x12 is recomputed per tile; with ``saved_x12="fp8"`` the tiles' 8-bit x12 is saved
    instead). ``"auto"`` picks the largest multiple of 256 rows whose ``[tile, 2H]`` workspace
    fits in 256 MiB. Inputs with no more rows than one tile take the untiled path unchanged.
    ``tile_grads_fp32`` (default True) accumulates 16-bit weights' gradients across tiles in
    float32 (4 bytes per weight element during backward); False accumulates in their dtype.
    See docs/long-context.md.
    """
    common = check.common_case(x, w12, b12, None, None, w3, b3, True)
    if not common:
        check.check_inputs({"x": x, "w12": w12, "b12": b12, "w3": w3, "b3": b3}, _PACKED_ROLES,
                           optional=("b12", "b3"))
        check.check_packed_shapes(x, w12, b12, w3, b3)
    return run_feed_forward([x, w12, b12, None, None, w3, b3], activation, recompute_gate_up, inplace_backward,
                            saved_x12, tile_rows, tile_grads_fp32, False, common)


def swiglu_unpacked(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None,
                    w2: torch.Tensor, b2: torch.Tensor | None, w3: torch.Tensor,
                    b3: torch.Tensor | None, *, activation="silu", recompute_gate_up: bool = False,
                    inplace_backward: bool = False, saved_x12=None, tile_rows=None,
                    tile_grads_fp32: bool = True) -> torch.Tensor:
    """``swiglu`` with separate gate (``w1 [H, D]``, ``b1``) and up (``w2``,
    ``b2``) projections: ``w3(silu(x @ w1.T + b1) * (x @ w2.T + b2)) + b3``.

    The weights are never concatenated: gate and up are two GEMMs whose
    outputs the kernels read where they lie (the modes that need one x12
    buffer write its halves); the same Function, kernels and guarantees as
    ``swiglu`` (backward takes one GEMM more: dx is ``dgate @ w1 + dup @ w2``).
    ``activation``, ``saved_x12``, ``tile_rows`` and ``tile_grads_fp32`` as in ``swiglu``, halves
    layout only (separate weights have no interleaving).
    """
    common = check.common_case(x, w1, b1, w2, b2, w3, b3, False)
    if not common:
        check_unpacked_call(x, w1, b1, w2, b2, w3, b3)
    return run_feed_forward([x, w1, b1, w2, b2, w3, b3], activation, recompute_gate_up, inplace_backward,
                            saved_x12, tile_rows, tile_grads_fp32, True, common)


def check_unpacked_call(x, w1, b1, w2, b2, w3, b3) -> None:
    """The full checks of ``swiglu_unpacked``'s tensors (each error names its
    argument), for a call that is not ``check.common_case``."""
    check.check_inputs({"x": x, "w1": w1, "b1": b1, "w2": w2, "b2": b2, "w3": w3, "b3": b3},
                       _UNPACKED_ROLES, optional=("b1", "b2", "b3"))
    check.check_unpacked_shapes(x, w1, b1, w2, b2, w3, b3)


def _from_dlpack_module(array):
    """The array library of a DLPack-exporting ``array`` (numpy, cupy, ...),
    used to hand the result back as the same kind of array."""
    library = importlib.import_module(type(array).__module__.split(".")[0])
    if not hasattr(library, "from_dlpack"):
        raise TypeError(f"gate is a {type(array).__name__} that exports DLPack, but its library "
                        f"{library.__name__} has no from_dlpack to receive the result")
    return library


def silu_mul(gate, up, activation="silu"):
    """Fused ``silu(gate) * up`` (SwiGLU's activation, for models whose
    projections stay their own modules, e.g. LoRA or quantized layers), or
    ``act(gate) * up`` of another GLU variant with ``activation=`` (halves
    layout specs only: gate and up are separate; see ``glu_mul``).

    ``gate`` and ``up``: one shape ``[..., H]``, one dtype (float16, bfloat16,
    float32 or float64), one device. torch tensors go through the apply-only
    ``SiluMulFunction`` (autograd, checkpointing, torch.compile, torch.func);
    DTensors laid out alike (not Partial) run on their local shards.
    Any other array that exports DLPack (``__dlpack__``: NumPy on the CPU,
    CuPy on a GPU) is read without a copy and the result comes back as the
    same kind of array (no autograd there).
    """
    check.reject_jit()
    spec = resolve_halves_activation(activation, "gate and up")
    if not isinstance(gate, torch.Tensor) and hasattr(gate, "__dlpack__"):
        if not hasattr(up, "__dlpack__") or isinstance(up, torch.Tensor):
            raise TypeError(f"up must be a DLPack array like gate ({type(gate).__name__}), "
                            f"got {type(up).__name__}")
        library = _from_dlpack_module(gate)
        h = silu_mul(torch.from_dlpack(gate), torch.from_dlpack(up), spec)
        return library.from_dlpack(h.detach())
    # Plain tensors first: no sys.modules read on the hot path (or inside a torch.compile trace).
    plain = gate.__class__ in _PLAIN_TENSORS and up.__class__ in _PLAIN_TENSORS
    dtensor = None if plain else _dtensor_class()
    if dtensor is not None and (isinstance(gate, dtensor) or isinstance(up, dtensor)):
        return _silu_mul_shard_by_shard(dtensor, gate, up, spec)
    for name, t in (("gate", gate), ("up", up)):
        check.check_tensor(name, t, _SILU_MUL_ROLES[name])
    if gate.dim() < 1:
        raise ValueError("gate must have shape [..., H], got a 0-d tensor")
    if up.shape != gate.shape:
        raise ValueError(f"up must have the shape of gate {tuple(gate.shape)}, got {tuple(up.shape)}")
    if up.device != gate.device:
        raise ValueError(f"up must be on the device of gate ({gate.device}), got {up.device}")
    if up.dtype != gate.dtype:
        raise TypeError(f"up must have the dtype of gate ({gate.dtype}), got {up.dtype}")
    return SiluMulFunction.apply(gate, up, spec)


def _dtensor_class():
    """DTensor, if torch.distributed.tensor is loaded (else no tensor can be one)."""
    return getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)


def _silu_mul_shard_by_shard(dtensor: type, gate, up, spec):
    """An elementwise product of two DTensors laid out alike (a column-parallel
    gate and up, as tensor parallelism makes them) is the product of their
    local shards, laid out alike again; autograd goes through to_local /
    from_local. Partial sums cannot be activated shard by shard."""
    for name, t in (("gate", gate), ("up", up)):
        if not isinstance(t, dtensor):
            raise TypeError(f"{name} must be a DTensor like the other argument, got {type(t).__name__}")
    if gate.device_mesh != up.device_mesh or tuple(gate.placements) != tuple(up.placements):
        raise ValueError(f"up must be laid out as gate (mesh {gate.device_mesh}, placements {gate.placements}), "
                         f"got mesh {up.device_mesh}, placements {up.placements}")
    if any(p.is_partial() for p in gate.placements):
        raise ValueError(f"gate and up must not be Partial DTensors (placements {gate.placements}): the "
                         "activation is not linear; redistribute them to Shard or Replicate first")
    if gate.shape != up.shape:
        raise ValueError(f"up must have the shape of gate {tuple(gate.shape)}, got {tuple(up.shape)}")
    h = silu_mul(gate.to_local(), up.to_local(), spec)
    return dtensor.from_local(h, gate.device_mesh, gate.placements, run_check=False, shape=gate.shape,
                              stride=gate.stride())


def glu_mul(gate, up, activation="silu"):
    """Fused ``act(gate) * up`` for any halves-layout GLU variant: the
    activation step of a gated MLP whose projections stay their own modules.
    ``activation``: a plain form's name (``"silu"``, ``"gelu_tanh"``,
    ``"gelu"``, ``"relu"``, ``"sigmoid"``, ``"identity"``) or a
    ``GLUActivation`` (clamped, OAI). Same contract as ``silu_mul``."""
    return silu_mul(gate, up, activation)
