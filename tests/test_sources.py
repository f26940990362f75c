"""Kernel sources: location, include inlining and cache-key freshness."""
import torch

from swiglu_cupy.kernels import sources as _sources


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
    from swiglu_cupy.kernels.launch_config import LAUNCH_CANDIDATES

    packs = sorted({c.packs_per_thread for c in LAUNCH_CANDIDATES})
    assert packs == [1, 2, 4]
    expected = {f"swiglu_{kind}_{width}_p{p}" for kind in ("forward", "backward")
                for width in ("vec", "scalar") for p in packs}
    fp8 = {f"swiglu_{kind}_fp8_{width}_p{p}" for kind in ("forward", "backward")
           for width in ("vec", "scalar") for p in packs}  # vec: 4 elements per access
    assert set(_sources.kernel_names()) == expected | fp8
    assert all(f"GLU_{n.split('_')[1].upper()}_FP8_ENTRY({n}," in _sources.module_source() for n in fp8)
    src = _sources.module_source()
    for name in expected:
        kind = name.split("_")[1].upper()
        assert f"GLU_{kind}_ENTRY({name}, glu_silu_t, " in src
    assert "typedef Glu<SiluAct, false> glu_silu_t;" in src
    lines = src.splitlines()
    for name in fp8:  # stamped out only where the dtype can save x12 in 8 bits (not float64)
        at = next(i for i, line in enumerate(lines) if f"_FP8_ENTRY({name}," in line)
        assert [line for line in lines[:at] if line.startswith(("#if", "#endif"))][-1] == "#if SWIGLU_FP8_SAVED_X12"
    for dtype in _sources.SUPPORTED_DTYPES:
        names = set(_sources.kernel_names(_sources.DEFAULT_VARIANT, dtype))
        assert names == (expected if dtype == torch.float64 else expected | fp8), dtype


def test_every_variant_is_its_own_module_with_its_own_names():
    """7 kinds x clamp x layout, 24 entry points each, names unique across
    modules (the loader finds a kernel's module by its name)."""
    from swiglu_cupy.activations import GPT_OSS, KINDS, deepseek_v4

    assert len(_sources.VARIANTS) == len(KINDS) * 2 * 2 and _sources.VARIANTS[0] == _sources.DEFAULT_VARIANT
    names = [n for v in _sources.VARIANTS for n in _sources.kernel_names(v)]
    assert len(names) == len(set(names)) == 24 * len(_sources.VARIANTS)
    oai = _sources.kernel_variant(GPT_OSS)
    assert oai == ("oai", True, True) and _sources.kernel_variant(deepseek_v4(10.0)) == ("silu", True, False)
    src = _sources.module_source(oai)
    assert "typedef Glu<OaiAct, true> glu_oai_clamp_t;" in src
    assert "GLU_BACKWARD_PAIRS_ENTRY(glu_backward_oai_clamp_pairs_vec_p4, glu_oai_clamp_t, SWIGLU_VEC_WIDTH, 4)" in src
    assert _sources.variant_of_kernel("glu_forward_gelu_tanh_scalar_p2") == ("gelu_tanh", False, False)
    assert _sources.variant_of_kernel("swiglu_forward_vec_p1") == _sources.DEFAULT_VARIANT
    # The text differs per variant only in its entry points; each is self-contained.
    assert src != _sources.module_source() and '#include "' not in src


def test_editing_a_header_changes_the_compiled_source(tmp_path, monkeypatch):
    """CuPy's disk cache keys on the source string: a header edit must change it."""
    for name in (*_sources.KERNEL_HEADERS, *_sources.KERNEL_FILES):
        (tmp_path / name).write_text((_sources.kernel_dir() / name).read_text())
    monkeypatch.setattr(_sources, "_CANDIDATE_DIRS", (tmp_path,))
    _sources.clear_source_cache()
    try:
        before = _sources.module_source()
        for header_name in _sources.KERNEL_HEADERS:
            header = tmp_path / header_name
            header.write_text(header.read_text() + f"\n// edited {header_name}\n")
            _sources.clear_source_cache()
            after = _sources.module_source()
            assert before != after and f"// edited {header_name}" in after
            before = after
    finally:
        _sources.clear_source_cache()


def test_options_differ_per_dtype_and_vector_widths():
    opts = {d: _sources.compile_options(d) for d in _sources.SUPPORTED_DTYPES}
    assert len(set(opts.values())) == 4
    assert "-DSWIGLU_SCALAR=__nv_bfloat16" in opts[torch.bfloat16]
    # float64 refuses saved_x12="fp8": its modules leave the 8-bit kernels out
    assert {d: "-DSWIGLU_FP8_SAVED_X12=1" in o for d, o in opts.items()} == {
        torch.float16: True, torch.bfloat16: True, torch.float32: True, torch.float64: False}
    assert all(("-DSWIGLU_FP8_SAVED_X12=0" in o) != ("-DSWIGLU_FP8_SAVED_X12=1" in o) for o in opts.values())
    assert [_sources.vector_width(d) for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64)] == [8, 8, 4, 2]
    # The 8-bit kernels' lane geometry reaches NVRTC and g++ from the one constant the host counts lanes by.
    assert all(f"-DSWIGLU_FP8_LANE_PACKS={_sources.FP8_LANE_PACKS}" in o for o in opts.values())
    assert [_sources.fp8_lane_columns(d) for d in (torch.float16, torch.bfloat16, torch.float32)] == [16, 16, 8]


def test_paired_math_kinds_are_the_kinds_the_cuda_pairs():
    """``PAIRED_MATH_KINDS`` restates each functor's ``kPaired`` flag in
    glu_activations.cuh (the machine-code check requires paired instructions
    for these kinds): both directions must agree, so a kind paired in CUDA
    but not listed cannot go unchecked."""
    import re

    text = _sources.kernel_files_source()
    paired = set()
    for kind, functor in _sources._ACT_FUNCTOR.items():
        found = re.search(r"struct " + functor + r"\b[^{]*\{(?:\s*//[^\n]*)?\s*static constexpr bool kPaired = (true|false);", text)
        assert found, f"{functor} declares no kPaired first in its body"
        if found.group(1) == "true":
            paired.add(kind)
    assert paired == set(_sources.PAIRED_MATH_KINDS)
