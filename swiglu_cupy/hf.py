"""The public path of the Hugging Face integration: the public names
(``__all__``) of :mod:`swiglu_cupy.integrations.hf`, re-exported."""
from .integrations.hf import *  # noqa: F401,F403  (exactly its __all__)
from .integrations.hf import __all__  # noqa: F401
