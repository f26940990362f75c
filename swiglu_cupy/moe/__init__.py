"""Mixture-of-experts: the GLU feed-forward of E experts.

- ``grouped_experts(x_sorted, offsets, w12, w3, ...)``: rows already grouped by expert;
- ``grouped_experts_unpacked(x_sorted, offsets, w1, w2, w3, ...)``: the same with separate
  gate/up weights (never concatenated);
- ``routed_experts(hidden_states, top_k_index, top_k_weights, w12, w3, ...)``: from a router's top-k;
- ``sort_by_expert``: the grouping; ``experts_reference``: the slow reference;
- ``MoEExpertsFunction``: the apply-only autograd Function under both.

Layouts and the saved tensors: ``swiglu_cupy.moe.grouped``.
"""
from ..reference import experts_reference
from .grouped import MoEExpertsFunction, grouped_experts, grouped_experts_unpacked
from .routing import routed_experts, sort_by_expert

__all__ = ["grouped_experts", "grouped_experts_unpacked", "routed_experts", "MoEExpertsFunction", "experts_reference", "sort_by_expert"]
