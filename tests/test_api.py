"""The functional API (api.py): swiglu() and the references on the CPU path, through SwiGLUFunction."""
import ast
import contextlib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import swiglu_cupy as sc
from conftest import assert_nontrivial, rel_rms, swiglu_fp64_reference

# Relative RMS error bounds against a float64 reference computed from the same
# (rounded) inputs. fp32: GEMM accumulation over K <= 96 plus a few roundings,
# ~16 units of 2^-24. bf16: the x12, h and y roundings (2^-9 each) add up to
# about one unit of 2^-8; we allow two. Measured: fp32 ~3e-7, bf16 ~3.8e-3.
REL_RMS_BOUND = {torch.float64: 1e-14, torch.float32: 1e-6, torch.bfloat16: 8e-3}
D, H, O = 64, 96, 48


def _params(dtype, bias12, bias3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    mk = lambda *s: (torch.randn(*s, generator=gen, dtype=torch.float64) / s[-1] ** 0.5).to(dtype)  # noqa: E731
    w12 = mk(2 * H, D)
    b12 = torch.randn(2 * H, generator=gen, dtype=torch.float64).to(dtype) if bias12 else None
    w3 = mk(O, H)
    b3 = torch.randn(O, generator=gen, dtype=torch.float64).to(dtype) if bias3 else None
    return [w12, b12, w3, b3]


def _leaves(tensors):
    return [None if t is None else t.detach().clone().requires_grad_(True) for t in tensors]


def _run(fn, x, params, dy):
    x, params = _leaves([x])[0], _leaves(params)
    y = fn(x, *params)
    y.backward(dy)
    return y, [x.grad] + [None if p is None else p.grad for p in params]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias12,bias3", [(True, True), (False, False), (True, False), (False, True)])
@pytest.mark.parametrize("lead", [(37,), (3, 11)], ids=["2d", "3d"])
def test_functional_parity_with_float64_reference(dtype, bias12, bias3, lead):
    torch.manual_seed(1)
    x = torch.randn(*lead, D, dtype=torch.float64).to(dtype)
    params = _params(dtype, bias12, bias3)
    dy = torch.randn(*lead, O, dtype=torch.float64).to(dtype)

    y, grads = _run(sc.swiglu, x, params, dy)
    y_ref, grads_ref = _run(swiglu_fp64_reference_autograd, x.double(), [None if p is None else p.double() for p in params], dy.double())
    assert y.dtype == dtype and y.shape == (*lead, O)
    bound = REL_RMS_BOUND[dtype]
    assert rel_rms(y, y_ref) < bound
    names = ["x", "w12", "b12", "w3", "b3"]
    for name, g, g_ref in zip(names, grads, grads_ref):
        if g_ref is None:
            assert g is None
            continue
        assert_nontrivial(g, name)
        assert g.dtype == dtype and g.shape == g_ref.shape
        assert rel_rms(g, g_ref) < bound, name

    if dtype == torch.bfloat16:
        # Single rounding: never less accurate than eager bf16 (double rounding).
        y_eager, grads_eager = _run(sc.swiglu_reference, x, params, dy)
        assert rel_rms(y, y_ref) <= 1.1 * rel_rms(y_eager, y_ref)
        for g, g_e, g_ref in zip(grads, grads_eager, grads_ref):
            if g_ref is not None:
                assert rel_rms(g, g_ref) <= 1.1 * rel_rms(g_e, g_ref)


def swiglu_fp64_reference_autograd(x, w12, b12, w3, b3):
    """Independent eager reference: F.linear + F.silu, autograd for gradients."""
    gate = F.linear(x, w12[:H], None if b12 is None else b12[:H])
    up = F.linear(x, w12[H:], None if b12 is None else b12[H:])
    return F.linear(F.silu(gate) * up, w3, b3)


def test_reference_helper_agrees_with_autograd_reference():
    x = torch.randn(5, D, dtype=torch.float64)
    params = _params(torch.float64, True, True)
    assert torch.allclose(swiglu_fp64_reference(x, *params), swiglu_fp64_reference_autograd(x, *params))
    assert torch.allclose(sc.swiglu_reference(x, *params), swiglu_fp64_reference_autograd(x, *params))


@pytest.mark.parametrize("bias", [True, False])
def test_gradcheck_float64(bias):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    w12 = torch.randn(10, 6, dtype=torch.float64, requires_grad=True)
    b12 = torch.randn(10, dtype=torch.float64, requires_grad=True) if bias else None
    w3 = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    b3 = torch.randn(4, dtype=torch.float64, requires_grad=True) if bias else None
    assert torch.autograd.gradcheck(sc.swiglu, (x, w12, b12, w3, b3))


@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "host-kernels"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "separate"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("lead", [(2, 3), (2, 1, 3), (1, 1), (0, 3)], ids=["3d", "4d", "decode", "no-rows"])
def test_output_is_not_a_view_and_has_input_layout(lead, bias, packed, kernels, host_launcher):
    """An N-D x's y is a tensor of its own in x's leading shape (no view: FSDP2
    warns about a view output), with and without grad, whichever GEMM path
    writes it (without a bias torch folds the rows; with one y is allocated),
    and matches the float64 reference."""
    from conftest import primitives_on_host_kernels

    w12, b12, w3, b3 = _params(torch.float32, bias, bias)
    if packed:
        weights = [w12, b12, w3, b3]
    else:  # swiglu_unpacked(x, w1, b1, w2, b2, w3, b3)
        (w1, w2), (b1, b2) = w12.chunk(2), (b12.chunk(2) if bias else (None, None))
        weights = [w1, b1, w2, b2, w3, b3]
    weights = [None if w is None else w.contiguous() for w in weights]
    fn = sc.swiglu if packed else sc.swiglu_unpacked
    x = torch.randn(*lead, D)
    expected = swiglu_fp64_reference(x.double(), *(None if t is None else t.double() for t in (w12, b12, w3, b3)))
    with primitives_on_host_kernels(host_launcher) if kernels else contextlib.nullcontext():
        with torch.no_grad():
            y = fn(x, *weights)
        assert not y._is_view() and y._base is None
        assert y.shape == (*lead, O) and y.is_contiguous()
        if y.numel():
            assert rel_rms(y, expected) < REL_RMS_BOUND[torch.float32]
        x.requires_grad_(True)
        leaves = _leaves(weights)
        y = fn(x, *leaves)
        assert not y._is_view() and y._base is None and y.requires_grad
        assert y.shape == (*lead, O) and y.is_contiguous()
        y.sum().backward()
    assert x.grad.shape == x.shape
    if x.numel():
        assert_nontrivial(x.grad, "x")


def test_non_contiguous_input():
    base = torch.randn(D, 10, dtype=torch.float64)
    x = base.t()  # [10, D], transposed
    params = _params(torch.float64, True, True)
    assert torch.allclose(sc.swiglu(x, *params), swiglu_fp64_reference(x, *params), rtol=1e-12, atol=1e-12)


def test_only_requested_gradients_are_computed():
    x = torch.randn(4, D)
    w12, b12, w3, b3 = _params(torch.float32, True, True)
    w3.requires_grad_(True)
    sc.swiglu(x, w12, b12, w3, b3).sum().backward()
    assert_nontrivial(w3.grad, "w3")
    assert w12.grad is None and x.grad is None


def test_function_is_only_called_through_apply():
    """No code in the package calls SwiGLUFunction.forward directly."""
    package = Path(sc.__file__).parent
    offenders = []
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "forward":
                if isinstance(node.value, ast.Name) and node.value.id == "SwiGLUFunction":
                    offenders.append(f"{path}:{node.lineno}")
    assert offenders == []
    x = torch.randn(3, D, requires_grad=True)
    y = sc.swiglu(x, *_params(torch.float32, True, True))
    assert type(y.grad_fn).__name__ == "SwiGLUFunctionBackward"


def test_saved_tensors_do_not_depend_on_requires_grad():
    """The forward saves the same tensors (x, w12, w3, x12; never h) whether or
    not x requires grad: the property non-reentrant checkpointing relies on."""
    def saved_shapes(x_requires_grad):
        shapes = []
        x = torch.randn(5, D, requires_grad=x_requires_grad)
        params = _leaves(_params(torch.float32, True, True))
        with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
            sc.swiglu(x, *params)
        return shapes

    expected = [(5, D), (2 * H, D), (O, H), (5, 2 * H)]
    assert saved_shapes(True) == expected
    assert saved_shapes(False) == expected


def test_autocast_cpu_bf16_computes_in_bf16_with_param_dtype_grads():
    torch.manual_seed(0)
    x = torch.randn(6, D, requires_grad=True)
    params = _leaves(_params(torch.float32, True, True))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = sc.swiglu(x, *params)
        y_lin = F.linear(x, params[0])
    assert y.dtype == y_lin.dtype == torch.bfloat16
    y.float().sum().backward()
    for p in [x] + params:
        assert p.grad.dtype == torch.float32
        assert_nontrivial(p.grad, "autocast grad")
    ref = swiglu_fp64_reference(x, *params)
    assert rel_rms(y, ref) < 2e-2  # bf16 inputs, weights and outputs


# ---- silu_mul on DTensors (tensor parallelism's column-parallel gate and up) ----------------

def run_silu_mul_dtensor_rank(case, rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(0)  # every rank the same full tensors
    gate_full, up_full, dh_full = (torch.randn(6, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    gate, up = (distribute_tensor(t, mesh, [Shard(1)]).requires_grad_() for t in (gate_full, up_full))
    h = sc.silu_mul(gate, up)
    assert isinstance(h, DTensor) and tuple(h.placements) == (Shard(1),) and h.to_local().shape == (6, 8 // world)
    h.backward(distribute_tensor(dh_full, mesh, [Shard(1)]))
    out = {"h": h.full_tensor(), "dgate": gate.grad.full_tensor(), "dup": up.grad.full_tensor()}
    errors = {}
    for what, (g, u) in {
        "mixed": (distribute_tensor(gate_full, mesh, [Shard(1)]), up_full),
        "layouts": (distribute_tensor(gate_full, mesh, [Shard(1)]), distribute_tensor(up_full, mesh, [Replicate()])),
        "partial": (DTensor.from_local(gate_full, mesh, [Partial()]), DTensor.from_local(up_full, mesh, [Partial()])),
    }.items():
        try:
            sc.silu_mul(g, u)
            errors[what] = None
        except (TypeError, ValueError) as exc:
            errors[what] = str(exc)
    out["errors"] = errors
    return out


def test_silu_mul_on_dtensors_is_shard_by_shard(tmp_path, monkeypatch):
    """Column-sharded DTensor gate/up (2 gloo ranks): the product is a DTensor
    laid out alike, its values and gradients those of the full tensors; mixed
    arguments, different layouts and Partial sums are refused by name."""
    import rank_launcher

    gen = torch.Generator().manual_seed(0)
    gate, up, dh = (torch.randn(6, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    gate.requires_grad_(), up.requires_grad_()
    h = F.silu(gate) * up
    h.backward(dh)
    for out in rank_launcher.launch(run_silu_mul_dtensor_rank, None, tmp_path, monkeypatch, 2, 120):
        torch.testing.assert_close(out["h"], h.detach(), rtol=1e-14, atol=1e-14)
        torch.testing.assert_close(out["dgate"], gate.grad, rtol=1e-14, atol=1e-14)
        torch.testing.assert_close(out["dup"], up.grad, rtol=1e-14, atol=1e-14)
        errors = out["errors"]
        assert "up must be a DTensor" in errors["mixed"]
        assert "up must be laid out as gate" in errors["layouts"]
        assert "must not be Partial" in errors["partial"]
