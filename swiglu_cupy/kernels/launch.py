"""The one place where kernels are launched.

Kernel code is reached through a *launcher*: ``launch(name, dtype, device,
grid, block, args)``. The CuPy launcher runs on a GPU; the host launcher in
``swiglu_cupy.kernels.host_exec`` runs the same kernel source compiled by g++,
so everything above this call (vector-width choice, grid, arguments) is the
code the GPU runs, exercised in CI without a GPU.
"""
from __future__ import annotations

import functools
import os
import threading
import warnings
from typing import Protocol, Sequence

import numpy as np
import torch

from .._torch_compat import current_raw_stream
from .sources import compile_options, kernel_names, kernel_variant, module_source, variant_of_kernel
from ..activations import resolve_activation

INSTALL_HINT = "pip install 'swiglu-cupy[cuda12]' or 'swiglu-cupy[cuda13]'"


class Launcher(Protocol):
    """Launches a kernel by name. ``args``: data pointers as ints
    (:func:`pointer`), every other argument numpy-typed (its exact width)."""

    def launch(self, name: str, dtype: torch.dtype, device: torch.device,
               grid: tuple[int, int, int], block: tuple[int, int, int],
               args: Sequence[object]) -> None: ...


def pointer(t: torch.Tensor) -> int:
    """A tensor's data pointer as a kernel argument (no copy, no DLPack): a
    Python int, which CuPy passes as 8 bytes, the pointer's own bits (int64,
    or uint64 from 2**63; ``kernel_argument_bytes``). Not a numpy scalar:
    making one per pointer was ~5 us of a decode-sized call (measured on
    the CPU-run CUDA route), where nothing else touches numpy."""
    return t.data_ptr()


def kernel_argument_bytes(value: int) -> bytes:
    """The 8 bytes CuPy passes for a Python int kernel argument (int64 below
    2**63, uint64 from there), little-endian; the host launcher and the
    machine-code model pass the same. Outside [-2**63, 2**64) raises, as
    CuPy does."""
    if value.__class__ is not int:
        raise TypeError(f"a kernel's integer argument must be an int, got {type(value).__name__}")
    if not -(1 << 63) <= value < (1 << 64):
        raise OverflowError(f"kernel argument {value} does not fit in 8 bytes")
    return (value & ((1 << 64) - 1)).to_bytes(8, "little")


def i64(value: int) -> np.int64:
    """An integer kernel argument; numpy-typed so CuPy passes exactly 8 bytes."""
    return np.int64(value)


class CudaUnavailableError(RuntimeError):
    """CuPy or NVRTC cannot be loaded, so CUDA kernels cannot run."""


@functools.lru_cache(maxsize=1)  # successes only: a failure raises again next time
def import_cupy():
    """CuPy, once it and its NVRTC library are known to load."""
    try:
        import cupy
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()  # loads libnvrtc: a missing library fails here, not at first compile
    except Exception as exc:  # ImportError, or a CUDA library failing to load
        raise CudaUnavailableError(
            f"swiglu-cupy needs CuPy (>= 14.2) and NVRTC for CUDA tensors: {exc}. Fix: {INSTALL_HINT}"
        ) from exc
    return cupy


def device_index(device: torch.device) -> int:
    """The CUDA ordinal of ``device`` ("cuda" alone means the current device)."""
    return device.index if device.index is not None else torch.cuda.current_device()


class _StreamHandle:
    """A raw cudaStream_t exposed through the CUDA stream protocol."""

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


class CupyLauncher:
    """Compiles kernels with CuPy's RawModule (NVRTC) and launches them on
    torch's current stream.

    Functions are cached per (device, dtype, kernel); one RawModule is built per
    (device, dtype, GLU variant), on the first launch of one of its kernels.
    A lock makes concurrent first calls compile once.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._modules: dict[tuple, object] = {}
        self._functions: dict[tuple[int, torch.dtype, str], object] = {}
        self._streams: dict[tuple[int, int], object] = {}
        self.compile_count = 0  # modules built; observable by tests and `info`

    def function(self, name: str, dtype: torch.dtype, device_index: int):
        key = (device_index, dtype, name)
        fn = self._functions.get(key)
        if fn is None:
            with self._lock:
                fn = self._functions.get(key)
                if fn is None:
                    fn = self._load(name, dtype, device_index)
                    self._functions[key] = fn
        return fn

    def _load(self, name: str, dtype: torch.dtype, device_index: int):
        cupy = import_cupy()
        variant = variant_of_kernel(name)  # ValueError for an unknown name
        module_key = (device_index, dtype, variant)
        with cupy.cuda.Device(device_index):
            module = self._modules.get(module_key)
            if module is None:
                module = cupy.RawModule(code=module_source(variant), options=compile_options(dtype))
                self.compile_count += 1
            try:
                # .kernel compiles (or reads CuPy's disk cache, which checks a
                # hash and recompiles a corrupt entry) and loads the binary
                # into this device's context.
                kernel = module.get_function(name).kernel
            except OSError as exc:  # the cache directory is unwritable or broken
                module, kernel = self._load_without_disk_cache(cupy, name, dtype, variant, exc)
            self._modules[module_key] = module
            return kernel

    def _load_without_disk_cache(self, cupy, name: str, dtype: torch.dtype, variant, error: OSError):
        warnings.warn(
            f"swiglu-cupy: CuPy's kernel cache directory is not usable ({error}); compiling in "
            "memory instead. Set CUPY_CACHE_DIR to a writable directory to keep compiled kernels.",
            RuntimeWarning, stacklevel=4)
        previous = os.environ.get("CUPY_CACHE_IN_MEMORY")
        os.environ["CUPY_CACHE_IN_MEMORY"] = "1"  # read by CuPy at each compile
        try:
            module = cupy.RawModule(code=module_source(variant), options=compile_options(dtype))
            return module, module.get_function(name).kernel
        finally:
            if previous is None:
                del os.environ["CUPY_CACHE_IN_MEMORY"]
            else:
                os.environ["CUPY_CACHE_IN_MEMORY"] = previous

    def _stream(self, device_index: int):
        """CuPy's view of torch's current stream (looked up at every call:
        checkpointing, side streams and graph capture change it)."""
        handle = current_raw_stream(device_index)
        key = (device_index, handle)
        stream = self._streams.get(key)
        if stream is None:
            stream = import_cupy().cuda.Stream.from_external(_StreamHandle(handle))
            self._streams[key] = stream
        return stream

    def launch(self, name, dtype, device, grid, block, args):
        index = device.index if device.index is not None else torch.cuda.current_device()
        fn = self._functions.get((index, dtype, name))
        if fn is None:
            fn = self.function(name, dtype, index)
        stream = self._stream(index)
        args = args if args.__class__ is tuple else tuple(args)
        cuda = import_cupy().cuda
        if cuda.runtime.getDevice() == index:  # the usual case: no device context to enter and leave
            fn(grid, block, args, stream=stream)
        else:
            with cuda.Device(index):
                fn(grid, block, args, stream=stream)


_cupy_launcher: CupyLauncher | None = None
_cupy_launcher_lock = threading.Lock()
_fallback_warned = False


def strict_mode() -> bool:
    return os.environ.get("SWIGLU_CUPY_STRICT", "") not in ("", "0")


def cupy_launcher() -> CupyLauncher:
    global _cupy_launcher
    if _cupy_launcher is None:
        with _cupy_launcher_lock:
            if _cupy_launcher is None:
                _cupy_launcher = CupyLauncher()
    return _cupy_launcher


def cuda_kernels_available() -> bool:
    """True when CuPy imports; with SWIGLU_CUPY_STRICT=1 a missing CuPy raises."""
    global _fallback_warned
    try:
        import_cupy()
        return True
    except CudaUnavailableError as exc:
        if strict_mode():
            raise CudaUnavailableError(
                f"SWIGLU_CUPY_STRICT is set and CUDA kernels are unavailable ({exc}). "
                f"Fix: {INSTALL_HINT}") from exc
        if not _fallback_warned:
            _fallback_warned = True
            warnings.warn(
                "swiglu-cupy: CuPy is not available, so CUDA tensors use the slower torch "
                f"implementation of the elementwise step. Fix: {INSTALL_HINT}. "
                "Set SWIGLU_CUPY_STRICT=1 to make this an error.",
                RuntimeWarning, stacklevel=3)
        return False


def warmup(device=None, dtypes=(torch.float16, torch.bfloat16, torch.float32), activations=("silu",)) -> int:
    """Compile and load every kernel for ``device``, ``dtypes`` and the GLU
    variants of ``activations`` (names or ``GLUActivation`` specs; specs that
    differ only in limit, alpha or up_offset share one compiled variant) now,
    e.g. before CUDA graph capture (no module may load during capture).
    Returns the number of kernels ready."""
    device = torch.device("cuda" if device is None else device)
    if device.type != "cuda":
        raise ValueError(f"device must be a CUDA device, got {device}")
    if isinstance(activations, str) or not hasattr(activations, "__iter__"):
        raise TypeError(f"activations must be a sequence of names or GLUActivation specs, got {activations!r}")
    variants = dict.fromkeys(kernel_variant(resolve_activation(a)) for a in activations)
    index = device_index(device)
    launcher = cupy_launcher()
    count = 0
    for dtype in dtypes:
        for variant in variants:
            for name in kernel_names(variant, dtype):
                launcher.function(name, dtype, index)
                count += 1
    launcher._stream(index)
    return count
