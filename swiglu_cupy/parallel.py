"""The public path of tensor parallelism: the public names (``__all__``) of
:mod:`swiglu_cupy.integrations.parallel`, re-exported."""
from .integrations.parallel import *  # noqa: F401,F403  (exactly its __all__)
from .integrations.parallel import __all__  # noqa: F401
