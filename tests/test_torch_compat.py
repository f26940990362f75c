"""_torch_compat: each private torch internal still behaves as the package
assumes. A failure here means torch changed it: read the note beside it."""
import pytest
import torch

from swiglu_cupy import _torch_compat as compat


def test_is_functorch_wrapped_sees_vmap_and_grad_wrappers_only():
    seen = {}

    def probe(t, key):
        seen[key] = compat.is_functorch_wrapped(t)
        return t.sum()

    torch.func.vmap(lambda t: probe(t, "vmap"))(torch.randn(3, 2))
    torch.func.grad(lambda t: probe(t, "grad"))(torch.randn(3))
    probe(torch.randn(3), "plain")
    assert seen == {"vmap": True, "grad": True, "plain": False}, (
        "torch._C._functorch.is_functorch_wrapped_tensor changed meaning")


def test_functorch_transforms_active_only_inside_a_transform():
    inside = []
    torch.func.vmap(lambda t: inside.append(compat.functorch_transforms_active()) or t)(torch.randn(2, 2))
    assert inside == [True] and compat.functorch_transforms_active() is False, (
        "torch._C._are_functorch_transforms_active changed meaning")


def test_any_autocast_enabled_sees_autocast_on_any_device_type():
    assert compat.any_autocast_enabled() is False
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert compat.any_autocast_enabled() is True, "torch._C._is_any_autocast_enabled changed meaning"
        with torch.autocast("cpu", enabled=False):
            assert compat.any_autocast_enabled() is False
    assert compat.any_autocast_enabled() is False


def test_jit_tracing_is_true_inside_a_jit_trace_only():
    seen = []

    def record(x):
        seen.append(compat.jit_tracing())
        return x * 2

    assert compat.jit_tracing() is False
    torch.jit.trace(record, (torch.randn(2),), check_trace=False)  # one run, traced
    assert seen == [True], "torch._C._is_tracing changed meaning"
    assert compat.jit_tracing() is False


def test_cpp_apply_records_the_same_graph_as_apply():
    class Double(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return x * 2

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, g):
            return g * 3  # distinguishable from autograd of x * 2

    x = torch.randn(4, requires_grad=True)
    y = compat.cpp_apply.__get__(None, Double)(x)
    assert type(y.grad_fn).__name__ == "DoubleBackward", "torch._C._FunctionBase.apply no longer builds the node"
    y.sum().backward()
    assert torch.equal(y, x.detach() * 2) and torch.equal(x.grad, torch.full((4,), 3.0))


def test_global_module_hooks_are_seen():
    assert compat.global_module_hooks_active() is False
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: None)
    try:
        assert compat.global_module_hooks_active() is True, "nn.Module's global hook registries moved"
    finally:
        handle.remove()
    assert compat.global_module_hooks_active() is False


def _in_a_fresh_process(code: str) -> str:
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def test_torch_compile_under_the_ci_environment_variable():
    """With CI set (GitHub Actions sets CI=true), Inductor refuses to make a
    fallback of an op that has a decomposition in torch's global table, so
    our ops must not be there: a fresh process compiles SwiGLU's forward and
    backward under CI=true and matches eager."""
    code = (
        "import torch, torch._decomp, swiglu_cupy as sc\n"
        "table = torch._decomp.global_decomposition_table['post_autograd']\n"
        "assert not any(str(o).startswith('swiglu_cupy') for o in table), 'our ops in the global table'\n"
        "torch.manual_seed(0)\n"
        "m = sc.SwiGLU(16, 24)\n"
        "x = torch.randn(5, 16, requires_grad=True)\n"
        "y = torch.compile(m, fullgraph=True)(x)\n"
        "y.square().sum().backward()\n"
        "g = x.grad.clone(); x.grad = None\n"
        "m(x).square().sum().backward()\n"
        "torch.testing.assert_close(g, x.grad)\n"
        "print('ok')\n")
    import os
    import subprocess
    import sys

    env = dict(os.environ, CI="true", TORCHINDUCTOR_CACHE_DIR=os.environ.get("TORCHINDUCTOR_CACHE_DIR", ""))
    if not env["TORCHINDUCTOR_CACHE_DIR"]:
        del env["TORCHINDUCTOR_CACHE_DIR"]
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_a_torch_without_the_cpp_apply_still_imports_and_runs(tmp_path):
    """If torch moves _FunctionBase, import swiglu_cupy warns once and the
    Functions take torch's own apply: same results (a speed loss only)."""
    out = _in_a_fresh_process(
        "import warnings, torch\n"
        "del torch._C._FunctionBase\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import swiglu_cupy as sc\n"
        "print(sum('_FunctionBase is gone' in str(w.message) for w in caught))\n"
        "from swiglu_cupy import _torch_compat\n"
        "print(_torch_compat.cpp_apply is None)\n"
        "torch.manual_seed(0)\n"
        "m = sc.SwiGLU(8, 16); x = torch.randn(3, 8, requires_grad=True)\n"
        "y = m(x); y.sum().backward()\n"
        "ref = sc.swiglu_reference(x.detach(), m.w12.weight, m.w12.bias, m.w3.weight, m.w3.bias)\n"
        "print(torch.allclose(y, ref, atol=1e-6) and bool(x.grad.abs().sum() > 0))\n")
    assert out.split() == ["1", "True", "True"], out


def test_this_torch_has_the_cpp_apply():
    """The fallback above must stay a fallback: on the supported torch the lean apply is live."""
    assert compat.cpp_apply is not None, "torch._C._FunctionBase.apply moved: see _torch_compat"


def test_silu_into_writes_silu_into_out():
    x = torch.randn(5, 7)
    out = torch.empty(5, 7)
    assert compat.silu_into(x, out=out) is out, "torch._C._nn.silu(x, out=) no longer returns out"
    assert torch.equal(out, torch.nn.functional.silu(x)), "torch._C._nn.silu changed meaning"
    assert compat.silu_into is torch._C._nn.silu   # the fallback is not live on the supported torch


def test_dropout_and_norm_base_classes_cover_their_variants():
    for cls in (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.AlphaDropout):
        assert isinstance(cls(), compat.DROPOUT_CLASSES), cls
    for cls in (torch.nn.BatchNorm1d, torch.nn.InstanceNorm1d):
        assert isinstance(cls(4), compat.BATCH_NORM_CLASSES), cls
    assert not isinstance(torch.nn.LayerNorm(4), compat.BATCH_NORM_CLASSES)
    # the private bases, not the public fallbacks, on the supported torch
    assert compat.DROPOUT_CLASSES is torch.nn.modules.dropout._DropoutNd
    assert compat.BATCH_NORM_CLASSES is torch.nn.modules.batchnorm._NormBase


def test_clamp_rule_is_what_the_installed_torch_does_at_both_bounds():
    """CLAMP_GRADIENT_AT_BOUND (found at import) against torch.clamp itself,
    at the max and at the min, one- and two-sided: one rule for all four, or
    the kernels' single gradient bound could not follow torch."""
    at_bound = compat.CLAMP_GRADIENT_AT_BOUND
    x = torch.tensor([-2.0, -1.0, 0.0, 1.0, 2.0], dtype=torch.float64, requires_grad=True)
    forms = {"max": lambda t: t.clamp(max=1.0), "min": lambda t: t.clamp(min=-1.0),
             "both": lambda t: t.clamp(min=-1.0, max=1.0)}
    for name, form in forms.items():
        x.grad = None
        form(x).sum().backward()
        at = {"max": [3], "min": [1], "both": [1, 3]}[name]
        assert x.grad[at].tolist() == [float(at_bound)] * len(at), (
            f"torch {torch.__version__}: clamp({name}) at the bound gave {x.grad[at].tolist()}, "
            f"CLAMP_GRADIENT_AT_BOUND says {at_bound}")
        assert x.grad[2] == 1.0
    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    assert at_bound == (version < (2, 14)), "the rule changed in torch 2.14; a later change needs a look"


def test_the_reference_with_the_installed_rule_is_torch_clamp():
    from swiglu_cupy import GLUActivation, glu_reference

    spec = GLUActivation("silu", limit=2.0)
    values = torch.tensor([-3.0, -2.0, -1.0, 2.0, 3.0, float("nan")], dtype=torch.float64)
    grads = []
    for rule in (None, compat.CLAMP_GRADIENT_AT_BOUND):
        gate, up = values.clone().requires_grad_(), values.flip(0).clone().requires_grad_()
        glu_reference(gate, up, spec, clamp_gradient_at_bound=rule).nansum().backward()
        grads.append((gate.grad, up.grad))
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0, equal_nan=True)


def test_setting_to_save_is_save_for_backward():
    """The hot setup_context sets ``ctx.to_save`` itself where SAVE_IS_TO_SAVE
    (the method's whole body): the tensors come back in backward, unpacked
    by torch (a version check included), as the method would save them."""
    assert compat.SAVE_IS_TO_SAVE, "FunctionCtx.save_for_backward does more than set to_save now"

    class Saving(torch.autograd.Function):
        @staticmethod
        def forward(x, w):
            return x * w

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.to_save = inputs

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            return g * w, g * x

    x, w = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    Saving.apply(x, w).sum().backward()
    assert torch.equal(x.grad, w.detach()) and torch.equal(w.grad, x.detach())
    y = Saving.apply(x, w)
    with torch.no_grad():
        w.mul_(2)  # a saved tensor modified in place: torch's version check still runs
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_compiling_in_one_frame_answers_is_compiling():
    """``is_dynamo_compiling() or compiler_state._is_compiling_flag`` is
    ``torch.compiler.is_compiling()``: False eagerly, True under Dynamo
    (folded; the flag, which it would guard on, never read) and in a
    non-strict export's trace (the flag). The stand-in asks is_compiling."""
    assert compat.compiler_state is torch.compiler, "torch.compiler.is_compiling reads more than its flag now"
    seen = []

    def compiling(state):
        return compat.is_dynamo_compiling() or state._is_compiling_flag

    for state in (compat.compiler_state, compat._AskIsCompiling()):
        assert compiling(state) is False is torch.compiler.is_compiling()
        torch._dynamo.reset()  # one lambda, two states: each compiles afresh (the guard on ``state``)
        traced = torch.compile(lambda x, state=state: x + 1 if compiling(state) else x - 1, fullgraph=True,
                               backend="eager")
        with torch._dynamo.config.patch(error_on_recompile=True):  # no guard on the flag fails after the trace
            assert traced(torch.zeros(1)).item() == 1.0
            assert traced(torch.zeros(1)).item() == 1.0

        class Recording(torch.nn.Module):
            def forward(self, x, state=state):
                seen.append((compiling(state), torch.compiler.is_compiling()))
                return x * 2

        seen.clear()
        torch.export.export(Recording(), (torch.randn(2),), strict=False)
        assert seen and all(pair == (True, True) for pair in seen)
