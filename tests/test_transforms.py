"""Program transforms: torch.export, torch.func (grad, vjp, jacrev, vmap,
per-sample gradients), ONNX export, nn.Module conventions (reset_parameters,
meta-device init) and the TorchScript error. CPU path, against the eager
references, with non-trivial gradients."""
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, jacrev, vjp, vmap

import swiglu_cupy as sc
from swiglu_cupy import primitives
from swiglu_cupy.primitives import ops
from conftest import assert_nontrivial, onnx_run_with_standard_ops

D, H, O = 12, 20, 10
TOL = dict(rtol=1e-10, atol=1e-10)  # float64 throughout: same math, different op order


def _block(bias=True, dtype=torch.float64):
    torch.manual_seed(0)
    return sc.SwiGLU(D, H, O, bias=bias, dtype=dtype)


def _reference_block(block):
    """The same weights as three eager nn.Linear ops (gate, up, down)."""
    gate, up, down = block.to_gate_up_down()

    def forward(x):
        return down(F.silu(gate(x)) * up(x))
    return forward, (gate, up, down)


class FunctionalModel(nn.Module):
    """swiglu() and silu_mul() called as functions inside a model."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.block = sc.SwiGLU(D, H, D, dtype=torch.float64)
        self.gate = nn.Linear(D, H, dtype=torch.float64)
        self.up = nn.Linear(D, H, dtype=torch.float64)

    def forward(self, x):
        b = self.block
        y = sc.swiglu(x, b.w12.weight, b.w12.bias, b.w3.weight, b.w3.bias)
        return sc.silu_mul(self.gate(y), self.up(y))

    def reference(self, x):
        b = self.block
        y = sc.swiglu_reference(x, b.w12.weight, b.w12.bias, b.w3.weight, b.w3.bias)
        return sc.silu_mul_reference(self.gate(y), self.up(y))


def _x(*shape, requires_grad=False):
    torch.manual_seed(2)
    return torch.randn(*shape, D, dtype=torch.float64, requires_grad=requires_grad)


def _grads(model, x, fn=None):
    y = (fn or model)(x)
    y.pow(2).sum().backward()
    return y.detach(), [x.grad] + [p.grad for p in model.parameters()]


# ---- torch.export -----------------------------------------------------------------------------

def _our_ops(ep):
    """Our ops anywhere in the program (strict export nests grad-mode regions
    in submodules)."""
    return sorted({str(n.target) for gm in ep.graph_module.modules() if isinstance(gm, torch.fx.GraphModule)
                   for n in gm.graph.nodes if n.op == "call_function" and "swiglu_cupy" in str(n.target)})


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("grad_enabled", [True, False])
@pytest.mark.parametrize("model_kind", ["module", "functional"])
def test_export_runs_and_matches_eager(strict, grad_enabled, model_kind):
    model = _block() if model_kind == "module" else FunctionalModel()
    x = _x(3, 5)
    with torch.set_grad_enabled(grad_enabled):
        ep = torch.export.export(model, (x,), strict=strict)
        expected = model(x)
        torch.testing.assert_close(ep.module()(x), expected, **TOL)
    # Our fused ops stay in the graph, functional in both grad modes (an exported
    # program holds no mutating op, which ONNX and aten_decompositions() could not translate).
    assert "swiglu_cupy.swiglu_forward.default" in _our_ops(ep)
    assert "swiglu_cupy.swiglu_forward_inplace.default" not in _our_ops(ep)
    if model_kind == "functional":
        assert "swiglu_cupy.silu_mul_forward.default" in _our_ops(ep)


def test_export_with_dynamic_batch_dim():
    model = FunctionalModel()
    batch = torch.export.Dim("batch")
    ep = torch.export.export(model, (_x(3, 5),), dynamic_shapes={"x": {0: batch}})
    for rows in (1, 4, 7):
        x = _x(rows, 5)
        torch.testing.assert_close(ep.module()(x), model.reference(x), **TOL)


def test_exported_program_is_differentiable_with_our_backward():
    """An exported program run with grad differentiates through the ops'
    registered autograd formulas (the fused backward kernels)."""
    model = FunctionalModel()
    ep = torch.export.export(model, (_x(4),))
    x = _x(4, requires_grad=True)
    y = ep.module()(x)
    y.pow(2).sum().backward()
    expected_x = x.grad.clone()
    x.grad = None
    model.reference(x).pow(2).sum().backward()
    assert_nontrivial(expected_x, "dx")
    torch.testing.assert_close(expected_x, x.grad, **TOL)


def test_run_decompositions_default_and_to_plain_aten():
    model = FunctionalModel()
    x = _x(2, 3)
    ep = torch.export.export(model, (x,))
    default = ep.run_decompositions()
    assert _our_ops(default), "the default decompositions keep our ops"
    torch.testing.assert_close(default.module()(x), model.reference(x), **TOL)
    plain = ep.run_decompositions(ops.aten_decompositions())
    assert _our_ops(plain) == []
    torch.testing.assert_close(plain.module()(x), model.reference(x), **TOL)


def test_export_save_load_round_trip_in_a_fresh_process(tmp_path):
    model = FunctionalModel()
    x = _x(3, 4)
    with torch.no_grad():
        expected = model(x)
    path = tmp_path / "model.pt2"
    torch.export.save(torch.export.export(model, (x,)), path)
    torch.save({"x": x, "expected": expected}, tmp_path / "io.pt")
    script = textwrap.dedent(f"""
        import torch, swiglu_cupy  # registers torch.ops.swiglu_cupy.*
        io = torch.load({str(tmp_path / 'io.pt')!r})
        ep = torch.export.load({str(path)!r})
        y = ep.module()(io["x"])
        torch.testing.assert_close(y, io["expected"], rtol=1e-12, atol=1e-12)
        print("ROUND TRIP OK", sorted({{str(n.target) for n in ep.graph.nodes if "swiglu_cupy" in str(n.target)}}))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ROUND TRIP OK" in proc.stdout and "swiglu_forward" in proc.stdout


# ---- torch.func -------------------------------------------------------------------------------

def test_func_grad_and_vjp_match_autograd():
    block = _block()
    ref, ref_modules = _reference_block(block)
    params = {k: v.detach() for k, v in block.named_parameters()}
    x = _x(3, 4)

    def loss(p, x):
        return functional_call(block, p, (x,)).pow(2).sum()

    g_params, g_x = grad(loss, argnums=(0, 1))(params, x)
    x_ref = x.clone().requires_grad_(True)
    ref(x_ref).pow(2).sum().backward()
    torch.testing.assert_close(g_x, x_ref.grad, **TOL)
    gate, up, down = ref_modules
    torch.testing.assert_close(g_params["w12.weight"], torch.cat([gate.weight.grad, up.weight.grad]), **TOL)
    torch.testing.assert_close(g_params["w3.weight"], down.weight.grad, **TOL)
    for name, g in g_params.items():
        assert_nontrivial(g, name)

    y, pullback = vjp(lambda x: block(x), x)
    dy = torch.randn_like(y)
    (dx,) = pullback(dy)
    _, ref_pullback = vjp(ref, x)
    torch.testing.assert_close(dx, ref_pullback(dy)[0], **TOL)


def test_func_jacrev_matches_the_reference():
    model = FunctionalModel()
    x = _x(2)
    jac = jacrev(model)(x)
    assert jac.shape == (2, H, 2, D)
    torch.testing.assert_close(jac, jacrev(model.reference)(x), **TOL)
    assert jac.abs().max() > 0


def test_vmap_over_inputs_folds_into_one_launch(monkeypatch):
    block = _block()
    xs = _x(6, 3)  # vmap over 6 batches of 3 tokens
    calls = []
    real = primitives.dispatch.run_swiglu_forward
    monkeypatch.setattr(primitives.dispatch, "run_swiglu_forward", lambda x12, *a, **k: calls.append(x12.shape) or real(x12, *a, **k))
    ys = vmap(block)(xs)
    assert calls == [(18, 2 * H)], "one primitive call over all 6 x 3 token rows"
    torch.testing.assert_close(ys, torch.stack([sc.swiglu_reference(x, block.w12.weight, block.w12.bias,
                                                                     block.w3.weight, block.w3.bias)
                                                for x in xs]), **TOL)


def test_vmap_silu_mul_batched_and_unbatched_arguments():
    torch.manual_seed(3)
    gate, up = torch.randn(4, 5, H, dtype=torch.float64), torch.randn(5, H, dtype=torch.float64)
    out = vmap(sc.silu_mul, in_dims=(0, None))(gate, up)
    torch.testing.assert_close(out, sc.silu_mul_reference(gate, up.expand_as(gate)), **TOL)
    out = vmap(sc.silu_mul, in_dims=(1, 1))(gate.transpose(0, 1), gate.transpose(0, 1))
    torch.testing.assert_close(out, sc.silu_mul_reference(gate, gate).transpose(0, 1).transpose(0, 1), **TOL)


def test_vmap_over_stacked_weights_ensemble():
    torch.manual_seed(4)
    members = [sc.SwiGLU(D, H, O, dtype=torch.float64) for _ in range(3)]
    params, _ = torch.func.stack_module_state(members)
    x = _x(5)

    def run(p):
        return functional_call(members[0], p, (x,))

    ys = vmap(run)(params)
    torch.testing.assert_close(ys, torch.stack([m(x) for m in members]), **TOL)


def test_per_sample_gradients_of_a_two_layer_model():
    torch.manual_seed(5)
    model = nn.Sequential(sc.SwiGLU(D, H, D, dtype=torch.float64), sc.SwiGLU(D, H, 1, dtype=torch.float64))
    params = {k: v.detach() for k, v in model.named_parameters()}
    xs = _x(4, 3)  # 4 samples of 3 tokens

    def loss(p, x):
        return functional_call(model, p, (x,)).pow(2).mean()

    per_sample = vmap(grad(loss), in_dims=(None, 0))(params, xs)
    for i, x in enumerate(xs):
        model.zero_grad()
        loss(dict(model.named_parameters()), x).backward()
        for name, p in model.named_parameters():
            assert_nontrivial(per_sample[name][i], name)
            torch.testing.assert_close(per_sample[name][i], p.grad, **TOL)


# ---- ONNX -------------------------------------------------------------------------------------

def test_onnx_export_uses_standard_ops_and_matches_onnxruntime(tmp_path):
    torch.manual_seed(6)
    model = nn.Sequential(sc.SwiGLU(D, H, D), nn.Linear(D, D))
    gate_up = nn.Linear(D, 2 * H)

    class WithSiluMul(nn.Module):
        def __init__(self):
            super().__init__()
            self.model, self.gate_up = model, gate_up

        def forward(self, x):
            g, u = self.gate_up(self.model(x)).chunk(2, dim=-1)
            return sc.silu_mul(g.contiguous(), u.contiguous())

    wrapped = WithSiluMul().eval()
    x = torch.randn(2, 3, D)
    out = onnx_run_with_standard_ops(wrapped, x, tmp_path)
    with torch.no_grad():
        expected = wrapped(x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


# ---- nn.Module conventions --------------------------------------------------------------------

def test_reset_parameters_initializes_exactly_like_nn_linear():
    block = sc.SwiGLU(D, H, O)
    torch.manual_seed(7)
    block.reset_parameters()
    torch.manual_seed(7)
    w12, w3 = nn.Linear(D, 2 * H), nn.Linear(H, O)
    for ours, ref in ((block.w12, w12), (block.w3, w3)):
        assert torch.equal(ours.weight, ref.weight) and torch.equal(ours.bias, ref.bias)
    bound = 1 / math.sqrt(D)
    assert block.w12.weight.abs().max() <= bound and block.w12.weight.std() > bound / 4


def test_meta_device_init_then_to_empty_and_reset_parameters():
    with torch.device("meta"):
        block = sc.SwiGLU(D, H, O)
    block.to_empty(device="cpu")
    block.reset_parameters()
    reference = _block(dtype=torch.float32)
    reference.load_state_dict(block.state_dict())
    x = torch.randn(4, D, requires_grad=True)
    y = block(x)
    torch.testing.assert_close(y, reference(x))
    y.sum().backward()
    assert_nontrivial(x.grad, "dx")


def test_torchscript_raises_one_clear_error_naming_torch_export():
    block = _block()
    w12, b12, w3, b3 = (t.detach() for t in (block.w12.weight, block.w12.bias, block.w3.weight, block.w3.bias))
    w1, w2 = w12.chunk(2)

    def unpacked(x):
        return sc.swiglu_unpacked(x, w1, None, w2, None, w3, b3)

    for compile_ in (lambda: torch.jit.trace(block, (_x(2),)), lambda: torch.jit.script(block),
                     lambda: torch.jit.script(nn.Sequential(block)), lambda: torch.jit.trace(unpacked, (_x(2),))):
        with pytest.raises(RuntimeError, match="torch.export"):
            compile_()


def test_func_and_export_of_swiglu_unpacked():
    """Separate gate/up weights (the xformers unpacked op's path) under
    torch.func and torch.export, against the packed reference."""
    block = _block()
    H_ = block.hidden_features
    w12, b12, w3, b3 = (t.detach() for t in (block.w12.weight, block.w12.bias, block.w3.weight, block.w3.bias))
    w1, w2, b1, b2 = w12[:H_], w12[H_:], b12[:H_], b12[H_:]

    def unpacked(x, w1, w2):
        return sc.swiglu_unpacked(x, w1, b1, w2, b2, w3, b3)

    def reference(x, w1, w2):
        return sc.swiglu_reference(x, torch.cat([w1, w2]), b12, w3, b3)

    x = _x(3, 4)
    loss = lambda f: lambda *a: f(*a).pow(2).sum()  # noqa: E731
    got = grad(loss(unpacked), argnums=(0, 1, 2))(x, w1, w2)
    want = grad(loss(reference), argnums=(0, 1, 2))(x, w1, w2)
    for g, w, name in zip(got, want, ("x", "w1", "w2")):
        assert_nontrivial(g, name)
        torch.testing.assert_close(g, w, **TOL)
    torch.testing.assert_close(vmap(unpacked, in_dims=(0, None, None))(x, w1, w2),
                               vmap(reference, in_dims=(0, None, None))(x, w1, w2), **TOL)

    class Unpacked(nn.Module):
        def forward(self, x):
            return unpacked(x, w1, w2)

    ep = torch.export.export(Unpacked(), (x,))
    assert "swiglu_cupy.swiglu_forward.default" in _our_ops(ep)
    torch.testing.assert_close(ep.module()(x), reference(x, w1, w2), **TOL)


@pytest.mark.parametrize("leaked_name", ["w12", "b12"])
def test_a_weight_left_over_from_a_transform_still_gets_its_gradient(leaked_name, monkeypatch):
    """x is plain, so the call is eager; a weight (or bias) that escaped a
    finished transform is seen by the API (where Dynamo never looks) and
    goes through torch's apply, not the bare C++ apply of the common case,
    so it is unwrapped: the gradient reaches the original tensor (the C++
    apply alone loses it)."""
    from swiglu_cupy import SwiGLUFunction

    torch.manual_seed(0)
    params = {"w12": torch.randn(2 * H, D, dtype=torch.float64), "b12": torch.randn(2 * H, dtype=torch.float64)}
    w3 = torch.randn(D, H, dtype=torch.float64)
    original = params[leaked_name].requires_grad_()
    leaked = []
    torch.func.vjp(lambda t: leaked.append(t) or t * 1, original)
    (dead,) = leaked
    assert torch._C._functorch.is_functorch_wrapped_tensor(dead)
    applied = []
    bare = SwiGLUFunction.apply_unwrapped
    monkeypatch.setattr(SwiGLUFunction, "apply_unwrapped", lambda *a: applied.append("bare") or bare(*a))
    x = _x(3)
    sc.swiglu(x, params["w12"].detach(), params["b12"], w3, None)
    assert applied == ["bare"]  # the common case: the C++ apply itself
    args = {**params, leaked_name: dead}
    y = sc.swiglu(x, args["w12"], args["b12"], w3, None)
    assert applied == ["bare"]  # not for the leaked tensor
    y.pow(2).sum().backward()
    got, original.grad = original.grad, None
    y_ref = sc.swiglu_reference(x, params["w12"], params["b12"], w3, None)
    y_ref.pow(2).sum().backward()
    torch.testing.assert_close(y, y_ref, **TOL)
    assert_nontrivial(got, "grad through the dead wrapper")
    torch.testing.assert_close(got, original.grad, **TOL)


def test_a_tensor_left_over_from_a_transform_still_works():
    """A tensor that escaped a finished torch.func transform is a dead
    wrapper: the Functions' lean apply hands it to torch's apply, which
    unwraps it, so the result and the gradient reaching the original tensor
    are those of the plain tensor (the C++ apply alone loses the gradient)."""
    leaked = []
    x = _x(3, requires_grad=True)
    torch.func.vjp(lambda t: leaked.append(t) or t * 1, x)
    (dead,) = leaked
    assert torch._C._functorch.is_functorch_wrapped_tensor(dead)
    block = _block()
    up = torch.randn(3, D, dtype=torch.float64)
    for fn in (block, lambda t: sc.silu_mul(t, up)):
        y = fn(dead)
        y.pow(2).sum().backward()
        got, x.grad = x.grad, None
        y_ref = fn(x)
        y_ref.pow(2).sum().backward()
        torch.testing.assert_close(y, y_ref, **TOL)
        assert_nontrivial(got, "grad through the dead wrapper")
        torch.testing.assert_close(got, x.grad, **TOL)
        x.grad = None
