"""``python -m swiglu_cupy bench``: SwiGLU feed-forward contenders measured in one run.

Measured: forward, backward and forward+backward time (CUDA events, or
``time.perf_counter`` on CPU; median, p10-p90, min/max over repeats after
warm-up), the elementwise kernels' bandwidth against a device copy, peak
memory (fwd+bwd and no-grad forward), host overhead per call at a tiny shape
(with grad and under no_grad, as ratios to eager HF), on the CPU the CPU
path's ratios to eager HF at a mid-size shape, and the kernels' cold-compile
and warm-start time in fresh processes. ``--sweep-launch`` times the
elementwise kernels' launch candidates instead (``sweep``); ``--moe``,
``--long-context`` and ``--host-cost`` are other measurements in their own
modules.
Anything that needs CUDA is recorded as null with the reason on CPU.

One module per job:

- ``config``: model presets, dtypes, the shapes and settings of a run;
- ``contenders``: the modules compared and the runners that call them;
- ``measure``: the clock, statistics, interleaved timing, peak memory, copy
  rate, and what is measured per shape, per contender, for host overhead and
  for the CPU path;
- ``compile_probe``: cold/warm kernel compile in fresh processes;
- ``environment``: versions, device and commit recorded with the results;
- ``report``: the text table and the PNG;
- ``sweep``: ``--sweep-launch``, the launch-shape sweep of the kernels;
- ``moe``: ``--moe``, the MoE experts against transformers' grouped_mm;
- ``long_context``: ``--long-context``, memory and time against sequence length;
- ``host_cost``: ``--host-cost``, host time per call of the CUDA route (a
  do-nothing launcher, ``tools.host_cost``) and the torch route on the CPU;
- ``bench_command``: arguments, their resolution into shapes and settings, and ``run``.

A new measurement mode gets its own module beside ``measure``, reusing its
``Clock``, ``stats`` and copy rate, and is wired in through ``bench_command``.
"""
from .bench_command import add_arguments, resolve, run
from .config import DTYPES, PRESETS, Settings, Shape
from .contenders import CONTENDERS, LABELS, LOWER_BOUND
from .measure import Clock, stats
from .report import format_table, plot

__all__ = ["add_arguments", "resolve", "run", "DTYPES", "PRESETS", "Settings", "Shape", "CONTENDERS",
           "LABELS", "LOWER_BOUND", "Clock", "stats", "format_table", "plot"]
