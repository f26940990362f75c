"""Exact live-bytes accounting of a call, on any device (the CPU included):
every storage an ATen op creates while the mode is active, when it is freed,
and the peak of their sum. Deterministic: it counts tensor storages, not an
allocator's blocks, so the same call gives the same figures on every run.

    with LiveBytes() as live:
        y = mlp(x); y.backward(dy)
    live.peak_bytes(), live.largest()

A storage is new when an op returns it and none of the op's inputs holds it
(views, ``out=`` and in-place results are not allocations); it is freed when
its last tensor goes (a ``weakref.finalize`` on the storage object, which
torch keeps for as long as the storage lives). Storages made before the mode
(inputs, weights) are never counted. ``exclude=`` replays the timeline
without some storages (the outputs and weight gradients of a comparison).
Storage resizes are followed. Memory that no ATen op allocates (a BLAS
library's private workspace, CuPy's pool) is not seen.
"""
from __future__ import annotations

import dataclasses
import weakref

import torch

from .._torch_compat import dispatch_mode_base

TorchDispatchMode, tree_leaves = dispatch_mode_base()

__all__ = ["LiveBytes", "Allocation"]


@dataclasses.dataclass
class Allocation:
    """One storage created during the call: the op that made it, the first
    tensor's shape and dtype, its bytes, and whether it was freed."""
    op: str
    shape: tuple
    dtype: torch.dtype
    nbytes: int
    freed: bool = False


def _storage(t: torch.Tensor):
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # tensors without storage (e.g. some subclasses)
        return None


class LiveBytes(TorchDispatchMode):
    """The dispatch mode recording allocations (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.allocations: list[Allocation] = []
        self._events: list[tuple[int, int]] = []   # (allocation index, byte delta), in order
        # live tracked storages, by StorageImpl address (reused once freed): (allocation index, bytes now)
        self._by_key: dict[int, tuple[int, int]] = {}
        self._finalizers: list[weakref.finalize] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {s._cdata for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)
                  and (s := _storage(a)) is not None}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or (st := _storage(t)) is None:
                continue
            key, nbytes = st._cdata, st.nbytes()
            if key in self._by_key:  # a tracked storage: follow a resize
                index, before = self._by_key[key]
                if nbytes != before:
                    self._by_key[key] = (index, nbytes)
                    self.allocations[index].nbytes = max(self.allocations[index].nbytes, nbytes)
                    self._events.append((index, nbytes - before))
            elif key not in inputs:
                index = len(self.allocations)
                self.allocations.append(Allocation(str(func), tuple(t.shape), t.dtype, nbytes))
                self._by_key[key] = (index, nbytes)
                self._events.append((index, nbytes))
                self._finalizers.append(weakref.finalize(st, self._freed, key))
        return out

    def _freed(self, key: int) -> None:
        index, nbytes = self._by_key.pop(key)
        self.allocations[index].freed = True
        self._events.append((index, -nbytes))

    def __exit__(self, *exc):
        super().__exit__(*exc)
        return False

    def _live_indices(self, tensors) -> set:
        """Allocation indices of the (live) storages of ``tensors``; None and untracked ones skipped."""
        keys = {st._cdata for t in tensors if t is not None and (st := _storage(t)) is not None}
        return {self._by_key[k][0] for k in keys if k in self._by_key}

    def peak_bytes(self, exclude=()) -> int:
        """The largest sum of live tracked bytes at any point, without the
        storages of the tensors in ``exclude`` (alive at the end: their keys
        are still theirs)."""
        skip = self._live_indices(exclude)
        live = peak = 0
        for index, delta in self._events:
            if index not in skip:
                live += delta
                peak = max(peak, live)
        return peak

    def live_bytes(self) -> int:
        """Tracked bytes still alive now."""
        return sum(nbytes for _, nbytes in self._by_key.values())

    def largest(self, exclude=()) -> Allocation | None:
        """The largest single allocation, without the storages of ``exclude``."""
        skip = self._live_indices(exclude)
        kept = [rec for i, rec in enumerate(self.allocations) if i not in skip]
        return max(kept, key=lambda rec: rec.nbytes, default=None)
