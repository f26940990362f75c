"""The dense GLU feed-forward: its GEMMs (``gemm``), the apply-only autograd
Functions (``functions``), the functional API (``api``: ``swiglu``,
``swiglu_unpacked``, ``silu_mul``, ``glu_mul``) and the ``SwiGLU`` module
(``module``). Built on ``primitives``."""
