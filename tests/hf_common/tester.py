"""OUR generic model tester for transformers' common mixins, parameterised by family (see families.py).

`make_test_case(family)` returns a `unittest.TestCase` subclass combining the sdist's `ModelTesterMixin` (plus
`TrainingTesterMixin`, `FSDPTesterMixin`, `TensorParallelTesterMixin`, `ExpertParallelTesterMixin` where the
installed version ships them) with `FamilyModelTester`, which supplies what those mixins read: the tiny config, the
model classes (from transformers' own auto mappings for the family's model_type), and random inputs.
"""
import importlib
import unittest

from .families import FAMILIES, config_kwargs, tiny_config

# (module of hf_sdist_tests, class): the mixins a decoder-only LM's test class combines; absent ones are left out
MIXINS = (
    ("test_modeling_common", "ModelTesterMixin"),
    ("test_training_mixin", "TrainingTesterMixin"),
    ("test_fsdp_mixin", "FSDPTesterMixin"),
    ("test_tensor_parallel_mixin", "TensorParallelTesterMixin"),
    ("test_expert_parallel_mixin", "ExpertParallelTesterMixin"),
)

# model-class role -> transformers auto mapping that names it
_ROLES = {
    "base_model_class": "MODEL_MAPPING_NAMES",
    "causal_lm_class": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "sequence_classification_class": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "token_classification_class": "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
    "question_answering_class": "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES",
}


def model_classes(family):
    """role -> class (None where transformers maps no class of that role to this model_type)."""
    import transformers
    from transformers.models.auto import modeling_auto

    out = {}
    for role, mapping in _ROLES.items():
        name = getattr(modeling_auto, mapping).get(family)
        out[role] = getattr(transformers, name) if name else None
    return out


def available_mixins():
    found = []
    for module, name in MIXINS:
        try:
            found.append(getattr(importlib.import_module(f"hf_sdist_tests.{module}"), name))
        except (ImportError, AttributeError):
            if module == "test_modeling_common":
                raise
    return found


class FamilyModelTester:
    """What the mixins read of `self.model_tester`: sizes, `get_config()`, inputs, model classes."""

    def __init__(self, parent, family, batch_size=13, seq_length=7, is_training=True):
        self.parent, self.family = parent, family
        self.batch_size, self.seq_length, self.is_training = batch_size, seq_length, is_training
        config = self.get_config()
        for attr in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
            setattr(self, attr, getattr(config, attr, None))
        for role, cls in model_classes(family).items():
            setattr(self, role, cls)

    def get_config(self):
        return tiny_config(self.family)

    def prepare_config_and_inputs(self):
        from hf_sdist_tests.test_modeling_common import ids_tensor, random_attention_mask

        # ids from 2 up: 0 is pad and 1 bos/eos in the tiny configs
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size - 2) + 2
        attention_mask = random_attention_mask([self.batch_size, self.seq_length])
        return self.get_config(), input_ids, attention_mask

    def prepare_config_and_inputs_for_common(self):
        config, input_ids, attention_mask = self.prepare_config_and_inputs()
        return config, {"input_ids": input_ids, "attention_mask": attention_mask}


def make_test_case(family):
    from hf_sdist_tests.test_configuration_common import ConfigTester

    classes = model_classes(family)
    all_model_classes = tuple(c for c in classes.values() if c is not None)
    config = tiny_config(family)
    config_class = type(config)
    # ConfigTester finds every kwarg again in the config's JSON: only the keys this config class serialises under
    # that name (qwen3_moe's `num_experts` is an alias of num_local_experts; deepseek_v4 stores no intermediate_size)
    stored = config.to_dict()
    config_tester_kwargs = {k: v for k, v in config_kwargs(family).items() if k in stored}

    def setUp(self):
        self.model_tester = FamilyModelTester(self, family)
        self.config_tester = ConfigTester(self, config_class=config_class, **config_tester_kwargs)

    def test_config(self):
        self.config_tester.run_common_tests()

    name = "".join(part.capitalize() for part in family.split("_")) + "CommonTest"
    body = {"all_model_classes": all_model_classes, "setUp": setUp, "test_config": test_config,
            "__module__": __name__, "__qualname__": name,
            # an MoE family: the mixins check "all params have gradients" per step, which routing can break
            "test_all_params_have_gradient": FAMILIES[family][0] != "moe"}
    from hf_sdist_tests.generation.test_utils import GenerationTesterMixin  # OUR stand-in: adds no tests

    # GenerationTesterMixin because these models can generate (test_generation_tester_mixin_inheritance checks it)
    return type(name, (*available_mixins(), GenerationTesterMixin, unittest.TestCase), body)
