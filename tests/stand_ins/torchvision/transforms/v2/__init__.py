"""torchvision.transforms.v2 stand-in (see the package)."""
from . import functional  # noqa: F401
