"""torchvision.transforms stand-in (see the package): no transform runs in these tests."""
from . import v2  # noqa: F401


class _NoTransforms:
    def __getitem__(self, name):
        raise RuntimeError("torchvision stand-in (tests/stand_ins): no image transform runs in these tests")


InterpolationMode = _NoTransforms()
