"""_torch_compat: each private torch internal still behaves as the package
assumes. A failure here means torch changed it: read the note beside it."""
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


def test_cpp_function_apply_records_the_same_graph_as_apply():
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
    y = compat.cpp_function_apply(Double, x)
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


def test_registered_global_decompositions_are_in_torch_table():
    """swiglu_cupy.ops registers its functional ops' aten math there at import."""
    import torch._decomp

    import swiglu_cupy.ops  # noqa: F401
    table = torch._decomp.global_decomposition_table["post_autograd"]
    assert torch.ops.swiglu_cupy.swiglu_forward.default in table, "torch._decomp's global table changed"
