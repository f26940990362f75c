"""The public path of the Hugging Face MoE experts implementation: the public
names (``__all__``) of :mod:`swiglu_cupy.integrations.hf_experts`, re-exported.
Importing it registers ``"swiglu_cupy"`` with transformers (that module does)."""
from .integrations.hf_experts import *  # noqa: F401,F403  (exactly its __all__)
from .integrations.hf_experts import __all__  # noqa: F401
