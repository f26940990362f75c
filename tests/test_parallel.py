"""Tensor parallelism (swiglu_cupy.parallel.SwiGLUTensorParallel) against one process.

Each CPU test starts gloo ranks through tests/rank_launcher.py (a rank that
fails or hangs fails the test within RANK_TIMEOUT_S). The ranks return plain
CPU tensors; the parent compares them with the same block run unsharded in
one process, in fp32.

Tolerances: TP changes only summation order (each rank sums over its H/tp
hidden units, then the partial outputs are added; dx likewise), a few fp32
roundings (eps 1.2e-7) of terms no larger than the result's scale, so
rtol/atol 1e-5 (~80 eps) holds; a wrong shard, a missed or doubled
reduction, or a swapped gate/up half is an O(1) error.

Also the torchrun worker of the GPU (nccl) test:
    torchrun --nproc_per_node=2 tests/test_parallel.py --case tp --out DIR
"""
from __future__ import annotations

import copy
import dataclasses
import re
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import rank_launcher
import swiglu_cupy as sc
from swiglu_cupy.activations import GPT_OSS
from conftest import assert_nontrivial
from swiglu_cupy.hf import patch_model
from swiglu_cupy.integrations.parallel import MIN_TORCH
from swiglu_cupy.parallel import SwiGLUTensorParallel, fsdp_shard_placement, reject_distributed_weights

D, H, O = 8, 6, 5          # H/tp = 3 rows of gate and 3 of up per rank (odd on purpose)
BATCH, SEQ = 2, 4          # SEQ divisible by the TP size (sequence parallel)
TP = 2
RANK_TIMEOUT_S = 60
RTOL = ATOL = 1e-5
PARAMS = ("w12.weight", "w12.bias", "w3.weight", "w3.bias")
SHARDED = ("w12.weight", "w3.weight")   # the biases are replicated over TP
LR = 0.1

# SwiGLUTensorParallel refuses older torch (its DTensor cannot redistribute
# the packed w12); every test that parallelizes a block skips there, and
# test_old_torch_gets_a_clear_error runs instead.
MIN_TORCH_TEXT = ".".join(map(str, MIN_TORCH))
OLD_TORCH = torch.__version__ < MIN_TORCH_TEXT
needs_min_torch = pytest.mark.skipif(
    OLD_TORCH, reason=f"SwiGLUTensorParallel needs torch >= {MIN_TORCH_TEXT}, this is {torch.__version__}")

# The device cases run on: CPU for the spawned gloo ranks, the rank's GPU
# under torchrun with nccl (set in _torchrun_main).
DEVICE = torch.device("cpu")


# ----------------------------------------------------------------------------
# shared by the ranks and the reference

# GPT-OSS's variant with a limit inside the range of the block's x12, so the clamps cut.
GPT_OSS_TIGHT = dataclasses.replace(GPT_OSS, limit=0.5)


def build_block(seed=0, **kwargs) -> sc.SwiGLU:
    torch.manual_seed(seed)
    return sc.SwiGLU(D, H, O, **kwargs).to(DEVICE)


def block_data(seq_first=False):
    """x [BATCH, SEQ, D] and the output grad dy [BATCH, SEQ, O] (loss =
    sum(y * dy): every output element gets its own weight). seq_first:
    both transposed to [SEQ, BATCH, ...]."""
    g = torch.Generator().manual_seed(1)
    x, dy = torch.randn(BATCH, SEQ, D, generator=g), torch.randn(BATCH, SEQ, O, generator=g)
    if seq_first:
        x, dy = x.transpose(0, 1).contiguous(), dy.transpose(0, 1).contiguous()
    return x.to(DEVICE), dy.to(DEVICE)


def reference(seq_first=False, **kwargs):
    """Output, dx and every parameter grad of the unsharded block."""
    block = build_block(**kwargs)
    x, dy = block_data(seq_first)
    x.requires_grad_()
    y = block(x)
    (y * dy).sum().backward()
    return {"out": y.detach().cpu(), "dx": x.grad.cpu(),
            "grads": {n: p.grad.cpu() for n, p in block.named_parameters()},
            "params": {n: p.detach().cpu() for n, p in block.named_parameters()}}


def _mesh(world):
    return init_device_mesh(DEVICE.type, (world,))


def _run_tp_block(block, x, dy, prefix="_orig_mod."):
    """Forward + backward of a parallelized block on this rank's x / dy.
    ``prefix`` is dropped from the parameter names (a compiled block's, or the
    block's name inside a wrapper)."""
    x = x.clone().requires_grad_()
    y = block(x)
    (y * dy).sum().backward()
    params = {n.removeprefix(prefix): p for n, p in block.named_parameters()}
    return {"out": y.detach().cpu(), "dx": x.grad.cpu(), "is_view": y._is_view(),
            "grads": {n: p.grad.full_tensor().cpu().clone() for n, p in params.items()},
            "grad_placements": {n: str(p.grad.placements) for n, p in params.items()}}


class HFStyleMLP(torch.nn.Module):
    """A Llama-style MLP (what swiglu_cupy.hf.patch_model replaces)."""

    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj = torch.nn.Linear(D, H), torch.nn.Linear(D, H)
        self.down_proj, self.act_fn = torch.nn.Linear(H, O), torch.nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def build_hf_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(HFStyleMLP()).to(DEVICE)


def hf_plan():
    """A Hugging Face style tp_plan for the MLP: the patched module keeps its
    projections, so they shard like the unpatched ones."""
    return {"0.gate_proj": ColwiseParallel(), "0.up_proj": ColwiseParallel(), "0.down_proj": RowwiseParallel()}


def _error_text(fn):
    try:
        fn()
    except Exception as e:  # the test inspects the type and the message
        return f"{type(e).__name__}: {e}"
    return "no error"


# ----------------------------------------------------------------------------
# rank side

def _case_tp(rank, world):
    mesh = _mesh(world)
    x, dy = block_data()
    res = {}
    for label, kwargs in (("bias", {}), ("no_bias", {"bias": False}),
                          ("recompute", {"recompute_gate_up": True}), ("gpt_oss", {"activation": GPT_OSS_TIGHT}),
                          ("tiled", {"tile_rows": 3})):
        block = parallelize_module(build_block(**kwargs), mesh, SwiGLUTensorParallel())
        r = _run_tp_block(block, x, dy)
        if label == "gpt_oss":  # interleaved rows: this rank's whole gate/up pairs
            r["local_w12"] = block.w12.weight.to_local().detach().cpu().clone()
            r["w12_placements"] = str(block.w12.weight.placements)
            with torch.no_grad():
                r["no_grad_out"] = block(x).cpu()
        if label == "bias":
            r["local"] = {n: p.to_local().detach().cpu().clone() for n, p in block.named_parameters()}
            r["full"] = {n: p.full_tensor().detach().cpu().clone() for n, p in block.named_parameters()}
            r["placements"] = {n: str(p.placements) for n, p in block.named_parameters()}
            with torch.no_grad():
                r["no_grad_out"] = block(x).cpu()
            r["class"] = type(block).__name__
            torch.optim.SGD(block.parameters(), lr=LR).step()
            r["after_step"] = {n: p.full_tensor().detach().cpu() for n, p in block.named_parameters()}
        res[label] = r
    # inside a plan dict, on a submodule
    model = torch.nn.Sequential(build_block())
    parallelize_module(model, mesh, {"0": SwiGLUTensorParallel()})
    res["plan"] = _run_tp_block(model[0], x, dy)
    dt_out = parallelize_module(build_block(), mesh, SwiGLUTensorParallel(use_local_output=False))(x)
    res["dtensor_out"] = {"type": type(dt_out).__name__, "placements": str(dt_out.placements),
                          "full": dt_out.full_tensor().detach().cpu()}

    # Hugging Face: a patched MLP keeps gate_proj/up_proj/down_proj, so an HF
    # style plan shards it (its hooks run the projections; silu * up is fused
    # on the local shards), whether it is patched before or after sharding.
    hf_model = build_hf_model()
    hf_state = {k: v.clone() for k, v in hf_model.state_dict().items()}
    with torch.no_grad():
        hf_out = hf_model(x)
    assert patch_model(hf_model, strict=True) == 1
    parallelize_module(hf_model, mesh, hf_plan())
    with torch.no_grad():
        # RowwiseParallel returns an AsyncCollectiveTensor: wait() gives the plain tensor to save.
        res["hf"] = {"out": hf_model(x).wait().cpu(), "expected_out": hf_out.cpu(), "fusion": hf_model[0].fusion(),
                     "state": {k: v.full_tensor().cpu() for k, v in hf_model.state_dict().items()},
                     "expected_state": {k: v.cpu() for k, v in hf_state.items()}}
    tp_plan_model = parallelize_module(build_hf_model(), mesh, hf_plan())
    res["hf"]["patched_after_plan"] = patch_model(tp_plan_model)
    with torch.no_grad():
        res["hf"]["out_after_plan"] = tp_plan_model(x).wait().cpu()

    def plain_tp_forward():
        plain = parallelize_module(build_block(), mesh, {"w12": ColwiseParallel(), "w3": RowwiseParallel()})
        return plain(x)

    odd = sc.SwiGLU(D, 2 * world + 1).to(DEVICE)  # H not divisible by world
    twice = parallelize_module(build_block(), mesh, SwiGLUTensorParallel())
    colwise = parallelize_module(build_block(), mesh, {"w12": ColwiseParallel()})
    res["errors"] = {
        "indivisible": _error_text(lambda: parallelize_module(odd, mesh, SwiGLUTensorParallel())),
        "twice": _error_text(lambda: parallelize_module(twice, mesh, SwiGLUTensorParallel())),
        "after_colwise": _error_text(lambda: parallelize_module(colwise, mesh, SwiGLUTensorParallel())),
        "not_swiglu": _error_text(lambda: parallelize_module(torch.nn.Linear(D, D), mesh,
                                                             SwiGLUTensorParallel())),
        "reject_dtensor": _error_text(lambda: reject_distributed_weights(w12=colwise.w12.weight)),
        "plain_colwise_forward": _error_text(plain_tp_forward),
        "bad_sequence_dim": _error_text(lambda: parallelize_module(
            build_block(), mesh, SwiGLUTensorParallel(sequence_parallel=True, sequence_dim=2))(x)),
    }
    return res


def _case_sp(rank, world):
    """Sequence parallel: this rank's equal slice of the sequence in, its
    slice of the output out; on dim 1 of [B, S, D] and on dim 0 of [S, B, D]."""
    mesh = _mesh(world)
    res = {}
    for seq_dim, seq_first in ((1, False), (0, True)):
        x, dy = block_data(seq_first)
        style = SwiGLUTensorParallel(sequence_parallel=True, sequence_dim=seq_dim)
        block = parallelize_module(build_block(), mesh, style)
        res[seq_dim] = _run_tp_block(block, x.chunk(world, seq_dim)[rank], dy.chunk(world, seq_dim)[rank])
    return res


def _case_compile(rank, world):
    """torch.compile(fullgraph=True) of a TP block, replicated and sequence
    parallel: the DTensor collectives trace with the fused op, no graph
    break. backend="aot_eager" traces forward and backward exactly as
    inductor does, without inductor's code generation (~20 s per graph on
    this CPU)."""
    mesh = _mesh(world)
    res = {}
    for sp in (False, True):
        block = parallelize_module(build_block(), mesh, SwiGLUTensorParallel(sequence_parallel=sp))
        x, dy = block_data()
        if sp:
            x, dy = x.chunk(world, 1)[rank], dy.chunk(world, 1)[rank]
        compiled = _run_tp_block(torch.compile(block, fullgraph=True, backend="aot_eager"), x, dy)
        block.zero_grad(set_to_none=True)
        res[sp] = {"compiled": compiled, "eager": _run_tp_block(block, x, dy)}
    return res


def _full_params(module):
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().clone()
            for n, p in module.named_parameters()}


def _dcp_load(module, path):
    state = module.state_dict()
    dcp.load(state, checkpoint_id=path)
    module.load_state_dict(state)
    return _full_params(module)


def _case_dcp(case, rank, world):
    from torch.distributed.fsdp import fully_shard

    path = case[1]
    mesh = _mesh(world)
    saved = parallelize_module(build_block(), mesh, SwiGLUTensorParallel())
    state = saved.state_dict()
    res = {"state_full": {k: v.full_tensor().cpu() for k, v in state.items()},
           "state_types": {k: type(v).__name__ for k, v in state.items()},
           # a deep copy (a snapshot of the state dict) keeps the values and the DCP chunks
           "deepcopy_full": {k: v.full_tensor().cpu() for k, v in copy.deepcopy(state).items()},
           "deepcopy_chunks": copy.deepcopy(state)["w12.weight"].__create_chunk_list__()
           == state["w12.weight"].__create_chunk_list__()}
    dcp.save(state, checkpoint_id=path)
    # into fresh modules with other initial values
    res["tp"] = _dcp_load(parallelize_module(build_block(seed=7), mesh, SwiGLUTensorParallel()), path)
    fsdp = build_block(seed=7)
    fully_shard(fsdp, mesh=mesh)
    res["fsdp2"] = _dcp_load(fsdp, path)
    # an unparallelized state dict (torch.save layout) into a TP module
    tp_from_plain = parallelize_module(build_block(seed=7), mesh, SwiGLUTensorParallel())
    tp_from_plain.load_state_dict(build_block().state_dict())
    res["tp_from_plain"] = _full_params(tp_from_plain)
    res["tp_from_plain_local"] = {n: p.to_local().detach().cpu() for n, p in tp_from_plain.named_parameters()}
    # a patched, parallelized HF model: HF keys through DCP
    hf_models = []
    for seed in (0, 7):
        model = build_hf_model(seed)
        patch_model(model)
        hf_models.append(parallelize_module(model, mesh, hf_plan()))
    dcp.save(hf_models[0].state_dict(), checkpoint_id=path + "_hf")
    res["hf_saved"] = _full_params(hf_models[0])
    res["hf_loaded"] = _dcp_load(hf_models[1], path + "_hf")
    return res


def _case_2d(case, rank, world):
    """FSDP2 over dp on top of TP over tp (2 x 2), the training run of
    test_distributed (3 residual blocks, non-reentrant checkpointing, root
    LayerNorm, 2 SGD steps); then a DCP save of the 2-D state."""
    from torch.distributed.fsdp import fully_shard

    import test_distributed as td

    mesh = init_device_mesh(DEVICE.type, (world // TP, TP), mesh_dim_names=("dp", "tp"))
    model = td.build_model("non_reentrant").to(DEVICE)
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], SwiGLUTensorParallel())
        fully_shard(block, mesh=mesh["dp"], shard_placement_fn=fsdp_shard_placement)
    fully_shard(model, mesh=mesh["dp"])
    # tp ranks of one dp group see the same data
    x, target = (t.to(DEVICE) for t in td.local_batch(mesh["dp"].get_local_rank(), world // TP))

    result = td._train(model, x, target, td.dtensor_full_grads)
    result["local_shape"] = tuple(model.blocks[0].w12.weight.to_local().shape)
    result["placements"] = str(model.blocks[0].w12.weight.placements)
    dcp.save(model.state_dict(), checkpoint_id=case[1])
    result["full_after"] = _full_params(model)
    # without fsdp_shard_placement, FSDP2 shards [gate_r; up_r] along dim 0
    # into pieces no DTensor layout describes: state_dict refuses, even before
    # the first forward (which refuses too: the "2d_plain" case)
    wrong = parallelize_module(build_block(), mesh["tp"], SwiGLUTensorParallel())
    fully_shard(wrong, mesh=mesh["dp"])
    result["default_fsdp_error"] = _error_text(wrong.state_dict)
    return result


def _case_2d_plain(rank, world):
    """torch's plain fully_shard (FSDP2's default dim-0 split) on top of
    SwiGLUTensorParallel, mesh (dp=2, tp=2): the first forward refuses it,
    however FSDP2 got the parameter (the block itself, only an ancestor,
    both, an explicit Shard(0), FSDP2 applied after a TP forward, no_grad).
    What works: the fix on an ancestor, and plain fully_shard when tp=1
    (then each rank's rows are one contiguous run of [gate; up])."""
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(DEVICE.type, (world // TP, TP), mesh_dim_names=("dp", "tp"))
    x, dy = block_data()  # the same batch on every rank: FSDP2's mean over dp is the one-process grad

    def tp_block():
        return parallelize_module(build_block(), mesh["tp"], SwiGLUTensorParallel())

    def sharded(how):
        block = tp_block()
        if how == "after_tp_forward":
            block(x)  # TP alone is fine; FSDP2 comes later
        root = torch.nn.Sequential(block)
        if how in ("block", "block_and_root", "after_tp_forward", "no_grad"):
            fully_shard(block, mesh=mesh["dp"])
        if how == "explicit_dim0":
            fully_shard(block, mesh=mesh["dp"], shard_placement_fn=lambda p: Shard(0))
        if how in ("root", "block_and_root"):
            fully_shard(root, mesh=mesh["dp"])
        return root if how in ("root", "block_and_root") else block

    def first_forward(how):
        module = sharded(how)
        if how == "no_grad":
            with torch.no_grad():
                return _error_text(lambda: module(x))
        return _error_text(lambda: module(x))

    res = {"errors": {how: first_forward(how) for how in
                      ("block", "root", "block_and_root", "explicit_dim0", "after_tp_forward", "no_grad")}}
    fixed = torch.nn.Sequential(tp_block())
    fully_shard(fixed, mesh=mesh["dp"], shard_placement_fn=fsdp_shard_placement)
    res["root_with_fix"] = _run_tp_block(fixed, x, dy, prefix="0.")
    mesh_tp1 = init_device_mesh(DEVICE.type, (world, 1), mesh_dim_names=("dp", "tp"))
    tp1 = parallelize_module(build_block(), mesh_tp1["tp"], SwiGLUTensorParallel())
    fully_shard(tp1, mesh=mesh_tp1["dp"])
    res["tp1_plain"] = _run_tp_block(tp1, x, dy)
    res["tp1_plain"]["state_full"] = {k: v.full_tensor().cpu() for k, v in tp1.state_dict().items()}
    return res


def run_case(case, rank, world):
    name = case[0] if isinstance(case, tuple) else case
    if name == "tp":
        return _case_tp(rank, world)
    if name == "sp":
        return _case_sp(rank, world)
    if name == "compile":
        return _case_compile(rank, world)
    if name == "dcp":
        return _case_dcp(case, rank, world)
    if name == "2d":
        return _case_2d(case, rank, world)
    if name == "2d_plain":
        return _case_2d_plain(rank, world)
    raise ValueError(case)


# ----------------------------------------------------------------------------
# parent side

def launch(case, tmp_path, monkeypatch, world=TP):
    return rank_launcher.launch(run_case, case, tmp_path, monkeypatch, world, RANK_TIMEOUT_S)


def close(actual, expected, what):
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def assert_block_matches(r, ref, out_slice=lambda t: t):
    """Output and dx (this rank's part of them) and every full parameter
    grad, non-trivial, equal to the unsharded block's."""
    close(r["out"], out_slice(ref["out"]), "output")
    assert not r["is_view"], "the output must be a fresh tensor, not a view"
    assert_nontrivial(r["dx"], "dx")
    close(r["dx"], out_slice(ref["dx"]), "dx")
    assert sorted(r["grads"]) == sorted(ref["grads"])
    for name, g in ref["grads"].items():
        assert_nontrivial(r["grads"][name], name)
        close(r["grads"][name], g, f"grad {name}")


def check_tp_results(results, world):
    ref = reference()
    rows = H // world
    for rank, res in enumerate(results):
        r = res["bias"]
        assert r["class"] == "TensorParallelSwiGLU"
        assert_block_matches(r, ref)
        close(r["no_grad_out"], ref["out"], "no-grad output")
        assert_block_matches(res["no_bias"], reference(bias=False))
        assert_block_matches(res["recompute"], reference(recompute_gate_up=True))
        assert_block_matches(res["tiled"], ref)   # row tiles on each rank's shards: the untiled block's results
        # GPT-OSS's interleaved, clamped variant: sharded by whole pairs (a plain row shard)
        oai, oai_ref = res["gpt_oss"], reference(activation=GPT_OSS_TIGHT)
        assert_block_matches(oai, oai_ref)
        close(oai["no_grad_out"], oai_ref["out"], "interleaved no-grad output")
        pairs = slice(2 * rank * (H // world), 2 * (rank + 1) * (H // world))
        assert torch.equal(oai["local_w12"], oai_ref["params"]["w12.weight"][pairs])
        assert oai["w12_placements"] == "(Shard(dim=0),)"
        assert_block_matches(res["plan"], ref)
        # HF: patched, then parallelized (or the reverse); the state dict keeps the HF keys and values
        hf = res["hf"]
        assert hf["fusion"] == "activation" and hf["patched_after_plan"] == 1
        close(hf["out"], hf["expected_out"], "patched + parallelized HF MLP output")
        close(hf["out_after_plan"], hf["expected_out"], "parallelized + patched HF MLP output")
        for key, value in hf["expected_state"].items():
            assert torch.equal(hf["state"][key], value), key
        assert sorted(hf["state"]) == sorted(hf["expected_state"])
        assert res["dtensor_out"]["type"] == "DTensor" and res["dtensor_out"]["placements"] == "(Replicate(),)"
        close(res["dtensor_out"]["full"], ref["out"], "use_local_output=False")
        # canonical layout: full_tensor() is the unsharded parameter
        for name in PARAMS:
            assert torch.equal(r["full"][name], ref["params"][name]), name
        # each rank holds only its shard: gate rows and up rows of its slice
        w12, w3 = ref["params"]["w12.weight"], ref["params"]["w3.weight"]
        mine = slice(rank * rows, (rank + 1) * rows)
        up = slice(H + rank * rows, H + (rank + 1) * rows)
        assert torch.equal(r["local"]["w12.weight"], torch.cat([w12[mine], w12[up]]))
        assert torch.equal(r["local"]["w3.weight"], w3[:, mine])
        for name in ("w12.bias", "w3.bias"):
            assert torch.equal(r["local"][name], ref["params"][name]), name
            assert r["placements"][name] == "(Replicate(),)"
        assert r["placements"]["w12.weight"] == "(_StridedShard(dim=0, sf=2),)"
        for name in SHARDED:  # sharded grads come back in the parameter's layout
            assert r["grad_placements"][name] == r["placements"][name]
        # an optimizer step on the DTensor parameters (the bias grads are partial sums)
        for name in PARAMS:
            close(r["after_step"][name], ref["params"][name] - LR * ref["grads"][name], f"SGD step {name}")


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    """The "tp" case, run once for the two tests that read it."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        return launch("tp", tmp_path_factory.mktemp("tp"), monkeypatch)


@pytest.mark.skipif(not OLD_TORCH, reason=f"torch >= {MIN_TORCH_TEXT}: the TP tests run instead")
def test_old_torch_gets_a_clear_error():
    with pytest.raises(RuntimeError, match=re.escape(
            f"SwiGLUTensorParallel needs torch >= {MIN_TORCH_TEXT}, you have {torch.__version__}")):
        SwiGLUTensorParallel()


@needs_min_torch
def test_tensor_parallel_matches_one_process(tp_results):
    """TP=2, replicated input: output, dx and every parameter grad (full,
    canonical layout) with and without biases, with recompute_gate_up, in row
    tiles, and inside a plan dict; the local shards; full_tensor() of each parameter."""
    check_tp_results(tp_results, TP)


@needs_min_torch
def test_tensor_parallel_errors(tp_results):
    errors = tp_results[0]["errors"]
    assert errors["indivisible"].startswith("ValueError")
    assert f"H={2 * TP + 1}" in errors["indivisible"] and f"size {TP}" in errors["indivisible"]
    for key in ("twice", "after_colwise"):
        assert errors[key].startswith("ValueError") and "already a DTensor" in errors[key], errors[key]
    assert errors["not_swiglu"].startswith("TypeError") and "Linear" in errors["not_swiglu"]
    assert errors["reject_dtensor"].startswith("TypeError")
    assert "SwiGLUTensorParallel" in errors["reject_dtensor"] and "w12" in errors["reject_dtensor"]
    # a generic ColwiseParallel/RowwiseParallel plan never runs silently
    assert errors["plain_colwise_forward"].startswith("TypeError")
    assert "SwiGLUTensorParallel" in errors["plain_colwise_forward"]
    assert errors["bad_sequence_dim"].startswith("ValueError") and "sequence_dim=2" in errors["bad_sequence_dim"]


@needs_min_torch
def test_sequence_parallel_matches_one_process(tmp_path, monkeypatch):
    """Input and output sharded on the sequence dim (dim 1 of [B, S, D], and
    dim 0 of [S, B, D] via sequence_dim=0): each rank's output and dx slice
    and every full parameter grad equal the unsharded block's."""
    results = launch("sp", tmp_path, monkeypatch)
    for seq_dim, seq_first in ((1, False), (0, True)):
        ref = reference(seq_first=seq_first)
        for rank, res in enumerate(results):
            assert_block_matches(res[seq_dim], ref, lambda t, r=rank, d=seq_dim: t.chunk(TP, d)[r])


@needs_min_torch
def test_tensor_parallel_compiles_without_graph_breaks(tmp_path, monkeypatch):
    """fullgraph=True traces the TP block (collectives included) forward and
    backward, and gives the eager results."""
    for res in launch("compile", tmp_path, monkeypatch):
        for sp in (False, True):
            got, exp = res[sp]["compiled"], res[sp]["eager"]
            close(got["out"], exp["out"], "compiled output")
            close(got["dx"], exp["dx"], "compiled dx")
            for name, g in exp["grads"].items():
                assert_nontrivial(got["grads"][name], name)
                close(got["grads"][name], g, f"compiled grad {name}")


@needs_min_torch
def test_dcp_round_trips(tmp_path, monkeypatch):
    """DCP save at TP=2 stores the canonical [2H, D] w12 (in 2 chunks per
    rank) and loads into TP=2, into FSDP2, and into a plain module."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = tmp_path / "ckpt"
    results = launch(("dcp", str(path)), tmp_path, monkeypatch)
    canonical = reference()["params"]
    rows = H // TP
    chunks = FileSystemReader(str(path)).read_metadata().state_dict_metadata["w12.weight"].chunks
    assert sorted((c.offsets[0], c.sizes[0]) for c in chunks) == [(i * rows, rows) for i in range(2 * TP)]
    for res in results:
        assert res["state_types"]["w3.weight"] == "DTensor"
        assert res["deepcopy_chunks"]
        for name in PARAMS:
            assert torch.equal(res["state_full"][name], canonical[name]), name
            assert torch.equal(res["deepcopy_full"][name], canonical[name]), name
            for target in ("tp", "fsdp2", "tp_from_plain"):
                assert torch.equal(res[target][name], canonical[name]), (target, name)
    assert torch.equal(results[1]["tp_from_plain_local"]["w3.weight"], canonical["w3.weight"][:, rows:])
    for res in results:
        for name, p in res["hf_saved"].items():
            assert torch.equal(res["hf_loaded"][name], p), name
    # the checkpoint on disk, as one torch.save file, into an unparallelized module
    dcp_to_torch_save(str(path), str(tmp_path / "full.pt"))
    state = torch.load(tmp_path / "full.pt")
    assert tuple(state["w12.weight"].shape) == (2 * H, D)
    plain = sc.SwiGLU(D, H, O)
    plain.load_state_dict(state)
    for name, p in plain.named_parameters():
        assert torch.equal(p.detach(), canonical[name]), name


@needs_min_torch
def test_fsdp2_on_tensor_parallel_2d(tmp_path, monkeypatch):
    """4 ranks, mesh (dp=2, tp=2): FSDP2 over dp on top of TP; loss and every
    full grad for 2 SGD steps equal one process (test_distributed's model and
    reference), and the 2-D sharded state saves through DCP as the canonical
    layout."""
    import test_distributed as td
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = tmp_path / "ckpt2d"
    results = launch(("2d", str(path)), tmp_path, monkeypatch, world=4)
    ref = td.reference_run()
    for res in results:
        td.assert_matches(res, ref)
        # tp shards w12's rows ([gate_r; up_r]), dp its columns
        assert res["local_shape"] == (2 * td.H // TP, td.D // (4 // TP)), res["local_shape"]
        assert res["placements"] == "(Shard(dim=1), _StridedShard(dim=0, sf=2))", res["placements"]
        for name, p in res["full_after"].items():  # after 2 SGD steps, canonical layout
            torch.testing.assert_close(p, ref["final"][name], rtol=td.RTOL_FP32, atol=td.ATOL_FP32)
        assert res["default_fsdp_error"].startswith("ValueError")
        assert "fsdp_shard_placement" in res["default_fsdp_error"]
    dcp_to_torch_save(str(path), str(tmp_path / "full.pt"))
    state = torch.load(tmp_path / "full.pt")
    assert sorted(state) == sorted(ref["final"])
    for name, p in results[0]["full_after"].items():
        assert torch.equal(state[name], p), name


@needs_min_torch
def test_plain_fully_shard_on_tensor_parallel_refuses_at_first_forward(tmp_path, monkeypatch):
    """4 ranks, mesh (dp=2, tp=2): FSDP2's default dim-0 split of the packed
    w12 would make full_tensor(), grads and state_dict permuted, so the first
    forward raises a ValueError that names fsdp_shard_placement, whichever
    module fully_shard got. The fix on an ancestor, and plain fully_shard at
    tp=1, match one process."""
    results = launch("2d_plain", tmp_path, monkeypatch, world=4)
    ref = reference()
    for res in results:
        for how, error in res["errors"].items():
            assert error.startswith("ValueError"), (how, error)
            assert "shard_placement_fn=swiglu_cupy.parallel.fsdp_shard_placement" in error, (how, error)
            assert "w12.weight" in error and "dim 0" in error, (how, error)
        assert_block_matches(res["root_with_fix"], ref)
        assert_block_matches(res["tp1_plain"], ref)
        for name, p in ref["params"].items():
            assert torch.equal(res["tp1_plain"]["state_full"][name], p), name


@needs_min_torch
@pytest.mark.gpu
def test_tensor_parallel_nccl_torchrun(tmp_path):
    """The TP case on GPUs with nccl under torchrun (one GPU per rank; with a
    single GPU it runs TP=1, which still exercises DTensor + the CUDA kernels)."""
    world = min(TP, torch.cuda.device_count())
    rank_launcher.run_torchrun(Path(__file__).resolve(), "tp", tmp_path, world, RANK_TIMEOUT_S + 60)
    global DEVICE
    DEVICE = torch.device("cuda")
    try:
        check_tp_results([torch.load(tmp_path / f"rank{r}.pt") for r in range(world)], world)
    finally:
        DEVICE = torch.device("cpu")


def _run_case_on(case, rank, world, device):
    """torchrun worker entry: the case on this rank's device (nccl + CUDA)."""
    global DEVICE
    DEVICE = device
    return run_case(case, rank, world)


if __name__ == "__main__":
    rank_launcher.torchrun_worker(_run_case_on)
