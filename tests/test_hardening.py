"""Hardening: bad inputs, edge cases, huge index ranges, non-finite values,
determinism and numerical gates. Kernel bodies run host-executed (g++) through
the same launch path as on a GPU; GPU variants are marked."""
import pytest
import torch

try:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
except ModuleNotFoundError as exc:  # optional (the test extra): its property test skips, the rest runs
    _why = f"needs hypothesis ({exc}): pip install 'swiglu-cupy[test]'"

    class _StandIn:  # HealthCheck.X and st.f(...) while the decorators below are evaluated
        def __getattr__(self, name):
            return lambda *args, **kwargs: None

    HealthCheck = st = _StandIn()

    def settings(*args, **kwargs):
        return lambda test: test

    def given(*args, **kwargs):  # a test without parameters, skipped with the reason
        def skipped():
            pass
        return lambda test: pytest.mark.skip(reason=_why)(skipped)

import swiglu_cupy as sc
from swiglu_cupy import primitives
from conftest import (UNIT_ROUNDOFF, assert_nontrivial, primitives_on_host_kernels, rel_rms,
                      swiglu_fp64_reference)

D, H, O = 16, 24, 8
REL_RMS_BOUND = {torch.float64: 1e-13, torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}


def _params(dtype=torch.float32, bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w12 = (torch.randn(2 * H, D, generator=gen, dtype=torch.float64) / D**0.5).to(dtype)
    w3 = (torch.randn(O, H, generator=gen, dtype=torch.float64) / H**0.5).to(dtype)
    b12 = torch.randn(2 * H, generator=gen, dtype=torch.float64).to(dtype) if bias else None
    b3 = torch.randn(O, generator=gen, dtype=torch.float64).to(dtype) if bias else None
    return [w12, b12, w3, b3]


def _x(*lead, dtype=torch.float32):
    return torch.randn(*lead, D, dtype=torch.float64).to(dtype)


def _sparse(t):
    return t.to_sparse()


# (id, builder from the valid (x, w12, b12, w3, b3), error type, message regex)
BAD_INPUTS = [
    ("x-not-tensor", lambda x, a, b, c, d: ([1.0] * D, a, b, c, d), TypeError, "x must be a torch.Tensor"),
    ("w12-none", lambda x, a, b, c, d: (x, None, b, c, d), TypeError, "w12 must be a torch.Tensor"),
    ("w3-numpy", lambda x, a, b, c, d: (x, a, b, c.numpy(), d), TypeError, "w3 must be a torch.Tensor"),
    ("b12-float", lambda x, a, b, c, d: (x, a, 0.5, c, d), TypeError, "b12 must be a torch.Tensor or None"),
    ("b3-list", lambda x, a, b, c, d: (x, a, b, c, [0.0] * O), TypeError, "b3 must be a torch.Tensor or None"),
    ("x-0d", lambda x, a, b, c, d: (x[0, 0], a, b, c, d), ValueError, "x must have shape \\[\\.\\.\\., D\\]"),
    ("w12-1d", lambda x, a, b, c, d: (x, a.flatten(), b, c, d), ValueError, "w12 must be 2-D \\[2H, D\\], got shape \\(768,\\)"),
    ("w12-3d", lambda x, a, b, c, d: (x, a[None], b, c, d), ValueError, "w12 must be 2-D"),
    ("D-mismatch", lambda x, a, b, c, d: (x[..., :-1], a, b, c, d), ValueError, "D = x.shape\\[-1\\] = 15, got shape \\(48, 16\\)"),
    ("w12-odd-rows", lambda x, a, b, c, d: (x, a[:-1], None, c, d), ValueError, "w12 must have 2H rows .* got 47 rows"),
    ("w12-zero-rows", lambda x, a, b, c, d: (x, a[:0], None, c[:, :0], d), ValueError, "got 0 rows"),
    ("w3-inner-dim", lambda x, a, b, c, d: (x, a, b, c[:, :-1], d), ValueError, "w3 must be 2-D \\[O, H\\] with H = 24, got shape \\(8, 23\\)"),
    ("w3-1d", lambda x, a, b, c, d: (x, a, b, c[0], d), ValueError, "w3 must be 2-D"),
    ("b12-short", lambda x, a, b, c, d: (x, a, b[:-2], c, d), ValueError, "b12 must have shape \\(48,\\) = \\(2H,\\), got \\(46,\\)"),
    ("b12-2d", lambda x, a, b, c, d: (x, a, b[None], c, d), ValueError, "b12 must have shape \\(48,\\)"),
    ("b3-long", lambda x, a, b, c, d: (x, a, b, c, torch.cat([d, d])), ValueError, "b3 must have shape \\(8,\\) = \\(O,\\), got \\(16,\\)"),
    ("mixed-dtype-x", lambda x, a, b, c, d: (x.double(), a, b, c, d), TypeError, "w12 must have the same dtype as x \\(torch.float64\\), got torch.float32"),
    ("mixed-dtype-b3", lambda x, a, b, c, d: (x, a, b, c, d.half()), TypeError, "b3 must have the same dtype as x"),
    ("int-x", lambda x, a, b, c, d: (x.long(), a, b, c, d), TypeError, "x must be a floating tensor .* got torch.int64"),
    ("int8-w3", lambda x, a, b, c, d: (x, a, b, c.to(torch.int8), d), TypeError, "w3 must be a floating tensor .* got torch.int8"),
    ("bool-w12", lambda x, a, b, c, d: (x, a.bool(), b, c, d), TypeError, "w12 must be a floating tensor .* got torch.bool"),
    ("complex-x", lambda x, a, b, c, d: (x.to(torch.complex64), a, b, c, d), TypeError, "x must be a floating tensor .* got torch.complex64"),
    ("fp8-w12", lambda x, a, b, c, d: (x, a.to(torch.float8_e4m3fn), b, c, d), TypeError, "w12 must be a floating tensor"),
    ("meta-x", lambda x, a, b, c, d: (x.to("meta"), a, b, c, d), ValueError, "x is a meta tensor"),
    ("meta-w3", lambda x, a, b, c, d: (x, a, b, c.to("meta"), d), ValueError, "w3 is a meta tensor"),
    ("sparse-w12", lambda x, a, b, c, d: (x, _sparse(a), b, c, d), TypeError, "w12 must be a dense \\(strided\\) tensor, got layout torch.sparse_coo"),
    ("sparse-x", lambda x, a, b, c, d: (_sparse(x), a, b, c, d), TypeError, "x must be a dense"),
    ("expanded-w12", lambda x, a, b, c, d: (x, a[:1].expand(2 * H, D), b, c, d), ValueError, "w12 is an expanded view \\(stride 0"),
    ("expanded-b12", lambda x, a, b, c, d: (x, a, b[:1].expand(2 * H), c, d), ValueError, "b12 is an expanded view"),
    ("flag-not-bool", None, TypeError, "inplace_backward must be a bool, got str"),
]


@pytest.mark.parametrize("case_id,build,error,match", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_raises_naming_the_argument_before_any_launch(case_id, build, error, match, monkeypatch):
    def no_launch(*a, **k):
        raise AssertionError("a primitive ran on bad input")

    # Both implementations' entry points, whichever way the call was dispatched.
    for name in ("swiglu_forward_torch", "swiglu_backward_torch", "silu_mul_forward_torch", "silu_mul_backward_torch"):
        monkeypatch.setattr(primitives.torch_impl, name, no_launch)
    for name in ("launch_swiglu_forward", "launch_swiglu_backward", "launch_silu_mul_forward",
                 "launch_silu_mul_backward", "launch_swiglu_forward_fp8", "launch_swiglu_backward_fp8",
                 "swiglu_forward_on", "silu_mul_forward_on", "swiglu_backward_on", "swiglu_backward_halves_on"):
        monkeypatch.setattr(primitives.cuda_impl, name, no_launch)
    valid = (_x(5), *_params())
    with pytest.raises(error, match=match):
        if build is None:
            sc.swiglu(*valid, inplace_backward="yes")
        else:
            sc.swiglu(*build(*valid))


def test_bad_input_table_is_large_enough():
    assert len(BAD_INPUTS) >= 25


@pytest.mark.gpu
def test_two_cuda_devices_are_rejected():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    x, w12, b12, w3, b3 = _x(5).cuda(0), *[t.cuda(1) for t in _params()]
    with pytest.raises(ValueError, match="w12 must have the same device as x \\(cuda:0\\), got cuda:1"):
        sc.swiglu(x, w12, b12, w3, b3)


@pytest.mark.gpu
def test_cpu_cuda_mix_is_rejected():
    x, w12, b12, w3, b3 = _x(5).cuda(), *_params()
    with pytest.raises(ValueError, match="w12 must have the same device as x"):
        sc.swiglu(x, w12, b12, w3, b3)


@pytest.fixture(params=["torch", "host_kernels"])
def path(request, host_launcher):
    """Run the CPU tests through the torch primitives or the host-executed kernels."""
    if request.param == "torch":
        yield request.param
        return
    with primitives_on_host_kernels(host_launcher):
        yield request.param


def _check_against_reference(x, params, dtype):
    x = x.detach().requires_grad_(True)
    params = [None if p is None else p.detach().requires_grad_(True) for p in params]
    y = sc.swiglu(x, *params)
    dy = torch.randn_like(y)
    y.backward(dy)
    xr = x.detach().double().requires_grad_(True)
    pr = [None if p is None else p.detach().double().requires_grad_(True) for p in params]
    yr = sc.swiglu_reference(xr, *pr)
    yr.backward(dy.double())
    assert rel_rms(y, yr) < REL_RMS_BOUND[dtype]
    for g, r in zip([x.grad] + [p.grad for p in params if p is not None],
                    [xr.grad] + [p.grad for p in pr if p is not None]):
        if r.numel() and r.abs().max() > 0:
            assert_nontrivial(g, "grad")
            assert rel_rms(g, r) < REL_RMS_BOUND[dtype]


def test_empty_batch_gives_empty_output_and_zero_grads(path):
    x = torch.empty(0, D, requires_grad=True)
    params = [p.requires_grad_(True) for p in _params()]
    y = sc.swiglu(x, *params)
    assert y.shape == (0, O)
    y.sum().backward()
    assert x.grad.shape == (0, D)
    for p in params:
        assert p.grad is not None and torch.equal(p.grad, torch.zeros_like(p))


@pytest.mark.parametrize("hidden,dim", [(1, D), (7, D), (H, 1), (1, 1)])
def test_tiny_and_odd_sizes(path, hidden, dim):
    torch.manual_seed(0)
    x = torch.randn(9, dim, dtype=torch.float64)
    params = [torch.randn(2 * hidden, dim, dtype=torch.float64), torch.randn(2 * hidden, dtype=torch.float64),
              torch.randn(5, hidden, dtype=torch.float64), torch.randn(5, dtype=torch.float64)]
    _check_against_reference(x, params, torch.float64)


@pytest.mark.parametrize("layout", ["transposed", "sliced", "stepped", "odd-offset"])
def test_non_contiguous_and_offset_inputs(path, layout):
    torch.manual_seed(0)
    x, (w12, b12, w3, b3) = _x(6, 3), _params()
    if layout == "transposed":
        x = x.transpose(0, 1).contiguous().transpose(0, 1)
        w12 = w12.t().contiguous().t()
        w3 = w3.t().contiguous().t()
    elif layout == "sliced":
        x = torch.cat([x, x], dim=-1)[..., :D]
        w12 = torch.cat([w12, w12], dim=1)[:, D:]
    elif layout == "stepped":
        x = torch.stack([x, x], dim=-1)[..., 0]
        w3 = torch.stack([w3, w3], dim=-1)[..., 1]
    else:
        x = torch.cat([torch.zeros(1), x.flatten()])[1:].view(x.shape)
        w12 = torch.cat([torch.zeros(3), w12.flatten()])[3:].view(w12.shape)
        b12 = torch.cat([torch.zeros(1), b12])[1:]
    assert not (x.is_contiguous() and w12.is_contiguous() and w3.is_contiguous()) or layout == "odd-offset"
    _check_against_reference(x, [w12, b12, w3, b3], torch.float32)


def _eager_primitives(x12, dh):
    g, u = x12.chunk(2, dim=1)
    g = g.clone().requires_grad_(True)
    u = u.clone().requires_grad_(True)
    h = torch.nn.functional.silu(g) * u
    dg, du = torch.autograd.grad(h, (g, u), dh)
    return h.detach(), torch.cat([dg, du], dim=1)


def _same_non_finite_pattern(got, expected):
    assert torch.equal(torch.isnan(got), torch.isnan(expected))
    assert torch.equal(torch.isposinf(got), torch.isposinf(expected))
    assert torch.equal(torch.isneginf(got), torch.isneginf(expected))
    finite = torch.isfinite(expected)
    assert torch.allclose(got[finite], expected[finite], rtol=1e-5, atol=1e-30)


def test_inf_and_nan_propagate_like_eager(path):
    special = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, 1.0, -1.0, 100.0, -100.0])
    g = special.repeat_interleave(len(special))
    u = special.repeat(len(special))
    x12 = torch.cat([g, u]).view(2, -1).t().reshape(-1, 2).contiguous()  # [64, 2]: H = 1
    dh = torch.ones(x12.shape[0], 1)
    h = primitives.swiglu_forward(x12)
    dx12, h2 = primitives.swiglu_backward(x12, dh)
    h_ref, dx12_ref = _eager_primitives(x12, dh)
    _same_non_finite_pattern(h, h_ref)
    _same_non_finite_pattern(h2, h_ref)
    _same_non_finite_pattern(dx12, dx12_ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_extreme_magnitudes_do_not_overflow_where_fp32_does_not(path, dtype):
    big = torch.finfo(dtype).max
    gates = torch.tensor([-big, -1e4, -90.0, -20.0, -1e-3, 1e-3, 20.0, 90.0, 250.0, 1e4])
    ups = torch.tensor([1e-3, 2.0, 250.0, -1e-4])
    x12 = torch.cat([gates.repeat_interleave(4)[:, None], ups.repeat(10)[:, None]], dim=1).to(dtype)
    dh = torch.full((40, 1), 0.5).to(dtype)
    h = primitives.swiglu_forward(x12)
    dx12, _ = primitives.swiglu_backward(x12, dh)
    g, u = x12.float().chunk(2, dim=1)
    s = torch.sigmoid(g)
    h_ref32 = g * s * u
    dg_ref32 = dh.float() * u * s * (1 + g * (1 - s))
    for got, ref in ((h, h_ref32), (dx12[:, :1], dg_ref32)):
        fits = ref.abs() <= big
        assert torch.isfinite(got[fits]).all()
        assert torch.equal(got.float()[fits], ref.to(dtype).float()[fits]) or \
            ((got.float() - ref.to(dtype).float())[fits].abs() <= 2 * UNIT_ROUNDOFF[dtype] * 2 * ref[fits].abs()).all()


def test_sigmoid_of_huge_negative_gate_is_stable(path):
    x12 = torch.tensor([[-3e38, 5.0], [-1e30, -5.0], [3e38, 1e-30]])
    dh = torch.ones(3, 1)
    h = primitives.swiglu_forward(x12)
    dx12, _ = primitives.swiglu_backward(x12, dh)
    assert torch.isfinite(h[:2]).all() and (h[:2] == 0).all()
    assert torch.isfinite(dx12[:2]).all()


def test_index_range_beyond_2_pow_31_on_host(host_launcher):
    """The real kernels, host-executed, over rows whose element offsets exceed
    2^31 (and 2^32): a sparse strided view of a huge, mostly untouched buffer."""
    dtype, H_ = torch.float16, 64
    ld = 2**31 + 64                      # row stride in elements; 16-byte aligned rows
    storage = torch.empty(2 * ld + 2 * H_, dtype=dtype)   # ~8 GiB virtual, 3 rows touched
    x12 = storage.as_strided((3, 2 * H_), (ld, 1))
    values = torch.randn(3, 2 * H_).to(dtype)
    x12.copy_(values)
    dh = torch.randn(3, H_).to(dtype)
    h_ref = primitives.swiglu_forward(values, implementation="torch")
    dx12_ref, _ = primitives.swiglu_backward(values, dh, implementation="torch")

    h = primitives.swiglu_forward(x12, launcher=host_launcher)
    assert host_launcher.launches[-1][0] == "swiglu_forward_vec_p1"
    torch.testing.assert_close(h, h_ref, rtol=2**-10, atol=0)
    dx12, h2 = primitives.swiglu_backward(x12, dh, dx12_out=x12, launcher=host_launcher)  # stores at 2^32+
    torch.testing.assert_close(h2, h_ref, rtol=2**-10, atol=0)
    torch.testing.assert_close(x12.clone(), dx12_ref, rtol=2**-10, atol=1e-7)
    # Scalar path too: an output shifted by one element is misaligned.
    primitives.swiglu_forward(values, out=x12[:, 1:H_ + 1], launcher=host_launcher)
    assert host_launcher.launches[-1][0] == "swiglu_forward_scalar_p1"
    torch.testing.assert_close(x12[:, 1:H_ + 1].clone(), h_ref, rtol=2**-10, atol=0)


def _assert_backward_bitwise_deterministic(m, x):
    runs = []
    for _ in range(2):
        x.grad = None
        m.zero_grad(set_to_none=True)
        m(x).float().pow(2).sum().backward()
        runs.append([x.grad.clone()] + [p.grad.clone() for p in m.parameters()])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_backward_is_bitwise_deterministic(path):
    torch.manual_seed(0)
    m = sc.SwiGLU(D, H, O, dtype=torch.bfloat16)
    _assert_backward_bitwise_deterministic(m, _x(33, dtype=torch.bfloat16).requires_grad_(True))


def _ulp_distance(got: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """|got - exact| in units of the last place of got's dtype at |exact|."""
    mantissa_bits = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23, torch.float64: 52}[got.dtype]
    magnitude = exact.abs().clamp_min(torch.finfo(got.dtype).smallest_normal)
    spacing = torch.exp2(torch.floor(torch.log2(magnitude)) - mantissa_bits)
    return (got.double() - exact).abs() / spacing


def test_ulp_helper():
    one = torch.tensor([1.0], dtype=torch.float64)
    assert _ulp_distance(torch.tensor([1.0 + 2**-7], dtype=torch.bfloat16), one).item() == 1
    assert _ulp_distance(torch.tensor([1.0], dtype=torch.float16), one).item() == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_forward_within_two_ulps_of_reference_from_same_x12(path, dtype):
    torch.manual_seed(1)
    x12 = (torch.randn(256, 2 * 40) * 3).to(dtype)
    exact = torch.nn.functional.silu(x12.double()[:, :40]) * x12.double()[:, 40:]
    ulps = _ulp_distance(primitives.swiglu_forward(x12), exact)
    assert ulps.max() <= 2, ulps.max()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(M=st.integers(0, 24), hidden=st.integers(1, 40), dim=st.integers(1, 12),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]),
       bias12=st.booleans(), bias3=st.booleans(), seed=st.integers(0, 2**16))
def test_property_host_kernels_match_reference(host_launcher, M, hidden, dim, dtype, bias12, bias3, seed):
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    x12 = (rnd(M, 2 * hidden) * 2).to(dtype)
    dh = rnd(M, hidden).to(dtype)
    h = primitives.swiglu_forward(x12, launcher=host_launcher)
    dx12, h2 = primitives.swiglu_backward(x12, dh, launcher=host_launcher)
    h_ref, dx12_ref = _eager_primitives(x12.double(), dh.double())
    assert torch.equal(h, h2)
    if M:
        if dtype in (torch.bfloat16, torch.float16):  # one rounding: the 2-ulp gate
            assert _ulp_distance(h, h_ref).max() <= 2
        else:  # a few ulps of fp32/fp64 math
            assert rel_rms(h, h_ref) < 16 * UNIT_ROUNDOFF[dtype]
        assert rel_rms(dx12, dx12_ref) < 2 * UNIT_ROUNDOFF[dtype] + 1e-6

    x = rnd(3, dim).to(dtype)
    w12, w3 = (rnd(2 * hidden, dim) / dim**0.5).to(dtype), (rnd(4, hidden) / hidden**0.5).to(dtype)
    b12 = rnd(2 * hidden).to(dtype) if bias12 else None
    b3 = rnd(4).to(dtype) if bias3 else None
    with primitives_on_host_kernels(host_launcher):
        y = sc.swiglu(x, w12, b12, w3, b3)
    ref = swiglu_fp64_reference(x, w12, b12, w3, b3)
    bound = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}[dtype]
    assert rel_rms(y, ref) < bound or ref.abs().max() < 1e-6


@pytest.mark.gpu
def test_gpu_tensors_past_2_pow_31_elements():
    M, H_ = 2**17 + 3, 2**14                    # x12: M * 2H ~ 4.3e9 elements (8.6 GB bf16)
    x12 = torch.randn(M, 2 * H_, device="cuda", dtype=torch.bfloat16)
    dh = torch.randn(M, H_, device="cuda", dtype=torch.bfloat16)
    h = primitives.swiglu_forward(x12, implementation="kernels")
    rows = torch.tensor([0, 2**31 // (2 * H_) - 1, 2**31 // (2 * H_), 2**32 // (2 * H_), M - 1])
    ref_h = primitives.swiglu_forward(x12[rows].cpu(), implementation="torch")
    torch.testing.assert_close(h[rows].cpu(), ref_h, rtol=2**-7, atol=1e-6)
    del h
    dx12, _ = primitives.swiglu_backward(x12, dh, implementation="kernels")
    ref_dx12, _ = primitives.swiglu_backward(x12[rows].cpu(), dh[rows].cpu(), implementation="torch")
    torch.testing.assert_close(dx12[rows].cpu(), ref_dx12, rtol=2**-7, atol=1e-5)


@pytest.mark.gpu
def test_gpu_backward_is_bitwise_deterministic():
    torch.manual_seed(0)
    m = sc.SwiGLU(256, 688, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    _assert_backward_bitwise_deterministic(m, x)


@pytest.mark.gpu
@pytest.mark.parametrize("M,hidden", [(0, 8), (5, 1), (9, 7), (3, 1001)])
def test_gpu_edge_shapes(M, hidden):
    x12 = torch.randn(M, 2 * hidden, device="cuda")
    dh = torch.randn(M, hidden, device="cuda")
    h = primitives.swiglu_forward(x12, implementation="kernels")
    dx12, _ = primitives.swiglu_backward(x12, dh, implementation="kernels")
    ref_dx12, ref_h = primitives.swiglu_backward(x12.cpu(), dh.cpu(), implementation="torch")
    torch.testing.assert_close(h.cpu(), ref_h, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx12.cpu(), ref_dx12, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_gpu_inf_and_nan_like_eager():
    special = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, 1.0, -100.0])
    x12 = torch.stack([special.repeat_interleave(6), special.repeat(6)], dim=1).cuda()
    dh = torch.ones(36, 1, device="cuda")
    h = primitives.swiglu_forward(x12, implementation="kernels")
    dx12, _ = primitives.swiglu_backward(x12, dh, implementation="kernels")
    h_ref, dx12_ref = _eager_primitives(x12.cpu(), dh.cpu())
    _same_non_finite_pattern(h.cpu(), h_ref)
    _same_non_finite_pattern(dx12.cpu(), dx12_ref)
