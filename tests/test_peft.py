"""patch_model on MLPs whose projections are not plain nn.Linear: PEFT LoRA
layers (real peft, a tiny Llama from a config, no downloads) and quantized-like
modules. The projections run as themselves; only silu(gate) * up runs fused
(silu_mul).
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

peft = pytest.importorskip("peft", reason="needs peft: pip install 'swiglu-cupy[test]'")
pytest.importorskip("transformers", reason="needs transformers: pip install 'swiglu-cupy[hf]'")

from conftest import assert_nontrivial, rel_rms  # noqa: E402
from test_hf import FP32_TOL, LAYERS, LOSS_TOL, enable_checkpointing, tiny_model, token_ids, train_losses  # noqa: E402

from swiglu_cupy.hf import SwiGLUMLP, patch_model  # noqa: E402

LORA_TARGETS = ["gate_proj", "up_proj", "down_proj"]


def lora_model(device="cpu", seed=0):
    """Tiny Llama with LoRA (r=4) on gate/up/down. init_lora_weights=False
    draws lora_B at random too (peft's default zeros it), so the adapters
    change the output and every adapter gets a non-zero gradient."""
    base = tiny_model("llama", device=device, seed=seed)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=LORA_TARGETS,
                             init_lora_weights=False)
    torch.manual_seed(seed + 1)
    return peft.get_peft_model(base, config)


def patched_copy(model):
    patched = copy.deepcopy(model)
    assert patch_model(patched, strict=True) == LAYERS
    return patched


def mlps(model):
    return [layer.mlp for layer in model.base_model.model.model.layers]


def trainable_grads(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids)
    out.loss.backward()
    frozen_with_grad = [n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None]
    assert not frozen_with_grad, frozen_with_grad
    return out.logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def test_lora_mlps_keep_their_projections():
    model = lora_model()
    before = [(m.gate_proj, m.up_proj, m.down_proj) for m in mlps(model)]
    names_before = [n for n, p in model.named_parameters() if p.requires_grad]
    state_before = model.state_dict()
    assert patch_model(model, strict=True) == LAYERS
    for mlp, projections in zip(mlps(model), before):
        assert isinstance(mlp, SwiGLUMLP) and mlp.fusion() == "activation"
        assert (mlp.gate_proj, mlp.up_proj, mlp.down_proj) == projections  # the same objects
        assert all(isinstance(p, peft.tuners.lora.LoraLayer) for p in projections)
    # Only the adapters train, under the same names; the state dict is unchanged.
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable == names_before and trainable and all("lora_" in n for n in trainable)
    state = model.state_dict()
    assert list(state) == list(state_before)
    assert all(torch.equal(state[k], state_before[k]) for k in state)
    assert patch_model(model) == 0  # already patched


@pytest.mark.parametrize("reentrant", [None, False], ids=["no-ckpt", "ckpt-nonreentrant"])
def test_logits_and_every_lora_gradient(reentrant):
    """Patched vs unpatched, fp32: only the activation's rounding differs."""
    model = lora_model()
    patched = patched_copy(model)
    if reentrant is not None:
        enable_checkpointing(model, reentrant)
        enable_checkpointing(patched, reentrant)
    model.train(), patched.train()
    ids = token_ids()
    logits_u, grads_u = trainable_grads(model, ids)
    logits_p, grads_p = trainable_grads(patched, ids)
    tol = FP32_TOL["cpu"]
    assert rel_rms(logits_p, logits_u) < tol
    assert list(grads_p) == list(grads_u)
    assert sum("mlp" in n for n in grads_u) == LAYERS * 3 * 2  # lora_A and lora_B per projection
    for name, g in grads_u.items():
        assert_nontrivial(grads_p[name], name)
        assert rel_rms(grads_p[name], g) < tol, (name, rel_rms(grads_p[name], g))


def test_thirty_training_steps_match():
    model = lora_model()
    patched = patched_copy(model)
    ref = train_losses(model, lr=1e-2)
    got = train_losses(patched, lr=1e-2)
    assert ref[-1] < 0.8 * ref[0], f"LoRA training did not move the loss: {ref[0]:.3f} -> {ref[-1]:.3f}"
    worst = max(abs(a - b) for a, b in zip(got, ref))
    assert worst < LOSS_TOL["cpu"], f"loss curves differ by {worst:.2e}: {got[-1]:.5f} vs {ref[-1]:.5f}"


def test_merge_and_unload_then_full_fusion():
    model = lora_model()
    patched = patched_copy(model)
    ids = token_ids()
    merged_ref = model.merge_and_unload()
    merged = patched.merge_and_unload()
    for mlp in merged.model.layers:
        # Plain nn.Linear again: the same patched MLP now runs whole fused.
        assert isinstance(mlp.mlp, SwiGLUMLP) and mlp.mlp.fusion() == "mlp"
        assert all(type(p) is nn.Linear for p in (mlp.mlp.gate_proj, mlp.mlp.up_proj, mlp.mlp.down_proj))
    with torch.no_grad():
        ref = merged_ref(ids).logits
        assert rel_rms(merged(ids).logits, ref) < FP32_TOL["cpu"]
    assert patch_model(merged) == 0  # already patched
    assert list(merged.state_dict()) == list(merged_ref.state_dict())


# --- quantized-like projections ----------------------------------------------

class Int8Linear(nn.Module):
    """A stand-in for a quantized linear layer: int8 weight (a buffer, not
    trainable), a per-row float scale, dequantized on the fly."""

    def __init__(self, in_features, out_features, expose_in_features=True):
        super().__init__()
        w = torch.randn(out_features, in_features) / in_features ** 0.5
        scale = w.abs().amax(1) / 127
        self.register_buffer("qweight", torch.round(w / scale[:, None]).to(torch.int8))
        self.scale = nn.Parameter(scale)
        if expose_in_features:
            self.in_features = in_features

    def forward(self, x):
        return F.linear(x, self.qweight.to(x.dtype) * self.scale[:, None].to(x.dtype))


class QuantMLP(nn.Module):
    def __init__(self, d=16, h=24, swap=False, expose_in_features=True, extra_child=False):
        super().__init__()
        self.gate_proj = Int8Linear(d, h, expose_in_features)
        self.up_proj = Int8Linear(d, h, expose_in_features)
        self.down_proj = Int8Linear(h, d, expose_in_features)
        self.act_fn = nn.SiLU()
        self.swap = swap
        if extra_child:
            self.norm = nn.LayerNorm(h)  # used by forward: the fused forward would skip it

    def forward(self, x):
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.swap:
            gate, up = up, gate
        h = self.act_fn(gate) * up
        return self.down_proj(self.norm(h) if hasattr(self, "norm") else h)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_quantized_projections_get_silu_mul(dtype):
    torch.manual_seed(0)
    model = nn.Sequential(QuantMLP(), QuantMLP()).to(dtype)
    ref = copy.deepcopy(model)
    buffers = [m.gate_proj.qweight for m in model]
    assert patch_model(model, strict=True) == 2
    assert all(isinstance(m, QuantMLP) and m.fusion() == "activation" for m in model)
    assert [m.gate_proj.qweight for m in model] == buffers  # same storage, never dequantized
    x = torch.randn(3, 5, 16, dtype=dtype, requires_grad=True)
    y, y_ref = model(x), ref(x)
    grads = torch.autograd.grad(y.pow(2).sum(), [x, *model.parameters()])
    grads_ref = torch.autograd.grad(y_ref.pow(2).sum(), [x, *ref.parameters()])
    tol = 1e-6 if dtype == torch.float32 else 1e-13
    assert rel_rms(y, y_ref) < tol
    for g, g_ref in zip(grads, grads_ref):
        assert_nontrivial(g, "grad")
        assert rel_rms(g, g_ref) < tol


def test_quantized_look_alikes_left_alone():
    torch.manual_seed(0)
    swapped, extra = QuantMLP(swap=True), QuantMLP(extra_child=True)
    model = nn.Sequential(swapped, extra)
    assert patch_model(model) == 0
    assert model[0] is swapped and model[1] is extra
    with pytest.raises(ValueError, match="could not be probed"):
        patch_model(nn.Sequential(QuantMLP(swap=True)), strict=True)
    # No in_features and no 2-D weight: the input width is unknown, so the
    # forward cannot be verified; verify=False trusts the structure.
    blind = nn.Sequential(QuantMLP(expose_in_features=False))
    assert patch_model(blind) == 0
    assert patch_model(blind, verify=False) == 1 and blind[0].fusion() == "activation"


def test_unknown_activation_lora_left_alone():
    base = tiny_model("llama", hidden_act="tanh")
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=LORA_TARGETS))
    assert patch_model(model) == 0
    assert not any(isinstance(m, SwiGLUMLP) for m in model.modules())


def test_lora_on_a_patched_model():
    """get_peft_model after patch_model: PEFT finds gate_proj/up_proj/down_proj by
    name, and the patched MLPs switch to the activation-only path."""
    base = tiny_model("llama")
    ref = copy.deepcopy(base)
    assert patch_model(base, strict=True) == LAYERS
    config = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=LORA_TARGETS, init_lora_weights=False)
    torch.manual_seed(1)
    model = peft.get_peft_model(base, peft.LoraConfig(**config))
    torch.manual_seed(1)
    ref = peft.get_peft_model(ref, peft.LoraConfig(**config))
    assert all(m.fusion() == "activation" for m in mlps(model))
    ids = token_ids()
    logits_p, grads_p = trainable_grads(model, ids)
    logits_u, grads_u = trainable_grads(ref, ids)
    assert rel_rms(logits_p, logits_u) < FP32_TOL["cpu"]
    assert list(grads_p) == list(grads_u)
    for name, g in grads_u.items():
        assert_nontrivial(grads_p[name], name)
        assert rel_rms(grads_p[name], g) < FP32_TOL["cpu"], name


# --- GPU -------------------------------------------------------------------

@pytest.mark.gpu
def test_lora_parity_cuda():
    model = lora_model(device="cuda")
    patched = patched_copy(model)
    ids = token_ids(device="cuda")
    logits_u, grads_u = trainable_grads(model, ids)
    logits_p, grads_p = trainable_grads(patched, ids)
    tol = FP32_TOL["cuda"]
    assert rel_rms(logits_p, logits_u) < tol
    for name, g in grads_u.items():
        assert_nontrivial(grads_p[name], name)
        assert rel_rms(grads_p[name], g) < tol, name
