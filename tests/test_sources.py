"""Kernel sources: location, include inlining and cache-key freshness."""
import torch

from swiglu_cupy import _sources


def test_local_headers_are_inlined_once():
    src = _sources.module_source()
    assert '#include "' not in src
    assert src.count("typedef SWIGLU_SCALAR scalar_t;") == 1
    assert src.startswith("// swiglu-cupy ")
    for filename in _sources.KERNEL_FILES:
        assert f"// ==== {filename} ====" in src


def test_kernel_names_cover_every_packs_per_thread_candidate():
    """One entry point per kind x access width x compiled packs-per-thread,
    each stamped out in the source (NVRTC proves they exist: test_compile_check)."""
    from swiglu_cupy.launch_config import LAUNCH_CANDIDATES

    packs = sorted({c.packs_per_thread for c in LAUNCH_CANDIDATES})
    assert packs == [1, 2, 4]
    expected = {f"swiglu_{kind}_{width}_p{p}" for kind in ("forward", "backward")
                for width in ("vec", "scalar") for p in packs}
    assert set(_sources.kernel_names()) == expected
    src = _sources.module_source()
    for name in expected:
        kind = name.split("_")[1].upper()
        assert f"SWIGLU_{kind}_ENTRY({name}, " in src


def test_editing_a_header_changes_the_compiled_source(tmp_path, monkeypatch):
    """CuPy's disk cache keys on the source string: a header edit must change it."""
    for name in ("swiglu_common.cuh", *_sources.KERNEL_FILES):
        (tmp_path / name).write_text((_sources.kernel_dir() / name).read_text())
    monkeypatch.setattr(_sources, "_CANDIDATE_DIRS", (tmp_path,))
    _sources.module_source.cache_clear()
    try:
        before = _sources.module_source()
        header = tmp_path / "swiglu_common.cuh"
        header.write_text(header.read_text() + "\n// edited\n")
        _sources.module_source.cache_clear()
        after = _sources.module_source()
        assert before != after and "// edited" in after
    finally:
        _sources.module_source.cache_clear()


def test_options_differ_per_dtype_and_vector_widths():
    opts = {d: _sources.compile_options(d) for d in _sources.SUPPORTED_DTYPES}
    assert len(set(opts.values())) == 4
    assert "-DSWIGLU_SCALAR=__nv_bfloat16" in opts[torch.bfloat16]
    assert [_sources.vector_width(d) for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64)] == [8, 8, 4, 2]
