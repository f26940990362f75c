"""Patched Hugging Face models are Hugging Face models: every state_dict key is
an attribute path, class-level patching loads checkpoints straight into fused
MLPs (meta device included), tp_plan stays valid, accelerate loads without
warnings, and export -> ONNX works under no_grad."""
import copy
import logging
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs transformers: pip install 'swiglu-cupy[hf]'")

from conftest import assert_nontrivial, rel_rms  # noqa: E402

from swiglu_cupy import ops  # noqa: E402
import swiglu_cupy as sc  # noqa: E402
from swiglu_cupy.hf import SwiGLUMLP, apply_to, patch_mapping, patch_model, unapply  # noqa: E402

FAMILIES = ("llama", "qwen2", "mistral")


def tiny_config(family="llama", **overrides):
    kwargs = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, pad_token_id=0, eos_token_id=1, bos_token_id=1,
                  initializer_range=0.1, tie_word_embeddings=False)
    kwargs.update(overrides)
    config = transformers.AutoConfig.for_model(family, **kwargs)
    config._attn_implementation = "eager"
    return config


def tiny_model(family="llama", seed=0, **overrides):
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(tiny_config(family, **overrides))


def ids():
    return torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(1))


def fused_mlps(model):
    return [m for m in model.modules() if isinstance(m, SwiGLUMLP) and m.fusion() == "mlp"]


@pytest.fixture
def class_patched():
    """apply_to(family) for the test's duration."""
    applied = []

    def apply(family):
        applied.append(family)
        return apply_to(family)

    yield apply
    for family in applied:
        unapply(family)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_state_dict_key_is_an_attribute_path(family):
    model = tiny_model(family, mlp_bias=True) if family == "llama" else tiny_model(family)
    assert patch_model(model, strict=True) == 2
    state = model.state_dict()
    assert any(".mlp.gate_proj." in k for k in state)
    for key, value in state.items():
        owner, _, name = key.rpartition(".")
        got = model.get_submodule(owner)._parameters.get(name)
        got = model.get_parameter(key) if got is not None else model.get_buffer(key)
        assert got.data_ptr() == value.data_ptr(), key
    # Nothing shares storage (transformers would read it as tied weights).
    ptrs = [p.data_ptr() for p in model.parameters()]
    assert len(ptrs) == len(set(ptrs))


@pytest.mark.parametrize("family", FAMILIES)
def test_tp_plan_stays_valid(family):
    from transformers.distributed.tensor_parallel import verify_tp_plan

    model = tiny_model(family)
    plan = model.config.base_model_tp_plan
    assert any("mlp.gate_proj" in k for k in plan)
    assert patch_model(model, strict=True) == 2
    modules, params = dict(model.named_modules()), dict(model.named_parameters())
    for pattern in (*model.tp_plan, *(f"model.{k}" for k in plan)):
        concrete = pattern.replace("*", "0")
        assert concrete in modules or concrete in params, pattern
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # verify_tp_plan warns about entries that match nothing
        verify_tp_plan(list(model.state_dict()), model.tp_plan)


@pytest.mark.parametrize("family", FAMILIES)
def test_class_patched_from_pretrained_save_and_reload_both_ways(tmp_path, family, class_patched):
    """apply_to before from_pretrained: the model is built fused (on the meta
    device) and the loader fills the very same gate_proj/up_proj/down_proj."""
    plain = tiny_model(family)
    plain.save_pretrained(tmp_path / "plain")
    with torch.no_grad():
        ref = plain(ids()).logits
    cls = type(plain)
    fused_cls = class_patched(family)
    assert len(fused_cls) == 1
    for kwargs in ({}, {"low_cpu_mem_usage": True}, {"device_map": "cpu"}):
        model = cls.from_pretrained(tmp_path / "plain", attn_implementation="eager", **kwargs)
        assert len(fused_mlps(model)) == 2, kwargs
        assert all(type(m) is fused_cls[0] for m in fused_mlps(model))
        with torch.no_grad():
            torch.testing.assert_close(model(ids()).logits, ref, rtol=1e-5, atol=1e-5)
    # Patched -> safetensors -> the same keys and values.
    model.save_pretrained(tmp_path / "fused")
    from safetensors.torch import load_file
    saved, plain_saved = load_file(tmp_path / "fused" / "model.safetensors"), plain.state_dict()
    assert sorted(saved) == sorted(plain_saved)
    assert all(torch.equal(saved[k], plain_saved[k]) for k in saved)
    # ... into an unpatched model, and an unpatched checkpoint into a patched one (above).
    unapply(family)
    unpatched = cls.from_pretrained(tmp_path / "fused", attn_implementation="eager")
    assert not any(isinstance(m, SwiGLUMLP) for m in unpatched.modules())
    with torch.no_grad():
        torch.testing.assert_close(unpatched(ids()).logits, ref, rtol=0, atol=0)


def test_class_patched_mlps_decide_their_fusion_when_built(class_patched, monkeypatch):
    from swiglu_cupy.integrations import plan_runner

    class_patched("llama")
    model = tiny_model("llama")
    mlps = [m for m in model.modules() if isinstance(m, SwiGLUMLP)]
    assert len(mlps) == 2 and all(plan_runner._FUSION_ATTR in m.__dict__ for m in mlps)  # before any forward
    decisions = []
    real = plan_runner._decide_fusion
    monkeypatch.setattr(plan_runner, "_decide_fusion", lambda *a: decisions.append(1) or real(*a))
    with torch.no_grad():
        model(ids())
    assert decisions == [] and len(fused_mlps(model)) == 2


def test_class_patched_training_matches_unpatched(class_patched):
    ref = tiny_model("qwen2")
    class_patched("qwen2")
    model = tiny_model("qwen2")  # from_config, same seed: same initial weights
    assert len(fused_mlps(model)) == 2
    grads = []
    for m in (ref, model):
        out = m(ids(), labels=ids())
        out.loss.backward()
        grads.append({n: p.grad for n, p in m.named_parameters()})
    for name, g in grads[0].items():
        assert_nontrivial(grads[1][name], name)
        assert rel_rms(grads[1][name], g) < 2e-5, name


def test_register_patch_mapping(tmp_path):
    monkey_patching = pytest.importorskip("transformers.monkey_patching")
    plain = tiny_model("mistral")
    plain.save_pretrained(tmp_path)
    mapping = patch_mapping("mistral")
    assert list(mapping) == ["MistralMLP"]
    monkey_patching.register_patch_mapping(mapping)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    except ModuleNotFoundError as e:
        if e.name != "torchvision":
            raise
        # transformers 5.17 applies registered patches by importing every model's
        # module, and some need torchvision (not installable beside the CPU torch here).
        pytest.skip(f"transformers {transformers.__version__}: applying a patch mapping imports torchvision")
    finally:
        monkey_patching.unregister_patch_mapping(list(mapping))
    assert len(fused_mlps(model)) == 2
    with torch.no_grad():
        torch.testing.assert_close(model(ids()).logits, plain(ids()).logits, rtol=1e-5, atol=1e-5)


def test_class_patching_leaves_other_activations_and_validates(class_patched):
    class_patched("llama")
    gelu = tiny_model("llama", hidden_act="tanh")  # no GLU kind: the original forward runs
    assert all(isinstance(layer.mlp, SwiGLUMLP) and layer.mlp.fusion() is None for layer in gelu.model.layers)
    ref = copy.deepcopy(gelu)
    for layer in ref.model.layers:  # the original class, same weights
        layer.mlp.__class__ = layer.mlp._swiglu_base
    with torch.no_grad():
        torch.testing.assert_close(gelu(ids()).logits, ref(ids()).logits, rtol=0, atol=0)
    with pytest.raises(ValueError, match="no SwiGLU MLP class"):
        apply_to("gpt2")  # GPT2MLP: c_fc/c_proj, a GELU MLP
    with pytest.raises(ValueError, match="cannot import"):
        apply_to("no_such_model")
    with pytest.raises(TypeError, match="target must be"):
        apply_to(3)


def test_accelerate_load_checkpoint_without_warnings(tmp_path, caplog):
    accelerate = pytest.importorskip("accelerate")
    plain = tiny_model("llama")
    plain.save_pretrained(tmp_path)
    model = tiny_model("llama", seed=5)
    assert patch_model(model, strict=True) == 2
    with caplog.at_level(logging.WARNING), warnings.catch_warnings():
        warnings.simplefilter("error")
        accelerate.load_checkpoint_in_model(model, str(tmp_path / "model.safetensors"))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    with torch.no_grad():
        torch.testing.assert_close(model(ids()).logits, plain(ids()).logits, rtol=1e-5, atol=1e-5)


def test_projection_hooks_are_honoured():
    """A hook on a projection makes the MLP call it (and fuse only silu * up)."""
    model = tiny_model("llama")
    assert patch_model(model) == 2
    mlp = model.model.layers[0].mlp
    seen = []
    handle = mlp.up_proj.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    assert mlp.fusion() == "activation"
    x = torch.randn(3, 64)
    ref = mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    seen.clear()
    torch.testing.assert_close(mlp(x), ref, rtol=1e-5, atol=1e-6)
    assert seen == [torch.Size([3, 128])]
    handle.remove()
    assert mlp.fusion() == "mlp"


def _swiglu_ops(ep):
    return sorted({str(n.target) for gm in ep.graph_module.modules() if isinstance(gm, torch.fx.GraphModule)
                   for n in gm.graph.nodes if n.op == "call_function" and "swiglu_cupy" in str(n.target)})


@pytest.mark.parametrize("grad_enabled", [False, True], ids=["no_grad", "grad"])
def test_export_decompositions_leave_no_swiglu_op(grad_enabled):
    model = tiny_model("llama", use_cache=False).eval()
    assert patch_model(model) == 2
    x = ids()
    with torch.set_grad_enabled(grad_enabled):
        ep = torch.export.export(model, (x,))
    assert _swiglu_ops(ep) == ["swiglu_cupy.swiglu_forward.default"]
    plain = ep.run_decompositions(ops.aten_decompositions())
    assert _swiglu_ops(plain) == []
    with torch.no_grad():
        torch.testing.assert_close(plain.module()(x).logits, model(x).logits, rtol=1e-5, atol=1e-5)


def test_export_then_onnx_under_no_grad_matches_onnxruntime():
    """An ExportedProgram holding our op goes to ONNX after
    run_decompositions(aten_decompositions()) (torch.onnx.export(model)
    itself traces aten math: tests/test_transforms.py)."""
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    model = tiny_model("llama", use_cache=False).eval()
    assert patch_model(model) == 2
    x = ids()
    with torch.no_grad():
        ep = torch.export.export(model, (x,))
        expected = model(x).logits
    onnx_program = torch.onnx.export(ep.run_decompositions(ops.aten_decompositions()), (x,), dynamo=True,
                                     verbose=False)
    session = ort.InferenceSession(onnx_program.model_proto.SerializeToString())
    feeds = {session.get_inputs()[0].name: x.numpy()}
    logits = torch.from_numpy(session.run(None, feeds)[0])
    assert rel_rms(logits, expected) < 1e-5


def test_patching_inside_a_meta_device_context():
    """transformers builds skeletons under ``with torch.device("meta")`` and
    post_init hooks (class-level patching) run inside it: the probes must not
    create meta tensors of their own."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=128, hidden_act="silu",
                               pad_token_id=0, eos_token_id=1, bos_token_id=1)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
        assert patch_model(model) == 2
        report = sc.patch(AutoModelForCausalLM.from_config(cfg))
    # Nothing to compute with on meta: switched undecided, probed at the first real forward.
    assert len(report.pending) == 2 and not report.fused, report
    reference = AutoModelForCausalLM.from_config(cfg)
    model.to_empty(device="cpu")
    model.load_state_dict(reference.state_dict())
    with torch.no_grad():  # non-persistent buffers (rotary inv_freq) are not in the state dict
        for (_, buffer), (_, ref_buffer) in zip(model.named_buffers(), reference.named_buffers()):
            buffer.copy_(ref_buffer)
    ids = torch.randint(2, 128, (2, 7), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-6)
    assert [m.fusion() for m in model.modules() if isinstance(m, SwiGLUMLP)] == ["mlp", "mlp"]
