"""Kernel sources: location, include inlining and cache-key freshness."""
import torch

from swiglu_cupy import _sources


def test_local_headers_are_inlined():
    for filename in _sources.KERNEL_FILES:
        src = _sources.expanded_source(filename)
        assert '#include "' not in src
        assert "typedef SWIGLU_SCALAR scalar_t;" in src
        assert src.startswith("// swiglu-cupy ")


def test_kernel_registry():
    owners = _sources.kernel_file_of()
    assert owners == {
        "swiglu_forward_vec": "swiglu_forward.cu", "swiglu_forward_scalar": "swiglu_forward.cu",
        "swiglu_backward_vec": "swiglu_backward.cu", "swiglu_backward_scalar": "swiglu_backward.cu",
    }


def test_editing_a_header_changes_the_compiled_source(tmp_path, monkeypatch):
    """CuPy's disk cache keys on the source string: a header edit must change it."""
    for name in ("swiglu_common.cuh", *_sources.KERNEL_FILES):
        (tmp_path / name).write_text((_sources.kernel_dir() / name).read_text())
    monkeypatch.setattr(_sources, "_CANDIDATE_DIRS", (tmp_path,))
    _sources.expanded_source.cache_clear()
    try:
        before = _sources.expanded_source("swiglu_forward.cu")
        header = tmp_path / "swiglu_common.cuh"
        header.write_text(header.read_text() + "\n// edited\n")
        _sources.expanded_source.cache_clear()
        after = _sources.expanded_source("swiglu_forward.cu")
        assert before != after and "// edited" in after
    finally:
        _sources.expanded_source.cache_clear()


def test_options_differ_per_dtype_and_vector_widths():
    opts = {d: _sources.compile_options(d) for d in _sources.SUPPORTED_DTYPES}
    assert len(set(opts.values())) == 4
    assert "-DSWIGLU_SCALAR=__nv_bfloat16" in opts[torch.bfloat16]
    assert [_sources.vector_width(d) for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64)] == [8, 8, 4, 2]
