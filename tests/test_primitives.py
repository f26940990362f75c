"""Layer 1, torch implementation: the contract and the math, against float64."""
import pytest
import torch
import torch.nn.functional as F

from swiglu_cupy import primitives
from swiglu_cupy.activations import GLUActivation
from swiglu_cupy.primitives import torch_impl
from conftest import DTYPES_ALL, elementwise_error_bounds, rel_rms


def _exact(x12: torch.Tensor, dh: torch.Tensor):
    """Float64 autograd of silu(g) * u, an independent derivation of the backward."""
    g, u = x12.double().chunk(2, dim=1)
    g.requires_grad_(True)
    u.requires_grad_(True)
    h = F.silu(g) * u
    dg, du = torch.autograd.grad(h, (g, u), dh.double())
    return h.detach(), torch.cat([dg, du], dim=1)


@pytest.mark.parametrize("dtype", DTYPES_ALL)
@pytest.mark.parametrize("M,H", [(1, 1), (7, 3), (33, 40)])
def test_torch_primitives_round_once(dtype, M, H):
    torch.manual_seed(M * 100 + H)
    x12 = (torch.randn(M, 2 * H, dtype=torch.float64) * 3).to(dtype)
    dh = torch.randn(M, H, dtype=torch.float64).to(dtype)
    h_exact, dx12_exact = _exact(x12, dh)
    h = primitives.swiglu_forward(x12, implementation="torch")
    dx12, h_bwd = primitives.swiglu_backward(x12, dh, implementation="torch")
    assert h.dtype == dx12.dtype == h_bwd.dtype == dtype
    assert h.shape == (M, H) and dx12.shape == (M, 2 * H)
    # Single rounding of the math-dtype result (bounds explained in conftest).
    h_bound, dx12_bound = elementwise_error_bounds(x12, dh, h_exact, dx12_exact)
    for got, exact, bound in ((h, h_exact, h_bound), (h_bwd, h_exact, h_bound), (dx12, dx12_exact, dx12_bound)):
        assert ((got.double() - exact).abs() <= bound).all()
    assert torch.equal(h, h_bwd)


def test_outputs_into_caller_buffers_and_in_place():
    torch.manual_seed(0)
    x12 = torch.randn(6, 10)
    dh = torch.randn(6, 5)
    h_ref = primitives.swiglu_forward(x12, implementation="torch")
    dx12_ref, _ = primitives.swiglu_backward(x12, dh, implementation="torch")

    work = x12.clone()
    out = primitives.swiglu_forward(work, out=work[:, :5], implementation="torch")
    assert out.data_ptr() == work.data_ptr()
    assert torch.equal(work[:, :5], h_ref)

    work = x12.clone()
    dx12, _ = primitives.swiglu_backward(work, dh, dx12_out=work, implementation="torch")
    assert dx12.data_ptr() == work.data_ptr()
    assert torch.equal(work, dx12_ref)


@pytest.mark.parametrize("call,match", [
    (lambda: primitives.swiglu_forward(torch.randn(4)), "x12 must be 2-D"),
    (lambda: primitives.swiglu_forward(torch.randn(4, 5)), "even number of columns"),
    (lambda: primitives.swiglu_forward(torch.ones(4, 6, dtype=torch.int32)), "x12 dtype"),
    (lambda: primitives.swiglu_forward(torch.randn(4, 6), out=torch.randn(4, 2)), "out must have shape"),
    (lambda: primitives.swiglu_backward(torch.randn(4, 6), torch.randn(4, 2)), "dh must have shape"),
    (lambda: primitives.swiglu_backward(torch.randn(4, 6), torch.randn(4, 3, dtype=torch.float64)), "dh dtype"),
    (lambda: primitives.swiglu_forward(torch.randn(4, 6), implementation="fast"), "implementation must be"),
])
def test_contract_errors_name_the_argument(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


def test_relative_rms_helper_detects_errors():
    a = torch.ones(10)
    assert rel_rms(a, a) == 0
    assert rel_rms(a * 1.01, a) == pytest.approx(0.01)


@pytest.mark.parametrize("dtype", DTYPES_ALL)
@pytest.mark.parametrize("M,H", [(1, 1), (7, 3), (33, 40)])
def test_torch_silu_mul_rounds_once(dtype, M, H):
    """gate and up as separate tensors (up non-contiguous): same single-rounding
    bounds against float64 autograd as the packed primitives."""
    torch.manual_seed(M * 10 + H)
    x12 = (torch.randn(M, 2 * H, dtype=torch.float64) * 3).to(dtype)
    dh = torch.randn(M, H, dtype=torch.float64).to(dtype)
    gate, up = x12[:, :H].clone(), x12[:, H:].t().contiguous().t()
    h_exact, dx12_exact = _exact(x12, dh)
    h = primitives.silu_mul_forward(gate, up, implementation="torch")
    dgate, dup = primitives.silu_mul_backward(gate, up, dh, implementation="torch")
    assert h.dtype == dgate.dtype == dup.dtype == dtype
    assert h.shape == dgate.shape == dup.shape == (M, H)
    h_bound, dx12_bound = elementwise_error_bounds(x12, dh, h_exact, dx12_exact)
    assert ((h.double() - h_exact).abs() <= h_bound).all()
    assert ((torch.cat([dgate, dup], dim=1).double() - dx12_exact).abs() <= dx12_bound).all()
    assert dgate.abs().max() > 0 and dup.abs().max() > 0


def test_silu_mul_outputs_into_caller_buffers_and_in_place():
    torch.manual_seed(0)
    gate, up, dh = torch.randn(6, 5), torch.randn(6, 5), torch.randn(6, 5)
    h_ref = primitives.silu_mul_forward(gate, up, implementation="torch")
    dgate_ref, dup_ref = primitives.silu_mul_backward(gate, up, dh, implementation="torch")
    g = gate.clone()
    assert primitives.silu_mul_forward(g, up, out=g, implementation="torch") is g
    assert torch.equal(g, h_ref)
    g, u = gate.clone(), up.clone()
    dgate, dup = primitives.silu_mul_backward(g, u, dh, dgate_out=g, dup_out=u, implementation="torch")
    assert dgate is g and dup is u
    assert torch.equal(g, dgate_ref) and torch.equal(u, dup_ref)


@pytest.mark.parametrize("call,error,match", [
    (lambda: primitives.silu_mul_forward([1.0], torch.randn(2, 3)), TypeError, "gate must be a torch.Tensor"),
    (lambda: primitives.silu_mul_forward(torch.randn(6), torch.randn(6)), ValueError, "gate must be 2-D"),
    (lambda: primitives.silu_mul_forward(torch.ones(2, 3, dtype=torch.int64), torch.ones(2, 3)), TypeError, "gate dtype"),
    (lambda: primitives.silu_mul_forward(torch.randn(2, 3), torch.randn(2, 4)), ValueError, "up must have shape \\(2, 3\\)"),
    (lambda: primitives.silu_mul_forward(torch.randn(2, 3), torch.randn(2, 3).double()), TypeError, "up dtype must match gate"),
    (lambda: primitives.silu_mul_forward(torch.randn(2, 3), torch.randn(2, 3, device="meta")), ValueError, "up must be on gate's device"),
    (lambda: primitives.silu_mul_forward(torch.randn(2, 3), torch.randn(2, 3), out=torch.randn(3, 2)), ValueError, "out must have shape"),
    (lambda: primitives.silu_mul_backward(torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 2)), ValueError, "dh must have shape"),
    (lambda: primitives.silu_mul_backward(torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 3).half()), TypeError, "dh dtype must match gate"),
    (lambda: primitives.silu_mul_backward(torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 3),
                                          dup_out=torch.randn(2, 3).double()), TypeError, "dup_out dtype"),
    (lambda: primitives.silu_mul_backward(torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 3),
                                          dgate_out=torch.randn(1, 3)), ValueError, "dgate_out must have shape"),
])
def test_silu_mul_errors_name_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_torch_path_blocks_of_a_widened_dtype_have_half_the_rows(monkeypatch):
    """A half-precision block's fp32 copies sit beside its operands: half the
    rows of an fp32 block keep about the same bytes in cache."""
    monkeypatch.setattr(torch_impl, "_BLOCK_ELEMENTS", 1 << 17)
    assert torch_impl._block_rows(512, torch.float32) == 256
    assert torch_impl._block_rows(512, torch.float64) == 256
    assert torch_impl._block_rows(512, torch.bfloat16) == torch_impl._block_rows(512, torch.float16) == 128
    assert torch_impl._block_rows(1 << 20, torch.bfloat16) == 1  # a row wider than a block is a block


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("interleaved", [False, True])
def test_torch_path_row_blocks_match_the_functional_form(dtype, interleaved, monkeypatch):
    """The buffered torch path (what primitives run: outputs written in
    place; one block, or blocks of rows through fp32 workspaces) equals the
    functional form (new tensors, what tracers see) bit for bit: as one block
    and in blocks of 4 rows (2 for a widened dtype) over 7 rows (a short last
    block), in place or not, halves or interleaved."""
    torch.manual_seed(0)
    M, H = 7, 5
    spec = GLUActivation("silu", interleaved=interleaved)
    x12 = (torch.randn(M, 2 * H, dtype=torch.float64) * 3).to(dtype)
    dh = torch.randn(M, H, dtype=torch.float64).to(dtype)
    functional_h = torch_impl.swiglu_forward_torch(x12, None, spec)
    functional_dx12, functional_h2 = torch_impl.swiglu_backward_torch(x12, dh, activation=spec)
    assert torch.equal(functional_h, functional_h2)
    for block_elements in (torch_impl._BLOCK_ELEMENTS, 4 * H):
        monkeypatch.setattr(torch_impl, "_BLOCK_ELEMENTS", block_elements)
        out = torch.full((M, H), float("nan"), dtype=dtype)
        assert torch.equal(primitives.swiglu_forward(x12, out=out, activation=spec), functional_h)
        dx12, h = primitives.swiglu_backward(x12, dh, activation=spec)
        assert torch.equal(dx12, functional_dx12) and torch.equal(h, functional_h)
        in_place = x12.clone()
        dx12, h = primitives.swiglu_backward(in_place, dh, dx12_out=in_place, activation=spec)
        assert dx12 is in_place and torch.equal(dx12, functional_dx12) and torch.equal(h, functional_h)
        if not interleaved:  # separate gate/up tensors, outputs over the inputs
            in_place = x12.clone()
            gate, up = in_place.chunk(2, 1)
            assert torch.equal(primitives.silu_mul_forward(gate, up, out=gate), functional_h)
            in_place = x12.clone()
            gate, up = in_place.chunk(2, 1)
            dgate, dup = primitives.silu_mul_backward(gate, up, dh, dgate_out=gate, dup_out=up)
            assert dgate is gate and dup is up and torch.equal(in_place, functional_dx12)
