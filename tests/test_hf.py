"""Hugging Face integration (swiglu_cupy.hf): patched vs unpatched tiny models.

Tiny random-weight models built from configs (no downloads). CPU tests run
everywhere; the ``gpu`` variants need CUDA.
"""
import copy
import io
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

transformers = pytest.importorskip(
    "transformers", reason="needs transformers: pip install 'swiglu-cupy[hf]'")

from conftest import assert_nontrivial, rel_rms  # noqa: E402

from swiglu_cupy import SwiGLU  # noqa: E402
from swiglu_cupy.hf import SwiGLUMLP, is_swiglu_mlp, patch_model  # noqa: E402

FAMILIES = ("llama", "mistral", "qwen2")
CKPT_IDS = ["no-ckpt", "ckpt-reentrant", "ckpt-nonreentrant"]
LAYERS = 2
VOCAB = 128


def tiny_model(family="llama", dtype=torch.float32, device="cpu", seed=0, **overrides):
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[family]
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=176, num_hidden_layers=LAYERS,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  # Larger than the default 0.02 so the MLPs weigh in the logits.
                  initializer_range=0.1, tie_word_embeddings=False, use_cache=False)
    if family == "mistral":
        kwargs["sliding_window"] = 8  # shorter than the test sequences, so it is exercised
    kwargs.update(overrides)
    config = config_cls(**kwargs)
    config._attn_implementation = "eager"  # same math in every dtype, float64 included
    torch.manual_seed(seed)
    return model_cls(config).to(device=device, dtype=dtype)


def token_ids(batch=2, seq=16, device="cpu", seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, seq), generator=g).to(device)


def patched_copy(model):
    patched = copy.deepcopy(model)
    assert patch_model(patched, strict=True) == LAYERS
    return patched


def forward_backward(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {name: p.grad for name, p in model.named_parameters()}


def enable_checkpointing(model, use_reentrant):
    with warnings.catch_warnings():  # newer versions call it activation_checkpointing_enable
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})


# fp32: the fused path computes gate and up in one GEMM and h in fp32 with one
# rounding, as the unpatched model does; only GEMM blocking differs, so the
# results agree to a few fp32 ulps (rel. RMS ~1e-7) after two layers and a
# softmax/cross-entropy. 2e-5 leaves room for other BLAS builds; any real bug
# (e.g. swapped gate/up) is off by O(1).
FP32_TOL = {"cpu": 2e-5, "cuda": 1e-4}
# bf16: both are compared with a float64 copy of the same (bf16-rounded)
# weights. The fused path rounds h once where the unpatched one rounds
# silu(gate) and gate*up separately, so its error should be no larger (the
# measured ratios are 0.9-1.3); 1.5x the unpatched error allows for noise.
# Per tensor, small tensors (biases, norms) have errors that fluctuate by tens
# of percent between two equally good roundings, so each tensor is also
# allowed a quarter of the model's median per-tensor bf16 error.
BF16_RATIO, BF16_SLACK = 1.5, 0.25


def check_parity(family, dtype, device, **overrides):
    base = tiny_model(family, dtype=torch.float32, device=device, **overrides)
    unpatched = copy.deepcopy(base).to(dtype)
    patched = patched_copy(unpatched)
    for layer in patched.model.layers:
        assert isinstance(layer.mlp, SwiGLUMLP) and layer.mlp.fusion() == "mlp"
        assert layer.mlp.gate_proj.weight.dtype == dtype and layer.mlp.gate_proj.weight.device.type == device
    ids = token_ids(device=device)
    logits_u, grads_u = forward_backward(unpatched, ids)
    logits_p, grads_p = forward_backward(patched, ids)
    assert grads_p.keys() == grads_u.keys()
    for name, g in grads_p.items():
        assert_nontrivial(g, f"patched {name}")
    if dtype == torch.float32:
        tol = FP32_TOL[device]
        assert rel_rms(logits_p, logits_u) < tol
        for name in grads_u:
            err = rel_rms(grads_p[name], grads_u[name])
            assert err < tol, f"{family} {name}: rel. RMS {err:.2e} >= {tol:.0e}"
        return
    oracle = copy.deepcopy(unpatched).double()
    logits_o, grads_o = forward_backward(oracle, ids)
    err_p, err_u = rel_rms(logits_p, logits_o), rel_rms(logits_u, logits_o)
    assert err_p <= BF16_RATIO * err_u, f"logits: patched {err_p:.2e}, unpatched {err_u:.2e}"
    errs = {name: (rel_rms(grads_p[name], grads_o[name]), rel_rms(grads_u[name], grads_o[name]))
            for name in grads_o}
    # All gradients together, each tensor scaled to unit norm.
    err_p, err_u = (sum(e[i] ** 2 for e in errs.values()) ** 0.5 for i in (0, 1))
    assert err_p <= BF16_RATIO * err_u, f"all grads: patched {err_p:.2e}, unpatched {err_u:.2e}"
    median_u = sorted(e[1] for e in errs.values())[len(errs) // 2]
    for name, (err_p, err_u) in errs.items():
        assert err_p <= BF16_RATIO * err_u + BF16_SLACK * median_u, \
            f"{family} {name}: patched {err_p:.2e} vs unpatched {err_u:.2e} (median {median_u:.2e})"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_parity_logits_and_grads(family, dtype):
    check_parity(family, dtype, "cpu")


def test_parity_mlp_bias():
    model = tiny_model("llama", mlp_bias=True)
    patched = patched_copy(model)
    mlp, ref = patched.model.layers[1].mlp, model.model.layers[1].mlp
    for name in ("gate_proj", "up_proj", "down_proj"):
        torch.testing.assert_close(getattr(mlp, name).bias, getattr(ref, name).bias, rtol=0, atol=0)
    check_parity("llama", torch.float32, "cpu", mlp_bias=True)


def train_losses(model, steps=30, lr=3e-3):
    """AdamW on a fixed synthetic batch: a repeating token pattern plus noise,
    so the loss falls well below log(VOCAB) within 30 steps."""
    torch.manual_seed(0)
    device = next(model.parameters()).device
    pattern = torch.arange(8).repeat(8)[:48]
    ids = torch.stack([(pattern * (i + 3)) % VOCAB for i in range(4)])
    ids[:, ::7] = token_ids(4, 48, seed=2)[:, ::7]
    ids = ids.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    model.train()
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


# Loss curves: the first losses agree to fp32 rounding; AdamW divides by
# sqrt(v), so per-step differences of ~1e-7 relative in the gradients stay of
# that order in the updates and grow slowly. 30 steps in fp32 end up well
# below 1e-4 apart, against a loss falling by several units.
LOSS_TOL = {"cpu": 1e-4, "cuda": 1e-3}


def check_convergence(device, family="llama", reentrant=None):
    unpatched = tiny_model(family, device=device)
    patched = patched_copy(unpatched)
    if reentrant is not None:
        enable_checkpointing(unpatched, reentrant)
        enable_checkpointing(patched, reentrant)
    ref = train_losses(unpatched)
    got = train_losses(patched)
    assert ref[-1] < 0.5 * ref[0], f"training did not converge: {ref[0]:.3f} -> {ref[-1]:.3f}"
    worst = max(abs(a - b) for a, b in zip(got, ref))
    assert worst < LOSS_TOL[device], f"loss curves differ by {worst:.2e}: {got[-1]:.5f} vs {ref[-1]:.5f}"


@pytest.mark.parametrize("reentrant", [None, True, False], ids=CKPT_IDS)
def test_convergence_parity(reentrant):
    check_convergence("cpu", reentrant=reentrant)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_gradient_checkpointing_grads(use_reentrant):
    """HF's gradient_checkpointing_enable with patched MLPs: same gradients as
    the patched model without checkpointing (the recompute is deterministic)."""
    unpatched = tiny_model("qwen2")
    plain, ckpt = patched_copy(unpatched), patched_copy(unpatched)
    enable_checkpointing(ckpt, use_reentrant)
    plain.train(), ckpt.train()
    ids = token_ids()
    _, grads_plain = forward_backward(plain, ids)
    _, grads_ckpt = forward_backward(ckpt, ids)
    for name, g in grads_ckpt.items():
        assert_nontrivial(g, name)
        torch.testing.assert_close(g, grads_plain[name], rtol=1e-6, atol=1e-7)


# --- save / load -----------------------------------------------------------

def test_state_dict_has_hf_layout():
    model = tiny_model("llama", mlp_bias=True)
    patched = patched_copy(model)
    sd_u, sd_p = model.state_dict(), patched.state_dict()
    assert list(sd_p) == list(sd_u)
    for k in sd_u:
        torch.testing.assert_close(sd_p[k], sd_u[k], rtol=0, atol=0)
    # ... and a patched state dict loads into an unpatched model and back.
    fresh_u = tiny_model("llama", seed=5, mlp_bias=True)
    fresh_p = patched_copy(tiny_model("llama", seed=5, mlp_bias=True))
    fresh_u.load_state_dict(sd_p)
    fresh_p.load_state_dict(sd_u)
    ids = token_ids()
    ref = model(ids).logits
    torch.testing.assert_close(fresh_u(ids).logits, ref, rtol=0, atol=0)
    torch.testing.assert_close(fresh_p(ids).logits, patched(ids).logits, rtol=0, atol=0)


def test_patched_in_place_keeps_modules_and_parameters():
    """The MLP object, its children and its Parameters stay the same objects:
    only the class changes (a subclass of the model's own MLP class)."""
    model = tiny_model("llama", mlp_bias=True)
    mlps = [layer.mlp for layer in model.model.layers]
    params = [dict(m.named_parameters()) for m in mlps]
    base = type(mlps[0])
    assert patch_model(model) == LAYERS
    for layer, mlp, before in zip(model.model.layers, mlps, params):
        assert layer.mlp is mlp and isinstance(mlp, base) and isinstance(mlp, SwiGLUMLP)
        assert type(mlp).__name__ == f"Fused{base.__name__}"
        after = dict(mlp.named_parameters())
        assert list(after) == list(before) and all(after[k] is before[k] for k in before)
    assert patch_model(model) == 0  # already patched


def test_pickle_deepcopy_and_to():
    model = patched_copy(tiny_model("qwen2"))
    ids = token_ids()
    with torch.no_grad():
        ref = model(ids).logits
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    for m in (loaded, copy.deepcopy(model), copy.deepcopy(model).to(torch.float64)):
        assert all(type(layer.mlp) is type(model.model.layers[0].mlp) for layer in m.model.layers)
        assert all(layer.mlp.fusion() == "mlp" for layer in m.model.layers)
        with torch.no_grad():
            torch.testing.assert_close(m(ids).logits.float(), ref, rtol=1e-5, atol=1e-5)


def test_memory_modes_pass_through():
    model = tiny_model("llama")
    plain = patched_copy(model)
    lean = copy.deepcopy(model)
    assert patch_model(lean, recompute_gate_up=True, inplace_backward=True) == LAYERS
    assert all(layer.mlp.recompute_gate_up and layer.mlp.inplace_backward for layer in lean.model.layers)
    assert not any(layer.mlp.recompute_gate_up or layer.mlp.inplace_backward for layer in plain.model.layers)
    ids = token_ids()
    _, grads_plain = forward_backward(plain, ids)
    _, grads_lean = forward_backward(lean, ids)
    for name, g in grads_lean.items():
        torch.testing.assert_close(g, grads_plain[name], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_save_pretrained_roundtrip(tmp_path, family):
    model = tiny_model(family)
    patched = patched_copy(model)
    ids = token_ids()
    ref = model(ids).logits
    cls = type(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # Patched -> checkpoint -> unpatched model.
        patched.save_pretrained(tmp_path / "patched")
        reloaded = cls.from_pretrained(tmp_path / "patched", attn_implementation="eager")
        # Unpatched -> checkpoint -> patched model (from_pretrained, then patch).
        model.save_pretrained(tmp_path / "plain")
        repatched = cls.from_pretrained(tmp_path / "plain", attn_implementation="eager")
    assert not any(isinstance(m, SwiGLUMLP) for m in reloaded.modules())
    torch.testing.assert_close(reloaded(ids).logits, ref, rtol=0, atol=0)
    assert patch_model(repatched) == LAYERS
    torch.testing.assert_close(repatched(ids).logits, patched(ids).logits, rtol=0, atol=0)
    # An HF checkpoint file loaded straight into an already patched model.
    from safetensors.torch import load_file
    target = patched_copy(tiny_model(family, seed=7))
    target.load_state_dict(load_file(tmp_path / "plain" / "model.safetensors"))
    torch.testing.assert_close(target(ids).logits, patched(ids).logits, rtol=0, atol=0)


# --- what gets patched -----------------------------------------------------

def test_keeps_dtype_device_requires_grad_and_mode():
    model = tiny_model("mistral", dtype=torch.bfloat16)
    for p in model.model.layers[0].mlp.parameters():
        p.requires_grad_(False)
    model.eval()
    patched = patched_copy(model)
    frozen, live = patched.model.layers[0].mlp, patched.model.layers[1].mlp
    assert not any(p.requires_grad for p in frozen.parameters())
    assert all(p.requires_grad for p in live.parameters())
    assert all(p.dtype == torch.bfloat16 for p in patched.parameters())
    assert not frozen.training


@pytest.mark.parametrize("act", ["tanh", "mish"])
def test_unknown_activations_untouched(act):
    model = tiny_model("llama", hidden_act=act)
    before = copy.deepcopy(model.state_dict())
    assert patch_model(model) == 0
    assert not any(isinstance(m, SwiGLUMLP) for m in model.modules())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="no GLU MLP found"):
        patch_model(model, strict=True)


@pytest.mark.parametrize("act, kind", [("gelu", "gelu"), ("gelu_pytorch_tanh", "gelu_tanh"), ("gelu_new", "gelu_tanh"),
                                       ("relu", "relu"), ("quick_gelu", "oai")])
def test_other_known_activations_fused(act, kind):
    """GeGLU, ReGLU, ... configs of a SwiGLU family: the activation is
    recognised by its values and fused exactly."""
    model = tiny_model("llama", hidden_act=act)
    patched = copy.deepcopy(model)
    assert patch_model(patched, strict=True) == LAYERS
    assert all(layer.mlp.swiglu_activation.kind == kind for layer in patched.model.layers)
    ids = token_ids()
    _, grads_u = forward_backward(model, ids)
    _, grads_p = forward_backward(patched, ids)
    for name, g in grads_p.items():
        assert rel_rms(g, grads_u[name]) < FP32_TOL["cpu"], name


def test_swish_name_is_patched():
    assert patch_model(tiny_model("llama", hidden_act="swish")) == LAYERS


class CustomMLP(nn.Module):
    """Not an HF class: detected by structure and by the activation's values."""

    def __init__(self, act, swap=False):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(16, 24, bias=False), nn.Linear(16, 24, bias=False)
        self.down_proj = nn.Linear(24, 16, bias=False)
        self.act_fn, self.swap = act, swap

    def forward(self, x):
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.swap:
            gate, up = up, gate
        return self.down_proj(self.act_fn(gate) * up)


class GeluMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.act = nn.Linear(16, 32), nn.Linear(32, 16), nn.GELU()

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def test_custom_modules():
    torch.manual_seed(0)
    model = nn.Sequential(CustomMLP(F.silu), CustomMLP(lambda t: t * torch.sigmoid(t)),
                          CustomMLP(nn.SiLU(), swap=True), CustomMLP(nn.Tanh()), GeluMLP())
    x = torch.randn(3, 16)
    ref = model(x)
    assert is_swiglu_mlp(model[2])  # the structure fits; only its forward differs
    assert patch_model(model) == 2
    assert [type(m).__name__ for m in model] == ["FusedCustomMLP", "FusedCustomMLP", "CustomMLP", "CustomMLP",
                                                 "GeluMLP"]
    torch.testing.assert_close(model(x), ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="does not compute"):
        patch_model(nn.Sequential(CustomMLP(nn.SiLU(), swap=True)), strict=True)


# --- SwiGLU.from_gate_up_down / to_gate_up_down ----------------------------

def test_from_gate_up_down_layout_and_swap_detected():
    torch.manual_seed(0)
    gate, up, down = nn.Linear(16, 24), nn.Linear(16, 24), nn.Linear(24, 8)
    x = torch.randn(5, 16)
    ref = down(F.silu(gate(x)) * up(x))
    m = SwiGLU.from_gate_up_down(gate, up, down)
    assert (m.in_features, m.hidden_features, m.out_features) == (16, 24, 8)
    torch.testing.assert_close(m.w12.weight[:24], gate.weight, rtol=0, atol=0)  # gate rows first
    torch.testing.assert_close(m(x), ref, rtol=1e-5, atol=1e-6)
    swapped = SwiGLU.from_gate_up_down(up, gate, down)(x)
    assert rel_rms(swapped, ref) > 0.1, "a gate/up swap must change the output"
    # The inverse gives back the same modules.
    g2, u2, d2 = m.to_gate_up_down()
    for a, b in ((g2, gate), (u2, up), (d2, down)):
        assert type(a) is nn.Linear
        torch.testing.assert_close(a.weight, b.weight, rtol=0, atol=0)
        torch.testing.assert_close(a.bias, b.bias, rtol=0, atol=0)
    # Copies, not aliases.
    with torch.no_grad():
        m.w12.weight.zero_()
    assert gate.weight.abs().sum() > 0 and g2.weight.abs().sum() > 0


def test_from_gate_up_down_mixed_bias_dtype_requires_grad():
    gate = nn.Linear(8, 12, bias=False, dtype=torch.float64)
    up = nn.Linear(8, 12, bias=False, dtype=torch.float64)
    down = nn.Linear(12, 8, bias=True, dtype=torch.float64)
    down.weight.requires_grad_(False)
    m = SwiGLU.from_gate_up_down(gate, up, down)
    assert m.w12.bias is None and m.w3.bias is not None
    assert m.w12.weight.dtype == torch.float64 and not m.w3.weight.requires_grad
    x = torch.randn(3, 8, dtype=torch.float64)
    torch.testing.assert_close(m(x), down(F.silu(gate(x)) * up(x)))
    g, u, d = m.to_gate_up_down()
    assert g.bias is None and d.bias is not None and not d.weight.requires_grad
    assert set(m.state_dict()) == {"w12.weight", "w3.weight", "w3.bias"}


def test_from_gate_up_down_validation():
    ok = dict(gate=nn.Linear(8, 12), up=nn.Linear(8, 12), down=nn.Linear(12, 8))
    cases = [
        (dict(up=nn.Linear(8, 10)), ValueError, r"up\.weight must have the shape of gate\.weight"),
        (dict(up=nn.Linear(6, 12)), ValueError, r"up\.weight"),
        (dict(down=nn.Linear(10, 8)), ValueError, r"down\.weight must be 2-D \[O, H\] with H = 12"),
        (dict(up=nn.Linear(8, 12, bias=False)), ValueError, "gate and up must both have a bias"),
        (dict(down=nn.Conv1d(12, 8, 1)), TypeError, "down must be an nn.Linear"),
        (dict(gate="w"), TypeError, "gate must be an nn.Linear"),
        (dict(up=nn.Linear(8, 12, dtype=torch.float64)), TypeError, r"up\.weight must have the dtype"),
    ]
    for change, error, match in cases:
        with pytest.raises(error, match=match):
            SwiGLU.from_gate_up_down(**{**ok, **change})
    up = nn.Linear(8, 12)
    up.weight.requires_grad_(False)
    with pytest.raises(ValueError, match="requires_grad"):
        SwiGLU.from_gate_up_down(ok["gate"], up, ok["down"])


# --- GPU variants ------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_parity_logits_and_grads_gpu(family, dtype):
    check_parity(family, dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("reentrant", [None, True, False], ids=CKPT_IDS)
def test_convergence_parity_gpu(reentrant):
    check_convergence("cuda", reentrant=reentrant)
