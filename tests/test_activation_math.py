"""The kernels' activation math on the GPU, modelled in float32 numpy with
the hardware approximations at their worst, against float64.

On the device the sigmoid is ``rcp.approx(1 + e^-g)`` (MUFU.RCP) with
``e^x = ex2.approx(x * log2 e)`` (MUFU.EX2) for 16-bit storage and accurate
``expf`` for fp32 storage (kernels_cu/swiglu_common.cuh). Host execution runs
libm instead, so these approximations are checked here, as a model: every
fp32 operation of the kernels' formulas is rounded as the GPU rounds it, and
each approximate result is moved by up to ``EX2_ULPS``/``RCP_ULPS``/``EXPF_ULPS``
(twice the 1-2 ulp the approximations are specified to), in every sign
combination. The model follows the formulas of glu_activations.cuh; a change
there must change it too.

Checked: over every finite bf16 and fp16 value (exhaustively) and 200,000
sampled fp32 values, act(g) and act'(g) stay within the bound the kernels are
held to everywhere else (64 fp32 ulps x (1 + g^2): ``MATH_ULPS`` of
``reference.single_rounding_bounds``, the self-check's), and act(g) rounded
once to the storage dtype is within one storage ulp of the float64 value
rounded. docs/design.md ("Activation math") quotes the measured maxima.
"""
import itertools
import math

import numpy as np
import pytest
import torch

from swiglu_cupy.primitives.first_use_check import MATH_ULPS

F32 = np.float32
LOG2E = F32(1.4426950408889634)
EX2_ULPS, RCP_ULPS, EXPF_ULPS = 4, 2, 4
BETA, KAPPA = F32(0.7978845608028654), F32(0.044715)
OAI_ALPHA = F32(1.702)


def _move(r: np.ndarray, ulps: int) -> np.ndarray:
    """``r`` moved by ``ulps`` float32 ulps (an approximation's error); inf and 0 stay."""
    moved = (r + F32(ulps) * np.spacing(np.abs(r).astype(F32))).astype(F32)
    return np.where(np.isfinite(r) & (r != 0), moved, r)


def _exp(x: np.ndarray, fp32_storage: bool, err: int) -> np.ndarray:
    if fp32_storage:  # accurate expf
        return _move(np.exp(x.astype(np.float64)).astype(F32), err)
    z = (x * LOG2E).astype(F32)                         # the product, rounded to fp32
    return _move(np.exp2(z.astype(np.float64)).astype(F32), err)


def _sigmoid_and_complement(z, fp32_storage, exp_err, rcp_err):
    """swiglu_common.cuh's sigmoid_and_complement: s and 1 - s (e * s where e <= 1)."""
    e = _exp((-z).astype(F32), fp32_storage, exp_err)
    s = _move((1.0 / (F32(1) + e).astype(F32).astype(np.float64)).astype(F32), rcp_err)
    with np.errstate(invalid="ignore"):
        c = np.where(e <= 1, (e * s).astype(F32), (F32(1) - s).astype(F32))
    return s, c


def device_activation(kind: str, g: np.ndarray, fp32_storage: bool, exp_err: int, rcp_err: int):
    """(act(g), act'(g)) as the kernels compute them in fp32."""
    one = F32(1)
    z = sigmoid_argument(kind, g)
    s, c = _sigmoid_and_complement(z, fp32_storage, exp_err, rcp_err)
    if kind != "gelu_tanh":  # only GELU-tanh takes the complement; the others compute 1 - s
        c = (one - s).astype(F32)
    if kind in ("silu", "oai"):
        return (g * s).astype(F32), (s * (one + z * c)).astype(F32)
    if kind == "gelu_tanh":
        slope = (BETA * (one + F32(3 * 0.044715) * (g * g).astype(F32))).astype(F32)
        return (g * s).astype(F32), (s + F32(2) * g * (s * c).astype(F32) * slope).astype(F32)
    if kind == "sigmoid":
        return s, (s * c).astype(F32)
    raise ValueError(kind)


def sigmoid_argument(kind: str, g: np.ndarray) -> np.ndarray:
    """What the kernels take the sigmoid of, in fp32 (GELU-tanh: 0.5 (1 + tanh y) = sigmoid(2 y))."""
    if kind == "oai":
        return (g * OAI_ALPHA).astype(F32)
    if kind == "gelu_tanh":
        inner = (BETA * (g + KAPPA * ((g * g).astype(F32) * g).astype(F32)).astype(F32)).astype(F32)
        return (F32(2) * inner).astype(F32)
    return g


def exact_activation(kind: str, g: np.ndarray):
    g = g.astype(np.float64)
    z = g * 1.702 if kind == "oai" else g
    if kind == "gelu_tanh":  # 0.5 (1 + tanh y) = sigmoid(2 y): 1 + tanh(y) would cancel in fp64 itself
        y2 = 2 * math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3)
        e = np.exp(-y2)
        s = 1 / (1 + e)
        one_minus_s = np.where(e <= 1, e * s, 1 - s)
        slope = math.sqrt(2 / math.pi) * (1 + 3 * 0.044715 * g * g)
        return g * s, s + 2 * g * s * one_minus_s * slope
    s = 1 / (1 + np.exp(-z))
    if kind == "sigmoid":
        return s, s * (1 - s)
    return g * s, s * (1 + z * (1 - s))


def _every_value(dtype: torch.dtype) -> np.ndarray:
    bits = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16)
    values = bits.view(dtype).float().numpy()
    return values[np.isfinite(values)]


def _sampled_fp32() -> np.ndarray:
    rng = np.random.default_rng(0)
    samples = [rng.standard_normal(50_000) * scale for scale in (0.5, 2.0, 8.0, 40.0)]
    return np.concatenate(samples + [np.array([0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0, 200.0, -200.0])]).astype(F32)


KINDS = ["silu", "oai", "gelu_tanh", "sigmoid"]
STORAGE = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def worst_errors(kind: str, storage: str):
    """Largest |device - exact| / (2^-24 (1 + g^2)) of act and act', and the
    largest storage-ulp distance of act rounded once, over every error sign."""
    dtype = STORAGE[storage]
    g = _sampled_fp32() if dtype is torch.float32 else _every_value(dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        exact_a, exact_da = exact_activation(kind, g)
    worst = [0.0, 0.0, 0]
    exp_ulps = EXPF_ULPS if dtype is torch.float32 else EX2_ULPS
    with np.errstate(over="ignore", invalid="ignore"):
        z = sigmoid_argument(kind, g)
    in_range = z >= -80
    # Where the sigmoid's argument itself overflows fp32 (|g| near the largest
    # finite value) z * (1 - s) is inf * 0: NaN (the IEEE-division kernels gave NaN there too).
    finite = np.isfinite(z)
    g, z, in_range, exact_a, exact_da = g[finite], z[finite], in_range[finite], exact_a[finite], exact_da[finite]
    scale = 2.0 ** -24 * (1 + g.astype(np.float64) ** 2)
    with np.errstate(over="ignore", invalid="ignore"):
        for exp_err, rcp_err in itertools.product((-exp_ulps, 0, exp_ulps), (-RCP_ULPS, 0, RCP_ULPS)):
            a, da = device_activation(kind, g, dtype is torch.float32, exp_err, rcp_err)
            assert np.isfinite(a).all() and np.isfinite(da).all(), "a non-finite result from a finite argument"
            worst[0] = max(worst[0], float(np.max(np.abs(a - exact_a) / scale)))
            worst[1] = max(worst[1], float(np.max(np.abs(da - exact_da) / scale)))
            stored = torch.from_numpy(a).to(dtype)             # the kernel's one rounding, from fp32
            stored_exact = torch.from_numpy(exact_a).to(dtype)
            magnitude = stored_exact.abs()
            ulp = (torch.nextafter(magnitude, torch.tensor(math.inf, dtype=dtype)) - magnitude).double()
            steps = (stored.double() - stored_exact.double()).abs() / ulp
            # Below -80 the sigmoid's e^-z leaves fp32's range and every fp32 sigmoid (torch's too) is 0.
            held = torch.isfinite(stored_exact) & torch.from_numpy(in_range)
            worst[2] = max(worst[2], int(steps[held].ceil().max().item()))
    return worst


@pytest.mark.parametrize("storage", list(STORAGE))
@pytest.mark.parametrize("kind", KINDS)
def test_device_activation_math_stays_within_the_kernels_bound(kind, storage):
    a_err, da_err, stored_ulps = worst_errors(kind, storage)
    assert a_err <= MATH_ULPS and da_err <= MATH_ULPS, (a_err, da_err)
    if storage != "float32":  # fp32 storage is the math dtype: its bound is the one above
        assert stored_ulps <= 1, stored_ulps


def test_the_model_sees_a_wrong_formula():
    """A sigmoid that drops the 1 + (a planted error) is far outside the bound:
    the comparison is not vacuous."""
    g = _every_value(torch.bfloat16)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        s = _move((1.0 / _exp((-g).astype(F32), False, 0).astype(np.float64)).astype(F32), 0)
        err = np.nanmax(np.abs((g * s).astype(F32) - exact_activation("silu", g)[0])
                        / (2.0 ** -24 * (1 + g.astype(np.float64) ** 2)))
    assert err > 10 * MATH_ULPS
