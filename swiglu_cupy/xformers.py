"""The public path of :mod:`swiglu_cupy.integrations.xformers` (this name is that very module)."""
import sys

from .integrations import xformers as _module

sys.modules[__name__] = _module
