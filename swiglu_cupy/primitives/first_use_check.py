"""First-use self-check of each kernel module: before the kernels of one GLU
variant, dtype and device (and launcher) produce a result anywhere, a small
probe runs that module's forward and backward entry points and compares them
with the torch implementation. A module that fails warns once (kernel,
device and compute capability, dtype, worst difference) and runs the torch
implementation for the rest of the process; ``SWIGLU_CUPY_STRICT=1`` makes a
failure an error; ``SWIGLU_CUPY_SELFCHECK=0`` skips the check.

The probe (``probe_module``), per module:

- both access widths: H = 3 x the 16-byte vector width (the vector path, with
  a partly filled block row) and H = that + 1 (odd: the scalar path);
- the launch shapes: each compiled packs-per-thread instance with the current
  block size, uncapped and capped at one grid wave, plus the current config;
  M is one grid wave of the capped shape plus one block plus one row, so
  rows past the first wave (the grid-stride loop) and past one block run;
- the variant's layout (halves or interleaved);
- special rows: zeros, large magnitudes, and, with the variant's limit (or
  1.5), values exactly at +-limit and one storage ulp on either side;
- outputs written over NaN-filled buffers, so a skipped element shows;
- the 8-bit saved x12's pair (``saved_x12="fp8"``; not for float64, which
  refuses it): H = 128 + 3 (two scale blocks per half, the last one partial),
  M past one wave of their own launch shape, every config; the saved bytes
  and scales must equal the torch implementation's exactly, h and the
  backward from the saved bytes are held to the bounds below.

Comparison (``compare``): ``|kernel - torch| <= 2 ulp(storage) * |torch| +
64 eps(math) * (1 + g^2) * scale + tiny`` per element (scale: the terms each
output multiplies; the bound the host-execution tests hold), the same
non-finite elements, and for clamped variants the clamp masks exactly: where
the raw gate is above (or the raw up outside) ``-limit..limit`` the gradient
is exactly 0 in both, and where it sits at the limit both follow the
installed torch's rule (passed up to 2.13, cut from 2.14 on).

Where the probe must not run: inside CUDA graph capture of the current
stream (a probe would be captured) the first use raises ``SelfCheckError``
telling to call ``swiglu_cupy.warmup`` before capture; inside a torch.compile
trace the call is given the torch implementation (traced as aten ops) and the
check waits for the module's first eager call.
"""
from __future__ import annotations

import dataclasses
import os
import threading
import time
import warnings

import torch

from ..activations import GLUActivation, resolve_activation
from ..kernels import launch
from ..kernels.launch import device_index, strict_mode
from ..kernels.launch_config import PACKS_PER_THREAD, LaunchConfig, current_launch_config, probing
from ..kernels.sources import KernelVariant, kernel_name, kernel_variant, vector_width
from ..reference import single_rounding_bounds, split_gate_up
from . import cuda_impl, saved_x12, torch_impl

__all__ = ["SelfCheckError", "CheckResult", "kernels_usable", "check_module", "result_of", "results", "format_results",
           "enabled", "probe_decision", "reset", "warmup",
           "record", "run_probe", "describe_device", "probe_spec"]

ENV = "SWIGLU_CUPY_SELFCHECK"
PROBE_LIMIT = 1.5                 # the clamp boundary probed for variants whose spec has none
STORAGE_ULPS = 2                  # x the unit roundoff: one storage ulp of the value
MATH_ULPS = 64                    # x the math dtype's unit roundoff, times the terms' size
LARGE = {torch.float16: 256.0}    # large magnitudes, exact in storage, that keep h finite (others: 8192)


class SelfCheckError(RuntimeError):
    """A kernel module failed its self-check under SWIGLU_CUPY_STRICT=1, or
    its first use came inside CUDA graph capture."""


@dataclasses.dataclass
class CheckResult:
    variant: KernelVariant
    dtype: torch.dtype
    device: str           # "NVIDIA H200 (sm_90, cuda:0)" or "cpu via HostLauncher"
    status: str           # "passed", "failed" or "skipped"
    detail: str           # the worst difference, or why it was skipped
    seconds: float = 0.0
    launches: int = 0
    calls: int = 0        # checks run (1 per module per process)
    module: str = ""      # another op's check (the MoE experts'); "" for a kernel module

    @property
    def kernel(self) -> str:
        return self.module or _label(self.variant)

    def line(self) -> str:
        launches = f", {self.launches} launches" if self.launches else ""
        timing = f"{launches}, {self.seconds * 1e3:.1f} ms" if self.status != "skipped" else ""
        return f"{self.kernel} [{str(self.dtype).replace('torch.', '')}, {self.device}]: {self.status}" \
               f"{timing}; {self.detail}"


_lock = threading.RLock()   # reentrant: the MoE probe checks the activation module inside its own check
_results: dict[tuple, CheckResult] = {}     # (launcher, variant, dtype, device) -> result
#: (launcher, spec, dtype, device) -> kernels usable (the module's first-use verdict)
verdicts: dict[tuple, bool] = {}
#: (launcher, variant, dtype, device) -> the launch configs its checks launched (absent: not
#: probed, e.g. skipped: any config runs); a config's own probe is in ``_results`` under key + (config,)
_covered: dict[tuple, set] = {}
#: called by ``reset`` (the caches built on verdicts: ``dispatch``'s decided paths)
on_reset: list = []


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip() not in ("0", "false", "off", "no")


def _stream_capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def probe_decision(device: torch.device) -> str:
    """"run" (probe now), "defer" (inside a torch.compile trace: use the torch
    implementation for this call, probe at the first eager call) or "refuse"
    (inside CUDA graph capture: raise)."""
    if _stream_capturing(device):
        return "refuse"
    if torch.compiler.is_compiling():
        return "defer"
    return "run"


def kernels_usable(launcher, spec: GLUActivation, dtype: torch.dtype, device: torch.device,
                   config: LaunchConfig | None = None) -> bool:
    """Whether this call may run the kernels (``launcher`` None: CuPy's): the
    module's self-check result, checked on its first use, and with
    ``config`` (the call's launch config) that config's own: one the
    module's check did not launch is probed at its first use."""
    verdict = verdicts.get((launcher, spec, dtype, device))
    if verdict is None:
        verdict = _first_use(launcher, spec, dtype, device)
    elif not verdict and strict_mode():
        raise SelfCheckError(_results[(launcher, kernel_variant(spec), dtype, device)].line())
    if verdict and config is not None:
        return _config_usable(launcher, spec, dtype, device, config)
    return verdict


def _config_usable(launcher, spec, dtype, device, config: LaunchConfig) -> bool:
    """A launch config after the module's check: usable if that check
    launched it (or was skipped), else once its own probe passes."""
    key = (launcher, kernel_variant(spec), dtype, device)
    covered = _covered.get(key)
    if covered is None or config in covered:
        return True
    config_key = key + (config,)
    result = _results.get(config_key)
    if result is None:
        decision = probe_decision(device)
        if decision == "defer":
            return False
        if decision == "refuse":
            raise SelfCheckError(
                f"swiglu-cupy: the {_label(key[1])} kernels ({dtype}, {device}) are first launched with "
                f"{config.label} inside CUDA graph capture, before that config's self-check; call "
                f"swiglu_cupy.warmup({str(device)!r}, dtypes=({dtype},), activations=({spec!r},)) inside "
                f"using_launch_config(...) with this config before capture (or set {ENV}=0 to skip the check).")
        result = record(config_key, lambda: run_probe(
            key[1], dtype, f"{describe_device(launcher, device)}, {config.label}", device,
            lambda: probe_module(launcher, spec, dtype, device, [config])))
    if result.status == "failed":
        if strict_mode():
            raise SelfCheckError(result.line())
        return False
    covered.add(config)
    return True


def _first_use(launcher, spec, dtype, device) -> bool:
    if not enabled():
        result = _record_skip(launcher, spec, dtype, device, f"{ENV}=0")
    else:
        decision = probe_decision(device)
        if decision == "defer":
            return False
        if decision == "refuse" and (launcher, kernel_variant(spec), dtype, device) not in _results:
            raise SelfCheckError(
                f"swiglu-cupy: the {_label(kernel_variant(spec))} kernels ({dtype}, {device}) are first used "
                "inside CUDA graph capture, before their self-check; the check's probe must not be captured. "
                f"Call swiglu_cupy.warmup({str(device)!r}, dtypes=({dtype},), activations=({spec!r},)) "
                f"before capture (or set {ENV}=0 to skip the check).")
        result = check_module(launcher, spec, dtype, device)
    ok = result.status != "failed"
    verdicts[(launcher, spec, dtype, device)] = ok
    if not ok and strict_mode():
        raise SelfCheckError(result.line())
    return ok


def _label(variant: KernelVariant) -> str:
    return "glu_" + variant.tag if variant.tag else "swiglu"


def describe_device(launcher, device: torch.device) -> str:
    if device.type == "cuda" and launcher is None:
        index = device_index(device)
        major, minor = torch.cuda.get_device_capability(index)
        return f"{torch.cuda.get_device_name(index)} (sm_{major}{minor}, cuda:{index})"
    return f"{device} via {type(launcher).__name__}"


def _record_skip(launcher, spec, dtype, device, why: str) -> CheckResult:
    variant = kernel_variant(spec)
    return record((launcher, variant, dtype, device),
                  lambda: CheckResult(variant, dtype, describe_device(launcher, device), "skipped", why))


def check_module(launcher, spec: GLUActivation, dtype: torch.dtype, device: torch.device) -> CheckResult:
    """The module's result, probing it now unless it was (once per process)."""
    spec = resolve_activation(spec)
    return record((launcher, kernel_variant(spec), dtype, device), lambda: _run_check(launcher, spec, dtype, device))


def _run_check(launcher, spec, dtype, device) -> CheckResult:
    configs = probe_configs()
    result = run_probe(kernel_variant(spec), dtype, describe_device(launcher, device), device,
                       lambda: probe_module(launcher, spec, dtype, device, configs))
    _covered[(launcher, kernel_variant(spec), dtype, device)] = set(configs)
    return result


def run_probe(variant: KernelVariant, dtype: torch.dtype, device_text: str, device: torch.device, probe,
              module: str = "") -> CheckResult:
    """Times ``probe()`` -> (problems, launches) and warns on a failure (the
    caller records the result; STRICT raises at the caller)."""
    start = time.perf_counter()
    # The probe's own numerics, whatever mode the first call came in (autocast
    # would recast the MoE GEMMs; inference mode forbids the reference's autograd).
    with torch.inference_mode(False), torch.autocast(device.type, enabled=False):
        problems, launches = probe()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    result = CheckResult(variant, dtype, device_text, "failed" if problems else "passed",
                         problems[0] if problems else "every output within its bound, clamp masks exact",
                         time.perf_counter() - start, launches, 1, module)
    if problems and not strict_mode():
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        warnings.warn(
            f"swiglu-cupy: self-check FAILED for kernel {result.kernel} on {result.device}, {dtype}: "
            f"{problems[0]}{more}. This module runs the torch implementation for the rest of the process "
            "(SWIGLU_CUPY_STRICT=1 makes this an error); please report it with `python -m swiglu_cupy info`.",
            RuntimeWarning, stacklevel=3)
    return result


def record(key: tuple, make) -> CheckResult:
    """The result for ``key``, made by ``make()`` once per process."""
    result = _results.get(key)
    if result is None:
        with _lock:
            result = _results.get(key)
            if result is None:
                result = _results[key] = make()
    return result


def result_of(launcher, spec: GLUActivation, dtype: torch.dtype, device: torch.device) -> CheckResult | None:
    """The module's result, or None while it is unchecked."""
    return _results.get((launcher, kernel_variant(resolve_activation(spec)), dtype, device))


def results() -> list[CheckResult]:
    """Every module checked (or skipped) so far in this process."""
    with _lock:
        return list(_results.values())


def format_results(items=None) -> list[str]:
    return [r.line() for r in (results() if items is None else items)]


def reset() -> None:
    """Forget every result (tests; a fresh process does the same)."""
    with _lock:
        _results.clear()
        verdicts.clear()
        _covered.clear()
        for forget in on_reset:
            forget()


def probe_spec(variant: KernelVariant) -> GLUActivation:
    """A spec that runs ``variant`` (GPT-OSS's alpha and offset for OAI; the
    probe limit for clamped ones), for checks made without a model's spec."""
    oai = dict(alpha=1.702, up_offset=1.0) if variant.kind == "oai" else {}
    return GLUActivation(variant.kind, limit=PROBE_LIMIT if variant.clamp else None,
                         interleaved=variant.interleaved, **oai)


# ---- the probe --------------------------------------------------------------------------------

def probe_configs(current: LaunchConfig | None = None) -> list[LaunchConfig]:
    """The current config, and each packs-per-thread instance with its block
    size, uncapped and capped at one grid wave."""
    current = current or current_launch_config()
    configs = [current] + [LaunchConfig(p, current.threads_per_block, w) for p in PACKS_PER_THREAD for w in (None, 1)]
    return list(dict.fromkeys(configs))


def probe_rows(H: int, vec: int, configs, variant: KernelVariant, sms: int) -> int:
    """Rows that reach past one block and past one grid wave of every config."""
    rows = 1
    for config in configs:
        config = cuda_impl.effective_launch_config(config, variant)
        grid, block = cuda_impl.launch_shape(1 << 30, H, vec, config, sms)
        wave = grid[1] * block[1] if config.grid_waves is not None else 0
        rows = max(rows, wave + block[1] + 1)
    return rows


def _neighbours(value: float, dtype: torch.dtype) -> tuple[float, float, float]:
    """(below, at, above): ``value`` rounded to ``dtype`` and its storage
    neighbours (a limit beyond the dtype's range: its largest finite value's)."""
    at = torch.tensor([min(value, torch.finfo(dtype).max)], dtype=dtype)
    bits = at.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[at.element_size()])
    below, above = (bits - 1).view(dtype), (bits + 1).view(dtype)
    return below.item(), at.item(), above.item()


def probe_inputs(spec: GLUActivation, dtype: torch.dtype, device: torch.device, M: int, H: int, seed: int):
    """(x12, dh): N(0, 2^2) gate/up, N(0, 1) dh, and the special rows."""
    gen = torch.Generator().manual_seed(seed)
    x12 = torch.randn(M, 2 * H, generator=gen, dtype=torch.float64) * 2
    dh = torch.randn(M, H, generator=gen, dtype=torch.float64)
    gate, up = split_gate_up(x12, spec)
    big = LARGE.get(dtype, 8192.0)
    below, at, above = _neighbours(spec.limit or PROBE_LIMIT, dtype)
    gate[0] = 0.0                                  # zeros (and a zero dh half-row)
    up[0, ::2] = 0.0
    dh[0, 1::2] = 0.0
    gate[1, 0::2], gate[1, 1::2] = big, -big       # large gates, moderate ups
    up[2, 0::2], up[2, 1::2] = big, -big           # large ups, moderate gates
    for row in (3, M - 1):                         # the clamp boundaries (also in the last row)
        gate[row, 0::4], gate[row, 1::4], gate[row, 2::4], gate[row, 3::4] = at, above, below, -at
        up[row, 0::4], up[row, 1::4], up[row, 2::4], up[row, 3::4] = at, -above, -at, above
    return x12.to(dtype).to(device), dh.to(dtype).to(device)


def _bounds(x12, dh, spec, ref_h, ref_dx12):
    return single_rounding_bounds(x12, dh, spec, ref_h, ref_dx12, storage_ulps=STORAGE_ULPS, math_ulps=MATH_ULPS)


def _clamp_region(x12, spec):
    """Where the clamp decides each dx12 element: the raw gate at or above the
    limit's lower neighbour, the raw up at or beyond it (either sign)."""
    below = _neighbours(spec.limit, x12.dtype)[0]
    g, u = split_gate_up(x12.double(), spec)
    parts = [g >= below, u.abs() >= below]
    return torch.stack(parts, 2).view_as(x12) if spec.interleaved else torch.cat(parts, 1)


@dataclasses.dataclass
class _Comparison:
    label: str
    excess: torch.Tensor   # max of |diff| / bound (> 1: out of bound); a 0-d device tensor
    mismatches: torch.Tensor  # non-finite or clamp-mask disagreements
    got: torch.Tensor
    ref: torch.Tensor
    bound: torch.Tensor


def compare(label: str, got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, mask_region=None) -> _Comparison:
    g, r = got.double(), ref.double()
    same = (g == r) | (torch.isnan(g) & torch.isnan(r))
    diff = torch.where(same, 0.0, (g - r).abs())      # inf - inf and NaN count as out of bound
    diff = torch.where(torch.isnan(diff), float("inf"), diff)
    mismatches = (torch.isfinite(g) != torch.isfinite(r)).sum()
    if mask_region is not None:
        mismatches = mismatches + (((g == 0) != (r == 0)) & mask_region).sum()
    return _Comparison(label, (diff / bound).max(), mismatches, got, ref, bound)


def _describe(c: _Comparison) -> str:
    g, r = c.got.double(), c.ref.double()
    ratio = torch.where((g == r), 0.0, (g - r).abs() / c.bound).nan_to_num(nan=float("inf"))
    flat = int(ratio.argmax())
    row, col = divmod(flat, c.got.shape[1])
    worst = (f"worst |diff| {abs(g[row, col] - r[row, col]).item():.3g} = {ratio[row, col].item():.3g} x its bound "
             f"at [{row}, {col}] (kernel {g[row, col].item():.6g}, torch {r[row, col].item():.6g})")
    n = int(c.mismatches)
    return f"{c.label}: {worst}" + (f"; {n} non-finite or clamp-mask mismatches" if n else "")


def _nan_like(shape, like):
    return torch.full(shape, float("nan"), dtype=like.dtype, device=like.device)


def probe_module(launcher, spec: GLUActivation, dtype: torch.dtype, device: torch.device,
                 configs=None) -> tuple[list[str], int]:
    """Runs the probe; returns (problems, kernel launches): problems name the
    entry point, the output and the worst difference."""
    variant = kernel_variant(spec)
    configs = probe_configs() if configs is None else configs
    vec = vector_width(dtype)
    sms = cuda_impl.sm_count(device)
    comparisons, launches = [], 0
    for seed, H in enumerate((3 * vec, 3 * vec + 1)):
        width = H % vec == 0
        M = max(probe_rows(H, vec if width else 1, configs, variant, sms), 5)
        x12, dh = probe_inputs(spec, dtype, device, M, H, seed)
        ref_h = torch_impl.swiglu_forward_torch(x12, None, spec)
        ref_dx12, _ = torch_impl.swiglu_backward_torch(x12, dh, activation=spec)
        h_bound, dx_bound = _bounds(x12, dh, spec, ref_h, ref_dx12)
        region = _clamp_region(x12, spec) if spec.limit is not None else None
        for config in configs:
            packs = cuda_impl.effective_launch_config(config, variant).packs_per_thread
            with probing():
                h = cuda_impl.launch_swiglu_forward(x12, _nan_like(ref_h.shape, x12), launcher, config, spec)
                dx12, h_bwd = cuda_impl.launch_swiglu_backward(x12, dh, _nan_like(x12.shape, x12), launcher,
                                                               config, spec)
            launches += 2
            where = f"{config.label}, H={H}, M={M}"
            comparisons += [
                compare(f"{kernel_name('swiglu_forward', width, packs, variant)} h ({where})", h, ref_h, h_bound),
                compare(f"{kernel_name('swiglu_backward', width, packs, variant)} dx12 ({where})", dx12, ref_dx12,
                        dx_bound, region),
                compare(f"{kernel_name('swiglu_backward', width, packs, variant)} h ({where})", h_bwd, ref_h,
                        h_bound),
            ]
    if dtype is not torch.float64:  # float64 refuses saved_x12="fp8": its kernels never run
        fp8_comparisons, fp8_launches = _probe_fp8(launcher, spec, dtype, device, configs, variant, sms)
        comparisons += fp8_comparisons
        launches += fp8_launches
    # One device-to-host copy for every figure.
    figures = torch.stack([torch.stack([c.excess, c.mismatches.double()]) for c in comparisons]).tolist()
    problems = [_describe(c) for c, (excess, mismatches) in zip(comparisons, figures) if excess > 1 or mismatches]
    return problems, launches


def _probe_fp8(launcher, spec, dtype, device, configs, variant, sms) -> tuple[list, int]:
    """The 8-bit saved x12's forward (h and the saved bytes in one pass) and
    backward (from the saved bytes) against the torch implementation, for
    both widths: H = 136 runs the 16-byte instances, 131 the others (two
    blocks per half, the second short)."""
    comparisons, launches = [], 0
    for H, vectorized in ((saved_x12.BLOCK + 8, True), (saved_x12.BLOCK + 3, False)):
        cols = cuda_impl.fp8_launch_columns(H, spec, dtype)
        M = max(probe_rows(cols, 1, configs, variant, sms), 5)
        x12, dh = probe_inputs(spec, dtype, device, M, H, seed=7)
        ref_h = torch_impl.swiglu_forward_torch(x12, None, spec)
        ref_saved = saved_x12.quantize_torch(x12, spec)
        read_back = saved_x12.dequantize_torch(ref_saved, H, spec)
        ref_dx12, ref_h_bwd = (t.to(dtype) for t in torch_impl.swiglu_backward_torch(read_back, dh.float(),
                                                                                    activation=spec))
        h_bound, _ = _bounds(x12, dh, spec, ref_h, ref_dx12)
        h_bwd_bound, dx_bound = _bounds(read_back.to(dtype), dh, spec, ref_h_bwd, ref_dx12)
        region = _clamp_region(read_back.to(dtype), spec) if spec.limit is not None else None
        exact = torch.full(ref_saved.shape, 0.5, dtype=torch.float64, device=device)  # bytes: any difference is >= 1
        for config in configs:
            with probing():
                h, saved = cuda_impl.launch_swiglu_forward_fp8(x12, launcher, config, spec)
                dx12, h_bwd = cuda_impl.launch_swiglu_backward_fp8(ref_saved, dh, launcher, config, spec)
            launches += 2
            where = f"{config.label}, H={H}, M={M}"
            packs = cuda_impl.effective_launch_config(config, variant).packs_per_thread
            forward, backward = (kernel_name(kind, vectorized, packs, variant)
                                 for kind in ("swiglu_forward_fp8", "swiglu_backward_fp8"))
            comparisons += [
                compare(f"{forward} h ({where})", h, ref_h, h_bound),
                compare(f"{forward} saved bytes ({where})", saved, ref_saved, exact),
                compare(f"{backward} dx12 ({where})", dx12, ref_dx12, dx_bound, region),
                compare(f"{backward} h ({where})", h_bwd, ref_h_bwd, h_bwd_bound),
            ]
    return comparisons, launches


def warmup(device=None, dtypes=(torch.float16, torch.bfloat16, torch.float32), activations=("silu",)) -> int:
    """Compile and load every kernel for ``device``, ``dtypes`` and the GLU
    variants of ``activations`` (names or ``GLUActivation`` specs; specs that
    differ only in limit, alpha or up_offset share one compiled variant), and
    run each module's self-check, now: e.g. before CUDA graph capture (no
    module may load, and no probe may run, during capture). Returns the
    number of kernels ready (``first_use_check.results()`` has the checks)."""
    count = launch.warmup(device, dtypes, activations)
    warm(torch.device("cuda" if device is None else device), dtypes, activations)
    return count


def warm(device, dtypes, activations) -> list[CheckResult]:
    """Checks each (variant, dtype) module on the CUDA ``device`` now."""
    device = torch.device("cuda", device_index(torch.device(device)))
    out = []
    for dtype in dtypes:
        for spec in dict.fromkeys(resolve_activation(a) for a in activations):
            kernels_usable(None, spec, dtype, device)
            out.append(check_module(None, spec, dtype, device))
    return out

