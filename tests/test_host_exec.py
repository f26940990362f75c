"""Layer 1, kernel implementation: the kernels_cu sources executed on the CPU
(g++ host build) through the same Python launch path the GPU uses, compared
with the torch implementation of the same contract."""
import pytest
import torch

import swiglu_cupy
from swiglu_cupy import primitives
from swiglu_cupy.primitives import kernels
from conftest import (DTYPES_ALL, assert_nontrivial, elementwise_error_bounds, primitives_on_host_kernels, rel_rms,
                      swiglu_fp64_reference)

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
