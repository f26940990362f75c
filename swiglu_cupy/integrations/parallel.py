"""Tensor parallelism for :class:`~swiglu_cupy.SwiGLU`: ``SwiGLUTensorParallel``.

    from torch.distributed.tensor.parallel import parallelize_module
    from swiglu_cupy.parallel import SwiGLUTensorParallel

    parallelize_module(mlp, tp_mesh, SwiGLUTensorParallel())          # one block
    parallelize_module(model, tp_mesh, {"blocks.0.mlp": SwiGLUTensorParallel(sequence_parallel=True)})

Sharding over a 1-D mesh of size ``tp`` (H = hidden_features, H % tp == 0):

- ``w12.weight`` ``[2H, D]``: rank r holds the gate rows **and** the up rows
  of hidden slice r, packed as ``[gate_r; up_r]`` (H/tp rows each). As a
  DTensor it is ``_StridedShard(0, split_factor=2)``, so ``full_tensor()`` is
  the canonical ``[gate; up]`` of the unsharded module. (A plain
  ``Shard(0)`` - what ``ColwiseParallel`` does - would give rank 0 only gate
  rows and rank 1 only up rows: silently wrong.)
- ``w12.bias`` ``[2H]``: replicated; each rank reads its ``[gate_r; up_r]``
  slice (2H/tp values) and its grad is summed over the ranks. (A strided
  bias could not be sharded again by FSDP2 along any dim with a correct
  DTensor layout: see :func:`fsdp_shard_placement`.)
- ``w3.weight`` ``[O, H]``: ``Shard(1)``, the matching columns.
- ``w3.bias``: replicated, added once, after the reduction.

With FSDP2 on top (2-D), pass ``shard_placement_fn=fsdp_shard_placement`` to
``fully_shard``. Without it, FSDP2 splits ``w12.weight`` along dim 0 into
pieces that it labels with a wrong layout, so the first (eager) forward
raises a ``ValueError`` that names the fix.

Forward runs the fused op on the local shards (no weight copies; only the
2H/tp bias values are gathered): the input
is replicated (or all-gathered from sequence shards), each rank computes its
partial ``[..., O]`` output, and the partial outputs are all-reduced (or
reduce-scattered back to sequence shards). The collectives are DTensor
redistributions, so ``torch.compile`` can trace them.

Checkpoints: in ``state_dict()`` the packed ``w12.weight`` is a DTensor that
describes its local rows to ``torch.distributed.checkpoint`` as contiguous
chunks of the canonical global tensor (the gate chunk at row ``r*H/tp``, the
up chunk at row ``H + r*H/tp``), so DCP stores the canonical ``[2H, D]`` and
reshards it on load like any other tensor.

The private torch APIs this relies on (``_StridedShard``, DCP's chunk
protocol, FSDP2's state) are in :mod:`swiglu_cupy._distributed_compat`.
"""
from __future__ import annotations

import copy
import warnings

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
)

from .. import _distributed_compat as compat
from .._validation import reject_dtensors
from ..dense.api import swiglu
from ..dense.module import SwiGLU

__all__ = ["SwiGLUTensorParallel", "fsdp_shard_placement", "reject_distributed_weights"]

# Packed [gate; up] rows split into 2 halves, each sharded over the mesh.
PACKED_ROWS = compat.StridedShard(0, split_factor=2)

# torch 2.11's DTensor reads every _StridedShard as an encoded shard order and
# cannot redistribute PACKED_ROWS (full_tensor() of w12 or its grad raises);
# 2.12 falls back to plain strided-shard transforms.
MIN_TORCH = (2, 12)


def _torch_release() -> tuple[int, ...]:
    return tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


def reject_distributed_weights(**weights) -> None:
    """Raise a TypeError if a weight passed to the fused op is a DTensor.

    The fused op runs on local tensors. A DTensor ``w12`` means the block was
    sharded by a generic style (``ColwiseParallel`` on ``w12``, an HF
    ``tp_plan``): a contiguous row shard of the packed ``[gate; up]`` puts gate
    rows on some ranks and up rows on others, which no local computation can
    fix. The op's own argument checks run this too.
    """
    reject_dtensors(**weights)


def fsdp_shard_placement(param: nn.Parameter) -> Shard | None:
    """``shard_placement_fn`` for ``fully_shard`` on top of
    :class:`SwiGLUTensorParallel`: the packed ``w12.weight`` is sharded over
    the data-parallel mesh along dim 1 (D must be divisible by its size),
    every other parameter along dim 0 (FSDP2's default).

    Along dim 0, FSDP2 would cut this rank's ``[gate_r; up_r]`` into
    contiguous pieces, whose global rows no DTensor placement can describe
    for more than 2 data-parallel ranks (and FSDP2 mislabels them for 2);
    along dim 1 the placements are simply ``(Shard(1), _StridedShard(0, 2))``.
    """
    if isinstance(param, DTensor) and any(compat.is_strided_shard(p, 0) for p in param.placements):
        return Shard(1)
    return None


# ----------------------------------------------------------------------------
# DCP: packed parameters as chunks of the canonical global tensor

def _global_ids(dt: DTensor, dim: int) -> list[int]:
    """The global indices, along ``dim``, of ``dt``'s local tensor: an arange
    sharded with the same mesh and the placements that split ``dim`` (no
    communication). Works for any mix of Shard, _StridedShard and Replicate,
    e.g. FSDP2's 2-D (dp, tp) placements."""
    placements = [compat.StridedShard(0, split_factor=p.split_factor) if compat.is_strided_shard(p, dim)
                  else Shard(0) if compat.is_plain_shard(p, dim)
                  else Replicate() for p in dt.placements]
    return distribute_tensor(torch.arange(dt.shape[dim]), dt.device_mesh, placements,
                             src_data_rank=None).to_local().tolist()


def _local_blocks(dt: DTensor) -> list[tuple[tuple[int, ...], int, int]]:
    """``(global_offsets, local_row, n_rows)`` for each run of consecutive
    global rows in ``dt``'s local tensor, in local order; the other dims must
    each hold one contiguous range (plain Shard or Replicate)."""
    col_offsets = []
    for dim in range(1, dt.dim()):
        ids = _global_ids(dt, dim)
        if ids and ids != list(range(ids[0], ids[0] + len(ids))):
            raise ValueError(f"expected a contiguous range along dim {dim}, got placements "
                             f"{tuple(dt.placements)}")
        col_offsets.append(ids[0] if ids else 0)
    rows, blocks, start = _global_ids(dt, 0), [], 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or rows[i] != rows[i - 1] + 1:
            blocks.append(((rows[start], *col_offsets), start, i - start))
            start = i
    return blocks


class _RowChunkedDTensor(compat.RowChunkCheckpointable, DTensor):
    """The same DTensor (same local storage, mesh and placements) that tells
    DCP its local rows are several chunks of the global tensor.

    DTensor's own DCP methods assume one contiguous chunk per rank, which a
    strided shard is not ("overlapping chunks" at save). The mixin supplies
    DCP's protocol from ``_dcp_row_blocks``; everything else is plain DTensor
    (``full_tensor()`` is canonical)."""

    @staticmethod
    def wrap(dt: DTensor) -> _RowChunkedDTensor:
        out = compat.rewrap_dtensor(_RowChunkedDTensor, dt, dt.to_local().detach())
        out._dcp_row_blocks = _local_blocks(dt)
        return out

    def __deepcopy__(self, memo):  # copy.deepcopy(model.state_dict())
        out = compat.rewrap_dtensor(_RowChunkedDTensor, self, copy.deepcopy(self._dcp_local(), memo))
        out._dcp_row_blocks = list(self._dcp_row_blocks)
        return out


_FSDP_DIM0_FIX = ("Pass shard_placement_fn=swiglu_cupy.parallel.fsdp_shard_placement to fully_shard: it "
                  "shards the packed weight along dim 1 instead.")


def _state_dict_hook(module, state_dict, prefix, local_metadata) -> None:
    value = state_dict.get(prefix + "w12.weight")
    if not isinstance(value, DTensor) or isinstance(value, _RowChunkedDTensor):
        return
    strided = [p for p in value.placements if compat.is_strided_shard(p)]
    if len(strided) > 1:
        # fully_shard's default dim-0 shard of a packed [gate_r; up_r] shard
        # (before the first forward, which would have refused it): the data is
        # right, but no DTensor placement describes it.
        raise ValueError(
            f"{prefix}w12.weight was sharded by FSDP2 along dim 0 on top of SwiGLUTensorParallel "
            f"(placements {tuple(value.placements)}), so its full_tensor() and state_dict would be "
            f"permuted. {_FSDP_DIM0_FIX}")
    if strided:
        state_dict[prefix + "w12.weight"] = _RowChunkedDTensor.wrap(value)


def _load_state_dict_pre_hook(module, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs) -> None:
    """A full, plain tensor (e.g. from ``torch.load`` of an unparallelized
    checkpoint, present on every rank) is sharded like the parameter it goes
    into; DTensors load as they are."""
    for name, param in module.named_parameters():
        value = state_dict.get(prefix + name)
        if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            if tuple(value.shape) != tuple(param.shape):
                continue  # load_state_dict reports the size mismatch
            state_dict[prefix + name] = distribute_tensor(
                value.to(param.device, param.dtype), param.device_mesh, param.placements,
                src_data_rank=None)


# ----------------------------------------------------------------------------
# the style

def _check_fsdp_layout(module) -> None:
    """Refuse, at the first forward under FSDP2, a packed ``w12.weight``
    that ``fully_shard`` split along dim 0 (its default).

    Training would run, but the split cuts each rank's ``[gate_r; up_r]``
    into pieces that FSDP2 labels with a DTensor layout they do not have:
    ``full_tensor()`` of the weight and of its gradient, and the state dict,
    would come out permuted. In forward FSDP2 has swapped in the unsharded
    parameter, so the placement it chose is read from its state. Runs until
    FSDP2 manages the module (it may be applied after a first forward), then
    once."""
    if not compat.fsdp_managed(module.w12):
        return
    try:
        placement = compat.fsdp_shard_placement_of(module.w12, "weight")
    except (AttributeError, ImportError) as e:  # FSDP2's internals changed
        warnings.warn(f"swiglu_cupy could not read FSDP2's sharding of w12.weight on torch "
                      f"{torch.__version__} ({e!r}); check that fully_shard got "
                      "shard_placement_fn=swiglu_cupy.parallel.fsdp_shard_placement", stacklevel=3)
        placement = None
    if placement is not None and placement.dim == 0 and module._tp_mesh.size() > 1:
        raise ValueError(
            "swiglu_cupy: fully_shard sharded the packed w12.weight of a SwiGLUTensorParallel block "
            "along dim 0 (its default), which cuts each rank's [gate_r; up_r] rows into pieces that "
            "no DTensor layout describes: full_tensor() of the weight and its gradient, and the "
            f"state dict, would be permuted. {_FSDP_DIM0_FIX}")
    module._tp_fsdp_checked = True


class _TensorParallelForward:
    """Mixed into the SwiGLU's class by :class:`SwiGLUTensorParallel` (as
    FSDP2 does with its own class): the forward on local shards."""

    def forward(self, x):
        if not self._tp_fsdp_checked and not torch.compiler.is_compiling():
            _check_fsdp_layout(self)
        mesh, seq_dim = self._tp_mesh, self._tp_sequence_dim
        if seq_dim is not None:
            dim = seq_dim + x.dim() if seq_dim < 0 else seq_dim
            if not 0 <= dim < x.dim() - 1:
                raise ValueError(f"sequence_dim={seq_dim} must index a non-feature dim of the input, "
                                 f"got an input of shape {tuple(x.shape)}")
            layout = [Shard(dim)]
        else:
            layout = [Replicate()]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, layout, run_check=False)
        # All-gather sequence shards; in backward the local dx is a partial
        # sum (this rank's hidden slice), reduced back to the input layout.
        x_local = x.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
        b12 = self.w12.bias
        if b12 is not None:
            # Replicated [2H]: this rank's [gate_r; up_r] slice (2H/tp values);
            # its grad covers only that slice, summed over the ranks.
            b12 = b12.to_local(grad_placements=[Partial()])
            b12 = torch.cat([b12[rows] for rows in self._tp_bias_rows])
        y = swiglu(x_local, self.w12.weight.to_local(), b12, self.w3.weight.to_local(), None,
                   activation=self.activation, recompute_gate_up=self.recompute_gate_up,
                   inplace_backward=self.inplace_backward, saved_x12=self.saved_x12,
                   tile_rows=self.tile_rows, tile_grads_fp32=self.tile_grads_fp32)
        y = DTensor.from_local(y, mesh, [Partial()], run_check=False).redistribute(mesh, layout)
        b3 = self.w3.bias  # added once, to the reduced output
        if not self._tp_use_local_output:
            return y if b3 is None else y + b3
        # A fresh tensor, never a view (to_local() returns one; FSDP2 warns
        # about views): the bias add makes it, else a copy.
        if b3 is None:
            return y.to_local().clone()
        # This rank's tokens contribute a partial sum to b3's grad when the
        # output is sequence-sharded; with a replicated output every rank
        # sees all tokens.
        return y.to_local() + b3.to_local(grad_placements=[Partial() if seq_dim is not None else Replicate()])


_TP_CLASSES: dict[type, type] = {}


def _tensor_parallel_class(cls: type) -> type:
    if cls not in _TP_CLASSES:
        _TP_CLASSES[cls] = type(f"TensorParallel{cls.__name__}", (_TensorParallelForward, cls), {})
    return _TP_CLASSES[cls]


class SwiGLUTensorParallel(compat.TensorParallelStyle):
    """Tensor-parallel style for a :class:`~swiglu_cupy.SwiGLU` (or a subclass
    of it), on a 1-D device mesh.

    Args:
        sequence_parallel: the input and output are sharded along
            ``sequence_dim`` (each rank holds an equal slice); the input is
            all-gathered before the block and the output reduce-scattered
            after it. Otherwise both are replicated.
        sequence_dim: the sharded dim of ``[batch, seq, D]`` inputs (default
            1, as in torchtitan); negative values count from the end.
        use_local_output: return a plain tensor (default) or a DTensor.
    """

    def __init__(self, *, sequence_parallel: bool = False, sequence_dim: int = 1,
                 use_local_output: bool = True) -> None:
        super().__init__()
        if _torch_release() < MIN_TORCH:
            raise RuntimeError(
                f"SwiGLUTensorParallel needs torch >= {'.'.join(map(str, MIN_TORCH))}, you have "
                f"{torch.__version__}: older DTensor cannot redistribute the packed w12 weight's "
                "_StridedShard placement, so full_tensor() of w12.weight and of its grad would fail.")
        for name, flag in (("sequence_parallel", sequence_parallel), ("use_local_output", use_local_output)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
        if isinstance(sequence_dim, bool) or not isinstance(sequence_dim, int):
            raise TypeError(f"sequence_dim must be an int, got {type(sequence_dim).__name__}")
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim
        self.use_local_output = use_local_output

    def __repr__(self) -> str:
        return (f"SwiGLUTensorParallel(sequence_parallel={self.sequence_parallel}, "
                f"sequence_dim={self.sequence_dim}, use_local_output={self.use_local_output})")

    def parallelize(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, SwiGLU):
            raise TypeError(f"SwiGLUTensorParallel applies to a swiglu_cupy.SwiGLU, got "
                            f"{type(module).__name__}")
        if device_mesh.ndim != 1:
            raise ValueError(f"SwiGLUTensorParallel needs a 1-D tensor-parallel mesh, got a "
                             f"{device_mesh.ndim}-D mesh {device_mesh}; pass e.g. mesh['tp']")
        tp, H = device_mesh.size(), module.hidden_features
        if H % tp:
            raise ValueError(f"hidden_features H={H} is not divisible by the tensor-parallel size "
                             f"{tp}: every rank must hold H/tp gate rows and H/tp up rows")
        for name, p in module.named_parameters():
            if isinstance(p, DTensor):
                raise ValueError(
                    f"{name} is already a DTensor (placements {tuple(p.placements)}): the module was "
                    "parallelized before (ColwiseParallel/RowwiseParallel, an HF tp_plan, or "
                    "SwiGLUTensorParallel twice). Apply SwiGLUTensorParallel once, to the "
                    "unparallelized module.")
        # Interleaved rows [g0, u0, g1, u1, ...] shard by whole pairs: a plain row shard.
        interleaved = module.activation.interleaved
        placements = {"w12.weight": Shard(0) if interleaved else PACKED_ROWS, "w12.bias": Replicate(),
                      "w3.weight": Shard(1), "w3.bias": Replicate()}
        for name, placement in placements.items():
            linear, attr = getattr(module, name.split(".")[0]), name.split(".")[1]
            p = getattr(linear, attr)
            if p is None:
                continue
            dt = distribute_tensor(p.detach(), device_mesh, [placement], src_data_rank=self.src_data_rank)
            setattr(linear, attr, nn.Parameter(dt, requires_grad=p.requires_grad))
        module._tp_mesh = device_mesh
        rows, rank = H // tp, device_mesh.get_local_rank()
        module._tp_bias_rows = ((slice(2 * rank * rows, 2 * (rank + 1) * rows),) if interleaved else
                                (slice(rank * rows, (rank + 1) * rows), slice(H + rank * rows, H + (rank + 1) * rows)))
        module._tp_sequence_dim = self.sequence_dim if self.sequence_parallel else None
        module._tp_use_local_output = self.use_local_output
        module._tp_fsdp_checked = False
        module.__class__ = _tensor_parallel_class(type(module))
        module.register_state_dict_post_hook(_state_dict_hook)
        module.register_load_state_dict_pre_hook(_load_state_dict_pre_hook)
        return module
