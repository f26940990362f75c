"""Reach (issue 39): every gated-unit class a supported library ships is
fused or named by ``patch()``, none passes unreported.

For each library, tests/reach_scan.py reads its source and lists the
classes that compute a gated unit (an activation's output times another
tensor, in any method) and their subclasses (LoRA and adapter variants).
Each class is built (tiny, or on the meta device: what the walk decides
there is its pending switch) and patched, alone or inside a stock model of
its library, and every instance must come out fused (whole, activation-only
or pending), skipped with a reason, or switched as Hugging Face experts.
The exceptions are said, per instance, and are not GLU feed-forwards: a
module without weights (an activation such as ``QuickGELU``), one whose
forward takes several tensors and holds no matrices of its own (attention,
gated norms, losses), and one whose gated product reads a child it does not
have (torchtune's ``FeedForward`` without ``w3``). A class that cannot be
built here is held to its source: Hugging Face experts (always reported by
``patch()``), or a forward the walk's safety net reads (named whenever it
holds weights). The rest are listed in ``LISTED`` with the reason: classes
whose gated unit is not a feed-forward's and sits in a method the safety
net does not read (attention maps, positional embeddings), or that cannot
be built here.
"""
from __future__ import annotations

import collections
import importlib
import importlib.util
import inspect
import logging

import pytest
import torch
from torch import nn

import swiglu_cupy as sc
from reach_scan import gated_classes, module_classes
from swiglu_cupy.integrations.glu_source import (feed_forward_shaped, forward_computes_glu, forward_gated_products,
                                                 live_gated_products)
from swiglu_cupy.integrations.recognition import takes_one_input

pytestmark = pytest.mark.filterwarnings("ignore")

#: Classes the scan finds whose gated unit is not a GLU feed-forward's, in a method the walk's safety net does
#: not read, or that cannot be built here; and why. Built, an instance is exempt with this reason.
LISTED: dict[str, str] = {
    "transformers.models.deformable_detr.modeling_deformable_detr.DeformableDetrModel":
        "a whole detection model; its gated product is a positional embedding's, in a helper method (it builds "
        "only where timm is installed)",
    "transformers.models.esm.modeling_esmfold.EsmFoldAttention":
        "attention (its output gated by a sigmoid of a projection) built with four sizes; takes several tensors",
    "transformers.models.granite4_vision.modeling_granite4_vision.Granite4VisionModel":
        "a whole vision-language model whose default config does not build; its product is not a feed-forward",
    "peft.tuners.shadow.layers.ShadowLayer":
        "PEFT's Shadow tuner layer: wraps a whole decoder block (a sigmoid-gated update of its hidden state, not "
        "a feed-forward), built only by its ShadowModel",
    "olmo_core.nn.moe.v2.hf.modeling_olmo3moe.Olmo3MoeExperts":
        "the Hugging Face export port's ModuleList of Olmo3MoeExpert (each a GLU MLP, held to its source), "
        "its grouped path in a helper; built only with that port's config",
    "olmo_core.nn.moe.v2.nemotron.NemotronMoE":
        "Nemotron-H's MoE mixer: squared-ReLU experts, ungated (the product is the routing weight's); built only "
        "by its v2 config",
    "megatron.core.transformer.experimental_attention_variant.dsa.DSAIndexer":
        "sparse attention's indexer (a sigmoid-weighted score), not a feed-forward",
    "megatron.core.transformer.moe.router.TopKRouter":
        "the MoE router (scores times a scaling), not a feed-forward",
    "megatron.core.transformer.moe.experts.GroupedMLP":
        "grouped-GEMM experts, built only with the grouped_gemm CUDA package; patch() names it "
        "(tests/test_megatron.py)",
    "timm.models.convit.GPSA":
        "gated positional self-attention: a sigmoid gate mixes two attention maps (in get_attention)",
    "timm.models.mobilevit.LinearSelfAttention":
        "MobileViT-v2's separable self-attention (its context scores), not a feed-forward",
}


def outcome(report, path: str) -> str | None:
    """Where ``report`` puts the module at ``path``, or None (unreported)."""
    for name in ("fused", "partial", "pending", "skipped"):
        if path in getattr(report, name):
            return name
    return None


def exempt(module: nn.Module) -> str | None:
    """Why an unreported ``module`` is not a GLU feed-forward; else None."""
    if not any(p.dim() >= 2 for p in module.parameters()):
        return "no weights (an activation or a function)"
    if not feed_forward_shaped(module, takes_one_input):
        return "not shaped like a feed-forward (several input tensors, no matrices of its own)"
    if forward_gated_products(type(module)) and not live_gated_products(module):
        return "its gated product reads a child it does not have"
    return None


Result = collections.namedtuple("Result", "built reported exempted")


def check(library: str, classes: dict[str, type], models: list[nn.Module]) -> Result:
    """Patch each of ``models``; every instance of ``classes`` in them must be
    reported or exempt; classes without an instance are held to their source."""
    built, reported, exempted, unreported = set(), {}, {}, []
    for model in models:
        names = {path: f"{type(m).__module__}.{type(m).__qualname__}" for path, m in model.named_modules()}
        report = sc.patch(model)  # switches fused modules to their fused class: named by their class before
        for path, module in model.named_modules():
            name = names[path]
            if name not in classes:
                continue
            built.add(name)
            where = outcome(report, path) or ("experts" if _hf_experts_class(type(module)) and report.experts
                                              else None)
            if where is not None:
                reported.setdefault(name, where)
                continue
            inner = [p for p in _reported_paths(report) if p.startswith(path + ".") or (path == "" and p)]
            why = ("holds modules patch() fused or named (a decoder layer's or MoE block's own gate is not a "
                   "feed-forward)" if inner else LISTED.get(name) or exempt(module))
            if why is None:
                unreported.append(f"{name} at {path or '<model>'}")
            else:
                exempted.setdefault(name, why)
    assert not unreported, f"{library}: gated-unit modules patch() neither fused nor named: {unreported}"
    unheld = [name for name, cls in classes.items() if name not in built and name not in LISTED
              and not _hf_experts_class(cls) and not forward_computes_glu(cls)]
    assert not unheld, (f"{library}: classes not built here whose gated unit the walk cannot read from their "
                        f"forward (build them in tests/test_reach.py or list them in LISTED): {unheld}")
    return Result(built, reported, exempted)


def _reported_paths(report) -> set[str]:
    return {*report.fused, *report.partial, *report.pending, *report.skipped}


def _hf_experts_class(cls: type) -> bool:
    """A ``@use_experts_implementation`` class (False without transformers)."""
    try:
        from swiglu_cupy.integrations.hf_experts import _wrapper_code

        return getattr(getattr(cls, "forward", None), "__code__", None) is _wrapper_code()
    except ImportError:
        return False


def scanned(package: str, file_pattern: str | None = None) -> dict[str, type]:
    classes, dropped = module_classes(gated_classes(package, file_pattern))
    assert classes, f"the scan found no gated-unit class in {package}: the scan is broken"
    return classes


def _say(library: str, classes: dict, result: Result) -> None:
    print(f"\n{library}: {len(classes)} gated-unit classes, {len(result.built)} built, "
          f"{len(result.reported)} reported {dict(collections.Counter(result.reported.values()))}, "
          f"{len(result.exempted)} exempt")
    for name, why in sorted(result.exempted.items()):
        print(f"  exempt {name}: {why}")


# ---- Hugging Face transformers ----------------------------------------------------------------

_LAYER_COUNTS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers", "decoder_layers",
                 "num_decoder_layers", "num_encoder_layers", "depth")


def _hf_configs(model_type: str, layers: int | None = None):
    """The default config of ``model_type`` and its sub-configs; with
    ``layers``, their layer counts cut to that (a whole model builds faster)."""
    from transformers import CONFIG_MAPPING, PretrainedConfig

    try:
        config = CONFIG_MAPPING[model_type]()
    except Exception:
        return []
    configs = [config] + [v for v in vars(config).values() if isinstance(v, PretrainedConfig)]
    for c in configs if layers else ():
        for name in _LAYER_COUNTS:
            if isinstance(getattr(c, name, None), int) and getattr(c, name) > layers:
                setattr(c, name, layers)
    return configs


def _hf_models(classes: dict[str, type]) -> list[nn.Module]:
    """Each class alone on the meta device from its model type's default
    config (or a sub-config); the rest inside that type's models."""
    from transformers import PreTrainedModel

    models, unbuilt = [], collections.defaultdict(list)
    for name, cls in classes.items():
        model_type = name.split(".")[2]
        for config in _hf_configs(model_type):
            try:
                with torch.device("meta"):
                    models.append(nn.ModuleDict({"m": cls(config)}))
                break
            except Exception:
                continue
        else:
            unbuilt[cls.__module__].append(name)
    for module_name, names in unbuilt.items():
        module = importlib.import_module(module_name)
        owners = [c for n, c in vars(module).items() if inspect.isclass(c) and issubclass(c, PreTrainedModel)
                  and c.__module__ == module_name and not n.endswith("PreTrainedModel")]
        for config in _hf_configs(names[0].split(".")[2], layers=2):
            for owner in owners:
                if not isinstance(config, owner.config_class):
                    continue
                try:
                    with torch.device("meta"):
                        model = owner._from_config(config)
                except Exception:
                    continue
                if any(f"{type(m).__module__}.{type(m).__qualname__}" in names for m in model.modules()):
                    models.append(model)
    return models


@pytest.fixture(scope="module")
def quiet_transformers():
    pytest.importorskip("transformers")
    logging.disable(logging.WARNING)  # default configs of 300 model types say a lot
    yield
    logging.disable(logging.NOTSET)


def test_transformers_gated_units_are_fused_or_named(quiet_transformers):
    classes = scanned("transformers", "modeling_")
    result = check("transformers", classes, _hf_models(classes))
    _say("transformers", classes, result)
    assert len(result.built) >= 0.9 * len(classes), "the builder lost most classes"


# ---- PEFT: LoRA and DoRA around Hugging Face's MLPs -------------------------------------------

def test_peft_gated_units_and_its_adapters_on_llama_mlps_are_fused_or_named(quiet_transformers):
    """PEFT's own gated classes, and its adapters (LoRA, DoRA) wrapped
    around a tiny Llama's MLP projections: the wrapped MLPs are named (fused
    activation-only, the adapters running as themselves)."""
    peft = pytest.importorskip("peft")
    from transformers import LlamaConfig, LlamaForCausalLM

    classes = scanned("peft")
    mlp = "transformers.models.llama.modeling_llama.LlamaMLP"
    classes[mlp] = importlib.import_module("transformers.models.llama.modeling_llama").LlamaMLP
    models = []
    for use_dora in (False, True):
        torch.manual_seed(0)
        base = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                            num_attention_heads=4, num_key_value_heads=2, vocab_size=64))
        config = peft.LoraConfig(r=4, target_modules=["gate_proj", "up_proj", "down_proj"], use_dora=use_dora)
        models.append(peft.get_peft_model(base, config))
    result = check("peft", classes, models)
    _say("peft", classes, result)
    assert result.reported[mlp] == "partial"


# ---- litgpt: the plain, LoRA and adapter-v2 MLPs -----------------------------------------------

def test_litgpt_gated_units_and_their_adapter_variants_are_fused_or_named():
    pytest.importorskip("litgpt")
    tiny = dict(n_layer=1, n_embd=32, n_head=4, n_query_groups=2, head_size=8, intermediate_size=64,
                padded_vocab_size=64, vocab_size=64, block_size=16)
    classes = scanned("litgpt")
    models = []
    for flavour, extra in (("model", {}), ("lora", dict(lora_r=4, lora_alpha=8, lora_mlp=True)),
                           ("adapter_v2", {}), ("adapter", {})):
        module = importlib.import_module(f"litgpt.{flavour}")
        for name in ("Llama-3.2-1B", "gemma-2b"):
            torch.manual_seed(0)
            models.append(module.GPT(module.Config.from_name(name, **tiny, **extra)))
    result = check("litgpt", classes, models)
    _say("litgpt", classes, result)
    assert {result.reported[f"litgpt.{f}.{c}"] for f in ("lora", "adapter_v2") for c in ("LLaMAMLP", "GemmaMLP")} \
        == {"partial"}, result.reported


# ---- torchtune: the feed-forward, plain and LoRA ------------------------------------------------

def test_torchtune_gated_units_are_fused_or_named():
    if importlib.util.find_spec("torchtune") is None:  # importing it needs the stand-ins
        pytest.skip("torchtune is not installed")
    from test_training_libraries import TORCHTUNE_STAND_INS, import_torchtune, stand_ins_for_import

    tune = import_torchtune()
    with stand_ins_for_import(TORCHTUNE_STAND_INS):
        classes = scanned("torchtune")
        from torchtune.models.clip._text_encoder import QuickGELU
        from torchtune.rlhf.loss.dpo import DPOLoss

    sizes = dict(vocab_size=64, num_layers=1, num_heads=4, num_kv_heads=2, embed_dim=32, intermediate_dim=64,
                 max_seq_len=16)
    torch.manual_seed(0)
    models = [tune.models.llama3.llama3(**sizes),
              tune.models.llama3.lora_llama3(lora_attn_modules=["q_proj"], apply_lora_to_mlp=True, lora_rank=4,
                                             lora_alpha=8, **sizes),
              nn.ModuleDict({"quick_gelu": QuickGELU(), "dpo": DPOLoss()})]
    result = check("torchtune", classes, models)
    _say("torchtune", classes, result)
    assert result.reported["torchtune.modules.feed_forward.FeedForward"] in ("fused", "partial")


# ---- OLMo-core: dense, nGPT and MoE builders ----------------------------------------------------

def test_olmo_core_gated_units_are_fused_or_named():
    pytest.importorskip("olmo_core")
    from test_training_libraries import olmo_model, stand_ins_for_import

    with stand_ins_for_import(("cached_path",)):
        transformer = importlib.import_module("olmo_core.nn.transformer")
        classes = scanned("olmo_core")
        models = [olmo_model(transformer, "llama_like"), olmo_model(transformer, "ngpt_like"),
                  olmo_model(transformer, "llama_like_moe", num_experts=4, top_k=2, expert_hidden_size=48)]
    result = check("olmo_core", classes, models)
    _say("olmo_core", classes, result)


# ---- megatron-core: the MLP and experts on one gloo rank ----------------------------------------

@pytest.fixture
def megatron_rank(tmp_path):
    pytest.importorskip("megatron.core")
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    yield
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def test_megatron_gated_units_are_fused_or_named(megatron_rank):
    from test_megatron import F_HIDDEN, _config, _dense, _experts

    classes = scanned("megatron")
    torch.manual_seed(0)
    experts = _experts(_config(1, num_moe_experts=2, moe_ffn_hidden_size=F_HIDDEN, moe_router_topk=2,
                               moe_token_dispatcher_type="allgather"))
    models = [_dense(_config(1)), nn.ModuleDict({"experts": experts})]
    result = check("megatron", classes, models)
    _say("megatron", classes, result)
    assert result.reported["megatron.core.transformer.mlp.MLP"] == "fused"


# ---- xformers and torchtitan --------------------------------------------------------------------

def test_xformers_gated_units_are_fused_or_named():
    xops = pytest.importorskip("xformers.ops")
    classes = scanned("xformers")
    result = check("xformers", classes, [nn.Sequential(xops.SwiGLU(16, 32, 16))])
    _say("xformers", classes, result)
    assert result.reported["xformers.ops.swiglu_op.SwiGLU"] == "fused"


def test_torchtitan_gated_units_are_fused_or_named():
    pytest.importorskip("torchtitan")
    from test_torchtitan import FUSED_OVERRIDES, build, model_config
    from torchtitan.config.override import OverrideConfig, apply_overrides
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.gpt_oss import model_registry as gpt_oss_registry

    classes = scanned("torchtitan")
    models = [build("deepseek_v3")]
    for name in ("llama3", "qwen3_moe"):  # torchtitan's fused_swiglu overrides, dense and experts
        overridden = model_config(name)
        assert apply_overrides(OverrideConfig(imports=FUSED_OVERRIDES), overridden)
        with torch.device("meta"):
            models.append(overridden.build())
    gpt_oss = gpt_oss_registry("debugmodel").model
    gpt_oss.layers = gpt_oss.layers[:1]
    for layer in gpt_oss.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    with torch.device("meta"):
        models.append(gpt_oss.build())
    result = check("torchtitan", classes, models)
    _say("torchtitan", classes, result)
    assert result.reported["torchtitan.models.common.moe.GroupedExperts"] == "fused"


# ---- timm: its layers, built from their first arguments ------------------------------------------

def _built_from_sizes(cls: type) -> nn.Module | None:
    """``cls`` built on the meta device from the first sizes it accepts
    (timm's layers take ``in_features``/``dim`` first), or None."""
    for args in ((16, 32), (16,), (32, 16), ()):
        try:
            with torch.device("meta"):
                return cls(*args)
        except Exception:
            continue
    return None


def test_timm_gated_units_are_fused_or_named():
    pytest.importorskip("timm")
    classes = scanned("timm")
    built = {name: _built_from_sizes(cls) for name, cls in classes.items()}
    models = [nn.ModuleDict({str(i): m}) for i, m in enumerate(m for m in built.values() if m is not None)]
    result = check("timm", classes, models)
    _say("timm", classes, result)
    assert result.reported["timm.layers.mlp.GluMlp"] in ("pending", "fused")
