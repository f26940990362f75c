"""The public path of the xformers integration: the public names
(``__all__``) of :mod:`swiglu_cupy.integrations.xformers`, re-exported."""
from .integrations.xformers import *  # noqa: F401,F403  (exactly its __all__)
from .integrations.xformers import __all__  # noqa: F401
