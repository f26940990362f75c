"""The Hugging Face Trainer with a ``deepspeed=`` config dict, and DeepSpeed's
own activation checkpointing, with patched models, on 2 CPU ranks (gloo,
tests/rank_launcher.py; DS_ACCELERATOR=cpu).

Trainer cases: ZeRO-2 and ZeRO-3, a tiny Llama (dense GLU MLPs) and a tiny
Mixtral (Hugging Face MoE experts), STEPS optimizer steps of
``Trainer.train()``, unpatched then patched in the same ranks from the same
seed and data; the Llama also with ``hf.apply_to`` (class-level patching)
before the model is built under zero.Init, which runs whole from its
first call. Under ZeRO-3 the model is built the way the Trainer expects
(``_from_config`` after ``TrainingArguments``, so under deepspeed.zero.Init:
partitioned at construction); the MoE model gets the experts by name
(``experts_implementation="swiglu_cupy"``) there and through ``patch`` under
ZeRO-2. The per-step losses (recorded in ``compute_loss``: the Trainer logs
losses rounded to 4 digits) and the gathered parameters after training must
agree, and the fused paths must have run (counted as in test_deepspeed.py).

How the Trainer gets a DeepSpeed engine on a CPU-only machine (accelerate
1.16, transformers 5.24): ``TrainingArguments(deepspeed=..., use_cpu=True)``.
use_cpu makes accelerate's process state a gloo MULTI_CPU one (the right
rank and world size) and the Trainer's Accelerator (made without cpu=True)
still switches to DeepSpeed for the plugin. Without use_cpu, accelerate
finds no device backend and counts each rank as process 0 of 1, and
DeepSpeed refuses the batch sizes the Trainer filled in ("train_batch_size
is not equal to micro_batch_per_gpu * gradient_acc_step * world_size").
The test checks both states, so a change there fails here first.

DeepSpeed activation checkpointing: ``deepspeed.checkpointing.configure``
then ``deepspeed.checkpointing.checkpoint(layer, hidden, ...)`` around each
decoder layer of a patched Llama under a ZeRO-3 engine (the recompute
re-enters the leaf MLP's hooks, which gather again): parity with the same
unpatched run, and every MLP call (forward and recompute) ran whole.
"""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from test_deepspeed import (BATCH, LLAMA, LR, MIXTRAL, N_LAYERS, RTOL_FP32, SEQ, STEPS, VOCAB, WORLD, _build,
                            _close, _Counts, _ds_config, _gathered_params, assert_parity_measured, engine_steps,
                            init_deepspeed_rank, launch_ranks)

if any(importlib.util.find_spec(m) is None for m in ("deepspeed", "transformers", "accelerate")):
    pytest.skip("deepspeed, transformers or accelerate is not installed (the 'test' extra has them)",
                allow_module_level=True)

RANK_TIMEOUT_S = 300

# (name, model, ZeRO stage, how the fused paths are switched on)
TRAINER_CASES = [
    ("trainer-llama-zero2", "llama", 2, "patch"),
    ("trainer-llama-zero3", "llama", 3, "patch"),
    ("trainer-llama-zero3-apply_to", "llama", 3, "apply_to"),
    ("trainer-mixtral-zero2", "mixtral", 2, "patch"),
    ("trainer-mixtral-zero3", "mixtral", 3, "experts_implementation"),
]
# (name, model): deepspeed.checkpointing around each decoder layer, ZeRO-3, patch() before initialize
DS_CHECKPOINTING_CASES = [("ds-checkpointing-llama-zero3", "llama"), ("ds-checkpointing-mixtral-zero3", "mixtral")]


def _trainer_ds_config(stage: int) -> dict:
    # The engine config of test_deepspeed.py with the Trainer's "auto" sizes.
    config = _ds_config(stage)
    config.update(train_micro_batch_size_per_gpu="auto", gradient_accumulation_steps="auto",
                  train_batch_size="auto")
    return config


def _dataset(rank_count: int):
    # The same examples on every rank; the Trainer's sampler gives each rank its share.
    gen = torch.Generator().manual_seed(100)
    ids = torch.randint(2, VOCAB, (STEPS * BATCH * rank_count, SEQ), generator=gen)
    return [{"input_ids": row, "labels": row} for row in ids]


def _full_params(model) -> dict:
    import deepspeed

    params = dict(model.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):  # a no-op for parameters ZeRO-3 does not hold
        return {name: p.detach().clone() for name, p in params.items()}


def _train_with_trainer(kind: str, stage: int, switch: str, patched: bool, world: int, out_dir,
                        monkeypatch) -> dict:
    from transformers import (LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM, Trainer,
                              TrainingArguments)

    import swiglu_cupy as sc

    losses = []

    class LossRecordingTrainer(Trainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            losses.append((loss[0] if isinstance(loss, tuple) else loss).detach().clone())
            return loss

    args = TrainingArguments(
        output_dir=str(out_dir), deepspeed=_trainer_ds_config(stage),
        use_cpu=True,
        per_device_train_batch_size=BATCH, max_steps=STEPS, learning_rate=LR, optim="sgd",
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0,
        logging_strategy="no", save_strategy="no", report_to=[], seed=0, data_seed=0,
        dataloader_num_workers=0, disable_tqdm=True)
    # Read now: the Trainer's Accelerator turns this shared state into DeepSpeed's.
    state = args.distributed_state
    process_state = (str(state.distributed_type), state.num_processes, state.process_index)
    torch.manual_seed(0)
    config = LlamaConfig(**LLAMA) if kind == "llama" else MixtralConfig(**MIXTRAL)
    cls = LlamaForCausalLM if kind == "llama" else MixtralForCausalLM
    extra = {"experts_implementation": "swiglu_cupy"} if patched and switch == "experts_implementation" else {}
    # After TrainingArguments: under ZeRO-3 this builds under deepspeed.zero.Init.
    if patched and switch == "apply_to":
        from swiglu_cupy.hf import apply_to, unapply

        apply_to(kind)  # class-level: the model is built fused
        try:
            model = cls._from_config(config, **extra)
        finally:
            unapply(kind)
    else:
        model = cls._from_config(config, **extra)
    out = {"partitioned": any(p.numel() == 0 for p in model.parameters()), "initial": _full_params(model)}
    if patched and switch == "patch":
        out["report"] = str(sc.patch(model))
    trainer = LossRecordingTrainer(model=model, args=args, train_dataset=_dataset(world))
    counts = _Counts(monkeypatch) if patched else None
    trainer.train()
    out["states"] = process_state + (str(trainer.accelerator.state.distributed_type),
                                     trainer.accelerator.num_processes)
    out["engine"] = type(trainer.model_wrapped).__name__
    out["engine_batch"] = (trainer.model_wrapped.dp_world_size, trainer.model_wrapped.train_batch_size())
    out["zero_stage"] = trainer.accelerator.state.deepspeed_plugin.zero_stage
    out["losses"] = torch.stack(losses)
    out["params"] = _gathered_params(trainer.model_wrapped)
    out["experts_impl"] = getattr(trainer.model.config, "_experts_implementation", None)
    if patched:
        monkeypatch.undo()
        out["counts"] = counts.snapshot()
        out["fusion"] = [m.fusion() for m in trainer.model.modules() if hasattr(m, "fusion")]
    trainer.model_wrapped.destroy()
    return out


def _checkpoint_each_layer(model, deepspeed, recomputed: list) -> None:
    """Runs each decoder layer's forward under deepspeed.checkpointing.checkpoint
    (reentrant: the forward runs without grad, the backward runs it again).
    Hidden states go in positionally (the tensor DeepSpeed tracks), the rest
    (mask, rotary embeddings, cache) bound by keyword."""
    for layer in model.model.layers:
        plain_forward = layer.forward

        def checkpointed(hidden_states, *args, _forward=plain_forward, **kwargs):
            def run(h):
                recomputed.append(torch.is_grad_enabled())  # False: the forward, True: the recompute
                return _forward(h, *args, **kwargs)
            return deepspeed.checkpointing.checkpoint(run, hidden_states)
        layer.forward = checkpointed


def _train_with_ds_checkpointing(kind: str, patched: bool, rank: int, monkeypatch) -> dict:
    import deepspeed

    import swiglu_cupy as sc

    model = _build(kind, 3, "before")
    out = {"report": str(sc.patch(model))} if patched else {}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                                      config=_ds_config(3))
    # No model parallelism (mpu None), activations kept whole on each rank.
    deepspeed.checkpointing.configure(None, partition_activations=False, checkpoint_in_cpu=False)
    recomputed = []
    _checkpoint_each_layer(engine.module, deepspeed, recomputed)
    counts = _Counts(monkeypatch) if patched else None
    out["partitioned"] = any(p.numel() == 0 for p in engine.module.parameters())
    out["losses"], out["params"] = engine_steps(engine, rank)
    out["recomputed"] = list(recomputed)
    if patched:
        monkeypatch.undo()
        out["counts"] = counts.snapshot()
        out["fusion"] = [m.fusion() for m in engine.module.modules() if hasattr(m, "fusion")]
    engine.destroy()
    return out


def run_case(case, rank: int, world: int) -> dict:
    import tempfile

    # What torchrun would set (one host); accelerate's MULTI_CPU state reads
    # LOCAL_WORLD_SIZE and MASTER_ADDR (the process group itself exists already).
    init_deepspeed_rank(rank, world, LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    results = {}
    with tempfile.TemporaryDirectory() as out_dir:
        for name, kind, stage, switch in TRAINER_CASES:
            if case not in ("all", name):
                continue
            with pytest.MonkeyPatch.context() as monkeypatch:
                results[name] = tuple(_train_with_trainer(kind, stage, switch, patched, world, out_dir,
                                                          monkeypatch) for patched in (False, True))
    for name, kind in DS_CHECKPOINTING_CASES:
        if case not in ("all", name):
            continue
        with pytest.MonkeyPatch.context() as monkeypatch:
            results[name] = tuple(_train_with_ds_checkpointing(kind, patched, rank, monkeypatch)
                                  for patched in (False, True))
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return launch_ranks(run_case, os.environ.get("DS_TRAINER_CASE", "all"), tmp_path_factory, "ds_trainer",
                        RANK_TIMEOUT_S)


@pytest.mark.parametrize("name,kind,stage,switch", TRAINER_CASES, ids=[c[0] for c in TRAINER_CASES])
def test_trainer_with_deepspeed_trains_like_the_unpatched_model(ranks, name, kind, stage, switch):
    for rank, results in enumerate(ranks):
        plain, patched = results[name]
        # The Trainer trained through its DeepSpeed engine at the configured stage.
        assert plain["engine"] == patched["engine"] == "DeepSpeedEngine"
        assert plain["states"] == patched["states"] == ("DistributedType.MULTI_CPU", WORLD, rank,
                                                        "DistributedType.DEEPSPEED", WORLD)
        assert plain["engine_batch"] == (WORLD, BATCH * WORLD)
        assert plain["zero_stage"] == patched["zero_stage"] == stage
        assert plain["partitioned"] == patched["partitioned"] == (stage == 3), \
            "under ZeRO-3 the Trainer's model is built partitioned (deepspeed.zero.Init)"
        assert len(plain["losses"]) == len(patched["losses"]) == STEPS
        _close(plain["losses"], patched["losses"], f"rank {rank} losses")
        assert plain["params"].keys() == patched["params"].keys()
        for key, before in plain["params"].items():
            _close(before, patched["params"][key], f"rank {rank} {key}")
            _close(ranks[0][name][1]["params"][key], patched["params"][key], f"rank {rank} vs rank 0 {key}")
        _assert_trained(plain, kind)
        counts = patched["counts"]
        if kind == "llama":
            # Every MLP call of every step ran the whole fused MLP, the first
            # included; patched partitioned (ZeRO-3), each MLP's probe ran the
            # fused op once more (apply_to: the class was verified, no probe).
            probes = N_LAYERS if stage == 3 and switch == "patch" else 0
            assert counts == dict(whole=N_LAYERS * STEPS + probes, activation=0, experts=0), patched.get("report")
            assert patched["fusion"] == ["mlp"] * N_LAYERS
        else:
            assert patched["experts_impl"] == "swiglu_cupy" != plain["experts_impl"]
            # Resolved at the first forward (on the weights ZeRO-3 gathered),
            # each experts module's forward check ran the fused op once more.
            checks = N_LAYERS if switch == "experts_implementation" else 0
            assert counts == dict(whole=0, activation=0, experts=N_LAYERS * STEPS + checks)
    # Each rank trained on its own share of the data (the Trainer's distributed sampler).
    assert not torch.equal(ranks[0][name][0]["losses"], ranks[1][name][0]["losses"])


def _assert_trained(plain: dict, kind: str) -> None:
    """The feed-forward weights moved far past the tolerances (else parity says nothing)."""
    ffn = [k for k in plain["params"] if ".mlp." in k or "experts" in k]
    assert ffn
    for key in ffn:
        start, end = plain["initial"][key], plain["params"][key]
        moved = ((end - start).abs().max() / start.abs().max()).item()
        assert moved > 100 * RTOL_FP32, f"{key} moved only {moved:.1e} relative"


@pytest.mark.parametrize("name,kind", DS_CHECKPOINTING_CASES, ids=[c[0] for c in DS_CHECKPOINTING_CASES])
def test_deepspeed_activation_checkpointing_around_patched_layers(ranks, name, kind):
    for rank, results in enumerate(ranks):
        plain, patched = results[name]
        # Each layer ran once without grad (the checkpointed forward) and once with it (the recompute).
        expected = ([False] * N_LAYERS + [True] * N_LAYERS) * STEPS
        assert plain["recomputed"] == patched["recomputed"] == expected
        assert plain["partitioned"] and patched["partitioned"]
        _close(plain["losses"], patched["losses"], f"rank {rank} losses")
        assert not torch.equal(plain["losses"][0], plain["losses"][-1]), "training moved nothing"
        for key, before in plain["params"].items():
            _close(before, patched["params"][key], f"rank {rank} {key}")
        counts = patched["counts"]
        if kind == "llama":
            # Forward and recompute both ran the whole MLP, fused, on the weights its leaf hooks gathered.
            assert counts == dict(whole=2 * N_LAYERS * STEPS, activation=0, experts=0), patched["report"]
            assert patched["fusion"] == ["mlp"] * N_LAYERS
        else:
            assert counts == dict(whole=0, activation=0, experts=2 * N_LAYERS * STEPS), patched["report"]


def test_the_parity_is_measured(ranks):
    """The largest relative differences seen (printed with -s); the
    tolerances are test_deepspeed.py's (the same ops, steps and layers)."""
    assert_parity_measured(ranks)
