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


# --- Hugging Face experts: the fused forward against the implementation the module had -------

def _hf_experts(family="mixtral"):
    pytest.importorskip("transformers")
    from swiglu_cupy.tools.bench.moe import experts_modules, tiny_model

    torch.manual_seed(0)
    model = tiny_model(family)
    return model, experts_modules(model)


def _hf_routing(module, tokens=11, seed=3):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, module.config.hidden_size, generator=gen)
    top, ids = torch.randn(tokens, module.num_experts, generator=gen).topk(2, dim=-1)
    return hidden, ids, top.softmax(-1)


def _scaled_by(function, factor):
    """An experts function whose math changed: ``function``'s output times ``factor``."""
    def changed(self, hidden_states, top_k_index, top_k_weights):
        return function(self, hidden_states, top_k_index, top_k_weights) * factor
    return changed


def test_hf_experts_unchanged_are_fused_after_the_forward_check():
    import swiglu_cupy.hf_experts as hx

    model, experts = _hf_experts()
    assert hx.patch_experts(model) == len(experts) > 0
    assert all(hx.experts_plan(m).activation is not None and not hx.experts_plan(m).pending for m in experts)


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_hf_experts_changed_implementation_is_refused_and_its_math_runs(family, monkeypatch):
    """A transformers release whose experts function (here grouped_mm, the
    one the module had) computes other math: the module stays on it."""
    import swiglu_cupy.hf_experts as hx
    import swiglu_cupy.integrations.hf_experts as hf_experts_module
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    model, experts = _hf_experts(family)
    changed = _scaled_by(ALL_EXPERTS_FUNCTIONS["grouped_mm"], 1.5)
    monkeypatch.setitem(ALL_EXPERTS_FUNCTIONS._local_mapping, "grouped_mm", changed)
    hf_experts_module._WARNED.discard(type(experts[0]))
    with pytest.warns(UserWarning, match="probe mismatch: its 'grouped_mm' implementation disagrees"):
        assert hx.patch_experts(model) == 0
    module = experts[0]
    assert "probe mismatch" in hx.experts_plan(module).reason
    routing = _hf_routing(module)
    with torch.no_grad():
        assert torch.equal(module(*routing), changed(module, *routing))


def test_hf_experts_changed_own_forward_is_refused_under_eager(monkeypatch):
    """Under the "eager" implementation the class's own forward is the
    reference: its math changed (the routing weights squared), it is kept."""
    import swiglu_cupy.hf_experts as hx
    from transformers.integrations import moe as moe_integration

    model, experts = _hf_experts()
    original_cls = type(experts[0])
    reference = original_cls.forward.__wrapped__

    def squared_weights(self, hidden_states, top_k_index, top_k_weights):
        return reference(self, hidden_states, top_k_index, top_k_weights ** 2)

    changed_cls = moe_integration.use_experts_implementation(
        type("ChangedExperts", (original_cls,), {"forward": squared_weights}))
    model.set_experts_implementation("eager")
    for m in experts:
        m.__class__ = changed_cls
    with pytest.warns(UserWarning, match=r"probe mismatch: its 'eager' implementation"):
        assert hx.patch_experts(model) == 0
    routing = _hf_routing(experts[0])
    with torch.no_grad():
        assert torch.equal(experts[0](*routing), squared_weights(experts[0], *routing))
    for m in experts:  # the class's unchanged forward under eager: fused
        m.__class__ = original_cls
    assert hx.patch_experts(model) == len(experts)


def test_hf_experts_no_reference_runs_is_refused_with_what_failed(monkeypatch):
    import swiglu_cupy.hf_experts as hx
    import swiglu_cupy.integrations.hf_experts as hf_experts_module
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    def no_driver(self, *args):
        raise RuntimeError("0 active drivers\nmore")

    model, experts = _hf_experts()
    monkeypatch.setitem(ALL_EXPERTS_FUNCTIONS._local_mapping, "grouped_mm", no_driver)
    monkeypatch.setattr(type(experts[0]).forward, "__wrapped__", no_driver)
    hf_experts_module._WARNED.discard(type(experts[0]))
    with pytest.warns(UserWarning, match="0 active drivers"):
        assert hx.patch_experts(model) == 0
    assert hx.experts_plan(experts[0]).reason.endswith(
        "could not be probed: its forward failed on a probe input (RuntimeError: 0 active drivers)")


@pytest.mark.parametrize("changed,strict", [(False, False), (True, False), (True, True)])
def test_hf_experts_patched_on_meta_are_checked_at_the_first_forward(changed, strict, monkeypatch):
    """Patched as a skeleton (meta): the plan waits; the first forward on real
    weights makes the check. A changed implementation is refused then, with a
    warning (an error under SWIGLU_CUPY_STRICT=1), and its math runs."""
    import swiglu_cupy.hf_experts as hx
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    _, (reference, *_) = _hf_experts()
    with torch.device("meta"):
        module = type(reference)(reference.config)
    assert hx.patch_experts(nn.Sequential(module)) == 1
    assert hx.experts_plan(module).pending
    module.to_empty(device="cpu")
    module.load_state_dict(reference.state_dict())
    expected_fn = ALL_EXPERTS_FUNCTIONS["grouped_mm"]
    if changed:
        expected_fn = _scaled_by(expected_fn, 1.5)
        monkeypatch.setitem(ALL_EXPERTS_FUNCTIONS._local_mapping, "grouped_mm", expected_fn)
    routing = _hf_routing(module)
    with torch.no_grad():
        if strict:
            monkeypatch.setenv("SWIGLU_CUPY_STRICT", "1")
            with pytest.raises(RuntimeError, match="checked at its first forward and stays unfused"):
                module(*routing)
        elif changed:
            with pytest.warns(RuntimeWarning, match="checked at its first forward and stays unfused.*probe mismatch"):
                module(*routing)
        y = module(*routing)   # settled: no second check, no second warning
        expected = expected_fn(module, *routing)
    plan = hx.experts_plan(module)
    assert not plan.pending and (plan.activation is None) == changed
    if changed:
        assert torch.equal(y, expected)
    else:
        torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-6)


def run_hf_expert_parallel_rank(case, rank, world):
    """One rank of transformers' distributed engine (tensor and expert
    parallel over 2 gloo ranks, ``case = (path, ep_implementation)``): the
    experts' weights are DTensors; logits with grouped_mm, with swiglu_cupy,
    and with swiglu_cupy over a changed grouped_mm, and the plans."""
    import swiglu_cupy.hf_experts as hx
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    from swiglu_cupy.tools.bench.moe import experts_modules

    path, mode = case
    ids = torch.randint(2, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    out = {}
    grouped_mm = ALL_EXPERTS_FUNCTIONS["grouped_mm"]
    for name, implementation in [("grouped_mm", "grouped_mm"), ("fused", hx.NAME), ("changed", "grouped_mm"),
                                 ("changed_fused", hx.NAME)]:
        if name.startswith("changed"):
            ALL_EXPERTS_FUNCTIONS._local_mapping["grouped_mm"] = _scaled_by(grouped_mm, 1.5)
        config = DistributedConfig(fsdp_size=1, tp_size=world, ep_size=world, ep_implementation=mode)
        model = AutoModelForCausalLM.from_pretrained(path, distributed_config=config, dtype=torch.float32,
                                                     experts_implementation=implementation)
        with torch.no_grad():
            out[name] = model(ids).logits
        experts = experts_modules(model)
        out[name + "_weights_dtensor"] = type(experts[0].gate_up_proj).__name__ == "DTensor"
        if implementation == hx.NAME:
            out[name + "_plans"] = [(hx.experts_plan(m).activation is not None, hx.experts_plan(m).reason)
                                    for m in experts]
    ALL_EXPERTS_FUNCTIONS._local_mapping.pop("grouped_mm", None)
    return out


@pytest.mark.parametrize("mode", ["all_to_all", "all_reduce"])
def test_hf_experts_under_transformers_expert_parallel_are_checked_on_their_shards(mode, tmp_path, monkeypatch):
    """Under transformers' own distributed engine the experts' weights are
    DTensors: the forward check runs on each rank's local shards; the fused
    experts give grouped_mm's logits exactly, and a changed grouped_mm is
    refused on every rank and its math runs."""
    pytest.importorskip("transformers.distributed.expert_parallel", exc_type=ImportError)
    import rank_launcher
    from swiglu_cupy.tools.bench.moe import tiny_model

    torch.manual_seed(0)
    tiny_model("mixtral").save_pretrained(tmp_path / "mixtral")
    for out in rank_launcher.launch(run_hf_expert_parallel_rank, (str(tmp_path / "mixtral"), mode), tmp_path,
                                    monkeypatch, 2, 240):
        assert out["fused_weights_dtensor"]
        assert all(fused for fused, _ in out["fused_plans"]), out["fused_plans"]
        assert torch.equal(out["fused"], out["grouped_mm"])
        assert not any(fused for fused, _ in out["changed_fused_plans"])
        assert all("probe mismatch" in reason for _, reason in out["changed_fused_plans"])
        assert torch.equal(out["changed_fused"], out["changed"])
        assert not torch.allclose(out["changed"], out["grouped_mm"])


# --- activations that agree within a 16-bit dtype's rounding: decided in float64 ----------------

class _InlineActivationMLP(nn.Module):
    """A GLU feed-forward that calls its activation inline (no act module to
    recognise by value): exact GELU, its tanh form or quick GELU."""

    def __init__(self, form, d=64, h=128):
        super().__init__()
        self.w1, self.w3 = nn.Linear(d, h, bias=False), nn.Linear(d, h, bias=False)
        self.w2 = nn.Linear(h, d, bias=False)
        self.form = form

    def forward(self, x):  # no attribute holds the activation: every known kind is a candidate
        a = self.w1(x)
        if self.form == "quick":
            a = a * torch.sigmoid(1.702 * a)
        else:
            a = nn.functional.gelu(a, approximate="tanh" if self.form == "tanh" else "none")
        return self.w2(a * self.w3(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("form,expected", [("exact", "gelu"), ("tanh", "gelu_tanh"), ("quick", "oai")])
def test_activations_alike_in_16_bits_are_told_apart(form, expected, dtype):
    """Exact GELU in bf16 used to be fused as its tanh form (the first
    candidate within bf16's rounding): the float64 copy decides."""
    torch.manual_seed(0)
    model = nn.Sequential(_InlineActivationMLP(form)).to(dtype)
    report = sc.patch(model)
    assert report.fused["0"].startswith(expected + ":") or report.fused["0"].startswith(expected + ","), report
    x = torch.randn(5, 64, dtype=dtype)
    with torch.no_grad():
        plain = _InlineActivationMLP(form).to(dtype)
        plain.load_state_dict(model[0].state_dict())
        exact = plain.double()(x.double())
        plain.to(dtype)
        err_fused = (model(x).double() - exact).norm() / exact.norm()
        err_plain = (plain(x).double() - exact).norm() / exact.norm()
    assert err_fused <= 2 * err_plain + 1e-12, (err_fused, err_plain)  # as close to float64 as unpatched


class _Float64Refusing(_InlineActivationMLP):
    def forward(self, x):
        if x.dtype == torch.float64:
            raise TypeError("no float64 kernel\nmore")
        return super().forward(x)


def test_activations_alike_and_no_float64_forward_is_refused_with_the_reason():
    model = nn.Sequential(_Float64Refusing("exact")).to(torch.bfloat16)
    report = sc.patch(model)
    reason = report.skipped["0"]
    assert "within torch.bfloat16's rounding and could not run in float64" in reason, reason
    assert reason.endswith("(TypeError: no float64 kernel)")
    assert type(model[0]) is _Float64Refusing
