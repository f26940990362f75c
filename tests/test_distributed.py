"""Distributed training with SwiGLU blocks: FSDP2, DDP and FSDP1, each with
activation checkpointing of every block, against a single-process run.

Every CPU test starts 2 ranks (gloo on the CPU, through tests/rank_launcher.py,
which fails a test whose ranks fail or hang instead of waiting), feeds each
rank its half of one seeded global batch, and compares the loss and every
parameter gradient (full, unsharded) with one process running the same
model, same initial weights, on the whole batch, for 2 optimizer steps.

This file is also the torchrun worker of the GPU test (FSDP1 on nccl; on a
machine without CUDA it runs the same case on gloo + CPU):
    torchrun --nproc_per_node=2 tests/test_distributed.py --case fsdp1 --out DIR
"""
from __future__ import annotations

import copy
import dataclasses
import importlib
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

import rank_launcher
import swiglu_cupy as sc

D, H, N_BLOCKS = 32, 48, 3
BATCH, SEQ = 8, 5          # 3-D input [BATCH, SEQ, D]; ranks split BATCH
STEPS, LR = 2, 0.1         # step 2 runs on weights updated by step 1
WORLD = 2
RANK_TIMEOUT_S = 90

# fp32 tolerances. The distributed grad is (g_0 + g_1) / 2 where g_r sums
# over rank r's half of the rows; the reference sums over all rows in one
# GEMM. Same math, different summation order (and GEMM blocking for another
# M), so they differ by a few fp32 roundings (eps = 1.2e-7) of terms of at
# most ~|grad|. Measured on CPU: max |diff| 2.2e-8 over all grads, whose
# per-tensor max |g| is >= 3.4e-3. rtol 1e-5 (~80 eps) leaves a wide margin
# for other BLAS blockings; atol 1e-6 only matters for elements that cancel
# to ~0, and is still < 1e-3 of every grad tensor's scale. A real bug (a
# missed or doubled reduction, a dropped half, a zero grad) is O(1) relative.
RTOL_FP32, ATOL_FP32 = 1e-5, 1e-6
# bf16 forward/backward vs an fp32 run: bf16 has 8 bits of mantissa (unit
# roundoff 2**-8 = 3.9e-3), rounded at every op through 3 blocks + norm, so
# a few 1e-2 relative (rms over a tensor); 5e-2 is "same training signal".
BF16_VS_FP32_REL_RMS = 5e-2


# ----------------------------------------------------------------------------
# model, data, loss (shared by the ranks and the reference)

class Stack(nn.Module):
    """Residual SwiGLU blocks ``x = x + block(x)`` and a final LayerNorm.

    The first block's input is the data itself, which does not require grad
    (the case that broke xformers' fused op under non-reentrant checkpoint).
    ``ckpt``: None, "non_reentrant" or "reentrant" checkpoint around blocks.
    """

    def __init__(self, ckpt: str | None = None, activation="silu", saved_x12=None):
        super().__init__()
        self.blocks = nn.ModuleList(sc.SwiGLU(D, H, activation=activation, saved_x12=saved_x12)
                                    for _ in range(N_BLOCKS))
        self.norm = nn.LayerNorm(D)  # owned by the root: FSDP2's root group
        self.ckpt = ckpt

    def forward(self, x):
        for block in self.blocks:
            if self.ckpt is None:
                y = block(x)
            else:
                y = checkpoint(block, x, use_reentrant=self.ckpt == "reentrant")
            x = x + y
        return self.norm(x)


def build_model(ckpt=None) -> Stack:
    torch.manual_seed(0)
    return Stack(ckpt)


# GPT-OSS's form (OAI, interleaved) with a limit the blocks' x12 crosses, so the clamps cut;
# x12 saved in 8 bits (its scales are per row: the same whatever the ranks' batch split).
GPT_OSS_TIGHT = dataclasses.replace(sc.GPT_OSS, limit=0.5)


def build_gpt_oss_model(ckpt=None) -> Stack:
    torch.manual_seed(0)
    return Stack(ckpt, activation=GPT_OSS_TIGHT, saved_x12="fp8")


def global_batch():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, SEQ, D, generator=g)
    target = torch.randn(BATCH, SEQ, D, generator=g)
    return x, target


def local_batch(rank, world):
    x, target = global_batch()
    n = BATCH // world
    return x[rank * n:(rank + 1) * n], target[rank * n:(rank + 1) * n]


def loss_fn(out, target):
    # A mean: with equal halves, the average of the ranks' grads is the grad
    # of the global mean.
    return (out.float() - target).pow(2).mean()


def clean_name(name: str) -> str:
    """Parameter name without DDP / FSDP1 / checkpoint_wrapper prefixes."""
    for wrapper in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module."):
        name = name.replace(wrapper, "")
    return name.removeprefix("module.")


# ----------------------------------------------------------------------------
# single-process references (run in the pytest process)

def reference_run(device="cpu", emulate_bf16_ranks=0, build=build_model):
    """Loss and grads per step, and the final parameters, of the same model
    (``build()``) on the whole batch.

    emulate_bf16_ranks=n: what FSDP2 with MixedPrecisionPolicy(bf16 params,
    fp32 reduce) computes on n ranks: per half-batch, a bf16 copy of the fp32
    weights runs forward/backward; the bf16 grads are upcast to fp32 and
    averaged; the fp32 weights take the optimizer step.

    Runs with 1 intra-op thread, like the ranks: CPU kernels split some
    reductions per thread (bf16 LayerNorm backward rounds each thread's
    partial sums to bf16), so the thread count alone moves results by an ulp.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference_run(device, emulate_bf16_ranks, build)
    finally:
        torch.set_num_threads(threads)


def _reference_run(device, emulate_bf16_ranks, build):
    model = build().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, target = (t.to(device) for t in global_batch())
    losses, grads = [], []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        if not emulate_bf16_ranks:
            loss = loss_fn(model(x), target)
            loss.backward()
        else:
            n, world = BATCH // emulate_bf16_ranks, emulate_bf16_ranks
            loss = torch.zeros((), device=device)
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
            for r in range(world):
                low = copy.deepcopy(model).to(torch.bfloat16)
                part = slice(r * n, (r + 1) * n)
                part_loss = loss_fn(low(x[part].to(torch.bfloat16)), target[part])
                part_loss.backward()
                loss += part_loss.detach() / world
                for p, q in zip(model.parameters(), low.parameters()):
                    p.grad += q.grad.float() / world
        losses.append(loss.detach().cpu())
        grads.append({n: p.grad.detach().cpu().clone() for n, p in model.named_parameters()})
        opt.step()
    final = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "grads": grads, "final": final}


# ----------------------------------------------------------------------------
# rank side

def _avg_loss(loss):
    t = loss.detach().float().clone()
    dist.all_reduce(t)
    return (t / dist.get_world_size()).cpu()


def _view_hooks(modules, record):
    """Forward hooks that record whether each output is a view."""
    for m in modules:
        m.register_forward_hook(lambda _m, _i, out: record.append(bool(out._is_view() or out._base is not None)))


def dtensor_full_grads(model):
    """Every parameter's full (unsharded) grad, on the CPU, from DTensor grads."""
    return {n: p.grad.full_tensor().detach().cpu().clone() for n, p in model.named_parameters()}


def _train(model, x, target, full_grads, record_warnings=False):
    """STEPS steps of SGD; returns losses (rank-averaged), full grads per step
    and any warnings raised during forward."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads, caught = [], [], []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            out = model(x)
        caught += [str(m.message) for m in w]
        loss = loss_fn(out, target)
        loss.backward()
        losses.append(_avg_loss(loss))
        grads.append(full_grads(model))
        opt.step()
    return {"losses": losses, "grads": grads, "warnings": caught}


def _case_fsdp2(rank, world, mixed_precision=False, build=build_model):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = build("non_reentrant")
    views = []
    _view_hooks(model.blocks, views)
    kw = {}
    if mixed_precision:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    assert all(type(p).__name__ == "DTensor" for p in model.parameters())
    x, target = local_batch(rank, world)

    result = _train(model, x, target, dtensor_full_grads)
    result["views"] = views
    return result


def _case_fsdp2_meta_init(rank, world):
    """FSDP2's large-model recipe: build on the meta device, shard, to_empty,
    reset_parameters. Records the initialized full weights, then loads the
    reference weights into the shards and trains."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    with torch.device("meta"):
        model = Stack("non_reentrant")
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device="cpu")
    for m in model.modules():
        if isinstance(m, (sc.SwiGLU, nn.LayerNorm)):
            m.reset_parameters()
    initialized = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for (name, p), full in zip(model.named_parameters(), build_model().parameters()):
            p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements).to_local())
    x, target = local_batch(rank, world)

    result = _train(model, x, target, dtensor_full_grads)
    result["initialized"] = initialized
    return result


def _case_fsdp2_view(rank, world):
    """Forward only: SwiGLU outputs under FSDP2, plus a positive control (a
    wrapped module that does return a view) proving the warning is caught."""
    from torch.distributed.fsdp import fully_shard

    class ReturnsView(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, D)

        def forward(self, x):
            return self.lin(x).view(-1, D)

    torch.manual_seed(0)
    block, control = sc.SwiGLU(D, H), ReturnsView()
    fully_shard(block)
    fully_shard(control)
    x, _ = local_batch(rank, world)
    res = {}
    for name, m, inp in (("swiglu", block, x), ("swiglu_2d", block, x.reshape(-1, D)),
                         ("control", control, x)):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            y = m(inp)
        res[name] = {"warnings": [str(m.message) for m in w], "is_view": bool(y._is_view()),
                     "requires_grad": y.requires_grad}
        y.float().sum().backward()  # completes FSDP2's backward state
    return res


def _case_ddp(rank, world, reentrant=False, build=build_model):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = build("reentrant" if reentrant else "non_reentrant")
    # Reentrant checkpoint runs each block's backward as a nested backward
    # pass, so DDP's reducer sees the hooks of those params fire outside its
    # normal autograd traversal; static_graph=True is DDP's supported mode for
    # that. Reentrant checkpoint also only builds a graph through its inputs:
    # with no input requiring grad the first block would get no grads at all
    # (torch's rule, any module), so here the data requires grad.
    ddp = DDP(model, static_graph=reentrant)
    x, target = local_batch(rank, world)
    if reentrant:
        x = x.requires_grad_()

    def full_grads(m):  # DDP all-reduces (averages) into every replica's .grad
        return {clean_name(n): p.grad.detach().clone() for n, p in m.named_parameters()}

    return _train(ddp, x, target, full_grads)


def _case_fsdp1(rank, world, device):
    import functools

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model = build_model(None).to(device)  # the wrapper does the checkpointing
    fsdp = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({sc.SwiGLU}), use_orig_params=True,
                device_id=device)
    apply_activation_checkpointing(
        fsdp, check_fn=lambda m: isinstance(m, sc.SwiGLU),
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper,
                                                checkpoint_impl=CheckpointImpl.NO_REENTRANT))
    n_wrapped = sum("CheckpointWrapper" in type(m).__name__ for m in fsdp.modules())
    assert n_wrapped == N_BLOCKS, n_wrapped
    x, target = (t.to(device) for t in local_batch(rank, world))

    def full_grads(m):
        with FSDP.summon_full_params(m, with_grads=True):
            return {clean_name(n): p.grad.detach().cpu().clone() for n, p in m.named_parameters()}

    return _train(fsdp, x, target, full_grads)


def _run_case(case, rank, world, device="cpu"):
    if ":" in case:  # "module:function" of another test file, called as function(rank, world)
        module, function = case.split(":")
        return getattr(importlib.import_module(module), function)(rank, world)
    if case == "fsdp2":
        return _case_fsdp2(rank, world)
    if case == "fsdp2_gpt_oss":
        return _case_fsdp2(rank, world, build=build_gpt_oss_model)
    if case == "fsdp2_bf16":
        return _case_fsdp2(rank, world, mixed_precision=True)
    if case == "fsdp2_meta_init":
        return _case_fsdp2_meta_init(rank, world)
    if case == "fsdp2_view":
        return _case_fsdp2_view(rank, world)
    if case == "ddp":
        return _case_ddp(rank, world)
    if case == "ddp_reentrant":
        return _case_ddp(rank, world, reentrant=True)
    if case == "fsdp1":
        return _case_fsdp1(rank, world, device)
    raise ValueError(case)


# ----------------------------------------------------------------------------
# parent side

def launch(case, tmp_path, monkeypatch, world=WORLD, timeout=RANK_TIMEOUT_S):
    """Spawns `world` CPU ranks running `case` (a name above, or "module:function"
    of another test file); returns their results."""
    return rank_launcher.launch(_run_case, case, tmp_path, monkeypatch, world, timeout)


def assert_matches(result, ref, rtol=RTOL_FP32, atol=ATOL_FP32):
    from conftest import assert_nontrivial

    assert len(result["losses"]) == len(ref["losses"]) == STEPS
    for step in range(STEPS):
        torch.testing.assert_close(result["losses"][step], ref["losses"][step], rtol=rtol, atol=atol,
                                   msg=lambda m: f"loss, step {step}: {m}")
        got, exp = result["grads"][step], ref["grads"][step]
        # every parameter, full (unsharded) shape
        assert sorted(got) == sorted(exp), (sorted(got), sorted(exp))
        for name in exp:
            assert_nontrivial(got[name], f"{name} (step {step})")
            assert got[name].dtype == torch.float32
            torch.testing.assert_close(got[name], exp[name], rtol=rtol, atol=atol,
                                       msg=lambda m: f"grad {name}, step {step}: {m}")


def _no_view_warnings(result):
    bad = [w for w in result["warnings"] if "view" in w]
    assert not bad, bad


# ----------------------------------------------------------------------------
# tests

def test_fsdp2_checkpoint_input_without_grad(tmp_path, monkeypatch):
    """FSDP2 per block + root, non-reentrant checkpoint of every block; the
    first block's input does not require grad."""
    ref = reference_run()
    for result in launch("fsdp2", tmp_path, monkeypatch):
        assert_matches(result, ref)
        _no_view_warnings(result)
        assert result["views"] and not any(result["views"])


def test_fsdp2_checkpoint_with_a_glu_variant(tmp_path, monkeypatch):
    """The same with GPT-OSS's clamped, interleaved variant and x12 saved in
    8 bits (saved_x12="fp8"): FSDP2 shards the interleaved w12 by rows and
    all-gathers it whole, so the variant's fused op sees the unsharded layout."""
    ref = reference_run(build=build_gpt_oss_model)
    for result in launch("fsdp2_gpt_oss", tmp_path, monkeypatch):
        assert_matches(result, ref)


def test_fsdp2_meta_init_to_empty_reset_parameters(tmp_path, monkeypatch):
    """Meta-device build + fully_shard + to_empty + reset_parameters gives
    nn.Linear-initialized SwiGLU weights, and the sharded model then trains
    exactly like one process."""
    import math

    ref = reference_run()
    for result in launch("fsdp2_meta_init", tmp_path, monkeypatch):
        for name, w in result["initialized"].items():
            assert torch.isfinite(w).all(), name
            if name.startswith("blocks.") and name.endswith("weight"):
                bound = 1 / math.sqrt(w.shape[1])  # nn.Linear: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
                assert w.abs().max() <= bound and w.std() > bound / 4, name
        assert_matches(result, ref)


def test_fsdp2_checkpoint_bf16_mixed_precision(tmp_path, monkeypatch):
    """FSDP2 with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)."""
    from conftest import assert_nontrivial, rel_rms

    emulated = reference_run(emulate_bf16_ranks=WORLD)
    fp32 = reference_run()
    for result in launch("fsdp2_bf16", tmp_path, monkeypatch):
        _no_view_warnings(result)
        # Against the emulation of the same bf16 computation (same half-batch
        # shapes and thread count, same bf16 roundings, grads upcast and
        # averaged in fp32), the only possible differences are fp32 roundings
        # of the reduction and of the optimizer step (on CPU it is in fact
        # bitwise equal), so the fp32 tolerance applies even though one bf16
        # ulp is 2**-8 relative: a single bf16 rounding done differently
        # anywhere fails it.
        assert_matches(result, emulated)
        # And the same training signal as full fp32, within bf16 accuracy.
        for step in range(STEPS):
            assert rel_rms(result["losses"][step], fp32["losses"][step]) < BF16_VS_FP32_REL_RMS
            for name, g in fp32["grads"][step].items():
                got = result["grads"][step][name]
                assert_nontrivial(got, name)
                assert rel_rms(got, g) < BF16_VS_FP32_REL_RMS, (name, step, rel_rms(got, g))


def test_fsdp1_checkpoint_wrapper_cpu(tmp_path, monkeypatch):
    """FSDP1 (FullyShardedDataParallel per block + root, use_orig_params)
    with apply_activation_checkpointing(checkpoint_wrapper, NO_REENTRANT).
    torch 2.13 runs FSDP1 on CPU with gloo; the nccl run is the GPU test."""
    ref = reference_run()
    for result in launch("fsdp1", tmp_path, monkeypatch):
        assert_matches(result, ref)


def test_ddp_non_reentrant_checkpoint(tmp_path, monkeypatch):
    ref = reference_run()
    for result in launch("ddp", tmp_path, monkeypatch):
        assert_matches(result, ref)


def test_ddp_reentrant_checkpoint_static_graph(tmp_path, monkeypatch):
    ref = reference_run()
    for result in launch("ddp_reentrant", tmp_path, monkeypatch):
        assert_matches(result, ref)


# FSDP2 warns about a view output from torch 2.13 on (pytorch PR #181850);
# 2.12 and older stay silent, so only the is_view checks apply there.
FSDP2_WARNS_ON_VIEWS = torch.__version__ >= "2.13"


def test_fsdp2_output_is_not_a_view(tmp_path, monkeypatch):
    """FSDP2 warns when a wrapped module returns a view; SwiGLU never does
    (3-D and 2-D inputs). The control module returns a view and must warn,
    which shows the warning is really recorded."""
    for result in launch("fsdp2_view", tmp_path, monkeypatch):
        for name in ("swiglu", "swiglu_2d"):
            r = result[name]
            assert r["requires_grad"]
            assert not r["is_view"], name
            assert not [w for w in r["warnings"] if "view" in w], (name, r["warnings"])
        assert result["control"]["is_view"]
        if FSDP2_WARNS_ON_VIEWS:
            assert any("view" in w for w in result["control"]["warnings"]), result["control"]["warnings"]


@pytest.mark.gpu
def test_fsdp1_checkpoint_wrapper_torchrun(tmp_path):
    """FSDP1 (FullyShardedDataParallel, use_orig_params) with non-reentrant
    checkpoint_wrapper on every block, nccl, under torchrun."""
    world = min(2, torch.cuda.device_count())
    rank_launcher.run_torchrun(Path(__file__).resolve(), "fsdp1", tmp_path, world, RANK_TIMEOUT_S + 60)
    ref = reference_run(device="cuda")
    for r in range(world):
        # cuBLAS may pick other algorithms for the per-rank M than for the
        # full batch: still only summation order, so the fp32 tolerance holds.
        assert_matches(torch.load(tmp_path / f"rank{r}.pt"), ref)


if __name__ == "__main__":
    rank_launcher.torchrun_worker(_run_case)
