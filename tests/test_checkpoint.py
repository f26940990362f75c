"""The seed bug (xformers #1126/#1151) as tests: activation checkpointing in
both modes, with and without grad on x, under autocast, and in a stack.
In every case the gradients equal the un-checkpointed run."""
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import swiglu_cupy as sc
from conftest import assert_nontrivial

D, H = 32, 40


def _model(n_blocks=1, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    return nn.ModuleList(sc.SwiGLU(D, H, dtype=dtype) for _ in range(n_blocks))


def _forward(blocks, x, mode):
    """mode: None (plain), 'reentrant' or 'non_reentrant'; blocks are residual."""
    for block in blocks:
        if mode is None:
            x = x + block(x)
        else:
            x = x + checkpoint(block, x, use_reentrant=(mode == "reentrant"))
    return x


def _grads(blocks, x, mode, autocast=False):
    blocks.zero_grad(set_to_none=True)
    if x.requires_grad:
        x.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = _forward(blocks, x, mode).float().pow(2).mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in blocks.named_parameters()}
    if x.requires_grad:
        grads["x"] = x.grad.clone()
    return loss.detach(), grads


def _assert_same(got, expected):
    loss, grads = got
    loss_ref, grads_ref = expected
    assert torch.equal(loss, loss_ref)
    assert grads.keys() == grads_ref.keys()
    for name in grads_ref:
        assert_nontrivial(grads_ref[name], name)
        assert torch.equal(grads[name], grads_ref[name]), name


@pytest.mark.parametrize("x_requires_grad", [False, True])
@pytest.mark.parametrize("n_blocks", [1, 3])
def test_non_reentrant_checkpoint_module(x_requires_grad, n_blocks):
    blocks = _model(n_blocks)
    x = torch.randn(4, 5, D, dtype=torch.float64, requires_grad=x_requires_grad)
    _assert_same(_grads(blocks, x, "non_reentrant"), _grads(blocks, x, None))


@pytest.mark.parametrize("n_blocks", [1, 3])
def test_reentrant_checkpoint_module(n_blocks):
    blocks = _model(n_blocks)
    x = torch.randn(4, 5, D, dtype=torch.float64, requires_grad=True)
    _assert_same(_grads(blocks, x, "reentrant"), _grads(blocks, x, None))


@pytest.mark.parametrize("x_requires_grad", [False, True])
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoint_functional_api(x_requires_grad, use_reentrant):
    """Weights passed as checkpoint inputs: both modes work even when x does
    not require grad (the case that broke xformers' fast path)."""
    torch.manual_seed(0)
    x = torch.randn(6, D, dtype=torch.float64, requires_grad=x_requires_grad)
    params = [torch.randn(2 * H, D, dtype=torch.float64), torch.randn(2 * H, dtype=torch.float64),
              torch.randn(D, H, dtype=torch.float64), torch.randn(D, dtype=torch.float64)]
    params = [p.requires_grad_(True) for p in params]

    def grads(use_checkpoint):
        for t in [x] + params:
            t.grad = None
        if use_checkpoint:
            y = checkpoint(sc.swiglu, x, *params, use_reentrant=use_reentrant)
        else:
            y = sc.swiglu(x, *params)
        y.pow(2).sum().backward()
        return [t.grad for t in ([x] if x_requires_grad else []) + params]

    expected, got = grads(False), grads(True)
    for g, g_ref in zip(got, expected):
        assert_nontrivial(g_ref, "grad")
        assert torch.equal(g, g_ref)


def test_reentrant_checkpoint_with_no_input_requiring_grad_behaves_like_nn_linear():
    """torch's reentrant checkpoint only builds a graph through its inputs; with
    none requiring grad it returns an output without grad_fn, for any module.
    We behave exactly like an nn.Linear there (no error, no silent grads)."""
    x = torch.randn(3, D, dtype=torch.float64)
    for module in (sc.SwiGLU(D, H, dtype=torch.float64), nn.Linear(D, D, dtype=torch.float64)):
        with pytest.warns(UserWarning, match="requires_grad"):
            y = checkpoint(module, x, use_reentrant=True)
        assert y.grad_fn is None


# Reentrant mode needs an input requiring grad (torch's rule, tested above).
@pytest.mark.parametrize("mode,x_requires_grad", [
    ("non_reentrant", False), ("non_reentrant", True), ("reentrant", True)])
def test_checkpoint_under_cpu_autocast(mode, x_requires_grad):
    blocks = _model(2, dtype=torch.float32)
    x = torch.randn(4, 6, D, requires_grad=x_requires_grad)
    got = _grads(blocks, x, mode, autocast=True)
    expected = _grads(blocks, x, None, autocast=True)
    _assert_same(got, expected)
    for g in expected[1].values():
        assert g.dtype == torch.float32


@pytest.mark.parametrize("mode,x_requires_grad", [
    ("non_reentrant", False), ("non_reentrant", True), ("reentrant", True)])
def test_checkpoint_of_separate_weights_on_the_kernels(host_launcher, mode, x_requires_grad):
    """Separate gate/up weights on the kernels' path (host-executed) save
    gate and up as two tensors: both checkpoint modes recompute the same
    saves and give the un-checkpointed gradients bit for bit."""
    from conftest import primitives_on_host_kernels

    torch.manual_seed(0)
    x = torch.randn(4, 6, D, requires_grad=x_requires_grad)
    params = [(torch.randn(H, D) / 6).requires_grad_(), torch.randn(H).requires_grad_(),
              (torch.randn(H, D) / 6).requires_grad_(), torch.randn(H).requires_grad_(),
              (torch.randn(D, H) / 7).requires_grad_(), None]

    def grads(checkpointed):
        for t in [x, *params[:5]]:
            t.grad = None
        with primitives_on_host_kernels(host_launcher):
            if checkpointed:
                y = checkpoint(sc.swiglu_unpacked, x, *params, use_reentrant=(mode == "reentrant"))
            else:
                y = sc.swiglu_unpacked(x, *params)
            y.pow(2).sum().backward()
        return [t.grad for t in ([x] if x_requires_grad else []) + params[:5]]

    host_launcher.launches.clear()
    expected = grads(False)
    assert [name for name, *_ in host_launcher.launches] == ["swiglu_forward_vec_p1", "swiglu_backward_vec_p1"]
    for g, g_ref in zip(grads(True), expected):
        assert_nontrivial(g_ref, "grad")
        assert torch.equal(g, g_ref)
