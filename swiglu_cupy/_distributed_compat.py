"""Every private ``torch.distributed`` API that :mod:`swiglu_cupy.parallel` uses, in one place.

Each entry says, in one line, what breaks if torch changes it.
``tests/test_distributed_compat.py`` checks each entry against the installed
torch by behaviour (DCP really calls the protocol methods, FSDP2 really
reports the placement it chose, ...), with a message naming the entry.
Checked with torch 2.11 and 2.13.

Nothing here is imported by the core op. The DCP classes are imported when a
state dict is first saved or loaded, the FSDP2 ones only for a module that
``fully_shard`` manages (FSDP2 is loaded by then).

Only torch's own APIs live here: what the package knows of other training
engines lives in each engine's module under :mod:`swiglu_cupy.integrations`.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ParallelStyle

# Rows split into `split_factor` equal blocks, each block sharded over the mesh
# dim. If changed: this import fails, or full_tensor() of a TP w12 stops being
# the canonical [gate; up] (tests: strided shard layout). torch 2.11 shards and
# computes with it, but its redistribute (full_tensor()) raises ValueError for
# a 1-D _StridedShard; torch 2.13 gathers it.
from torch.distributed.tensor.placement_types import _StridedShard as StridedShard

__all__ = ["StridedShard", "is_plain_shard", "is_strided_shard", "rewrap_dtensor", "TensorParallelStyle",
           "RowChunkCheckpointable", "fsdp_managed", "fsdp_shard_placement_of"]


def is_strided_shard(placement, dim: int | None = None) -> bool:
    return isinstance(placement, StridedShard) and (dim is None or placement.dim == dim)


def is_plain_shard(placement, dim: int | None = None) -> bool:
    """A ``Shard`` that is not strided (``_StridedShard`` was a ``Shard``
    subclass in older torch; it is not in 2.11)."""
    return (isinstance(placement, Shard) and not isinstance(placement, StridedShard)
            and (dim is None or placement.dim == dim))


def rewrap_dtensor(cls: type, dt: DTensor, local: torch.Tensor) -> DTensor:
    """``local`` as an instance of the DTensor subclass ``cls``, with ``dt``'s
    mesh, placements, shape and stride; it does not require grad."""
    # DTensor(local, spec, requires_grad=) and DTensor._spec: DTensor.from_local
    # always returns a DTensor, not a subclass. If changed: state_dict() of a TP
    # module fails here (tests: DTensor subclass construction).
    return cls(local, dt._spec, requires_grad=False)


class TensorParallelStyle(ParallelStyle):
    """A ``ParallelStyle`` whose subclasses implement ``parallelize(module,
    device_mesh)``."""

    # parallelize_module(module, mesh, style) sets style.src_data_rank, then
    # calls the abstract ParallelStyle._apply. If renamed: the style cannot be
    # instantiated (abstract) or parallelize_module skips it (tests: ParallelStyle._apply).
    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        return self.parallelize(module, device_mesh)

    def parallelize(self, module: nn.Module, device_mesh) -> nn.Module:
        raise NotImplementedError


class RowChunkCheckpointable:
    """Mixin for a tensor (a DTensor subclass) whose local rows are several
    contiguous chunks of the global tensor, for ``torch.distributed.checkpoint``.

    A subclass sets ``_dcp_row_blocks``: ``(global_offsets, local_row,
    n_rows)`` per chunk, in local order; the other dims of a chunk are the
    whole local extent. DCP writes each chunk from, and reads each chunk into,
    a row view of the local tensor, so loading fills it in place.
    """

    _dcp_row_blocks: list[tuple[tuple[int, ...], int, int]]

    def _dcp_local(self) -> torch.Tensor:
        with torch.no_grad():  # to_local() is then the local tensor itself, not an autograd view
            return self.to_local()

    # The three methods below are DCP's private _Checkpointable protocol, looked
    # up with hasattr by its planner helpers (save plan, load plan) and by
    # find_tensor_shard (data). If DCP stops calling them, it treats this as a
    # DTensor with one chunk per rank: save fails with overlapping chunks, or
    # loads rows into the wrong places (tests: DCP _Checkpointable protocol).
    def __create_write_items__(self, fqn: str, object) -> list:
        # Public DCP planner classes, imported here so that importing
        # swiglu_cupy.parallel does not load DCP.
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        properties = TensorProperties.create_from_tensor(self._dcp_local())
        return [WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=chunk, properties=properties, size=self.size()))
                for chunk in self.__create_chunk_list__()]

    def __create_chunk_list__(self) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        rest = tuple(self._dcp_local().shape[1:])
        return [ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size((n_rows, *rest)))
                for offsets, _, n_rows in self._dcp_row_blocks]

    def __get_tensor_shard__(self, index) -> torch.Tensor:
        for offsets, local_row, n_rows in self._dcp_row_blocks:
            if index.offset is not None and tuple(index.offset) == tuple(offsets):
                return self._dcp_local().narrow(0, local_row, n_rows)
        raise ValueError(f"no local chunk of {index.fqn} starts at {index.offset}; "
                         f"local row blocks {self._dcp_row_blocks}")


def fsdp_managed(module: nn.Module) -> bool:
    """Whether FSDP2's ``fully_shard`` manages ``module``'s parameters
    (``module`` or one of its ancestors was passed to it)."""
    # fully_shard sets this flag on every module it manages, after sharding.
    # If renamed: the first-forward check of the FSDP2 layout never runs, and
    # only state_dict() refuses a wrong layout (tests: FSDP2 internals).
    return bool(getattr(module, "_is_fsdp_managed_module", False))


def fsdp_shard_placement_of(module: nn.Module, name: str) -> Shard | None:
    """The ``Shard`` placement along which ``fully_shard`` split the data-
    parallel shards of ``module.<name>`` (``shard_placement_fn``'s answer, or
    its default ``Shard(0)``); None when no FSDP2 state manages it.

    Looks through every FSDP2 state, so it finds the parameter whether
    ``fully_shard`` was applied to ``module``'s owner or to an ancestor."""
    # FSDP2's state objects, their parameter groups and FSDPParam's
    # _module_info and fsdp_placement. If changed: this raises AttributeError
    # or ImportError at the first forward of a TP module under FSDP2
    # (tests: FSDP2 internals).
    from torch.distributed._composable_state import _module_state_mapping
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    seen = set()
    for state_ref in list(_module_state_mapping.values()):
        state = state_ref()
        if not isinstance(state, FSDPState) or id(state) in seen:
            continue
        seen.add(id(state))
        for group in _fsdp_param_groups(state):
            for fsdp_param in group.fsdp_params:
                info = fsdp_param._module_info
                owners = zip((info.module, *info.shared_modules), (info.param_name, *info.shared_param_names))
                if any(owner is module and param_name == name for owner, param_name in owners):
                    return fsdp_param.fsdp_placement
    return None


def _fsdp_param_groups(state) -> list:
    # torch 2.11 holds one group (or None) in _fsdp_param_group; later
    # versions a list in _fsdp_param_groups.
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = state._fsdp_param_group
    return [] if group is None else [group]
