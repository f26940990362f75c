"""The private torch.distributed APIs behind swiglu_cupy._distributed_compat,
checked against the installed torch by what they do.

One test per entry of the compat module; each failure message starts with
the entry's name, so a torch upgrade that changes one says which. The DCP
protocol runs in this process (DCP without a process group); the DTensor and
FSDP2 entries run on 2 gloo ranks (tests/rank_launcher.py).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor, Shard

import rank_launcher
from swiglu_cupy import _distributed_compat as compat
from swiglu_cupy.integrations.parallel import MIN_TORCH

# torch older than SwiGLUTensorParallel's floor cannot full_tensor() a 1-D _StridedShard.
OLD_TORCH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < MIN_TORCH

WORLD = 2
RANK_TIMEOUT_S = 60


# ----------------------------------------------------------------------------
# DCP _Checkpointable protocol (one process)

class _Chunked(compat.RowChunkCheckpointable, torch.Tensor):
    """A plain tensor whose rows are stored out of global order; the row
    blocks say where each run of local rows belongs. Records which protocol
    methods DCP called."""

    calls: set

    @staticmethod
    def make(local: torch.Tensor, blocks) -> _Chunked:
        out = local.as_subclass(_Chunked)
        out._dcp_row_blocks, out.calls = blocks, set()
        return out

    def _dcp_local(self) -> torch.Tensor:
        return self.as_subclass(torch.Tensor)

    def __create_write_items__(self, fqn, object):
        self.calls.add("__create_write_items__")
        return super().__create_write_items__(fqn, object)

    def __create_chunk_list__(self):
        self.calls.add("__create_chunk_list__")
        return super().__create_chunk_list__()

    def __get_tensor_shard__(self, index):
        self.calls.add("__get_tensor_shard__")
        return super().__get_tensor_shard__(index)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, on purpose
def test_dcp_checkpointable_protocol(tmp_path):
    """dcp.save asks the object for its chunks and data, dcp.load asks it
    where to read each chunk into: the file holds the global row order,
    and loading fills the object's own storage, in its local order."""
    canonical = torch.arange(18.0).reshape(6, 3)
    order = [4, 5, 0, 1, 2, 3]  # local rows: global rows 4-5, then 0-1, then 2-3
    blocks = [((4, 0), 0, 2), ((0, 0), 2, 2), ((2, 0), 4, 2)]
    saved = _Chunked.make(canonical[order].clone(), blocks)
    dcp.save({"w": saved}, checkpoint_id=str(tmp_path), no_dist=True)
    what = "DCP _Checkpointable protocol"
    assert {"__create_write_items__", "__get_tensor_shard__"} <= saved.calls, (
        f"{what}: dcp.save no longer calls {sorted({'__create_write_items__', '__get_tensor_shard__'} - saved.calls)}")
    chunks = dcp.FileSystemReader(str(tmp_path)).read_metadata().state_dict_metadata["w"].chunks
    assert sorted((tuple(c.offsets), tuple(c.sizes)) for c in chunks) == [((0, 0), (2, 3)), ((2, 0), (2, 3)),
                                                                         ((4, 0), (2, 3))], f"{what}: {chunks}"
    plain = {"w": torch.zeros(6, 3)}
    dcp.load(plain, checkpoint_id=str(tmp_path), no_dist=True)
    assert torch.equal(plain["w"], canonical), f"{what}: the saved chunks are not in their global rows"

    loaded = _Chunked.make(torch.zeros(6, 3), blocks)
    storage = loaded.data_ptr()
    dcp.load({"w": loaded}, checkpoint_id=str(tmp_path), no_dist=True)
    assert {"__create_chunk_list__", "__get_tensor_shard__"} <= loaded.calls, (
        f"{what}: dcp.load no longer calls {sorted({'__create_chunk_list__', '__get_tensor_shard__'} - loaded.calls)}")
    assert loaded.data_ptr() == storage
    assert torch.equal(loaded.as_subclass(torch.Tensor), canonical[order]), (
        f"{what}: dcp.load did not fill each local row block in place")


# ----------------------------------------------------------------------------
# DTensor, ParallelStyle and FSDP2 (2 gloo ranks)

class _Sub(DTensor):
    pass


class _RecordingStyle(compat.TensorParallelStyle):
    def parallelize(self, module, device_mesh):
        self.called_with = (module, device_mesh, self.src_data_rank)
        return module


class _Owner(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 6)


def _case(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    res = {}
    # StridedShard: 2 blocks of 4 rows, each split over the 2 ranks
    rows = torch.arange(8.0).unsqueeze(1).repeat(1, 3)
    strided = distribute_tensor(rows, mesh, [compat.StridedShard(0, split_factor=2)], src_data_rank=None)
    res["strided_local"] = strided.to_local().clone()
    res["strided_full"] = _try(lambda: strided.full_tensor())
    res["shard_kinds"] = (compat.is_strided_shard(strided.placements[0], 0), compat.is_plain_shard(Shard(0), 0),
                          compat.is_plain_shard(strided.placements[0]), compat.is_strided_shard(Shard(0)))

    # DTensor(local, spec) as a subclass
    local = strided.to_local().detach().clone()
    sub = compat.rewrap_dtensor(_Sub, strided, local)
    with torch.no_grad():
        same_storage = sub.to_local().data_ptr() == local.data_ptr()
    res["rewrap"] = {"type": type(sub).__name__, "placements": sub.placements == strided.placements,
                     "mesh": sub.device_mesh == mesh, "shape": tuple(sub.shape), "stride": sub.stride(),
                     "requires_grad": sub.requires_grad, "same_storage": same_storage}

    # ParallelStyle._apply, called by parallelize_module
    style, lin = _RecordingStyle(), nn.Linear(4, 6)
    out = parallelize_module(lin, mesh, style, src_data_rank=None)
    called = getattr(style, "called_with", None)
    res["style"] = {"called": called is not None and called[0] is lin and called[1] is mesh,
                    "src_data_rank": called[2] if called else "not called", "returned": out is lin}

    # FSDP2: the placement fully_shard chose, found from the owner or an ancestor
    fsdp = {}
    for how in ("default", "dim1", "ancestor", "none"):
        owner = _Owner()
        parent = nn.Sequential(owner)
        if how == "default":
            fully_shard(owner, mesh=mesh)
        elif how == "dim1":
            fully_shard(owner, mesh=mesh, shard_placement_fn=lambda p: Shard(p.dim() - 1))
        elif how == "ancestor":
            fully_shard(parent, mesh=mesh)
        fsdp[how] = {"managed": compat.fsdp_managed(owner.lin),
                     "weight": repr(_try(lambda: compat.fsdp_shard_placement_of(owner.lin, "weight"))),
                     "bias": repr(_try(lambda: compat.fsdp_shard_placement_of(owner.lin, "bias"))),
                     "other": repr(_try(lambda: compat.fsdp_shard_placement_of(owner, "weight")))}
    res["fsdp"] = fsdp
    return res


def _try(fn):
    try:
        return fn()
    except Exception as e:  # the parent test reports it with the entry's name
        return f"raised {type(e).__name__}: {e}"


def run_case(case, rank, world):
    return _case(rank, world)


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory):
    with pytest.MonkeyPatch.context() as monkeypatch:
        return rank_launcher.launch(run_case, "compat", tmp_path_factory.mktemp("compat"), monkeypatch,
                                    WORLD, RANK_TIMEOUT_S)


def test_strided_shard_layout(rank_results):
    """Rank r holds its quarter of each half, in order ([gate_r; up_r] for
    a packed w12), and full_tensor() puts the rows back in global order."""
    rows = torch.arange(8.0).unsqueeze(1).repeat(1, 3)
    what = "StridedShard (_StridedShard)"
    for rank, res in enumerate(rank_results):
        mine = torch.cat([rows[2 * rank:2 * rank + 2], rows[4 + 2 * rank:4 + 2 * rank + 2]])
        assert torch.equal(res["strided_local"], mine), f"{what}: rank {rank} holds {res['strided_local'][:, 0]}"
        full = res["strided_full"]
        if OLD_TORCH:  # SwiGLUTensorParallel refuses this torch: its DTensor cannot gather the layout
            assert not isinstance(full, torch.Tensor), f"{what}: full_tensor() now works on {torch.__version__}"
            continue
        assert isinstance(full, torch.Tensor), f"{what}: full_tensor() {full}"
        assert torch.equal(full, rows), f"{what}: full_tensor() is not the global tensor: {full[:, 0]}"
        assert res["shard_kinds"] == (True, True, False, False), f"{what}: placement tests {res['shard_kinds']}"


def test_dtensor_subclass_construction(rank_results):
    """DTensor(local, spec, requires_grad=) with another DTensor's _spec
    gives that subclass, on the same local storage and layout."""
    for res in rank_results:
        assert res["rewrap"] == {"type": "_Sub", "placements": True, "mesh": True, "shape": (8, 3), "stride": (3, 1),
                                 "requires_grad": False, "same_storage": True}, (
            f"DTensor subclass construction (DTensor.__new__, DTensor._spec): {res['rewrap']}")


def test_parallel_style_apply(rank_results):
    """parallelize_module sets src_data_rank on the style and calls its
    ParallelStyle._apply with the module and the mesh."""
    for res in rank_results:
        assert res["style"] == {"called": True, "src_data_rank": None, "returned": True}, (
            f"ParallelStyle._apply: {res['style']}")


def test_fsdp2_internals(rank_results):
    """FSDP2 marks the modules it manages and reports the placement it chose
    per parameter: its default, a shard_placement_fn's, and for a module that
    only an ancestor was fully_shard-ed on; nothing for unmanaged ones."""
    what = "FSDP2 internals (_is_fsdp_managed_module, FSDP2 state, FSDPParam)"
    for res in rank_results:
        fsdp = res["fsdp"]
        assert fsdp["default"] == {"managed": True, "weight": "Shard(dim=0)", "bias": "Shard(dim=0)",
                                   "other": "None"}, f"{what}: {fsdp['default']}"
        assert fsdp["dim1"]["weight"] == "Shard(dim=1)", f"{what}: {fsdp['dim1']}"
        assert fsdp["ancestor"] == fsdp["default"], f"{what}: {fsdp['ancestor']}"
        assert fsdp["none"] == {"managed": False, "weight": "None", "bias": "None", "other": "None"}, (
            f"{what}: {fsdp['none']}")


def test_parallel_does_not_import_dcp():
    """Importing swiglu_cupy.parallel leaves torch.distributed.checkpoint
    unloaded (it is loaded when a state dict is saved or loaded)."""
    import subprocess
    import sys

    code = ("import sys, swiglu_cupy.parallel; "
            "print('torch.distributed.checkpoint' in sys.modules, 'torch.distributed.fsdp' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"], out
