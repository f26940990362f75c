"""What ``torchtune.training`` imports of ``torchao.quantization`` at import
time (its post-training quantizers call them; no test here does)."""


def _stand_in(*args, **kwargs):
    raise RuntimeError("torchao stand-in (tests/stand_ins): nothing is quantized in these tests")


int4_weight_only = int8_dynamic_activation_int4_weight = quantize_ = _stand_in
