"""The fake-quantization switches ``torchtune.training`` imports at import
time (called only on a model a QAT quantizer prepared: none here)."""


def _stand_in(module):
    raise RuntimeError("torchao stand-in (tests/stand_ins): no fake-quantized module in these tests")


disable_4w_fake_quant = disable_8da4w_fake_quant = enable_4w_fake_quant = enable_8da4w_fake_quant = _stand_in
