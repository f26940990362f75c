"""Memory modes, measured with saved_tensors_hooks (saved bytes) on CPU."""
import pytest
import torch

import swiglu_cupy as sc
from swiglu_cupy import primitives
from conftest import assert_nontrivial

D, H, M = 32, 48, 20


def _saved(model, x):
    """(per-token saved elements, all saved tensors) during one forward."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = model(x)
    params = {p.data_ptr() for p in model.parameters()}
    activations = [t for t in saved if t.data_ptr() not in params]
    per_token = sum(t.numel() for t in activations) // x.shape[0]
    return y, per_token, saved


def test_default_saves_exactly_x_and_x12():
    model = sc.SwiGLU(D, H)
    x = torch.randn(M, D, requires_grad=True)
    _, per_token, saved = _saved(model, x)
    assert per_token == D + 2 * H
    assert sorted(tuple(t.shape) for t in saved) == sorted([(M, D), (2 * H, D), (D, H), (M, 2 * H)])
    assert all(tuple(t.shape) != (M, H) for t in saved)  # never h


def test_recompute_gate_up_saves_only_x_and_gives_identical_grads():
    torch.manual_seed(0)
    base = sc.SwiGLU(D, H)
    lean = sc.SwiGLU(D, H, recompute_gate_up=True)
    lean.load_state_dict(base.state_dict())
    x = torch.randn(M, D, requires_grad=True)
    _, per_token, _ = _saved(lean, x)
    assert per_token == D
    grads = []
    for model in (base, lean):
        x.grad = None
        model(x).pow(2).sum().backward()
        grads.append([x.grad.clone()] + [p.grad.clone() for p in model.parameters()])
    for g, g_ref in zip(grads[1], grads[0]):
        assert_nontrivial(g_ref, "grad")
        assert torch.equal(g, g_ref)


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_no_grad_forward_writes_h_over_x12_and_matches(context, monkeypatch):
    torch.manual_seed(0)
    model = sc.SwiGLU(D, H)
    x = torch.randn(M, D)
    expected = model(x).detach()
    calls = []
    real = primitives.torch_impl.silu_mul_forward_torch  # the CPU path's elementwise step

    def spy(gate, up, out=None, *args, **kwargs):
        calls.append((gate, up, out))
        return real(gate, up, out, *args, **kwargs)

    monkeypatch.setattr(primitives.torch_impl, "silu_mul_forward_torch", spy)
    with context():
        y = model(x)
    (gate, up, out), = calls
    # h went over the gate half of x12 (gate and up are its two halves): no
    # [M, H] buffer was allocated.
    assert out is gate and up.data_ptr() == gate.data_ptr() + H * gate.element_size()
    assert gate.stride() == up.stride() == (2 * H, 1)
    assert torch.equal(y, expected)


def test_inplace_backward_once_then_clear_error():
    torch.manual_seed(0)
    model = sc.SwiGLU(D, H, inplace_backward=True)
    ref = sc.SwiGLU(D, H)
    ref.load_state_dict(model.state_dict())
    x = torch.randn(M, D, requires_grad=True)
    y = model(x)
    y.sum().backward(retain_graph=True)
    g = x.grad.clone()
    x.grad = None
    ref(x).sum().backward()
    assert torch.equal(g, x.grad)
    with pytest.raises(RuntimeError, match="inplace_backward=True"):
        y.sum().backward()


def test_default_allows_a_second_backward():
    model = sc.SwiGLU(D, H)
    x = torch.randn(M, D, requires_grad=True)
    y = model(x)
    y.sum().backward(retain_graph=True)
    first = x.grad.clone()
    y.sum().backward()
    assert torch.equal(x.grad, 2 * first)


def test_mode_flags_are_validated():
    with pytest.raises(TypeError, match="recompute_gate_up must be a bool"):
        sc.swiglu(torch.randn(2, 4), torch.randn(6, 4), None, torch.randn(4, 3), None, recompute_gate_up=1)
