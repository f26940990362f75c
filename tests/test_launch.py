"""The CuPy launcher's caching, locking and fallback, without a GPU."""
import threading
import time
import types
import warnings

import numpy as np
import pytest
import torch

from swiglu_cupy import primitives
from swiglu_cupy.kernels import launch as _launch
from swiglu_cupy.kernels.sources import kernel_names


def test_concurrent_first_calls_compile_once(monkeypatch):
    launcher = _launch.CupyLauncher()
    loads = []

    def slow_load(name, dtype, device_index):
        loads.append((name, dtype, device_index))
        time.sleep(0.05)
        return object()

    monkeypatch.setattr(launcher, "_load", slow_load)
    barrier = threading.Barrier(8)
    results = []

    def first_call():
        barrier.wait()
        results.append(launcher.function("swiglu_forward_vec_p1", torch.bfloat16, 0))

    threads = [threading.Thread(target=first_call) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert loads == [("swiglu_forward_vec_p1", torch.bfloat16, 0)]
    assert len({id(r) for r in results}) == 1
    launcher.function("swiglu_forward_vec_p1", torch.float16, 0)  # another dtype: its own entry
    assert len(loads) == 2


class _FakeCupy:
    """Records what the launcher asks of CuPy (the real one needs a driver)."""

    def __init__(self):
        self.calls = []
        fake = self

        class Device:
            def __init__(self, index):
                self.index = index

            def __enter__(self):
                fake.calls.append(("device", self.index))

            def __exit__(self, *exc):
                return False

        class RawModule:
            def __init__(self, code, options):
                fake.calls.append(("module", options))

            def get_function(self, name):
                kernel = lambda grid, block, args, stream=None: fake.calls.append(("launch", name, grid, block, args, stream))  # noqa: E731
                return types.SimpleNamespace(kernel=kernel)

        class Stream:
            @staticmethod
            def from_external(obj):
                version, handle = obj.__cuda_stream__()
                fake.calls.append(("stream", version, handle))
                return types.SimpleNamespace(ptr=handle)

        self.current_device = 0  # what cudaGetDevice answers
        self.RawModule = RawModule
        self.cuda = types.SimpleNamespace(Device=Device, Stream=Stream,
                                          runtime=types.SimpleNamespace(getDevice=lambda: fake.current_device))


def test_launch_uses_current_torch_stream_and_device(monkeypatch):
    fake = _FakeCupy()
    monkeypatch.setattr(_launch, "import_cupy", lambda: fake)
    monkeypatch.setattr(_launch, "current_raw_stream", lambda index: 1234)
    launcher = _launch.CupyLauncher()
    args = [np.uint64(16), np.int64(3)]
    for _ in range(2):
        launcher.launch("swiglu_backward_scalar_p1", torch.float32, torch.device("cuda", 1), (1, 2, 1), (32, 8, 1), args)
    kinds = [c[0] for c in fake.calls]
    assert kinds.count("module") == 1 and kinds.count("stream") == 1 and kinds.count("launch") == 2
    assert launcher.compile_count == 1
    launch = [c for c in fake.calls if c[0] == "launch"][-1]
    assert launch[1:5] == ("swiglu_backward_scalar_p1", (1, 2, 1), (32, 8, 1), tuple(args))
    assert launch[5].ptr == 1234
    assert ("device", 1) in fake.calls
    assert ("module", ("--std=c++17", "-ftz=true", "-DSWIGLU_MAX_THREADS_PER_BLOCK=512", "-DSWIGLU_FP8_SAVED_X12=1",
                       "-DSWIGLU_FP8_LANE_PACKS=2", "-DSWIGLU_SCALAR=float")) in fake.calls


def test_launch_on_the_current_device_enters_no_device_context(monkeypatch):
    """The usual call (the tensor's device is current) launches directly; the
    stream follows torch's current one at every call (a changed stream between
    calls gets its own CuPy stream object, made once)."""
    fake = _FakeCupy()
    monkeypatch.setattr(_launch, "import_cupy", lambda: fake)
    handle = [11]
    monkeypatch.setattr(_launch, "current_raw_stream", lambda index: handle[0])
    launcher = _launch.CupyLauncher()
    fake.current_device = 2
    for stream in (11, 11, 12, 11):
        handle[0] = stream
        launcher.launch("swiglu_forward_vec_p1", torch.bfloat16, torch.device("cuda", 2), (1, 1, 1), (32, 1, 1),
                        (np.uint64(0),))
    launches = [c for c in fake.calls if c[0] == "launch"]
    assert [c[5].ptr for c in launches] == [11, 11, 12, 11]
    assert [c for c in fake.calls if c[0] == "stream"] == [("stream", 0, 11), ("stream", 0, 12)]
    assert [c for c in fake.calls if c[0] == "device"] == [("device", 2)]  # loading the module only


def test_each_glu_variant_compiles_its_own_module_on_first_use(monkeypatch):
    """One RawModule per (device, dtype, variant), built from that variant's
    source; a second kernel of the same variant reuses it."""
    from swiglu_cupy.kernels import sources as _sources
    from swiglu_cupy.activations import GPT_OSS

    fake = _FakeCupy()
    sources = []
    real_module = fake.RawModule
    fake.RawModule = lambda code, options: sources.append(code) or real_module(code=code, options=options)
    monkeypatch.setattr(_launch, "import_cupy", lambda: fake)
    monkeypatch.setattr(_launch, "current_raw_stream", lambda index: 7)
    launcher = _launch.CupyLauncher()
    oai = _sources.kernel_variant(GPT_OSS)
    for name in ("swiglu_forward_vec_p1", "glu_forward_oai_clamp_pairs_vec_p1", "glu_backward_oai_clamp_pairs_scalar_p4",
                 "swiglu_backward_vec_p1"):
        launcher.launch(name, torch.bfloat16, torch.device("cuda", 0), (1, 1, 1), (32, 1, 1), [])
    assert launcher.compile_count == 2
    assert sources == [_sources.module_source(), _sources.module_source(oai)]
    with pytest.raises(ValueError, match="unknown kernel"):
        launcher.launch("glu_forward_swish_vec_p1", torch.bfloat16, torch.device("cuda", 0), (1, 1, 1), (32, 1, 1), [])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_the_compile_check_builds_what_the_loader_builds(monkeypatch, dtype):
    """The machine-code checks read ``compile_check``'s cubins: it must hand
    NVRTC the loader's source and options (CuPy's ``-ftz=true`` included),
    adding only the arch and ptxas' report, or the checks prove properties of
    code that never runs."""
    from swiglu_cupy.activations import GPT_OSS
    from swiglu_cupy.kernels import compile_check
    from swiglu_cupy.kernels import sources as _sources

    fake = _FakeCupy()
    loaded = []
    fake.RawModule = lambda code, options: loaded.append((code, options)) or types.SimpleNamespace(
        get_function=lambda name: types.SimpleNamespace(kernel=None))
    monkeypatch.setattr(_launch, "import_cupy", lambda: fake)
    checked = []

    def record(source, options, label):
        checked.append((source, options))
        return {"k": (1, 0, 0, 0)}, b"", "", 0.0

    monkeypatch.setattr(compile_check, "_compile", record)
    for variant in (_sources.DEFAULT_VARIANT, _sources.kernel_variant(GPT_OSS)):
        name = _sources.kernel_names(variant)[0]
        _launch.CupyLauncher().function(name, dtype, 0)
        compile_check.compile_module(dtype, "sm_90", variant)
    assert len(loaded) == len(checked) == 2
    for (code, options), (source, check_options) in zip(loaded, checked):
        assert source == code
        assert list(check_options) == [*options, "--gpu-architecture=sm_90", "-Xptxas=-v"]
        assert "-ftz=true" in options  # what CuPy's RawModule adds to every compile, and runs


def test_missing_cupy_falls_back_with_one_warning_naming_the_fix(monkeypatch):
    def no_cupy():
        raise _launch.CudaUnavailableError("no module named cupy")

    monkeypatch.setattr(_launch, "import_cupy", no_cupy)
    monkeypatch.setattr(_launch, "_fallback_warned", False)
    monkeypatch.delenv("SWIGLU_CUPY_STRICT", raising=False)
    with pytest.warns(RuntimeWarning, match=r"swiglu-cupy\[cuda12\]"):
        assert _launch.cuda_kernels_available() is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _launch.cuda_kernels_available() is False  # warned once only
    monkeypatch.setenv("SWIGLU_CUPY_STRICT", "1")
    with pytest.raises(_launch.CudaUnavailableError, match="cuda13"):
        _launch.cuda_kernels_available()


def test_cpu_tensors_never_touch_cupy(monkeypatch):
    def boom():
        raise AssertionError("CuPy imported for a CPU tensor")

    monkeypatch.setattr(_launch, "import_cupy", boom)
    x12 = torch.randn(3, 8)
    assert primitives.swiglu_forward(x12).shape == (3, 4)


def test_warmup_loads_every_kernel_before_capture(monkeypatch):
    fake = _FakeCupy()
    monkeypatch.setattr(_launch, "import_cupy", lambda: fake)
    monkeypatch.setattr(_launch, "_cupy_launcher", _launch.CupyLauncher())
    monkeypatch.setattr(_launch, "current_raw_stream", lambda index: 7)
    assert _launch.warmup("cuda:0", dtypes=(torch.bfloat16, torch.float32)) == 2 * len(kernel_names())
    assert _launch.cupy_launcher().compile_count == 2  # one module per (device, dtype)
    with pytest.raises(ValueError, match="device must be a CUDA device"):
        _launch.warmup("cpu")


def test_unwritable_kernel_cache_falls_back_to_memory(monkeypatch):
    import os

    fake = _FakeCupy()
    real_module = fake.RawModule

    class CacheFailingModule(real_module):
        """Like RawModule: compiles (and writes the disk cache) on first use."""
        compiled = False

        def get_function(self, name):
            if not self.compiled:
                if os.environ.get("CUPY_CACHE_IN_MEMORY") != "1":
                    raise PermissionError(13, "Permission denied", "/nonexistent/kernel_cache")
                self.compiled = True
            return super().get_function(name)

    fake.RawModule = CacheFailingModule
    monkeypatch.setattr(_launch, "import_cupy", lambda: fake)
    monkeypatch.delenv("CUPY_CACHE_IN_MEMORY", raising=False)
    launcher = _launch.CupyLauncher()
    with pytest.warns(RuntimeWarning, match="CUPY_CACHE_DIR"):
        kernel = launcher.function("swiglu_forward_vec_p1", torch.float32, 0)
    assert kernel is not None
    assert "CUPY_CACHE_IN_MEMORY" not in os.environ  # restored
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        launcher.function("swiglu_forward_scalar_p1", torch.float32, 0)  # module reused, no new warning


def test_unknown_kernel_name_is_rejected(monkeypatch):
    monkeypatch.setattr(_launch, "import_cupy", lambda: _FakeCupy())
    with pytest.raises(ValueError, match="unknown kernel"):
        _launch.CupyLauncher().function("swiglu_sideways", torch.float32, 0)


def test_eight_threads_first_call_compile_once_and_compute_correctly(monkeypatch, host_launcher):
    """The real CupyLauncher (cache, lock, launch path) with a CuPy stand-in
    whose 'compiled kernels' are the host-executed kernels: 8 threads race on
    the first call; one module is built per dtype and every result is right."""
    compiles = []

    class HostBackedModule:
        def __init__(self, code, options):
            time.sleep(0.05)  # widen the race window
            compiles.append(options)
            self.dtype = {"__half": torch.float16, "__nv_bfloat16": torch.bfloat16,
                          "float": torch.float32, "double": torch.float64}[options[-1].split("=")[1]]

        def get_function(self, name):
            def kernel(grid, block, args, stream=None):
                host_launcher.launch(name, self.dtype, torch.device("cpu"), grid, block, args)
            return types.SimpleNamespace(kernel=kernel)

    fake = _FakeCupy()
    fake.RawModule = HostBackedModule
    monkeypatch.setattr(_launch, "import_cupy", lambda: fake)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(_launch, "current_raw_stream", lambda index: 5)
    launcher = _launch.CupyLauncher()
    barrier = threading.Barrier(8)
    failures = []

    def worker(i):
        try:
            dtype = (torch.bfloat16, torch.float32)[i % 2]
            x12 = torch.randn(7 + i, 2 * (16 + i)).to(dtype)
            dh = torch.randn(7 + i, 16 + i).to(dtype)
            barrier.wait()
            h = primitives.swiglu_forward(x12, launcher=launcher)
            dx12, _ = primitives.swiglu_backward(x12, dh, launcher=launcher)
            ref_dx12, ref_h = primitives.swiglu_backward(x12, dh, implementation="torch")
            torch.testing.assert_close(h, ref_h, rtol=2**-7, atol=1e-6)
            torch.testing.assert_close(dx12, ref_dx12, rtol=2**-7, atol=1e-5)
        except BaseException as exc:  # reported by the main thread
            failures.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not failures, failures
    assert sorted(o[-1] for o in compiles) == ["-DSWIGLU_SCALAR=__nv_bfloat16", "-DSWIGLU_SCALAR=float"]
    assert launcher.compile_count == 2


def test_info_command_explains_the_state():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "swiglu_cupy", "info"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for key in ("swiglu_cupy", "torch", "cupy", "nvrtc", "kernel_sources", "cupy_cache_dir", "cuda_path"):
        assert key in proc.stdout


def test_info_without_cupy_names_the_fix(monkeypatch):
    from swiglu_cupy.tools import info

    def no_cupy():
        raise _launch.CudaUnavailableError("x") from ImportError("No module named 'cupy'")

    monkeypatch.setattr(info, "import_cupy", no_cupy)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.delenv("SWIGLU_CUPY_STRICT", raising=False)
    state = info.collect()
    assert state["cupy"] is None and "No module named 'cupy'" in state["cupy_error"]
    assert "fall back" in state["cuda_path"] and "swiglu-cupy[cuda13]" in state["cuda_path"]


def test_unloadable_nvrtc_falls_back_like_missing_cupy(monkeypatch):
    """NVRTC that cannot load is caught when CuPy is first needed, not at the first compile."""
    from cupy_backends.cuda.libs import nvrtc

    def broken():
        raise OSError("libnvrtc.so.13: cannot open shared object file")

    monkeypatch.setattr(nvrtc, "getVersion", broken)
    monkeypatch.setattr(_launch, "_fallback_warned", False)
    monkeypatch.delenv("SWIGLU_CUPY_STRICT", raising=False)
    _launch.import_cupy.cache_clear()
    try:
        with pytest.raises(_launch.CudaUnavailableError, match="NVRTC.*libnvrtc"):
            _launch.import_cupy()
        with pytest.warns(RuntimeWarning, match=r"swiglu-cupy\[cuda12\]"):
            assert _launch.cuda_kernels_available() is False
    finally:
        _launch.import_cupy.cache_clear()


def test_launch_config_validation_names_the_field():
    from swiglu_cupy.kernels.launch_config import LaunchConfig

    for kwargs, match in [({"packs_per_thread": 3}, "packs_per_thread must be one of the compiled"),
                          ({"packs_per_thread": True}, "packs_per_thread"),
                          ({"threads_per_block": 100}, "threads_per_block must be a multiple of 32"),
                          ({"threads_per_block": 1024}, "threads_per_block must be a multiple of 32 in \\[32, 512\\]"),
                          ({"grid_waves": 0}, "grid_waves must be None or a positive int")]:
        with pytest.raises(ValueError, match=match):
            LaunchConfig(**kwargs)
    assert LaunchConfig(2, 128, 4).max_blocks(sm_count=132) == 4 * 132 * (2048 // 128)
    assert LaunchConfig().max_blocks(sm_count=132) is None


def test_using_launch_config_is_scoped_and_per_thread(host_launcher):
    from swiglu_cupy.kernels.launch_config import DEFAULT_LAUNCH, LaunchConfig, current_launch_config, using_launch_config

    config = LaunchConfig(4, 128, 1)
    seen_elsewhere = []
    with using_launch_config(config):
        assert current_launch_config() == config
        worker = threading.Thread(target=lambda: seen_elsewhere.append(current_launch_config()))
        worker.start()
        worker.join()
        host_launcher.launches.clear()
        primitives.swiglu_forward(torch.randn(3, 16), launcher=host_launcher)
        assert host_launcher.launches[-1][0] == "swiglu_forward_vec_p4"
        assert host_launcher.launches[-1][2] == (32, 4, 1)
    assert current_launch_config() == DEFAULT_LAUNCH and seen_elsewhere == [DEFAULT_LAUNCH]
    with pytest.raises(TypeError, match="config must be a LaunchConfig"):
        with using_launch_config((4, 128, 1)):
            pass


def test_sm_count_is_read_once_per_cuda_device(monkeypatch):
    from swiglu_cupy.primitives import cuda_impl as kernels

    calls = []

    def properties(index):
        calls.append(index)
        return types.SimpleNamespace(multi_processor_count=132)

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    kernels._cuda_sm_count.cache_clear()
    try:
        assert kernels.sm_count(torch.device("cuda", 3)) == 132
        assert kernels.sm_count(torch.device("cuda", 3)) == 132
        assert calls == [3]
        assert kernels.sm_count(torch.device("cpu")) == kernels.HOST_SM_COUNT
    finally:
        kernels._cuda_sm_count.cache_clear()


def test_launch_plans_are_cached_by_identity_and_bounded():
    """One plan per spec and config object, built once; a caller that makes a
    new (equal) spec per call gets equal plans, and the cache stays bounded."""
    from swiglu_cupy.activations import GLUActivation
    from swiglu_cupy.kernels.launch_config import LaunchConfig
    from swiglu_cupy.primitives import cuda_impl

    spec, config = GLUActivation("silu", limit=7.0), LaunchConfig(2, 128, None)
    plan = cuda_impl.launch_plan("swiglu_forward", spec, torch.bfloat16, config)
    assert cuda_impl.launch_plan("swiglu_forward", spec, torch.bfloat16, config) is plan
    assert plan.names == ("glu_forward_silu_clamp_scalar_p2", "glu_forward_silu_clamp_vec_p2")
    assert (plan.vec, plan.itemsize, plan.config, plan.capped) == (8, 2, config, False)
    assert [float(a) for a in plan.scalar_args[:3]] == [7.0, 1.0, 0.0]
    for _ in range(3 * cuda_impl._MAX_PLANS):
        fresh = cuda_impl.launch_plan("swiglu_forward", GLUActivation("silu", limit=7.0), torch.bfloat16, config)
        assert fresh.names == plan.names and fresh.scalar_args == plan.scalar_args
    assert len(cuda_impl._PLANS) <= cuda_impl._MAX_PLANS


def test_row_launches_cache_shape_arguments_and_still_check_each_pointer():
    """A row launch's shape arguments, instance and grid are kept per (M, H,
    row strides, device); each call's pointers still pick the instance (a
    misaligned one: the 1-element instance) and travel as 64-bit values."""
    import numpy as np

    from swiglu_cupy.activations import SILU
    from swiglu_cupy.primitives import cuda_impl

    class Recording:
        def __init__(self):
            self.launches = []

        def launch(self, name, dtype, device, grid, block, args):
            assert (dtype, device) == (torch.float32, cpu)  # the plan's dtype, the device as given
            self.launches.append((name, grid, block, args))

    plan = cuda_impl.launch_plan("swiglu_forward", SILU, torch.float32, None)
    recorder, cpu = Recording(), torch.device("cpu")
    plan.rows.clear()
    for gate in (4096, 4100, 8192):  # aligned, misaligned, aligned again: one cached entry
        plan.launch_rows(recorder, cpu, 3, 64, (gate, 65536, 131072), (128, 128, 64))
    plan.launch_rows(recorder, cpu, 3, 64, (4096, 65536, 131072), (130, 128, 64))  # a stride of 130: never wide
    plan.launch_rows(recorder, cpu, 0, 64, (4096, 65536, 131072), (128, 128, 64))  # nothing to do
    names = [name for name, *_ in recorder.launches]
    assert names == [plan.names[1], plan.names[0], plan.names[1], plan.names[0]]
    assert len(plan.rows) == 2
    first, misaligned = recorder.launches[0], recorder.launches[1]
    assert [type(a) for a in first[3][:5]] == [int] * 3 + [np.int64] * 2  # pointers as given (see below)
    assert [int(a) for a in first[3][:8]] == [4096, 65536, 131072, 3, 64, 128, 128, 64]
    sms = cuda_impl.sm_count(cpu) if plan.capped else 0
    assert int(misaligned[3][0]) == 4100 and misaligned[1:3] == cuda_impl.launch_shape(3, 64, 1, plan.config, sms)
    assert first[1:3] == cuda_impl.launch_shape(3, 64, plan.vec, plan.config, sms)
    assert first[3][8:] == plan.scalar_args


def test_pointers_travel_as_ints_which_cupy_passes_as_their_eight_bytes():
    """A data pointer is a kernel argument as a Python int (no numpy scalar
    made per launch). CuPy's own rule (``numpy_dtype_from_pyscalar``, what its
    launch packs an int as) gives 8 bytes, the pointer's bits, which is what
    ``kernel_argument_bytes`` (the host launcher's and the machine-code
    model's packing) says; a value that fits no 8 bytes or is no int raises."""
    import numpy as np

    cupy_scalar = pytest.importorskip("cupy._core._scalar")
    t = torch.empty(3)
    assert _launch.pointer(t).__class__ is int and _launch.pointer(t) == t.data_ptr()
    for value in (0, 16, 4100, 0x7F12_3456_7890, 2**63 - 1, 2**63, 2**64 - 1, -5):
        dtype, _ = cupy_scalar.numpy_dtype_from_pyscalar(value)
        assert dtype.itemsize == 8
        assert np.array(value, dtype=dtype).tobytes() == _launch.kernel_argument_bytes(value)
        assert _launch.kernel_argument_bytes(value) == np.array(value % 2**64, dtype=np.uint64).tobytes()
    for value, error in ((2**64, OverflowError), (-(2**63) - 1, OverflowError), (True, TypeError),
                         (np.uint64(3), TypeError), (3.0, TypeError)):
        with pytest.raises(error):
            _launch.kernel_argument_bytes(value)
