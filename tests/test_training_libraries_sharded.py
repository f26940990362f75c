"""``swiglu_cupy.patch`` under the sharding entry points of litgpt, torchtune
and OLMo-core, on 2 CPU ranks (gloo, tests/rank_launcher.py).

Each case builds the library's stock tiny model (the builders of
tests/test_training_libraries.py), shards it with the library's own entry
point, and trains it for STEPS SGD steps on each rank's own batches, twice
in the same ranks from the same seed: unpatched, then patched with
``swiglu_cupy.patch`` before the sharding call, or after it. The per-step
losses and the full (gathered) parameters after the last step must agree,
and the fused op's calls are counted in the ranks (the whole-MLP op, or the
activation-only ``glu_mul`` where the projections run as themselves).

Entry points:
  torchtune:  ``torchtune.training.shard_model`` (FSDP2 ``fully_shard`` on
              every ``TransformerSelfAttentionLayer``, then the root), as its
              distributed recipes call it.
  OLMo-core:  ``Transformer.apply_fsdp`` (FSDP2; its ``full`` wrapping, each
              block and the LM head, and ``fine_grained``, which also shards
              each block's attention and feed-forward on their own) and
              ``Transformer.apply_tp`` (tensor parallelism 2: w1/w3
              column-wise, w2 row-wise, sequence parallel norms); also
              ``apply_fsdp`` on ``llama_like_moe`` (dropless experts; the
              Triton routing stood in by plain torch) and on ``ngpt_like``,
              whose experts and nGPT feed-forwards patch() switches by class:
              fused whole patched before or after FSDP2 (no probe; the
              block's hooks unshard the weights around the switched forward).
  litgpt:     Lightning Fabric's ``ModelParallelStrategy`` (FSDP2), with
              litgpt's own ``parallelize_fn`` (litgpt/finetune/lora.py: it
              shards every trainable ``nn.Linear`` by itself, the blocks and
              the root) and with a function that shards each ``Block`` and the
              root (the FSDP2 form of the ``auto_wrap_policy={Block}`` that
              litgpt's pretrain and full finetune give ``FSDPStrategy``).
              ``FSDPStrategy`` itself (FSDP1) cannot run here: Fabric refuses
              it off the GPU (its connector raises "You selected the FSDP
              strategy but FSDP is only available on GPU" for
              accelerator="cpu"); rank 0 checks that this is still so.

Patched before sharding, the feed-forwards run the whole MLP fused wherever
the sharding leaves their projections plain ``nn.Linear`` (FSDP2 on a block
or on the feed-forward itself: its hooks unshard the weights around the
fused forward); where it puts hooks on each projection (litgpt's per-Linear
``fully_shard``, OLMo-core's TP styles) the fused forward runs the
projections as themselves and only ``act(gate) * up`` fused, and patch()
again says so. Patched after FSDP2, the weights are DTensor shards outside
the sharded module's forward: patch() does not probe a feed-forward that
FSDP2 manages (probing one whose projections ``fully_shard`` got, as after
litgpt's function, broke FSDP's lazy init: the first step raised), and the
report names every one, skipped, with that reason (never silently). Patched
after TP, the probe runs through the TP styles' hooks and fuses the
activation, as patched before.

All cases run in one launch of 2 ranks (the three libraries' imports take
most of the time on 2 shared cores); each test checks its case.
"""
from __future__ import annotations

import importlib
import importlib.util
import os

import pytest
import torch

import rank_launcher
import test_training_libraries as ttl

WORLD = 2
RANK_TIMEOUT_S = 240
STEPS, LR = 3, 0.5  # lr large enough that each step moves the weights well past the tolerances
BATCH, SEQ = 2, 12
ROWS = BATCH * SEQ  # rows of each feed-forward call on a rank
TOP_K = 2  # the MoE model's experts run ROWS * TOP_K routed rows a layer (dropless)
N_LAYERS = 2  # every tiny model here has two blocks, one feed-forward each

# fp32 tolerances. The patched and unpatched runs shard, reduce and step
# alike; they differ only in how each feed-forward is computed: the fused
# op's CPU path against three nn.Linear calls (or, activation only, glu_mul
# against act(gate) * up). Those may round differently by a few fp32 ulps
# (eps 1.2e-7) per layer, carried through 2 layers and 3 SGD steps; the
# unsharded tests measured up to 3e-6 of a tensor's scale on single
# gradients (test_training_libraries.py). Measured here
# (test_the_parity_is_measured, -s): 0 for the losses and every parameter,
# over every case and rank (torch 2.13 CPU: the fused op's GEMMs and
# product are the same ops as the modules'). rtol 1e-5 (~80 eps), the
# value of test_deepspeed.py and of the unsharded tests, leaves margin for
# other BLAS blockings; atol 1e-6 matters only for weights near zero. A
# missed unshard (zero or shard-sized weights), a dropped or doubled
# gradient reduction, or a wrong activation is O(1) relative and fails at once.
RTOL_FP32, ATOL_FP32 = 1e-5, 1e-6

# name -> (library, entry point, when patch() runs): each entry point patched before and after it
# (OLMo-core's "apply_fsdp_moe"/"apply_fsdp_ngpt": apply_fsdp on the modules patch() switches by
# class, its dropless MoE experts and nGPT's feed-forward)
ENTRY_POINTS = [("torchtune", "shard_model"), ("olmo_core", "apply_fsdp"), ("olmo_core", "apply_fsdp_fine_grained"),
                ("olmo_core", "apply_tp"), ("olmo_core", "apply_fsdp_moe"), ("olmo_core", "apply_fsdp_ngpt"),
                ("litgpt", "fabric_fsdp2_blocks"), ("litgpt", "fabric_fsdp2_litgpt_fn")]
CLASS_SWITCHED = ("apply_fsdp_moe", "apply_fsdp_ngpt")
CASES = {f"{library}-{entry}-{when}": (library, entry, when)
         for library, entry in ENTRY_POINTS for when in ("before", "after")}


def _installed(library: str) -> bool:
    return importlib.util.find_spec(library) is not None


# ---- in the ranks ----------------------------------------------------------------------------

def _full(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    p = p.detach()
    return (p.full_tensor() if isinstance(p, DTensor) else p).clone()


def _steps(model, params, rank: int, vocab: int, same_batch: bool, backward=None, optimizer=None):
    """STEPS SGD steps of next-token cross-entropy on the rank's own batches
    (the same on every rank under TP, whose ranks share one batch): the
    per-step losses and the full parameters after them."""
    from torch.distributed.tensor import DTensor

    optimizer = optimizer or torch.optim.SGD(params, lr=LR)
    gen = torch.Generator().manual_seed(100 + (0 if same_batch else rank))
    losses = []
    for _ in range(STEPS):
        ids = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=gen)
        logits = model(ids[:, :-1])
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        (backward or torch.Tensor.backward)(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().clone())
    return torch.stack(losses)


class _Libraries:
    """The libraries, imported once per rank (torchtune and OLMo-core with
    the stand-ins of tests/stand_ins, as in test_training_libraries.py)."""

    def __init__(self):
        self.torchtune = self.olmo_core = self.litgpt = None
        if _installed("torchtune"):
            # torchtune.training (shard_model) imports torchao's quantizers too
            self.torchtune = ttl.import_torchtune("training")
        if _installed("olmo_core"):
            with ttl.stand_ins_for_import(("cached_path",)):
                self.olmo_core = importlib.import_module("olmo_core.nn.transformer")
        if _installed("litgpt"):
            self.litgpt = importlib.import_module("litgpt")


def _build(libs: _Libraries, library: str, entry: str):
    """(model, vocab, feed-forward class) of the library's stock tiny model."""
    if library == "torchtune":
        from torchtune.modules import FeedForward

        return ttl.torchtune_model(libs.torchtune, "llama3_2"), ttl.VOCAB, FeedForward
    if entry == "apply_fsdp_moe":
        from olmo_core.nn.moe.mlp import DroplessMoEMLP

        model = ttl.olmo_model(libs.olmo_core, "llama_like_moe", num_experts=4, top_k=TOP_K, expert_hidden_size=48,
                               hidden_size_multiple_of=16, dropless=True)
        return model, 128, DroplessMoEMLP
    if entry == "apply_fsdp_ngpt":
        from olmo_core.nn.feed_forward import NormalizedFeedForward

        return ttl.ngpt_model(libs.olmo_core), 128, NormalizedFeedForward
    if library == "olmo_core":
        from olmo_core.nn.feed_forward import FeedForward

        return ttl.olmo_model(libs.olmo_core, "llama_like", hidden_size_multiple_of=16), 128, FeedForward
    import litgpt.model as lm

    return ttl.litgpt_model(libs.litgpt, "Llama-3.2-1B"), ttl.VOCAB, lm.LLaMAMLP


def _litgpt_blocks_fn(model, device_mesh):
    """FSDP2 on each ``Block`` and the root: what litgpt's pretrain and full
    finetune ask of ``FSDPStrategy(auto_wrap_policy={Block})``, as a
    ``ModelParallelStrategy`` parallelize function."""
    from litgpt.model import Block
    from torch.distributed.fsdp import fully_shard

    for block in model.transformer.h:
        assert isinstance(block, Block)
        fully_shard(block, mesh=device_mesh["data_parallel"])
    fully_shard(model, mesh=device_mesh["data_parallel"])
    return model


def _fabric(entry: str, patch_after, world: int):
    """Lightning Fabric with ``ModelParallelStrategy`` (data parallel 2) on the
    CPU, in the ranks the launcher started (it adopts their process group)."""
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy

    if entry == "fabric_fsdp2_litgpt_fn":
        from litgpt.finetune.lora import parallelize_fn

        def parallelize(model, mesh):  # litgpt's own; no activation checkpointing (its default wraps blocks)
            return patch_after(parallelize_fn(model, mesh, activation_checkpointing=False))
    else:
        def parallelize(model, mesh):
            return patch_after(_litgpt_blocks_fn(model, mesh))
    strategy = ModelParallelStrategy(parallelize_fn=parallelize, data_parallel_size=world, tensor_parallel_size=1)
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy, precision="32-true")
    fabric.launch()
    return fabric


def _train(libs: _Libraries, library: str, entry: str, when: str, patched: bool, rank: int, world: int) -> dict:
    import swiglu_cupy as sc
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    model, vocab, ff_class = _build(libs, library, entry)
    out = {"paths": [p for p, m in model.named_modules() if isinstance(m, ff_class)]}
    if patched and when == "before":
        out["report"] = _plain(sc.patch(model))

    def patch_after(sharded):
        if patched and when == "after":
            out["report"] = _plain(sc.patch(sharded))
        return sharded

    mesh = init_device_mesh("cpu", (world,))
    backward = optimizer = None
    trained = model
    if entry == "shard_model":
        from torchtune.modules import TransformerSelfAttentionLayer

        libs.torchtune.training.shard_model(
            model, [lambda name, m: isinstance(m, TransformerSelfAttentionLayer)], cpu_offload=False, dp_mesh=mesh)
        patch_after(model)
    elif entry.startswith("apply_fsdp"):
        from olmo_core.nn.transformer.config import TransformerDataParallelWrappingStrategy as Wrapping

        wrapping = Wrapping.fine_grained if entry.endswith("fine_grained") else Wrapping.full
        model.apply_fsdp(dp_mesh=mesh, wrapping_strategy=wrapping)
        patch_after(model)
    elif entry == "apply_tp":
        model.apply_tp(mesh)
        patch_after(model)
    else:
        fabric = _fabric(entry, patch_after, world)
        trained = fabric.setup_module(model)  # runs the parallelize function
        model = trained.module
        optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=LR))
        backward = fabric.backward
    out["sharded"] = any(isinstance(p, DTensor) for p in model.parameters())
    with pytest.MonkeyPatch.context() as monkeypatch:
        whole = ttl.count_whole_mlp_calls(monkeypatch)
        activation = _count_glu_mul(monkeypatch)
        switched = _count_class_switched(monkeypatch)
        if entry == "apply_fsdp_moe":
            ttl.use_plain_torch_moe_routing(monkeypatch)  # OLMo-core's Triton routing kernels: no CPU form
        out["losses"] = _steps(trained, model.parameters(), rank, vocab, entry == "apply_tp", backward, optimizer)
    out["params"] = {name: _full(p) for name, p in model.named_parameters()}
    if patched:
        out["whole"], out["activation"], out["switched"] = whole, activation, switched
        out["fusion"] = {p: getattr(model.get_submodule(p), "fusion", lambda: None)() for p in out["paths"]}
        out["again"] = _plain(sc.patch(model))  # what patch() says of the trained, sharded model
    return out


def _plain(report) -> dict:
    """A PatchReport as plain data (what the launcher's torch.load accepts), its text under "text"."""
    return dict(fused=report.fused, partial=report.partial, skipped=report.skipped, pending=report.pending,
                already=report.already, count=len(report), text=str(report))


def _count_glu_mul(monkeypatch) -> list[int]:
    """Calls of the activation-only fused op (``act(gate) * up``): their rows."""
    from swiglu_cupy.integrations import plan_runner

    calls, real = [], plan_runner.glu_mul

    def counting(gate, *args, **kwargs):
        calls.append(gate.shape[:-1].numel())
        return real(gate, *args, **kwargs)

    monkeypatch.setattr(plan_runner, "glu_mul", counting)
    return calls


def _count_class_switched(monkeypatch) -> dict:
    """Calls of the fused ops by OLMo-core's class-switched modules (the experts'
    ``grouped_experts_unpacked``, nGPT's ``swiglu_unpacked``): their rows, by op."""
    from swiglu_cupy.integrations import olmo_core as olmo_core_integration

    return {name: ttl.count_whole_mlp_calls(monkeypatch, olmo_core_integration, name)
            for name in ("grouped_experts_unpacked", "swiglu_unpacked")}


def _fsdp1_refusal() -> str | None:
    """Fabric's refusal of ``FSDPStrategy`` (FSDP1) on the CPU, or None if it
    now accepts it (then this file should test it)."""
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import FSDPStrategy

    try:
        Fabric(accelerator="cpu", devices=2, strategy=FSDPStrategy())
    except ValueError as e:
        return str(e)
    return None


def run_case(case, rank: int, world: int) -> dict:
    # What a launcher sets, which Fabric reads: LOCAL_RANK says that the processes
    # exist (it starts none); it adopts the process group rank_launcher made.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    libs = _Libraries()
    results = {}
    for name, (library, entry, when) in CASES.items():
        if case in ("all", name) and getattr(libs, library) is not None:
            results[name] = tuple(_train(libs, library, entry, when, patched, rank, world)
                                  for patched in (False, True))
    if rank == 0 and libs.litgpt is not None:
        results["fsdp1_refusal"] = _fsdp1_refusal()
    return results


# ---- the tests -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    if not any(_installed(library) for library in ("torchtune", "olmo_core", "litgpt")):
        pytest.skip("none of litgpt, torchtune, ai2-olmo-core is installed")
    with pytest.MonkeyPatch.context() as monkeypatch:
        return rank_launcher.launch(run_case, "all", tmp_path_factory.mktemp("sharded"), monkeypatch,
                                    WORLD, RANK_TIMEOUT_S)


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(b, a, rtol=RTOL_FP32, atol=ATOL_FP32, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("name", sorted(CASES))
def test_patched_model_trains_like_the_unpatched_one_under_the_library_sharding(ranks, name):
    library, entry, when = CASES[name]
    if not _installed(library):
        pytest.skip(f"{library} is not installed; CI installs it with: {ttl.PEERS_PIP}")
    for rank, results in enumerate(ranks):
        plain, patched = results[name]
        assert plain["sharded"] and patched["sharded"], "the entry point sharded nothing"
        _close(plain["losses"], patched["losses"], f"rank {rank} losses")
        assert plain["params"].keys() == patched["params"].keys()
        for key, before in plain["params"].items():
            _close(before, patched["params"][key], f"rank {rank} {key}")
            # every rank gathers the same full parameters
            _close(ranks[0][name][1]["params"][key], patched["params"][key], f"rank {rank} vs rank 0 {key}")
        assert not torch.equal(plain["losses"][0], plain["losses"][-1]), "training moved nothing"
        _check_fusion(rank, entry, when, patched)


def _check_fusion(rank: int, entry: str, when: str, patched: dict) -> None:
    """What ran fused in the rank, and what patch() said of it."""
    paths, report, again = patched["paths"], patched["report"], patched["again"]
    assert len(paths) == N_LAYERS, paths
    calls = [ROWS] * (N_LAYERS * STEPS)  # one call per feed-forward and step (no checkpointing)
    if entry in CLASS_SWITCHED:
        # Switched by class, no probe: before or after FSDP2 (whose hooks on the block
        # unshard the weights around the switched forward) the whole op runs
        assert sorted(report["fused"]) == sorted(paths) and not report["skipped"], f"rank {rank}\n{report['text']}"
        assert sorted(again["already"]) == sorted(paths), again["text"]
        op, rows = ("grouped_experts_unpacked", ROWS * TOP_K) if entry == "apply_fsdp_moe" else ("swiglu_unpacked", ROWS)
        want = [rows] * len(calls)
        if when == "after":
            # Patched on FSDP2's sharded (DTensor) weights: each switch is proved against OLMo-core's own
            # forward at its first forward, on the probe input (integrations.switch_proof), which runs the op
            # once more there: 10 rows for the 4 experts' (3, 0, 5, 2), 6 for nGPT's feed-forward.
            probe = 10 if entry == "apply_fsdp_moe" else 6
            want = [probe, rows] * N_LAYERS + [rows] * (len(calls) - N_LAYERS)
        assert patched["switched"] == {"grouped_experts_unpacked": [], "swiglu_unpacked": [], op: want}
        assert patched["whole"] == patched["activation"] == [], f"rank {rank}"
        return
    hooked = entry in ("apply_tp", "fabric_fsdp2_litgpt_fn")  # hooks on every projection
    if when == "after" and not entry == "apply_tp":
        # FSDP2 sharded first: every feed-forward is named, skipped, with the cause
        assert sorted(report["skipped"]) == sorted(paths) and report["count"] == 0, f"rank {rank}\n{report['text']}"
        for path in paths:
            reason = report["skipped"][path]
            assert reason.startswith("not probed: sharded by FSDP2") and "patch before sharding" in reason, reason
        assert patched["whole"] == patched["activation"] == [], f"rank {rank}: fused code ran"
        assert sorted(again["skipped"]) == sorted(paths) and again["count"] == 0, f"rank {rank}\n{again['text']}"
        return
    if when == "before":  # plain nn.Linear projections at patch() time: fused whole
        assert sorted(report["fused"]) == sorted(paths) and not report["skipped"], f"rank {rank}\n{report['text']}"
    if hooked:
        # torch's TP styles or FSDP2 on each projection: the projections run as
        # themselves (their hooks shard, unshard, redistribute), act(gate)*up fused
        assert patched["fusion"] == dict.fromkeys(paths, "activation")
        assert patched["whole"] == [] and len(patched["activation"]) == len(calls), f"rank {rank}"
        table = report if when == "after" else again
        assert sorted(table["partial"]) == sorted(paths) and not table["fused"], f"rank {rank}\n{table['text']}"
        assert all("run as themselves" in table["partial"][p] and "has hooks" in table["partial"][p] for p in paths), \
            table["text"]
    else:
        # FSDP2 on the block (or on the feed-forward itself): its hooks unshard the
        # weights around the fused forward, which runs the whole MLP
        assert patched["fusion"] == dict.fromkeys(paths, "mlp")
        assert patched["whole"] == calls and patched["activation"] == [], f"rank {rank}"
        assert sorted(again["fused"]) == sorted(paths) and sorted(again["already"]) == sorted(paths), again["text"]


def test_litgpt_fsdp1_strategy_is_refused_on_the_cpu(ranks):
    """Why litgpt's ``FSDPStrategy`` path (pretrain, full finetune) is not
    tested here: Fabric refuses it off the GPU, before anything is sharded."""
    if not _installed("litgpt"):
        pytest.skip(f"litgpt is not installed; CI installs it with: {ttl.PEERS_PIP}")
    refusal = ranks[0]["fsdp1_refusal"]
    assert refusal is not None and "FSDP is only available on GPU" in refusal, refusal


def test_the_parity_is_measured(ranks):
    """The largest relative differences, plain vs patched, over every case
    and rank (printed with -s), below RTOL_FP32: the tolerances stay grounded."""
    worst_loss = worst_param = 0.0
    for results in ranks:
        for name in CASES:
            if name not in results:
                continue
            plain, patched = results[name]
            worst_loss = max(worst_loss, ((plain["losses"] - patched["losses"]).abs()
                                          / plain["losses"].abs()).max().item())
            for key, a in plain["params"].items():
                worst_param = max(worst_param, ((a - patched["params"][key]).abs().max() / a.abs().max()).item())
    print(f"max relative diff: loss {worst_loss:.2e}, parameters {worst_param:.2e} (per tensor, vs its max)")
    assert worst_loss < RTOL_FP32 and worst_param < RTOL_FP32
