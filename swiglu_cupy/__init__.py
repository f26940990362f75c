"""swiglu-cupy: a fused SwiGLU (GLU-family) feed-forward op for PyTorch, with
CUDA kernels JIT-compiled by CuPy.

Layers, each importing only those before it: the leaves (``activations``,
``reference``, argument checks, torch internals), ``kernels`` (CUDA sources,
loader, launch shapes, compile and host-execution checks), ``primitives``
(the elementwise forward/backward contract: CUDA and torch implementations,
registered ops), ``dense`` and ``moe`` (GEMMs + primitives, apply-only
Functions, API), ``integrations`` (``patch``, Hugging Face, xformers, tensor
parallel) and ``tools`` (bench, selftest, info). This module is the face.
"""
from ._version import __version__
from .activations import GLUActivation, GPT_OSS, deepseek_v4
from .dense.api import glu_mul, silu_mul, swiglu, swiglu_unpacked
from .dense.functions import SiluMulFunction, SwiGLUFunction, SwiGLUOptions
from .dense.module import SwiGLU
from .integrations.patching import PatchReport, patch
from .kernels.launch import cuda_kernels_available
from .primitives.first_use_check import warmup
from .tools.info import info
from .reference import glu_ffn_reference, glu_reference, silu_mul_reference, swiglu_reference

__all__ = ["__version__", "SwiGLU", "SwiGLUFunction", "SwiGLUOptions", "SiluMulFunction", "swiglu", "swiglu_unpacked",
           "swiglu_reference", "silu_mul", "silu_mul_reference", "glu_mul", "glu_reference",
           "glu_ffn_reference", "GLUActivation", "GPT_OSS", "deepseek_v4", "warmup", "info", "patch", "PatchReport",
           "cuda_kernels_available"]
