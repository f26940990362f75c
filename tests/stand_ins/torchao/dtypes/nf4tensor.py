"""The names torchtune imports at import time: a class that no weight here
is an instance of, an op registry decorator that registers nothing, and
conversions that say they are a stand-in."""


class NF4Tensor:
    """No tensor in these tests is NF4 (``isinstance`` checks are False)."""


def implements(ops):
    def register(function):
        return function
    return register


def to_nf4(*args, **kwargs):
    raise RuntimeError("torchao stand-in (tests/stand_ins): no weight can be quantized to NF4 in these tests")


def linear_nf4(*args, **kwargs):
    raise RuntimeError("torchao stand-in (tests/stand_ins): no NF4 linear runs in these tests")
