"""The opt-in 8-bit saved x12 (``saved_x12="fp8"``): its format (scales,
zero blocks, rounding), saved bytes, accuracy of every variant against
float64 references, the clamp boundary rule, and the modes it combines
with (checkpoint, autocast, torch.compile; the memory modes it refuses).
The kernels' side (host-executed) is at the end."""
import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import swiglu_cupy as sc
from swiglu_cupy import reference
from swiglu_cupy.activations import GLUActivation, deepseek_v4
from swiglu_cupy.kernels.sources import VARIANTS, kernel_name, kernel_variant
from swiglu_cupy.primitives import dispatch, saved_x12
from conftest import assert_nontrivial, rel_rms, spec_of_variant

HALVES, PAIRS = GLUActivation("silu"), GLUActivation("silu", interleaved=True)


def _fp8_roundtrip(x12: torch.Tensor, spec) -> torch.Tensor:
    """What backward reads: x12 quantized and dequantized (float32)."""
    return saved_x12.dequantize_torch(saved_x12.quantize_torch(x12.detach(), spec), x12.shape[1] // 2, spec)


# ---- the format ------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", [HALVES, PAIRS], ids=["halves", "interleaved"])
@pytest.mark.parametrize("H", [1, 100, 128, 200])
def test_scales_are_block_amax_over_448_and_nothing_saturates(spec, H):
    gen = torch.Generator().manual_seed(H)
    M = 5
    x12 = torch.randn(M, 2 * H, generator=gen) * torch.logspace(-3, 3, M).unsqueeze(1)
    x12[2] = 0.0  # a row of zero blocks
    saved = saved_x12.quantize_torch(x12, spec)
    assert saved.dtype == torch.uint8 and saved.shape == (M, saved_x12.saved_row_bytes(H, spec.interleaved))
    q, scales = saved_x12.saved_views(saved, H, spec.interleaved)
    parts = [x12] if spec.interleaved else [x12[:, :H], x12[:, H:]]
    expected = torch.cat([torch.stack([p[:, s:s + 128].abs().amax(1) for s in range(0, p.shape[1], 128)], 1)
                          for p in parts], 1) / 448
    assert torch.equal(scales, expected)
    assert (scales[2] == 0).all() and (q[2].float() == 0).all()  # zero blocks: scale 0, q 0, no NaN
    back = saved_x12.dequantize_torch(saved, H, spec)
    assert torch.isfinite(back).all() and (back[2] == 0).all()
    # every nonzero block reaches 448 exactly (its amax), none beyond: no saturation
    q_parts = [q.float()] if spec.interleaved else [q[:, :H].float(), q[:, H:].float()]
    q_amax = torch.cat([torch.stack([p[:, s:s + 128].abs().amax(1) for s in range(0, p.shape[1], 128)], 1)
                        for p in q_parts], 1)
    assert torch.equal(q_amax[scales > 0], torch.full_like(q_amax[scales > 0], 448.0))
    # one e4m3 rounding of x / scale: half an ulp (2^-4 relative) for normals, 2^-10 * scale below 2^-6
    scale_of = torch.repeat_interleave(scales, 128, 1)
    if not spec.interleaved:
        nb = scales.shape[1] // 2
        scale_of = torch.cat([torch.repeat_interleave(scales[:, :nb], 128, 1)[:, :H],
                              torch.repeat_interleave(scales[:, nb:], 128, 1)[:, :H]], 1)
    scale_of = scale_of[:, :2 * H]
    bound = torch.maximum(x12.abs() * 2 ** -4, scale_of * 2 ** -10) * (1 + 1e-6)
    assert ((back - x12).abs() <= bound).all()


def test_quantized_bytes_are_torchs_e4m3fn_cast_of_x_over_scale():
    x12 = torch.randn(3, 256, dtype=torch.bfloat16)
    saved = saved_x12.quantize_torch(x12, HALVES)
    q, scales = saved_x12.saved_views(saved, 128, False)
    expected = (x12.float() / torch.repeat_interleave(scales, 128, 1)).to(torch.float8_e4m3fn)
    assert torch.equal(q.view(torch.uint8), expected.view(torch.uint8))


def test_bad_values_are_refused_naming_the_argument():
    x, w12, w3 = torch.randn(4, 8), torch.randn(16, 8), torch.randn(8, 8)
    for bad in ("bf16", "FP8", 8, True):
        with pytest.raises(ValueError, match="saved_x12 must be None"):
            sc.swiglu(x, w12, None, w3, None, saved_x12=bad)
    with pytest.raises(ValueError, match="recompute_gate_up"):
        sc.swiglu(x, w12, None, w3, None, saved_x12="fp8", recompute_gate_up=True)
    with pytest.raises(ValueError, match="inplace_backward"):
        sc.SwiGLU(8, 8, saved_x12="fp8", inplace_backward=True)
    with pytest.raises(TypeError, match="float64"):
        sc.swiglu(x.double().requires_grad_(), w12.double(), None, w3.double(), None, saved_x12="fp8")
    with torch.no_grad():  # no graph, nothing saved: the forward runs as without the option
        y = sc.swiglu(x.double(), w12.double(), None, w3.double(), None, saved_x12="fp8")
    assert y.dtype == torch.float64


# ---- saved bytes -----------------------------------------------------------------------------

def _saved_activation_bytes(fn, params) -> int:
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fn()
    ptrs = {p.data_ptr() for p in params}
    return sum(t.numel() * t.element_size() for t in saved if t.data_ptr() not in ptrs)


@pytest.mark.parametrize("activation", [HALVES, PAIRS], ids=["halves", "interleaved"])
def test_dense_fp8_x12_with_scales_is_at_most_053_of_bf16_x12(activation):
    D, H, M = 64, 256, 24
    model = sc.SwiGLU(D, H, dtype=torch.bfloat16, activation=activation)
    x = torch.randn(M, D, dtype=torch.bfloat16, requires_grad=True)
    default = _saved_activation_bytes(lambda: model(x), model.parameters())
    model.saved_x12 = "fp8"
    fp8 = _saved_activation_bytes(lambda: model(x), model.parameters())
    x_bytes, x12_bytes = M * D * 2, M * 2 * H * 2
    assert default == x_bytes + x12_bytes
    assert (fp8 - x_bytes) / x12_bytes <= 0.53
    assert fp8 - x_bytes == M * saved_x12.saved_row_bytes(H, activation.interleaved)


# ---- accuracy ----------------------------------------------------------------------------------

D, H, O = 24, 64, 16
# Against the float64 reference of the contract (x12 read back from its 8
# bits, the gradient passing straight through the rounding): what remains
# is the compute dtype's own rounding (as test_glu.py's bounds).
CONTRACT_BOUND = {torch.float32: 2e-5, torch.bfloat16: 1.5e-2, torch.float16: 3e-3}
# Against the exact float64 feed-forward: e4m3's 3-bit mantissa (half an ulp
# is 2^-4 = 6.25% of a value; measured 0.012-0.043 over the unclamped
# variants here). A clamp's gradient jumps at its limit, so values whose
# saved rounding crosses it flip a mask: the clamped variants' bound is wide
# (measured up to 0.30 with limit 1.5 over x12 ~ N(0, 2^2); the default bf16
# mode reaches 0.20 on the same problems for the same reason).
EXACT_BOUND = {False: 0.05, True: 0.4}


def _problem(dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(9, D, generator=gen, dtype=torch.float64) * 2).to(dtype)
    w12 = (torch.randn(2 * H, D, generator=gen, dtype=torch.float64) / D ** 0.5).to(dtype)
    b12 = (torch.randn(2 * H, generator=gen, dtype=torch.float64) * 0.3).to(dtype)
    w3 = (torch.randn(O, H, generator=gen, dtype=torch.float64) / H ** 0.5).to(dtype)
    dy = torch.randn(9, O, generator=gen, dtype=torch.float64).to(dtype)
    return [x, w12, b12, w3], dy


def _grads(fn, tensors, dy, **kw):
    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    y = fn(leaves[0], leaves[1], leaves[2], leaves[3], None, **kw)
    y.backward(dy)
    return y.detach(), [t.grad for t in leaves]


def _contract_reference(x, w12, b12, w3, b3, activation, dtype):
    """float64 autograd with x12 as the fp8 path saves it: x12 rounded to the
    compute dtype, then through its 8 bits (value only: straight-through)."""
    x12 = F.linear(x, w12, b12)
    stored = _fp8_roundtrip(x12.to(dtype), activation).double()
    x12_saved = x12 + (stored - x12).detach()
    # every gradient at the saved x12, w3's too (backward recomputes h from it); y is not compared
    return F.linear(reference.glu_reference(*reference.split_gate_up(x12_saved, activation), activation), w3, b3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.tag or "swiglu")
def test_every_variant_within_its_bounds_of_float64_references(variant, dtype):
    spec = spec_of_variant(variant)
    tensors, dy = _problem(dtype, seed=VARIANTS.index(variant))
    y, grads = _grads(sc.swiglu, tensors, dy, activation=spec, saved_x12="fp8")
    wide = [t.double() for t in tensors]
    _, grads_c = _grads(_contract_reference, wide, dy.double(), activation=spec, dtype=dtype)
    _, grads_e = _grads(sc.glu_ffn_reference, wide, dy.double(), activation=spec)
    y_default, _ = _grads(sc.swiglu, tensors, dy, activation=spec)
    assert torch.equal(y, y_default)  # the forward's value does not see the 8 bits
    for what, g, g_c, g_e in zip(["x", "w12", "b12", "w3"], grads, grads_c, grads_e):
        assert_nontrivial(g, what)
        assert g.dtype == dtype
        assert rel_rms(g, g_c) < CONTRACT_BOUND[dtype], what
        assert rel_rms(g, g_e) < EXACT_BOUND[variant.clamp], what
    # the 8 bits are really used: the gradients differ from the default mode's
    _, grads_default = _grads(sc.swiglu, tensors, dy, activation=spec)
    assert rel_rms(grads[1], grads_default[1]) > 1e-3


# ---- the kernels (host-executed) against the CPU path --------------------------------------------

def _same_saved(a: torch.Tensor, b: torch.Tensor, H: int, spec) -> None:
    """Quantized bytes and scales identical (the row padding is unspecified)."""
    (qa, sa), (qb, sb) = saved_x12.saved_views(a, H, spec.interleaved), saved_x12.saved_views(b, H, spec.interleaved)
    assert torch.equal(qa.view(torch.uint8), qb.view(torch.uint8))
    assert torch.equal(sa, sb)


def test_kernel_encoder_is_bit_exact_with_torchs_cast_on_every_bf16_value(host_launcher):
    """Each row: 448 (so its block's scale is exactly 1 and q = e4m3(x)), then
    127 bf16 values: every bf16 value of magnitude <= 448 (larger ones would
    change the scale; nothing larger is ever quantized) and every subnormal."""
    allbf16 = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    values = allbf16[allbf16.float().abs() <= 448]
    rows = -(-values.numel() // 127)
    body = torch.zeros(rows * 127, dtype=torch.bfloat16)
    body[:values.numel()] = values
    x12 = torch.cat([torch.full((rows, 1), 448.0, dtype=torch.bfloat16), body.view(rows, 127)], 1)
    spec = GLUActivation("identity", interleaved=True)  # one block of x12 per row
    _, saved = dispatch.run_swiglu_forward_fp8(x12, None, host_launcher, spec)
    q, scales = saved_x12.saved_views(saved, 64, True)
    assert (scales == 1).all()
    assert torch.equal(q.view(torch.uint8), x12.float().to(torch.float8_e4m3fn).view(torch.uint8))


QUANTIZE_SOURCE = r"""
extern "C" __global__ void quantize_each(const float* x, const float* scale, unsigned char* q, long long n) {
    for (long long i = 0; i < n; ++i) q[i] = e4m3_from_float(E4m3Quantizer(scale[i]).quotient(x[i]));
}
"""


def _quantizer_cases() -> tuple[torch.Tensor, torch.Tensor]:
    """(x, scale) pairs: for each scale, x = scale times every bf16 value of
    magnitude <= 448 (the quotients the format meets, e4m3's midpoints
    among them), rounded to fp32 and one and two fp32 ulps on either side;
    also -0, NaN and x beside 0. Scales: ordinary, mantissa all ones, powers
    of two, tiny (the 2^64 boost and its 2^-80 edge), near fp32's largest
    over 448, and 0, inf and NaN."""
    allbf16 = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    quotients = allbf16[allbf16.abs() <= 448]
    ones = torch.tensor([0x3FFFFFFF, 0x1F7FFFFF, 0x5EFFFFFF], dtype=torch.int32).view(torch.float32)
    scales = torch.cat([torch.tensor([1.0, 3.0, 0.1, 1 / 448, 7.3e-3, 2.0 ** -70, 2.0 ** -80, 2.0 ** -80 * 1.5,
                                      2.0 ** -90, 3.3e-30, 2.0 ** 100, 3.4028234e38 / 448]), ones,
                        torch.rand(8, generator=torch.Generator().manual_seed(3)) * 10])
    xs, ss = [], []
    for scale in scales:
        x = quotients * scale
        for step in (-2, -1, 0, 1, 2):
            moved = x
            for _ in range(abs(step)):
                moved = torch.nextafter(moved, torch.full_like(moved, float("inf") if step > 0 else float("-inf")))
            xs.append(moved)
            ss.append(torch.full_like(moved, float(scale)))
    specials = torch.tensor([-0.0, 0.0, float("nan"), 1.0, -3.0, float("inf"), float("-inf")])
    for scale in (0.0, float("inf"), float("nan"), 1.0):
        xs.append(specials)
        ss.append(torch.full_like(specials, scale))
    x, scale = torch.cat(xs), torch.cat(ss)
    # The format never pairs an infinite x with a finite scale, nor a NaN x with a scale other
    # than NaN: x makes its block's scale infinite or NaN.
    keep = ~(x.isinf() & scale.isfinite()) & ~(x.isnan() & ~scale.isnan())
    return x[keep], scale[keep]


SCALE_SOURCE = r"""
extern "C" __global__ void scale_each(const float* amax, float* scale, long long n) {
    for (long long i = 0; i < n; ++i) scale[i] = fp8_block_scale(amax[i]);
}
"""


def test_block_scale_is_bit_equal_to_dividing_by_448():
    """The kernels' ``fp8_block_scale(amax)`` (no division routine) is torch's
    float32 ``amax / 448`` bit for bit: every mantissa at exponents 0, -100
    and 127 (a quotient's rounding depends on the mantissa only, while it is
    normal: amax >= 448 x 2^-126), and 0, inf, NaN, the largest float.
    Host-executed."""
    from swiglu_cupy.kernels import host_exec
    from swiglu_cupy.kernels.sources import compile_options, kernel_files_source

    defines = [o for o in compile_options(torch.float32) if o.startswith("-D")]
    lib = host_exec.build_host_library(kernel_files_source() + SCALE_SOURCE, ["scale_each"], options=defines,
                                       label="fp8_block_scale")
    mantissas = torch.arange(2 ** 23, dtype=torch.int32)
    amax = torch.cat([(mantissas | (exponent + 127) << 23).view(torch.float32) for exponent in (0, -100, 127)]
                     + [torch.tensor([0.0, float("inf"), float("nan"), 3.4028234663852886e38, 448 * 2.0 ** -126])])
    scale = torch.empty_like(amax)
    lib.launch("scale_each", (1, 1, 1), (1, 1, 1), [amax, scale, np.int64(amax.numel())])
    assert torch.equal(scale.view(torch.int32), (amax / 448).view(torch.int32))


@pytest.mark.parametrize("rcp_ulps", [0, -2, -1, 1, 2])
def test_quantizer_is_bit_equal_to_dividing_with_an_inexact_reciprocal(rcp_ulps):
    """The kernels' division-free quantizer gives the bytes of torch's
    ``(x / scale).to(float8_e4m3fn)`` (an IEEE division, then the cast) with
    the hardware reciprocal made up to 2 ulps wrong on purpose (MUFU.RCP is
    within 1): the Newton step and the exact-residual correction absorb it.
    Host-executed; ~2.4 M quotients."""
    from swiglu_cupy.kernels import host_exec
    from swiglu_cupy.kernels.sources import compile_options, kernel_files_source

    defines = [o for o in compile_options(torch.float32) if o.startswith("-D")]
    lib = host_exec.build_host_library(kernel_files_source() + QUANTIZE_SOURCE, ["quantize_each"],
                                       options=[*defines, f"-DSWIGLU_HOST_RCP_ULPS={rcp_ulps}"],
                                       label=f"quantizer_rcp{rcp_ulps}")
    x, scale = _quantizer_cases()
    q = torch.empty(x.numel(), dtype=torch.uint8)
    lib.launch("quantize_each", (1, 1, 1), (1, 1, 1), [x, scale, q, np.int64(x.numel())])
    with torch.no_grad():
        expected = torch.where(scale == 0, 0.0, x / scale).to(torch.float8_e4m3fn).view(torch.uint8)
    bad = (q != expected).nonzero().flatten()
    assert bad.numel() == 0, [(x[i].item(), scale[i].item(), q[i].item(), expected[i].item()) for i in bad[:5]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("spec", [GLUActivation("silu"), GLUActivation("gelu_tanh", limit=1.5),
                                  GLUActivation("oai", limit=1.5, alpha=1.702, up_offset=1.0, interleaved=True),
                                  GLUActivation("relu", interleaved=True)], ids=str)
def test_kernels_match_the_cpu_path(host_launcher, spec, dtype):
    """Forward: h identical to the default kernels' h, the saved bytes and
    scales identical to the CPU path's. Backward from the same saved tensor:
    dx12 and h within a few fp32 ulps of the CPU path (both fp32 math, one
    rounding; erf/tanh/exp differ by an ulp between libm and torch), the
    clamp masks identical. Odd, partial-block and multi-block widths: the
    16-byte instances where H is a multiple of the vector width, the others
    elsewhere."""
    from conftest import glu_error_bounds

    for M, H in [(3, 1), (4, 100), (2, 300), (2, 301), (3, 258), (4, 104), (2, 392), (5, 136)]:
        gen = torch.Generator().manual_seed(M * H)
        x12 = (torch.randn(M, 2 * H, generator=gen) * 2).to(dtype)
        dh = torch.randn(M, H, generator=gen).to(dtype)
        host_launcher.launches.clear()
        h, saved = dispatch.run_swiglu_forward_fp8(x12, None, host_launcher, spec)
        h_cpu, saved_cpu = dispatch.run_swiglu_forward_fp8(x12, "torch", None, spec)
        assert torch.equal(h, dispatch.run_swiglu_forward(x12, None, None, host_launcher, spec))
        _same_saved(saved, saved_cpu, H, spec)
        dx12, h_bwd = dispatch.run_swiglu_backward_fp8(saved_cpu, dh, None, host_launcher, spec)
        dx12_cpu, h_bwd_cpu = dispatch.run_swiglu_backward_fp8(saved_cpu, dh, "torch", None, spec)
        variant = kernel_variant(spec)
        assert [n for n, *_ in host_launcher.launches if "_fp8_" in n] == [
            kernel_name(kind, H % (16 // x12.element_size()) == 0, 1, variant)
            for kind in ("swiglu_forward_fp8", "swiglu_backward_fp8")]
        x12_saved = saved_x12.dequantize_torch(saved_cpu, H, spec)
        h_bound, dx12_bound = glu_error_bounds(x12_saved.to(dtype), dh, spec, h_bwd_cpu, dx12_cpu)
        assert ((h_bwd.double() - h_bwd_cpu.double()).abs() <= h_bound).all()
        assert ((dx12.double() - dx12_cpu.double()).abs() <= dx12_bound).all()
        if spec.limit is not None:
            assert torch.equal(dx12 == 0, dx12_cpu == 0)



def test_float64_builds_no_8_bit_kernels_and_their_launch_says_why(host_launcher):
    """float64 refuses saved_x12="fp8", so its modules leave those kernels
    out; a direct launch gets the API's TypeError, not a missing symbol."""
    from swiglu_cupy.activations import SILU
    from swiglu_cupy.kernels.sources import DEFAULT_VARIANT, kernel_names

    assert not [n for n in kernel_names(DEFAULT_VARIANT, torch.float64) if "_fp8_" in n]
    assert len([n for n in kernel_names(DEFAULT_VARIANT, torch.float32) if "_fp8_" in n]) == 12  # 2 kinds x 2 widths x 3
    x12, dh = torch.randn(3, 16, dtype=torch.float64), torch.randn(3, 8, dtype=torch.float64)
    _, saved = dispatch.run_swiglu_forward_fp8(x12.float(), "torch", None, SILU)
    host_launcher.launches.clear()
    with pytest.raises(TypeError, match="float64"):
        dispatch.run_swiglu_forward_fp8(x12, None, host_launcher, SILU)
    with pytest.raises(TypeError, match="float64"):
        dispatch.run_swiglu_backward_fp8(saved, dh, None, host_launcher, SILU)
    assert not [n for n, *_ in host_launcher.launches if "_fp8_" in n]


# ---- the clamp boundary rule -------------------------------------------------------------------

@pytest.mark.parametrize("implementation", ["torch", "host_kernels"])
@pytest.mark.parametrize("limit, value, saved, passes", [
    (1.02, 1.03, 1.0, True),        # above the limit, saved below it: the gradient passes
    (1.05, 1.04, 120 / 112, False),  # below the limit, saved above it: the gradient is cut
])
def test_clamp_masks_follow_the_saved_value_across_the_limit(implementation, limit, value, saved, passes,
                                                             host_launcher):
    """Each block's amax is 4, so scale = 4/448 = 1/112 and values near 1 are
    saved on the e4m3 grid 104/112, 112/112, 120/112 (step 8 at 112); the
    midpoint 116/112 = 1.0357 rounds to even. A gate (and an up, mirrored to
    -value) whose saved value falls on the other side of the limit takes the
    saved value's mask: the rule in docs/design.md."""
    spec = deepseek_v4(limit)
    gate = torch.tensor([[4.0, value, 0.5]])
    up = torch.tensor([[4.0, 0.5, -value]])
    x12 = torch.cat([gate, up], 1)
    impl, launcher = ("torch", None) if implementation == "torch" else (None, host_launcher)
    _, stored = dispatch.run_swiglu_forward_fp8(x12, impl, launcher, spec)
    back = saved_x12.dequantize_torch(stored, 3, spec)
    assert back[0, 1].item() == pytest.approx(saved, rel=1e-7) and back[0, 5].item() == pytest.approx(-saved, rel=1e-7)
    assert (value > limit) == passes and (saved > limit) != passes  # the rounding crosses the limit
    dx12, _ = dispatch.run_swiglu_backward_fp8(stored, torch.ones(1, 3), impl, launcher, spec)
    dgate, dup = dx12.chunk(2, 1)
    assert (dgate[0, 1] != 0) == passes and (dup[0, 2] != 0) == passes
    assert dgate[0, 2] != 0 and dup[0, 1] != 0  # far from the limit: unaffected
    assert dgate[0, 0] == 0 and dup[0, 0] == 0  # 4 is beyond the limit either way


@pytest.mark.parametrize("implementation", ["torch", "host_kernels"])
def test_saved_value_exactly_at_the_limit_follows_the_rule_in_force(implementation, clamp_rule, host_launcher):
    """Each block's amax is 448, so scale = 1 and 2.0 is saved exactly: a gate
    at +L and an up at -L read back at the limit, and their gradient is passed
    (torch up to 2.13) or 0 (2.14 on), as the rule in force says."""
    spec = deepseek_v4(2.0)
    x12 = torch.cat([torch.tensor([[448.0, 2.0, 0.5]]), torch.tensor([[448.0, 0.5, -2.0]])], 1)
    impl, launcher = ("torch", None) if implementation == "torch" else (None, host_launcher)
    _, stored = dispatch.run_swiglu_forward_fp8(x12, impl, launcher, spec)
    back = saved_x12.dequantize_torch(stored, 3, spec)
    assert back[0, 1].item() == 2.0 and back[0, 5].item() == -2.0
    dx12, _ = dispatch.run_swiglu_backward_fp8(stored, torch.ones(1, 3), impl, launcher, spec)
    dgate, dup = dx12.chunk(2, 1)
    assert (dgate[0, 1] != 0) == clamp_rule and (dup[0, 2] != 0) == clamp_rule
    assert dgate[0, 2] != 0 and dup[0, 1] != 0  # inside the limit: passed under both rules
    gate, up = back.double().chunk(2, 1)
    gate, up = gate.requires_grad_(), up.requires_grad_()
    reference.glu_reference(gate, up, spec, clamp_gradient_at_bound=clamp_rule).sum().backward()
    torch.testing.assert_close(dx12.double(), torch.cat([gate.grad, up.grad], 1), rtol=1e-6, atol=1e-6)


# ---- the modes it combines with ----------------------------------------------------------------

def _model_and_input(dtype=torch.float32, activation="silu"):
    torch.manual_seed(0)
    model = sc.SwiGLU(32, 128, activation=activation, saved_x12="fp8", dtype=dtype)
    return model, torch.randn(3, 5, 32, dtype=dtype, requires_grad=True)


def _all_grads(model, x, fn):
    x.grad = None
    model.zero_grad(set_to_none=True)
    fn().pow(2).sum().backward()
    return [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoint_both_modes_matches_the_plain_fp8_run(use_reentrant):
    model, x = _model_and_input()
    plain = _all_grads(model, x, lambda: model(x))
    ckpt = _all_grads(model, x, lambda: checkpoint(model, x, use_reentrant=use_reentrant))
    for g, g_ref in zip(ckpt, plain):
        assert_nontrivial(g, "grad")
        assert torch.equal(g, g_ref)


def test_autocast_saves_the_8_bits_of_the_bf16_x12():
    model, x = _model_and_input()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = model(x)
    assert y.dtype == torch.bfloat16
    activations = [t for t in saved if t.shape[0] != 2 * 128 and t.shape[0] != 32]  # not the weights
    assert [(t.dtype, tuple(t.shape)) for t in activations] == [
        (torch.bfloat16, (3, 5, 32)), (torch.uint8, (15, saved_x12.saved_row_bytes(128, False)))]
    y.float().pow(2).sum().backward()
    assert_nontrivial(x.grad, "x")
    assert x.grad.dtype == torch.float32


def test_torch_compile_fullgraph_matches_eager():
    from conftest import assert_compiled_matches_eager

    model, x = _model_and_input(activation=GLUActivation("gelu_tanh", limit=2.0, interleaved=True))
    assert_compiled_matches_eager(model, x, tol=1e-5)


def test_moe_saved_x12_fp8_bytes_and_gradients():
    """routed_experts: the saved x12 is the 8-bit tensor (<= 0.53x bf16 x12),
    and the gradients are within the e4m3 bound of the default mode's."""
    from swiglu_cupy.moe import grouped_experts, routed_experts

    torch.manual_seed(0)
    T, D_, I, E, K = 12, 32, 128, 4, 2
    x = torch.randn(T, D_, dtype=torch.bfloat16, requires_grad=True)
    w12 = (torch.randn(E, 2 * I, D_) / D_ ** 0.5).to(torch.bfloat16).requires_grad_()
    w3 = (torch.randn(E, D_, I) / I ** 0.5).to(torch.bfloat16).requires_grad_()
    idx, wts = torch.randint(0, E, (T, K)), torch.rand(T, K)
    runs = {}
    for mode in (None, "fp8"):
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t) or t, lambda t: t):
            y = routed_experts(x, idx, wts, w12, w3, saved_x12=mode)
        x12_like = [t for t in sizes if t.dim() == 2 and t.shape[0] == T * K and t.shape[1] >= 2 * I]
        assert len(x12_like) == 1
        y.float().pow(2).sum().backward()
        runs[mode] = (x12_like[0], [x.grad.clone(), w12.grad.clone(), w3.grad.clone()])
        x.grad = w12.grad = w3.grad = None
    fp8_saved, bf16_saved = runs["fp8"][0], runs[None][0]
    assert fp8_saved.dtype == torch.uint8 and bf16_saved.dtype == torch.bfloat16
    assert fp8_saved.numel() * 1 <= 0.53 * bf16_saved.numel() * 2
    for g, g_ref in zip(runs["fp8"][1], runs[None][1]):
        assert_nontrivial(g, "grad")
        assert 1e-3 < rel_rms(g, g_ref) < 0.05
    offsets = torch.tensor([3, 6, 9, 12], dtype=torch.int32)
    with pytest.raises(ValueError, match="saved_x12 must be None"):
        grouped_experts(x[:12], offsets, w12, w3, saved_x12="e4m3")
    with pytest.raises(ValueError, match="recompute_gate_up"):
        routed_experts(x, idx, wts, w12, w3, saved_x12="fp8", recompute_gate_up=True)


def test_patch_reaches_the_fused_mlp_op():
    from torch import nn

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj = nn.Linear(32, 128, bias=False), nn.Linear(32, 128, bias=False)
            self.down_proj, self.act_fn = nn.Linear(128, 32, bias=False), nn.SiLU()

        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    model = nn.Sequential(MLP())
    assert len(sc.patch(model, saved_x12="fp8")) == 1
    x = torch.randn(6, 32)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        model(x).sum().backward()
    assert any(t.dtype == torch.uint8 for t in saved)
    with pytest.raises(ValueError, match="saved_x12 must be None"):
        sc.patch(model, saved_x12="int8")


def test_torch_func_vmap_of_grad_matches_the_loop():
    """torch.func reaches the registered fp8 ops (vmap folds the batch into
    the rows: the scales are per row, so the result is the loop's up to the
    fp32 GEMMs' summation order, which batching changes: a few ulps of each
    gradient's largest element; the default saved x12 differs from the loop
    as much). The 8-bit x12's own effect on the gradients that read it is far
    larger, so a vmap that bypassed the fp8 ops would fail."""
    model, _ = _model_and_input()
    plain = copy.deepcopy(model)  # the same module saving x12 as computed (functional_call gives both the weights)
    plain.saved_x12 = None
    params = dict(model.named_parameters())
    xs = torch.randn(4, 6, 32)

    def loss(m, p, x):
        return torch.func.functional_call(m, p, (x,)).pow(2).sum()

    batched = torch.func.vmap(torch.func.grad(loss, argnums=1), in_dims=(None, None, 0))(model, params, xs)
    for i in range(xs.shape[0]):
        single = torch.func.grad(loss, argnums=1)(model, params, xs[i])
        unquantized = torch.func.grad(loss, argnums=1)(plain, params, xs[i])
        for name in params:
            assert_nontrivial(single[name], name)
            reorder = 8 * torch.finfo(torch.float32).eps * single[name].abs().max().item()
            torch.testing.assert_close(batched[name][i], single[name], rtol=0, atol=reorder)
            if name != "w3.bias":  # dy alone: the saved x12 does not enter it
                assert (unquantized[name] - single[name]).abs().max() > 100 * reorder, name


def test_swiglu_unpacked_saves_and_computes_what_swiglu_does():
    """Separate gate/up weights write the same x12 buffer: the same 8 bits,
    the same gradients as the packed call."""
    tensors, dy = _problem(torch.bfloat16, seed=7)
    x, w12, b12, w3 = tensors
    _, packed = _grads(sc.swiglu, tensors, dy, saved_x12="fp8")
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, w12[:H], b12[:H], w12[H:], b12[H:], w3)]
    sc.swiglu_unpacked(*leaves[:5], leaves[5], None, saved_x12="fp8").backward(dy)
    grads = [t.grad for t in leaves]
    assert torch.equal(grads[0], packed[0])
    assert torch.equal(torch.cat([grads[1], grads[3]]), packed[1])
    assert torch.equal(torch.cat([grads[2], grads[4]]), packed[2])
    assert torch.equal(grads[5], packed[3])


def test_moe_torch_compile_fullgraph_matches_eager():
    """The MoE ops' fp8 flag under torch.compile: the same forward and gradients as eager."""
    from swiglu_cupy.moe import routed_experts

    torch.manual_seed(0)
    T, D_, I, E, K = 10, 32, 128, 4, 2
    x = torch.randn(T, D_, requires_grad=True)
    w12 = (torch.randn(E, 2 * I, D_) / D_ ** 0.5).requires_grad_()
    w3 = (torch.randn(E, D_, I) / I ** 0.5).requires_grad_()
    idx, wts = torch.randint(0, E, (T, K)), torch.rand(T, K)

    def step(fn):
        x.grad = w12.grad = w3.grad = None
        y = fn(x, idx, wts, w12, w3)
        y.pow(2).sum().backward()
        return [y.detach(), x.grad.clone(), w12.grad.clone(), w3.grad.clone()]

    fn = lambda *a: routed_experts(*a, saved_x12="fp8")  # noqa: E731
    eager, compiled = step(fn), step(torch.compile(fn, fullgraph=True))
    for a, b in zip(compiled, eager):
        assert_nontrivial(b, "grad")
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    default = step(routed_experts)
    assert rel_rms(compiled[2], default[2]) > 1e-3  # the compiled backward read the 8 bits
