"""Launch shape of the elementwise kernels: the candidates and the default,
in one place.

A :class:`LaunchConfig` has three knobs:

``packs_per_thread``
    independent 16-byte packs (or single elements on the scalar path) each
    thread loads before it computes, i.e. loads in flight per thread. Each
    value is a compiled kernel instance (``PACKS_PER_THREAD``).
``threads_per_block``
    block size (x covers column packs of a row, y covers rows).
``grid_waves``
    ``None`` launches one thread per tile; an integer caps the grid at that
    many waves (SM count x resident blocks per SM at full occupancy) and
    the kernels cover the rest with grid-stride loops over rows and columns.

Choosing a config for a call (the entry point for ``bench --sweep-launch``)::

    from swiglu_cupy.kernels.launch_config import LAUNCH_CANDIDATES, using_launch_config
    for config in LAUNCH_CANDIDATES:
        with using_launch_config(config):   # this thread, this block only
            primitives.swiglu_forward(x12, out=h)   # any kernel-path call

The kernel-path functions in ``swiglu_cupy.primitives.cuda_impl`` also take
``launch_config=`` directly. To make a measured winner the default, change
``DEFAULT_LAUNCH`` below (its ``repr`` is the line to write).
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import itertools
from dataclasses import dataclass
from typing import Iterator

PACKS_PER_THREAD = (1, 2, 4)        # compiled kernel instances (see _sources)
THREADS_PER_BLOCK = (128, 256, 512)
GRID_WAVES = (None, 1, 4)
MAX_THREADS_PER_BLOCK = 512         # every kernel's registers must fit 512 threads (65536 regs)
RESIDENT_THREADS_PER_SM = 2048      # sm_80, sm_90, sm_100; defines one "wave"


@dataclass(frozen=True)
class LaunchConfig:
    packs_per_thread: int = 1
    threads_per_block: int = 256
    grid_waves: int | None = None

    def __post_init__(self) -> None:
        if type(self.packs_per_thread) is not int or self.packs_per_thread not in PACKS_PER_THREAD:
            raise ValueError(f"packs_per_thread must be one of the compiled instances {PACKS_PER_THREAD}, "
                             f"got {self.packs_per_thread!r}")
        t = self.threads_per_block
        if type(t) is not int or t % 32 or not 32 <= t <= MAX_THREADS_PER_BLOCK:
            raise ValueError(f"threads_per_block must be a multiple of 32 in [32, {MAX_THREADS_PER_BLOCK}], "
                             f"got {t!r}")
        w = self.grid_waves
        if w is not None and (type(w) is not int or w < 1):
            raise ValueError(f"grid_waves must be None or a positive int, got {w!r}")

    @property
    def label(self) -> str:
        waves = "all" if self.grid_waves is None else str(self.grid_waves)
        return f"packs={self.packs_per_thread} threads={self.threads_per_block} waves={waves}"

    def max_blocks(self, sm_count: int) -> int | None:
        """The grid cap in blocks, or None when uncapped."""
        if self.grid_waves is None:
            return None
        return self.grid_waves * sm_count * max(1, RESIDENT_THREADS_PER_SM // self.threads_per_block)


# Chosen by the issue/memory model of the kernels' machine code (a GPU
# measurement may overrule it: ``bench --sweep-launch``): one pack per thread,
# the grid capped at one wave, so each thread covers several tiles with one
# prologue. Uncapped (one tile per thread), the prologue is paid per tile:
# +40-100% instructions per element, which made bf16 and fp32 SwiGLU issue-bound
# on a B200 (0.75 / 0.61 of the memory time, now 0.59 / 0.30). More packs per
# thread score as well or a little better but take up to twice the registers,
# whose occupancy cost the model leaves out. The comparison:
# ``machine_code.score_launches``, printed by ``python -m swiglu_cupy compile
# --report``; ``tests/test_machine_code.py`` checks this is its first choice.
DEFAULT_LAUNCH = LaunchConfig(packs_per_thread=1, threads_per_block=256, grid_waves=1)

LAUNCH_CANDIDATES = tuple(LaunchConfig(p, t, w) for p, t, w in
                          itertools.product(PACKS_PER_THREAD, THREADS_PER_BLOCK, GRID_WAVES))

_current = contextvars.ContextVar("swiglu_cupy_launch_config", default=DEFAULT_LAUNCH)


#: ``current_launch_config()``: the config kernel launches use when none is
#: passed explicitly (the ContextVar's own getter: no Python frame per launch).
current_launch_config = _current.get


@contextlib.contextmanager
def using_launch_config(config: LaunchConfig) -> Iterator[LaunchConfig]:
    """Launch the kernels with ``config`` inside the block (per thread/context)."""
    if not isinstance(config, LaunchConfig):
        raise TypeError(f"config must be a LaunchConfig, got {type(config).__name__}")
    token = _current.set(config)
    try:
        yield config
    finally:
        _current.reset(token)


_probing = contextvars.ContextVar("swiglu_cupy_probing", default=False)


def is_probing() -> bool:
    """True while the self-check's probe launches (launchers may keep them apart)."""
    return _probing.get()


@contextlib.contextmanager
def probing() -> Iterator[None]:
    """Mark the launches inside the block as the self-check's probe."""
    token = _probing.set(True)
    try:
        yield
    finally:
        _probing.reset(token)


# ---- the launcher: CuPy on a GPU, or a substitute for every primitive call -----------------

_forced = [None]  # the launcher set by using_launcher, process-wide

#: ``forced_launcher()``: the launcher set by ``using_launcher``, or None (CUDA
#: tensors then use CuPy); a C-level getter (no Python frame per call).
forced_launcher = functools.partial(_forced.__getitem__, 0)


@contextlib.contextmanager
def using_launcher(launcher) -> Iterator[object]:
    """Route every primitive call, CPU tensors included, through the kernel
    path with ``launcher`` (an object with ``launch(name, dtype, device, grid,
    block, args)``, ``args`` as ``launch.Launcher`` says: pointers as ints,
    the rest numpy-typed; e.g. ``swiglu_cupy.kernels.host_exec.HostLauncher``)
    inside the block: the whole op then runs the ``.cu`` kernels. Process-wide,
    not per thread, because autograd may run backward on its own threads;
    meant for tests and harnesses, not for concurrent use."""
    if not callable(getattr(launcher, "launch", None)):
        raise TypeError(f"launcher must have a launch(name, dtype, device, grid, block, args) method, "
                        f"got {type(launcher).__name__}")
    saved, _forced[0] = _forced[0], launcher
    try:
        yield launcher
    finally:
        _forced[0] = saved
