"""Token order and expert order on the routed path.

T tokens routed to K experts each have T*K slots (flat index ``t*K + k``,
the order of a router's top-k output). ``perm`` lists the slots in expert
order (``sort_by_expert``): routed row ``r`` is slot ``perm[r]``, of token
``perm[r] // K``. Every move between the two orders is a gather
(``index_select``), never a scatter-add, so it is deterministic on every
device; each token's K rows are summed in a fixed order in fp32.
"""
from __future__ import annotations

import torch

__all__ = ["TokenRows", "sum_per_token", "index_dtype"]


def index_dtype(n: int) -> torch.dtype:
    """The narrowest index dtype for ``n`` rows: int32 (half the bytes of
    int64 wherever an index is saved for backward), int64 past 2**31 - 1."""
    return torch.int32 if n < 2 ** 31 else torch.int64


def sum_per_token(rows: torch.Tensor, inv_perm: torch.Tensor, K: int, dtype: torch.dtype) -> torch.Tensor:
    """[T, N]: each token's K rows (``rows`` in expert order) summed in a fixed
    order in fp32 (float64 for float64), rounded once to ``dtype``."""
    per_token = rows.index_select(0, inv_perm).view(-1, K, rows.shape[1])
    if rows.dtype == dtype:
        # Without an fp32 copy of the rows: two rows take one add (computed in fp32,
        # rounded once; on the CPU several times faster than a sum over a dim of 2),
        # and torch's sum accumulates half precision in fp32 and rounds once (CPU and
        # CUDA). Both equal sum(dtype=float32).to(dtype) bit for bit (tests/test_moe.py).
        return torch.add(per_token[:, 0], per_token[:, 1]) if K == 2 else per_token.sum(1)
    out = per_token.sum(1, dtype=torch.promote_types(rows.dtype, torch.float32))
    # No no-op .to(): torch 2.11's torch.compile gives an autograd.Function whose
    # forward returns such a self-alias (.to(same dtype), .contiguous()) zero gradients.
    return out if out.dtype == dtype else out.to(dtype)


class TokenRows:
    """The T*K routed rows of T tokens in expert order, from ``perm`` [T*K]
    (any integer dtype) and K. The token index and the inverse permutation
    are derived on first use, so only ``perm`` needs to be kept."""

    def __init__(self, perm: torch.Tensor, top_k: int):
        self.perm = perm
        self.top_k = top_k
        self._token = None
        self._inverse = None

    @property
    def token(self) -> torch.Tensor:
        """[S]: the token of each row."""
        if self._token is None:
            self._token = self.perm // self.top_k
        return self._token

    @property
    def inverse(self) -> torch.Tensor:
        """[S]: the row of each slot (``inverse[perm[r]] == r``): distinct
        indices, so the one scatter is deterministic."""
        if self._inverse is None:
            inv = torch.empty_like(self.perm)
            inv[self.perm] = torch.arange(self.perm.shape[0], device=self.perm.device, dtype=self.perm.dtype)
            self._inverse = inv
        return self._inverse

    def gather(self, per_token: torch.Tensor) -> torch.Tensor:
        """[S, N]: each row's token's row of ``per_token`` [T, N]."""
        return per_token.index_select(0, self.token)

    def slots_to_rows(self, per_slot: torch.Tensor) -> torch.Tensor:
        """[S]: ``per_slot`` [T*K] (token order) in expert order."""
        return per_slot.index_select(0, self.perm)

    def rows_to_slots(self, per_row: torch.Tensor) -> torch.Tensor:
        """[T*K]: ``per_row`` [S] (expert order) back in token order."""
        return per_row.index_select(0, self.inverse)

    def sum_per_token(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[T, N]: each token's K rows of ``rows`` [S, N] summed (``sum_per_token``)."""
        return sum_per_token(rows, self.inverse, self.top_k, dtype)
