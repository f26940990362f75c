"""Slow eager references: the formulas in plain torch ops, for tests and
for users checking the fused ops (dense layouts as in ``dense/functions.py``,
MoE layouts as in ``moe/grouped.py``)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .activations import resolve_activation

__all__ = ["swiglu_reference", "silu_mul_reference", "glu_reference", "glu_ffn_reference", "split_gate_up",
           "experts_reference", "single_rounding_bounds"]

UNIT_ROUNDOFF = {torch.float16: 2**-11, torch.bfloat16: 2**-8, torch.float32: 2**-24, torch.float64: 2**-53}


def swiglu_reference(x: torch.Tensor, w12: torch.Tensor, b12: torch.Tensor | None,
                     w3: torch.Tensor, b3: torch.Tensor | None) -> torch.Tensor:
    """The packed feed-forward in three torch ops."""
    gate, up = F.linear(x, w12, b12).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w3, b3)


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` (two torch ops)."""
    return F.silu(gate) * up


def split_gate_up(x12: torch.Tensor, activation) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up) views of a packed ``[..., 2H]`` tensor in the spec's layout."""
    if resolve_activation(activation).interleaved:
        return x12[..., 0::2], x12[..., 1::2]
    return x12.chunk(2, dim=-1)


def _clamp_with_rule(x: torch.Tensor, low: float | None, high: float, gradient_at_bound: bool) -> torch.Tensor:
    """``x.clamp(low, high)``'s value, with the gradient passed where
    ``low <= x <= high`` (``gradient_at_bound``) or ``low < x < high``."""
    below = torch.le if gradient_at_bound else torch.lt
    inside = below(x, high) if low is None else below(x, high) & below(-x, -low)
    return torch.where(inside, x, x.detach().clamp(low, high))


def glu_reference(gate: torch.Tensor, up: torch.Tensor, activation="silu", *,
                  clamp_gradient_at_bound: bool | None = None) -> torch.Tensor:
    """``act(gate) * up`` for any ``GLUActivation`` (or a plain form's name),
    written as the models write it (HF's eager expressions), so autograd of
    this is the reference gradient, clamp boundaries included.

    ``clamp_gradient_at_bound``: None clamps with ``torch.clamp`` itself, so
    an element exactly at the limit gets the installed torch's gradient
    (passed up to 2.13, cut from 2.14); True or False imposes one rule, to
    check either on any torch."""
    spec = resolve_activation(activation)
    if spec.limit is not None and clamp_gradient_at_bound is None:
        gate = gate.clamp(max=spec.limit)
        up = up.clamp(min=-spec.limit, max=spec.limit)
    elif spec.limit is not None:
        gate = _clamp_with_rule(gate, None, spec.limit, clamp_gradient_at_bound)
        up = _clamp_with_rule(up, -spec.limit, spec.limit, clamp_gradient_at_bound)
    if spec.kind == "oai":
        return (up + spec.up_offset) * (gate * torch.sigmoid(gate * spec.alpha))
    act = {"silu": F.silu, "gelu_tanh": lambda g: F.gelu(g, approximate="tanh"), "gelu": F.gelu,
           "relu": F.relu, "sigmoid": torch.sigmoid, "identity": lambda g: g}[spec.kind]
    return act(gate) * up


def glu_ffn_reference(x: torch.Tensor, w12: torch.Tensor, b12: torch.Tensor | None,
                      w3: torch.Tensor, b3: torch.Tensor | None, activation="silu", *,
                      clamp_gradient_at_bound: bool | None = None) -> torch.Tensor:
    """The packed feed-forward with any activation spec (x12 in its layout)."""
    h = glu_reference(*split_gate_up(F.linear(x, w12, b12), activation), activation,
                      clamp_gradient_at_bound=clamp_gradient_at_bound)
    return F.linear(h, w3, b3)


def experts_reference(hidden_states, top_k_index, top_k_weights, w12, w3, b12=None, b3=None, *,
                      activation="silu", transposed=False, x12_dtype=None,
                      clamp_gradient_at_bound: bool | None = None) -> torch.Tensor:
    """The slow eager reference of ``routed_experts``: a loop over experts of
    plain torch ops (``glu_reference``), accumulated per token in fp32.
    ``x12_dtype`` rounds the gate/up projection to that dtype before the
    activation (as a low-precision op stores it): a clamp's gradient jumps at
    the limit, so a check of a bf16 op against a float64 reference must take
    the same clamp decisions. ``clamp_gradient_at_bound``: as in
    ``glu_reference``."""

    spec = resolve_activation(activation)
    D = hidden_states.shape[-1]
    x = hidden_states.reshape(-1, D)
    K = top_k_index.shape[-1]
    ids = top_k_index.reshape(x.shape[0], K)
    acc = torch.zeros(x.shape[0], D, dtype=torch.promote_types(x.dtype, torch.float32), device=x.device)
    for e in range(w12.shape[0]):
        token, slot = torch.where(ids == e)
        if token.numel() == 0:
            continue
        W12 = w12[e].t() if transposed else w12[e]
        W3 = w3[e].t() if transposed else w3[e]
        x12 = F.linear(x[token], W12, None if b12 is None else b12[e])
        if x12_dtype is not None:
            x12 = x12.to(x12_dtype).to(x12.dtype)
        h = glu_reference(*split_gate_up(x12, spec), spec, clamp_gradient_at_bound=clamp_gradient_at_bound)
        z = F.linear(h, W3, None if b3 is None else b3[e])
        if top_k_weights is not None:
            z = z * top_k_weights.reshape(x.shape[0], K)[token, slot].unsqueeze(1)
        acc = acc.index_add(0, token, z.to(acc.dtype))
    return acc.to(hidden_states.dtype).view(hidden_states.shape)


def single_rounding_bounds(x12, dh, activation, ref_h, ref_dx12, *, clamp: bool = True,
                           storage_ulps: int = 2, math_ulps: int = 64):
    """Per-element bounds (h, dx12) between two implementations of a GLU
    variant that both compute in fp32 (fp64 for float64) and round each
    output once: ``storage_ulps`` x the unit roundoff of the storage dtype
    times the value, plus ``math_ulps`` x the math dtype's unit roundoff times
    the size of the terms (the activations' derivatives grow at most like
    1 + g^2), plus the smallest normal. ``clamp``: size the terms from the
    clamped gate and up (the variant's limit), as the math sees them."""
    spec = resolve_activation(activation)
    dtype = x12.dtype
    ulp = storage_ulps * UNIT_ROUNDOFF[dtype]
    eps = math_ulps * UNIT_ROUNDOFF[torch.float64 if dtype == torch.float64 else torch.float32]
    g, u = split_gate_up(x12.double(), spec)
    if clamp and spec.limit is not None:
        g, u = g.clamp(max=spec.limit), u.clamp(-spec.limit, spec.limit)
    u = u.abs() + abs(spec.up_offset)
    d = dh.double().abs()
    grow = 1 + g * g
    tiny = torch.finfo(dtype).tiny
    h_bound = ref_h.double().abs() * ulp + eps * grow * u + tiny
    terms = [d * u * grow, d * grow]
    dx_terms = torch.stack(terms, 2).view_as(x12) if spec.interleaved else torch.cat(terms, 1)
    return h_bound, ref_dx12.double().abs() * ulp + eps * dx_terms + tiny
