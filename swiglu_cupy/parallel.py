"""The public path of :mod:`swiglu_cupy.integrations.parallel` (this name is that very module)."""
import sys

from .integrations import parallel as _module

sys.modules[__name__] = _module
