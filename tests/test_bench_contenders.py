"""The bench contenders: the same weights give the same function, and the
GEMM lower bound runs exactly the GEMMs of SwiGLUFunction."""
import pytest
import torch
import torch.nn.functional as F

from swiglu_cupy.tools.bench.contenders import (GemmRunner, ModuleRunner, Unavailable, build_module,
                                          master_weights)

D, H, M = 16, 24, 5
CPU = torch.device("cpu")


def _reference(x, weights):
    wg, wu, wd = weights
    return (F.silu(x @ wg.T) * (x @ wu.T)) @ wd.T


@pytest.mark.parametrize("name", ["eager_hf", "eager_packed", "swiglu_cupy"])
def test_contender_computes_swiglu_with_the_given_weights(name):
    weights = master_weights(D, H, torch.float64, CPU)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(M, D, generator=g, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(M, D, generator=g, dtype=torch.float64)
    runner = ModuleRunner(build_module(name, D, H, torch.float64, CPU, weights), x, dy)

    x_ref = x.detach().clone().requires_grad_(True)
    y_ref = _reference(x_ref, weights)
    y_ref.backward(dy)
    torch.testing.assert_close(runner.fwd(), y_ref, rtol=1e-12, atol=1e-12)

    runner.zero()
    runner.fwd_bwd()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-12, atol=1e-12)
    grads = [p.grad for p in runner.params]
    assert grads and all(gr is not None and torch.isfinite(gr).all() and gr.abs().sum() > 0 for gr in grads)
    runner.zero()
    assert x.grad is None and all(p.grad is None for p in runner.params)
    assert runner.nograd().grad_fn is None


def test_master_weights_are_seeded_and_scaled():
    first, second = master_weights(D, H, torch.float32, CPU), master_weights(D, H, torch.float32, CPU)
    assert [w.shape for w in first] == [(H, D), (H, D), (D, H)]
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    assert not torch.equal(first[0], first[1])  # gate and up differ


def test_gemm_runner_runs_the_function_gemms():
    weights = master_weights(D, H, torch.float64, CPU)
    r = GemmRunner(D, H, M, torch.float64, CPU, weights)
    wg, wu, wd = weights
    torch.testing.assert_close(r.fwd(), r.h @ wd.T)
    torch.testing.assert_close(r.x12, r.x @ torch.cat([wg, wu]).T)
    r.bwd()
    torch.testing.assert_close(r.dh, r.dy @ wd)
    torch.testing.assert_close(r.dx, r.dx12 @ torch.cat([wg, wu]))
    torch.testing.assert_close(r.dw12, r.dx12.T @ r.x)
    torch.testing.assert_close(r.dw3, r.dy.T @ r.h)


def test_liger_is_unavailable_on_cpu_with_a_reason():
    with pytest.raises(Unavailable, match="liger_kernel is not importable|needs a CUDA device"):
        build_module("liger", D, H, torch.float32, CPU, master_weights(D, H, torch.float32, CPU))


def test_unknown_contender_is_an_error():
    with pytest.raises(ValueError, match="unknown contender 'nope'"):
        build_module("nope", D, H, torch.float32, CPU, master_weights(D, H, torch.float32, CPU))
