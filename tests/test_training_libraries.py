"""``swiglu_cupy.patch`` on the real model classes of three training libraries:
litgpt, torchtune and OLMo-core. Each section builds the library's stock
model from a tiny config with the library's own builders, patches it, and
checks the report (every GLU feed-forward fused whole, the MoE experts fused
or named with a reason, nothing left out silently) and the parity of logits
and of every parameter gradient against an unpatched deepcopy, in fp32, also
under the library's own activation checkpointing where it runs on the CPU.

CI installs them with the other peers (README command 1, both venvs):
``pip install --no-deps -r tests/requirements/peers.txt``, which says what
each needs and why --no-deps.

Tolerances (fp32): the fused op computes each MLP with the same GEMMs but
rounds ``act(gate) * up`` once where eager rounds twice and may sum in
another order, so logits and gradients differ by a few ulps per layer.
Every tensor must agree within ``GRAD_RTOL`` of its largest entry (about
80 ulps of fp32: measured at most 3e-6 here); a wrong activation (GELU
against its tanh form, 1e-3), a swapped gate/up or a lost gradient is
orders of magnitude above it.
"""
from __future__ import annotations

import contextlib
import copy
import importlib
import importlib.abc
import importlib.machinery
import inspect
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import swiglu_cupy as sc
from swiglu_cupy.integrations import plan_runner as fused_forward
from swiglu_cupy.integrations import patching as sc_patching
from swiglu_cupy.integrations.fused import FusedGLUMLP

GRAD_RTOL = 1e-5
VOCAB = 97


@pytest.fixture
def whole_mlp_calls(monkeypatch):
    """How many times the whole-MLP fused op ran (unpacked gate/up, as every
    library here has): parity alone cannot tell it from the module's own
    forward, as on the CPU the two can agree to the last bit."""
    return count_whole_mlp_calls(monkeypatch)


def count_whole_mlp_calls(monkeypatch, module=fused_forward, name: str | None = None) -> list[int]:
    """The rows of each call of the whole-MLP fused op (``module.<name>``: the
    walk's fused forward, whose separate projections call the API's
    ``run_feed_forward`` with ``[x, weights...]``, or a class-switched
    library's ``swiglu_unpacked``) from now on (until ``monkeypatch`` is
    undone); also used in the ranks of test_training_libraries_sharded.py."""
    calls = []
    name = name or ("run_feed_forward" if module is fused_forward else "swiglu_unpacked")
    real = getattr(module, name)

    def counting(first, *args, **kwargs):
        x = first[0] if isinstance(first, list) else first  # run_feed_forward takes [x, weights...]
        calls.append(x.shape[0] if x.dim() == 2 else x.shape[:-1].numel())
        return real(first, *args, **kwargs)

    monkeypatch.setattr(module, name, counting)
    return calls


def assert_model_parity(patched: nn.Module, reference: nn.Module, forward, loss=lambda y: y.square().mean()):
    """Same output and the same gradient for every parameter (names and
    presence included) from ``forward(model)`` on both models."""
    out, ref_out = forward(patched), forward(reference)
    assert_close_to_scale(out, ref_out, "output")
    loss(out).backward()
    loss(ref_out).backward()
    ours, theirs = dict(patched.named_parameters()), dict(reference.named_parameters())
    assert list(ours) == list(theirs)  # patching keeps every parameter, under its name
    for name, ref_param in theirs.items():
        grad, ref_grad = ours[name].grad, ref_param.grad
        assert (grad is None) == (ref_grad is None), name
        if ref_grad is not None:
            assert_close_to_scale(grad, ref_grad, name)


def assert_close_to_scale(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype == torch.float32, what
    scale = expected.abs().max().item()
    error = (actual - expected).abs().max().item()
    assert error <= GRAD_RTOL * scale, f"{what}: max error {error:.3g}, {error / max(scale, 1e-30):.3g} of its scale"


def assert_fused_whole(report, model: nn.Module, glu_classes: tuple[type, ...], skipped=()) -> list[str]:
    """Every module of ``glu_classes`` in ``model`` is in ``report.fused``
    and runs the whole MLP fused; nothing was skipped (but the paths in
    ``skipped``) or fused only in part."""
    paths = [p for p, m in model.named_modules() if isinstance(m, glu_classes)]
    assert paths, "the model holds none of the GLU classes: the config did not build what the test is about"
    assert sorted(report.skipped) == sorted(skipped) and report.partial == {} and report.pending == {}, str(report)
    assert sorted(report.fused) == sorted(paths), str(report)
    for path in paths:
        module = model.get_submodule(path)
        assert isinstance(module, FusedGLUMLP) and module.fusion() == "mlp", path
    return paths


# ---- litgpt ----------------------------------------------------------------------------------

PEERS_PIP = "pip install --no-deps -r tests/requirements/peers.txt"  # README command 1 and both CI venvs


@pytest.fixture(scope="module")
def litgpt():
    return pytest.importorskip("litgpt", reason=f"litgpt is not installed; CI installs it with: {PEERS_PIP}")


def litgpt_model(litgpt, name: str, **overrides):
    """litgpt's stock GPT for a named config, shrunk to two tiny layers."""
    import litgpt.model as lm
    from litgpt.model import GPT

    tiny = dict(n_layer=2, n_embd=32, n_head=4, n_query_groups=2, head_size=8, intermediate_size=64,
                vocab_size=VOCAB, padded_vocab_size=128, block_size=16)
    config = litgpt.Config.from_name(name, **{**tiny, **overrides})
    torch.manual_seed(0)
    model = GPT(config)
    # GroupedTopkRouter's weight is torch.empty until litgpt's own init; the
    # Linears keep torch's default init (larger than litgpt's std=0.02, so the
    # activations reach past their linear range).
    for module in model.modules():
        if isinstance(module, lm.GroupedTopkRouter):
            model._init_weights(module)
    return model


def checkpoint_blocks(model: nn.Module) -> None:
    """litgpt's activation checkpointing: torch's ``checkpoint_wrapper`` around
    every ``Block`` (its FSDP strategy's ``activation_checkpointing_policy={Block}``,
    and what ``litgpt.finetune.lora.parallelize_fn`` does), here without FSDP."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model.transformer.h = nn.ModuleList(checkpoint_wrapper(b, preserve_rng_state=False) for b in model.transformer.h)


# name, overrides, the class of its feed-forward, the activation the probe must find
LITGPT_DENSE = {
    "llama": ("Llama-3.2-1B", {}, "LLaMAMLP", "silu"),
    "gemma_tanh": ("Gemma-2b", {}, "GemmaMLP", "gelu_tanh"),  # Gemma's configs: gelu_approximate="tanh"
    "gemma_exact_bias": ("Gemma-2b", dict(gelu_approximate="none", bias=True), "GemmaMLP", "gelu"),
}


@pytest.mark.parametrize("case", sorted(LITGPT_DENSE))
def test_litgpt_dense_mlps_are_fused_whole_with_parity(litgpt, case, whole_mlp_calls):
    import litgpt.model as lm

    name, overrides, cls_name, activation = LITGPT_DENSE[case]
    model = litgpt_model(litgpt, name, **overrides)
    assert model.config.mlp_class_name == cls_name
    reference = copy.deepcopy(model)
    report = sc.patch(model)
    paths = assert_fused_whole(report, model, (lm.LLaMAMLP,))  # GemmaMLP is a LLaMAMLP subclass
    assert {report.classes[p] for p in paths} == {cls_name}
    assert {str(model.get_submodule(p).swiglu_plan.activation) for p in paths} == {activation}
    # litgpt's MLP names no roles: the probe picked fc_1 as the gate (F.silu/F.gelu(fc_1(x)) * fc_2(x))
    assert {report.fused[p] for p in paths} == {f"{activation}: fc_1/fc_2 -> proj"}
    idx = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    whole_mlp_calls.clear()  # the probe ran the fused op too
    assert_model_parity(model, reference, lambda m: m(idx))
    assert whole_mlp_calls == [24] * len(paths)


# Mixtral's router (a Linear, top-k then softmax); DeepSeek-style options of the
# same LLaMAMoE: a shared expert, the grouped top-k router, a routed scale.
LITGPT_MOE = {
    "mixtral": ("Mixtral-8x7B-v0.1", dict(n_expert=4, n_expert_per_token=2, moe_intermediate_size=48)),
    "shared_grouped": ("Qwen3-30B-A3B", dict(n_expert=8, n_expert_per_token=1, moe_intermediate_size=48,
                                             n_shared_expert=1, n_expert_groups=2, n_topk_groups=1,
                                             n_topk_scores_per_group=1, routed_scaling_factor=2.5)),
}


@pytest.mark.parametrize("checkpointed", [False, True], ids=["eager", "checkpointed"])
@pytest.mark.parametrize("case", sorted(LITGPT_MOE))
def test_litgpt_moe_experts_are_fused_whole_with_parity(litgpt, case, checkpointed, whole_mlp_calls):
    """``LLaMAMoE`` is a router and a ModuleList of ``LLaMAMLP`` experts that it
    calls on each expert's tokens: the walk passes the router by and fuses
    every expert (and the shared one) as the dense GLU it is; the routing runs
    as litgpt's own. Few tokens, so that some experts get none (an empty call)."""
    import litgpt.model as lm

    name, overrides = LITGPT_MOE[case]
    model = litgpt_model(litgpt, name, **overrides)
    reference = copy.deepcopy(model)
    if checkpointed:  # wrapped first, then patched: the walk goes through the wrappers
        checkpoint_blocks(model)
        checkpoint_blocks(reference)
    report = sc.patch(model)
    paths = assert_fused_whole(report, model, (lm.LLaMAMLP,))
    moes = [m for m in model.modules() if isinstance(m, lm.LLaMAMoE)]
    assert len(moes) == 2
    experts_per_moe = model.config.n_expert + (1 if model.config.n_shared_expert else 0)
    assert len(paths) == 2 * experts_per_moe
    assert not any(isinstance(m, FusedGLUMLP) for m in moes)  # the router block itself runs as litgpt's
    idx = torch.randint(0, VOCAB, (1, 3), generator=torch.Generator().manual_seed(2))
    whole_mlp_calls.clear()
    assert_model_parity(model, reference, lambda m: m(idx))
    # every expert is called once per forward (litgpt loops over all of them),
    # and again by the checkpoint's recompute in backward
    assert len(whole_mlp_calls) == len(paths) * (2 if checkpointed else 1)
    idle = [p for p in paths if model.get_submodule(p).proj.weight.grad.abs().max() == 0]
    assert case != "shared_grouped" or idle, "every expert got tokens: the empty-call path went untested"


def test_every_gated_litgpt_config_is_fused_whole(litgpt, whole_mlp_calls):
    """Every named config of litgpt's table whose MLP is gated (LLaMAMLP,
    GemmaMLP, LLaMAMoE; GptNeoxMLP is not a GLU), shrunk to two tiny layers:
    each GLU module is fused whole and nothing is skipped, partial or pending
    (0 unreported), and the logits equal the unpatched copy's."""
    import litgpt.model as lm
    from litgpt.config import configs

    gated = [c["name"] for c in configs if c.get("mlp_class_name", "GptNeoxMLP") != "GptNeoxMLP"]
    assert len(gated) > 150, len(gated)
    tokens = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(8))
    for name in gated:
        moe = litgpt.Config.from_name(name).mlp_class_name == "LLaMAMoE"
        model = litgpt_model(litgpt, name, **(dict(n_expert=4, n_expert_per_token=2, moe_intermediate_size=48)
                                              if moe else {}))
        reference = copy.deepcopy(model)
        report = sc.patch(model)
        paths = assert_fused_whole(report, model, (lm.LLaMAMLP, lm.GemmaMLP))
        whole_mlp_calls.clear()
        with torch.no_grad():
            assert_close_to_scale(model(tokens), reference(tokens), f"{name} logits")
        assert len(whole_mlp_calls) == len(paths) or moe, name   # the experts run only where routed
        assert whole_mlp_calls, name


def test_litgpt_checkpointed_dense_model_keeps_parity(litgpt, whole_mlp_calls):
    """Patched first, then wrapped by litgpt's checkpointing: the recompute in
    backward runs the fused forward again (the fused modules stay fused)."""
    import litgpt.model as lm

    model = litgpt_model(litgpt, "Gemma-2b")
    reference = copy.deepcopy(model)
    assert len(sc.patch(model).fused) == 2
    checkpoint_blocks(model)
    checkpoint_blocks(reference)
    again = sc.patch(model)
    assert sorted(assert_fused_whole(again, model, (lm.LLaMAMLP,))) == sorted(again.already)
    idx = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    whole_mlp_calls.clear()
    assert_model_parity(model, reference, lambda m: m(idx))
    assert len(whole_mlp_calls) == 2 * 2  # two blocks, each run again in backward


# ---- torchtune -------------------------------------------------------------------------------

# Imported through a stand-in when not installed (tests/stand_ins): see the fixture.
TORCHTUNE_STAND_INS = ("datasets", "torchao", "torchvision")
STAND_INS = Path(__file__).resolve().parent / "stand_ins"


@pytest.fixture(scope="module")
def torchtune():
    """torchtune, imported with stand-ins (tests/stand_ins) for what is not
    installed of: Hugging Face ``datasets`` (torchtune's dataset builders
    import it at import time; it brings pyarrow and pandas) and ``torchao``
    (torchtune imports its NF4 tensor at import time; the torchao that has it
    breaks peft's import, see the stand-in). No model here uses either. The
    stand-ins are gone from ``sys.modules`` and ``sys.path`` again once
    torchtune's models are imported, so nothing else in the session sees them."""
    if importlib.util.find_spec("torchtune") is None:
        pytest.skip(f"torchtune is not installed; CI installs it with: {PEERS_PIP}")
    return import_torchtune()


def import_torchtune(*more: str):
    """torchtune and the modules of it the tests build from (and ``more``,
    e.g. "training"), imported with the stand-ins. Shared with
    test_training_libraries_sharded.py."""
    with stand_ins_for_import(TORCHTUNE_STAND_INS):
        module = importlib.import_module("torchtune")
        for name in ("models.gemma", "models.gemma2", "models.llama2", "models.llama3", "models.llama3_1",
                     "models.llama3_2", "models.llama3_2_vision", "models.mistral", "models.phi3", "models.qwen2",
                     "models.t5", "modules", *more):
            importlib.import_module(f"torchtune.{name}")
    return module


class _StandInFinder(importlib.abc.MetaPathFinder):
    """Finds the stand-ins of tests/stand_ins for ``names`` only: putting the
    folder on ``sys.path`` would also shadow an installed package that has a
    stand-in there (torchvision beside torch 2.14, which torchmetrics then
    failed to import ``torchvision.models`` from)."""

    def __init__(self, names):
        self.names = set(names)

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] not in self.names:
            return None
        return importlib.machinery.PathFinder.find_spec(fullname, path if "." in fullname else [str(STAND_INS)])


@contextlib.contextmanager
def stand_ins_for_import(names):
    """Serve the stand-ins (tests/stand_ins) of those of ``names`` that are
    not installed, and take them out of ``sys.modules`` after."""
    missing = [n for n in names if importlib.util.find_spec(n) is None]
    finder = _StandInFinder(missing)
    if missing:
        sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        if missing:
            sys.meta_path.remove(finder)
            for name in [m for m in sys.modules if m.split(".")[0] in missing]:
                del sys.modules[name]


TUNE_V = VOCAB


def torchtune_model(torchtune, family: str):
    """torchtune's stock decoder of ``family`` from its component builder, tiny."""
    from torchtune.models.gemma import gemma
    from torchtune.models.gemma2 import gemma2
    from torchtune.models.llama2 import llama2
    from torchtune.models.llama3 import llama3
    from torchtune.models.llama3_1 import llama3_1
    from torchtune.models.llama3_2 import llama3_2, lora_llama3_2
    from torchtune.models.llama3_2_vision import llama3_2_vision_decoder
    from torchtune.models.mistral import mistral
    from torchtune.models.phi3 import phi3
    from torchtune.models.qwen2 import qwen2
    from torchtune.models.t5 import t5_encoder

    dims = dict(vocab_size=VOCAB, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32, max_seq_len=32,
                intermediate_dim=64)
    builders = {
        "llama2": lambda: llama2(**dims),
        "llama3": lambda: llama3(**dims),
        "llama3_1": lambda: llama3_1(**dims),
        "llama3_2": lambda: llama3_2(**dims),
        "mistral": lambda: mistral(**dims),
        # the decoder of Llama-3.2-Vision: self-attention layers plus a fusion layer (cross-attention and its
        # own FeedForward) every fusion_interval layers
        "llama3_2_vision": lambda: llama3_2_vision_decoder(fusion_interval=1, num_special_tokens=2,
                                                           encoder_max_seq_len=TUNE_ENCODER_TOKENS, **dims),
        # T5 v1.1's encoder (the text encoder of torchtune's Flux recipes): GEGLU with exact (erf) GELU;
        # it takes exactly max_seq_len tokens (the tests' 12)
        "t5": lambda: t5_encoder(embed_dim=32, mlp_dim=64, num_heads=4, head_dim=8, num_layers=2,
                                 rel_pos_num_buckets=8, rel_pos_max_dist=16, vocab_size=VOCAB, norm_eps=1e-6,
                                 max_seq_len=12),
        "qwen2": lambda: qwen2(**dims),
        "phi3": lambda: phi3(**dims),
        "gemma": lambda: gemma(head_dim=8, **dims),
        "gemma2": lambda: gemma2(head_dim=8, **dims),
        "lora_llama3_2": lambda: lora_llama3_2(lora_attn_modules=["q_proj", "v_proj"], apply_lora_to_mlp=True,
                                               lora_rank=4, lora_alpha=8, **dims),
    }
    torch.manual_seed(0)
    return builders[family]()


# family -> the activation torchtune's builder gives its FeedForward (every decoder builder of torchtune
# 0.6.1 with a GLU: llama3_3/qwen2_5/phi4/code_llama2 call these same builders; CLIP's MLP is not gated)
TORCHTUNE_DENSE = {"llama2": "silu", "llama3": "silu", "llama3_1": "silu", "llama3_2": "silu", "mistral": "silu",
                   "qwen2": "silu", "phi3": "silu", "gemma": "gelu_tanh", "gemma2": "gelu_tanh",
                   "llama3_2_vision": "silu", "t5": "gelu"}
TUNE_ENCODER_TOKENS = 6


def torchtune_forward(family: str, tokens: torch.Tensor):
    """How ``family``'s model is called: the vision decoder also takes the (projected) image tokens its
    fusion layers cross-attend to."""
    if family != "llama3_2_vision":
        return lambda m: m(tokens)
    encoder_input = torch.randn(tokens.shape[0], TUNE_ENCODER_TOKENS, 32, generator=torch.Generator().manual_seed(6))
    mask = torch.ones(tokens.shape[0], tokens.shape[1], TUNE_ENCODER_TOKENS, dtype=torch.bool)
    return lambda m: m(tokens, encoder_input=encoder_input, encoder_mask=mask)


@pytest.mark.parametrize("checkpointed", [False, True], ids=["eager", "checkpointed"])
@pytest.mark.parametrize("family", sorted(TORCHTUNE_DENSE))
def test_torchtune_feed_forwards_are_fused_whole_with_parity(torchtune, family, checkpointed, whole_mlp_calls):
    """torchtune's ``FeedForward`` (``w1``/``w3``/``w2`` and an ``activation``
    module, roles named by nothing): the probe picks w1 as the gate. Under
    torchtune's activation checkpointing as its recipes set it
    (``set_activation_checkpointing``: torch's ``apply_activation_checkpointing``
    on every ``TransformerSelfAttentionLayer``)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from torchtune.models.t5._encoder import T5EncoderLayer
    from torchtune.modules import FeedForward, TransformerCrossAttentionLayer, TransformerSelfAttentionLayer

    model = torchtune_model(torchtune, family)
    reference = copy.deepcopy(model)
    report = sc.patch(model)
    paths = assert_fused_whole(report, model, (FeedForward,))
    activation = TORCHTUNE_DENSE[family]
    assert {report.fused[p] for p in paths} == {f"{activation}: w1/w3 -> w2"}
    if checkpointed:  # patched first, then wrapped: the fused modules run inside torchtune's checkpoint
        for m in (model, reference):
            # torchtune.training.set_activation_checkpointing(m, {TransformerSelfAttentionLayer}) is these
            # two torch calls; torchtune.training itself imports torchao's quantizers
            apply_activation_checkpointing(m, auto_wrap_policy=ModuleWrapPolicy(
                {TransformerSelfAttentionLayer, TransformerCrossAttentionLayer, T5EncoderLayer}))
        assert all("_checkpoint_wrapped_module" in p for p, m in model.named_modules() if isinstance(m, FeedForward))
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(4))
    whole_mlp_calls.clear()
    loss = lambda y: y.square().mean()  # noqa: E731
    if family == "t5":  # it ends in an RMSNorm, whose mean square is 1 whatever its input: no gradient
        probe = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(7))
        loss = lambda y: (y * probe).sum()  # noqa: E731
    assert_model_parity(model, reference, torchtune_forward(family, tokens), loss)
    assert whole_mlp_calls == [24] * (len(paths) * (2 if checkpointed else 1))


def test_torchtune_lora_feed_forward_fuses_the_activation_and_says_why(torchtune):
    """``lora_llama3_2(apply_lora_to_mlp=True)``: w1/w3/w2 are ``LoRALinear``,
    which run as themselves; only ``act(gate) * up`` is fused, and the report
    says so (``partial``), with parity."""
    from torchtune.modules import FeedForward

    model = torchtune_model(torchtune, "lora_llama3_2")
    reference = copy.deepcopy(model)
    report = sc.patch(model)
    paths = [p for p, m in model.named_modules() if isinstance(m, FeedForward)]
    assert report.fused == {} and report.skipped == {} and sorted(report.partial) == sorted(paths) and paths
    for path in paths:
        assert "LoRALinear is not an nn.Linear" in report.partial[path]
        assert model.get_submodule(path).fusion() == "activation"
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(5))
    assert_model_parity(model, reference, lambda m: m(tokens))


def test_torchtune_ungated_feed_forward_is_left_as_it_is(torchtune):
    """torchtune's ``FeedForward`` without ``up_proj`` (CLIP's MLP) is
    ``w2(act(w1(x)))``, no GLU: w1's output is w2's input, never twice it, so
    no packed layout fits and the walk does not take it for a feed-forward
    to fuse (nor report it: it is not a GLU)."""
    from torchtune.modules import FeedForward

    torch.manual_seed(0)
    ungated = FeedForward(gate_proj=nn.Linear(16, 64), down_proj=nn.Linear(64, 16), activation=nn.GELU())
    report = sc.patch(ungated)
    assert len(report) == 0 and report.skipped == {}, report
    assert type(ungated) is FeedForward


def _torchtune_model_builders() -> list[tuple[str, object]]:
    """("family.name", builder) of every model builder torchtune ships: the
    public functions of each ``torchtune.models`` package that need no
    argument (the named sizes: llama3_1_405b, qwen2_5_72b_instruct, ...;
    tokenizers, transforms and LoRA builders need arguments or are no model)."""
    import pkgutil

    import torchtune.models

    found = []
    for package in pkgutil.iter_modules(torchtune.models.__path__):
        if not package.ispkg:
            continue
        module = importlib.import_module(f"torchtune.models.{package.name}")
        for name in getattr(module, "__all__", ()):
            fn = getattr(module, name)
            if not inspect.isfunction(fn) or "tokenizer" in name or "transform" in name:
                continue
            params = inspect.signature(fn).parameters.values()
            if all(p.default is not p.empty or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) for p in params):
                found.append((f"{package.name}.{name}", fn))
    return found


def test_every_torchtune_model_builder_is_fused_or_pending(torchtune):
    """Every named model builder of torchtune 0.6.1 (Llama 2/3/3.1/3.2/3.3 and
    the 3.2-Vision models, Code Llama 2, Mistral, Qwen2/2.5, Phi-3/4, Gemma 1/2,
    T5, CLIP, Flux's autoencoder), built on the meta device at its real size:
    every gated ``FeedForward`` is pending (decided at its first forward, as
    the tiny models above show), nothing is skipped or fused only in part,
    and the ungated ones (CLIP's, the vision encoders') are not reported."""
    from torchtune.modules import FeedForward

    builders = _torchtune_model_builders()
    names = [name for name, _ in builders]
    for family in ("llama3_3", "qwen2_5", "phi4", "code_llama2", "llama3_2_vision", "t5"):
        assert any(name.startswith(family + ".") for name in names), (family, names)
    models = 0
    for name, builder in builders:
        with torch.device("meta"):
            model = builder()
        if not isinstance(model, nn.Module):  # base_llama_tp_plan: a dict
            continue
        models += 1
        report = sc.patch(model)
        gated = [p for p, m in model.named_modules() if isinstance(m, FeedForward) and m.w3 is not None]
        assert sorted(report.pending) == sorted(gated), (name, str(report))
        assert not report.fused and not report.skipped and not report.partial and not report.unreached, \
            (name, str(report))
    assert models >= 40, names


# ---- OLMo-core -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def olmo_core():
    """OLMo-core, imported with the ``cached_path`` stand-in (tests/stand_ins)
    when ``cached_path`` is not installed: the real one imports the Google
    Cloud, AWS and Hugging Face clients at its import, and OLMo-core's config
    module imports it at its own; no model here reads a remote file. The
    stand-in is gone from ``sys.modules`` and ``sys.path`` again once
    OLMo-core's transformer is imported."""
    if importlib.util.find_spec("olmo_core") is None:
        pytest.skip(f"ai2-olmo-core is not installed; CI installs it with: {PEERS_PIP}")
    with stand_ins_for_import(("cached_path",)):
        module = importlib.import_module("olmo_core.nn.transformer")
    return module


def olmo_model(olmo_core, builder: str, **overrides):
    """OLMo-core's stock transformer from one of its config builders, tiny,
    built and initialised on the CPU as its trainer does."""
    make = getattr(olmo_core.TransformerConfig, builder)
    config = make(d_model=32, vocab_size=128, n_layers=2, n_heads=4, **overrides)
    torch.manual_seed(0)
    model = config.build(init_device="cpu")
    model.init_weights(device=torch.device("cpu"))
    return model


NO_GROUPED_GEMM = pytest.mark.filterwarnings("ignore:Grouped GEMM not available")  # DroplessMoEMLP's, at build


OLMO_DENSE = {
    "llama_silu": ("llama_like", dict(hidden_size_multiple_of=16), "silu"),
    "gemma3_gelu_tanh": ("gemma3_like", dict(n_kv_heads=2, hidden_size=64), "gelu_tanh"),
}


@pytest.mark.parametrize("checkpointed", [False, True], ids=["eager", "checkpointed"])
@pytest.mark.parametrize("case", sorted(OLMO_DENSE))
def test_olmo_core_feed_forwards_are_fused_whole_with_parity(olmo_core, case, checkpointed, whole_mlp_calls):
    """OLMo-core's ``FeedForward`` (``w1``/``w3``/``w2`` and an
    ``activation_fn`` function, F.silu or tanh-GELU): the probe identifies
    the function by value and picks w1 as the gate. Checkpointed by the
    model's own ``apply_activation_checkpointing("full")``."""
    from olmo_core.nn.feed_forward import FeedForward

    builder, overrides, activation = OLMO_DENSE[case]
    model = olmo_model(olmo_core, builder, **overrides)
    reference = copy.deepcopy(model)
    report = sc.patch(model)
    paths = assert_fused_whole(report, model, (FeedForward,))
    assert {report.fused[p] for p in paths} == {f"{activation}: w1/w3 -> w2"}
    if checkpointed:
        for m in (model, reference):
            m.apply_activation_checkpointing("full")
    tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(6))
    whole_mlp_calls.clear()
    assert_model_parity(model, reference, lambda m: m(tokens))
    assert whole_mlp_calls == [24] * (len(paths) * (2 if checkpointed else 1))


@pytest.fixture
def normalized_calls(monkeypatch):
    """The rows of each call of ``swiglu_unpacked`` by OLMo-core's switched nGPT feed-forward."""
    from swiglu_cupy.integrations import olmo_core as olmo_core_integration

    return count_whole_mlp_calls(monkeypatch, olmo_core_integration)


def ngpt_model(olmo_core):
    """``ngpt_like`` with its scales away from 1 (their init), so that folding them in is tested."""
    from olmo_core.nn.feed_forward import NormalizedFeedForward

    model = olmo_model(olmo_core, "ngpt_like")
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, NormalizedFeedForward):
                for scale in (m.sw1, m.sw3):
                    scale.copy_(0.5 + torch.rand(scale.shape, generator=gen))
    return model


@pytest.mark.parametrize("checkpointed", [False, True], ids=["eager", "checkpointed"])
def test_olmo_core_normalized_feed_forward_is_fused_whole_with_parity(olmo_core, checkpointed, normalized_calls):
    """nGPT's ``NormalizedFeedForward`` (learned scales ``sw1``/``sw3`` on the
    gate and up outputs) runs ``swiglu_unpacked`` with the scales folded into
    the w1/w3 rows: logits and every gradient, the scales' included, match
    the unpatched copy, also under OLMo-core's own ``"full"`` checkpointing;
    its own methods (``normalize_matrices``) still work."""
    from olmo_core.nn.feed_forward import NormalizedFeedForward

    model = ngpt_model(olmo_core)
    reference = copy.deepcopy(model)
    report = sc.patch(model)
    paths = [p for p, m in model.named_modules() if isinstance(m, NormalizedFeedForward)]
    assert paths and sorted(report.fused) == sorted(paths) and not report.skipped, str(report)
    assert report.skipped == report.partial == report.pending == {} and report.unreached == {}, str(report)
    for path in paths:
        module = model.get_submodule(path)
        assert type(module).__name__ == "SwiGLUCupyNormalizedFeedForward", path
        assert report.classes[path] == "NormalizedFeedForward"
        assert report.fused[path].startswith("swiglu_cupy.swiglu_unpacked, silu: w1/w3 -> w2, the scales")
    assert list(model.state_dict()) == list(reference.state_dict())
    if checkpointed:
        for m in (model, reference):
            m.apply_activation_checkpointing("full")
    tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(7))
    normalized_calls.clear()  # patch()'s proof ran the fused op too
    assert_model_parity(model, reference, lambda m: m(tokens))
    assert normalized_calls == [24] * (len(paths) * (2 if checkpointed else 1))
    for m in model.modules():
        if isinstance(m, NormalizedFeedForward):
            m.normalize_matrices()
            torch.testing.assert_close(m.w1.weight.norm(dim=-1), torch.ones(m.w1.weight.shape[0]))


def test_olmo_core_normalized_feed_forward_with_hooked_linears(olmo_core, normalized_calls):
    """A linear hooked before ``patch()`` (a LoRA, ZeRO-3, FSDP2 on the child)
    leaves the module unswitched, named in report.skipped with the reason; a
    hook put on after patching makes the call run OLMo-core's own forward,
    which the hook sees."""
    from olmo_core.nn.feed_forward import NormalizedFeedForward

    model = ngpt_model(olmo_core)
    paths = [p for p, m in model.named_modules() if isinstance(m, NormalizedFeedForward)]
    seen = []
    model.get_submodule(paths[0]).w3.register_forward_hook(lambda m, args, out: seen.append("before"))
    reference = copy.deepcopy(model)
    report = sc.patch(model)
    assert report.skipped == {paths[0]: "w3: Linear has hooks"}, str(report)
    assert sorted(report.fused) == sorted(paths[1:]), str(report)
    assert type(model.get_submodule(paths[0])) is NormalizedFeedForward
    model.get_submodule(paths[1]).w1.register_forward_hook(lambda m, args, out: seen.append("after"))
    reference.get_submodule(paths[1]).w1.register_forward_hook(lambda m, args, out: seen.append("after"))
    tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(7))
    seen.clear()
    normalized_calls.clear()  # patch()'s proof ran the fused op too
    assert_model_parity(model, reference, lambda m: m(tokens))
    assert seen.count("before") == 2 and seen.count("after") == 2, seen  # each hook ran in both models
    assert normalized_calls == [24] * (len(paths) - 2)


def _olmo_core_builders(olmo_core):
    """OLMo-core's named model builders: ``TransformerConfig`` classmethods that
    need nothing but ``vocab_size`` (the ``*_like`` ones also need the sizes)."""
    def needs_only_vocab_size(fn) -> bool:
        params = inspect.signature(fn).parameters
        required = [n for n, p in params.items() if p.default is p.empty and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
        return required == ["vocab_size"]

    config = olmo_core.TransformerConfig
    return [name for name, value in vars(config).items()
            if isinstance(value, classmethod) and needs_only_vocab_size(getattr(config, name))]


@NO_GROUPED_GEMM
def test_every_olmo_core_builder_is_fused_or_named(olmo_core):
    """Every named ``TransformerConfig`` builder of OLMo-core (olmo2/olmo3,
    llama2/3, gemma3, qwen3, smallmoe, OLMoE, nGPT, ...; the ``*_like`` ones
    with required sizes are the tiny models of the tests above), built on the
    meta device at its real size: every ``FeedForward`` and MoE experts
    module is fused (the experts and nGPT's by class) or pending (the probe
    runs at the first forward, as the tiny models show), nothing skipped or
    unreported. Qwen3.5's builders need flash-linear-attention (Triton) for
    their GatedDeltaNet layers and cannot be built here: they must raise
    exactly that."""
    from olmo_core.nn.feed_forward import FeedForward
    from olmo_core.nn.moe.mlp import MoEMLPBase

    names = _olmo_core_builders(olmo_core)
    assert len(names) >= 50 and "olmoe_1B_7B" in names and "ngpt_1B" in names, names
    unbuildable, checked = [], 0
    for name in names:
        config = getattr(olmo_core.TransformerConfig, name)(vocab_size=128)
        try:
            with torch.device("meta"):
                model = config.build(init_device="meta")
        except AssertionError:  # olmo_core.nn.attention.recurrent: assert has_fla()
            unbuildable.append(name)
            continue
        report = sc.patch(model)
        paths = [p for p, m in model.named_modules() if isinstance(m, (FeedForward, MoEMLPBase))]
        assert paths, name
        assert sorted([*report.fused, *report.pending]) == sorted(paths), (name, str(report))
        assert not report.skipped and not report.partial and not report.unreached, (name, str(report))
        checked += 1
    assert unbuildable == [n for n in names if n.startswith("qwen3_5_")] and checked == len(names) - len(unbuildable)


@pytest.fixture
def olmo_moe_routing_on_cpu(olmo_core, monkeypatch):
    use_plain_torch_moe_routing(monkeypatch)  # also in the ranks of test_training_libraries_sharded.py


def use_plain_torch_moe_routing(monkeypatch) -> None:
    """OLMo-core's MoE routes tokens with Triton kernels (``olmo_core.ops.moe``'s
    gather/scatter and their binned, capacity-padded forms), which do not run
    on the CPU: here they are the same index maps in plain torch (differentiable
    by autograd), for the patched model and its unpatched copy alike. Only the
    routing is replaced; the router, the experts' modules and their callers
    (``ParallelMLP``/``ParallelDroplessMLP``) are OLMo-core's own.

    ``indices`` lists the routed slots (token * top_k + k) in expert order and
    ``bins`` the cumulative group ends; the binned forms keep the first
    ``capacity`` rows of each expert, zero padding past its count."""
    import olmo_core.ops.moe as routing_ops

    def gather(x, indices, bin_ids, bins, top_k):
        return x[indices.long() // top_k]

    def scatter(x, indices, bin_ids, weights, bins, top_k):
        slots = indices.long()
        rows = x if weights is None else x * weights[slots].unsqueeze(1)
        return x.new_zeros((slots.shape[0], x.shape[1])).index_copy(0, slots, rows).view(-1, top_k, x.shape[1]).sum(1)

    def kept(indices, bins, capacity):
        """(position in the padded [E * capacity] rows, routed slot) of every row kept."""
        ends = bins.long()
        starts = torch.cat([ends.new_zeros(1), ends[:-1]])
        rank = torch.arange(indices.shape[0])
        expert = torch.searchsorted(ends, rank, right=True)
        within = rank - starts[expert]
        keep = within < capacity
        return expert[keep] * capacity + within[keep], indices.long()[keep]

    def binned_gather(x, indices, bins, capacity, top_k):
        padded, slots = kept(indices, bins, capacity)
        out = x.new_zeros((bins.shape[0] * capacity, x.shape[1]))
        return out.index_copy(0, padded, x[slots // top_k]).view(bins.shape[0], capacity, x.shape[1])

    def binned_scatter(x, indices, weights, bins, top_k):
        experts, capacity, width = x.shape
        padded, slots = kept(indices, bins, capacity)
        rows = x.reshape(experts * capacity, width)[padded]
        if weights is not None:
            rows = rows * weights[slots].unsqueeze(1)
        return x.new_zeros((indices.shape[0], width)).index_copy(0, slots, rows).view(-1, top_k, width).sum(1)

    for name, fn in (("gather", gather), ("scatter", scatter), ("binned_gather", binned_gather),
                     ("binned_scatter", binned_scatter)):
        monkeypatch.setattr(routing_ops, name, fn)


@pytest.fixture
def experts_calls(monkeypatch):
    """The rows of every call of the MoE op by OLMo-core's fused experts."""
    from swiglu_cupy.integrations import olmo_core as olmo_core_integration

    return count_whole_mlp_calls(monkeypatch, olmo_core_integration, "grouped_experts_unpacked")


# case -> llama_like_moe's overrides, the experts class, the rows the op runs per layer
# (24 tokens, top-2 of 4 experts: dropless, 48 routed rows; capacity factor 1: 16 per
# expert, ensure_multiple_of(int(1.0 * 2 * 24 / 4), 8), some padding and some dropped)
OLMO_MOE = {
    "capacity": (dict(capacity_factor=1.0), "MoEMLP", 4 * 16),
    "dropless": (dict(dropless=True), "DroplessMoEMLP", 48),
}


@NO_GROUPED_GEMM
@pytest.mark.parametrize("checkpointed", [False, True], ids=["eager", "checkpointed"])
@pytest.mark.parametrize("case", sorted(OLMO_MOE))
def test_olmo_core_moe_experts_and_shared_mlp_are_fused_whole_with_parity(
        olmo_core, olmo_moe_routing_on_cpu, case, checkpointed, whole_mlp_calls, experts_calls):
    """``llama_like_moe`` (capacity-padded ``MoEMLP`` or ``DroplessMoEMLP``,
    whose w1/w2/w3 stack every expert in three 2-D parameters, and a
    ``shared_mlp`` ``FeedForward``): every experts module runs
    ``swiglu_cupy.moe.grouped_experts_unpacked`` and every shared MLP the whole fused
    MLP, nothing skipped; logits and every gradient (router included) match
    the unpatched copy. Checkpointed by OLMo-core's own
    ``apply_activation_checkpointing("selected_modules")`` around the experts
    and the shared MLPs: OLMo-core refuses to wrap MoE blocks ("full",
    "selected_blocks") or the MoE module, and its "selected_ops" fails on the
    CPU in the rotary embedding, unpatched too."""
    from olmo_core.nn.feed_forward import FeedForward
    from olmo_core.nn.moe import mlp as olmo_mlp

    overrides, experts_class, rows = OLMO_MOE[case]
    model = olmo_model(olmo_core, "llama_like_moe", num_experts=4, top_k=2, expert_hidden_size=48,
                       shared_expert_hidden_size=40, hidden_size_multiple_of=16, **overrides)
    reference = copy.deepcopy(model)
    report = sc.patch(model)
    shared = [p for p, m in model.named_modules() if isinstance(m, FeedForward)]
    experts = [p for p, m in model.named_modules() if isinstance(m, olmo_mlp.MoEMLPBase)]
    assert len(shared) == len(experts) == 2 and all(p.endswith("feed_forward_moe.experts.mlp") for p in experts)
    assert report.skipped == report.partial == report.pending == {} and report.unreached == {}, str(report)
    assert sorted(report.fused) == sorted(shared + experts), str(report)
    for path in shared:
        module = model.get_submodule(path)
        assert isinstance(module, FusedGLUMLP) and module.fusion() == "mlp", path
        assert report.fused[path] == "silu: w1/w3 -> w2"
    for path in experts:
        module = model.get_submodule(path)
        assert type(module).__name__ == f"SwiGLUCupy{experts_class}" and type(module).__mro__[1].__name__ == experts_class
        assert report.classes[path] == experts_class
        line = report.fused[path]
        assert line.startswith("swiglu_cupy.moe.grouped_experts_unpacked, silu: ") and "not concatenated" in line
    if checkpointed:
        for m in (model, reference):
            m.apply_activation_checkpointing("selected_modules", modules=["blocks.*.feed_forward_moe.experts",
                                                                          "blocks.*.feed_forward_moe.shared_mlp"])
    tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(8))
    whole_mlp_calls.clear()
    experts_calls.clear()  # patch()'s proof ran the experts op too
    assert_model_parity(model, reference, lambda m: m(tokens))
    runs = len(experts) * (2 if checkpointed else 1)  # checkpointed: forward and recompute
    assert experts_calls == [rows] * runs and whole_mlp_calls == [24] * runs


@NO_GROUPED_GEMM
@pytest.mark.parametrize("case", sorted(OLMO_MOE))
def test_olmo_core_moe_experts_save_no_weight_copy(olmo_core, case):
    """The fused experts save, beyond the parameters, exactly the rows and x12
    (gate and up are never concatenated: no [E, 2H, D] copy), which is less
    than OLMo-core's own experts save; the outputs match."""
    from swiglu_cupy.tools.bench.moe import saved_activation_bytes
    from olmo_core.nn.moe import mlp as olmo_mlp

    E, D, H = 4, 32, 48
    experts = (olmo_mlp.DroplessMoEMLP if case == "dropless" else olmo_mlp.MoEMLP)(d_model=D, hidden_size=H,
                                                                                  num_experts=E)
    torch.manual_seed(0)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.1)
    reference = copy.deepcopy(experts)
    assert sc.patch(experts).fused, "not fused"
    if case == "dropless":
        counts = torch.tensor([5, 0, 7, 4])
        x = torch.randn(int(counts.sum()), D, requires_grad=True)
        call = lambda m: m(x, counts)  # noqa: E731
    else:
        x = torch.randn(E, 6, D, requires_grad=True)
        call = lambda m: m(x)  # noqa: E731
    rows = x.numel() // D
    ours = saved_activation_bytes(lambda: call(experts), list(experts.parameters()) + [x])
    theirs = saved_activation_bytes(lambda: call(reference), list(reference.parameters()) + [x])
    assert ours == rows * 2 * H * 4 + E * 4, (ours, theirs)  # x12 fp32 and the int32 offsets; x is the input
    assert ours < theirs, (ours, theirs)
    torch.testing.assert_close(call(experts), call(reference), rtol=1e-5, atol=1e-6)


@NO_GROUPED_GEMM
def test_olmo_core_experts_of_other_classes_are_skipped_with_their_reason(olmo_core):
    """Only ``MoEMLP`` and ``DroplessMoEMLP`` themselves are switched (their
    forwards are reproduced): a subclass with its own forward, another
    ``MoEMLPBase`` class or OLMo-core's v2 ``RoutedExperts`` (``KNOWN_UNFUSED``)
    or a replaced instance forward is named in the report with the reason
    and left as it is. A switched
    one survives deepcopy (pickles as OLMo-core's class, switched on load)
    and patching again."""
    from olmo_core.nn.moe import mlp as olmo_mlp

    class ScaledExperts(olmo_mlp.MoEMLP):
        def forward(self, x):
            return 2 * super().forward(x)

    class OtherExperts(olmo_mlp.MoEMLPBase):
        def __init__(self):
            super().__init__(d_model=8, hidden_size=16, num_experts=2)
            self.w1, self.w2, self.w3 = (nn.Parameter(torch.randn(2 * 8, 16)) for _ in range(3))

        def forward(self, x):
            return x

    from olmo_core.config import DType
    from olmo_core.nn.moe.v2.routed_experts import RoutedExperts

    kw = dict(d_model=8, hidden_size=16, num_experts=2)
    model = nn.ModuleDict({"plain": olmo_mlp.MoEMLP(**kw), "dropless": olmo_mlp.DroplessMoEMLP(**kw),
                           "sub": ScaledExperts(**kw), "other": OtherExperts(),
                           "hooked": olmo_mlp.MoEMLP(**kw),
                           "v2": RoutedExperts(**kw, bias=False, dtype=DType.float32)})
    model["hooked"].forward = lambda x: x
    report = sc.patch(model)
    assert sorted(report.fused) == ["dropless", "plain"], str(report)
    assert report.skipped == {
        "sub": "ScaledExperts subclasses MoEMLP with its own forward, which swiglu_cupy does not reproduce",
        "other": sc_patching.KNOWN_UNFUSED[("olmo_core.nn.moe.mlp", "MoEMLPBase")],
        "v2": sc_patching.KNOWN_UNFUSED[("olmo_core.nn.moe.v2.routed_experts", "RoutedExperts")],
        "hooked": "its forward is replaced on the instance, which would bypass the fusion"}, str(report)
    assert type(model["sub"]) is ScaledExperts and type(model["other"]) is OtherExperts
    copied = copy.deepcopy(model)
    assert type(copied["plain"]) is type(model["plain"]) and type(copied["plain"]).__name__ == "SwiGLUCupyMoEMLP"
    again = sc.patch(model)
    assert sorted(again.fused) == ["dropless", "plain"] == sorted(again.already) and all(
        v.endswith("(already fused)") for v in again.fused.values()), str(again)


def test_stand_ins_leave_nothing_behind(torchtune, olmo_core):
    """After the imports, the stand-ins cannot be found or imported by
    anything else in the session (peft checks for torchao, transformers for
    datasets): only the libraries' modules keep the names they took."""
    assert str(STAND_INS) not in sys.path
    for name in (*TORCHTUNE_STAND_INS, "cached_path"):
        module = sys.modules.get(name)
        assert module is None or STAND_INS not in Path(module.__file__).parents, name
        spec = importlib.util.find_spec(name)
        assert spec is None or STAND_INS not in Path(spec.origin).parents, name
