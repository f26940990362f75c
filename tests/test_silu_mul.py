"""The public fused activation ``silu_mul(gate, up)``: parity with float64,
one rounding, gradients, the host-executed kernels through the whole
Function, bad input, DLPack arrays, checkpointing and torch.compile."""
import numpy as np
import pytest
import torch
from torch.utils.checkpoint import checkpoint

import swiglu_cupy as sc
from conftest import (DTYPES_ALL, UNIT_ROUNDOFF, assert_compiled_matches_eager, assert_nontrivial,
                      primitives_on_host_kernels, rel_rms)

H = 24


def _pair(*shape, dtype=torch.float64, requires_grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    gate = (3 * torch.randn(*shape, generator=g, dtype=torch.float64)).to(dtype)
    up = torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)
    return gate.requires_grad_(requires_grad), up.requires_grad_(requires_grad)


def _exact(gate, up, dh):
    """float64 forward and gradients by autograd of the eager formula."""
    g, u = gate.detach().double().requires_grad_(), up.detach().double().requires_grad_()
    h = torch.nn.functional.silu(g) * u
    h.backward(dh.double())
    return h.detach(), g.grad, u.grad


def test_float64_parity_and_gradcheck():
    gate, up = _pair(3, 5, H, requires_grad=True)
    torch.testing.assert_close(sc.silu_mul(gate, up), sc.silu_mul_reference(gate, up), rtol=1e-14, atol=1e-14)
    assert torch.autograd.gradcheck(sc.silu_mul, (gate, up))


def _assert_one_rounding(outputs, gate, up, dh):
    """(h, dgate, dup) each within one storage ulp (plus fp32-math slack, as
    large as the terms) of the float64 result from the same stored inputs."""
    dtype = gate.dtype
    exact = _exact(gate, up, dh)
    ulp = 2 * UNIT_ROUNDOFF[dtype]
    math_eps = 8 * UNIT_ROUNDOFF[torch.float64 if dtype == torch.float64 else torch.float32]
    g, u, d = gate.detach().double(), up.detach().double(), dh.double()
    scales = ((g * u).abs(), (d * u).abs() * (1 + g.abs()), (d * g).abs())
    for got, want, scale, name in zip(outputs, exact, scales, ("h", "dgate", "dup")):
        assert got.dtype == dtype
        assert_nontrivial(got, name)
        bound = want.abs() * ulp + scale * math_eps + torch.finfo(dtype).tiny
        assert ((got.detach().double() - want).abs() <= bound).all(), name


@pytest.mark.parametrize("dtype", DTYPES_ALL)
def test_one_rounding_against_float64(dtype):
    gate, up = _pair(64, H, dtype=dtype, requires_grad=True)
    dh = torch.randn(64, H, dtype=torch.float64).to(dtype)
    h = sc.silu_mul(gate, up)
    h.backward(dh)
    _assert_one_rounding((h, gate.grad, up.grad), gate, up, dh)


def test_bf16_is_more_accurate_than_eager_double_rounding():
    gate, up = _pair(512, H, dtype=torch.bfloat16)
    exact = _exact(gate, up, torch.zeros(512, H))[0]
    ours, eager = rel_rms(sc.silu_mul(gate, up), exact), rel_rms(sc.silu_mul_reference(gate, up), exact)
    assert ours <= eager


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("odd_h", [7, 13])
def test_host_executed_kernels_through_the_function(host_launcher, dtype, odd_h):
    """Odd H and strided inputs (columns of a wider buffer, a transposed
    view) run the .cu kernels end to end, with one rounding."""
    torch.manual_seed(1)
    wide = 3 * torch.randn(6, 3 * odd_h, dtype=dtype)
    gate = wide[:, 1:odd_h + 1].clone().requires_grad_()            # contiguous, odd H
    up_strided = wide[:, odd_h + 2:2 * odd_h + 2]                     # row stride 3H
    up_t = torch.randn(odd_h, 6, dtype=dtype).t()                     # non-unit inner stride
    for up_src in (up_strided, up_t):
        up = up_src.detach().requires_grad_()
        dh = torch.randn(6, odd_h, dtype=dtype)
        gate.grad = None
        with primitives_on_host_kernels(host_launcher):
            h = sc.silu_mul(gate, up)
            h.backward(dh)
        _assert_one_rounding((h, gate.grad, up.grad), gate, up, dh)


BAD = [
    ("shape", lambda: (torch.randn(2, 3), torch.randn(2, 4)), ValueError, "up must have the shape of gate"),
    ("dtype", lambda: (torch.randn(2, 3), torch.randn(2, 3).double()), TypeError, "up must have the dtype"),
    ("device", lambda: (torch.randn(2, 3), torch.randn(2, 3, device="meta")), ValueError, "up"),
    ("int", lambda: (torch.ones(2, 3, dtype=torch.int32), torch.ones(2, 3, dtype=torch.int32)), TypeError,
     "gate must be a floating tensor"),
    ("0-d", lambda: (torch.tensor(1.0), torch.tensor(1.0)), ValueError, "gate must have shape"),
    ("not a tensor", lambda: ([1.0], torch.randn(1)), TypeError, "gate must be a torch.Tensor"),
    ("up not an array", lambda: (np.ones((2, 3), np.float32), [1.0]), TypeError, "up must be a DLPack array"),
]


@pytest.mark.parametrize("case,build,error,match", BAD, ids=[b[0] for b in BAD])
def test_bad_input_names_the_argument(case, build, error, match):
    with pytest.raises(error, match=match):
        sc.silu_mul(*build())


def test_empty_and_leading_dims():
    gate, up = _pair(2, 0, 5, H)
    assert sc.silu_mul(gate, up).shape == (2, 0, 5, H)
    gate, up = _pair(4, 0)
    assert sc.silu_mul(gate, up).shape == (4, 0)
    gate, up = _pair(2, 3, 4, H)
    torch.testing.assert_close(sc.silu_mul(gate, up), sc.silu_mul_reference(gate, up))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_numpy_in_and_out_through_dlpack(dtype):
    rng = np.random.default_rng(0)
    gate, up = rng.standard_normal((5, H)).astype(dtype), rng.standard_normal((5, H)).astype(dtype)
    h = sc.silu_mul(gate, up)
    assert isinstance(h, np.ndarray) and h.dtype == dtype and h.shape == (5, H)
    expected = gate / (1 + np.exp(-gate.astype(np.float64))) * up
    np.testing.assert_allclose(h, expected, rtol=1e-6 if dtype == np.float32 else 1e-13)
    # Zero copy on the way in: torch reads numpy's own buffer.
    assert torch.from_dlpack(gate).data_ptr() == gate.__array_interface__["data"][0]


def test_saves_only_its_inputs_whatever_requires_grad():
    for requires_grad in (True, False):
        gate, up = _pair(4, H)
        gate.requires_grad_(requires_grad)
        up.requires_grad_(True)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            sc.silu_mul(gate, up)
        assert [t.data_ptr() for t in saved] == [gate.data_ptr(), up.data_ptr()]


class _GateUp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.gate = torch.nn.Linear(16, H, dtype=torch.float64)
        self.up = torch.nn.Linear(16, H, dtype=torch.float64)

    def forward(self, x):
        return sc.silu_mul(self.gate(x), self.up(x))


@pytest.mark.parametrize("mode", ["non_reentrant", "reentrant"])
@pytest.mark.parametrize("autocast", [False, True])
def test_checkpoint_gives_the_same_gradients(mode, autocast):
    model = _GateUp().float()
    x = torch.randn(3, 16, requires_grad=mode == "reentrant")  # reentrant needs an input with grad

    def grads(use_checkpoint):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = checkpoint(model, x, use_reentrant=mode == "reentrant") if use_checkpoint else model(x)
        y.float().pow(2).sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    for got, want in zip(grads(True), grads(False)):
        assert_nontrivial(want, "grad")
        assert torch.equal(got, want)


def test_torch_compile_and_opcheck():
    x = torch.randn(5, 16, dtype=torch.float64, requires_grad=True)
    assert_compiled_matches_eager(_GateUp(), x, tol=1e-12)
    gate, up = _pair(5, H, dtype=torch.float32)
    torch.library.opcheck(torch.ops.swiglu_cupy.silu_mul_forward.default, (gate, up))
    torch.library.opcheck(torch.ops.swiglu_cupy.silu_mul_backward.default, (gate, up, torch.randn(5, H)))


def test_only_called_through_apply():
    gate, up = _pair(2, H, requires_grad=True)
    assert type(sc.silu_mul(gate, up).grad_fn).__name__ == "SiluMulFunctionBackward"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_cuda_silu_mul_function_matches_cpu_float64(dtype):
    gate, up = _pair(257, 131, dtype=dtype)
    gate, up = gate.cuda().requires_grad_(), up.cuda().requires_grad_()
    dh = torch.randn(257, 131, device="cuda").to(dtype)
    h = sc.silu_mul(gate, up)
    h.backward(dh)
    exact = _exact(gate.cpu(), up.cpu(), dh.cpu())
    for got, want in zip((h, gate.grad, up.grad), exact):
        assert_nontrivial(got, "cuda")
        assert rel_rms(got.cpu(), want) < 4 * UNIT_ROUNDOFF[dtype]


@pytest.mark.gpu
def test_cupy_in_and_out_through_dlpack():
    cupy = pytest.importorskip("cupy")
    gate = cupy.random.standard_normal((33, 65), dtype=cupy.float32)
    up = cupy.random.standard_normal((33, 65), dtype=cupy.float32)
    h = sc.silu_mul(gate, up)
    assert isinstance(h, cupy.ndarray)
    expected = gate / (1 + cupy.exp(-gate)) * up
    assert float(cupy.abs(h - expected).max()) < 1e-5
