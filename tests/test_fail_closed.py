"""patch() fails closed: a module whose forward cannot be shown equal to the
fused one is left as it is, with a reason that says what happened."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import swiglu_cupy as sc


class _RaisingMLP(nn.Module):
    """A GLU feed-forward by its names whose forward raises on any input."""

    def __init__(self, d=8, h=16):
        super().__init__()
        self.gate_proj = nn.Linear(d, h, bias=False)
        self.up_proj = nn.Linear(d, h, bias=False)
        self.down_proj = nn.Linear(h, d, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        raise RuntimeError("0 active drivers\nsecond line, not reported")


def test_failed_probe_reports_the_exception_type_and_first_line():
    model = nn.Sequential(_RaisingMLP())
    report = sc.patch(model)
    reason = report.skipped["0"]
    assert reason == ("could not be probed: its forward failed on a probe input "
                      "(RuntimeError: 0 active drivers)"), reason
    assert type(model[0]) is _RaisingMLP


# --- class switches: the upstream forward is run against the fused one -----------------------

class _SiluChanged:
    """A stand-in for a module's ``torch.nn.functional`` (its ``F``) whose silu
    is another activation: the upstream forward left alone, the activation it
    calls changed."""

    def __init__(self, functional):
        self._functional = functional

    def __getattr__(self, name):
        return getattr(self._functional, name)

    @staticmethod
    def silu(x, inplace=False):
        return torch.nn.functional.gelu(x)


def _torchtitan_experts():
    pytest.importorskip("torchtitan", exc_type=ImportError)
    from torchtitan.models.common.moe import GroupedExperts

    torch.manual_seed(0)
    experts = GroupedExperts(GroupedExperts.Config(dim=16, hidden_dim=32, num_experts=4))
    for p in experts.parameters():
        nn.init.normal_(p, std=0.2)
    return experts, GroupedExperts


def _olmo_core_module(kind):
    import importlib.util
    import warnings

    if importlib.util.find_spec("olmo_core") is None:
        pytest.skip("ai2-olmo-core is not installed")
    from test_training_libraries import stand_ins_for_import

    with stand_ins_for_import(("cached_path",)):  # as test_training_libraries' olmo_core fixture
        importlib.import_module("olmo_core.nn.transformer")

    from olmo_core.nn.feed_forward import NormalizedFeedForward
    from olmo_core.nn.moe.mlp import DroplessMoEMLP, MoEMLP

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DroplessMoEMLP: grouped GEMM not available
        if kind == "normalized":
            module = NormalizedFeedForward(d_model=16, hidden_size=32)
            module.reset_parameters() if hasattr(module, "reset_parameters") else None
        else:
            module = (MoEMLP if kind == "moe_mlp" else DroplessMoEMLP)(d_model=16, hidden_size=32, num_experts=4)
    for p in module.parameters():
        nn.init.normal_(p, std=0.2)
    return module, type(module)


def _inputs(module):
    name = type(module).__name__.removeprefix("SwiGLUCupy")
    torch.manual_seed(3)
    if name == "GroupedExperts":
        counts = torch.tensor([2, 3, 0, 3])
        return torch.randn(8, 16), counts
    if name == "MoEMLP":
        return (torch.randn(4, 3, 16),)
    if name == "DroplessMoEMLP":
        counts = torch.tensor([2, 3, 0, 3])
        return torch.randn(8, 16), counts
    return (torch.randn(5, 16),)


def _build(kind):
    return _torchtitan_experts() if kind == "torchtitan_experts" else _olmo_core_module(kind)


def _upstream_module(kind):
    if kind == "torchtitan_experts":
        import torchtitan.models.common.moe as upstream
    elif kind == "normalized":
        import olmo_core.nn.feed_forward as upstream
    else:
        import olmo_core.nn.moe.mlp as upstream
    return upstream


SWITCHED = ["torchtitan_experts", "moe_mlp", "dropless", "normalized"]


@pytest.mark.parametrize("kind", SWITCHED)
def test_unchanged_upstream_forward_is_switched(kind):
    module, cls = _build(kind)
    model = nn.ModuleDict({"ffn": module})
    args = _inputs(module)
    want = module(*args)
    report = sc.patch(model)
    assert "ffn" in report.fused and not report.skipped, str(report)
    assert type(module).__name__ == f"SwiGLUCupy{cls.__name__}"
    got = module(*args)
    tol = 3e-2 if kind == "torchtitan_experts" else 1e-4  # torchtitan's experts compute in bf16
    assert (got - want).norm() <= tol * want.norm()


@pytest.mark.parametrize("way", ["forward", "activation"])
@pytest.mark.parametrize("kind", SWITCHED)
def test_changed_upstream_math_is_refused_and_kept(kind, way, monkeypatch):
    """An upstream release that changes the class's forward, or leaves it and
    changes the activation it calls: patch() refuses the class switch with a
    reason, and the model computes the changed math."""
    module, cls = _build(kind)
    if way == "forward":
        original = cls.forward
        monkeypatch.setattr(cls, "forward", lambda self, *a, **k: 2.0 * original(self, *a, **k))
    else:
        upstream = _upstream_module(kind)
        monkeypatch.setattr(upstream, "F", _SiluChanged(upstream.F))
    model = nn.ModuleDict({"ffn": module})
    args = _inputs(module)
    want = module(*args)
    report = sc.patch(model)
    assert "ffn" not in report.fused and "probe mismatch" in report.skipped.get("ffn", ""), str(report)
    assert cls.__name__ in report.skipped["ffn"]
    assert type(module) is cls
    assert torch.equal(module(*args), want)


@pytest.mark.parametrize("kind", SWITCHED)
def test_switched_on_meta_is_proved_at_the_first_forward(kind, monkeypatch):
    """On the meta device nothing can be computed: the switch is kept pending
    and proved at the first forward on real weights; a changed upstream
    forward is then refused (warned) and its own math runs."""
    module, cls = _build(kind)
    state = {k: v.clone() for k, v in module.state_dict().items()}
    meta = module.to("meta")
    original = cls.forward
    monkeypatch.setattr(cls, "forward", lambda self, *a, **k: 2.0 * original(self, *a, **k))
    report = sc.patch(nn.ModuleDict({"ffn": meta}))
    assert "first forward on real weights" in report.fused["ffn"], str(report)
    meta.to_empty(device="cpu")
    meta.load_state_dict(state)
    args = _inputs(meta)
    with pytest.warns(RuntimeWarning, match="probe mismatch"):
        got = meta(*args)
    assert torch.equal(got, original(meta, *args) * 2.0)


@pytest.mark.parametrize("way", ["forward", "activation"])
def test_torchtitan_feed_forward_changed_upstream_is_refused(way, monkeypatch):
    """torchtitan's dense ``FeedForward`` (w1/w3/w2) is found by structure and
    probed by the walk (not class-switched): a changed forward, or a changed
    ``F.silu`` in its module (here 1.5 * silu: no known activation), is
    refused, and its own math runs."""
    pytest.importorskip("torchtitan", exc_type=ImportError)
    import torchtitan.models.common.feed_forward as upstream
    from test_torchtitan import build

    module = build("llama3").layers["0"].feed_forward
    assert type(module) is upstream.FeedForward
    if way == "forward":
        original = upstream.FeedForward.forward
        monkeypatch.setattr(upstream.FeedForward, "forward", lambda self, x: 2.0 * original(self, x))
    else:
        changed = _SiluChanged(upstream.F)
        changed.silu = lambda x, inplace=False: 1.5 * torch.nn.functional.silu(x)
        monkeypatch.setattr(upstream, "F", changed)
    model = nn.ModuleDict({"ffn": module})
    x = torch.randn(5, module.w1.weight.shape[1], generator=torch.Generator().manual_seed(3))
    want = module(x)
    report = sc.patch(model)
    assert "ffn" not in report.fused and report.skipped["ffn"].startswith("probe mismatch"), str(report)
    assert type(module) is upstream.FeedForward
    assert torch.equal(module(x), want)


def test_proved_switch_stays_proved_when_patched_again_on_meta():
    """A module proved by patch() stays proved when patch() meets it again
    with weights it cannot compute with (sharded after the first patch)."""
    module, cls = _build("moe_mlp")
    model = nn.ModuleDict({"ffn": module})
    assert "ffn" in sc.patch(model).fused
    module.to("meta")
    again = sc.patch(model)
    assert again.fused["ffn"].endswith("(already fused)") and module._swiglu_cupy_proof is None, str(again)
