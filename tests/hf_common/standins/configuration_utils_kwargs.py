"""OUR stand-in for transformers' `tests/utils/test_configuration_utils.py` (not in the PyPI sdist).

test_configuration_common imports `config_common_kwargs` from it: PretrainedConfig kwargs with non-default values
that every config class must store as given (ConfigTester.check_config_arguments_init). A smaller set of our own:
`dtype` must be float16 (the mixin checks that key by itself).
"""

config_common_kwargs = {
    "return_dict": False,
    "output_hidden_states": True,
    "output_attentions": True,
    "dtype": "float16",
    "chunk_size_feed_forward": 5,
    "architectures": ["SwigluCupyTestModel"],
    "problem_type": "regression",
    "tie_word_embeddings": False,
}
