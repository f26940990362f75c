"""OUR stand-in for transformers' `tests/exporters/test_export.py` (not in the PyPI sdist).

`ModelTesterMixin` subclasses `ExportTesterMixin`; the real one holds the @slow torch.export / ONNX export tests,
which never run by default. This one adds NO tests.
"""


class ExportTesterMixin:
    """Stand-in: no export tests."""
