"""swiglu_cupy.xformers: our fused ops inside the real xformers 0.0.35 API
(``xformers.ops.SwiGLU``, ``xformers.ops.swiglu``, ``SwiGLUOpDispatch``).

xformers' historical SwiGLU test matrix (forward and backward, bias or not,
packed or not, autocast or not, fp32 and bf16) on small CPU shapes, against a
float64 reference and against xformers' own eager op on the same weights;
then the seed cases (checkpointing both ways, AMP, FSDP2) on patched xformers
modules.
"""
import copy
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils._python_dispatch import TorchDispatchMode

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # xformers warns that its C++ extension is not built (expected)
    xops = pytest.importorskip("xformers.ops",
                               reason="needs xformers: pip install --no-deps -r tests/requirements/peers.txt")

import swiglu_cupy as sc  # noqa: E402
from conftest import assert_nontrivial, rel_rms  # noqa: E402
from swiglu_cupy.xformers import SwiGLUFusedOp, SwiGLUPackedFusedOp, patch_xformers  # noqa: E402

D, H, O = 24, 40, 16
LEAD = (3, 7)
# Relative RMS bounds against float64 on the same rounded inputs (the
# reasoning of test_api.py): fp32 is a few fp32 roundings plus GEMM
# accumulation; bf16 is about one bf16 unit (2^-8) from the x12, h and y
# roundings, and we allow two.
REL_RMS_BOUND = {torch.float32: 1e-6, torch.bfloat16: 8e-3}
# Our fp32 result vs xformers' eager fp32 result: both are within a few fp32
# roundings of the exact value, so of each other.
FP32_VS_EAGER = 1e-6


def xformers_swiglu(packed=True, bias=True, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    module = xops.SwiGLU(D, H, O, bias=bias, _pack_weights=packed).to(dtype)
    if bias:  # nn.Linear's bias init is small; make the bias terms weigh in
        with torch.no_grad():
            for p in module.parameters():
                if p.dim() == 1:
                    p.normal_(0, 0.5)
    return module


def patched(module):
    copy_ = copy.deepcopy(module)
    assert patch_xformers(copy_, strict=True) == 1
    return copy_


def inputs(dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*LEAD, D, generator=g, dtype=torch.float64).to(dtype)
    dy = torch.randn(*LEAD, O, generator=g, dtype=torch.float64).to(dtype)
    return x, dy


def run(module, x, dy, autocast=False):
    """Forward + backward; returns y and the grads of x and every parameter."""
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = module(x)
    y.backward(dy.to(y.dtype))
    return y.detach(), {"x": x.grad, **{n: p.grad for n, p in module.named_parameters()}}


def fp64_reference(module, x, dy, compute_dtype):
    """Eager SwiGLU in float64 from the values the op computes with (the
    parameters and x rounded to ``compute_dtype``, as autocast does)."""
    ref = copy.deepcopy(module)
    ref.op = None  # xformers' eager op
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(p.to(compute_dtype))
    return run(ref.double(), x.to(compute_dtype).double(), dy.to(compute_dtype).double())


# ----------------------------------------------------------------------------
# the op objects and the functional API

def test_import_does_not_import_xformers():
    code = (
        "import sys\n"
        "from torch import nn\n"
        "import swiglu_cupy, swiglu_cupy.hf, swiglu_cupy.xformers as sx\n"
        "assert sx.patch_xformers(nn.Linear(2, 2)) == 0\n"
        "try:\n"
        "    sx.patch_xformers(nn.Linear(2, 2), strict=True)\n"
        "except ValueError as e:\n"
        "    assert 'xformers is not imported' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('strict=True did not raise')\n"
        "loaded = sorted(m for m in sys.modules if m == 'xformers' or m.startswith('xformers.'))\n"
        "assert not loaded, loaded\n"
        "import xformers.ops\n"
        "assert 'xformers.ops.swiglu_op' in sys.modules  # the check above can see an import\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("dtype,autocast", [(torch.float32, False), (torch.bfloat16, False),
                                            (torch.float32, True), (torch.bfloat16, True)],
                         ids=["fp32", "bf16", "fp32-autocast", "bf16-autocast"])
def test_matrix_against_float64_and_eager(packed, bias, dtype, autocast):
    """Forward and every gradient of a patched xformers.ops.SwiGLU: within the
    single-rounding bound of float64, and as close as xformers' eager op."""
    eager = xformers_swiglu(packed, bias, dtype)
    fused = patched(eager)
    assert fused.op is (SwiGLUPackedFusedOp if packed else SwiGLUFusedOp)
    x, dy = inputs(dtype)
    compute_dtype = torch.bfloat16 if autocast else dtype

    y, grads = run(fused, x, dy, autocast)
    y_eager, grads_eager = run(eager, x, dy, autocast)
    y_ref, grads_ref = fp64_reference(eager, x, dy, compute_dtype)

    assert y.dtype == y_eager.dtype == compute_dtype and y.shape == (*LEAD, O)
    bound = REL_RMS_BOUND[compute_dtype]
    assert rel_rms(y, y_ref) < bound
    assert sorted(grads) == sorted(grads_eager) == sorted(grads_ref)
    expected = {"x", "w3.weight"} | ({"w12.weight"} if packed else {"w1.weight", "w2.weight"})
    if bias:
        expected |= {"w3.bias"} | ({"w12.bias"} if packed else {"w1.bias", "w2.bias"})
    assert set(grads) == expected
    for name, g in grads.items():
        assert_nontrivial(g, name)
        assert g.dtype == grads_eager[name].dtype  # each input's own dtype, as eager
        assert rel_rms(g, grads_ref[name]) < bound, (name, rel_rms(g, grads_ref[name]))
    # Equal to xformers' eager op up to rounding: in fp32 a few fp32 units;
    # in bf16 both are about one bf16 unit from exact, in different places
    # (we round h once, eager rounds gate, up, silu and h), so the bf16 bound.
    to_eager = FP32_VS_EAGER if compute_dtype == torch.float32 else bound
    assert rel_rms(y, y_eager) < to_eager
    for name, g in grads.items():
        assert rel_rms(g, grads_eager[name]) < to_eager, name


def test_packed_op_gets_a_view_of_w12(monkeypatch):
    """The packed op hands swiglu() the storage of w12.weight itself."""
    from swiglu_cupy.integrations import xformers_ops as sx

    seen = []

    def recording_swiglu(x, w12, b12, w3, b3):
        seen.append((w12, b12))
        return sc.swiglu(x, w12, b12, w3, b3)

    monkeypatch.setattr(sx, "swiglu", recording_swiglu)
    module = patched(xformers_swiglu())
    x, dy = inputs()
    module(x).backward(dy)
    (w12, b12), = seen
    for t, p in ((w12, module.w12.weight), (b12, module.w12.bias)):
        assert t.shape == p.shape and t.data_ptr() == p.data_ptr() and t.stride() == p.stride()
        assert t._base is p  # a view: autograd routes its grad to the parameter
        assert_nontrivial(p.grad, "w12")


def _packed_params(module):
    """xformers' packed arguments: w1, w2 (and b1, b2) are views of w12."""
    return module._ordered_params()


def test_functional_swiglu_with_our_ops():
    """xformers.ops.swiglu(..., op=ours): packed weights with the packed op,
    any weights with the unpacked op; same values and grads as eager."""
    module = xformers_swiglu()
    x, dy = inputs()
    y_eager, grads_eager = run(module, x, dy)
    for op in (SwiGLUPackedFusedOp, SwiGLUFusedOp):
        module.zero_grad(set_to_none=True)
        xg = x.clone().requires_grad_()
        y = xops.swiglu(xg, *_packed_params(module), op=op)
        y.backward(dy)
        assert rel_rms(y, y_eager) < FP32_VS_EAGER, op
        assert rel_rms(xg.grad, grads_eager["x"]) < FP32_VS_EAGER
        for name, p in module.named_parameters():
            assert rel_rms(p.grad, grads_eager[name]) < FP32_VS_EAGER, (op, name)


def test_packed_op_with_non_adjacent_halves():
    """w1 and w2 in one storage but not adjacent (xformers' stack_or_none
    accepts any stride between them): the packed op runs the halves as
    separate weights, still without a copy, and matches eager."""
    g = torch.Generator().manual_seed(3)
    storage = torch.randn(3, H, D, generator=g)  # w1 = block 0, w2 = block 2
    bstorage = torch.randn(3, H, generator=g)
    w3, b3 = torch.randn(O, H, generator=g) / H ** 0.5, torch.randn(O, generator=g)
    x, _ = inputs()
    args = (storage[0], bstorage[0], storage[2], bstorage[2], w3, b3)
    y = xops.swiglu(x, *args, op=SwiGLUPackedFusedOp)
    y_eager = xops.swiglu(x, *args, op=xops.SwiGLUEagerOp)
    assert rel_rms(y, y_eager) < FP32_VS_EAGER


def test_supports():
    def dispatch(dtype=torch.float32, packed=True, device="cpu"):
        return xops.SwiGLUOpDispatch(device=device, dtype=dtype, dtype_autocast_gpu=None,
                                     packed_weights=packed, bias_enabled=True)

    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        for device in ("cpu", torch.device("cuda", 0)):
            assert SwiGLUPackedFusedOp.supports(dispatch(dtype, device=device))
            assert SwiGLUFusedOp.supports(dispatch(dtype, packed=False, device=device))
            assert SwiGLUFusedOp.supports(dispatch(dtype, packed=True, device=device))
    assert not SwiGLUPackedFusedOp.supports(dispatch(packed=False))  # needs w12
    for dtype in (torch.int32, torch.float8_e4m3fn, torch.complex64):
        assert not SwiGLUPackedFusedOp.supports(dispatch(dtype))
        assert not SwiGLUFusedOp.supports(dispatch(dtype))
    assert not SwiGLUFusedOp.supports(dispatch(device="meta"))
    # the dispatcher's own description of real arguments
    module = xformers_swiglu()
    x, _ = inputs()
    assert SwiGLUPackedFusedOp.supports(xops.SwiGLUOpDispatch.from_arguments(x.view(-1, D), *_packed_params(module)))
    assert SwiGLUPackedFusedOp.PACKED_WEIGHTS and not SwiGLUFusedOp.PACKED_WEIGHTS
    assert str(SwiGLUPackedFusedOp).startswith("SwiGLUOp:") and SwiGLUPackedFusedOp.NAME != SwiGLUFusedOp.NAME


def test_op_argument_errors():
    module = xformers_swiglu()
    x, _ = inputs()
    w3, b3 = module.w3.weight, module.w3.bias
    with pytest.raises(ValueError, match="w1w2"):
        SwiGLUPackedFusedOp(x.view(-1, D), module.w12.weight, None, w3, b3)  # [2H, D], not [2, H, D]
    with pytest.raises(ValueError, match="b1b2"):
        SwiGLUPackedFusedOp(x.view(-1, D), module.w12.weight.view(2, H, D), module.w12.bias, w3, b3)
    with pytest.raises(TypeError, match="w2"):
        SwiGLUFusedOp(x, module.w12.weight[:H], None, module.w12.weight[H:].long(), None, w3, None)


def test_ops_survive_deepcopy_and_pickle():
    import io
    import pickle

    module = patched(xformers_swiglu(packed=False))
    assert copy.deepcopy(module).op is SwiGLUFusedOp
    assert pickle.loads(pickle.dumps(SwiGLUPackedFusedOp)) is SwiGLUPackedFusedOp
    buf = io.BytesIO()
    torch.save(module, buf)
    buf.seek(0)
    assert torch.load(buf, weights_only=False).op is SwiGLUFusedOp


# ----------------------------------------------------------------------------
# patch_xformers

def test_patch_xformers_counts_and_strict():
    model = nn.Sequential(xops.SwiGLU(D, H), nn.Linear(D, D), nn.Sequential(xops.SwiGLU(D, H, _pack_weights=False)),
                          xops.SwiGLU(D, H, bias=False))
    assert patch_xformers(model) == 3
    assert [m.op for m in model.modules() if isinstance(m, xops.SwiGLU)] == [
        SwiGLUPackedFusedOp, SwiGLUFusedOp, SwiGLUPackedFusedOp]
    single = xops.SwiGLU(D, H)
    assert patch_xformers(single, strict=True) == 1 and single.op is SwiGLUPackedFusedOp
    assert patch_xformers(nn.Linear(2, 2)) == 0
    with pytest.raises(ValueError, match="contains no xformers.ops.SwiGLU"):
        patch_xformers(nn.Sequential(nn.Linear(2, 2)), strict=True)
    with pytest.raises(TypeError, match="model"):
        patch_xformers(lambda x: x)


def test_patch_xformers_searches_a_sequential_that_looks_like_three_projections():
    """Issue 34: a Sequential of SwiGLU, Linear, SwiGLU (each states in/out
    features of 16 -> 16, like three projections) was taken for a GLU
    candidate, refused, and patch_xformers stopped there."""
    net = nn.Sequential(xops.SwiGLU(16, 32), nn.Linear(16, 16), xops.SwiGLU(16, 32, _pack_weights=False))
    twin = copy.deepcopy(net)
    assert patch_xformers(net) == 2
    assert [m.op for m in net if isinstance(m, xops.SwiGLU)] == [SwiGLUPackedFusedOp, SwiGLUFusedOp]
    report = sc.patch(twin)
    assert set(report.fused) == {"0", "2"} and not report.skipped  # no row for the Sequential itself


def _llama_mlp_of_xformers_swiglus():
    """A real LlamaMLP whose projections are xformers SwiGLUs: the walk takes
    the LlamaMLP as the GLU feed-forward (its projections run as themselves)."""
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    mlp = llama.LlamaMLP(llama.LlamaConfig(hidden_size=D, intermediate_size=H, num_attention_heads=2,
                                           num_key_value_heads=2))
    mlp.gate_proj, mlp.up_proj, mlp.down_proj = xops.SwiGLU(D, 8, H), xops.SwiGLU(D, 8, H), xops.SwiGLU(H, 8, D)
    return nn.ModuleDict({"norm": nn.LayerNorm(D), "mlp": mlp})


def test_patch_xformers_warns_naming_the_first_swiglu_it_could_not_patch_and_why():
    model = _llama_mlp_of_xformers_swiglus()
    with pytest.warns(UserWarning, match=r"none of the 3 xformers.ops.SwiGLU in ModuleDict could be patched: "
                                         r"the first, mlp.gate_proj, lies inside mlp \(LlamaMLP: a GLU "
                                         r"feed-forward under Hugging Face's names"):
        assert patch_xformers(model) == 0
    assert all(m.op is None for m in model.modules() if isinstance(m, xops.SwiGLU))
    with pytest.raises(ValueError, match="strict=True.*the first, mlp.gate_proj, lies inside mlp"):
        patch_xformers(model, strict=True)
    report = sc.patch(copy.deepcopy(model))  # what the warning points to: patch() takes the LlamaMLP
    assert set(report.partial) == {"mlp"} and "SwiGLU is not an nn.Linear" in report.partial["mlp"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about: none there, or some patched
        assert patch_xformers(nn.Sequential(nn.Linear(D, D))) == 0
        model["extra"] = xops.SwiGLU(D, H)
        assert patch_xformers(model) == 1


class _OpSpy(TorchDispatchMode):
    """Records every aten op: name, the storages its tensor arguments live in,
    and the (shape, storage) of each tensor it returns."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat_args = [a for arg in args for a in (arg if isinstance(arg, (tuple, list)) else (arg,))]
        storages = {a.untyped_storage().data_ptr() for a in flat_args if isinstance(a, torch.Tensor)}
        outs = out if isinstance(out, (tuple, list)) else (out,)
        results = [(tuple(o.shape), o.untyped_storage().data_ptr()) for o in outs if isinstance(o, torch.Tensor)]
        self.calls.append((func.overloadpacket.__name__, storages, results))
        return out


COPYING_OPS = {"cat", "stack", "_to_copy", "copy_", "clone", "contiguous"}


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
def test_no_weight_copy_per_call(packed):
    """Neither op concatenates, stacks or copies a weight: no copying aten op
    reads a parameter's storage (forward and backward), and forward creates
    no [2H, D] tensor outside the weights' own storage (backward creates one:
    dw12, the gradient itself). The
    spy sees the concatenation a naive unpacked op would do (positive control)."""
    module = patched(xformers_swiglu(packed=packed))
    weights = {p.untyped_storage().data_ptr() for p in module.parameters()}
    x, dy = inputs()
    with _OpSpy() as forward_spy:
        y = module(x)
    with _OpSpy() as backward_spy:
        y.backward(dy)
    calls = forward_spy.calls + backward_spy.calls
    assert forward_spy.calls and backward_spy.calls
    assert any(storages & weights for _, storages, _ in forward_spy.calls)  # the GEMMs read them
    assert not [c for c in calls if c[0] in COPYING_OPS and c[1] & weights], calls
    new_gate_up = [c for c in forward_spy.calls
                   for shape, storage in c[2] if shape == (2 * H, D) and storage not in weights]
    assert not new_gate_up, forward_spy.calls
    with _OpSpy() as control:
        torch.cat([module.w3.weight, module.w3.weight])
    assert any(name == "cat" and storages & weights for name, storages, _ in control.calls)


# ----------------------------------------------------------------------------
# state_dict

@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_xformers_state_dict_loads_into_swiglu(bias):
    xf = xformers_swiglu(bias=bias)
    ours = sc.SwiGLU(D, H, O, bias=bias)
    ours.load_state_dict(xf.state_dict())  # strict: same keys and shapes
    x, _ = inputs()
    with torch.no_grad():
        assert rel_rms(ours(x), xf(x)) < FP32_VS_EAGER
    back = xformers_swiglu(bias=bias, seed=5)
    back.load_state_dict(ours.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), xf.state_dict().values()))


# ----------------------------------------------------------------------------
# the seed cases: checkpointing, AMP, FSDP2 on patched xformers modules

class XformersStack(nn.Module):
    """Residual xformers SwiGLU blocks; the first block's input is the data."""

    def __init__(self, blocks, ckpt=None):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.ckpt = ckpt

    def forward(self, x):
        for block in self.blocks:
            y = block(x) if self.ckpt is None else checkpoint(block, x, use_reentrant=self.ckpt == "reentrant")
            x = x + y.float()
        return x


def _stack(ckpt, op_patch=True, packed=True):
    blocks = [xops.SwiGLU(D, H, D, _pack_weights=packed) for _ in range(3)]
    torch.manual_seed(0)
    for b in blocks:
        for p in b.parameters():
            nn.init.normal_(p, 0, 0.3)
    model = XformersStack(blocks, ckpt)
    if op_patch:
        assert patch_xformers(model, strict=True) == 3
    return model


def _stack_step(model, x, autocast=False):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(x).pow(2).mean()
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    if x.requires_grad:
        grads["x"] = x.grad
    return loss.detach(), grads


@pytest.mark.parametrize("ckpt", ["non_reentrant", "reentrant"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
def test_checkpoint(ckpt, packed):
    """Checkpointed patched stack == the same stack without checkpoint, and
    == xformers' eager op. Non-reentrant: the data does not require grad (the
    case that broke xformers' fused op). Reentrant builds a graph only
    through inputs that require grad (torch's rule), so there it does."""
    x, _ = inputs()
    if ckpt == "reentrant":
        x.requires_grad_()
    loss, grads = _stack_step(_stack(ckpt, packed=packed), x)
    x.grad = None
    loss_plain, grads_plain = _stack_step(_stack(None, packed=packed), x)
    x.grad = None
    loss_eager, grads_eager = _stack_step(_stack(None, op_patch=False, packed=packed), x)
    torch.testing.assert_close(loss, loss_plain, rtol=0, atol=0)  # same ops, recomputed
    assert rel_rms(loss, loss_eager) < FP32_VS_EAGER
    for name, g in grads_plain.items():
        assert_nontrivial(grads[name], name)
        torch.testing.assert_close(grads[name], g, rtol=0, atol=0)
        assert rel_rms(g, grads_eager[name]) < 1e-5, name  # 3 residual blocks deep


def test_amp_and_checkpoint():
    """CPU autocast (bf16) with non-reentrant checkpoint: equal to autocast
    without checkpoint, fp32 grads, and the training signal of fp32."""
    x, _ = inputs()
    loss, grads = _stack_step(_stack("non_reentrant"), x, autocast=True)
    loss_plain, grads_plain = _stack_step(_stack(None), x, autocast=True)
    _, grads_fp32 = _stack_step(_stack(None), x)
    torch.testing.assert_close(loss, loss_plain, rtol=0, atol=0)
    for name, g in grads_plain.items():
        assert grads[name].dtype == torch.float32
        assert_nontrivial(grads[name], name)
        torch.testing.assert_close(grads[name], g, rtol=0, atol=0)
        # bf16 through 3 blocks vs fp32: a few bf16 units (2^-8) relative
        assert rel_rms(g, grads_fp32[name]) < 5e-2, name


def xformers_fsdp_stack(ckpt=None):
    """test_distributed's Stack (same seeded weights) with its blocks replaced
    by patched xformers.ops.SwiGLU modules loaded from their state dicts."""
    from test_distributed import D as DD, H as DH, build_model

    model = build_model(ckpt)
    blocks = []
    for block in model.blocks:
        xf = xops.SwiGLU(DD, DH, DD)
        xf.load_state_dict(block.state_dict())
        blocks.append(xf)
    model.blocks = nn.ModuleList(blocks)
    assert patch_xformers(model, strict=True) == len(blocks)
    return model


def fsdp2_rank(rank, world):
    """Rank body: test_distributed's FSDP2 case (fully_shard per block + root,
    non-reentrant checkpoint, data without grad) on the xformers stack."""
    from test_distributed import _case_fsdp2

    return _case_fsdp2(rank, world, build=xformers_fsdp_stack)


def test_fsdp2_two_gloo_ranks_against_one_process(tmp_path, monkeypatch):
    from test_distributed import assert_matches, launch, reference_run

    ref = reference_run(build=xformers_fsdp_stack)
    for result in launch(f"{__name__}:fsdp2_rank", tmp_path, monkeypatch):
        assert_matches(result, ref)


# ----------------------------------------------------------------------------
# CUDA

@pytest.mark.gpu
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_ops_match_float64(packed, dtype):
    eager = xformers_swiglu(packed=packed, dtype=dtype).cuda()
    fused = patched(eager)
    x, dy = (t.cuda() for t in inputs(dtype))
    y, grads = run(fused, x, dy)
    y_ref, grads_ref = fp64_reference(eager, x, dy, dtype)
    assert y.is_cuda and y.dtype == dtype
    bound = {torch.float16: 2e-3, torch.bfloat16: 8e-3}[dtype]  # ~2 units of 2^-11 / 2^-8
    assert rel_rms(y, y_ref) < bound
    for name, g in grads.items():
        assert_nontrivial(g, name)
        assert rel_rms(g, grads_ref[name]) < bound, name


@pytest.mark.gpu
def test_cuda_autocast_and_checkpoint():
    x, _ = (t.cuda() for t in inputs())
    model, plain = _stack("non_reentrant").cuda(), _stack(None).cuda()
    model.zero_grad(set_to_none=True)
    losses, grads = [], []
    for m in (model, plain):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = m(x).pow(2).mean()
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in m.named_parameters()})
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)
    for name, g in grads[1].items():
        assert_nontrivial(grads[0][name], name)
        torch.testing.assert_close(grads[0][name], g, rtol=0, atol=0)
