"""swiglu-cupy: a fused SwiGLU feed-forward op for PyTorch with CuPy kernels.

Layers: ``primitives`` (elementwise forward/backward, CUDA kernels + torch),
``SwiGLUFunction`` (GEMMs + primitives, apply-only), and the API
(``swiglu``, ``SwiGLU``).
"""
from ._launch import warmup
from ._version import __version__
from .interface import (SiluMulFunction, SwiGLUFunction, silu_mul, silu_mul_reference, swiglu,
                        swiglu_reference, swiglu_unpacked)
from .module import SwiGLU

__all__ = ["__version__", "SwiGLU", "SwiGLUFunction", "SiluMulFunction", "swiglu", "swiglu_unpacked",
           "swiglu_reference", "silu_mul", "silu_mul_reference", "warmup"]
