"""Routing: tokens to expert-grouped rows and back (``sort_by_expert``, the
deterministic dispatch/combine Functions), and ``routed_experts``, the
experts feed-forward from a router's top-k choice (``grouped`` does the
experts' work)."""
from __future__ import annotations

import torch

from .. import _validation as check
from .._autograd import LeanApplyFunction
from ..activations import GLUActivation, resolve_activation
from .grouped import run_experts

__all__ = ["routed_experts", "sort_by_expert", "route_and_combine"]


def sort_by_expert(top_k_index: torch.Tensor, num_experts: int):
    """Group the routed rows by expert: ``(perm, offsets)`` with ``perm`` [T*K]
    the flat (token, slot) indices in expert order (stable) and ``offsets``
    [E] int32 cumulative ends. Ids >= num_experts (expert-parallel sentinels)
    sort to the tail, past ``offsets[-1]``. No host synchronisation."""
    ids = top_k_index.reshape(-1)
    sorted_ids, perm = torch.sort(ids, stable=True)
    # histc, as Hugging Face's grouped_mm experts: bincount breaks CUDA graphs; CPU histc takes floats only.
    hist_in = sorted_ids.float() if sorted_ids.device.type in ("cpu", "mps") else sorted_ids.int()
    counts = torch.histc(hist_in, bins=num_experts, min=0, max=num_experts - 1)
    return perm, torch.cumsum(counts, 0, dtype=torch.int32)


def _sum_per_token(rows: torch.Tensor, inv_perm: torch.Tensor, K: int, dtype: torch.dtype) -> torch.Tensor:
    """[T, D]: each token's K rows (``rows`` in expert order) summed in a fixed
    order in fp32 (float64 for float64), rounded once to ``dtype``."""
    acc = torch.promote_types(rows.dtype, torch.float32)
    out = rows.index_select(0, inv_perm).view(-1, K, rows.shape[1]).sum(1, dtype=acc)
    # No no-op .to(): torch 2.11's torch.compile gives an autograd.Function whose
    # forward returns such a self-alias (.to(same dtype), .contiguous()) zero gradients.
    return out if out.dtype == dtype else out.to(dtype)


class _Dispatch(LeanApplyFunction):
    """``hidden[token]``: each routed row's token, in expert order. Backward
    sums each token's K row gradients in a fixed order (a gather, no
    scatter-add: deterministic on every device). Saves the two index vectors."""

    @staticmethod
    def forward(hidden, token, inv_perm, K):
        return hidden.index_select(0, token)

    @staticmethod
    def setup_context(ctx, inputs, output):
        hidden, token, inv_perm, K = inputs
        ctx.save_for_backward(inv_perm)
        ctx.K, ctx.dtype = K, hidden.dtype

    @staticmethod
    def backward(ctx, d_rows):
        (inv_perm,) = ctx.saved_tensors
        return _sum_per_token(d_rows, inv_perm, ctx.K, ctx.dtype), None, None, None


class _Combine(LeanApplyFunction):
    """The adjoint of ``_Dispatch``: each token's K expert rows summed
    (``_sum_per_token``); backward gathers each row's token gradient."""

    @staticmethod
    def forward(rows, token, inv_perm, K, dtype):
        return _sum_per_token(rows, inv_perm, K, dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        rows, token, inv_perm, K, dtype = inputs
        ctx.save_for_backward(token)
        ctx.dtype = rows.dtype

    @staticmethod
    def backward(ctx, dy):
        (token,) = ctx.saved_tensors
        return dy.index_select(0, token).to(ctx.dtype), None, None, None, None


def route_and_combine(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights, w12, b12, w3, b3,
                      activation: GLUActivation, transposed: bool, recompute_gate_up: bool, sentinels: bool,
                      post_expert=None, saved_x12_fp8: bool = False) -> torch.Tensor:
    """Token-level experts: sort the T*K routed rows by expert, run the
    experts, and sum each token's K rows in a fixed order in fp32 (or
    float64), rounded once to the input's dtype. With ``sentinels``, ids >= E
    contribute zero (and no router gradient). ``post_expert`` (a module
    applied to each row's unweighted output, e.g. a post-expert norm) moves
    the routing weights after it. ``saved_x12_fp8``: x12 saved in 8 bits."""
    K = top_k_index.shape[-1]
    E = w12.shape[0]
    perm, offsets = sort_by_expert(top_k_index, E)
    token = perm // K
    inv_perm = torch.empty_like(perm)
    inv_perm[perm] = torch.arange(perm.shape[0], device=perm.device)
    x_sorted = _Dispatch.apply(hidden_states, token, inv_perm, K)
    rw = None
    if top_k_weights is not None:
        rw = top_k_weights.reshape(-1).index_select(0, perm)
        if sentinels:  # the mask keeps them out of the router gradient
            rw = rw.masked_fill(top_k_index.reshape(-1).index_select(0, perm) >= E, 0)
    y = run_experts(x_sorted, offsets, w12, b12, w3, b3, None if post_expert is not None else rw, activation,
                    transposed, recompute_gate_up, sentinels, saved_x12_fp8)
    if post_expert is not None:
        y = post_expert(y)
        if rw is not None:
            y = y * rw.unsqueeze(1)
        if sentinels:
            y = y.masked_fill((torch.arange(y.shape[0], device=y.device) >= offsets[-1]).unsqueeze(1), 0)
    return _Combine.apply(y, token, inv_perm, K, hidden_states.dtype)


def routed_experts(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor | None,
                   w12: torch.Tensor, w3: torch.Tensor, b12: torch.Tensor | None = None,
                   b3: torch.Tensor | None = None, *, activation="silu", transposed: bool = False,
                   recompute_gate_up: bool = False, saved_x12=None) -> torch.Tensor:
    """Mixture-of-experts feed-forward from a router's top-k choice: ``[..., D]``.

    ``top_k_index`` [..., K] (integer expert ids in [0, E)) and
    ``top_k_weights`` [..., K] (or None: unweighted) are the router's output
    for ``hidden_states`` [..., D]. Each token's K expert outputs are weighted
    and summed in a fixed order in fp32 (deterministic), rounded once to
    ``hidden_states.dtype``. The ids are checked with one host copy of their
    min and max. Weights, activation and ``saved_x12``: as ``grouped_experts``.
    """
    check.reject_jit()
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() < 1:
        raise ValueError("hidden_states must be a tensor [..., D]")
    E, _ = check.check_expert_weights("hidden_states", hidden_states, w12, w3, b12, b3, transposed)
    check.check_flags(recompute_gate_up=recompute_gate_up)
    fp8 = check.check_saved_x12(saved_x12, recompute_gate_up)
    spec = resolve_activation(activation)
    lead = tuple(hidden_states.shape[:-1])
    if not isinstance(top_k_index, torch.Tensor) or top_k_index.dim() != len(lead) + 1 \
            or tuple(top_k_index.shape[:-1]) != lead:
        shape = tuple(top_k_index.shape) if isinstance(top_k_index, torch.Tensor) else type(top_k_index).__name__
        raise ValueError(f"top_k_index must have shape {lead} + (K,) (hidden_states' leading dims), got {shape}")
    if top_k_index.device != hidden_states.device:
        raise ValueError(f"top_k_index must be on the device of hidden_states ({hidden_states.device}), "
                         f"got {top_k_index.device}")
    check.check_expert_ids("top_k_index", top_k_index, E)
    check.check_routing_weights("top_k_weights", top_k_weights, tuple(top_k_index.shape), hidden_states)
    D = hidden_states.shape[-1]
    out = route_and_combine(hidden_states.reshape(-1, D), top_k_index.reshape(-1, top_k_index.shape[-1]),
                            top_k_weights, w12, b12, w3, b3, spec, transposed, recompute_gate_up, False,
                            saved_x12_fp8=fp8)
    return out.view(hidden_states.shape)
