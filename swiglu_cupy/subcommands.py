"""The subcommands of ``python -m swiglu_cupy`` (and of the ``swiglu-cupy``
console script): ``compile [--arch sm_80 sm_90 ...]``, ``info``,
``bench [...]`` and ``selftest --out DIR``, each dispatched to its tool."""
from __future__ import annotations

import argparse
import sys
import time

from .kernels.sources import DEFAULT_ARCHS
from .activations import KINDS


def _cmd_compile(args: argparse.Namespace) -> int:
    from .kernels.sources import SUPPORTED_DTYPES, VARIANTS
    from .kernels.compile_check import CompileError, compile_jobs, format_table

    start = time.perf_counter()
    variants = tuple(v for v in VARIANTS if args.kind is None or v.kind in args.kind)
    dtypes = tuple(d for d in SUPPORTED_DTYPES if args.dtype is None or str(d).replace("torch.", "") in args.dtype)
    jobs = [(dtype, arch, variant) for arch in args.arch for dtype in dtypes for variant in variants]
    try:
        modules = compile_jobs(jobs)
    except CompileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    reports = [r for module_reports, _ in modules for r in module_reports]
    elapsed = time.perf_counter() - start
    print(format_table(reports))
    spilled = [r for r in reports if r.spills]
    print(f"\ncompiled {len(reports)} kernels ({len(variants)} GLU variants) for {', '.join(args.arch)} "
          f"in {elapsed:.2f} s "
          f"(NVRTC, no GPU needed); spills: {len(spilled)}")
    for r in spilled:
        print(f"SPILL: {r.kernel} [{r.dtype}, {r.arch}] stores={r.spill_store_bytes} "
              f"loads={r.spill_load_bytes}", file=sys.stderr)
    if args.report:
        from .tools.machine_code import report_modules

        try:
            print("\n" + report_modules(jobs, modules))
        except RuntimeError as exc:  # cuobjdump missing, or machine code the model cannot read
            print(f"error: {exc}", file=sys.stderr)
            return 1
    return 1 if spilled else 0


def _cmd_info(args: argparse.Namespace) -> int:
    from .tools.info import collect, format_info

    print(format_info(collect(check_default_modules=True)))
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from .tools.bench import run

    return run(args)


def _cmd_selftest(args: argparse.Namespace) -> int:
    from .tools.gpu_selftest import run

    return run(args.out)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m swiglu_cupy")
    sub = parser.add_subparsers(dest="command", required=True)
    comp = sub.add_parser("compile", help="compile every kernel x dtype x GLU variant with NVRTC (no GPU "
                                          "needed), report registers and spills; exit 1 on spills")
    comp.add_argument("--arch", nargs="+", default=list(DEFAULT_ARCHS),
                      help="GPU architectures, e.g. sm_80 sm_90 sm_100")
    comp.add_argument("--kind", nargs="+", default=None, choices=KINDS,
                      help="only these activation kinds' variants (each with and without the clamp, both "
                           "layouts); default: every kind")
    comp.add_argument("--dtype", nargs="+", default=None, choices=("float16", "bfloat16", "float32", "float64"),
                      help="only these storage dtypes; default: every one")
    comp.add_argument("--report", action="store_true",
                      help="also read every kernel's machine code (cuobjdump -sass) and print, per kernel, "
                           "the issue/memory model's prediction (instr/elem, bytes/elem, ratio per GPU), "
                           "local memory, access widths and CALLs in the hot loop: predicted, not measured")
    comp.set_defaults(func=_cmd_compile)

    info = sub.add_parser("info", help="explain the setup: versions, CuPy/NVRTC state, cache dir, "
                                       "and which path CUDA tensors take")
    info.set_defaults(func=_cmd_info)

    from .tools import bench
    ben = sub.add_parser("bench", help="time and measure SwiGLU contenders (eager, packed, torch.compile, "
                                       "Liger, swiglu-cupy) against the GEMMs alone; writes bench.json/png")
    bench.add_arguments(ben)
    ben.set_defaults(func=_cmd_bench)

    st = sub.add_parser("selftest", help="GPU check within 8 minutes: pytest -m gpu, bench --quick, then "
                                         "bench --sweep-launch; exit 2 without CUDA")
    st.add_argument("--out", default="selftest-results", help="directory for the logs, results and summary")
    st.set_defaults(func=_cmd_selftest)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)
