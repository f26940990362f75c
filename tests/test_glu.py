"""The GLU family through the public API (CPU path, torch implementation of
every variant): each variant x dtype against a float64 autograd reference of
HF's eager expression (values and every gradient), clamp boundaries hit on
purpose, interleaved against halves, and everything that holds for SwiGLU:
module conventions, checkpointing, autocast, memory modes, torch.compile,
torch.export, torch.func and ONNX. The kernels' side is test_host_exec.py."""
import copy
import dataclasses
import io

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import swiglu_cupy as sc
from swiglu_cupy import primitives, reference
from swiglu_cupy.primitives import ops
from swiglu_cupy.activations import GPT_OSS, SILU, GLUActivation, deepseek_v4
from swiglu_cupy.dense.module import _interleave
from conftest import assert_compiled_matches_eager, assert_nontrivial, onnx_run_with_standard_ops, rel_rms

D, H, O = 32, 48, 24
# As test_api.py: float64 reference from the same rounded inputs; bf16 allows
# a few roundings (x12, h, y) of 2^-9 each.
REL_RMS_BOUND = {torch.float64: 1e-13, torch.float32: 2e-6, torch.bfloat16: 1e-2}
# Limits chosen so that a good share of the entries of x12 ~ N(0, 1.5^2) is clamped.
SPECS = {
    "silu": SILU,
    "gelu_tanh": GLUActivation("gelu_tanh"),
    "gelu": GLUActivation("gelu"),
    "relu": GLUActivation("relu"),
    "sigmoid": GLUActivation("sigmoid"),
    "identity": GLUActivation("identity"),
    "deepseek_v4": deepseek_v4(1.25),
    "gpt_oss": dataclasses.replace(GPT_OSS, limit=1.25),
    "oai_halves": GLUActivation("oai", alpha=1.702, up_offset=1.0),
    "gelu_tanh_clamp_interleaved": GLUActivation("gelu_tanh", limit=1.0, interleaved=True),
    "silu_interleaved": GLUActivation("silu", interleaved=True),
}


def _params(dtype, seed=0, spread=1.5):
    gen = torch.Generator().manual_seed(seed)
    mk = lambda *s: (torch.randn(*s, generator=gen, dtype=torch.float64) / s[-1] ** 0.5).to(dtype)  # noqa: E731
    x = (torch.randn(5, 7, D, generator=gen, dtype=torch.float64) * spread).to(dtype)
    params = [mk(2 * H, D), torch.randn(2 * H, generator=gen, dtype=torch.float64).to(dtype) * 0.3,
              mk(O, H), torch.randn(O, generator=gen, dtype=torch.float64).to(dtype)]
    dy = torch.randn(5, 7, O, generator=gen, dtype=torch.float64).to(dtype)
    return x, params, dy


def _run(fn, x, params, dy, **kw):
    leaves = [t.detach().clone().requires_grad_(True) for t in [x, *params]]
    y = fn(*leaves, **kw)
    y.backward(dy)
    return y, [t.grad for t in leaves]


def _stored_x12_reference(x, w12, b12, w3, b3, activation, dtype):
    """glu_ffn_reference in float64, except that the clamps and relu see x12
    as the op stores it (rounded to ``dtype``; the gradient passes straight
    through the rounding): the clamp masks are discontinuous, and HF's eager
    bf16 model clamps its bf16 x12 too."""
    x12 = F.linear(x, w12, b12)
    x12 = x12 + (x12.to(dtype).double() - x12).detach()
    gate, up = reference.split_gate_up(x12, activation)
    return F.linear(sc.glu_reference(gate, up, activation), w3, b3)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(SPECS))
def test_every_variant_matches_float64_autograd_of_the_eager_expression(name, dtype):
    spec = SPECS[name]
    x, params, dy = _params(dtype, seed=len(name))
    y, grads = _run(sc.swiglu, x, params, dy, activation=spec)
    y_ref, grads_ref = _run(_stored_x12_reference, x.double(), [p.double() for p in params], dy.double(),
                            activation=spec, dtype=dtype)
    assert y.dtype == dtype and rel_rms(y, y_ref) < REL_RMS_BOUND[dtype]
    for what, g, g_ref in zip(["x", "w12", "b12", "w3", "b3"], grads, grads_ref):
        assert_nontrivial(g, what)
        assert g.dtype == dtype and rel_rms(g, g_ref) < REL_RMS_BOUND[dtype], what
    if spec.limit is not None:  # the clamps really cut: both sides of the limit occur
        x12 = F.linear(x.double(), params[0].double(), params[1].double())
        assert 0.1 < (x12.abs() > spec.limit).double().mean() < 0.6


@pytest.mark.parametrize("implementation", ["torch", "host_kernels"])
@pytest.mark.parametrize("spec", [deepseek_v4(2.0), dataclasses.replace(GPT_OSS, limit=2.0),
                                  GLUActivation("relu", limit=2.0, interleaved=True)], ids=str)
def test_clamp_boundaries_pass_the_gradient_like_torch_clamp(spec, implementation, host_launcher, clamp_rule):
    """Gate at, below and above +L; up at -L, L and beyond, under each torch's
    rule: up to 2.13 torch's clamp passes the gradient where min <= x <= max,
    from 2.14 where min < x < max; L + ulp never gets it (nor NaN)."""
    L = spec.limit
    ulp = torch.finfo(torch.float64).eps * L
    values = torch.tensor([-L - ulp, -L, -L + ulp, -1.0, 0.0, 0.5, L - ulp, L, L + ulp, 3 * L], dtype=torch.float64)
    gate = values.repeat(len(values))          # every (gate, up) pair of values
    up = values.repeat_interleave(len(values))
    gate, up = gate.view(10, 10).requires_grad_(), up.view(10, 10).requires_grad_()
    dh = torch.linspace(0.5, 2.0, 100, dtype=torch.float64).view(10, 10)
    sc.glu_reference(gate, up, spec, clamp_gradient_at_bound=clamp_rule).backward(dh)
    gate_up = torch.stack([gate, up], dim=2).reshape(10, 20) if spec.interleaved else torch.cat([gate, up], 1)
    kw = {"launcher": host_launcher} if implementation == "host_kernels" else {"implementation": "torch"}
    dx12, h = primitives.swiglu_backward(gate_up.detach(), dh, activation=spec, **kw)
    dgate, dup = (dx12[:, 0::2], dx12[:, 1::2]) if spec.interleaved else dx12.chunk(2, 1)
    torch.testing.assert_close(h, sc.glu_reference(gate, up, spec).detach(), rtol=1e-15, atol=1e-15)
    torch.testing.assert_close(dgate, gate.grad, rtol=1e-14, atol=1e-15)
    torch.testing.assert_close(dup, up.grad, rtol=1e-14, atol=1e-15)
    assert (dgate[gate.detach() > L] == 0).all() and (dup[up.detach().abs() > L] == 0).all()
    at_gate, at_up = dgate[gate.detach() == L], dup[up.detach().abs() == L]
    assert ((at_gate != 0).any() == clamp_rule) and ((at_gate == 0).all() != clamp_rule)
    assert ((at_up != 0).any() == clamp_rule) and ((at_up == 0).all() != clamp_rule)
    assert (dgate[(gate.detach() - L).abs() == ulp] != 0).any()  # just below the limit: passes under both


def test_interleaved_equals_halves_with_the_rows_interleaved():
    torch.manual_seed(2)
    halves = sc.SwiGLU(D, H, O, dtype=torch.float64, activation=GPT_OSS.__class__("oai", 1.5, 1.702, 1.0))
    pairs = sc.SwiGLU(D, H, O, dtype=torch.float64, activation=dataclasses.replace(halves.activation,
                                                                                   interleaved=True))
    with torch.no_grad():
        pairs.w12.weight.copy_(_interleave(list(halves.w12.weight.chunk(2))))
        pairs.w12.bias.copy_(_interleave(list(halves.w12.bias.chunk(2))))
        pairs.w3.load_state_dict(halves.w3.state_dict())
    x = torch.randn(9, D, dtype=torch.float64) * 2
    y_h, y_p = halves(x), pairs(x)
    torch.testing.assert_close(y_p, y_h, rtol=1e-14, atol=1e-14)
    y_h.sum().backward()
    y_p.sum().backward()
    torch.testing.assert_close(pairs.w12.weight.grad, _interleave(list(halves.w12.weight.grad.chunk(2))),
                               rtol=1e-13, atol=1e-14)
    torch.testing.assert_close(pairs.w3.weight.grad, halves.w3.weight.grad, rtol=1e-13, atol=1e-14)
    # Converting from and to separate projections honours the layout.
    gate, up, down = pairs.to_gate_up_down()
    torch.testing.assert_close(gate.weight, halves.w12.weight[:H])
    rebuilt = sc.SwiGLU.from_gate_up_down(gate, up, down, activation=pairs.activation)
    torch.testing.assert_close(rebuilt.w12.weight, pairs.w12.weight, rtol=0, atol=0)


@pytest.mark.parametrize("fn", ["glu_mul", "silu_mul"])
def test_glu_mul_every_plain_form_and_the_clamped_ones(fn):
    gate, up = torch.randn(3, 4, 40, dtype=torch.float64) * 2, torch.randn(3, 4, 40, dtype=torch.float64) * 2
    for spec in [*(s for s in SPECS.values() if not s.interleaved), "gelu_tanh", "relu"]:
        g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
        h = getattr(sc, fn)(g, u, activation=spec)
        h.backward(torch.ones_like(h))
        g_ref, u_ref = gate.clone().requires_grad_(), up.clone().requires_grad_()
        sc.glu_reference(g_ref, u_ref, spec).backward(torch.ones_like(h))
        torch.testing.assert_close(h, sc.glu_reference(gate, up, spec), rtol=1e-14, atol=1e-14)
        torch.testing.assert_close(g.grad, g_ref.grad, rtol=1e-13, atol=1e-14)
        torch.testing.assert_close(u.grad, u_ref.grad, rtol=1e-13, atol=1e-14)
    assert torch.autograd.gradcheck(lambda a, b: sc.glu_mul(a, b, "gelu"), (gate[0, :2].requires_grad_(),
                                                                            up[0, :2].requires_grad_()))


def test_bad_activation_arguments_name_activation():
    x, (w12, b12, w3, b3), _ = _params(torch.float32)
    w1, w2 = w12.chunk(2)
    with pytest.raises(ValueError, match="activation.*interleaved"):
        sc.swiglu_unpacked(x, w1, None, w2, None, w3, None, activation=GPT_OSS)
    with pytest.raises(ValueError, match="activation.*interleaved"):
        sc.glu_mul(w1, w2, activation=GPT_OSS)
    with pytest.raises(ValueError, match="activation must be one of"):
        sc.swiglu(x, w12, b12, w3, b3, activation="swish")
    with pytest.raises(TypeError, match="activation must be a str or a GLUActivation"):
        sc.SwiGLU(4, 4, activation=F.silu)
    with pytest.raises(ValueError, match="limit"):
        GLUActivation("silu", limit=-1.0)
    # swiglu_unpacked takes the halves variants.
    y = sc.swiglu_unpacked(x, w1, b12[:H], w2, b12[H:], w3, b3, activation=deepseek_v4(1.0))
    torch.testing.assert_close(y, sc.glu_ffn_reference(x, w12, b12, w3, b3, deepseek_v4(1.0)), rtol=1e-5, atol=1e-5)


def test_module_keeps_the_spec_out_of_the_state_dict_and_through_copies():
    m = sc.SwiGLU(D, H, O, activation=GPT_OSS)
    assert "activation=oai, alpha=1.702, up_offset=1, limit=7, interleaved" in repr(m)
    assert "activation=silu" in repr(sc.SwiGLU(D, H))
    assert set(m.state_dict()) == {"w12.weight", "w12.bias", "w3.weight", "w3.bias"}
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    x = torch.randn(4, D) * 3
    for other in (loaded, copy.deepcopy(m)):
        assert other.activation == GPT_OSS
        torch.testing.assert_close(other(x), m(x), rtol=0, atol=0)
    plain = sc.SwiGLU(D, H, O)
    plain.load_state_dict(m.state_dict())  # same keys: only the spec says how to read w12
    assert plain.activation is SILU
    assert sc.SwiGLU(D, H, activation="gelu_tanh").activation == GLUActivation("gelu_tanh")


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpointing_and_autocast(use_reentrant):
    torch.manual_seed(3)
    m = sc.SwiGLU(D, H, O, activation=GPT_OSS)
    x = (torch.randn(6, D) * 3).requires_grad_()
    m(x).pow(2).sum().backward()
    expected = [x.grad.clone()] + [p.grad.clone() for p in m.parameters()]
    x.grad = None
    m.zero_grad()
    checkpoint(m, x, use_reentrant=use_reentrant).pow(2).sum().backward()
    for g, e in zip([x.grad] + [p.grad for p in m.parameters()], expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = checkpoint(m, x, use_reentrant=use_reentrant)
    assert y.dtype == torch.bfloat16
    assert rel_rms(y, sc.glu_ffn_reference(x, m.w12.weight, m.w12.bias, m.w3.weight, m.w3.bias, GPT_OSS)) < 1e-2


@pytest.mark.parametrize("spec", [GPT_OSS, deepseek_v4(1.0)], ids=str)
def test_memory_modes_give_the_same_results(spec):
    torch.manual_seed(4)
    x = torch.randn(8, D, dtype=torch.float64) * 2
    results = []
    for kw in ({}, {"recompute_gate_up": True}, {"inplace_backward": True}):
        torch.manual_seed(5)
        m = sc.SwiGLU(D, H, O, dtype=torch.float64, activation=spec, **kw)
        xi = x.clone().requires_grad_()
        y = m(xi)
        y.pow(2).sum().backward()
        with torch.no_grad():
            y_no_grad = m(x)
        torch.testing.assert_close(y_no_grad, y.detach(), rtol=0, atol=0)
        results.append([y.detach(), xi.grad] + [p.grad for p in m.parameters()])
    for other in results[1:]:
        for a, b in zip(other, results[0]):
            torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-14)


def test_torch_compile_fullgraph_every_layout():
    torch.manual_seed(6)
    model = torch.nn.Sequential(sc.SwiGLU(16, 24, activation=GPT_OSS), sc.SwiGLU(16, 24, activation="gelu_tanh"),
                                sc.SwiGLU(16, 24, activation=deepseek_v4(1.0), recompute_gate_up=True))
    assert_compiled_matches_eager(model, (torch.randn(3, 4, 16) * 3).requires_grad_(), tol=1e-5)


def test_opcheck_with_every_spec_argument():
    x12, dh = torch.randn(5, 14) * 3, torch.randn(5, 7)
    spec = ops.spec_args(dataclasses.replace(GPT_OSS, limit=1.5))
    gate, up = x12.chunk(2, 1)
    for op, args in [(torch.ops.swiglu_cupy.swiglu_forward.default, (x12, *spec)),
                     (torch.ops.swiglu_cupy.swiglu_backward.default, (x12, dh, *spec)),
                     (torch.ops.swiglu_cupy.swiglu_backward_inplace.default, (x12.clone(), dh, *spec)),
                     (torch.ops.swiglu_cupy.silu_mul_forward.default, (gate.contiguous(), up.contiguous(),
                                                                       "gelu", 1.5, 1.0, 0.0, False))]:
        torch.library.opcheck(op, args)


def test_export_records_the_spec_and_decomposes_to_aten():
    torch.manual_seed(7)
    m = sc.SwiGLU(D, H, O, dtype=torch.float64, activation=GPT_OSS)
    x = torch.randn(4, D, dtype=torch.float64) * 3
    ep = torch.export.export(m, (x,))
    nodes = [n for n in ep.graph.nodes if str(n.target).startswith("swiglu_cupy.")]
    assert nodes and all(n.kwargs.get("kind", n.args[1] if len(n.args) > 1 else None) == "oai" for n in nodes)
    torch.testing.assert_close(ep.module()(x), m(x), rtol=1e-14, atol=1e-14)
    plain = ep.run_decompositions(ops.aten_decompositions())
    assert not [n for n in plain.graph.nodes if str(n.target).startswith("swiglu_cupy.")]
    torch.testing.assert_close(plain.module()(x), m(x), rtol=1e-12, atol=1e-12)


def test_torch_func_grad_and_vmap():
    torch.manual_seed(8)
    m = sc.SwiGLU(D, H, O, dtype=torch.float64, activation=GPT_OSS)
    params = dict(m.named_parameters())
    xs = torch.randn(3, 5, D, dtype=torch.float64) * 3

    def loss(p, x, fn):
        return fn(p, x).pow(2).sum()

    ours = lambda p, x: torch.func.functional_call(m, p, (x,))  # noqa: E731
    ref = lambda p, x: sc.glu_ffn_reference(x, p["w12.weight"], p["w12.bias"], p["w3.weight"], p["w3.bias"],  # noqa: E731
                                            GPT_OSS)
    torch.testing.assert_close(torch.func.vmap(ours, in_dims=(None, 0))(params, xs), ref(params, xs))
    g = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, None))(params, xs, ours)
    g_ref = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, None))(params, xs, ref)
    for k in params:
        assert_nontrivial(g[k], k)
        torch.testing.assert_close(g[k], g_ref[k], rtol=1e-12, atol=1e-12)


def test_onnx_export_of_the_variants_uses_standard_ops(tmp_path):
    torch.manual_seed(9)
    model = torch.nn.Sequential(sc.SwiGLU(D, H, D, activation=GPT_OSS), sc.SwiGLU(D, H, D, activation="gelu"),
                                sc.SwiGLU(D, H, D, activation=deepseek_v4(1.0))).eval()
    x = torch.randn(2, 3, D) * 3
    out = onnx_run_with_standard_ops(model, x, tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
