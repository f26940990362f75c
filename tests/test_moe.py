"""The MoE experts op (swiglu_cupy.moe): parity with a float64 loop-over-experts
reference (output and every gradient, routing weights included), both GEMM
paths (grouped_mm and the per-expert loop), what is saved for backward,
checkpointing, edge cases of the routing, bad arguments, torch.compile,
autocast, FSDP2 and meta-device init on 2 gloo ranks."""
from contextlib import nullcontext

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import rank_launcher
import swiglu_cupy.moe as moe
from swiglu_cupy.moe import grouped, routing
from conftest import (assert_nontrivial, primitives_on_host_kernels, rel_rms, routed_saved_bytes, routed_saved_bytes_a6d6350,
                      routed_saved_ratio_goal, zero_filled_shapes)
from swiglu_cupy.activations import GPT_OSS, SILU, GLUActivation, deepseek_v4
from swiglu_cupy.tools.bench.moe import saved_activation_bytes

# Relative RMS error bounds against the float64 reference: a few roundings of
# the storage dtype (GEMM outputs are rounded, the activation once).
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2, torch.float64: 1e-12}

SPECS = {"silu": SILU, "gpt_oss": GPT_OSS, "deepseek_v4": deepseek_v4(0.5), "gelu_tanh": GLUActivation("gelu_tanh")}


def make(E=4, D=64, I=32, T=37, K=2, dtype=torch.float32, transposed=False, bias=False, seed=0, device="cpu"):
    """Inputs of routed_experts: x, router logits (top-k weights are a softmax
    of them, so the router gets a gradient), ids and the expert weights."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *shape, s=1.0: (torch.randn(*shape, generator=gen) * s).to(device, dtype).requires_grad_()  # noqa: E731
    x = r(T, D)
    logits = r(T, E)
    ids = torch.randn(T, E, generator=gen).topk(K, -1).indices.to(device)
    w12 = r(*((E, D, 2 * I) if transposed else (E, 2 * I, D)), s=D ** -0.5 * 2)
    w3 = r(*((E, I, D) if transposed else (E, D, I)), s=I ** -0.5)
    b12 = r(E, 2 * I, s=0.5) if bias else None
    b3 = r(E, D, s=0.5) if bias else None
    return x, logits, ids, w12, w3, b12, b3


# How the op runs the groups' GEMMs: grouped_mm, or a loop of plain GEMMs
# (what it falls back to where grouped_mm refuses; forced here).
SCHEDULES = ["grouped", "loop"]


def use_schedule(monkeypatch, name):
    if name == "loop":
        monkeypatch.setattr(grouped, "grouped_mm_runs", lambda *a: False)


def routing_weights(logits, ids):
    return logits.gather(1, ids).softmax(-1)


def run(inputs, spec, transposed, fn=moe.routed_experts, **kw):
    x, logits, ids, w12, w3, b12, b3 = inputs
    return fn(x, ids, routing_weights(logits, ids), w12, w3, b12, b3, activation=spec, transposed=transposed, **kw)


def grads(inputs, y, dy):
    leaves = [t for t in (inputs[0], inputs[1], *inputs[3:]) if t is not None]
    return torch.autograd.grad(y, leaves, dy)


def fp64_reference(inputs, spec, transposed):
    """The float64 reference from the same values; with a clamp, x12 is
    rounded to the inputs' dtype first, so both take the same clamp decisions
    (the clamp's gradient jumps at the limit)."""
    d = [None if t is None or not t.is_floating_point() else t.detach().double().requires_grad_() for t in inputs]
    d[2] = inputs[2]
    x12_dtype = inputs[0].dtype if spec.limit is not None else None
    return d, run(d, spec, transposed, fn=moe.experts_reference, x12_dtype=x12_dtype)


def assert_matches_reference(inputs, spec, transposed, dtype, **kw):
    y = run(inputs, spec, transposed, **kw)
    ref_inputs, y_ref = fp64_reference(inputs, spec, transposed)
    assert y.dtype == dtype and y.shape == y_ref.shape
    assert rel_rms(y, y_ref) <= TOL[dtype]
    dy = torch.randn_like(y_ref)
    names = ["x", "router"] + [n for n, t in zip(("w12", "w3", "b12", "b3"), inputs[3:]) if t is not None]
    for name, g, g_ref in zip(names, grads(inputs, y, dy.to(dtype)), grads(ref_inputs, y_ref, dy)):
        assert_nontrivial(g, name)
        assert g.dtype == dtype
        assert rel_rms(g, g_ref) <= TOL[dtype], name


# ---- parity --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("spec,transposed,bias", [("silu", False, False), ("gpt_oss", True, True),
                                                  ("deepseek_v4", False, False), ("gelu_tanh", False, True)])
def test_matches_fp64_reference(dtype, spec, transposed, bias):
    inputs = make(dtype=dtype, transposed=transposed, bias=bias)
    assert_matches_reference(inputs, SPECS[spec], transposed, dtype)


@pytest.mark.parametrize("implementation", ["torch", "host_kernels"])
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("spec", [deepseek_v4(2.0), GPT_OSS], ids=str)
def test_clamp_gradient_at_exactly_the_limit_follows_the_rule_in_force(spec, schedule, implementation, clamp_rule,
                                                                        monkeypatch, host_launcher):
    """Each expert's w12 copies x's columns into gate and up (a permutation
    times 1), so x12 holds +-L exactly; with top-1 routing and unit weights
    x.grad is dx12 itself. Under each torch's rule the gradient at the limit
    is passed (2.13) or 0 (2.14), as the float64 reference imposes it."""
    use_schedule(monkeypatch, schedule)
    E, I, T = 2, 8, 6
    L = spec.limit
    row = torch.tensor([-L - 1, -L, -0.5, 0.0, 0.5, L, L + 1, 1.0], dtype=torch.float64)
    x = torch.stack([row.roll(t) for t in range(T)]).repeat(1, 2).requires_grad_()  # [T, 2I]: gate = up = row
    w12 = torch.eye(2 * I, dtype=torch.float64).expand(E, 2 * I, 2 * I)
    if spec.interleaved:  # x12's columns as [g0, u0, g1, u1, ...]
        w12 = w12[:, torch.arange(2 * I).view(2, I).t().reshape(-1)]
    w12 = w12.clone().requires_grad_()
    w3 = torch.randn(E, 2 * I, I, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).requires_grad_()
    ids = (torch.arange(T) % E).view(T, 1)
    weights = torch.ones(T, 1, dtype=torch.float64)
    context = primitives_on_host_kernels(host_launcher) if implementation == "host_kernels" else nullcontext()
    with context:
        y = moe.routed_experts(x, ids, weights, w12, w3, activation=spec)
        got = torch.autograd.grad(y.sum(), (x, w12, w3))
    leaves = [t.detach().clone().requires_grad_() for t in (x, w12, w3)]
    y_ref = moe.experts_reference(leaves[0], ids, weights, leaves[1], leaves[2], activation=spec,
                                  clamp_gradient_at_bound=clamp_rule)
    torch.testing.assert_close(y, y_ref, rtol=1e-13, atol=1e-13)
    for g, g_ref in zip(got, torch.autograd.grad(y_ref.sum(), leaves)):
        torch.testing.assert_close(g, g_ref, rtol=1e-12, atol=1e-13)
    gate, up = x.detach().chunk(2, 1)
    at_limit = torch.cat([gate == L, up.abs() == L], 1)   # the gate is clamped from above only
    beyond = torch.cat([gate > L, up.abs() > L], 1)
    assert ((got[0][at_limit] != 0).any() == clamp_rule) and ((got[0][at_limit] == 0).all() != clamp_rule)
    assert (got[0][beyond] == 0).all() and (got[0][~beyond & ~at_limit] != 0).any()


@pytest.mark.parametrize("D,I", [(64, 32), (63, 33)])
def test_grouped_mm_and_loop_paths_agree(monkeypatch, D, I):
    """The grouped_mm path (aligned fp32) and the per-expert loop of GEMMs
    give the same results; odd widths take the loop by themselves."""
    inputs = make(D=D, I=I, transposed=True, bias=True)
    assert grouped.grouped_mm_runs(inputs[0], inputs[3], inputs[4]) == (D % 4 == 0 and I % 2 == 0)
    y = run(inputs, GPT_OSS, True)
    dy = torch.randn_like(y)
    g = grads(inputs, y, dy)
    use_schedule(monkeypatch, "loop")
    y_loop = run(inputs, GPT_OSS, True)
    torch.testing.assert_close(y_loop, y, rtol=1e-6, atol=1e-6)
    for a, b in zip(grads(inputs, y_loop, dy), g):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert_matches_reference(inputs, GPT_OSS, True, torch.float32)


def test_grouped_mm_runs_predicate():
    x = torch.randn(16, 64)
    w12, w3 = torch.randn(2, 64, 64), torch.randn(2, 64, 32)
    assert grouped.grouped_mm_runs(x, w12, w3)
    assert not grouped.grouped_mm_runs(x.double(), w12.double(), w3.double())      # no float64 kernel
    assert not grouped.grouped_mm_runs(torch.randn(16 * 64 + 1)[1:].view(16, 64), w12, w3)  # 4-byte aligned base
    assert not grouped.grouped_mm_runs(torch.randn(16, 66)[:, :62], torch.randn(2, 64, 62), torch.randn(2, 62, 32))


@pytest.mark.parametrize("transposed", [False, True])
def test_grouped_experts_take_any_gradient_strides(transposed):
    """Autograd hands the backward whatever strides the loss gives: an
    expanded zero-stride dy (``y.sum().backward()``) or a transposed one runs
    on the grouped_mm path (which refuses such operands itself) and gives
    the gradients a contiguous dy gives."""
    torch.manual_seed(0)
    E, D, I, S = 4, 32, 48, 64
    x = torch.randn(S, D, requires_grad=True)
    w12 = (torch.randn(E, D, 2 * I) if transposed else torch.randn(E, 2 * I, D)).requires_grad_()
    w3 = (torch.randn(E, I, D) if transposed else torch.randn(E, D, I)).requires_grad_()
    offsets = torch.tensor([10, 30, 30, S], dtype=torch.int32)
    assert grouped.grouped_mm_runs(x, w12, w3)
    leaves = (x, w12, w3)

    def grads_of(loss):
        return torch.autograd.grad(loss(moe.grouped_experts(x, offsets, w12, w3, transposed=transposed)), leaves)

    for loss, dy in ((lambda y: y.sum(), torch.ones(S, D)), (lambda y: (y.t() * torch.arange(S)).sum(),
                                                             torch.arange(S).float().unsqueeze(1).expand(S, D))):
        y = moe.grouped_experts(x, offsets, w12, w3, transposed=transposed)
        for got, want in zip(grads_of(loss), torch.autograd.grad(y, leaves, dy.contiguous())):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_routing_weight_multiplies_the_down_output_bias_included():
    """w * (h W3 + b3), not (w * h) W3 + b3: with a down bias the two differ."""
    x, logits, ids, w12, w3, b12, b3 = make(bias=True)
    rw = routing_weights(logits, ids)
    y = moe.routed_experts(x, ids, rw, w12, w3, b12, b3)
    bias_unweighted = moe.experts_reference(x, ids, rw, w12, w3, b12, None) + b3[ids].sum(1)
    assert rel_rms(y, bias_unweighted) > 1e-2  # the (w h) W3 + b3 form is a different function
    torch.testing.assert_close(y, moe.experts_reference(x, ids, rw, w12, w3, b12, b3), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_router_gradient_is_dy_dot_down_output(dtype):
    """d(routing weight) = dy . (h W3 + b3), against autograd of the float64 reference."""
    x, logits, ids, w12, w3, b12, b3 = make(bias=True, transposed=True, dtype=dtype)
    rw = routing_weights(logits, ids).detach().requires_grad_()
    y = moe.routed_experts(x, ids, rw, w12, w3, b12, b3, activation=GPT_OSS, transposed=True)
    dy = torch.randn_like(y)
    (g,) = torch.autograd.grad(y, rw, dy)
    d = [t.detach().double() for t in (x, w12, w3, b12, b3)]
    rw64 = rw.detach().double().requires_grad_()
    y_ref = moe.experts_reference(d[0], ids, rw64, *d[1:3], *d[3:], activation=GPT_OSS, transposed=True)
    (g_ref,) = torch.autograd.grad(y_ref, rw64, dy.double())
    assert_nontrivial(g, "routing weights")
    assert rel_rms(g, g_ref) <= TOL[dtype]


def test_grouped_experts_matches_routed():
    """The grouped entry point on rows sorted by hand equals the routed one."""
    x, logits, ids, w12, w3, b12, b3 = make(bias=True)
    rw = routing_weights(logits, ids).detach()
    perm, offsets = moe.sort_by_expert(ids, w12.shape[0])
    assert offsets.dtype == torch.int32 and offsets[-1].item() == ids.numel()
    y_sorted = moe.grouped_experts(x.detach()[perm // 2], offsets, w12, w3, b12, b3,
                                   routing_weights=rw.reshape(-1)[perm])
    y = torch.zeros_like(x).index_add_(0, perm // 2, y_sorted)
    torch.testing.assert_close(y, moe.routed_experts(x, ids, rw, w12, w3, b12, b3), rtol=1e-5, atol=1e-6)


# ---- what is saved, checkpointing ------------------------------------------------------------

def test_saves_x_sorted_and_x12_only_and_recompute_saves_x_only():
    """Saved for backward inside the op: x_sorted (D) and x12 (2I) per routed
    row plus offsets and routing weights; recompute_gate_up drops x12; the
    same whatever requires grad."""
    E, D, I, T, K = 4, 64, 32, 37, 2
    S = T * K
    x_sorted, offsets, w12, w3 = torch.randn(S, D), torch.tensor([10, 30, 30, S], dtype=torch.int32), \
        torch.randn(E, 2 * I, D), torch.randn(E, D, I)
    rw = torch.rand(S)
    extra = offsets.nbytes + rw.nbytes
    for x_grad, w_grad in ((True, True), (False, True), (True, False), (False, False)):
        x = x_sorted.clone().requires_grad_(x_grad)
        w12_, w3_ = w12.clone().requires_grad_(w_grad), w3.clone().requires_grad_(w_grad)
        rw_ = rw.clone().requires_grad_(True)
        for recompute, per_row in ((False, D + 2 * I), (True, D)):
            got = saved_activation_bytes(
                lambda: moe.grouped_experts(x, offsets, w12_, w3_, routing_weights=rw_, recompute_gate_up=recompute),
                [w12_, w3_])
            assert got == S * per_row * 4 + extra, (x_grad, w_grad, recompute, got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routed_saves_each_tokens_input_once(dtype):
    """The routed path at DeepSeek-V3's proportions (top-8 of 16, D/I = 3.5)
    saves x [T, D] once, x12 per routed row, perm (int32), the routing
    weights and the offsets: exactly ``routed_saved_bytes``, whatever
    requires grad, with or without sentinels; recompute_gate_up drops x12.
    That is within issue 26's bound of what a6d6350 saved."""
    E, K, D, I, T = 16, 8, 224, 64, 24
    x, logits, ids, w12, w3, _, _ = make(E=E, K=K, D=D, I=I, T=T, dtype=dtype)
    rw = routing_weights(logits.float(), ids).detach()
    ids_with_sentinels = ids.clone()
    ids_with_sentinels[::5, 3] = E + 2
    for x_grad, w_grad in ((True, True), (False, True), (True, False), (False, False)):
        x_ = x.detach().clone().requires_grad_(x_grad)
        w12_, w3_ = w12.detach().clone().requires_grad_(w_grad), w3.detach().clone().requires_grad_(w_grad)
        rw_ = rw.clone().requires_grad_(True)
        for recompute in (False, True):
            want = routed_saved_bytes(T, K, E, D, I, x.element_size(), 4, recompute)
            for sentinels in (False, True):
                got = saved_activation_bytes(
                    lambda: routing.route_and_combine(x_, ids_with_sentinels if sentinels else ids, rw_, w12_, None,
                                                      w3_, None, SILU, False, recompute, sentinels), [w12_, w3_])
                assert got == want, (x_grad, w_grad, recompute, sentinels, got, want)
    before = routed_saved_bytes_a6d6350(T, K, E, D, I, x.element_size(), 4)
    assert routed_saved_bytes(T, K, E, D, I, x.element_size(), 4) <= routed_saved_ratio_goal(K, D, I) * before


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("wrt", ["x", "w12", "router", "w3"])
def test_one_gradient_at_a_time_matches_reference(wrt, recompute):
    """Each gradient alone (the backward skips what is not asked for, the
    re-gather of the rows included) equals the float64 reference's."""
    inputs = make(bias=True)
    x, logits, ids, w12, w3, b12, b3 = inputs
    leaf = {"x": x, "w12": w12, "router": logits, "w3": w3}[wrt]
    y = run(inputs, SILU, False, recompute_gate_up=recompute)
    ref_inputs, y_ref = fp64_reference(inputs, SILU, False)
    ref_leaf = {"x": ref_inputs[0], "w12": ref_inputs[3], "router": ref_inputs[1], "w3": ref_inputs[4]}[wrt]
    dy = torch.randn_like(y_ref)
    (g,) = torch.autograd.grad(y, leaf, dy.float())
    (g_ref,) = torch.autograd.grad(y_ref, ref_leaf, dy)
    assert_nontrivial(g, wrt)
    assert rel_rms(g, g_ref) <= TOL[torch.float32]


@pytest.mark.parametrize("bias", [False, True])
def test_gradcheck_float64(bias):
    """torch's gradcheck (undefined output gradients included) on a small
    routed call: every input, routing weights and biases included."""
    x, logits, ids, w12, w3, b12, b3 = make(E=3, D=4, I=3, T=5, dtype=torch.float64, bias=bias)
    leaves = [t for t in (x, logits, w12, w3, b12, b3) if t is not None]

    def f(x, logits, w12, w3, b12=None, b3=None):
        return moe.routed_experts(x, ids, routing_weights(logits, ids), w12, w3, b12, b3)

    assert torch.autograd.gradcheck(f, leaves)


def test_backward_builds_no_zero_gradient_for_x12():
    """The op's x12 output is there to be saved: autograd must not
    materialise a zero [S, 2I] gradient for it before every backward."""
    inputs = make(D=40, I=32)
    x, _, ids, w12 = inputs[:4]
    y = run(inputs, SILU, False)
    filled = zero_filled_shapes(lambda: y.sum().backward())
    assert (ids.numel(), w12.shape[1]) not in filled, filled
    assert_nontrivial(x.grad, "x")


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("recompute", [False, True])
def test_checkpoint_both_modes_match_plain(use_reentrant, recompute):
    inputs = make(transposed=True, bias=True)
    x, logits, ids, w12, w3, b12, b3 = inputs

    def block(x, logits):
        return moe.routed_experts(x, ids, routing_weights(logits, ids), w12, w3, b12, b3, activation=GPT_OSS,
                                  transposed=True, recompute_gate_up=recompute)

    leaves = [x, logits, w12, w3, b12, b3]

    def backward(y, dy):  # .backward(): reentrant checkpoint refuses autograd.grad
        for t in leaves:
            t.grad = None
        y.backward(dy)
        return [t.grad for t in leaves]

    y = block(x, logits)
    dy = torch.randn_like(y)
    expected = backward(y, dy)
    y_ck = checkpoint(block, x, logits, use_reentrant=use_reentrant)
    assert torch.equal(y_ck, y)
    for a, b in zip(backward(y_ck, dy), expected):
        assert_nontrivial(b, "grad")
        assert torch.equal(a, b)


def test_no_grad_forward_equals_grad_forward_and_second_backward_works():
    inputs = make()
    with torch.no_grad():
        y0 = run(inputs, SILU, False)
    y = run(inputs, SILU, False)
    assert torch.equal(y0, y)
    dy = torch.randn_like(y)
    g1 = torch.autograd.grad(y, inputs[0], dy, retain_graph=True)[0]
    g2 = torch.autograd.grad(y, inputs[0], dy)[0]
    assert torch.equal(g1, g2)  # nothing saved was overwritten


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("K", [1, 2, 3, 8])
def test_sum_per_token_accumulates_half_precision_in_fp32(dtype, K, device):
    """Each token's K rows are summed in fp32 and rounded once: the plain
    half-precision sum the combine takes must equal that bit for bit (a
    half-precision accumulator of 3 or more terms differs on these rows:
    large and small terms)."""
    from swiglu_cupy.moe.tokens import sum_per_token
    torch.manual_seed(0)
    T, N = 64, 96
    rows = (torch.randn(T * K, N) * torch.logspace(-3, 3, T * K).unsqueeze(1)).to(device, dtype)
    inv_perm = torch.randperm(T * K).to(device)
    per_token = rows[inv_perm].view(T, K, N)
    expected, fp32_sums = per_token.double().sum(1), per_token.float().sum(1)
    got = sum_per_token(rows, inv_perm, K, dtype)
    assert got.dtype == dtype and torch.equal(got, fp32_sums.to(dtype))
    if K > 2:  # a half-precision accumulator, for contrast (two terms round once either way)
        naive = per_token[:, 0]
        for k in range(1, K):
            naive = naive + per_token[:, k]
        assert not torch.equal(naive, got)
    magnitude = per_token.double().abs().sum(1)
    bound = expected.abs() * torch.finfo(dtype).eps / 2 + magnitude * K * 2.0 ** -24  # one rounding, fp32 sums
    assert ((got.double() - expected).abs() <= bound).all()
    assert torch.equal(sum_per_token(rows, inv_perm, K, torch.float32), fp32_sums)
    wide_rows = rows.float()
    assert torch.equal(sum_per_token(wide_rows, inv_perm, K, torch.float32), fp32_sums)
    assert torch.equal(sum_per_token(wide_rows, inv_perm, K, dtype), fp32_sums.to(dtype))


def test_combine_is_deterministic():
    inputs = make(T=200, E=8, K=3)
    ys = [run(inputs, SILU, False) for _ in range(3)]
    gs = [grads(inputs, y, torch.ones_like(y)) for y in ys]
    for y, g in zip(ys[1:], gs[1:]):
        assert torch.equal(y, ys[0])
        assert all(torch.equal(a, b) for a, b in zip(g, gs[0]))


def test_autocast_bf16_casts_inputs_and_returns_fp32_grads():
    inputs = make()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = run(inputs, SILU, False)
    assert y.dtype == torch.float32  # the combine rounds to the input's dtype
    ref_inputs, y_ref = fp64_reference(inputs, SILU, False)
    assert rel_rms(y, y_ref) <= TOL[torch.bfloat16]
    for g in grads(inputs, y, torch.ones_like(y)):
        assert g.dtype == torch.float32
        assert_nontrivial(g, "grad")


# ---- routing edge cases --------------------------------------------------------------------

def _with_ids(inputs, ids):
    return (*inputs[:2], ids, *inputs[3:])


@pytest.mark.parametrize("case", ["empty_experts", "one_expert_takes_all", "top1", "one_expert", "zero_tokens"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_routing_edge_cases(monkeypatch, case, schedule):
    use_schedule(monkeypatch, schedule)
    E, K, T = {"top1": (4, 1, 37), "one_expert": (1, 1, 37), "zero_tokens": (4, 2, 0),
               "one_expert_takes_all": (6, 1, 37)}.get(case, (6, 2, 37))
    inputs = make(E=E, K=K, T=T, bias=True)
    if case == "empty_experts":  # each token to experts (1, 2) or (3, 4): experts 0 and 5 get nothing
        pairs = torch.tensor([[1, 2], [3, 4]])
        inputs = _with_ids(inputs, pairs[torch.randint(0, 2, (T,), generator=torch.Generator().manual_seed(0))])
    elif case == "one_expert_takes_all":
        inputs = _with_ids(inputs, torch.full((T, 1), 4))
    y = run(inputs, SILU, False)
    ref_inputs, y_ref = fp64_reference(inputs, SILU, False)
    assert y.shape == (T, 64)
    dy = torch.randn_like(y_ref)
    got = grads(inputs, y, dy.float())
    if T:
        want = grads(ref_inputs, y_ref, dy)
    else:  # no token reached any expert: the reference has no graph, every gradient is zero
        want = [torch.zeros_like(t) for t in (ref_inputs[0], ref_inputs[1], *ref_inputs[3:]) if t is not None]
    if T:
        assert rel_rms(y, y_ref) <= TOL[torch.float32]
    for g, g_ref in zip(got, want):
        assert g.shape == g_ref.shape
        if not g_ref.any():
            assert torch.equal(g, torch.zeros_like(g))  # empty experts, no tokens: exactly zero
        else:
            assert rel_rms(g, g_ref) <= TOL[torch.float32]
    if case in ("empty_experts", "one_expert_takes_all"):
        unused = sorted(set(range(E)) - set(inputs[2].unique().tolist()))
        assert unused and all(torch.equal(got[2][e], torch.zeros_like(got[2][e])) for e in unused)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_expert_parallel_sentinels_contribute_zero(monkeypatch, schedule):
    """Ids >= E (experts on other ranks) sort to a tail that gets no GEMM:
    zero output, zero gradient, and no router gradient there."""
    use_schedule(monkeypatch, schedule)
    x, logits, ids, w12, w3, b12, b3 = make(E=4, bias=True)
    ids = ids.clone()
    ids[::3, 1] = 4 + torch.arange(ids[::3].shape[0]) % 3   # sentinels 4, 5, 6
    sentinel = ids >= 4
    rw = routing_weights(logits, ids.clamp(max=3)).detach().requires_grad_()
    y = routing.route_and_combine(x, ids, rw, w12, b12, w3, b3, SILU, False, False, True)
    leaves = [x, rw, w12, w3, b12, b3]
    dy = torch.randn_like(y)
    g = torch.autograd.grad(y, leaves, dy)
    assert torch.equal(g[1][sentinel], torch.zeros(int(sentinel.sum())))
    d = [t.detach().double().requires_grad_() for t in leaves]
    y_ref = moe.experts_reference(d[0], ids.clamp(max=3), d[1] * ~sentinel, d[2], d[3], d[4], d[5])
    assert rel_rms(y, y_ref) <= TOL[torch.float32]
    for name, a, b in zip(("x", "rw", "w12", "w3", "b12", "b3"), g, torch.autograd.grad(y_ref, d, dy.double())):
        assert_nontrivial(a, name)
        assert rel_rms(a, b) <= TOL[torch.float32], name


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_sentinel_tail_rows_are_zero_whatever_they_hold(monkeypatch, schedule):
    """The op on rows with a sentinel tail (past offsets[-1]) holding NaN:
    the tail's output, input gradient and routing-weight gradient are exactly
    zero, and nothing of it reaches the other rows or the weight gradients."""
    use_schedule(monkeypatch, schedule)
    E, D, I, S, tail = 3, 64, 32, 40, 7
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(S, D, generator=gen)
    x[S - tail:] = float("nan")
    x.requires_grad_()
    rw = torch.rand(S, generator=gen).requires_grad_()
    w12 = (torch.randn(E, 2 * I, D, generator=gen) / 8).requires_grad_()
    w3 = (torch.randn(E, D, I, generator=gen) / 8).requires_grad_()
    b3 = torch.randn(E, D, generator=gen).requires_grad_()
    offsets = torch.tensor([10, 10, S - tail], dtype=torch.int32)
    y = grouped.run_experts(x, offsets, w12, None, w3, b3, rw, SILU, False, False, True)
    dy = torch.randn(S, D, generator=gen)
    dx, drw, dw12, dw3, db3 = torch.autograd.grad(y, (x, rw, w12, w3, b3), dy)
    assert torch.equal(y[S - tail:], torch.zeros(tail, D)) and torch.equal(dx[S - tail:], torch.zeros(tail, D))
    assert torch.equal(drw[S - tail:], torch.zeros(tail))
    assert torch.equal(dw12[1], torch.zeros_like(dw12[1])) and torch.equal(db3[1], torch.zeros(D))  # empty expert
    for t in (y, dx, drw, dw12, dw3, db3):
        assert torch.isfinite(t).all()
    kept = slice(0, S - tail)
    y_ref = moe.grouped_experts(x[kept].detach(), offsets, w12, w3, None, b3, routing_weights=rw[kept].detach())
    torch.testing.assert_close(y[kept], y_ref, rtol=1e-6, atol=1e-6)


# ---- errors --------------------------------------------------------------------------------

def test_bad_offsets_and_ids_raise_naming_the_argument():
    x, _, ids, w12, w3, _, _ = make(E=4, T=10)
    xs = torch.randn(20, x.shape[1])
    good = torch.tensor([5, 10, 10, 20], dtype=torch.int32)
    moe.grouped_experts(xs, good, w12, w3)
    with pytest.raises(TypeError, match="offsets must be int32"):
        moe.grouped_experts(xs, good.long(), w12, w3)
    with pytest.raises(ValueError, match="offsets must be non-decreasing"):
        moe.grouped_experts(xs, torch.tensor([5, 3, 10, 20], dtype=torch.int32), w12, w3)
    with pytest.raises(ValueError, match="offsets must end at x_sorted.shape"):
        moe.grouped_experts(xs, torch.tensor([5, 10, 10, 19], dtype=torch.int32), w12, w3)
    with pytest.raises(ValueError, match=r"offsets must have shape \(4,\)"):
        moe.grouped_experts(xs, good[:3], w12, w3)
    out_of_range = ids.clone()
    out_of_range[3, 1] = 4
    with pytest.raises(ValueError, match="top_k_index holds expert id 4, outside"):
        moe.routed_experts(x, out_of_range, None, w12, w3)
    with pytest.raises(ValueError, match="top_k_index holds expert id -1"):
        moe.routed_experts(x, ids - 1, None, w12, w3)
    with pytest.raises(TypeError, match="top_k_index must be an integer tensor"):
        moe.routed_experts(x, ids.float(), None, w12, w3)
    with pytest.raises(ValueError, match="top_k_weights must have shape"):
        moe.routed_experts(x, ids, torch.rand(10, 3), w12, w3)
    with pytest.raises(ValueError, match="w3 must have shape"):
        moe.routed_experts(x, ids, None, w12, w3.transpose(1, 2))
    with pytest.raises(ValueError, match="w12 must be"):
        moe.routed_experts(x, ids, None, w12[:, :-1], w3)
    with pytest.raises(ValueError, match="b12 must have shape"):
        moe.routed_experts(x, ids, None, w12, w3, torch.zeros(4, 3))
    with pytest.raises(TypeError, match="w3 must have the same dtype"):
        moe.routed_experts(x, ids, None, w12, w3.double())
    with pytest.raises(ValueError, match="activation must be one of"):
        moe.routed_experts(x, ids, None, w12, w3, activation="swish")


# ---- separate gate/up weights (grouped_experts_unpacked) -------------------------------------

def make_unpacked(E=4, D=64, I=32, S=74, dtype=torch.float32, transposed=False, bias=False, seed=0, device="cpu"):
    """Rows grouped by expert (one empty expert), separate gate w1 and up w2, w3, biases, routing weights."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *shape, s=1.0: (torch.randn(*shape, generator=gen) * s).to(device, dtype).requires_grad_()  # noqa: E731
    gate_up = (E, D, I) if transposed else (E, I, D)
    tensors = {"x": r(S, D), "w1": r(*gate_up, s=D ** -0.5 * 2), "w2": r(*gate_up, s=D ** -0.5 * 2),
               "w3": r(*((E, I, D) if transposed else (E, D, I)), s=I ** -0.5),
               "b1": r(E, I, s=0.5) if bias else None, "b2": r(E, I, s=0.5) if bias else None,
               "b3": r(E, D, s=0.5) if bias else None,
               "rw": torch.rand(S, generator=gen).to(device, dtype).requires_grad_()}
    ends = [S * (e + 1) // E for e in range(E)]
    ends[0] = 0  # an empty expert
    offsets = torch.tensor(ends, dtype=torch.int32, device=device)
    return tensors, offsets


def run_unpacked(t, offsets, transposed, packed=False, **kw):
    """grouped_experts_unpacked, or (packed=True) grouped_experts on the concatenated weights."""
    if not packed:
        return moe.grouped_experts_unpacked(t["x"], offsets, t["w1"], t["w2"], t["w3"], t["b1"], t["b2"], t["b3"],
                                            routing_weights=t["rw"], transposed=transposed, **kw)
    w12 = torch.cat([t["w1"], t["w2"]], dim=2 if transposed else 1)
    b12 = None if t["b1"] is None else torch.cat([t["b1"], t["b2"]], dim=1)
    return moe.grouped_experts(t["x"], offsets, w12, t["w3"], b12, t["b3"], routing_weights=t["rw"],
                               transposed=transposed, **kw)


def unpacked_reference(t, offsets, transposed):
    """The float64 per-expert reference (``experts_reference``, top-1 with the
    routing weights) on the same values, gate and up concatenated."""
    d = {k: None if v is None else v.detach().double().requires_grad_() for k, v in t.items()}
    rows = torch.arange(t["x"].shape[0], dtype=torch.int32, device=offsets.device)
    ids = torch.searchsorted(offsets, rows, right=True).view(-1, 1)
    w12 = torch.cat([d["w1"], d["w2"]], dim=2 if transposed else 1)
    b12 = None if d["b1"] is None else torch.cat([d["b1"], d["b2"]], dim=1)
    y = moe.experts_reference(d["x"], ids, d["rw"].view(-1, 1), w12, d["w3"], b12, d["b3"], transposed=transposed)
    return d, y


UNPACKED_MODES = {"plain": {}, "recompute_gate_up": {"recompute_gate_up": True}, "tiles": {"tile_rows": 16},
                  "fp8_saved_x12": {"saved_x12": "fp8"}}


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("mode,dtype,transposed,bias", [
    (mode, *case) for mode in UNPACKED_MODES
    for case in ((torch.float32, False, False), (torch.float32, True, True), (torch.bfloat16, False, True),
                 (torch.float64, True, False))
    if not (mode == "fp8_saved_x12" and case[0] == torch.float64)])  # refused for float64 (test_saved_x12_fp8)
def test_unpacked_matches_fp64_reference_and_packed(monkeypatch, schedule, mode, dtype, transposed, bias):
    """Separate gate/up weights: y and every gradient (x, w1, w2, w3, biases,
    routing weights) match the float64 reference and the packed entry on the
    concatenated weights, on both GEMM schedules and in every saving mode."""
    use_schedule(monkeypatch, schedule)
    assert_unpacked_matches(mode, dtype, transposed, bias, "cpu")


def assert_unpacked_matches(mode, dtype, transposed, bias, device):
    t, offsets = make_unpacked(dtype=dtype, transposed=transposed, bias=bias, device=device)
    kw = UNPACKED_MODES[mode]
    y = run_unpacked(t, offsets, transposed, **kw)
    y_packed = run_unpacked(t, offsets, transposed, packed=True, **kw)
    d, y_ref = unpacked_reference(t, offsets, transposed)
    # The 8-bit saved x12 (read by the backward only): e4m3's bound against the exact
    # reference, as test_saved_x12_fp8's EXACT_BOUND.
    ref_tol = 0.05 if mode == "fp8_saved_x12" else TOL[dtype]
    assert y.dtype == dtype and rel_rms(y, y_ref) <= TOL[dtype]
    torch.testing.assert_close(y, y_packed, rtol=TOL[dtype], atol=TOL[dtype])
    names = [k for k, v in t.items() if v is not None]
    dy = torch.randn_like(y_ref)
    got = torch.autograd.grad(y, [t[k] for k in names], dy.to(dtype))
    packed = torch.autograd.grad(y_packed, [t[k] for k in names], dy.to(dtype))
    want = torch.autograd.grad(y_ref, [d[k] for k in names], dy)
    for name, g, g_packed, g_ref in zip(names, got, packed, want):
        assert_nontrivial(g, name)
        assert g.dtype == dtype and g.shape == t[name].shape, name
        assert rel_rms(g, g_ref) <= ref_tol, name
        assert rel_rms(g, g_packed) <= TOL[dtype], name


def test_unpacked_saves_what_packed_saves_and_no_weight_copy():
    """Saved for backward: x_sorted and x12 per row, offsets and routing
    weights, exactly the packed entry's bytes; the weights only by reference
    (packing w1/w2 by hand saves the [E, 2I, D] copy too)."""
    t, offsets = make_unpacked()
    E, I, D = t["w1"].shape
    S = t["x"].shape[0]
    weights = [t["w1"], t["w2"], t["w3"]]
    want = S * (D + 2 * I) * 4 + offsets.nbytes + t["rw"].nbytes
    assert saved_activation_bytes(lambda: run_unpacked(t, offsets, False), weights) == want
    by_hand = saved_activation_bytes(lambda: run_unpacked(t, offsets, False, packed=True), weights)
    assert by_hand == want + E * 2 * I * D * 4
    assert saved_activation_bytes(lambda: run_unpacked(t, offsets, False, recompute_gate_up=True), weights) \
        == S * D * 4 + offsets.nbytes + t["rw"].nbytes


@pytest.mark.parametrize("which", ["w1", "w2"])
def test_unpacked_one_weight_at_a_time(which):
    """Only one of the gate/up weights requires grad: it gets the reference's
    gradient and the other none."""
    t, offsets = make_unpacked()
    other = "w2" if which == "w1" else "w1"
    t[other] = t[other].detach()
    y = run_unpacked(t, offsets, False)
    d, y_ref = unpacked_reference(t, offsets, False)
    dy = torch.randn_like(y_ref)
    (g,) = torch.autograd.grad(y, t[which], dy.float())
    (g_ref,) = torch.autograd.grad(y_ref, d[which], dy)
    assert_nontrivial(g, which)
    assert rel_rms(g, g_ref) <= TOL[torch.float32]
    assert t[other].grad is None


def test_unpacked_gradcheck_float64():
    t, offsets = make_unpacked(E=3, D=4, I=3, S=7, dtype=torch.float64, bias=True)
    names = list(t)

    def f(*tensors):
        return run_unpacked(dict(zip(names, tensors)), offsets, False)

    assert torch.autograd.gradcheck(f, [t[k] for k in names])


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_unpacked_checkpoint_both_modes_match_plain(use_reentrant):
    t, offsets = make_unpacked(transposed=True, bias=True)
    leaves = [v for v in t.values() if v is not None]

    def block(x):
        return run_unpacked({**t, "x": x}, offsets, True)

    def backward(y, dy):
        for v in leaves:
            v.grad = None
        y.backward(dy)
        return [v.grad for v in leaves]

    y = block(t["x"])
    dy = torch.randn_like(y)
    expected = backward(y, dy)
    y_ck = checkpoint(block, t["x"], use_reentrant=use_reentrant)
    assert torch.equal(y_ck, y)
    for a, b in zip(backward(y_ck, dy), expected):
        assert_nontrivial(b, "grad")
        assert torch.equal(a, b)


def test_unpacked_bad_inputs_raise_naming_the_argument():
    t, offsets = make_unpacked()
    x, w1, w2, w3 = (t[k].detach() for k in ("x", "w1", "w2", "w3"))
    E, I, D = w1.shape
    with pytest.raises(ValueError, match="w2 must have the shape of w1"):
        moe.grouped_experts_unpacked(x, offsets, w1, w2[:, :-1], w3)
    with pytest.raises(ValueError, match="w1 must be 3-D"):
        moe.grouped_experts_unpacked(x, offsets, w1[0], w2, w3)
    with pytest.raises(ValueError, match=r"w1 must be \[E, I, D\]"):
        moe.grouped_experts_unpacked(x, offsets, w1[..., :-1], w2[..., :-1], w3)
    with pytest.raises(ValueError, match="w3 must have shape"):
        moe.grouped_experts_unpacked(x, offsets, w1, w2, w3.transpose(1, 2))
    with pytest.raises(ValueError, match="b2 must have shape"):
        moe.grouped_experts_unpacked(x, offsets, w1, w2, w3, b2=torch.zeros(E, 2 * I))
    with pytest.raises(TypeError, match="w2"):
        moe.grouped_experts_unpacked(x, offsets, w1, w2.double(), w3)
    with pytest.raises(ValueError, match="interleaved.*w1 and w2"):
        moe.grouped_experts_unpacked(x, offsets, w1, w2, w3, activation=GPT_OSS)
    with pytest.raises(ValueError, match="offsets"):
        moe.grouped_experts_unpacked(x, offsets[:-1], w1, w2, w3)
    with pytest.raises(ValueError, match="tile_rows"):
        moe.grouped_experts_unpacked(x, offsets, w1, w2, w3, tile_rows=0)


def test_unpacked_opcheck_registered_ops():
    """The registered ops with a separate up weight: fake shapes (x12 [S, 2I],
    dw_up like w_up) match the real ones."""
    from swiglu_cupy.primitives.ops import spec_args

    t, offsets = make_unpacked(E=3, D=16, I=8, S=10, bias=True)
    x, w1, w2, w3, b3, rw = (t[k].detach() for k in ("x", "w1", "w2", "w3", "b3", "rw"))
    b12 = torch.cat([t["b1"], t["b2"]], 1).detach()
    spec = (*spec_args(SILU), False, False)
    fwd = (x, offsets, w1, b12, w3, b3, rw, *spec, None, 1, None, False, w2)
    torch.library.opcheck(torch.ops.swiglu_cupy.moe_experts_forward.default, fwd)
    y, x12 = torch.ops.swiglu_cupy.moe_experts_forward(*fwd)
    assert x12.shape == (x.shape[0], 2 * w1.shape[1])
    bwd = (torch.randn_like(y), x, x12, offsets, w1, b12, w3, b3, rw, *spec, [True] * 6, None, 1, None, False, w2)
    torch.library.opcheck(torch.ops.swiglu_cupy.moe_experts_backward.default, bwd)
    grads = torch.ops.swiglu_cupy.moe_experts_backward(*bwd)
    assert [g.shape for g in grads] == [v.shape for v in (x, w1, b12, w3, b3, rw, w2)]


class TinyUnpackedExperts(nn.Module):
    """Experts with separate gate/up 3-D parameters over rows grouped by expert."""

    def __init__(self, D=32, I=16, E=4):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(E, I, D) * D ** -0.5)
        self.w2 = nn.Parameter(torch.randn(E, I, D) * D ** -0.5)
        self.w3 = nn.Parameter(torch.randn(E, D, I) * I ** -0.5)
        self.register_buffer("offsets", torch.tensor([3, 9, 9, 18], dtype=torch.int32))

    def forward(self, x):
        return moe.grouped_experts_unpacked(x, self.offsets, self.w1, self.w2, self.w3)


def test_unpacked_torch_compile_fullgraph_matches_eager():
    from conftest import assert_compiled_matches_eager

    torch.manual_seed(0)
    assert_compiled_matches_eager(TinyUnpackedExperts(), torch.randn(18, 32, requires_grad=True), tol=1e-5)


# ---- torch.compile -------------------------------------------------------------------------

class TinyMoE(nn.Module):
    """A router and E experts as packed 3-D parameters (the layout under test)."""

    def __init__(self, D=32, I=16, E=4, K=2, spec=SILU, transposed=False, bias=False):
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        self.K, self.spec, self.transposed = K, spec, transposed
        self.w12 = nn.Parameter(torch.randn((E, D, 2 * I) if transposed else (E, 2 * I, D)) * D ** -0.5)
        self.w3 = nn.Parameter(torch.randn((E, I, D) if transposed else (E, D, I)) * I ** -0.5)
        self.b12 = nn.Parameter(torch.randn(E, 2 * I) * 0.1) if bias else None
        self.b3 = nn.Parameter(torch.randn(E, D) * 0.1) if bias else None

    def reset_parameters(self):
        with torch.no_grad():
            for p in self.parameters():
                p.normal_(0, 0.2)

    def forward(self, x):
        top, ids = self.router(x).topk(self.K, dim=-1)
        return x + moe.routed_experts(x, ids, top.softmax(-1), self.w12, self.w3, self.b12, self.b3,
                                      activation=self.spec, transposed=self.transposed)


@pytest.mark.parametrize("way_in", ["rows", "tokens", "tokens_to_rows"])
def test_opcheck_registered_ops(way_in):
    """torch.library.opcheck on the ops torch.compile traces: the fake
    impls' shapes and dtypes (y per token or per row, dx per token, the
    routing weights' gradient per slot) match the real ones, both ways in."""
    from swiglu_cupy.primitives.ops import spec_args

    E, K, D, I, T = 3, 2, 16, 8, 5
    x, logits, ids, w12, w3, b12, b3 = [None if t is None else t.detach()
                                        for t in make(E=E, K=K, D=D, I=I, T=T, bias=True)]
    perm, offsets = moe.sort_by_expert(ids, E)
    rw = routing_weights(logits, ids).reshape(-1).double()  # a wider dtype: y and drw follow it
    if way_in == "rows":
        x, rw, perm, combine = x[perm // K], rw[perm], None, None
    else:
        perm, combine = perm.int(), (torch.float32 if way_in == "tokens" else None)
    spec = (*spec_args(GPT_OSS), False, False)
    fwd = (x, offsets, w12, b12, w3, b3, rw, *spec, perm, K, combine)
    torch.library.opcheck(torch.ops.swiglu_cupy.moe_experts_forward.default, fwd)
    y, x12 = torch.ops.swiglu_cupy.moe_experts_forward(*fwd)
    assert y.shape == ((T, D) if way_in == "tokens" else (T * K, D))
    bwd = (torch.randn_like(y), x, x12, offsets, w12, b12, w3, b3, rw, *spec, [True] * 6, perm, K, combine)
    torch.library.opcheck(torch.ops.swiglu_cupy.moe_experts_backward.default, bwd)
    grads = torch.ops.swiglu_cupy.moe_experts_backward(*bwd)
    assert [g.shape for g in grads] == [t.shape for t in (x, w12, b12, w3, b3, rw)] + [(0,)]  # no w_up


def test_torch_compile_fullgraph_matches_eager():
    from conftest import assert_compiled_matches_eager

    torch.manual_seed(0)
    model = TinyMoE(spec=GPT_OSS, transposed=True, bias=True)
    assert_compiled_matches_eager(model, torch.randn(2, 9, 32, requires_grad=True), tol=1e-5)


# ---- FSDP2 over the 3-D expert weights, meta-device init (2 gloo ranks) ----------------------

def _stack(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(TinyMoE(spec=GPT_OSS, transposed=True, bias=True), TinyMoE())


def _batch():
    torch.manual_seed(1)
    return torch.randn(4, 8, 32), torch.randn(4, 8, 32)


def _train(model, x, target, grads_of, steps=2):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = (model(x) - target).pow(2).mean()
        loss.backward()
        out.append((loss.detach().clone(), grads_of(model)))
        opt.step()
    return out


def fsdp2_case(rank, world, meta=False):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    if meta:
        with torch.device("meta"):
            model = _stack()
    else:
        model = _stack()
    for block in model:
        fully_shard(block)
    fully_shard(model)
    assert all(type(p).__name__ == "DTensor" for p in model.parameters())
    if meta:
        model.to_empty(device="cpu")
        for block in model:
            block.reset_parameters()
        with torch.no_grad():
            for p, full in zip(model.parameters(), _stack().parameters()):
                p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements).to_local())
    x, target = _batch()
    half = x.shape[0] // world
    x, target = x[rank * half:(rank + 1) * half], target[rank * half:(rank + 1) * half]

    def full_grads(m):
        return {n: p.grad.full_tensor().clone() for n, p in m.named_parameters()}

    result = []
    for loss, g in _train(model, x, target, full_grads):
        dist.all_reduce(loss)
        result.append((loss / world, g))
    return result


def fsdp2_meta_case(rank, world):
    return fsdp2_case(rank, world, meta=True)


def _run_case(case, rank, world):
    return {"fsdp2": fsdp2_case, "fsdp2_meta": fsdp2_meta_case}[case](rank, world)


@pytest.mark.parametrize("case", ["fsdp2", "fsdp2_meta"])
def test_fsdp2_two_ranks_matches_one_process(case, tmp_path, monkeypatch):
    model = _stack()
    x, target = _batch()
    ref = _train(model, x, target, lambda m: {n: p.grad.clone() for n, p in m.named_parameters()})
    results = rank_launcher.launch(_run_case, case, tmp_path, monkeypatch, 2, 120)
    for result in results:
        for (loss, g), (loss_ref, g_ref) in zip(result, ref):
            torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-6)
            assert g.keys() == g_ref.keys()
            for name in g_ref:
                assert_nontrivial(g[name], name)
                torch.testing.assert_close(g[name], g_ref[name], rtol=1e-5, atol=1e-6, msg=name)


# ---- GPU ------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_unpacked_matches_fp64_reference_and_packed(dtype, monkeypatch):
    """grouped_experts_unpacked on the GPU, both GEMM schedules, every saving mode."""
    for schedule in SCHEDULES:
        with monkeypatch.context() as m:
            use_schedule(m, schedule)
            for mode in UNPACKED_MODES:
                assert_unpacked_matches(mode, dtype, False, dtype == torch.float32, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_matches_fp64_reference_both_paths(dtype, monkeypatch):
    for spec, transposed, bias in ((SILU, False, False), (GPT_OSS, True, True)):
        inputs = make(dtype=dtype, transposed=transposed, bias=bias, T=301, E=8, device="cuda")
        if dtype == torch.bfloat16:
            assert grouped.grouped_mm_runs(inputs[0], inputs[3], inputs[4])
        assert_matches_reference(inputs, spec, transposed, dtype)
        with monkeypatch.context() as m:
            m.setattr(grouped, "grouped_mm_runs", lambda *a: False)
            assert_matches_reference(inputs, spec, transposed, dtype)

