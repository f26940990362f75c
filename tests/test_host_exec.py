"""Layer 1, kernel implementation: the kernels_cu sources executed on the CPU
(g++ host build) through the same Python launch path the GPU uses, compared
with the torch implementation of the same contract."""
import pytest
import torch

import swiglu_cupy
from swiglu_cupy import primitives, reference
from swiglu_cupy.kernels.sources import VARIANTS, kernel_name, kernel_variant, variant_of_kernel
from swiglu_cupy.activations import GPT_OSS, SILU as SILU_SPEC
from swiglu_cupy.kernels.launch_config import (DEFAULT_LAUNCH, LAUNCH_CANDIDATES, LaunchConfig, is_probing,
                                              using_launch_config)
from swiglu_cupy.primitives import cuda_impl as kernels
from conftest import (DTYPES_ALL, assert_nontrivial, elementwise_error_bounds, glu_error_bounds,
                      primitives_on_host_kernels, rel_rms, spec_of_variant, swiglu_fp64_reference)

def _check(x12, dh, h=None, dx12=None):
    """Kernel outputs against the torch implementation: both round one
    fp32 (fp64) result once, and differ only where exp/sigmoid differ in the
    last bit of the math dtype, so the single-rounding bounds apply."""
    ref_dx12, ref_h = primitives.swiglu_backward(x12.contiguous(), dh, implementation="torch")
    h_bound, dx12_bound = elementwise_error_bounds(x12, dh, ref_h, ref_dx12)
    if h is not None:
        assert h.dtype == ref_h.dtype and h.shape == ref_h.shape
        assert ((h.double() - ref_h.double()).abs() <= 2 * h_bound).all()
    if dx12 is not None:
        assert dx12.dtype == ref_dx12.dtype and dx12.shape == ref_dx12.shape
        assert ((dx12.double() - ref_dx12.double()).abs() <= 2 * dx12_bound).all()


def _inputs(M, H, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x12 = (torch.randn(M, 2 * H, generator=gen, dtype=torch.float64) * 2).to(dtype)
    dh = torch.randn(M, H, generator=gen, dtype=torch.float64).to(dtype)
    return x12, dh


@pytest.mark.parametrize("dtype", DTYPES_ALL)
@pytest.mark.parametrize("M,H", [(1, 1), (3, 7), (5, 16), (70, 40), (9, 1000), (2, 4099)])
def test_kernels_match_torch_implementation(host_launcher, dtype, M, H):
    x12, dh = _inputs(M, H, dtype, seed=M + H)
    h = primitives.swiglu_forward(x12, launcher=host_launcher)
    dx12, h_bwd = primitives.swiglu_backward(x12, dh, launcher=host_launcher)
    _check(x12, dh, h=h, dx12=dx12)
    _check(x12, dh, h=h_bwd)
    assert torch.equal(h, h_bwd)  # forward and backward recompute the same h


@pytest.mark.parametrize("dtype", DTYPES_ALL)
def test_vector_path_when_aligned_scalar_path_otherwise(host_launcher, dtype):
    vec = 16 // torch.empty((), dtype=dtype).element_size()
    H = 4 * vec
    x12, dh = _inputs(6, H, dtype)
    host_launcher.launches.clear()
    primitives.swiglu_forward(x12, launcher=host_launcher)
    assert host_launcher.launches[-1][0] == "swiglu_forward_vec_p1"

    # Same values at an odd storage offset: misaligned, so the scalar path.
    storage = torch.empty(x12.numel() + 1, dtype=dtype)
    shifted = storage[1:].view(6, 2 * H)
    shifted.copy_(x12)
    h = primitives.swiglu_forward(shifted, launcher=host_launcher)
    assert host_launcher.launches[-1][0] == "swiglu_forward_scalar_p1"
    _check(x12, dh, h=h)
    dx12, _ = primitives.swiglu_backward(shifted, dh, launcher=host_launcher)
    assert host_launcher.launches[-1][0] == "swiglu_backward_scalar_p1"
    _check(x12, dh, dx12=dx12)

    # H not a multiple of the vector width: scalar path.
    x12_odd, _ = _inputs(6, H + 1, dtype)
    primitives.swiglu_forward(x12_odd, launcher=host_launcher)
    assert host_launcher.launches[-1][0] == "swiglu_forward_scalar_p1"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_strided_rows_and_in_place_outputs(host_launcher, dtype):
    M, H = 12, 24
    wide = torch.randn(M, 2 * H + 16, dtype=torch.float64).to(dtype)
    x12 = wide[:, 8:8 + 2 * H]          # row stride 2H+16, 16-byte aligned rows
    dh = torch.randn(M, H, dtype=torch.float64).to(dtype)
    original = x12.clone()
    _check(original, dh, h=primitives.swiglu_forward(x12, launcher=host_launcher))
    before = wide.clone()
    out = x12[:, :H]                    # h written over the gate half
    primitives.swiglu_forward(x12, out=out, launcher=host_launcher)
    _check(original, dh, h=x12[:, :H])
    assert torch.equal(x12[:, H:], before[:, 8 + H:8 + 2 * H])   # up half untouched
    assert torch.equal(wide[:, :8], before[:, :8]) and torch.equal(wide[:, 8 + 2 * H:], before[:, 8 + 2 * H:])

    work = x12.contiguous()
    work.copy_(before[:, 8:8 + 2 * H])
    dx12, _ = primitives.swiglu_backward(work, dh, dx12_out=work, launcher=host_launcher)
    assert dx12.data_ptr() == work.data_ptr()
    _check(original, dh, dx12=work)


def test_rows_beyond_the_grid_are_covered_by_the_row_loop(host_launcher, monkeypatch):
    monkeypatch.setattr(kernels, "MAX_GRID_Y", 2)
    x12, dh = _inputs(50, 9, torch.float32)
    host_launcher.launches.clear()
    h = primitives.swiglu_forward(x12, launcher=host_launcher)
    assert host_launcher.launches[-1][1][1] == 2
    dx12, _ = primitives.swiglu_backward(x12, dh, launcher=host_launcher)
    _check(x12, dh, h=h, dx12=dx12)


def test_empty_batch_launches_nothing(host_launcher):
    host_launcher.launches.clear()
    h = primitives.swiglu_forward(torch.empty(0, 8), launcher=host_launcher)
    dx12, h2 = primitives.swiglu_backward(torch.empty(0, 8), torch.empty(0, 4), launcher=host_launcher)
    assert h.shape == (0, 4) and dx12.shape == (0, 8) and h2.shape == (0, 4)
    assert host_launcher.launches == []


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_whole_function_with_host_kernels(host_launcher, dtype):
    """SwiGLUFunction end to end with the kernels (host-executed) as primitives."""
    torch.manual_seed(0)
    m = swiglu_cupy.SwiGLU(32, 48, 24, dtype=dtype)
    x = torch.randn(3, 5, 32, dtype=dtype, requires_grad=True)
    host_launcher.launches.clear()
    with primitives_on_host_kernels(host_launcher):
        y = m(x)
        y.backward(torch.ones_like(y))
    assert [name for name, *_ in host_launcher.launches] == ["swiglu_forward_vec_p1", "swiglu_backward_vec_p1"]
    ref = swiglu_fp64_reference(x, m.w12.weight, m.w12.bias, m.w3.weight, m.w3.bias)
    bound = {torch.float64: 1e-13, torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]
    assert rel_rms(y, ref) < bound
    for p in (x, m.w12.weight, m.w12.bias, m.w3.weight, m.w3.bias):
        assert_nontrivial(p.grad, "param")


# ---- silu_mul: separate gate and up pointers -------------------------------

def _separate(M, H, dtype, seed=0):
    """gate as a strided view of a wider buffer, up as its own tensor."""
    x12, dh = _inputs(M, H, dtype, seed)
    wide = torch.zeros(M, H + 3 * _vec(dtype), dtype=dtype)
    gate = wide[:, _vec(dtype):_vec(dtype) + H]   # row stride H + 3*vec, 16-byte aligned rows
    gate.copy_(x12[:, :H])
    return gate, x12[:, H:].clone(), dh, x12


def _vec(dtype):
    return 16 // torch.empty((), dtype=dtype).element_size()


@pytest.mark.parametrize("dtype", DTYPES_ALL)
@pytest.mark.parametrize("M,H", [(1, 1), (5, 7), (9, 16), (33, 120)])
def test_silu_mul_kernels_match_torch_implementation(host_launcher, dtype, M, H):
    gate, up, dh, x12 = _separate(M, H, dtype, seed=M * H)
    host_launcher.launches.clear()
    h = primitives.silu_mul_forward(gate, up, launcher=host_launcher)
    dgate, dup = primitives.silu_mul_backward(gate, up, dh, launcher=host_launcher)
    width = "vec" if H % _vec(dtype) == 0 else "scalar"
    assert [n for n, *_ in host_launcher.launches] == [f"swiglu_forward_{width}_p1", f"swiglu_backward_{width}_p1"]
    _check(x12, dh, h=h, dx12=torch.cat([dgate, dup], dim=1))
    # The separate-pointer kernels agree bit for bit with the packed x12 path.
    assert torch.equal(h, primitives.swiglu_forward(x12, launcher=host_launcher))
    dx12, _ = primitives.swiglu_backward(x12, dh, launcher=host_launcher)
    assert torch.equal(torch.cat([dgate, dup], dim=1), dx12)


def test_silu_mul_non_unit_inner_stride_and_misaligned_inputs(host_launcher):
    M, H, dtype = 6, 24, torch.bfloat16
    _, _, dh, x12 = _separate(M, H, dtype)
    gate_t = x12[:, :H].t().contiguous().t()          # column-major: inner stride M
    storage = torch.empty(M * H + 1, dtype=dtype)
    up_shifted = storage[1:].view(M, H)                # misaligned by one element
    up_shifted.copy_(x12[:, H:])
    assert gate_t.stride(1) != 1
    host_launcher.launches.clear()
    h = primitives.silu_mul_forward(gate_t, up_shifted, launcher=host_launcher)
    dgate_out = torch.empty(H, M, dtype=dtype).t()    # non-unit inner stride output
    dgate, dup = primitives.silu_mul_backward(gate_t, up_shifted, dh, dgate_out=dgate_out, launcher=host_launcher)
    assert dgate is dgate_out
    assert [n for n, *_ in host_launcher.launches] == ["swiglu_forward_scalar_p1", "swiglu_backward_scalar_p1"]
    _check(x12, dh, h=h, dx12=torch.cat([dgate, dup], dim=1))


def test_silu_mul_in_place(host_launcher):
    """h over gate; dgate over gate and dup over up (each thread loads its
    whole tile before storing to the same positions)."""
    M, H, dtype = 7, 40, torch.float32
    gate, up, dh, x12 = _separate(M, H, dtype)
    h = primitives.silu_mul_forward(gate, up, out=gate, launcher=host_launcher)
    assert h is gate
    _check(x12, dh, h=gate)
    gate.copy_(x12[:, :H])
    dgate, dup = primitives.silu_mul_backward(gate, up, dh, dgate_out=gate, dup_out=up, launcher=host_launcher)
    assert dgate is gate and dup is up
    _check(x12, dh, dx12=torch.cat([gate, up], dim=1))


# ---- every launch candidate --------------------------------------------------

def _assert_loops(config, launch, M, H, vec):
    """With a grid cap the recorded grid is smaller than the work, so the
    kernels' grid-stride loops must have iterated (rows or columns)."""
    name, grid, block = launch
    assert name.endswith(f"_p{config.packs_per_thread}")
    config = kernels.effective_launch_config(config, variant_of_kernel(name))
    assert block[0] * block[1] == config.threads_per_block
    cap = config.max_blocks(kernels.HOST_SM_COUNT)
    if cap is None:
        return None
    assert grid[0] * grid[1] <= cap
    rows_loop = grid[1] * block[1] < M
    cols_loop = grid[0] * block[0] * config.packs_per_thread * vec < H
    return rows_loop, cols_loop


def _assert_grid_loops_used(host_launcher, config, M, H, vec, cap, label) -> None:
    """Every recorded launch covers the tile; a capped grid on a tall (wide)
    shape must take the row (column) grid-stride loop."""
    path_vec = vec if H % vec == 0 else 1
    loops = {_assert_loops(config, launch, M, H, path_vec) for launch in host_launcher.launches}
    if cap is not None and label == "tall":
        assert all(rows for rows, _ in loops), loops
    if cap is not None and label == "wide":
        assert all(cols for _, cols in loops), loops


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("config", LAUNCH_CANDIDATES, ids=lambda c: c.label.replace(" ", "-"))
def test_every_launch_candidate_is_correct(host_launcher, config, dtype):
    vec = _vec(dtype)
    cap = config.max_blocks(kernels.HOST_SM_COUNT)
    # Tall (more row blocks than the cap), wide (one row needs more column
    # tiles than the cap) and odd-H (scalar path, tails in every tile).
    wide_H = vec * 128 * config.packs_per_thread * (cap or 1) + 3 * vec
    cases = [("tall", 600, 40), ("wide", 2, wide_H), ("odd", 37, 4 * 129 * config.packs_per_thread + 1)]
    for label, M, H in cases:
        gate, up, dh, x12 = _separate(M, H, dtype, seed=H)
        host_launcher.launches.clear()
        with using_launch_config(config):
            h = primitives.silu_mul_forward(gate, up, launcher=host_launcher)
            dgate, dup = primitives.silu_mul_backward(gate, up, dh, launcher=host_launcher)
            h_x12 = primitives.swiglu_forward(x12, launcher=host_launcher)
            dx12, h_bwd = primitives.swiglu_backward(x12, dh, launcher=host_launcher)
        _check(x12, dh, h=h, dx12=torch.cat([dgate, dup], dim=1))
        _check(x12, dh, h=h_x12, dx12=dx12)
        assert torch.equal(h, h_bwd) and torch.equal(h, h_x12)
        _assert_grid_loops_used(host_launcher, config, M, H, vec, cap, label)
        # Same config through the explicit keyword of the kernel path.
        assert torch.equal(kernels.launch_swiglu_forward(x12, None, host_launcher, launch_config=config), h)


@pytest.mark.parametrize("config", [c for c in LAUNCH_CANDIDATES if c.grid_waves == 1])
def test_every_capped_candidate_in_place(host_launcher, config):
    M, H, dtype = 300, 72, torch.bfloat16
    x12, dh = _inputs(M, H, dtype)
    work = x12.clone()
    with using_launch_config(config):
        primitives.swiglu_forward(work, out=work[:, :H], launcher=host_launcher)
        _check(x12, dh, h=work[:, :H])
        assert torch.equal(work[:, H:], x12[:, H:])
        work.copy_(x12)
        primitives.swiglu_backward(work, dh, dx12_out=work, launcher=host_launcher)
    _check(x12, dh, dx12=work)


def test_default_launch_shape():
    """The default (the machine-code model's choice): one pack per thread,
    256-thread blocks (at most 128 across a row), one block row per
    256 // block_x rows, the grid capped at one wave (132 SMs x 8 blocks):
    small calls launch as uncapped, large ones loop."""
    assert DEFAULT_LAUNCH == LaunchConfig(1, 256, 1)
    for M, H, vec, expected in [
        (1, 1, 1, ((1, 1, 1), (32, 8, 1))),
        (8192, 11008, 8, ((11, 96, 1), (128, 2, 1))),      # 1056 // 11 block rows, each looping over rows
        (10**6, 64, 8, ((1, 1056, 1), (32, 8, 1))),
        (5, 4099, 1, ((33, 3, 1), (128, 2, 1))),
    ]:
        assert kernels.launch_shape(M, H, vec, DEFAULT_LAUNCH, sm_count=132) == expected


# ---- every GLU variant (activation kind x clamp x layout) --------------------

def _check_glu(x12, dh, spec, h=None, dx12=None):
    ref_dx12, ref_h = primitives.swiglu_backward(x12.contiguous(), dh, implementation="torch", activation=spec)
    h_bound, dx12_bound = glu_error_bounds(x12, dh, spec, ref_h, ref_dx12)
    if h is not None:
        assert ((h.double() - ref_h.double()).abs() <= h_bound).all()
    if dx12 is not None:
        assert ((dx12.double() - ref_dx12.double()).abs() <= dx12_bound).all()
        if spec.limit is not None:  # the clamp masks agree exactly
            assert torch.equal(dx12 == 0, ref_dx12 == 0)


def _glu_inputs(M, H, dtype, spec, seed):
    x12, dh = _inputs(M, H, dtype, seed)
    if spec.limit is not None:  # gate and up exactly at the limits, on purpose
        gate, up = reference.split_gate_up(x12, spec)
        gate[:, ::5] = spec.limit
        up[:, 1::5] = spec.limit
        up[:, 2::5] = -spec.limit
    return x12, dh


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.tag or "swiglu")
def test_every_variant_kernel_matches_torch_implementation(host_launcher, variant):
    """All dtypes, the 16-byte and the scalar path, packed x12 (halves or
    interleaved) and, for halves, separate gate/up tensors; in place too."""
    spec = spec_of_variant(variant)
    for dtype in DTYPES_ALL:
        for M, H in [(5, 16), (3, 7)]:
            x12, dh = _glu_inputs(M, H, dtype, spec, seed=M * H)
            host_launcher.launches.clear()
            h = primitives.swiglu_forward(x12, launcher=host_launcher, activation=spec)
            dx12, h_bwd = primitives.swiglu_backward(x12, dh, launcher=host_launcher, activation=spec)
            width = "vec" if H % _vec(dtype) == 0 else "scalar"
            assert [n for n, *_ in host_launcher.launches] == [
                kernel_name(k, width == "vec", 1, variant) for k in ("swiglu_forward", "swiglu_backward")]
            _check_glu(x12, dh, spec, h=h, dx12=dx12)
            assert torch.equal(h, h_bwd)
            work = x12.clone()
            primitives.swiglu_backward(work, dh, dx12_out=work, launcher=host_launcher, activation=spec)
            assert torch.equal(work, dx12)  # in place: same values
            if not spec.interleaved:
                gate, up = x12[:, :H].clone(), x12[:, H:].clone()
                assert torch.equal(primitives.silu_mul_forward(gate, up, launcher=host_launcher, activation=spec), h)
                dgate, dup = primitives.silu_mul_backward(gate, up, dh, launcher=host_launcher, activation=spec)
                assert torch.equal(torch.cat([dgate, dup], 1), dx12)


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v.clamp], ids=lambda v: v.tag)
def test_clamped_kernels_follow_the_clamp_rule_in_force(host_launcher, variant, clamp_rule):
    """Every clamped variant and dtype, both access widths, under each torch's
    rule: the kernels' gradient at exactly +-limit is passed (2.13) or 0
    (2.14 on), as the torch implementation's, and just inside the limit it
    passes under both."""
    spec = spec_of_variant(variant)
    for dtype in DTYPES_ALL:
        for M, H in [(5, 16), (3, 7)]:
            x12, dh = _glu_inputs(M, H, dtype, spec, seed=M * H)
            dh = dh.masked_fill(dh == 0, 1)
            dx12, _ = primitives.swiglu_backward(x12, dh, launcher=host_launcher, activation=spec)
            _check_glu(x12, dh, spec, dx12=dx12)
            gate, up = reference.split_gate_up(x12, spec)
            dgate, dup = reference.split_gate_up(dx12, spec)
            at_gate, at_up = dgate[gate == spec.limit], dup[up.abs() == spec.limit]
            assert at_gate.numel() and at_up.numel()
            assert (at_gate != 0).any() if clamp_rule else (at_gate == 0).all(), dtype
            assert (at_up != 0).any() if clamp_rule else (at_up == 0).all(), dtype  # relu's h may be 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("config", LAUNCH_CANDIDATES, ids=lambda c: c.label.replace(" ", "-"))
def test_every_launch_candidate_on_the_interleaved_layout(host_launcher, config, dtype):
    """GPT-OSS's variant (OAI, clamped, interleaved) under every launch shape:
    tall, wide and odd-H cases as for the halves layout above."""
    spec = GPT_OSS
    vec = _vec(dtype)
    # The grid cap of the block the variant's instance really launches with.
    cap = kernels.effective_launch_config(config, kernel_variant(spec)).max_blocks(kernels.HOST_SM_COUNT)
    wide_H = vec * 128 * config.packs_per_thread * (cap or 1) + 3 * vec
    for label, M, H in [("tall", 600, 40), ("wide", 2, wide_H), ("odd", 37, 4 * 129 * config.packs_per_thread + 1)]:
        x12, dh = _glu_inputs(M, H, dtype, spec, seed=H)
        x12 = x12 * 4  # beyond GPT-OSS's limit of 7 too
        host_launcher.launches.clear()
        with using_launch_config(config):
            h = primitives.swiglu_forward(x12, launcher=host_launcher, activation=spec)
            dx12, h_bwd = primitives.swiglu_backward(x12, dh, launcher=host_launcher, activation=spec)
        _check_glu(x12, dh, spec, h=h, dx12=dx12)
        assert torch.equal(h, h_bwd)
        _assert_grid_loops_used(host_launcher, config, M, H, vec, cap, label)


def test_interleaved_vector_path_reads_x12_in_place(host_launcher, monkeypatch):
    """The interleaved x12 goes to its own 16-byte kernel as it is: never
    split into strided gate/up views (which would be copied), never copied."""
    read_from = []  # each launch's first pointer: the x12 it reads (the self-check's own launches aside)
    real_launch = host_launcher.launch

    def launch(name, dtype, device, grid, block, args):
        if not is_probing():
            read_from.append(int(args[0]))
        return real_launch(name, dtype, device, grid, block, args)

    monkeypatch.setattr(host_launcher, "launch", launch)
    x12, dh = _glu_inputs(6, 32, torch.bfloat16, GPT_OSS, seed=1)
    host_launcher.launches.clear()
    primitives.swiglu_forward(x12, launcher=host_launcher, activation=GPT_OSS)
    primitives.swiglu_backward(x12, dh, launcher=host_launcher, activation=GPT_OSS)
    assert [n for n, *_ in host_launcher.launches] == ["glu_forward_oai_clamp_pairs_vec_p1",
                                                      "glu_backward_oai_clamp_pairs_vec_p1"]
    assert read_from == [x12.data_ptr()] * 2  # x12 itself, no copy and no view of a copy
    with pytest.raises(ValueError, match="out must not share x12's memory"):
        primitives.swiglu_forward(x12, out=x12[:, :32], launcher=host_launcher, activation=GPT_OSS)


@pytest.mark.parametrize("spec", ["gelu_tanh", "GPT_OSS"])
def test_whole_function_with_host_kernels_for_a_variant(host_launcher, spec):
    spec = GPT_OSS if spec == "GPT_OSS" else spec
    torch.manual_seed(0)
    m = swiglu_cupy.SwiGLU(32, 48, 24, dtype=torch.float32, activation=spec)
    x = (torch.randn(3, 5, 32) * 4).requires_grad_()
    host_launcher.launches.clear()
    with primitives_on_host_kernels(host_launcher):
        y = m(x)
        y.backward(torch.ones_like(y))
        with torch.no_grad():
            assert torch.equal(m(x), y.detach())
    tag = kernel_variant(m.activation).tag
    assert [name for name, *_ in host_launcher.launches] == [
        f"glu_forward_{tag}_vec_p1", f"glu_backward_{tag}_vec_p1", f"glu_forward_{tag}_vec_p1"]
    ref_params = [p.detach().double().requires_grad_() for p in (m.w12.weight, m.w12.bias, m.w3.weight, m.w3.bias)]
    x_ref = x.detach().double().requires_grad_()
    y_ref = swiglu_cupy.glu_ffn_reference(x_ref, *ref_params, activation=m.activation)
    y_ref.backward(torch.ones_like(y_ref))
    assert rel_rms(y, y_ref) < 1e-6
    for p, p_ref in zip([x, m.w12.weight, m.w12.bias, m.w3.weight, m.w3.bias], [x_ref, *ref_params]):
        assert_nontrivial(p.grad, "param")
        assert rel_rms(p.grad, p_ref.grad) < 1e-5


@pytest.mark.parametrize("rows", [(3, 5), (15,)], ids=["3d", "2d"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_separate_weights_keep_gate_and_up_apart_with_host_kernels(host_launcher, dtype, rows):
    """Separate gate/up weights: gate and up are their own GEMMs' outputs,
    which the kernel reads where they lie (no x12 buffer); under no_grad it
    writes h over gate. inplace_backward (dx12 over x12) keeps one x12. All
    three give the same y and gradients, bit for bit, and match fp64 (a 2-D x
    takes the backward's inline GEMMs)."""
    torch.manual_seed(0)
    D, H, O = 32, 48, 24
    x = torch.randn(*rows, D).to(dtype)
    w1, w2 = ((torch.randn(H, D) / 6).to(dtype).requires_grad_() for _ in range(2))
    b1, b2 = (torch.randn(H).to(dtype).requires_grad_() for _ in range(2))
    w3, b3 = (torch.randn(O, H) / 7).to(dtype).requires_grad_(), torch.randn(O).to(dtype).requires_grad_()
    params = (w1, b1, w2, b2, w3, b3)
    pointers = []  # each launch's first three pointer arguments: (gate, up, h) forward

    class Recording:
        def launch(self, name, dtype, device, grid, block, args):
            if not is_probing():  # the first-use self-check's launches are not the calls'
                pointers.append((name, *(int(a) for a in args[:3])))
            host_launcher.launch(name, dtype, device, grid, block, args)

    results = []
    with primitives_on_host_kernels(Recording()):
        for inplace in (False, True):
            xg = x.clone().requires_grad_()
            y = swiglu_cupy.swiglu_unpacked(xg, w1, b1, w2, b2, w3, b3, inplace_backward=inplace)
            grads = torch.autograd.grad(y, (xg, *params), torch.ones_like(y))
            results.append((y.detach(), grads))
        with torch.no_grad():
            y_no_grad = swiglu_cupy.swiglu_unpacked(x, w1, b1, w2, b2, w3, b3)
    step = H * x.element_size()
    apart, packed, no_grad = [p for p in pointers if p[0] == "swiglu_forward_vec_p1"]
    assert apart[2] != apart[1] + step and apart[3] not in (apart[1], apart[2])  # two tensors, a new h
    assert packed[2] == packed[1] + step  # x12's halves
    assert no_grad[2] != no_grad[1] + step and no_grad[3] == no_grad[1]  # two tensors, h over gate
    assert [p[0] for p in pointers] == ["swiglu_forward_vec_p1", "swiglu_backward_vec_p1"] * 2 + [
        "swiglu_forward_vec_p1"]
    (y, grads), (y_packed, grads_packed) = results
    assert torch.equal(y, y_packed) and torch.equal(y_no_grad, y) and y.shape == (*rows, O)
    assert all(torch.equal(g, g_packed) for g, g_packed in zip(grads, grads_packed))
    ref = [t.detach().double().requires_grad_() for t in (x, *params)]
    w12, b12 = torch.cat([ref[1], ref[3]]), torch.cat([ref[2], ref[4]])
    y_ref = swiglu_cupy.glu_ffn_reference(ref[0], w12, b12, ref[5], ref[6])
    grads_ref = torch.autograd.grad(y_ref, ref, torch.ones_like(y_ref))
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert rel_rms(y, y_ref) < tol
    for g, g_ref in zip(grads, grads_ref):
        assert_nontrivial(g, "grad")
        assert rel_rms(g, g_ref) < tol


@pytest.mark.parametrize("frozen", ["w1", "w2"])
def test_separate_weights_with_one_projection_frozen(host_launcher, frozen):
    """A frozen gate (or up) weight gets no gradient and costs no GEMM; the
    others' match fp64 (kernels forward and backward, a 2-D x)."""
    torch.manual_seed(1)
    D, H, O = 16, 24, 8
    x = torch.randn(6, D, requires_grad=True)
    w = {"w1": torch.randn(H, D) / 4, "w2": torch.randn(H, D) / 4, "w3": torch.randn(O, H) / 5}
    for name, t in w.items():
        t.requires_grad_(name != frozen)
    mms = []
    real_mm = torch.mm

    def counting_mm(*args, **kwargs):
        mms.append(args[0].shape)
        return real_mm(*args, **kwargs)

    with primitives_on_host_kernels(host_launcher):
        y = swiglu_cupy.swiglu_unpacked(x, w["w1"], None, w["w2"], None, w["w3"], None)
        trainable = [x] + [t for t in w.values() if t.requires_grad]
        torch.mm = counting_mm
        try:
            grads = torch.autograd.grad(y, trainable, torch.ones_like(y))
        finally:
            torch.mm = real_mm
    assert len(mms) == 4  # dh, dx's first half, the trainable half's dW, dw3 (dx's second: addmm_)
    ref = {k: t.detach().double().requires_grad_() for k, t in {"x": x, **w}.items()}
    y_ref = swiglu_cupy.glu_ffn_reference(ref["x"], torch.cat([ref["w1"], ref["w2"]]), None, ref["w3"], None)
    names = ["x"] + [k for k, t in w.items() if t.requires_grad]
    grads_ref = torch.autograd.grad(y_ref, [ref[k] for k in names], torch.ones_like(y_ref))
    for name, g, g_ref in zip(names, grads, grads_ref):
        assert_nontrivial(g, name)
        assert rel_rms(g, g_ref) < 1e-6, name


def test_separate_gate_and_up_saved_by_kernels_reach_a_torch_backward(host_launcher):
    """gate and up saved apart by the kernels' forward, backward run where no
    kernels do (the launcher's context left): the torch implementation gets
    them as one x12, and the gradients match the fp64 reference as the
    kernels' backward does."""
    torch.manual_seed(0)
    x = torch.randn(6, 32, requires_grad=True)
    w1, w2 = ((torch.randn(48, 32) / 6).requires_grad_() for _ in range(2))
    w3 = (torch.randn(24, 48) / 7).requires_grad_()
    grads = []
    for backward_on_kernels in (True, False):
        with primitives_on_host_kernels(host_launcher):
            y = swiglu_cupy.swiglu_unpacked(x, w1, None, w2, None, w3, None)
            if backward_on_kernels:
                grads.append(torch.autograd.grad(y.sum(), (x, w1, w2, w3)))
        if not backward_on_kernels:
            grads.append(torch.autograd.grad(y.sum(), (x, w1, w2, w3)))
    ref = [t.detach().double().requires_grad_() for t in (x, w1, w2, w3)]
    y_ref = swiglu_cupy.glu_ffn_reference(ref[0], torch.cat([ref[1], ref[2]]), None, ref[3], None)
    grads_ref = torch.autograd.grad(y_ref.sum(), ref)
    for g_torch, g_kernels, g_ref in zip(grads[1], grads[0], grads_ref):
        assert_nontrivial(g_torch, "grad")
        assert rel_rms(g_torch, g_ref) < 1e-6 and rel_rms(g_kernels, g_ref) < 1e-6


def test_wide_tiles_of_the_variants_launch_in_smaller_blocks(host_launcher):
    """The other variants' 4-pack instances are built for 256-thread blocks:
    a 512-thread config launches them with 256 (and stays correct); SwiGLU's
    keep the full block."""
    config = LaunchConfig(packs_per_thread=4, threads_per_block=512)
    x12 = torch.randn(64, 2 * 96)
    for spec, threads in ((GPT_OSS, 256), (SILU_SPEC, 512)):
        host_launcher.launches.clear()
        with using_launch_config(config):
            h = primitives.swiglu_forward(x12, launcher=host_launcher, activation=spec)
        assert {block[0] * block[1] for _, _, block in host_launcher.launches} == {threads}
        torch.testing.assert_close(h, primitives.swiglu_forward(x12, implementation="torch", activation=spec),
                                   rtol=1e-6, atol=1e-6)
