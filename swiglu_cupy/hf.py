"""Hugging Face integration: swap the SwiGLU MLPs of a loaded model for the fused op.

    from transformers import AutoModelForCausalLM
    from swiglu_cupy.hf import patch_model

    model = AutoModelForCausalLM.from_pretrained(...)
    n = patch_model(model)   # number of MLPs replaced

Every module with ``gate_proj``/``up_proj``/``down_proj`` (``nn.Linear``) and a
SiLU activation (``LlamaMLP``, ``MistralMLP``, ``Qwen2MLP``, ...) becomes a
:class:`SwiGLUMLP` with the same weights. The activation is recognised by its
values, not by its class name, and the module's own forward is checked against
the fused op on a probe input before it is replaced, so GELU/GeGLU MLPs and
look-alikes that compute something else are left alone.

:class:`SwiGLUMLP` keeps the Hugging Face checkpoint layout: its state_dict
keys are ``gate_proj.weight``, ``up_proj.weight``, ``down_proj.weight`` (and
the biases), and it loads state dicts in that layout (or in its own packed
``w12``/``w3`` layout). ``save_pretrained`` of a patched model therefore writes
a checkpoint that loads into an unpatched model, and an unpatched model's
state dict loads into a patched one.

MLPs whose projections are other modules (PEFT LoRA layers, quantized
linears, anything callable) keep them: they become a :class:`SiluMulMLP`
holding the very same projection modules, and only
``act_fn(gate_proj(x)) * up_proj(x)`` runs fused (:func:`swiglu_cupy.silu_mul`).
Parameter names, adapters, ``requires_grad`` and PEFT's ``merge_and_unload``
are untouched.

This module does not import ``transformers``; it works on any ``nn.Module``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._sources import SUPPORTED_DTYPES
from .api import silu_mul
from .module import SwiGLU

__all__ = ["SwiGLUMLP", "SiluMulMLP", "patch_model", "is_swiglu_mlp"]

_ACT_NAMES = ("act_fn", "activation_fn", "act")
_HF = ("gate_proj", "up_proj", "down_proj")


def _to_hf_keys(module: "SwiGLUMLP", state_dict, prefix: str, local_metadata) -> None:
    """state_dict post-hook: ``w12.*``/``w3.*`` -> ``gate_proj.*``, ``up_proj.*``,
    ``down_proj.*``. The gate/up halves are views of ``w12`` (no copy);
    ``save_pretrained`` clones such disjoint views before writing."""
    H = module.hidden_features
    packed = {}
    for name in ("w12.weight", "w12.bias", "w3.weight", "w3.bias"):
        if prefix + name in state_dict:
            packed[name] = state_dict.pop(prefix + name)
    # In nn.Linear order: gate_proj.weight, gate_proj.bias, up_proj.weight, ...
    for hf_name, packed_name, rows in (("gate_proj", "w12", slice(None, H)),
                                       ("up_proj", "w12", slice(H, None)),
                                       ("down_proj", "w3", slice(None))):
        for kind in ("weight", "bias"):
            t = packed.get(f"{packed_name}.{kind}")
            if t is not None:
                state_dict[f"{prefix}{hf_name}.{kind}"] = t[rows]


def _from_hf_keys(module: "SwiGLUMLP", state_dict, prefix: str, local_metadata, strict,
                  missing_keys, unexpected_keys, error_msgs) -> None:
    """load_state_dict pre-hook: HF keys -> ``w12.*`` (gate rows first) / ``w3.*``.
    Keys already in the packed layout are left as they are; an incomplete
    gate/up pair is left in place so load_state_dict reports it."""
    for kind in ("weight", "bias"):
        g, u = f"{prefix}gate_proj.{kind}", f"{prefix}up_proj.{kind}"
        if g in state_dict and u in state_dict:
            gate, up = state_dict.pop(g), state_dict.pop(u)
            if gate.shape[1:] != up.shape[1:]:
                error_msgs.append(f"{g} and {u} have different shapes: {tuple(gate.shape)} vs "
                                  f"{tuple(up.shape)}")
                continue
            state_dict[f"{prefix}w12.{kind}"] = torch.cat([gate, up])
        d = f"{prefix}down_proj.{kind}"
        if d in state_dict:
            state_dict[f"{prefix}w3.{kind}"] = state_dict.pop(d)


class SwiGLUMLP(SwiGLU):
    """A :class:`~swiglu_cupy.SwiGLU` that presents the Hugging Face MLP
    checkpoint layout (``gate_proj``/``up_proj``/``down_proj`` keys) in
    ``state_dict`` and ``load_state_dict``. Its parameters are still the
    packed ``w12`` (gate rows first) and ``w3``. Build one with
    ``SwiGLUMLP.from_gate_up_down(mlp.gate_proj, mlp.up_proj, mlp.down_proj)``.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._register_state_dict_hook(_to_hf_keys)
        self._register_load_state_dict_pre_hook(_from_hf_keys, with_module=True)


class SiluMulMLP(nn.Module):
    """``down_proj(silu_mul(gate_proj(x), up_proj(x)))`` around projection
    modules that cannot be packed into one weight (PEFT LoRA layers,
    quantized linears, any module mapping ``[..., D]`` to ``[..., H]``): they
    are kept as they are, so parameter names, adapters and ``requires_grad``
    stay those of the original MLP; only the activation and product run fused.
    ``act_fn`` is an ``nn.SiLU`` that names the activation (the forward does
    not call it), so that once the projections are plain ``nn.Linear`` again
    (e.g. after PEFT's ``merge_and_unload()``) ``patch_model`` can replace
    this module with the fully fused :class:`SwiGLUMLP`.
    """

    def __init__(self, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module) -> None:
        super().__init__()
        for name, proj in (("gate_proj", gate_proj), ("up_proj", up_proj), ("down_proj", down_proj)):
            if not isinstance(proj, nn.Module):
                raise TypeError(f"{name} must be an nn.Module, got {type(proj).__name__}")
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))


def _find_act(module: nn.Module):
    for name in _ACT_NAMES:
        act = getattr(module, name, None)
        if act is not None:
            return name, act
    return None, None


def _is_silu(act, device, dtype) -> bool:
    """True if ``act`` is a parameter-free callable that computes SiLU."""
    if isinstance(act, nn.SiLU):
        return True
    if not callable(act):
        return False
    if isinstance(act, nn.Module) and any(True for _ in act.parameters()):
        return False  # learnable activation: replacing it would drop its parameters
    if device is not None and device.type == "meta":
        device = torch.device("cpu")
    t = torch.linspace(-12.0, 12.0, 1001, dtype=torch.float32, device=device)
    # Probe in the model's dtype when it is float32/64; low-precision
    # activations are compared in float32 (their values are identical).
    if dtype == torch.float64:
        t = t.double()
    try:
        with torch.no_grad():
            out = act(t)
    except Exception:
        return False
    if not isinstance(out, torch.Tensor) or out.shape != t.shape:
        return False
    return bool(torch.allclose(out.to(t.dtype), F.silu(t), rtol=1e-5, atol=1e-6))


def is_swiglu_mlp(module: nn.Module) -> bool:
    """True if ``module`` has plain ``nn.Linear`` ``gate_proj``/``up_proj``/
    ``down_proj`` of compatible shapes and a SiLU activation (checked by value).
    It does not run the module's forward (``patch_model`` also does that)."""
    lins = [getattr(module, name, None) for name in _HF]
    if not all(type(lin) is nn.Linear for lin in lins):  # not subclasses (quantized, LoRA, ...)
        return False
    gate, up, down = lins
    w = gate.weight
    if w.dtype not in SUPPORTED_DTYPES:
        return False
    if any(lin.weight.dtype != w.dtype or lin.weight.device != w.device for lin in lins):
        return False
    if up.weight.shape != w.shape or down.weight.shape[1] != w.shape[0]:
        return False
    if (gate.bias is None) != (up.bias is None):
        return False
    if up.weight.requires_grad != w.requires_grad:
        return False
    if gate.bias is not None and gate.bias.requires_grad != up.bias.requires_grad:
        return False
    _, act = _find_act(module)
    return act is not None and _is_silu(act, w.device, w.dtype)


def _probe_spec(module: nn.Module) -> tuple[int, torch.device, torch.dtype] | None:
    """``(in_features, device, dtype)`` of a probe input for an MLP whose
    projections are arbitrary modules, or None if the input width is unknown.
    The width is ``gate_proj.in_features`` (nn.Linear, PEFT and quantized
    layers have it) or the second dim of a 2-D ``gate_proj.weight``; the
    dtype is that of gate_proj's first floating parameter (a quantized base
    weight is not floating; LoRA adapters come after the base layer)."""
    gate = module.gate_proj
    in_features = getattr(gate, "in_features", None)
    weight = getattr(gate, "weight", None)
    if not isinstance(in_features, int) and isinstance(weight, torch.Tensor) and weight.dim() == 2:
        in_features = weight.shape[1]
    if not isinstance(in_features, int) or isinstance(in_features, bool) or in_features < 1:
        return None
    tensors = [*module.parameters(), *module.buffers()]
    device = tensors[0].device if tensors else torch.device("cpu")
    dtype = next((p.dtype for p in gate.parameters() if p.dtype in SUPPORTED_DTYPES), torch.get_default_dtype())
    return in_features, device, dtype


def _is_silu_mul_mlp(module: nn.Module) -> bool:
    """``gate_proj``/``up_proj``/``down_proj`` modules of any kind and a SiLU
    activation, and nothing else a :class:`SiluMulMLP` would drop: no other
    child module, no parameter or buffer of its own."""
    if not all(isinstance(getattr(module, name, None), nn.Module) for name in _HF):
        return False
    act_name, act = _find_act(module)
    if act is None:
        return False
    if any(name not in (*_HF, act_name) for name, _ in module.named_children()):
        return False
    if any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False)):
        return False
    spec = _probe_spec(module)
    device, dtype = (spec[1], spec[2]) if spec is not None else (None, torch.get_default_dtype())
    return _is_silu(act, device, dtype)


def _forward_matches(module: nn.Module, replacement: nn.Module, in_features: int, device: torch.device,
                     dtype: torch.dtype) -> bool:
    """Run the original module and its replacement on a probe input of
    ``in_features`` (``device``, ``dtype``): equal up to rounding? (A gate/up
    swap or any other formula differs by O(1).)"""
    if device.type == "meta":
        return True  # nothing to compute with; the structure check has to do
    gen = torch.Generator(device="cpu").manual_seed(1234)
    x = torch.randn(4, in_features, generator=gen, dtype=torch.float32).to(device, dtype)
    was_training = module.training, replacement.training
    try:
        module.eval(), replacement.eval()  # no dropout in the probe
        with torch.no_grad():
            expected = module(x)
            actual = replacement(x)
    except Exception:
        return False
    finally:
        module.train(was_training[0])
        replacement.train(was_training[1])
    if not isinstance(expected, torch.Tensor) or not isinstance(actual, torch.Tensor) \
            or expected.shape != actual.shape:
        return False
    e, a = expected.double(), actual.double()
    if not (torch.isfinite(e).all() and torch.isfinite(a).all()):
        return False
    scale = e.pow(2).mean().sqrt().item()
    if scale == 0.0:
        return a.abs().max().item() == 0.0
    # Both sides round differently (fused: one rounding of h); the error is a
    # few ulps of the dtype, relative. A wrong formula is off by O(1).
    tol = {torch.float16: 2e-2, torch.bfloat16: 5e-2}.get(dtype, 1e-4)
    return (e - a).pow(2).mean().sqrt().item() <= tol * scale


def patch_model(model: nn.Module, strict: bool = False, *, verify: bool = True,
                recompute_gate_up: bool = False, inplace_backward: bool = False) -> int:
    """Fuse every SwiGLU-style MLP in ``model`` and return how many were patched.

    A module qualifies if it has ``gate_proj``/``up_proj``/``down_proj`` and
    an activation (``act_fn``, ``activation_fn`` or ``act``) that computes
    SiLU (checked on a probe tensor; learnable activations never qualify):
    - plain ``nn.Linear`` projections (one dtype and device, gate and up of
      one shape): replaced by a :class:`SwiGLUMLP` carrying the same weights
      (copies, same device, dtype and ``requires_grad``, biases included),
      the fully fused op. ``recompute_gate_up`` / ``inplace_backward`` select
      its memory modes.
    - any other projection modules (PEFT LoRA layers, quantized linears, ...):
      replaced by a :class:`SiluMulMLP` holding the same projection modules,
      which fuses ``act(gate_proj(x)) * up_proj(x)`` (:func:`silu_mul`). The
      MLP must have no other submodule and no parameter of its own.
    With ``verify=True`` (the default) the module's forward must also match
    its replacement on a probe input (so a module whose forward is not
    ``down(silu(gate(x)) * up(x))`` is left alone; projections whose input
    width cannot be told are then left alone too). Other MLPs (GELU, GeGLU,
    ...) are untouched. ``strict=True`` raises ``ValueError`` if nothing was
    patched. Call it after the weights are loaded and adapters added
    (``peft.get_peft_model``), before wrapping the model (DDP, FSDP,
    torch.compile) or building the optimizer.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    candidates = []
    for name, module in model.named_modules():
        if isinstance(module, SwiGLU):
            continue
        if is_swiglu_mlp(module):
            fused = True
        elif not isinstance(module, SiluMulMLP) and _is_silu_mul_mlp(module):
            fused = False
        else:
            continue
        if not name:
            raise ValueError("patch_model: model itself is a SwiGLU MLP and cannot be replaced in "
                             "place; use SwiGLUMLP.from_gate_up_down(model.gate_proj, model.up_proj, "
                             "model.down_proj) or SiluMulMLP(model.gate_proj, model.up_proj, "
                             "model.down_proj)")
        candidates.append((name, module, fused))
    for name, module, fused in candidates:
        distributed = [n for n in _HF if type(getattr(getattr(module, n), "weight", None)).__name__ == "DTensor"]
        if fused and distributed:  # e.g. from_pretrained(..., tp_plan=...): a row shard splits gate from up
            raise ValueError(
                f"patch_model: {name}.{distributed[0]}.weight is already a DTensor (tensor parallel, e.g. "
                "a Hugging Face tp_plan). Load the model without tp_plan, call patch_model, then "
                "parallelize each patched MLP with swiglu_cupy.parallel.SwiGLUTensorParallel.")
    replaced = 0
    skipped = []
    for name, module, fused in candidates:
        if fused:
            new = SwiGLUMLP.from_gate_up_down(module.gate_proj, module.up_proj, module.down_proj,
                                              recompute_gate_up=recompute_gate_up,
                                              inplace_backward=inplace_backward)
            probe = (new.in_features, new.w12.weight.device, new.w12.weight.dtype)
        else:
            new = SiluMulMLP(module.gate_proj, module.up_proj, module.down_proj)
            probe = _probe_spec(module)
        if verify and (probe is None or not _forward_matches(module, new, *probe)):
            skipped.append(name)
            continue
        new.train(module.training)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, new)
        replaced += 1
    if strict and replaced == 0:
        detail = (f" {len(skipped)} candidate(s) had gate/up/down projections and a SiLU activation "
                  f"but a forward that does not compute down(silu(gate(x)) * up(x)) (or could not be probed): "
                  f"{skipped[:4]}."
                  if skipped else "")
        raise ValueError(
            f"patch_model(strict=True): no SwiGLU MLP found in {type(model).__name__}. A SwiGLU MLP is "
            "a module with gate_proj, up_proj and down_proj (nn.Linear, LoRA, quantized or other "
            "modules) and a SiLU activation (act_fn/activation_fn/act); GELU and GeGLU MLPs are not "
            "patched." + detail)
    return replaced
