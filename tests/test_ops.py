"""The registered custom ops (torch.compile's view of the primitives) and
torch.compile of models using SwiGLU."""
import pytest
import torch

import swiglu_cupy as sc
from swiglu_cupy.primitives import ops, route
from conftest import assert_compiled_matches_eager


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_custom_ops(dtype):
    x12 = torch.randn(5, 14).to(dtype)
    dh = torch.randn(5, 7).to(dtype)
    torch.library.opcheck(torch.ops.swiglu_cupy.swiglu_forward.default, (x12,))
    torch.library.opcheck(torch.ops.swiglu_cupy.swiglu_backward.default, (x12, dh))
    torch.library.opcheck(torch.ops.swiglu_cupy.swiglu_forward_inplace.default, (x12.clone(),))
    torch.library.opcheck(torch.ops.swiglu_cupy.swiglu_backward_inplace.default, (x12.clone(), dh))
    h, saved = torch.ops.swiglu_cupy.swiglu_forward_fp8(x12)
    assert saved.dtype == torch.uint8 and torch.equal(h, torch.ops.swiglu_cupy.swiglu_forward(x12))
    torch.library.opcheck(torch.ops.swiglu_cupy.swiglu_forward_fp8.default, (x12,))
    torch.library.opcheck(torch.ops.swiglu_cupy.swiglu_backward_fp8.default, (saved, dh))


def test_ops_match_the_primitives():
    from swiglu_cupy import primitives

    x12 = torch.randn(6, 10)
    dh = torch.randn(6, 5)
    assert torch.equal(torch.ops.swiglu_cupy.swiglu_forward(x12), primitives.swiglu_forward(x12))
    dx12, h = torch.ops.swiglu_cupy.swiglu_backward(x12, dh)
    ref_dx12, ref_h = primitives.swiglu_backward(x12, dh)
    assert torch.equal(dx12, ref_dx12) and torch.equal(h, ref_h)
    work = x12.clone()
    h_view = route.forward_inplace(work)
    assert h_view.data_ptr() == work.data_ptr() and torch.equal(h_view, ref_h)


def _model(**kw):
    torch.manual_seed(0)
    return torch.nn.Sequential(sc.SwiGLU(16, 24, **kw), sc.SwiGLU(16, 24, **kw))


def test_torch_compile_fullgraph_no_graph_breaks_matches_eager():
    assert_compiled_matches_eager(_model(), torch.randn(3, 4, 16, requires_grad=True), tol=1e-6)


def test_torch_compile_memory_modes():
    model = _model(recompute_gate_up=True, inplace_backward=True)
    x = torch.randn(8, 16, requires_grad=True)
    compiled = torch.compile(model, fullgraph=True)
    compiled(x).sum().backward()
    g = x.grad.clone()
    x.grad = None
    _model()(x).sum().backward()
    torch.testing.assert_close(g, x.grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("layout", ["packed", "unpacked"])
def test_torch_compile_of_the_functions_with_plain_tensor_weights(layout):
    """Plain tensors (not Parameters: a functional call, TP's to_local shards)
    take the API's common case inside the trace too: fullgraph, and the
    forward and every gradient match eager."""
    torch.manual_seed(0)
    x = torch.randn(5, 16, requires_grad=True)
    w12, b12 = (torch.randn(48, 16) / 4).requires_grad_(), torch.randn(48).requires_grad_()
    w3 = (torch.randn(16, 24) / 5).requires_grad_()
    weights = (x, w12, b12, w3)

    def call(x, w12, b12, w3):
        if layout == "packed":
            return sc.swiglu(x, w12, b12, w3, None)
        w1, w2 = w12.chunk(2)
        b1, b2 = b12.chunk(2)
        return sc.swiglu_unpacked(x, w1.contiguous(), b1, w2.contiguous(), b2, w3, None)

    eager = call(*weights)
    eager_grads = torch.autograd.grad(eager.pow(2).sum(), weights)
    compiled = torch.compile(call, fullgraph=True)(*weights)
    grads = torch.autograd.grad(compiled.pow(2).sum(), weights)
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)
    for g, ref in zip(grads, eager_grads):
        assert g.abs().sum() > 0
        torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-5)
