"""Routing: tokens to expert-grouped rows and back (``sort_by_expert``; the
gathers themselves: ``tokens``), and ``routed_experts``, the experts
feed-forward from a router's top-k choice (``grouped`` does the experts'
work, on the tokens: each token's input is saved once)."""
from __future__ import annotations

import torch

from .. import _validation as check
from .._autograd import LeanApplyFunction
from ..activations import GLUActivation, resolve_activation
from .._tile_size import resolve_tile_rows, tile_slices
from .grouped import compute_dtype, expert_width, run_experts
from .tokens import TokenRows, index_dtype, sum_per_token

__all__ = ["routed_experts", "sort_by_expert", "sort_by_expert_in_tiles", "route_and_combine"]


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


def sort_by_expert_in_tiles(top_k_index: torch.Tensor, num_experts: int, tile: int):
    """``sort_by_expert`` for tiles of ``tile`` tokens: ``(perm, local_perm,
    offsets)``. The rows are grouped by tile, then by expert within each tile
    (stable; sentinel ids at the tile's end), so tile i's rows are
    ``[i*tile*K, (i+1)*tile*K)``. ``perm`` [T*K]: each row's slot; ``local_perm``
    the same counted from the tile's first slot; ``offsets`` [n_tiles, E] int32
    each tile's own cumulative group ends. One sort per tile, no host
    synchronisation, and no index arithmetic on ``arange`` (torch 2.13's
    Inductor on the CPU miscompiles ``arange(n) // c`` when n is not a multiple
    of its vector width: garbage in the last elements)."""
    T, K = top_k_index.shape
    local, offsets = zip(*(sort_by_expert(top_k_index[rows], num_experts) for rows in tile_slices(T, tile)))
    local = torch.cat(local)
    perm = torch.cat([p + rows.start * K for p, rows in zip(local.split(tile * K), tile_slices(T, tile))])
    return perm, local, torch.stack(offsets)


class _Combine(LeanApplyFunction):
    """Each token's K expert rows summed (``tokens.sum_per_token``); backward
    gathers each row's token gradient (the post-expert path's combine: the
    plain path sums inside the experts Function)."""

    @staticmethod
    def forward(rows, token, inv_perm, K, dtype):
        return sum_per_token(rows, inv_perm, K, dtype)

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
                      post_expert=None, saved_x12_fp8: bool = False, tile_rows=None,
                      tile_grads_fp32: bool = True) -> torch.Tensor:
    """Token-level experts: sort the T*K routed rows by expert, run the
    experts on the tokens (the Function gathers the rows, saves each token's
    input once, and sums each token's K rows in a fixed order in fp32, or
    float64, rounded once to the input's dtype). With ``sentinels``, ids >= E
    contribute zero (and no router gradient). ``post_expert`` (a module
    applied to each row's unweighted output, e.g. a post-expert norm) moves
    the routing weights and the sum after it. ``saved_x12_fp8``: x12 saved in 8 bits.
    ``tile_rows`` (None, an int or ``"auto"``: tokens per tile) runs the experts a
    tile of tokens at a time, so the routed intermediate is bounded by
    ``tile x K x 2I``; ``tile_grads_fp32`` as ``swiglu``'s."""
    K = top_k_index.shape[-1]
    E = w12.shape[0]
    T = hidden_states.shape[0]
    tile = resolve_tile_rows(tile_rows, T, K * expert_width(w12, transposed), compute_dtype(hidden_states))
    if tile:
        perm, expert_perm, offsets = sort_by_expert_in_tiles(top_k_index, E, tile)
    else:
        perm, offsets = sort_by_expert(top_k_index, E)
        expert_perm = perm
    expert_perm = expert_perm.to(index_dtype(perm.shape[0]))  # saved for backward: int32 is half the bytes
    slot_weights = None if top_k_weights is None else top_k_weights.reshape(-1)
    tiling = dict(tile=tile, tile_grads_fp32=tile_grads_fp32)
    if post_expert is None:
        return run_experts(hidden_states, offsets, w12, b12, w3, b3, slot_weights, activation, transposed,
                           recompute_gate_up, sentinels, expert_perm, K, hidden_states.dtype, saved_x12_fp8,
                           **tiling)
    tokens = TokenRows(perm, K)
    y = post_expert(run_experts(hidden_states, offsets, w12, b12, w3, b3, None, activation, transposed,
                                recompute_gate_up, sentinels, expert_perm, K, None, saved_x12_fp8, **tiling))
    if slot_weights is not None:
        y = y * tokens.slots_to_rows(slot_weights).unsqueeze(1)
    if sentinels:  # zero output there, so zero gradient for those rows' routing weights
        y = y.masked_fill(_sentinel_rows(offsets, y.shape[0], top_k_index, perm, E).unsqueeze(1), 0)
    return _Combine.apply(y, tokens.token, tokens.inverse, K, hidden_states.dtype)


def _sentinel_rows(offsets: torch.Tensor, rows: int, top_k_index, perm, num_experts: int) -> torch.Tensor:
    """[rows] bool: the sentinel-tail rows (past offsets[-1]; tiled: rows whose slot's id is a sentinel)."""
    if offsets.dim() == 1:
        return torch.arange(rows, device=offsets.device) >= offsets[-1]
    return top_k_index.reshape(-1).index_select(0, perm) >= num_experts


def routed_experts(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor | None,
                   w12: torch.Tensor, w3: torch.Tensor, b12: torch.Tensor | None = None,
                   b3: torch.Tensor | None = None, *, activation="silu", transposed: bool = False,
                   recompute_gate_up: bool = False, saved_x12=None, tile_rows=None,
                   tile_grads_fp32: bool = True) -> torch.Tensor:
    """Mixture-of-experts feed-forward from a router's top-k choice: ``[..., D]``.

    ``top_k_index`` [..., K] (integer expert ids in [0, E)) and
    ``top_k_weights`` [..., K] (or None: unweighted) are the router's output
    for ``hidden_states`` [..., D]. Each token's K expert outputs are weighted
    and summed in a fixed order in fp32 (deterministic), rounded once to
    ``hidden_states.dtype``. The ids are checked with one host copy of their
    min and max. Weights, activation and ``saved_x12``: as ``grouped_experts``.
    ``tile_rows`` (an int or ``"auto"``) runs the experts ``tile_rows`` tokens at a
    time, forward and backward, so no routed ``[tokens x K, 2I]`` intermediate
    exists (see ``route_and_combine``); ``tile_grads_fp32`` as ``swiglu``'s.
    """
    check.reject_jit()
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() < 1:
        raise ValueError("hidden_states must be a tensor [..., D]")
    E, _ = check.check_expert_weights("hidden_states", hidden_states, w12, w3, b12, b3, transposed)
    check.check_flags(recompute_gate_up=recompute_gate_up, tile_grads_fp32=tile_grads_fp32)
    check.check_tile_rows(tile_rows)
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
                            saved_x12_fp8=fp8, tile_rows=tile_rows, tile_grads_fp32=tile_grads_fp32)
    return out.view(hidden_states.shape)
