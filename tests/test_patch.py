"""swiglu_cupy.patch(model): every GLU feed-forward fused in place, decided by a
probe, with a report. Hugging Face families with other activations, a packed
gate_up_proj and a clamp (Gemma, Phi-3, GLM, DeepSeek-V4) against the
unpatched model; one model mixing every family of other ecosystems (timm,
DINOv2, torchtitan, xformers, renamed names, look-alikes)."""
import copy
import re
import warnings

import pytest
import torch
from torch import nn

import swiglu_cupy as sc
import swiglu_cupy.hf_experts as hx
from conftest import assert_nontrivial, rel_rms
from glu_zoo import (Dinov2SwiGLUFFN, RenamedGeGLU, SwappedGateLookAlike, TimmGluMlp, TimmSwiGLU,
                     TorchtitanFeedForward, timm_swiglu_packed)
from swiglu_cupy.integrations import plan_runner, recognition
from swiglu_cupy.hf import SwiGLUMLP, apply_to, patch_model, unapply
from swiglu_cupy.xformers import patch_xformers

# --- Hugging Face families --------------------------------------------------------------------

# model type -> (expected activation, packed gate_up_proj?, extra config)
HF_FAMILIES = {
    "gemma": ("gelu_tanh", False, {}),
    "gemma2": ("gelu_tanh", False, {}),
    "gemma3_text": ("gelu_tanh", False, {}),
    "phi3": ("silu", True, {}),
    "glm": ("silu", True, {}),
    "glm4": ("silu", True, {}),
    # A small limit, so the clamp is hit on both sides by the tiny model's activations.
    "deepseek_v4": ("silu, limit=0.5", False, dict(n_routed_experts=4, num_experts_per_tok=2,
                                                   moe_intermediate_size=32, swiglu_limit=0.5)),
}


def hf_model(family, seed=0, **overrides):
    transformers = pytest.importorskip("transformers")
    if family not in transformers.models.auto.configuration_auto.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {family}")
    kwargs = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=128, pad_token_id=0, eos_token_id=1,
                  bos_token_id=1, initializer_range=0.1, tie_word_embeddings=False, use_cache=False)
    kwargs.update(HF_FAMILIES[family][2])
    kwargs.update(overrides)
    config = transformers.AutoConfig.for_model(family, **kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config)


def token_ids():
    return torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))


def gated_mlps(model):
    return [m for m in model.modules() if isinstance(getattr(m, "down_proj", None), nn.Module)
            and isinstance(getattr(m, "gate_proj", getattr(m, "gate_up_proj", None)), nn.Module)]


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", list(HF_FAMILIES))
def test_hf_family_parity_with_checkpointing(family):
    """fp32, gradient checkpointing on: logits and every gradient as the
    unpatched model's; each MLP fully fused with the family's activation;
    state_dict keys unchanged."""
    act, packed, _ = HF_FAMILIES[family]
    unpatched = hf_model(family)
    patched = copy.deepcopy(unpatched)
    n = len(gated_mlps(unpatched))
    report = sc.patch(patched, strict=True)
    assert len(report.fused) == n and not report.partial and not report.skipped, report
    for mlp in gated_mlps(patched):
        assert isinstance(mlp, SwiGLUMLP) and mlp.fusion() == "mlp"
        assert str(mlp.swiglu_activation) == act
        assert (mlp.swiglu_plan.packed == "gate_up_proj") == packed
    assert list(patched.state_dict()) == list(unpatched.state_dict())
    experts = sum(hx.is_hf_experts(m) for m in unpatched.modules())  # MoE families: counted too
    assert report.experts == experts
    assert patch_model(copy.deepcopy(unpatched)) == n + experts  # the narrow entry fuses the same modules
    if family == "deepseek_v4":  # the clamp is hit, on both sides
        mlp = gated_mlps(unpatched)[0]
        seen = []
        hooks = [getattr(mlp, p).register_forward_hook(lambda m, i, o: seen.append(o.detach()))
                 for p in ("gate_proj", "up_proj")]
        unpatched(token_ids())
        for h in hooks:
            h.remove()
        assert (seen[0] > 0.5).any() and (seen[1] < -0.5).any() and (seen[1] > 0.5).any()
    for m in (unpatched, patched):
        m.train()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = token_ids()
    logits_u, grads_u = loss_and_grads(unpatched, ids)
    logits_p, grads_p = loss_and_grads(patched, ids)
    assert rel_rms(logits_p, logits_u) < 2e-5
    assert grads_p.keys() == grads_u.keys()
    mlp_grads = [k for k in grads_p if ".mlp." in k or "shared_experts" in k]
    assert mlp_grads
    # DeepSeek-V4's router weights get gradients of ~1e-10 against ~1e-2 for
    # the rest: rounding noise on both sides, compared as such.
    noise = 1e-7 * max(g.pow(2).mean().sqrt().item() for g in grads_u.values())
    for name, g in grads_p.items():
        if name in mlp_grads:
            assert_nontrivial(g, name)
        if grads_u[name].pow(2).mean().sqrt().item() < noise:
            assert g.pow(2).mean().sqrt().item() < noise, name
            continue
        assert rel_rms(g, grads_u[name]) < 2e-5, name


@pytest.mark.parametrize("family", ["gemma3_text", "phi3"])
def test_hf_family_bf16_error_no_larger_than_unpatched(family):
    """bf16: against a float64 copy of the same weights, the patched model's
    error is no larger than the unpatched one's (1.5x for noise; the fused
    path rounds h once)."""
    base = hf_model(family).to(torch.bfloat16)
    patched = copy.deepcopy(base)
    assert len(sc.patch(patched).fused) == 2
    oracle = copy.deepcopy(base).double()
    ids = token_ids()
    (lu, gu), (lp, gp), (lo, go) = (loss_and_grads(m, ids) for m in (base, patched, oracle))
    assert rel_rms(lp, lo) <= 1.5 * rel_rms(lu, lo)
    err_p = sum(rel_rms(gp[k], go[k]) ** 2 for k in go) ** 0.5
    err_u = sum(rel_rms(gu[k], go[k]) ** 2 for k in go) ** 0.5
    assert err_p <= 1.5 * err_u, (err_p, err_u)


@pytest.mark.parametrize("family", ["phi3", "glm4"])
def test_packed_gate_up_proj_used_in_place(family, monkeypatch):
    """The fused op receives gate_up_proj.weight itself: no copy, no new
    parameter, and its gradient lands there."""
    model = hf_model(family)
    mlps = gated_mlps(model)
    weights = [m.gate_up_proj.weight for m in mlps]
    ptrs = [w.data_ptr() for w in weights]
    assert patch_model(model, strict=True) == len(mlps)
    assert [m.gate_up_proj.weight for m in mlps] == weights
    seen = []
    real = plan_runner.swiglu

    def spy(x, w12, *args, **kwargs):
        seen.append(w12)
        return real(x, w12, *args, **kwargs)

    monkeypatch.setattr(plan_runner, "swiglu", spy)
    model(token_ids(), labels=token_ids()).loss.backward()
    assert len(seen) == len(mlps)
    for w12, w, ptr in zip(seen, weights, ptrs):
        assert w12 is w and w12.data_ptr() == ptr
        assert_nontrivial(w.grad, "gate_up_proj.weight.grad")
    assert len({p.data_ptr() for p in model.parameters()}) == len(list(model.parameters()))


@pytest.mark.parametrize("family", ["gemma", "phi3", "deepseek_v4"])
def test_class_level_patching(family):
    """apply_to: the model is built fused (any layout, clamp included) and
    computes what the unpatched one does."""
    ref = hf_model(family)
    fused = apply_to(family)
    try:
        model = hf_model(family)
    finally:
        unapply(family)
    mlps = gated_mlps(model)
    assert mlps and all(type(m) in fused and m.fusion() == "mlp" for m in mlps)
    assert str(mlps[0].swiglu_activation) == HF_FAMILIES[family][0]
    with torch.no_grad():
        assert rel_rms(model(token_ids()).logits, ref(token_ids()).logits) < 2e-5


def test_unknown_hf_activation_left_alone():
    model = hf_model("gemma", hidden_act="tanh", hidden_activation="tanh")
    report = sc.patch(model)
    assert not report.fused and len(report.skipped) == 2
    assert all("unknown activation" in r for r in report.skipped.values())
    assert patch_model(model) == 0


def test_lora_on_geglu_and_packed_gets_the_fused_activation():
    """PEFT LoRA on Gemma's projections and on Phi-3's gate_up_proj: the
    projections run as LoRA layers, act(gate) * up is fused (report.partial),
    gradients as the unpatched LoRA model's."""
    peft = pytest.importorskip("peft")
    for family, targets in (("gemma", ["gate_proj", "up_proj", "down_proj"]), ("phi3", ["gate_up_proj"])):
        base = peft.get_peft_model(hf_model(family), peft.LoraConfig(r=4, target_modules=targets,
                                                                     init_lora_weights=False))
        model = copy.deepcopy(base)
        report = sc.patch(model, strict=True)
        assert len(report.partial) == 2 and not report.fused, report
        assert all("LoRA" in why for why in report.partial.values())
        ids = token_ids()
        logits_u, grads_u = loss_and_grads(base, ids)
        logits_p, grads_p = loss_and_grads(model, ids)
        assert rel_rms(logits_p, logits_u) < 2e-5
        lora = [k for k in grads_p if "lora_" in k]
        assert lora and grads_p.keys() == grads_u.keys()
        for name in lora:
            assert_nontrivial(grads_p[name], name)
            assert rel_rms(grads_p[name], grads_u[name]) < 2e-5, name


# --- one model mixing every family ------------------------------------------------------------

D = 16


class Residual(nn.Module):
    """The sum of every block's output on the same input: each one's output and gradient count."""

    def __init__(self, blocks: dict):
        super().__init__()
        self.blocks = nn.ModuleDict(blocks)

    def forward(self, x):
        return sum(block(x) for block in self.blocks.values())


class PReLUGlu(TimmGluMlp):
    def __init__(self):
        super().__init__(D, 48, act_layer=lambda: nn.PReLU())


def mixed_model():
    """Every family of issue 19, plus look-alikes the probe must leave alone."""
    transformers = pytest.importorskip("transformers")
    blocks = {}
    for family in ("gemma", "phi3", "deepseek_v4"):
        if family in transformers.models.auto.configuration_auto.CONFIG_MAPPING:
            config = transformers.AutoConfig.for_model(family, hidden_size=D, intermediate_size=24,
                                                       **HF_FAMILIES[family][2])
            mlp_cls = {"gemma": "GemmaMLP", "phi3": "Phi3MLP", "deepseek_v4": "DeepseekV4MLP"}[family]
            module = __import__(f"transformers.models.{family}.modeling_{family}", fromlist=[mlp_cls])
            blocks[f"hf_{family}"] = getattr(module, mlp_cls)(config)
    blocks.update(
        timm_glu=TimmGluMlp(D, 48),                                   # sigmoid, gate last
        timm_glu_gelu_first=TimmGluMlp(D, 48, act_layer=nn.GELU, gate_last=False),
        timm_swiglu_packed=timm_swiglu_packed(D, 48),
        timm_swiglu=TimmSwiGLU(D, 24),
        timm_norm=TimmGluMlp(D, 48, act_layer=nn.SiLU, norm_layer=nn.LayerNorm),  # activation only
        timm_dropout=TimmGluMlp(D, 48, drop=0.25),                    # activation only in training
        dinov2=Dinov2SwiGLUFFN(D, 24),
        torchtitan=TorchtitanFeedForward(D, 24),
        renamed_geglu=RenamedGeGLU(D, 24),
        swapped=SwappedGateLookAlike(D, 24),                          # probe mismatch
        tanh_glu=TimmGluMlp(D, 48, act_layer=nn.Tanh),                # unknown activation
        prelu_glu=PReLUGlu(),                                         # learnable activation
        plain_mlp=nn.Sequential(nn.Linear(D, 32), nn.GELU(), nn.Linear(32, D)),  # not a GLU
    )
    xops = _xformers_ops()
    if xops is not None:
        blocks["xformers"] = xops.SwiGLU(D, 24, D)
    torch.manual_seed(0)
    model = Residual(blocks)
    with torch.no_grad():  # weights large enough that every block weighs in (and DeepSeek-V4 clamps)
        for p in model.parameters():
            p.normal_(0, 0.4)
    return model


def _xformers_ops():
    try:
        import xformers.ops as xops
    except Exception:
        return None
    return xops


FUSED = {"hf_gemma", "hf_phi3", "hf_deepseek_v4", "timm_glu", "timm_glu_gelu_first", "timm_swiglu_packed",
         "timm_swiglu", "dinov2", "torchtitan", "renamed_geglu", "xformers"}
PARTIAL = {"timm_norm", "timm_dropout"}
SKIPPED = {"swapped": "probe mismatch", "tanh_glu": "unknown activation", "prelu_glu": "learnable activation"}


def grads_of(model, x, seed):
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    y = model(x)
    y.pow(2).mean().backward()
    return y.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_mixed_model_forward_grads_report_state_dict_idempotent():
    model = mixed_model()
    names = set(model.blocks)
    ref = copy.deepcopy(model)
    report = sc.patch(model, strict=True)
    paths = {k: {p.removeprefix("blocks.") for p in getattr(report, k)} for k in ("fused", "partial", "skipped")}
    assert paths["fused"] == FUSED & names
    assert paths["partial"] == PARTIAL
    assert paths["skipped"] == set(SKIPPED)
    for name, why in SKIPPED.items():
        assert why in report.skipped[f"blocks.{name}"]
        assert not isinstance(model.blocks[name], SwiGLUMLP)
    assert "norm" in report.partial["blocks.timm_norm"] and "drop1" in report.partial["blocks.timm_dropout"]
    assert report.fused["blocks.timm_glu"].startswith("sigmoid: fc1 (gate last)")
    assert report.fused["blocks.torchtitan"] == "silu: w1/w3 -> w2"
    text = str(report)
    assert text.startswith(f"swiglu_cupy.patch: {len(paths['fused'])} fused, 2 activation only, 3 skipped")
    assert re.search(r"blocks\.swapped\s+SwappedGateLookAlike\s+skipped\s+probe mismatch", text)
    # Forward and every gradient, in training mode (dropout drawn from the same seed).
    x = torch.randn(3, 5, D, generator=torch.Generator().manual_seed(2))
    y_ref, g_ref = grads_of(ref, x, seed=3)
    y, g = grads_of(model, x, seed=3)
    assert rel_rms(y, y_ref) < 1e-5
    assert g.keys() == g_ref.keys()
    for name, grad in g.items():
        assert_nontrivial(grad, name)
        assert rel_rms(grad, g_ref[name]) < 1e-5, name
    # In eval mode the dropout block is fully fused too.
    model.eval(), ref.eval()
    assert model.blocks.timm_dropout.fusion() == "mlp"
    with torch.no_grad():
        assert rel_rms(model(x), ref(x)) < 1e-5
    model.train(), ref.train()
    # state_dict: same keys; each loads into the other.
    sd, sd_ref = model.state_dict(), ref.state_dict()
    assert list(sd) == list(sd_ref)
    other, other_ref = mixed_model(), mixed_model()
    assert len(sc.patch(other).fused) == len(paths["fused"])
    other.load_state_dict(sd_ref)
    other_ref.load_state_dict(sd)
    with torch.no_grad():
        model.eval(), other.eval(), other_ref.eval(), ref.eval()
        torch.testing.assert_close(other(x), model(x), rtol=0, atol=0)
        torch.testing.assert_close(other_ref(x), ref(x), rtol=0, atol=0)
    # Patching again changes nothing and says so.
    model.train()
    classes = {n: type(m) for n, m in model.named_modules()}
    again = sc.patch(model)
    assert (set(again.fused), set(again.partial), set(again.skipped)) == \
        (set(report.fused), set(report.partial), set(report.skipped))
    assert all(v.endswith("(already fused)") for v in (*again.fused.values(), *again.partial.values()))
    assert {n: type(m) for n, m in model.named_modules()} == classes
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x), other(x), rtol=0, atol=0)


def test_dinov2_without_xformers():
    """DINOv2 with XFORMERS_DISABLED=1 builds its own SwiGLUFFN (w12/w3, not
    xformers'): patch_xformers finds nothing and says where to go; patch
    fuses it with w12 used in place."""
    torch.manual_seed(0)
    model = nn.Sequential(Dinov2SwiGLUFFN(D, 24), Dinov2SwiGLUFFN(D, 24, bias=False))
    ref = copy.deepcopy(model)
    assert patch_xformers(model) == 0
    with pytest.raises(ValueError, match=r"swiglu_cupy\.patch\(model\)"):
        patch_xformers(model, strict=True)
    report = sc.patch(model, strict=True)
    assert set(report.fused) == {"0", "1"} and report.fused["0"] == "silu: w12 (gate first) -> w3"
    x = torch.randn(4, D, requires_grad=True)
    y, y_ref = model(x), ref(x)
    assert rel_rms(y, y_ref) < 1e-6
    gx, gw = torch.autograd.grad(y.sum(), [x, model[0].w12.weight])
    gx_ref, gw_ref = torch.autograd.grad(y_ref.sum(), [x, ref[0].w12.weight])
    assert rel_rms(gx, gx_ref) < 1e-6 and rel_rms(gw, gw_ref) < 1e-6


def test_root_module_and_strict():
    torch.manual_seed(0)
    root = TorchtitanFeedForward(D, 24)
    assert set(sc.patch(root, strict=True).fused) == {""}
    assert "<model>" in str(sc.patch(root))
    with pytest.raises(ValueError, match=r"nothing fused in Sequential.*\n  0: probe mismatch"):
        sc.patch(nn.Sequential(SwappedGateLookAlike(D, 24), nn.Linear(D, D)), strict=True)
    with pytest.raises(ValueError, match="nothing fused"):
        sc.patch(nn.Linear(4, 4), strict=True)
    assert str(sc.patch(nn.Linear(4, 4))).endswith("(no GLU feed-forward found)")
    with pytest.raises(TypeError, match="strict must be a bool"):
        sc.patch(root, strict=1)
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        sc.patch("model")


def test_hidden_clamp_is_caught():
    """A clamp written into a forward (no limit attribute) is hit by the
    probe's large rows: the module is left alone, not fused unclamped."""

    class HiddenClamp(TorchtitanFeedForward):
        def forward(self, x):
            return self.w2(torch.nn.functional.silu(self.w1(x).clamp(max=10.0)) * self.w3(x))

    report = sc.patch(nn.Sequential(HiddenClamp(D, 24)))
    assert set(report.skipped) == {"0"} and "probe mismatch" in report.skipped["0"]


def test_patch_of_a_model_without_experts_does_not_import_transformers():
    """No experts class can be in a model when transformers' MoE module was
    never imported: patch() then skips the experts search (and its ~2 s import)."""
    import subprocess
    import sys

    code = ("import sys, torch.nn as nn, swiglu_cupy\n"
            "report = swiglu_cupy.patch(nn.Sequential(nn.Linear(8, 8)))\n"
            "print('transformers' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr


# --- one walk: the narrow entries are filters over patch()'s decisions -----------------------

class HFNamedWithDropout(nn.Module):
    """Hugging Face names plus a dropout between the product and down_proj:
    patch() and patch_model() used to disagree on it (two walks)."""

    def __init__(self, dim, hidden):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.act_fn = nn.SiLU()
        self.dropout = nn.Dropout(0.1)  # registered before down_proj, as it runs
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down_proj(self.dropout(self.act_fn(self.gate_proj(x)) * self.up_proj(x)))


def _zoo_modules():
    return {"timm_glu": TimmGluMlp(D, 24), "timm_swiglu_packed": timm_swiglu_packed(D, 24),
            "timm_swiglu": TimmSwiGLU(D, 12), "dinov2": Dinov2SwiGLUFFN(D, 12),
            "torchtitan": TorchtitanFeedForward(D, 12), "renamed": RenamedGeGLU(D, 12),
            "swapped": SwappedGateLookAlike(D, 12), "hf_dropout": HFNamedWithDropout(D, 12)}


def _decisions(model):
    """path -> (class after patching, plan) of every module."""
    return {p: (type(m).__name__, getattr(m, "swiglu_plan", None)) for p, m in model.named_modules()}


@pytest.mark.parametrize("source", ["zoo", *HF_FAMILIES])
def test_patch_model_and_patch_decide_alike(source):
    """For every module hf.patch_model looks at (Hugging Face names), it
    decides exactly as patch() does; the modules it does not look at
    (other names) stay untouched."""
    torch.manual_seed(0)
    base = nn.ModuleDict(_zoo_modules()) if source == "zoo" else hf_model(source)
    by_patch, by_model = copy.deepcopy(base), copy.deepcopy(base)
    report = sc.patch(by_patch)
    patch_model(by_model)
    hf_paths = {p for p, m in base.named_modules() if recognition.hf_candidates(m) is not None}
    assert hf_paths, "the source holds no Hugging Face-named MLP: the comparison would be empty"
    after_patch, after_model, before = _decisions(by_patch), _decisions(by_model), _decisions(base)
    for path in after_patch:
        inside_hf = any(path == h or path.startswith(h + ".") for h in hf_paths)
        expected = after_patch[path] if inside_hf else before[path]
        assert after_model[path] == expected, (path, after_model[path], expected)
    if source == "zoo":
        assert "hf_dropout" in report.fused or "hf_dropout" in report.partial
        assert set(report.skipped) == {"swapped"}


def test_patch_xformers_is_the_walk_narrowed_to_xformers():
    xops = _xformers_ops()
    if xops is None:
        pytest.skip("needs xformers: pip install --no-deps -r tests/requirements/peers.txt")
    torch.manual_seed(0)
    model = nn.ModuleDict({"x": xops.SwiGLU(D, 12), "t": TorchtitanFeedForward(D, 12)})
    assert patch_xformers(model) == 1
    assert type(model["t"]) is TorchtitanFeedForward  # not an xformers module: left to patch()
    report = sc.patch(model)
    assert set(report.fused) == {"x", "t"} and report.fused["x"].endswith("(already fused)")


# --- the meta device: decided by structure, verified at the first real forward ---------------

def _materialize(model, seed=0):
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model


def test_a_model_patched_on_meta_is_probed_at_its_first_forward():
    with torch.device("meta"):
        model = nn.Sequential(TorchtitanFeedForward(D, 12), RenamedGeGLU(D, 12), HFNamedWithDropout(D, 12))
    report = sc.patch(model)
    assert set(report.pending) == {"0", "1", "2"} and not report.fused and not report.skipped
    assert len(report) == 3 and "pending" in str(report)
    _materialize(model)
    with torch.device("cpu"):
        reference = nn.Sequential(TorchtitanFeedForward(D, 12), RenamedGeGLU(D, 12), HFNamedWithDropout(D, 12))
    reference.load_state_dict(model.state_dict())
    model.eval(), reference.eval()
    x = torch.randn(5, D, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = model(x)
    assert rel_rms(y, reference(x)) < 1e-6
    assert [m.fusion() for m in model] == ["mlp", "mlp", "mlp"]
    assert model[1].swiglu_plan.activation.kind == "gelu_tanh" and model[0].swiglu_plan.gate == "w1"
    gx, = torch.autograd.grad(y.sum(), x)
    gx_ref, = torch.autograd.grad(reference(x).sum(), x)
    assert_nontrivial(gx, "x")
    assert rel_rms(gx, gx_ref) < 1e-6
    again = sc.patch(model)
    assert set(again.fused) == {"0", "1", "2"} and not again.pending


def test_a_meta_look_alike_refused_at_its_first_forward_warns_once_and_runs_its_own_forward(monkeypatch):
    with torch.device("meta"):
        model = nn.Sequential(SwappedGateLookAlike(D, 12))
    assert set(sc.patch(model).pending) == {"0"}
    _materialize(model)
    x = torch.randn(3, D)
    with pytest.warns(RuntimeWarning, match="SwappedGateLookAlike patched on the meta device.*probe mismatch"):
        y = model(x)
    expected = SwappedGateLookAlike.forward(model[0], x)
    assert torch.equal(y, expected)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: decided for good
        assert torch.equal(model(x), expected)
    assert model[0].swiglu_plan is None and model[0].fusion() is None

    with torch.device("meta"):
        strict = nn.Sequential(SwappedGateLookAlike(D, 12))
    sc.patch(strict)
    _materialize(strict)
    monkeypatch.setenv("SWIGLU_CUPY_STRICT", "1")
    with pytest.raises(RuntimeError, match="runs its original forward: probe mismatch"):
        strict(x)


def test_patching_again_after_materialising_decides_then():
    with torch.device("meta"):
        model = nn.Sequential(TorchtitanFeedForward(D, 12), SwappedGateLookAlike(D, 12))
    sc.patch(model)
    _materialize(model)
    report = sc.patch(model)
    assert set(report.fused) == {"0"} and "decided now" in report.fused["0"]
    assert set(report.skipped) == {"1"} and "refused by the probe" in report.skipped["1"]


def test_torchtitan_style_linear_subclass_is_plain():
    """An nn.Linear subclass that keeps nn.Linear.forward (torchtitan's Linear)
    runs the whole MLP fused; one that overrides forward runs as itself, and
    the report names what it found."""

    class KeepsForward(nn.Linear):
        pass

    class OverridesForward(nn.Linear):
        def forward(self, x):
            return super().forward(x)

    def build(linear):
        ff = TorchtitanFeedForward(D, 12)
        for name in ("w1", "w2", "w3"):
            old = getattr(ff, name)
            new = linear(old.in_features, old.out_features, bias=False)
            new.weight = old.weight
            setattr(ff, name, new)
        return ff

    torch.manual_seed(0)
    kept = sc.patch(nn.Sequential(build(KeepsForward)))
    assert set(kept.fused) == {"0"} and not kept.partial
    overridden = sc.patch(nn.Sequential(build(OverridesForward)))
    assert set(overridden.partial) == {"0"}
    assert "OverridesForward overrides nn.Linear.forward" in overridden.partial["0"]
    hooked = build(KeepsForward)
    hooked.w1.register_forward_hook(lambda m, i, o: None)
    assert "KeepsForward has hooks" in sc.patch(nn.Sequential(hooked)).partial["0"]


# --- containers and blocks nested at random: every entry reaches what patch() reaches --------

class Chain(nn.Module):
    """A block applying its children (attributes, or the items of a container child) in order."""

    def __init__(self, *layers):
        super().__init__()
        for i, layer in enumerate(layers):
            setattr(self, f"layer{i}", layer)

    def forward(self, x):
        for layer in self.children():
            x = _apply(layer, x)
        return x


class Fork(nn.Module):
    """A residual block: x plus each branch's output on x."""

    def __init__(self, *branches):
        super().__init__()
        self.branches = nn.ModuleList(branches)

    def forward(self, x):
        return x + sum(_apply(branch, x) for branch in self.branches)


def _apply(layer, x):
    if isinstance(layer, (nn.ModuleList, nn.ModuleDict)):
        for item in (layer.values() if isinstance(layer, nn.ModuleDict) else layer):
            x = _apply(item, x)
        return x
    return layer(x)


def _random_leaf(rng, xops, llama):
    kind = rng.choice(["xformers_packed", "xformers_unpacked", "llama_mlp", "linear", "layernorm", "torchtitan"])
    if kind == "xformers_packed":
        return xops.SwiGLU(D, 24)
    if kind == "xformers_unpacked":
        return xops.SwiGLU(D, 24, _pack_weights=False)
    if kind == "llama_mlp":
        return llama.LlamaMLP(llama.LlamaConfig(hidden_size=D, intermediate_size=24, num_attention_heads=2,
                                                num_key_value_heads=2))
    if kind == "torchtitan":
        return TorchtitanFeedForward(D, 12)  # a GLU under other names: patch() only
    return nn.Linear(D, D) if kind == "linear" else nn.LayerNorm(D)


def _random_stack(rng, xops, holder):
    """Three D -> D layers that look like gate/up/down projections (an
    xformers SwiGLU states in_features/out_features), maybe with a norm."""
    layers = [rng.choice([lambda: xops.SwiGLU(D, 24), lambda: xops.SwiGLU(D, 24, _pack_weights=False),
                          lambda: nn.Linear(D, D)])() for _ in range(3)]
    if rng.random() < 0.5:
        layers.insert(rng.randrange(4), nn.LayerNorm(D))
    return holder(*layers)


def _random_nest(rng, xops, llama, depth=3):
    """A runnable tree of D -> D modules: containers and blocks over leaves."""
    if depth == 0 or rng.random() < 0.25:
        if rng.random() < 0.3:
            return _random_stack(rng, xops, rng.choice([nn.Sequential, Chain]))
        return _random_leaf(rng, xops, llama)
    children = [_random_nest(rng, xops, llama, depth - 1) for _ in range(rng.choice([1, 2, 3, 3]))]
    holder = rng.choice(["sequential", "chain", "fork", "chain_of_list", "fork_of_dict"])
    if holder == "sequential":
        return nn.Sequential(*children)
    if holder == "chain":
        return Chain(*children)
    if holder == "fork":
        return Fork(*children)
    if holder == "chain_of_list":
        return Chain(nn.ModuleList(children))
    return Fork(nn.ModuleDict({f"k{i}": c for i, c in enumerate(children)}))


def _reached(model):
    """family -> paths of the modules patched in that family."""
    found = {"xformers": set(), "hf": set(), "generic": set()}
    for path, m in model.named_modules():
        if type(m).__name__ == "SwiGLU" and type(m).__module__.startswith("xformers") and m.op is not None:
            found["xformers"].add(path)
        elif isinstance(m, SwiGLUMLP):
            found[m.swiglu_family].add(path)
    return found


def test_every_entry_reaches_in_random_nests_of_containers_and_blocks_what_patch_reaches():
    """30 seeded random trees of Sequential/ModuleList/ModuleDict and block
    classes over real xformers SwiGLUs (packed and not), real LlamaMLPs,
    a torchtitan FeedForward and plain layers: patch() fuses every GLU in
    them, reports no container, and patch_xformers / patch_model reach
    exactly the modules of their families that patch() does."""
    import random

    xops = _xformers_ops()
    if xops is None:
        pytest.skip("needs xformers: pip install --no-deps -r tests/requirements/peers.txt")
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    containers = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
    lookalikes_seen = 0
    for seed in range(30):
        rng = random.Random(seed)
        torch.manual_seed(seed)
        base = Chain(_random_nest(rng, xops, llama))
        modules = dict(base.named_modules())
        by_patch, by_xformers, by_hf = (copy.deepcopy(base) for _ in range(3))
        report = sc.patch(by_patch)
        n_xformers, n_hf = patch_xformers(by_xformers), patch_model(by_hf)
        reached = _reached(by_patch)
        expected = {"xformers": {p for p, m in modules.items() if isinstance(m, xops.SwiGLU)},
                    "hf": {p for p, m in modules.items() if isinstance(m, llama.LlamaMLP)},
                    "generic": {p for p, m in modules.items() if isinstance(m, TorchtitanFeedForward)}}
        assert reached == expected, seed
        rows = {**report.fused, **report.partial, **report.skipped, **report.pending}
        assert not [p for p in rows if isinstance(modules[p], containers)], (seed, str(report))
        assert _reached(by_xformers) == {"xformers": reached["xformers"], "hf": set(), "generic": set()}, seed
        assert _reached(by_hf) == {"xformers": set(), "hf": reached["hf"], "generic": set()}, seed
        assert (n_xformers, n_hf) == (len(reached["xformers"]), len(reached["hf"])), seed
        # A block whose children look like three projections, refused, with GLUs inside it:
        # the case where the narrow walks used to stop.
        lookalikes_seen += any(any(f.startswith(p + ".") for f in reached["xformers"] | reached["hf"])
                               for p in report.skipped)
    assert lookalikes_seen >= 3, lookalikes_seen
