import pytest
import torch

from swiglu_cupy.kernels.launch_config import using_launcher

from swiglu_cupy.kernels.host_exec import HostLauncher

DTYPES_ALL = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "training: trains a model for hundreds of steps "
                                       "(the floor run of .ci/run leaves it out)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def host_launcher():
    """Runs the kernels_cu sources on the CPU (built once per session)."""
    launcher = HostLauncher()
    launcher.warm(DTYPES_ALL)
    return launcher


def primitives_on_host_kernels(launcher):
    """Route every primitive call (CPU tensors included) through the kernel
    path with ``launcher``: the whole Function then runs the .cu kernels."""
    return using_launcher(launcher)


def rel_rms(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected||_rms / ||expected||_rms, in float64."""
    a, e = actual.double(), expected.double()
    return ((a - e).pow(2).mean().sqrt() / e.pow(2).mean().sqrt().clamp_min(1e-300)).item()


def zero_filled_shapes(fn) -> list:
    """The shapes of the tensors zero-filled (``aten::zero_``/``fill_``) while ``fn()`` runs."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    return [tuple(e.input_shapes[0]) for e in prof.events()
            if e.name in ("aten::zero_", "aten::fill_") and e.input_shapes and e.input_shapes[0]]


def assert_nontrivial(grad: torch.Tensor, name: str) -> None:
    assert grad is not None, f"{name}: gradient is None"
    assert torch.isfinite(grad).all(), f"{name}: non-finite gradient"
    assert grad.double().abs().max().item() > 0, f"{name}: gradient is all zeros"


def routed_saved_bytes(T, K, E, D, I, x_bytes, rw_bytes, recompute_gate_up=False) -> int:
    """Bytes the routed MoE path saves for backward (issue 26): each token's
    input once (T*D), x12 per routed row (S*2I; none with
    recompute_gate_up), the expert order ``perm`` (int32) and the routing
    weights per routed row, and the offsets (E int32)."""
    S = T * K
    return T * D * x_bytes + (0 if recompute_gate_up else S * 2 * I * x_bytes) + S * (4 + rw_bytes) + E * 4


def routed_saved_bytes_a6d6350(T, K, E, D, I, x_bytes, rw_bytes, recompute_gate_up=False) -> int:
    """What the routed path saved before issue 26 (commit a6d6350; these
    reproduce its measured figures, docs/moe.md): x_sorted per routed row (K
    copies of each token's input), x12, three int64 index vectors (perm,
    inverse, token), the gathered routing weights, the offsets."""
    S = T * K
    return S * (D + (0 if recompute_gate_up else 2 * I)) * x_bytes + S * (3 * 8 + rw_bytes) + E * 4


def routed_saved_ratio_goal(K, D, I) -> float:
    """Issue 26's bound on saved bytes, new / before: (D + K*2I) / (K*(D + 2I))."""
    return (D + K * 2 * I) / (K * (D + 2 * I))


def swiglu_fp64_reference(x, w12, b12, w3, b3):
    """Independent eager reference, computed in float64 from the given values."""
    import torch.nn.functional as F

    d = lambda t: None if t is None else t.detach().double()  # noqa: E731
    H = w12.shape[0] // 2
    x12 = F.linear(d(x), d(w12), d(b12))
    h = F.silu(x12[..., :H]) * x12[..., H:]
    return F.linear(h, d(w3), d(b3))


# Half an ulp at 1.0 for each storage dtype (one rounding, relative).
UNIT_ROUNDOFF = {torch.float16: 2**-11, torch.bfloat16: 2**-8, torch.float32: 2**-24, torch.float64: 2**-53}


def elementwise_error_bounds(x12: torch.Tensor, dh: torch.Tensor, exact_h, exact_dx12):
    """Per-element error bounds for h and dx12 of a single-rounding
    implementation: one storage ulp of the exact value, plus a few ulps of the
    math dtype (fp32, or fp64 for float64) times the size of the terms, since
    dgate = dh*u*s*(1 + g*(1-s)) cancels near g = -1.28."""
    dtype = x12.dtype
    ulp = 2 * UNIT_ROUNDOFF[dtype]
    math_eps = 8 * UNIT_ROUNDOFF[torch.float64 if dtype == torch.float64 else torch.float32]
    g, u = x12.double().chunk(2, dim=1)
    d = dh.double()
    tiny = torch.finfo(dtype).tiny
    h_terms = (g * u).abs()
    dx12_terms = torch.cat([(d * u).abs() * (1 + g.abs()), (d * g).abs()], dim=1)
    h_bound = exact_h.double().abs() * ulp + h_terms * math_eps + tiny
    dx12_bound = exact_dx12.double().abs() * ulp + dx12_terms * math_eps + tiny
    return h_bound, dx12_bound


def spec_of_variant(variant):
    """A spec that runs ``variant``: the limit cuts a good share of x12 ~ N(0, 2^2)."""
    from swiglu_cupy.activations import GLUActivation

    oai = dict(alpha=1.702, up_offset=1.0) if variant.kind == "oai" else {}
    return GLUActivation(variant.kind, limit=1.5 if variant.clamp else None, interleaved=variant.interleaved, **oai)


def glu_error_bounds(x12, dh, spec, ref_h, ref_dx12):
    """Per-element bounds between two single-rounding implementations of a
    variant (``reference.single_rounding_bounds``: one storage ulp of the
    value plus a few math-dtype ulps of the size of its terms), sized from the
    raw (unclamped) gate and up."""
    from swiglu_cupy.reference import single_rounding_bounds

    return single_rounding_bounds(x12, dh, spec, ref_h, ref_dx12, clamp=False)


def assert_compiled_matches_eager(model, x, tol):
    """torch.compile(fullgraph=True) traces with no graph break and matches
    eager, forward and every gradient. Returns the eager output."""
    explanation = torch._dynamo.explain(model)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    compiled = torch.compile(model, fullgraph=True)
    y = compiled(x)
    y.pow(2).sum().backward()
    grads = [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    x.grad = None
    model.zero_grad(set_to_none=True)
    y_eager = model(x)
    y_eager.pow(2).sum().backward()
    torch.testing.assert_close(y, y_eager, rtol=tol, atol=tol)  # same ops, maybe fused differently
    for g, p in zip(grads, [x] + list(model.parameters())):
        assert_nontrivial(g, "compiled grad")
        torch.testing.assert_close(g, p.grad, rtol=tol, atol=tol)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), y_eager, rtol=tol, atol=tol)
    return y_eager


def onnx_run_with_standard_ops(model, x, tmp_path):
    """``torch.onnx.export(model, (x,), dynamo=True)``, saved and run by ONNX
    Runtime; asserts the graph uses standard ONNX domains only (no custom op
    of ours). Returns ORT's output as a torch tensor."""
    ort = pytest.importorskip("onnxruntime")
    program = torch.onnx.export(model, (x,), dynamo=True)
    path = tmp_path / "model.onnx"
    program.save(str(path))
    domains = {node.domain for node in program.model_proto.graph.node}
    for function in program.model_proto.functions:
        domains |= {node.domain for node in function.node}
    assert domains <= {"", "ai.onnx"}, domains
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    return torch.from_numpy(out)


@pytest.fixture(params=[True, False], ids=["grad_at_bound", "no_grad_at_bound"])
def clamp_rule(request, monkeypatch):
    """Each torch's clamp rule in turn, whatever torch is installed: True
    (up to 2.13) passes the gradient at exactly the limit, False (2.14 on)
    gives it 0. Compare against ``glu_reference(...,
    clamp_gradient_at_bound=clamp_rule)``."""
    from swiglu_cupy import _torch_compat

    monkeypatch.setattr(_torch_compat, "CLAMP_GRADIENT_AT_BOUND", request.param)
    return request.param
