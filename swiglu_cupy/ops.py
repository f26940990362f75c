"""The public path of the registered ``torch.ops.swiglu_cupy.*`` ops and
``aten_decompositions()``: the public names (``__all__``) of
:mod:`swiglu_cupy.primitives.ops`, re-exported."""
from .primitives.ops import *  # noqa: F401,F403  (exactly its __all__)
from .primitives.ops import __all__  # noqa: F401
