"""The QAT quantizer classes ``torchtune.training`` imports at import time
(its recipes' ``quantizer`` option builds them; no test here does)."""


class _QATQuantizer:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("torchao stand-in (tests/stand_ins): no quantization-aware training in these tests")


class Int4WeightOnlyQATQuantizer(_QATQuantizer):
    pass


class Int8DynActInt4WeightQATQuantizer(_QATQuantizer):
    pass
