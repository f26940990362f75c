"""The cooperative host executor (swiglu_cupy/kernels/host_exec.py) by
itself: small CUDA kernels that need their block's threads to cooperate
(shared memory and barriers, warp shuffles, votes) give the GPU's answer when
a block's threads run as fibers, and a wrong one when each thread runs alone
(mode "sequential"). A deadlock ends the launch with an error naming the
kernel; those launches run in a subprocess with a timeout, so a regression
fails instead of hanging CI."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from swiglu_cupy.kernels import host_exec
from swiglu_cupy.kernels.host_exec import HostLibrary, build_host_library, execution_mode

REPO = Path(__file__).resolve().parent.parent

COOPERATIVE_SOURCE = r"""
// Sum of each block's slice: a tree in shared memory, a barrier per level.
extern "C" __global__ void block_sum(const float* x, float* out, long long n) {
    __shared__ float partial[256];
    const unsigned t = threadIdx.x;
    const long long i = (long long)blockIdx.x * blockDim.x + t;
    partial[t] = i < n ? x[i] : 0.0f;
    __syncthreads();
    for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
        if (t < s) partial[t] += partial[t + s];
        __syncthreads();
    }
    if (t == 0) out[blockIdx.x] = partial[0];
}

// Inclusive scan within each warp (Hillis-Steele over __shfl_up_sync), then
// the warp's total by a butterfly and by a down-shift tree, and lane 0's
// value broadcast.
extern "C" __global__ void warp_scan(const int* x, int* scan, int* totals) {
    const unsigned t = blockIdx.x * blockDim.x + threadIdx.x, lane = threadIdx.x % warpSize;
    const int v = x[t];
    int s = v;
    for (int d = 1; d < warpSize; d <<= 1) {
        const int up = __shfl_up_sync(0xffffffffu, s, d);
        if (lane >= d) s += up;
    }
    scan[t] = s;
    int butterfly = v, tree = v;
    for (int o = warpSize / 2; o > 0; o >>= 1) {
        butterfly += __shfl_xor_sync(0xffffffffu, butterfly, o);
        tree += __shfl_down_sync(0xffffffffu, tree, o);
    }
    const int first = __shfl_sync(0xffffffffu, v, 0);
    totals[3 * t] = butterfly;
    totals[3 * t + 1] = __shfl_sync(0xffffffffu, tree, 0);
    totals[3 * t + 2] = first;
}

// out = in^T through a padded shared tile (2-D blocks, partial edge tiles).
extern "C" __global__ void transpose(const float* in, float* out, int n) {
    __shared__ float tile[16][17];
    int x = blockIdx.x * 16 + threadIdx.x, y = blockIdx.y * 16 + threadIdx.y;
    if (x < n && y < n) tile[threadIdx.y][threadIdx.x] = in[y * n + x];
    __syncthreads();
    x = blockIdx.y * 16 + threadIdx.x;
    y = blockIdx.x * 16 + threadIdx.y;
    if (x < n && y < n) out[y * n + x] = tile[threadIdx.x][threadIdx.y];
}

// The same through dynamic shared memory (launch shared_mem = 16*17 floats);
// a second extern __shared__ name aliases the same bytes.
extern "C" __global__ void transpose_dynamic(const float* in, float* out, int n) {
    extern __shared__ __align__(16) float dynamic_tile[];
    extern __shared__ unsigned char dynamic_bytes[];
    int x = blockIdx.x * 16 + threadIdx.x, y = blockIdx.y * 16 + threadIdx.y;
    if (x < n && y < n) dynamic_tile[threadIdx.y * 17 + threadIdx.x] = in[y * n + x];
    __syncthreads();
    const float* tile = reinterpret_cast<const float*>(dynamic_bytes);
    x = blockIdx.y * 16 + threadIdx.x;
    y = blockIdx.x * 16 + threadIdx.y;
    if (x < n && y < n) out[y * n + x] = tile[threadIdx.x * 17 + threadIdx.y];
}

// Every vote, per thread: all, any, ballot, activemask, and the block-wide
// count/and/or of the predicate.
extern "C" __global__ void votes(const int* predicate, unsigned* out) {
    const unsigned t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    const int p = predicate[t];
    unsigned* o = out + 7 * t;
    o[0] = __all_sync(0xffffffffu, p);
    o[1] = __any_sync(0xffffffffu, p);
    o[2] = __ballot_sync(0xffffffffu, p);
    o[3] = __activemask();
    o[4] = __syncthreads_count(p);
    o[5] = __syncthreads_and(p);
    o[6] = __syncthreads_or(p);
}

// Every shuffle with a width, on lane numbers (CUDA's segment rules).
extern "C" __global__ void shuffles(int* out, int width, int src, unsigned delta, int lane_mask) {
    const int t = threadIdx.x;
    out[4 * t] = __shfl_sync(0xffffffffu, t, src, width);
    out[4 * t + 1] = __shfl_up_sync(0xffffffffu, t, delta, width);
    out[4 * t + 2] = __shfl_down_sync(0xffffffffu, t, delta, width);
    out[4 * t + 3] = __shfl_xor_sync(0xffffffffu, t, lane_mask, width);
    __syncwarp();
}

template <typename T> __device__ T warp_total(T v) {
    for (int o = 16; o > 0; o >>= 1) v = v + __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// A warp total in each type CUDA shuffles (2, 4 and 8 bytes), as double.
extern "C" __global__ void typed_totals(const __half* h, const __nv_bfloat16* b, const float* f,
                                        const double* d, const long long* q, double* out) {
    const unsigned t = threadIdx.x;
    const __half2 h2 = warp_total(__halves2half2(h[t], __hneg(h[t])));
    double* o = out + 7 * t;
    o[0] = __half2float(warp_total(h[t]));
    o[1] = __bfloat162float(warp_total(b[t]));
    o[2] = warp_total(f[t]);
    o[3] = warp_total(d[t]);
    o[4] = (double)warp_total(q[t]);
    o[5] = __half2float(__low2half(h2));
    o[6] = __half2float(__high2half(h2));
}

// Reads dynamic shared memory nobody wrote: 0xff bytes, a NaN.
extern "C" __global__ void read_unwritten_dynamic(float* out) {
    extern __shared__ float scratch[];
    out[threadIdx.x] = scratch[threadIdx.x];
}

// ---- misuse: each must end with an error, never hang ----
extern "C" __global__ void returns_before_barrier(float* out) {
    __shared__ float s[64];
    if (threadIdx.x == 5) return;
    s[threadIdx.x] = 1.0f;
    __syncthreads();
    out[threadIdx.x] = s[(threadIdx.x + 1) % blockDim.x];
}

extern "C" __global__ void barrier_in_one_branch(float* out) {
    if (threadIdx.x < 16) __syncthreads();
    out[threadIdx.x] = 1.0f;
}

extern "C" __global__ void barriers_at_two_places(float* out) {
    if (threadIdx.x < 16) __syncthreads();
    else __syncthreads();
    out[threadIdx.x] = 1.0f;
}

extern "C" __global__ void shuffle_with_exited_lane(int* out) {
    if (threadIdx.x == 7) return;
    out[threadIdx.x] = __shfl_down_sync(0xffffffffu, (int)threadIdx.x, 1);
}

extern "C" __global__ void shuffle_against_syncwarp(int* out) {
    int v = threadIdx.x;
    if (threadIdx.x < 16) v = __shfl_xor_sync(0xffffffffu, v, 1);
    else __syncwarp();
    out[threadIdx.x] = v;
}

extern "C" __global__ void mask_without_own_lane(int* out) {
    out[threadIdx.x] = __shfl_sync(0x1u, 1, 0);
}

extern "C" __global__ void width_not_power_of_two(int* out) {
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, (int)threadIdx.x, 1, 12);
}
"""
KERNELS = ("block_sum", "warp_scan", "transpose", "transpose_dynamic", "votes", "shuffles", "typed_totals",
           "read_unwritten_dynamic", "returns_before_barrier", "barrier_in_one_branch", "barriers_at_two_places",
           "shuffle_with_exited_lane", "shuffle_against_syncwarp", "mask_without_own_lane",
           "width_not_power_of_two")
TILE_FLOATS = 16 * 17


@pytest.fixture(scope="module")
def cooperative():
    lib = build_host_library(COOPERATIVE_SOURCE, KERNELS, label="executor_test")
    assert lib.mode == "fibers"  # "auto" saw the primitives
    return lib


@pytest.fixture(scope="module")
def sequential():
    return build_host_library(COOPERATIVE_SOURCE, KERNELS, label="executor_test", mode="sequential")


def _block_sum(lib, x, threads=256):
    blocks = (len(x) + threads - 1) // threads
    out = np.zeros(blocks, np.float32)
    lib.launch("block_sum", (blocks, 1, 1), (threads, 1, 1), [x, out, np.int64(len(x))])
    return out


def test_block_reduction_through_shared_memory(cooperative, sequential):
    x = (np.arange(1000) % 17).astype(np.float32)  # integer sums: exact in any order
    expected = np.array([x[i:i + 256].sum() for i in range(0, 1000, 256)], np.float32)
    np.testing.assert_array_equal(_block_sum(cooperative, x), expected)
    tail = x[:200]  # a last block that is mostly padding
    np.testing.assert_array_equal(_block_sum(cooperative, tail, threads=64),
                                  [tail[i:i + 64].sum() for i in range(0, 200, 64)])
    # Alone, thread 0 folds slots the others have not written yet and stores first.
    assert not np.array_equal(_block_sum(sequential, x), expected)


def _warp_scan(lib, x, threads):
    scan = np.zeros_like(x)
    totals = np.zeros((len(x), 3), np.int32)
    lib.launch("warp_scan", (len(x) // threads, 1, 1), (threads, 1, 1), [x, scan, totals])
    return scan, totals


def test_warp_scan_and_reductions_with_shuffles(cooperative, sequential):
    x = np.random.default_rng(0).integers(-50, 50, 256).astype(np.int32)
    warps = x.reshape(-1, 32)
    expected_scan = np.cumsum(warps, axis=1).ravel()
    expected_totals = np.stack([np.repeat(warps.sum(1), 32)] * 2 + [np.repeat(warps[:, 0], 32)], axis=1)
    for threads in (32, 128, 256):
        scan, totals = _warp_scan(cooperative, x, threads)
        np.testing.assert_array_equal(scan, expected_scan)
        np.testing.assert_array_equal(totals, expected_totals)
    # Alone, every shuffle returns the lane's own value.
    scan, totals = _warp_scan(sequential, x, 128)
    assert not np.array_equal(scan, expected_scan)
    assert not np.array_equal(totals, expected_totals)


@pytest.mark.parametrize("kernel", ["transpose", "transpose_dynamic"])
def test_shared_memory_transpose(cooperative, sequential, kernel):
    n = 37  # partial tiles at the edges
    a = torch.randn(n, n, generator=torch.Generator().manual_seed(1))
    shared = TILE_FLOATS * 4 if kernel == "transpose_dynamic" else 0
    for lib, matches in ((cooperative, True), (sequential, False)):
        out = torch.zeros(n, n)
        lib.launch(kernel, (3, 3, 1), (16, 16, 1), [a, out, np.int32(n)], shared_mem=shared)
        # Alone, a thread reads tile cells its neighbours write after it.
        assert torch.equal(out, a.T) is matches


def _votes(lib, predicate, block):
    out = np.zeros((len(predicate), 7), np.uint32)
    lib.launch("votes", (1, 1, 1), block, [predicate, out])
    return out


def _expected_votes(predicate):
    """CUDA's votes, warp by warp (32 consecutive linear thread ids; the last may be partial)."""
    rows, count = [], int(predicate.astype(bool).sum())
    for start in range(0, len(predicate), 32):
        warp = predicate[start:start + 32].astype(bool)
        ballot = sum(1 << j for j, p in enumerate(warp) if p)
        present = (1 << len(warp)) - 1
        row = [int(warp.all()), int(warp.any()), ballot, present, count,
               int(count == len(predicate)), int(count > 0)]
        rows += [row] * len(warp)
    return np.array(rows, np.uint32)


@pytest.mark.parametrize("block", [(96, 1, 1), (69, 1, 1), (8, 4, 3)], ids=["3_warps", "partial_warp", "3d"])
def test_warp_votes(cooperative, sequential, block):
    threads = block[0] * block[1] * block[2]
    predicate = np.ones(threads, np.int32)
    predicate[33] = 0            # warp 1: all false, any true, one bit clear
    predicate[64:] = 0           # warp 2 on: nothing true
    expected = _expected_votes(predicate)
    np.testing.assert_array_equal(_votes(cooperative, predicate, block), expected)
    everywhere = np.ones(threads, np.int32)
    np.testing.assert_array_equal(_votes(cooperative, everywhere, block), _expected_votes(everywhere))
    # Alone, a thread votes only for itself.
    assert not np.array_equal(_votes(sequential, predicate, block), expected)


def _reference_shuffles(width, src, delta, lane_mask):
    """CUDA's documented rules: lanes form segments of ``width``; __shfl_sync
    reads srcLane modulo width in the segment; up/down return the own value
    when the source leaves the segment; xor may read an earlier segment but
    returns the own value for a later one."""
    out = []
    for lane in range(32):
        first = lane & ~(width - 1)
        last = first + width - 1
        idx = first | (src & (width - 1))
        up = lane - delta if lane - delta >= first else lane
        down = lane + delta if lane + delta <= last else lane
        xor = lane ^ (lane_mask & 31)
        out.append([idx, up, down, xor if xor <= last else lane])
    return np.array(out, np.int32)


@pytest.mark.parametrize("width", [32, 16, 8, 4, 2, 1])
@pytest.mark.parametrize("src,delta,lane_mask", [(3, 1, 1), (-1, 5, 6), (45, 16, 16), (0, 33, 31)])
def test_shuffle_widths_and_lanes_outside(cooperative, width, src, delta, lane_mask):
    out = np.zeros((32, 4), np.int32)
    cooperative.launch("shuffles", (1, 1, 1), (32, 1, 1),
                       [out, np.int32(width), np.int32(src), np.uint32(delta), np.int32(lane_mask)])
    np.testing.assert_array_equal(out, _reference_shuffles(width, src, delta, lane_mask))


def test_shuffles_of_every_value_type(cooperative):
    t = torch.arange(64)
    values = [(t % 8).half(), (t % 8).bfloat16(), (t % 8).float(), (t * 1.5).double(), t.long() * 10**12]
    out = torch.zeros(64, 7, dtype=torch.float64)
    cooperative.launch("typed_totals", (1, 1, 1), (64, 1, 1), [*values, out])
    for column, v in enumerate(values):
        expected = v.double().view(2, 32).sum(1).repeat_interleave(32)
        assert torch.equal(out[:, column], expected), column
    half_total = values[0].double().view(2, 32).sum(1).repeat_interleave(32)
    assert torch.equal(out[:, 5], half_total) and torch.equal(out[:, 6], -half_total)


def test_dynamic_shared_memory_starts_as_nan_and_is_bounded(cooperative):
    out = np.zeros(32, np.float32)
    cooperative.launch("read_unwritten_dynamic", (2, 1, 1), (32, 1, 1), [out], shared_mem=128)
    assert np.isnan(out).all()
    with pytest.raises(ValueError, match="shared_mem"):
        cooperative.launch("read_unwritten_dynamic", (1, 1, 1), (32, 1, 1), [out],
                           shared_mem=host_exec.MAX_DYNAMIC_SHARED_BYTES + 1)
    with pytest.raises(ValueError, match="1024"):
        cooperative.launch("block_sum", (1, 1, 1), (1025, 1, 1), [out, out, np.int64(0)])


def test_ucontext_fibers_give_the_same_results():
    """The portable fibers (every architecture but x86-64) on the same kernels."""
    lib = build_host_library(COOPERATIVE_SOURCE, KERNELS, label="executor_test",
                             options=["-DSWIGLU_HOST_UCONTEXT"])
    x = (np.arange(1000) % 17).astype(np.float32)
    np.testing.assert_array_equal(_block_sum(lib, x), [x[i:i + 256].sum() for i in range(0, 1000, 256)])
    xi = np.arange(128, dtype=np.int32)
    scan, _ = _warp_scan(lib, xi, 64)
    np.testing.assert_array_equal(scan, np.cumsum(xi.reshape(-1, 32), axis=1).ravel())


# Runs in a fresh interpreter with a timeout: a hang fails the test, not CI.
_MISUSE_SCRIPT = r"""
import json, sys
import numpy as np
from swiglu_cupy.kernels.host_exec import HostLibrary
lib = HostLibrary(sys.argv[1], sys.argv[2].split(","), "fibers")
errors = {}
for kernel, threads in [("returns_before_barrier", 64), ("barrier_in_one_branch", 64), ("barriers_at_two_places", 64),
                        ("shuffle_with_exited_lane", 32), ("shuffle_against_syncwarp", 32),
                        ("mask_without_own_lane", 32), ("width_not_power_of_two", 32)]:
    try:
        lib.launch(kernel, (2, 1, 1), (threads, 1, 1), [np.zeros(64, np.float32)])
        errors[kernel] = None
    except RuntimeError as exc:
        errors[kernel] = str(exc)
x = np.ones(512, np.float32)  # the executor is usable after a failed launch
out = np.zeros(2, np.float32)
lib.launch("block_sum", (2, 1, 1), (256, 1, 1), [x, out, np.int64(512)])
print(json.dumps({"errors": errors, "after": out.tolist()}))
"""


@pytest.fixture(scope="module")
def misuse_errors(cooperative):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", _MISUSE_SCRIPT, str(cooperative.path), ",".join(KERNELS)],
                          capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["after"] == [256.0, 256.0]
    return result["errors"]


def _line(text):
    """The line of ``text`` in COOPERATIVE_SOURCE (messages name the call's line)."""
    return COOPERATIVE_SOURCE[:COOPERATIVE_SOURCE.index(text)].count("\n") + 1


BARRIER_LINE = _line("__syncthreads();\n    out[threadIdx.x] = s[")
FIRST_BRANCH_LINE, SECOND_BRANCH_LINE = _line("__syncthreads();\n    else"), _line("else __syncthreads")
EXITED_SHUFFLE_LINE = _line("__shfl_down_sync(0xffffffffu, (int)threadIdx.x, 1)")


@pytest.mark.parametrize("kernel,reason", [
    ("returns_before_barrier", r"deadlock in block \(0,0,0\) of 64 threads; 63 threads wait at __syncthreads on "
                               rf"line {BARRIER_LINE}.*"
                               r"1 thread returned \(\(5,0,0\)\)"),
    ("barrier_in_one_branch", r"deadlock .*16 threads wait at __syncthreads.*48 threads returned"),
    ("barriers_at_two_places", rf"thread \(16,0,0\) .*__syncthreads on line {SECOND_BRANCH_LINE} while "
                               rf"thread \(0,0,0\) waits at the one on line {FIRST_BRANCH_LINE} "
                               r"\(a barrier in divergent code\)"),
    ("shuffle_with_exited_lane", rf"deadlock .*31 threads wait at __shfl_down_sync on line "
                                 rf"{EXITED_SHUFFLE_LINE} "
                                 r"\(mask 0xffffffff, warp 0\).*1 thread returned \(\(7,0,0\)\)"),
    ("shuffle_against_syncwarp", r"__syncwarp on line \d+ with mask 0xffffffff in lane 16 while lane 0 of warp 0 "
                                 r"waits at __shfl_xor_sync on line \d+"),
    ("mask_without_own_lane", r"thread \(1,0,0\) .*__shfl_sync on line \d+ with mask 0x00000001, which leaves "
                              r"out the calling lane 1"),
    ("width_not_power_of_two", r"__shfl_xor_sync on line \d+ with width 12: not a power of two"),
])
def test_misuse_ends_with_an_error_naming_the_kernel(misuse_errors, kernel, reason):
    import re

    message = misuse_errors[kernel]
    assert message is not None, f"{kernel} ran without an error"
    assert message.startswith(f"host execution of kernel {kernel!r} failed: "), message
    assert re.search(reason, message), message


HEADER_SOURCE = r"""
#include <cuda_fp16.h>
extern "C" __global__ void halve(const __half* x, float* out, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = 0.5f * __half2float(x[i]);
}
"""


def test_the_library_cache_is_keyed_by_the_headers_contents_not_their_path(tmp_path, monkeypatch):
    """A second install of the same CUDA headers (another venv: CI's floor
    run) reuses a built library; an edited header builds a new one (which
    runs)."""
    from swiglu_cupy.kernels.cuda_headers import cuda_include_dirs

    real = cuda_include_dirs()
    copies = []
    for name in ("a", "b"):
        copy = tmp_path / name / "include"
        shutil.copytree(real[0], copy, ignore=shutil.ignore_patterns("cccl", "cooperative_groups*", "thrust", "cub"))
        copies.append(copy)
    monkeypatch.setenv("SWIGLU_CUPY_HOST_CACHE", str(tmp_path / "cache"))
    builds = []
    real_run = subprocess.run
    monkeypatch.setattr(host_exec.subprocess, "run", lambda cmd, **kw: (
        builds.append(cmd) if "-shared" in cmd else None) or real_run(cmd, **kw))
    libs = []
    for copy in (*copies, copies[1]):
        monkeypatch.setattr(host_exec, "cuda_include_dirs", lambda copy=copy: [copy])
        libs.append(build_host_library(HEADER_SOURCE, ["halve"], label="header_key"))
    assert len(builds) == 1 and libs[0].path == libs[1].path == libs[2].path  # built once, at a
    assert f"-I{copies[0]}" in builds[0]
    (copies[1] / "cuda_fp16.hpp").write_text((copies[1] / "cuda_fp16.hpp").read_text()
                                             + "\n#define SWIGLU_EDITED_HEADER 1\n")
    host_exec.included_headers_digest.cache_clear()  # a process sees its headers as they were: a new one
    edited = build_host_library(HEADER_SOURCE, ["halve"], label="header_key")
    assert len(builds) == 2 and edited.path != libs[0].path and f"-I{copies[1]}" in builds[1]
    x = torch.tensor([1.0, -3.0, 0.25], dtype=torch.float16)
    out = torch.empty(3)
    edited.launch("halve", (1, 1, 1), (32, 1, 1), (x.data_ptr(), out.data_ptr(), np.int64(3)))
    assert out.tolist() == [0.5, -1.5, 0.125]


def test_auto_mode_keeps_the_sequential_path_for_kernels_that_never_cooperate():
    assert execution_mode(COOPERATIVE_SOURCE) == "fibers"
    assert execution_mode("__global__ void k(float* y) { y[threadIdx.x] = 1; }") == "sequential"
    for dtype in (torch.float16, torch.float64):  # kernels_cu: the 8-bit kernels' lanes shuffle
        assert execution_mode(host_exec.host_source(dtype)) == "fibers"
    with pytest.raises(ValueError, match="mode"):
        execution_mode(COOPERATIVE_SOURCE, "threads")


def test_the_kernels_run_the_same_as_fibers():
    """kernels_cu's kernels that never cooperate (all but the 8-bit ones)
    give bit-identical outputs built for fibers (as "auto" builds kernels_cu)
    and built sequential."""
    from swiglu_cupy.kernels.sources import VARIANTS, compile_options, kernel_names
    from swiglu_cupy.primitives import cuda_impl

    dtype = torch.float32
    names = [n for v in VARIANTS for n in kernel_names(v, dtype)]
    defines = [o for o in compile_options(dtype) if o.startswith("-D")]
    sequential = build_host_library(host_exec.host_source(dtype), names, options=defines, mode="sequential",
                                    label="kernels_float32_sequential")
    assert sequential.mode == "sequential" and host_exec.build_library(dtype).mode == "fibers"

    class SequentialLauncher(host_exec.HostLauncher):
        def _library(self, d):
            return sequential

    x12 = torch.randn(33, 2 * 300, generator=torch.Generator().manual_seed(2))
    dh = torch.randn(33, 300, generator=torch.Generator().manual_seed(3))
    outputs = []
    for launcher in (host_exec.HostLauncher(), SequentialLauncher()):  # straight to the kernels: the
        # first-use check would fail the sequential build (its 8-bit kernels need their shuffles)
        outputs.append([cuda_impl.launch_swiglu_forward(x12, None, launcher=launcher),
                        *cuda_impl.launch_swiglu_backward(x12, dh, None, launcher=launcher)])
    for as_fibers, sequentially in zip(*outputs):
        assert torch.equal(as_fibers, sequentially)


def test_kernel_arguments_are_packed_as_a_gpu_launch_passes_them():
    """ints (pointers) as CuPy's 8 bytes, numpy scalars at their width; a
    bool or a float, which CuPy would pass at another width, is refused."""
    import ctypes

    for value in (0, 4096, 0x7F00_0000_1000, 2**63):
        held = host_exec._kernel_argument(value)
        assert ctypes.sizeof(held) == 8 and bytes(held) == np.uint64(value).tobytes()
    assert bytes(host_exec._kernel_argument(-2)) == np.int64(-2).tobytes()
    assert bytes(host_exec._kernel_argument(np.float32(1.5))) == np.float32(1.5).tobytes()
    for bad in (True, 1.5):
        with pytest.raises(TypeError, match="kernel arguments must be ints"):
            host_exec._kernel_argument(bad)
    with pytest.raises(OverflowError):
        host_exec._kernel_argument(2**64)
