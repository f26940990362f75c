"""See the package docstring. ``TensorCoreTiledLayout``: a name that
``torchtune.training.quantization`` imports (its int4 quantizer's layout)."""


class TensorCoreTiledLayout:
    """No weight here is laid out for torchao's int4 kernels."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError("torchao stand-in (tests/stand_ins): no int4 layout in these tests")
