"""Hugging Face's own tensor parallelism (``from_pretrained(..., tp_plan="auto")``)
on patched Llama MLPs: 2 gloo ranks on the CPU (tests/rank_launcher.py).

The default Llama plan shards ``gate_proj``/``up_proj`` colwise and
``down_proj`` rowwise, replacing each projection's ``forward`` with one that
handles the DTensor layouts and the all-reduce. A patched MLP sees that and
calls its projections as modules, fusing ``silu(gate) * up`` on the local
shards: the same logits and gradients as the unsharded, unpatched model.
"""
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs transformers: pip install 'swiglu-cupy[hf]'")

import rank_launcher  # noqa: E402
from conftest import assert_nontrivial, rel_rms  # noqa: E402

WORLD = 2
MLP_PARAMS = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")


def tiny_config():
    return transformers.AutoConfig.for_model(
        "llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, pad_token_id=0, eos_token_id=1, bos_token_id=1,
        initializer_range=0.1, tie_word_embeddings=False)


def ids():
    return torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))


def logits_and_mlp_grads(model):
    out = model(ids(), labels=ids())
    out.loss.backward()
    grads = {}
    for i, layer in enumerate(model.model.layers):
        for name in MLP_PARAMS:
            g = layer.mlp.get_parameter(name).grad
            grads[f"{i}.{name}"] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    with torch.no_grad():
        no_grad_logits = model(ids()).logits
    return {"logits": out.logits.detach(), "no_grad_logits": no_grad_logits, "grads": grads}


def run_case(path, rank, world):
    import os

    from swiglu_cupy.hf import SwiGLUMLP, apply_to, patch_model, unapply

    # What torchrun would set: transformers sizes its mesh from WORLD_SIZE.
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))

    res = {}
    # Patched after loading with tp_plan.
    model = transformers.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", attn_implementation="eager")
    res["patched"] = patch_model(model, strict=True)
    res["fusion"] = [layer.mlp.fusion() for layer in model.model.layers]
    res["after"] = logits_and_mlp_grads(model)
    # Class-level patching, then from_pretrained with tp_plan.
    apply_to("llama")
    try:
        built = transformers.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto",
                                                                  attn_implementation="eager")
    finally:
        unapply("llama")
    res["before_types"] = [isinstance(layer.mlp, SwiGLUMLP) for layer in built.model.layers]
    res["before"] = logits_and_mlp_grads(built)
    res["placements"] = {name: str(built.model.layers[0].mlp.get_parameter(name).placements)
                         for name in MLP_PARAMS}
    return res


def test_hf_tp_plan_auto_on_patched_mlps(tmp_path, monkeypatch):
    torch.manual_seed(0)
    ref_model = transformers.LlamaForCausalLM(tiny_config())
    ref_model.config._attn_implementation = "eager"
    ref_model.save_pretrained(tmp_path / "ckpt")
    ref = logits_and_mlp_grads(ref_model)
    results = rank_launcher.launch(run_case, str(tmp_path / "ckpt"), tmp_path, monkeypatch, WORLD, 240)
    for res in results:
        assert res["patched"] == 2 and res["fusion"] == ["activation", "activation"]
        assert res["before_types"] == [True, True]
        assert res["placements"] == {"gate_proj.weight": "(Shard(dim=0),)", "up_proj.weight": "(Shard(dim=0),)",
                                     "down_proj.weight": "(Shard(dim=1),)"}
        for order in ("after", "before"):
            got = res[order]
            assert rel_rms(got["logits"], ref["logits"]) < 1e-5, order
            assert rel_rms(got["no_grad_logits"], ref["no_grad_logits"]) < 1e-5, order
            for name, g in ref["grads"].items():
                assert_nontrivial(got["grads"][name], f"{order} {name}")
                assert rel_rms(got["grads"][name], g) < 1e-5, (order, name)
