"""Layer 3: the SwiGLU module."""
import pytest
import torch
from torch import nn

import swiglu_cupy as sc
from conftest import assert_nontrivial, rel_rms, swiglu_fp64_reference


def test_state_dict_layout_matches_packed_xformers_swiglu():
    m = sc.SwiGLU(16, 40, 8)
    sd = m.state_dict()
    assert list(sd) == ["w12.weight", "w12.bias", "w3.weight", "w3.bias"]
    assert sd["w12.weight"].shape == (80, 16) and sd["w12.bias"].shape == (80,)
    assert sd["w3.weight"].shape == (8, 40) and sd["w3.bias"].shape == (8,)
    assert isinstance(m.w12, nn.Linear) and isinstance(m.w3, nn.Linear)


def test_out_features_defaults_to_in_features_and_bias_flag():
    m = sc.SwiGLU(12, 20, bias=False)
    assert m.w3.weight.shape == (12, 20)
    assert m.w12.bias is None and m.w3.bias is None
    assert list(m.state_dict()) == ["w12.weight", "w3.weight"]


def test_default_init_is_nn_linear():
    torch.manual_seed(7)
    m = sc.SwiGLU(16, 24, 8)
    torch.manual_seed(7)
    w12, w3 = nn.Linear(16, 48), nn.Linear(24, 8)
    for a, b in ((m.w12, w12), (m.w3, w3)):
        assert torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)


def test_gate_rows_come_first():
    """Rows 0..H-1 of w12 are the gate: zeroing the up rows zeroes the output
    (up multiplies), zeroing the gate rows gives silu(0) * up = 0 too, but
    swapping the halves changes the result."""
    torch.manual_seed(0)
    m = sc.SwiGLU(8, 6, 4, bias=False, dtype=torch.float64)
    x = torch.randn(5, 8, dtype=torch.float64)
    w1, w2 = m.w12.weight[:6], m.w12.weight[6:]
    expected = (torch.nn.functional.silu(x @ w1.T) * (x @ w2.T)) @ m.w3.weight.T
    assert torch.allclose(m(x), expected, rtol=1e-12, atol=1e-12)
    swapped = torch.cat([w2, w1])
    assert not torch.allclose(sc.swiglu(x, swapped, None, m.w3.weight, None), expected, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_module_parity_and_gradients(dtype):
    torch.manual_seed(3)
    m = sc.SwiGLU(32, 48, 16, dtype=dtype)
    x = torch.randn(2, 7, 32, dtype=dtype, requires_grad=True)
    y = m(x)
    ref = swiglu_fp64_reference(x, m.w12.weight, m.w12.bias, m.w3.weight, m.w3.bias)
    assert rel_rms(y, ref) < {torch.float32: 1e-6, torch.bfloat16: 8e-3}[dtype]
    y.sum().backward()
    for name, p in [("x", x), *m.named_parameters()]:
        assert_nontrivial(p.grad, name)


@pytest.mark.parametrize("kwargs,match", [
    (dict(in_features=0, hidden_features=4), "in_features must be a positive int"),
    (dict(in_features=4, hidden_features=-1), "hidden_features must be a positive int"),
    (dict(in_features=4, hidden_features=4, out_features=2.5), "out_features must be a positive int"),
])
def test_constructor_rejects_bad_sizes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sc.SwiGLU(**kwargs)


def test_repr():
    assert "hidden_features=5" in repr(sc.SwiGLU(3, 5))


def test_forward_sees_parametrized_and_reassigned_weights():
    """forward reads its weights from the module registries for speed; a
    parametrization (weight no longer registered) or a re-registered
    parameter must still be what it computes with."""
    from torch.nn.utils import parametrize

    class Double(torch.nn.Module):
        def forward(self, w):
            return 2 * w

    torch.manual_seed(0)
    m = sc.SwiGLU(8, 12, dtype=torch.float64)
    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    w12, b12, w3, b3 = (p.detach().clone() for p in (m.w12.weight, m.w12.bias, m.w3.weight, m.w3.bias))
    parametrize.register_parametrization(m.w12, "weight", Double())
    y = m(x)
    torch.testing.assert_close(y, sc.swiglu_reference(x, 2 * w12, b12, w3, b3))
    y.sum().backward()
    assert m.w12.parametrizations.weight.original.grad is not None
    m.w3.weight = torch.nn.Parameter(torch.zeros_like(w3))
    torch.testing.assert_close(m(x), b3.expand(3, -1))
