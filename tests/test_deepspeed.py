"""DeepSpeed ZeRO stages 1, 2 and 3 with patched Hugging Face models, on 2
CPU ranks (gloo, tests/rank_launcher.py; DS_ACCELERATOR=cpu).

Each case trains a tiny Llama (dense GLU MLPs) or a tiny Mixtral (Hugging
Face MoE experts) for STEPS optimizer steps under one DeepSpeed engine,
twice in the same ranks from the same seed: unpatched, then patched with
``swiglu_cupy.patch``. The per-step losses and the gathered parameters after
the last step must agree. Under ZeRO-3 (parameters partitioned) the fused
MLPs must run whole ("mlp": one fused op reading gate/up/down, which ZeRO-3
gathers because patch() made each MLP a leaf module), never the
activation-only fallback that ZeRO's hooks on the projections caused before;
the experts must run swiglu_cupy's experts function. Counted by wrapping the
functions the fused forward calls, not by asking it what it would do.

Cases under ZeRO-3: patch() before deepspeed.initialize, patch() after it
(the projections carry ZeRO-3's hooks), Hugging Face gradient checkpointing
(the recompute gathers again), and a model built under deepspeed.zero.Init
(partitioned at construction, so the probe decides at the first forward).

All cases run in one launch of 2 ranks (deepspeed, transformers and the
engines take most of the time on 2 shared cores); each test checks its case.
No DeepSpeed C++ op is built: torch.optim.SGD (zero_force_ds_cpu_optimizer
off) and gloo's collectives (the CPU shared-memory allreduce op is switched
off before the engine would compile it).
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

import rank_launcher

# Found, not imported: this process (and the other test files) must not load deepspeed.
if importlib.util.find_spec("deepspeed") is None or importlib.util.find_spec("transformers") is None:
    pytest.skip("deepspeed or transformers is not installed (the 'test' extra has both)", allow_module_level=True)

WORLD = 2
RANK_TIMEOUT_S = 240
STEPS, LR = 3, 0.5  # lr large enough that each step moves the weights well past the tolerances
BATCH, SEQ, VOCAB = 2, 8, 64

LLAMA = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=2, vocab_size=VOCAB, pad_token_id=0, eos_token_id=1, bos_token_id=1)
MIXTRAL = dict(LLAMA, num_local_experts=4, num_experts_per_tok=2)
N_LAYERS = LLAMA["num_hidden_layers"]

# (name, model, ZeRO stage, variant)
CASES = [
    ("llama-zero1", "llama", 1, "before"),
    ("llama-zero2", "llama", 2, "before"),
    ("llama-zero3-before", "llama", 3, "before"),
    ("llama-zero3-after", "llama", 3, "after"),
    ("llama-zero3-ckpt", "llama", 3, "ckpt"),
    ("llama-zero3-zeroinit", "llama", 3, "zero_init"),
    ("llama-zero3-unmarked", "llama", 3, "unmarked"),
    ("llama-zero3-offload", "llama", 3, "offload"),
    ("mixtral-zero1", "mixtral", 1, "before"),
    ("mixtral-zero2", "mixtral", 2, "before"),
    ("mixtral-zero3", "mixtral", 3, "before"),
    ("mixtral-zero3-after", "mixtral", 3, "after"),
    ("mixtral-zero3-offload", "mixtral", 3, "offload"),
]

# fp32 tolerances. The patched and unpatched runs do the same math in a
# different order: the fused op's CPU path computes act(gate)*up and the
# down projection in its own kernels (its GEMM blocking and summation order
# differ from three separate nn.Linear calls), the experts function sums
# each token's K expert outputs in fp32 in a fixed order. So they differ by
# a few fp32 roundings (eps 1.2e-7) per op, carried through 2 layers and 3
# SGD steps. Measured (test_the_parity_is_measured, -s): max relative diff
# 1.1e-7 for the losses, 2.1e-7 for a parameter tensor (vs its max |w|),
# over every case and rank. rtol 1e-5 (~80 eps, ~50x that) leaves margin
# for other BLAS blockings; atol 1e-6 matters only for weights near zero and
# is < 1e-3 of every weight tensor's scale (>= 1e-2 here). A missed gather
# (zero weights), a dropped or doubled gradient reduction, or a wrong
# activation is O(1) relative and fails at once.
RTOL_FP32, ATOL_FP32 = 1e-5, 1e-6


def _ds_config(stage: int, offload_param: bool = False) -> dict:
    zero = {"stage": stage}
    if stage == 3:
        # Every parameter partitioned: by default ZeRO-3 keeps parameters
        # under 1e5 elements gathered ("persistent"), which is all of a tiny
        # model, and nothing would be gathered by the hooks under test.
        zero.update(stage3_param_persistence_threshold=0, stage3_model_persistence_threshold=0)
    if offload_param:
        # ZeRO-Infinity's parameter offload: partitions live on the offload
        # device and are fetched from it. On these CPU ranks the offload
        # device is the compute device, so this runs the offload code path
        # (its fetch and release), not host-device transfers.
        zero["offload_param"] = {"device": "cpu", "pin_memory": False}
    return {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
            "zero_optimization": zero, "zero_force_ds_cpu_optimizer": False,
            "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9}


def _build(kind: str, stage: int, variant: str):
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**LLAMA) if kind == "llama" else MixtralConfig(**MIXTRAL)
    cls = LlamaForCausalLM if kind == "llama" else MixtralForCausalLM
    if variant == "zero_init":
        # How Hugging Face builds under ZeRO-3 (from_pretrained does the same):
        # with an HfDeepSpeedConfig alive, _from_config builds under
        # deepspeed.zero.Init and initialises the weights gathered.
        from transformers.integrations import HfDeepSpeedConfig

        hf_ds_config = HfDeepSpeedConfig(_ds_config(stage))
        model = cls._from_config(config)
        del hf_ds_config  # later cases are built outside ZeRO-3 (transformers holds a weak reference)
        assert all(p.numel() == 0 for p in model.parameters()), "not partitioned at construction"
    else:
        model = cls(config)
    model.train()
    if variant == "ckpt":
        model.gradient_checkpointing_enable()
    return model


class _Counts:
    """How often the fused forward ran the whole MLP, the activation-only
    fallback, and the experts function (wrapping the functions it calls)."""

    def __init__(self, monkeypatch):
        from swiglu_cupy.integrations import hf_experts, plan_runner

        self.whole = self.activation = self.experts = 0

        def counting(module, name, field):
            original = getattr(module, name)

            def wrapper(*args, **kwargs):
                setattr(self, field, getattr(self, field) + 1)
                return original(*args, **kwargs)
            monkeypatch.setattr(module, name, wrapper)

        counting(plan_runner, "swiglu", "whole")  # the whole MLP fused, either layout
        counting(plan_runner, "swiglu_unpacked", "whole")
        counting(plan_runner, "run_feed_forward", "whole")  # the usual separate projections (swiglu_unpacked's body)
        counting(plan_runner, "glu_mul", "activation")
        counting(hf_experts, "route_and_combine", "experts")

    def snapshot(self) -> dict:
        return dict(whole=self.whole, activation=self.activation, experts=self.experts)


def _gathered_params(engine) -> dict:
    import deepspeed

    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):  # a no-op below ZeRO-3
        return {name: p.detach().clone() for name, p in params.items()}


def engine_steps(engine, rank: int) -> tuple[torch.Tensor, dict]:
    """STEPS training steps of a causal LM engine on the rank's own batches (the
    same in the plain and patched runs): the per-step losses and the gathered
    parameters after them. Shared with test_deepspeed_trainer.py."""
    gen = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(STEPS):
        ids = torch.randint(2, VOCAB, (BATCH, SEQ), generator=gen)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().clone())
    return torch.stack(losses), _gathered_params(engine)


def _train(kind: str, stage: int, variant: str, patched: bool, rank: int, monkeypatch) -> dict:
    import deepspeed

    import swiglu_cupy as sc

    model = _build(kind, stage, variant)
    out = {}
    if patched and variant == "unmarked":
        # patch() before deepspeed was imported (it checks sys.modules): it
        # cannot mark the MLPs, so deepspeed.initialize hooks the projections;
        # the first call finds ZeRO-3's hooks and makes each MLP a leaf.
        with pytest.MonkeyPatch.context() as hide:
            hide.delitem(sys.modules, "deepspeed")
            out["report"] = str(sc.patch(model))
    elif patched and variant != "after":
        out["report"] = str(sc.patch(model))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                      config=_ds_config(stage, offload_param=variant == "offload"))
    out["offload_param"] = bool(engine.zero_offload_param())
    if patched and variant == "after":
        out["report"] = str(sc.patch(engine.module))
    counts = _Counts(monkeypatch) if patched else None
    out["partitioned"] = any(p.numel() == 0 for p in engine.module.parameters())
    out["losses"], out["params"] = engine_steps(engine, rank)
    if patched:
        monkeypatch.undo()
        out["counts"] = counts.snapshot()
        out["fusion"] = [m.fusion() for m in engine.module.modules() if hasattr(m, "fusion")]
        out["leaf"] = [deepspeed.utils.z3_leaf_module(m) for m in engine.module.modules() if hasattr(m, "fusion")]
        out["hooked_projections"] = sum(bool(lin._forward_pre_hooks) for m in engine.module.modules()
                                        if hasattr(m, "fusion") for lin in m.children())
        out["experts_impl"] = getattr(engine.module.config, "_experts_implementation", None)
    engine.destroy()
    return out


def init_deepspeed_rank(rank: int, world: int, **env: str) -> None:
    """In a rank of ``launch_ranks``: what a launcher would set (one host: the
    local rank is the rank; ``env`` adds to it), then DeepSpeed's distributed
    init over the launcher's gloo group. Shared by the DeepSpeed test files."""
    os.environ.update(DS_ACCELERATOR="cpu", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), **env)
    import deepspeed
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    # No C++ op: DeepSpeed's CPU backend would compile its shared-memory
    # allreduce at init (a minute, a compiler); gloo does the collectives.
    deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False
    deepspeed.init_distributed(dist_backend="gloo")  # adopts the launcher's process group


def launch_ranks(run_case, case: str, tmp_path_factory, label: str, timeout_s: float) -> list:
    """WORLD CPU ranks running ``run_case(case, rank, WORLD)`` with DeepSpeed's
    CPU accelerator; their results in rank order. Shared by the DeepSpeed test files."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("DS_ACCELERATOR", "cpu")
        return rank_launcher.launch(run_case, case, tmp_path_factory.mktemp(label), monkeypatch, WORLD, timeout_s)


def run_case(case, rank: int, world: int) -> dict:
    init_deepspeed_rank(rank, world)
    results = {}
    for name, kind, stage, variant in CASES if case == "all" else [c for c in CASES if c[0] == case]:
        with pytest.MonkeyPatch.context() as monkeypatch:
            results[name] = (_train(kind, stage, variant, False, rank, monkeypatch),
                             _train(kind, stage, variant, True, rank, monkeypatch))
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return launch_ranks(run_case, "all", tmp_path_factory, "deepspeed", RANK_TIMEOUT_S)


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(b, a, rtol=RTOL_FP32, atol=ATOL_FP32, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("name,kind,stage,variant", CASES, ids=[c[0] for c in CASES])
def test_patched_model_trains_like_the_unpatched_one(ranks, name, kind, stage, variant):
    for rank, results in enumerate(ranks):
        plain, patched = results[name]
        _close(plain["losses"], patched["losses"], f"rank {rank} losses")
        assert plain["params"].keys() == patched["params"].keys()
        for key, before in plain["params"].items():
            _close(before, patched["params"][key], f"rank {rank} {key}")
        for key in plain["params"]:  # both ranks hold the same full parameters after every step
            _close(ranks[0][name][1]["params"][key], patched["params"][key], f"rank {rank} vs rank 0 {key}")
        assert not torch.equal(plain["losses"][0], plain["losses"][-1]), "training moved nothing"
        assert patched["partitioned"] == (stage == 3), "ZeRO-3 partitions, stages 1 and 2 do not"
        assert plain["offload_param"] == patched["offload_param"] == (variant == "offload")
        counts = patched["counts"]
        if kind == "llama":
            # Every MLP call ran the whole fused MLP (twice per step with the
            # checkpoint recompute); none fell back to activation-only fusion.
            # Patched while partitioned (after initialize, zero.Init): the
            # probe runs the fused op once per MLP at its first forward.
            calls = N_LAYERS * STEPS * (2 if variant == "ckpt" else 1)
            probes = N_LAYERS if variant in ("after", "zero_init") else 0
            # Unmarked: the first call of each MLP ran its hooked projections.
            first = N_LAYERS if variant == "unmarked" else 0
            assert counts == dict(whole=calls + probes - first, activation=first, experts=0), patched["report"]
            assert patched["fusion"] == ["mlp"] * N_LAYERS
            assert all(patched["leaf"]), "each fused MLP is a ZeRO-3 leaf (gathers its projections)"
            # Patched before deepspeed.initialize: ZeRO-3 put no hooks on the projections.
            assert (patched["hooked_projections"] > 0) == (stage == 3 and variant in ("after", "unmarked"))
            if variant in ("after", "zero_init"):  # ZeRO-3 already managed the model at patch()
                assert "DeepSpeed ZeRO-3: 2 fused MLP(s) are leaf modules" in patched["report"]
                assert "partitioned by DeepSpeed ZeRO-3" in patched["report"]
        else:
            assert patched["experts_impl"] == "swiglu_cupy"
            # Patched while partitioned: each experts module's forward check
            # runs the fused op once more, at its first forward.
            checks = N_LAYERS if stage == 3 and variant in ("after", "zero_init") else 0
            assert counts == dict(whole=0, activation=0, experts=N_LAYERS * STEPS + checks), patched["report"]
            assert f"{N_LAYERS} MoE experts" in patched["report"]


def assert_parity_measured(ranks) -> None:
    """The largest relative differences, plain vs patched, over every rank and
    case of ``ranks`` (printed with -s), below RTOL_FP32: so the tolerances
    stay grounded. Shared with test_deepspeed_trainer.py.

    A parameter is measured against its largest entry, or against
    ATOL_FP32 / RTOL_FP32 where all its entries are smaller (there the
    absolute tolerance is the one that applies, as in ``_close``): a tensor
    that starts at zero and moves by 1e-5 in three steps, such as
    DeepSeek-V4's ``hc_head.hc_base`` in transformers 5.25, holds its
    gradients' cancellation, not the op's error, in its last digits."""
    worst_loss = worst_param = 0.0
    for results in ranks:
        for plain, patched in results.values():
            worst_loss = max(worst_loss, ((plain["losses"] - patched["losses"]).abs()
                                          / plain["losses"].abs()).max().item())
            for key, a in plain["params"].items():
                b = patched["params"][key]
                scale = max(a.abs().max().item(), ATOL_FP32 / RTOL_FP32)
                worst_param = max(worst_param, (a - b).abs().max().item() / scale)
    print(f"max relative diff: loss {worst_loss:.2e}, parameters {worst_param:.2e} (per tensor, vs its max)")
    assert worst_loss < RTOL_FP32 and worst_param < RTOL_FP32


def test_the_parity_is_measured(ranks):
    assert_parity_measured(ranks)


def test_patching_without_deepspeed_imports_nothing_of_it(tmp_path):
    """A user without deepspeed pays nothing: patch() and training steps
    neither import deepspeed nor mark anything for it."""
    code = """if True:
        import sys, torch
        from torch import nn
        import swiglu_cupy as sc

        class MLP(nn.Module):
            def __init__(self):
                super().__init__()
                self.gate_proj, self.up_proj = nn.Linear(8, 16, bias=False), nn.Linear(8, 16, bias=False)
                self.down_proj, self.act_fn = nn.Linear(16, 8, bias=False), nn.SiLU()

            def forward(self, x):
                return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

        mlp = MLP()
        report = sc.patch(mlp)
        mlp(torch.randn(3, 8, requires_grad=True)).sum().backward()
        assert list(report.fused) == [""] and mlp.fusion() == "mlp", report
        assert not report.engines and not hasattr(mlp, "_z3_leaf"), report
        assert "deepspeed" not in sys.modules and "swiglu_cupy._distributed_compat" not in sys.modules
        assert "swiglu_cupy.integrations.deepspeed_zero3" not in sys.modules
        print("ok")
    """
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
