"""swiglu-cupy: a fused SwiGLU feed-forward op for PyTorch with CuPy kernels.

Layers: ``primitives`` (elementwise forward/backward, CUDA kernels + torch),
``SwiGLUFunction`` (GEMMs + primitives, apply-only), and the API
(``swiglu``, ``SwiGLU``).
"""
from ._launch import warmup
from ._version import __version__
from .activations import GLUActivation, GPT_OSS, deepseek_v4
from .api import glu_mul, silu_mul, swiglu, swiglu_unpacked
from .functions import SiluMulFunction, SwiGLUFunction
from .reference import glu_ffn_reference, glu_reference, silu_mul_reference, swiglu_reference
from .module import SwiGLU
from .patching import PatchReport, patch

__all__ = ["__version__", "SwiGLU", "SwiGLUFunction", "SiluMulFunction", "swiglu", "swiglu_unpacked",
           "swiglu_reference", "silu_mul", "silu_mul_reference", "glu_mul", "glu_reference",
           "glu_ffn_reference", "GLUActivation", "GPT_OSS", "deepseek_v4", "warmup", "patch", "PatchReport"]
