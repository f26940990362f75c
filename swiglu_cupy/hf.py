"""The public path of :mod:`swiglu_cupy.integrations.hf` (this name is that very module)."""
import sys

from .integrations import hf as _module

sys.modules[__name__] = _module
