"""``swiglu_cupy.patch`` on timm's own models and MLP classes (timm 1.0.31;
first run under torch 2.14.1, where torchvision, which timm imports, installs
beside the CPU torch).

Every timm model family with a GLU feed-forward is built small with
``timm.create_model(name, pretrained=False, ...)`` (its real entrypoint and
classes, shrunk by the entrypoint's keyword arguments), its parameters drawn
again at an O(1) scale (timm's inits put near-zero gates and 1e-5 layer
scales in some, which would hide a wrong MLP from the logits), and a patched
deepcopy is checked against the unpatched model in fp32: the report (which
modules, fused whole, activation only or skipped, and the count: every GLU
MLP of the model), the logits, the input gradient and every parameter
gradient, the number of calls of the fused op, state_dict keys; then again
under ``model.set_grad_checkpointing(True)`` (the recompute runs the fused
op again). Models without a GLU MLP (plain ViT's ``Mlp``, gMLP's
``GatedMlp`` with its spatial gating) come out untouched.

Coverage is checked, not assumed: the sources of ``timm.layers`` and
``timm.models`` are scanned for classes whose forward multiplies an
activation call (a GLU) and for users of ``GluMlp``/``SwiGLU``/
``SwiGLUPacked``; each such class is a covered GLU MLP or named with why it
is not one, and every entrypoint of the modules that build them is built on
the meta device (one block where the entrypoint takes ``depth``): each kind of
GLU MLP it holds (class, gate order, children, biases) must be one a family
here runs. A family timm adds fails the test until it is covered. (Built
once on meta, all 1371 entrypoints of timm 1.0.31 hold GLU MLPs only in
the modules swept here.)

Found so far (timm 1.0.31): ``GluMlp`` (EVA02 tiny/small, Sapiens2, DINOv2
giant and TIPSv2 giant as ``SwiGLUPacked``, DeepSeek's ViT without biases,
gMixer with the gate last), ``SwiGLU`` (AIMv2, DINOv3 and LingBot, EVA02
base/large with its ``scale_mlp`` norm: activation only; BEiT's
``swiglu_mlp`` option), Gemma 4's ``Gemma4GatedMlp`` (its projections are
``Gemma4ClippableLinear`` wrappers: activation only) and ViTamin's
``GeGluMlp``, which applies a LayerNorm to the input inside the MLP, before
the projections: no plan of the walk has a place for that, so the probe
refuses it and the report says so (skipped, the model untouched).

Tolerance (fp32): each tensor within ``RTOL`` of its largest entry, as in
test_training_libraries.py (the fused op rounds ``act(gate) * up`` once where
eager rounds twice); a wrong activation, order or lost gradient is orders of
magnitude above it.
"""
from __future__ import annotations

import ast
import copy
import dataclasses
import functools
import importlib
import math
import re
from pathlib import Path

import pytest
import torch
from torch import nn

try:
    import timm
except Exception as exc:  # absent, or a torchvision built for another torch ("torchvision::nms does not exist")
    pytest.skip(f"timm cannot be imported here ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                "it needs torchvision built for the installed torch", allow_module_level=True)

import timm.layers.weight_init  # noqa: E402
from timm.layers import GatedMlp, GluMlp, Mlp, SwiGLU, SwiGLUPacked  # noqa: E402
from timm.models import _registry as timm_registry  # noqa: E402

import swiglu_cupy as sc  # noqa: E402
from swiglu_cupy.integrations import plan_runner as fused_forward  # noqa: E402
from swiglu_cupy.integrations.fused import FusedGLUMLP  # noqa: E402

RTOL = 1e-5
BATCH = 2
FUSED_OPS = ("swiglu", "swiglu_unpacked", "glu_mul")  # what integrations.plan_runner calls

# ---- the GLU MLP classes of timm ---------------------------------------------------------

#: The GLU feed-forward classes of timm 1.0.31 (module, class): every module
#: of these in a model is a GLU MLP the report must account for.
GLU_MLP_CLASSES = {
    ("timm.layers.mlp", "GluMlp"), ("timm.layers.mlp", "SwiGLU"),
    ("timm.models.vitamin", "GeGluMlp"), ("timm.models.gemma4_vit", "Gemma4GatedMlp"),
}

#: Classes whose forward multiplies an activation call but which are no GLU
#: feed-forward (found by the same scan), and why.
NOT_GLU_MLPS = {
    ("timm.layers.cbam", "LightChannelAttn"): "channel attention: x * sigmoid(pooled gate), no projections",
    ("timm.models.swin_transformer_v2", "WindowAttention"): "attention: a sigmoid-scaled position bias",
    ("timm.models.efficientvim", "HSMSSD"): "a state-space mixer: out_proj(h * act(z) + h * D)",
    ("timm.models.mambaout", "GatedConvBlock"): ("a gated conv block: part of the up path is a depthwise conv "
                                                 "over the image, not a projection"),
    ("timm.models.nfnet", "NormFreeBlock"): "a residual block: act(x) * beta, a scalar",
    ("timm.models.starnet", "Block"): ("StarNet's star block: 1x1 convs in NCHW between depthwise convs, "
                                       "no linear projections"),
}

#: timm's GLU layer classes, whose users (model files) are swept.
GLU_LAYER_NAMES = {"GluMlp", "SwiGLU", "SwiGLUPacked"}


def glu_mlp_classes() -> tuple[type, ...]:
    return tuple(getattr(importlib.import_module(m), c) for m, c in sorted(GLU_MLP_CLASSES))


def glu_paths(model: nn.Module) -> list[str]:
    classes = glu_mlp_classes()
    return [p for p, m in model.named_modules() if isinstance(m, classes)]


def kind(module: nn.Module) -> tuple:
    """What the walk decides on: the class, the gate order, and each child
    (projections with their bias, norms by class, the rest as they print:
    the activation, dropout, identity)."""
    def child(m):
        if isinstance(m, nn.Linear):
            return f"Linear(bias={m.bias is not None})"
        if any(True for _ in m.parameters()):
            return type(m).__name__
        return repr(m)
    base = getattr(module, "_swiglu_base", type(module))
    return (f"{base.__module__}.{base.__qualname__}", getattr(module, "gate_last", None),
            tuple((n, child(c)) for n, c in module.named_children()))


# ---- the families ------------------------------------------------------------------------

SMALL = dict(embed_dim=48, depth=2, num_heads=2)
FUSED_PACKED = "silu: fc1 (gate first) -> fc2"
FUSED_SPLIT = "silu: fc1_g/fc1_x -> fc2"


@dataclasses.dataclass(frozen=True)
class Family:
    """One timm model family, built small: ``status`` is what the report
    must say of each of its ``count`` GLU MLPs (``"fused"``: whole MLP,
    ``"partial"``: activation only, ``"skipped"``, or ``"none"``: no GLU MLP
    at all), ``detail`` the report's line for each, ``op`` the fused op each
    runs once per forward."""
    model: str
    kwargs: dict
    img: int
    status: str
    count: int
    detail: str = ""
    op: str | None = None
    note: str = ""


FAMILIES = {
    "eva02_packed": Family("eva02_tiny_patch14_224", dict(img_size=28, **SMALL), 28, "fused", 2, FUSED_PACKED,
                           "swiglu", "EVA02 tiny/small, Sapiens2: GluMlp (SwiGLUPacked), gate first"),
    "eva02_scale_mlp": Family("eva02_base_patch14_224", dict(img_size=28, **SMALL), 28, "partial", 2,
                              "silu; norm (LayerNorm) between the product and fc2 runs as itself", "glu_mul",
                              "EVA02 base/large: SwiGLU with its scale_mlp LayerNorm between product and fc2"),
    "dinov3": Family("vit_small_plus_patch16_dinov3", dict(img_size=32, **SMALL), 32, "fused", 2, FUSED_SPLIT,
                     "swiglu_unpacked", "DINOv3, LingBot (eva.py): SwiGLU, hidden width aligned to 8"),
    "dinov2_giant": Family("vit_giant_patch14_reg4_dinov2", dict(img_size=28, **SMALL), 28, "fused", 2,
                           FUSED_PACKED, "swiglu", "DINOv2 / TIPSv2 giant: mlp_layer=SwiGLUPacked"),
    "aimv2": Family("aimv2_large_patch14_224", dict(img_size=28, **SMALL), 28, "fused", 2, FUSED_SPLIT,
                    "swiglu_unpacked", "AIMv2: mlp_layer=SwiGLU, no biases"),
    "gmixer": Family("gmixer_12_224", dict(img_size=32), 32, "fused", 24, "silu: fc1 (gate last) -> fc2",
                     "swiglu_unpacked", "gMixer: GluMlp with SiLU, gate last, token and channel MLPs "
                                        "(12 blocks: the entrypoint takes no depth)"),
    "deepseek_vit": Family("deepseek_vit_412m", dict(img_size=28, **SMALL), 28, "fused", 2, FUSED_PACKED,
                           "swiglu", "DeepSeek ViT: GluMlp gate first, no biases"),
    "gemma4_vit": Family("gemma4_vit_167m", dict(img_size=32, head_dim=24, intermediate_size=96, **SMALL), 32,
                         "partial", 2, "gelu_tanh; gate_proj/up_proj/down_proj run as themselves: "
                                       "Gemma4ClippableLinear is not an nn.Linear (LoRA, quantized?)", "glu_mul",
                         "Gemma 4: Gemma4GatedMlp on clamping wrappers of nn.Linear"),
    "vitamin": Family("vitamin_small_224", dict(img_size=32, embed_cfg="small", **SMALL), 32, "skipped", 2,
                      "probe mismatch: no role assignment and known activation reproduces its forward", None,
                      "ViTamin: GeGluMlp normalises its input inside the MLP, before the projections"),
    "beit_swiglu": Family("beit_base_patch16_224", dict(img_size=32, swiglu_mlp=True, **SMALL), 32, "fused", 2,
                          FUSED_SPLIT, "swiglu_unpacked", "BEiT's swiglu_mlp option (no entrypoint sets it)"),
    "vit_mlp": Family("vit_tiny_patch16_224", dict(img_size=32, **SMALL), 32, "none", 0,
                      note="plain ViT: Mlp, no GLU"),
    "gmlp": Family("gmlp_ti16_224", dict(img_size=32), 32, "none", 0,
                   note="gMLP: GatedMlp with a spatial gating unit, no GLU (30 blocks: no depth argument)"),
}


def build(family: Family) -> nn.Module:
    kwargs = dict(family.kwargs)
    if kwargs.get("embed_cfg") == "small":  # ViTamin's conv stem, shrunk to one block per stage
        from timm.models.vitamin import VitCfg, VitConvCfg

        kwargs["embed_cfg"] = VitCfg(embed_dim=(16, 32, kwargs["embed_dim"]), depths=(1, 1, 1), stem_width=16,
                                     conv_cfg=VitConvCfg(norm_layer="layernorm2d", norm_eps=1e-6), head_type="1d")
    return timm.create_model(family.model, pretrained=False, num_classes=10, **kwargs)


def redraw_parameters(model: nn.Module, seed: int = 0) -> None:
    """Every parameter drawn again at an O(1) scale (weights 1/sqrt(fan_in)),
    so that every MLP moves the logits and every gradient."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            std = 1 / math.sqrt(p[0].numel()) if p.dim() >= 2 else 0.5
            p.copy_(torch.randn(p.shape, generator=gen) * std)


def count_fused_calls(monkeypatch) -> dict[str, int]:
    """Calls of each fused op that a patched module's forward runs, from now on."""
    calls = dict.fromkeys(FUSED_OPS, 0)
    # The usual separate projections run swiglu_unpacked's body in plan_runner: the API's run_feed_forward.
    for name, key in [*((op, op) for op in FUSED_OPS), ("run_feed_forward", "swiglu_unpacked")]:
        real = getattr(fused_forward, name)

        def counting(*args, _name=key, _real=real, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(fused_forward, name, counting)
    return calls


def assert_close_to_scale(actual: torch.Tensor, expected: torch.Tensor, what: str, floor: float = 0.0) -> None:
    """Within ``RTOL`` of the tensor's largest entry, or of ``floor`` where
    that is larger (a gradient that is zero but for rounding)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype == torch.float32, what
    assert torch.isfinite(actual).all(), f"{what}: not finite"
    scale = max(expected.abs().max().item(), floor)
    error = (actual - expected).abs().max().item()
    assert error <= RTOL * scale, f"{what}: max error {error:.3g}, {error / max(scale, 1e-30):.3g} of its scale"


def assert_parity(patched: nn.Module, reference: nn.Module, x: torch.Tensor, mlp_paths: list[str]) -> None:
    """Same logits, input gradient and gradient of every parameter (names and
    presence included); the GLU MLPs' weight gradients are non-trivial.

    A gradient that is analytically zero is rounding noise (gMixer's token-MLP
    ``fc2.bias``: a constant over the channels of a token, which the next
    LayerNorm takes away): each gradient is compared at no less than 1% of
    the model's largest gradient (so within 1e-7 of it)."""
    grads = {}
    for which, model in (("patched", patched), ("reference", reference)):
        model.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        out = model(xi)
        out.square().mean().backward()
        grads[which] = (out.detach(), xi.grad, {n: p.grad for n, p in model.named_parameters()})
    (out, x_grad, ours), (ref_out, ref_x_grad, theirs) = grads["patched"], grads["reference"]
    assert_close_to_scale(out, ref_out, "logits")
    assert ref_out.abs().max() > 0
    assert_close_to_scale(x_grad, ref_x_grad, "input gradient")
    assert list(ours) == list(theirs)  # patching keeps every parameter, under its name
    largest = max(g.abs().max().item() for g in theirs.values() if g is not None)
    for name, ref_grad in theirs.items():
        grad = ours[name]
        assert (grad is None) == (ref_grad is None), name
        if ref_grad is not None:
            assert_close_to_scale(grad, ref_grad, name, floor=1e-2 * largest)
    for path in mlp_paths:
        for name, p in reference.get_submodule(path).named_parameters():
            if p.dim() >= 2:
                assert p.grad is not None and p.grad.abs().max() > 1e-4 * largest, f"{path}.{name}: trivial gradient"


def assert_report(report, model: nn.Module, family: Family) -> list[str]:
    """The report names exactly the model's GLU MLPs, each with the family's
    status and line; the modules are switched (or not) accordingly."""
    paths = glu_paths(model)
    assert len(paths) == family.count, (paths, str(report))
    tables = {"fused": report.fused, "partial": report.partial, "skipped": report.skipped}
    expected = {status: ({p: family.detail for p in paths} if status == family.status else {})
                for status in tables}
    assert {s: dict(t) for s, t in tables.items()} == expected, str(report)
    assert report.pending == {} and report.experts == 0 and report.unreached == {}, str(report)
    switched = [p for p, m in model.named_modules() if isinstance(m, FusedGLUMLP)]
    assert switched == (paths if family.status in ("fused", "partial") else []), str(report)
    for path in switched:
        module = model.get_submodule(path)
        assert module.fusion() == ("mlp" if family.status == "fused" else "activation"), path
    return paths


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: the models are tiny, and on a shared CPU more
    threads made them 20x slower, not faster."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def family_models():
    """Each family's small model, its parameters drawn again, in fp32 (built once)."""
    models = {}
    for i, (name, family) in enumerate(FAMILIES.items()):
        torch.manual_seed(i)
        model = build(family).float()
        redraw_parameters(model, seed=i)
        models[name] = model
    return models


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_patch_report_and_parity(name, family_models, monkeypatch):
    family = FAMILIES[name]
    reference = copy.deepcopy(family_models[name]).train()
    patched = copy.deepcopy(reference)
    keys = list(patched.state_dict())
    report = sc.patch(patched)
    paths = assert_report(report, patched, family)
    assert list(patched.state_dict()) == keys
    x = torch.randn(BATCH, 3, family.img, family.img, generator=torch.Generator().manual_seed(7))
    calls = count_fused_calls(monkeypatch)

    def expect_calls(per_mlp: int) -> None:
        want = dict.fromkeys(FUSED_OPS, 0)
        if family.op is not None:
            want[family.op] = per_mlp * family.count
        assert calls == want, (calls, want)
        calls.update(dict.fromkeys(FUSED_OPS, 0))

    assert_parity(patched, reference, x, paths)
    expect_calls(1)
    for model in (patched, reference):
        model.set_grad_checkpointing(True)
    assert_parity(patched, reference, x, paths)
    expect_calls(2)  # the forward and the recompute in backward: the checkpoint really ran, fused both times


# ---- coverage: every GLU MLP class and entrypoint of timm --------------------------------

_ACT_CALL = re.compile(r"act|silu|gelu|sigmoid|swish|relu", re.IGNORECASE)
# A line where an activation-like call is a factor: ``act(...) *`` or ``* act(``
# (one level of parentheses inside the call).
_FACTOR = re.compile(r"(act|silu|gelu|sigmoid|swish|relu)\w*\((?:[^()]|\([^()]*\))*\)\s*\*(?!\*)"
                     r"|(?<!\*)\*\s*[\w.]*(act|silu|gelu|sigmoid|swish|relu)\w*\(", re.IGNORECASE)
_GLU_LAYER_NAME = re.compile(r"\b(" + "|".join(sorted(GLU_LAYER_NAMES)) + r")\b")


def _callee(node) -> str:
    if not isinstance(node, ast.Call):
        return ""
    return node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")


def _glu_like_classes(tree: ast.Module) -> set[str]:
    """Classes whose ``forward`` multiplies the result of a call named like an
    activation (``self.act(x1) * x2``, ``F.silu(g) * u``)."""
    found = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        forward = next((f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "forward"), None)
        if forward is not None and any(
                isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mult)
                and any(_ACT_CALL.search(_callee(side)) for side in (n.left, n.right))
                for n in ast.walk(forward)):
            found.add(cls.name)
    return found


@functools.lru_cache(maxsize=None)
def scan_timm_sources():
    """``(glu_like, users)``: the classes of timm.layers and timm.models
    whose forward multiplies an activation call, as ``(module, class)``, and
    the modules of timm.models that name timm's GLU layer classes. Only the
    files with a line where an activation-like call is a factor are parsed
    (parsing all of timm takes seconds)."""
    root = Path(timm.__file__).parent
    glu_like, users = set(), set()
    for package in ("layers", "models"):
        for path in sorted((root / package).glob("*.py")):
            module, text = f"timm.{package}.{path.stem}", path.read_text()
            if package == "models" and _GLU_LAYER_NAME.search(text):
                users.add(module)
            if any("*" in line and _FACTOR.search(line) for line in text.splitlines()):
                glu_like |= {(module, name) for name in _glu_like_classes(ast.parse(text))}
    return frozenset(glu_like), frozenset(users)


def test_every_glu_class_of_timm_is_covered_or_explained(family_kinds):
    glu_like, _ = scan_timm_sources()
    unknown = glu_like - GLU_MLP_CLASSES - set(NOT_GLU_MLPS)
    assert not unknown, f"timm classes with a GLU-like forward that no family here covers: {sorted(unknown)}"
    stale = (GLU_MLP_CLASSES | set(NOT_GLU_MLPS)) - glu_like
    assert not stale, f"named here but not found in timm's sources: {sorted(stale)}"
    covered = {kind_class for kinds in family_kinds.values() for kind_class, *_ in kinds}
    missing = {f"{m}.{c}" for m, c in GLU_MLP_CLASSES} - covered
    assert not missing, f"GLU MLP classes no family builds: {sorted(missing)}"


@pytest.fixture(scope="module")
def family_kinds(family_models) -> dict[str, frozenset]:
    """The kinds of GLU MLP each family's small model holds."""
    return {name: frozenset(kind(model.get_submodule(p)) for p in glu_paths(model))
            for name, model in family_models.items()}


def test_every_entrypoint_with_a_glu_mlp_is_a_covered_kind(family_kinds, monkeypatch):
    """Every entrypoint of the model modules that build timm's GLU MLPs,
    built on meta (one block where it takes ``depth``; timm's truncated-normal
    init, slow on meta and meaningless there, is skipped): each GLU MLP in it
    is of a kind some family runs (and so is patched as that family's are)."""
    _, users = scan_timm_sources()
    builders = users | {m for m, _ in GLU_MLP_CLASSES if m.startswith("timm.models.")}
    monkeypatch.setattr(timm.layers.weight_init, "_trunc_normal_", lambda tensor, *args, **kwargs: tensor)
    covered = frozenset().union(*family_kinds.values())
    seen: dict[tuple, list[str]] = {}
    for name in timm.list_models():
        if f"timm.models.{timm_registry._model_to_module[name]}" not in builders:
            continue
        with torch.device("meta"):
            try:
                model = timm.create_model(name, pretrained=False, depth=1)
            except Exception:  # no depth argument (gMixer), or per-block lists of depth's length
                model = timm.create_model(name, pretrained=False)
        for path in glu_paths(model):
            seen.setdefault(kind(model.get_submodule(path)), []).append(name)
    assert seen, "no entrypoint builds a GLU MLP: the scan is broken"
    if timm.__version__ == "1.0.31":  # the number README.md and docs/patching-and-hf.md state
        assert len({name for names in seen.values() for name in names}) == 59
    missing = {k: v[:3] for k, v in seen.items() if k not in covered}
    assert not missing, f"kinds of GLU MLP in timm's entrypoints that no family runs: {missing}"
    unused = {name for name, kinds in family_kinds.items() if kinds and not kinds & set(seen)}
    assert unused <= {"beit_swiglu"}, f"families whose kind no entrypoint builds: {unused}"


# ---- timm's MLP classes on their own ---------------------------------------------------

D = 16
GATED_UNIT_NAMED = ("its forward computes a gated unit (read from its source: an activation's output times another "
                    "tensor) in a form swiglu_cupy does not recognise: left as is")


def mlp_cases():
    """``(module, report table, detail, fusion in training)``: GluMlp's
    defaults (the original GLU: sigmoid, gate last), its options, and the
    other classes of timm.layers.mlp."""
    return {
        "glu_defaults": (GluMlp(D, 48), "fused", "sigmoid: fc1 (gate last) -> fc2", "mlp"),
        "glu_gelu_gate_first": (GluMlp(D, 48, act_layer=nn.GELU, gate_last=False), "fused",
                                "gelu: fc1 (gate first) -> fc2", "mlp"),
        "glu_no_bias": (GluMlp(D, 48, bias=False), "fused", "sigmoid: fc1 (gate last) -> fc2", "mlp"),
        "glu_norm": (GluMlp(D, 48, norm_layer=nn.LayerNorm), "partial",
                     "sigmoid; norm (LayerNorm) between the product and fc2 runs as itself", "activation"),
        # dropout: no-op in eval, so the whole MLP fuses; in training it runs as itself.
        "glu_dropout": (GluMlp(D, 48, drop=0.25), "fused", "sigmoid: fc1 (gate last) -> fc2", "activation"),
        "glu_dropout_zero": (GluMlp(D, 48, drop=0.0), "fused", "sigmoid: fc1 (gate last) -> fc2", "mlp"),
        "glu_dropout_after_fc2": (GluMlp(D, 48, drop=(0.0, 0.25)), "fused", "sigmoid: fc1 (gate last) -> fc2",
                                  "mlp"),
        "swiglu_packed": (SwiGLUPacked(D, 48), "fused", "silu: fc1 (gate first) -> fc2", "mlp"),
        "swiglu": (SwiGLU(D, 24), "fused", "silu: fc1_g/fc1_x -> fc2", "mlp"),
        "swiglu_gelu_aligned": (SwiGLU(D, 20, act_layer=nn.GELU, align_to=8), "fused", "gelu: fc1_g/fc1_x -> fc2",
                                "mlp"),
        "swiglu_norm_dropout": (SwiGLU(D, 24, norm_layer=nn.LayerNorm, drop=0.25), "partial",
                                "silu; norm (LayerNorm) between the product and fc2 runs as itself", "activation"),
        "glu_tanh": (GluMlp(D, 48, act_layer=nn.Tanh), "skipped",
                     "unknown activation (Tanh): left alone, never approximated", None),
        "glu_prelu": (GluMlp(D, 48, act_layer=nn.PReLU), "skipped",
                      "learnable activation (PReLU): left alone, never approximated", None),
        "mlp": (Mlp(D, 48), None, None, None),
        # use_conv: 1x1 Conv2d projections over NCHW are not linear-like: no candidate; its forward's
        # gated unit is named by the walk's safety net (no timm model builds it).
        "glu_conv": (GluMlp(D, 48, use_conv=True), "skipped", GATED_UNIT_NAMED, None),
    }


@pytest.mark.parametrize("case", list(mlp_cases()))
def test_timm_mlp_classes_fused_with_parity_or_left_with_a_reason(case):
    torch.manual_seed(0)
    module, table, detail, training_fusion = mlp_cases()[case]
    module.eval()
    redraw_parameters(module, seed=1)
    reference = copy.deepcopy(module)
    report = sc.patch(module)
    assert len(report.fused) + len(report.partial) + len(report.skipped) == (table is not None), str(report)
    if table is not None:
        assert getattr(report, table) == {"": detail}, str(report)
    assert isinstance(module, FusedGLUMLP) == (table in ("fused", "partial")), str(report)
    if isinstance(module, FusedGLUMLP):
        assert module.fusion() == ("mlp" if table == "fused" else "activation")
    x = torch.randn(3, D, 4, 4) if case == "glu_conv" else torch.randn(3, 5, D)
    assert_parity(module, reference, x, [""] if table in ("fused", "partial") else [])
    for model in (module, reference):
        model.train()
    if isinstance(module, FusedGLUMLP):
        assert module.fusion() == training_fusion
    # training mode, dropout on: the same masks from the same seed (a training-mode probe checked placement)
    for model in (module, reference):
        model.zero_grad(set_to_none=True)
    outs = []
    for model in (module, reference):
        torch.manual_seed(3)
        out = model(x)
        out.square().mean().backward()
        outs.append(out)
    assert_close_to_scale(outs[0], outs[1], "training-mode output")
    for (name, p), q in zip(module.named_parameters(), reference.parameters()):
        assert_close_to_scale(p.grad, q.grad, name)


def test_glu_mlp_with_dropout_patched_in_training():
    """Patched in training mode, GluMlp's dropout (p > 0) between the product
    and fc2 is said in the report: activation only, the masks its own."""
    torch.manual_seed(0)
    module = GluMlp(D, 48, drop=0.25).train()
    redraw_parameters(module)
    reference = copy.deepcopy(module)
    report = sc.patch(module)
    assert report.partial == {"": "sigmoid; drop1 (Dropout p=0.25 in training) between the product and fc2 runs "
                                  "as itself"} and not report.fused, str(report)
    x = torch.randn(3, 5, D)
    outs = []
    for model in (module, reference):
        torch.manual_seed(3)
        outs.append(model(x))
    assert_close_to_scale(outs[0], outs[1], "training-mode output")
    assert (outs[1] == 0).any()  # the dropout really drew a mask
    module.eval()
    assert module.fusion() == "mlp"


def test_gated_mlp_with_spatial_gating_is_not_a_glu():
    """gMLP's GatedMlp: fc1 -> act -> gate (a spatial gating unit, with a
    projection over tokens) -> fc2: no GLU, not a candidate, untouched."""
    from timm.models.mlp_mixer import SpatialGatingUnit

    torch.manual_seed(0)
    module = GatedMlp(D, 48, gate_layer=functools.partial(SpatialGatingUnit, seq_len=5))
    redraw_parameters(module)
    reference = copy.deepcopy(module)
    report = sc.patch(module)
    assert not (report.fused or report.partial or report.skipped or report.pending), str(report)
    assert not any(isinstance(m, FusedGLUMLP) for m in module.modules())
    assert_parity(module, reference, torch.randn(3, 5, D), [])
