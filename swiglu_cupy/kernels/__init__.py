"""The CUDA kernels' Python side: the ``kernels_cu/`` sources and their
variants (``sources``), the CuPy loader and launcher (``launch``), launch
shapes (``launch_config``), and the two ways they are checked without a GPU:
NVRTC compilation (``compile_check``) and host execution as C++
(``host_exec``). Imports only the leaves."""
