"""Tools for testing without a GPU: NVRTC compile checks and host execution
of the CUDA kernel sources."""
