"""The public path of :mod:`swiglu_cupy.primitives.ops` (this name is that very module):
the registered ``torch.ops.swiglu_cupy.*`` ops and ``aten_decompositions()``."""
import sys

from .primitives import ops as _module

sys.modules[__name__] = _module
