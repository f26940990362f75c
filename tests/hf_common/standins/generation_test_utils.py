"""OUR stand-in for transformers' `tests/generation/test_utils.py` (not in the PyPI sdist).

test_modeling_common imports `GenerationTesterMixin` from it (and only checks `issubclass` against it). This one
adds NO tests: generate() is not what swiglu_cupy changes, and the real mixin is not shipped.
"""


class GenerationTesterMixin:
    """Stand-in: no generation tests."""
