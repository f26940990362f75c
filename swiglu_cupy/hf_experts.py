"""The public path of :mod:`swiglu_cupy.integrations.hf_experts` (this name is that very module)."""
import sys

from .integrations import hf_experts as _module

sys.modules[__name__] = _module
