"""Layer 1, torch implementation: the contract and the math, against float64."""
import pytest
import torch
import torch.nn.functional as F

from swiglu_cupy import primitives
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
