"""functions.py: the apply-only Functions' calling convention."""
import pytest
import torch

from swiglu_cupy import SiluMulFunction, SwiGLUFunction, SwiGLUOptions
from swiglu_cupy.activations import GPT_OSS, SILU, GLUActivation
from swiglu_cupy.reference import glu_ffn_reference, glu_reference, swiglu_reference
from conftest import zero_filled_shapes

D, H, O = 16, 24, 8


def _packed(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(5, D, generator=gen), torch.randn(2 * H, D, generator=gen) / D ** 0.5,
            torch.randn(O, H, generator=gen) / H ** 0.5)


def test_apply_with_every_argument_matches_the_reference():
    x, w12, w3 = _packed()
    y, x12 = SwiGLUFunction.apply(x, w12, None, None, None, w3, None, SwiGLUOptions(SILU), False, 0)
    assert torch.allclose(y, swiglu_reference(x, w12, None, w3, None), rtol=1e-5, atol=1e-6)
    assert x12.shape == (5, 2 * H)
    y, _ = SwiGLUFunction.apply(x, w12, None, None, None, w3, None, SwiGLUOptions(GPT_OSS), False, 0)
    assert torch.allclose(y, glu_ffn_reference(x, w12, None, w3, None, GPT_OSS), rtol=1e-5, atol=1e-6)


def test_backward_builds_no_zero_gradient_for_x12():
    """x12 is an output only so that it can be saved: autograd must not
    materialise a zero [M, 2H] gradient for it before every backward."""
    x, w12, w3 = (t.requires_grad_() for t in _packed())
    y, _ = SwiGLUFunction.apply(x, w12, None, None, None, w3, None, SwiGLUOptions(SILU), False, 0)
    filled = zero_filled_shapes(lambda: y.sum().backward())
    assert (x.shape[0], 2 * H) not in filled, filled
    assert x.grad.abs().sum() > 0 and w12.grad.abs().sum() > 0


def test_silu_mul_function_takes_the_spec():
    gate, up = torch.randn(2, 3, 8, dtype=torch.float64), torch.randn(2, 3, 8, dtype=torch.float64)
    spec = GLUActivation("gelu_tanh", limit=1.0)
    torch.testing.assert_close(SiluMulFunction.apply(gate, up, spec), glu_reference(gate, up, spec))


@pytest.mark.parametrize("transform", ["eager", "vmap", "grad"])
def test_missing_arguments_fail_the_same_way_in_eager_and_under_transforms(transform):
    """The forward has no defaults, so the lean apply (eager) and torch's own
    apply (transforms) cannot disagree about a short call."""
    x, w12, w3 = _packed()
    short = lambda x: SwiGLUFunction.apply(x, w12, None, None, None, w3, None)[0]  # noqa: E731
    call = {"eager": short, "vmap": torch.func.vmap(short),
            "grad": torch.func.grad(lambda x: short(x).sum())}[transform]
    with pytest.raises(TypeError, match=r"SwiGLUFunction\.apply takes 10 positional arguments .*got 7"):
        call(x)


def test_silu_mul_function_checks_its_argument_count_too():
    with pytest.raises(TypeError, match=r"SiluMulFunction\.apply takes 3 positional arguments"):
        SiluMulFunction.apply(torch.randn(3))


def test_a_function_with_defaults_cannot_use_the_lean_apply():
    from swiglu_cupy._autograd import LeanApplyFunction

    with pytest.raises(TypeError, match="required positional arguments only"):
        class WithDefault(LeanApplyFunction):  # noqa: F841
            @staticmethod
            def forward(x, scale=2.0):
                return x * scale


def test_a_call_is_decided_once_and_reused():
    """The API checks a call's settings and decides its path once: a repeated
    call reuses the same options object, its path bound in; another dtype is a
    decision of its own; a bad value is refused every time (1 is not True)."""
    from swiglu_cupy.dense import api
    from swiglu_cupy.primitives import dispatch

    x, w12, w3 = _packed()
    api._DECIDED.clear()
    api.swiglu(x, w12, None, w3, None, recompute_gate_up=True)
    ((key, first),) = api._DECIDED.items()
    api.swiglu(x, w12, None, w3, None, recompute_gate_up=True)
    assert list(api._DECIDED) == [key] and api._DECIDED[key] is first
    options = first[3]
    assert options._replace(path=None) == SwiGLUOptions(SILU, recompute_gate_up=True)
    assert options.path is dispatch.eager_path(x, SILU)  # the path decided (and kept) for x
    api.swiglu(x.double(), w12.double(), None, w3.double(), None, recompute_gate_up=True)
    assert len(api._DECIDED) == 2
    # A spec is keyed by identity, and the entry keeps it: an equal spec made anew gets its own
    # entry with equal settings, never another object's (a freed spec's id may be reused).
    spec, twin = GLUActivation("gelu_tanh"), GLUActivation("gelu_tanh")
    api.swiglu(x, w12, None, w3, None, activation=spec)
    api.swiglu(x, w12, None, w3, None, activation=twin)
    entries = [next(e for e in api._DECIDED.values() if e[0] is s) for s in (spec, twin)]
    assert entries[0][3]._replace(path=None) == entries[1][3]._replace(path=None)
    assert entries[0][3].activation is spec and entries[1][3].activation is twin
    for _ in range(2):
        with pytest.raises(TypeError, match="recompute_gate_up must be a bool"):
            api.swiglu(x, w12, None, w3, None, recompute_gate_up=1)
        with pytest.raises(ValueError, match="saved_x12='fp8' cannot be combined with recompute_gate_up"):
            api.swiglu(x, w12, None, w3, None, recompute_gate_up=True, saved_x12="fp8")


def test_only_lasting_path_decisions_are_kept_by_the_api_and_a_reset_forgets_them(monkeypatch):
    """A call whose path is not a lasting decision (a self-check deferred or
    failed: asked again next call) leaves nothing in the API's cache; a kept
    one goes on a self-check reset, with the path it holds."""
    from swiglu_cupy.dense import api
    from swiglu_cupy.primitives import dispatch, first_use_check
    from swiglu_cupy.tools import host_cost

    x, w12, w3 = _packed()
    api._DECIDED.clear()
    monkeypatch.setattr(dispatch, "kernels_usable", lambda *a: False)  # as a failed self-check answers
    with host_cost.cuda_route():
        api.swiglu(x, w12, None, w3, None)
    assert not api._DECIDED
    monkeypatch.undo()
    with host_cost.cuda_route():
        api.swiglu(x, w12, None, w3, None)
        ((_, entry),) = api._DECIDED.items()
        assert isinstance(entry[3].path, dispatch.KernelPath)
        first_use_check.reset()
        assert not api._DECIDED


def _first_order_calls():
    """Each Function's call with an input that requires grad: (name, call() -> (output, input))."""
    import swiglu_cupy as sc
    import swiglu_cupy.moe as moe

    def dense():
        x, w12, w3 = _packed()
        x.requires_grad_()
        return sc.swiglu(x, w12, None, w3, None), x

    def silu_mul():
        gate, up = (t.requires_grad_() for t in torch.randn(2, 5, H, generator=torch.Generator().manual_seed(0)))
        return sc.silu_mul(gate, up), gate

    def experts():
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(7, D, generator=gen, requires_grad=True)
        ids = torch.randint(0, 3, (7, 2), generator=gen)
        weights = torch.rand(7, 2, generator=gen)
        w12, w3 = torch.randn(3, 2 * H, D, generator=gen) / D ** 0.5, torch.randn(3, D, H, generator=gen) / H ** 0.5
        return moe.routed_experts(x, ids, weights, w12, w3), x

    return {"swiglu": dense, "silu_mul": silu_mul, "routed_experts": experts}


@pytest.mark.parametrize("name", ["swiglu", "silu_mul", "routed_experts"])
def test_backward_is_first_order_only(name):
    """A backward with create_graph=True runs under torch's once_differentiable
    guard: its gradients are the usual ones, and differentiating them again
    raises. Without create_graph the backward runs bare, with the same result."""
    call = _first_order_calls()[name]
    y, x = call()
    (plain,) = torch.autograd.grad(y.square().sum(), x)
    y, x = call()
    (graphed,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    assert torch.equal(graphed, plain) and plain.abs().sum() > 0
    with pytest.raises(RuntimeError, match="once_differentiable"):
        graphed.sum().backward()


def test_apply_unwrapped_is_torchs_own_apply():
    """The dense API's common case applies the Function through torch's C++
    apply itself (the graph-building apply, never ``forward``); where that is
    unavailable, through ``apply``."""
    from swiglu_cupy import _torch_compat

    assert _torch_compat.cpp_apply is not None
    assert SwiGLUFunction.apply_unwrapped == _torch_compat.cpp_apply.__get__(None, SwiGLUFunction)
    assert SwiGLUFunction.apply_unwrapped != _torch_compat.cpp_apply.__get__(None, SiluMulFunction)
