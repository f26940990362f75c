"""DeepSpeed ZeRO-3 on every Hugging Face family of the tests
(``tests/hf_common/families.py``: 11 dense, 7 MoE), on 2 CPU ranks (gloo,
tests/rank_launcher.py; DS_ACCELERATOR=cpu).

Each family's tiny model trains STEPS optimizer steps under a ZeRO-3 engine
(every parameter partitioned), unpatched then patched with
``swiglu_cupy.patch`` before ``deepspeed.initialize``, in the same ranks from
the same seed and batches (test_deepspeed.py's ``engine_steps``). The per-step
losses and the gathered parameters after the last step must agree, and the
fused paths must have run: every fused MLP (dense MLPs, shared experts,
DeepSeek's dense first layer) ran whole on every call, none fell back to the
activation-only fusion, and every experts module ran swiglu_cupy's experts
function on every call. Counted by wrapping the functions the fused forward
calls (test_deepspeed.py's ``_Counts``). The deeper cases (patch() after
initialize, zero.Init, checkpointing, the Trainer) are in test_deepspeed.py
and test_deepspeed_trainer.py on Llama and Mixtral.

All families run in one launch of 2 ranks.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

from hf_common.families import FAMILIES, tiny_config
from test_deepspeed import (LR, STEPS, _close, _Counts, _ds_config, assert_parity_measured, engine_steps,
                            init_deepspeed_rank, launch_ranks)

if importlib.util.find_spec("deepspeed") is None or importlib.util.find_spec("transformers") is None:
    pytest.skip("deepspeed or transformers is not installed (the 'test' extra has both)", allow_module_level=True)

RANK_TIMEOUT_S = 420


def _train(family: str, patched: bool, rank: int) -> dict:
    import deepspeed
    from transformers import AutoModelForCausalLM

    import swiglu_cupy as sc
    from swiglu_cupy.integrations import hf_experts

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family))
    model.train()
    out = {}
    if patched:
        out["report"] = str(sc.patch(model))
        out["mlps"] = sum(1 for m in model.modules() if hasattr(m, "fusion") and m.fusion() == "mlp")
        out["experts"] = sum(1 for m in model.modules() if hf_experts.is_hf_experts(m))
        out["fusion"] = sorted({m.fusion() for m in model.modules() if hasattr(m, "fusion")})
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=_ds_config(3))
    out["partitioned"] = all(p.numel() == 0 for p in engine.module.parameters())
    with pytest.MonkeyPatch.context() as monkeypatch:
        counts = _Counts(monkeypatch) if patched else None
        out["losses"], out["params"] = engine_steps(engine, rank)
        if patched:
            out["counts"] = counts.snapshot()
    if patched:
        out["leaf"] = all(deepspeed.utils.z3_leaf_module(m) for m in engine.module.modules() if hasattr(m, "fusion"))
        out["experts_impl"] = getattr(engine.module.config, "_experts_implementation", None)
    engine.destroy()
    return out


def run_case(case, rank: int, world: int) -> dict:
    init_deepspeed_rank(rank, world)
    return {family: (_train(family, False, rank), _train(family, True, rank))
            for family in (FAMILIES if case == "all" else [case])}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return launch_ranks(run_case, "all", tmp_path_factory, "deepspeed_families", RANK_TIMEOUT_S)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_zero3_family_trains_like_the_unpatched_one_with_the_whole_mlp_fused(ranks, family):
    kind = FAMILIES[family][0]
    for rank, results in enumerate(ranks):
        plain, patched = results[family]
        assert plain["partitioned"] and patched["partitioned"], "ZeRO-3 partitions every parameter"
        _close(plain["losses"], patched["losses"], f"{family} rank {rank} losses")
        assert plain["params"].keys() == patched["params"].keys()
        for key, before in plain["params"].items():
            _close(before, patched["params"][key], f"{family} rank {rank} {key}")
        assert not torch.equal(plain["losses"][0], plain["losses"][-1]), "training moved nothing"
        report = patched["report"]
        # Nothing runs activation-only: each GLU MLP is fused whole and is a ZeRO-3 leaf.
        assert patched["fusion"] in ([], ["mlp"]), report
        assert patched["leaf"], report
        if kind == "dense":
            assert patched["mlps"] == 2 and patched["experts"] == 0, report  # one MLP per layer
        else:
            assert patched["experts"] >= 1 and patched["experts_impl"] == "swiglu_cupy", report
            assert f"{patched['experts']} MoE experts" in report, report
        assert patched["counts"] == dict(whole=patched["mlps"] * STEPS, activation=0,
                                         experts=patched["experts"] * STEPS), report


def test_the_parity_is_measured(ranks):
    assert_parity_measured(ranks)
