"""integrations/plan_runner.py: a patched module's fusion is decided once and
kept with the state it was decided on; every change to that state (a hook, an
instance forward, a replaced projection, dropout's mode, a global hook) is
seen at the next call, which decides again. Never a stale fusion."""
from __future__ import annotations

import copy
import pickle
import sys

import pytest
import torch
from torch import nn

import swiglu_cupy as sc
from swiglu_cupy.integrations import plan_runner


class GatedMLP(nn.Module):
    """Its dropout is registered after ``down_proj`` but applied before it:
    by registration order the structure reads it as after ``down``."""

    def __init__(self, d=16, h=24, p=0.0):
        super().__init__()
        self.gate_proj = nn.Linear(d, h, bias=False)
        self.up_proj = nn.Linear(d, h, bias=False)
        self.down_proj = nn.Linear(h, d, bias=False)
        self.dropout = nn.Dropout(p)

    def forward(self, x):
        return self.down_proj(self.dropout(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x)))


class DropoutBeforeDown(GatedMLP):
    """The same forward, the dropout registered where it is applied."""

    def __init__(self, d=16, h=24, p=0.0):
        nn.Module.__init__(self)
        self.gate_proj = nn.Linear(d, h, bias=False)
        self.up_proj = nn.Linear(d, h, bias=False)
        self.dropout = nn.Dropout(p)
        self.down_proj = nn.Linear(h, d, bias=False)


@pytest.fixture(autouse=True)
def usual_state(monkeypatch):
    """Without DeepSpeed loaded, the usual state is compared in place: the
    path these tests must reach (an earlier test file may have loaded it)."""
    monkeypatch.delitem(sys.modules, "deepspeed", raising=False)


def patched(p=0.0, cls=GatedMLP):
    torch.manual_seed(0)
    reference = cls(p=p).double()
    model = nn.Sequential(copy.deepcopy(reference))
    report = sc.patch(model)
    assert "0" in {**report.fused, **report.partial}, report
    return reference, model[0]


def counted(monkeypatch, *names) -> list:
    """A list that grows by one at each call of any of ``plan_runner``'s ``names`` (which still run)."""
    calls = []
    for name in names:
        real = getattr(plan_runner, name)
        monkeypatch.setattr(plan_runner, name, lambda *a, real=real, **k: calls.append(1) or real(*a, **k))
    return calls


def whole_calls(monkeypatch) -> list:
    """Each run of the whole MLP in the fused op (the packed layouts' entry points, and the usual
    separate projections' call of the API's ``run_feed_forward``)."""
    return counted(monkeypatch, "swiglu", "swiglu_unpacked", "run_feed_forward")


def test_decided_once_and_kept(monkeypatch):
    _, mlp = patched()
    x = torch.randn(3, 16, dtype=torch.float64)
    mlp(x)
    decisions = counted(monkeypatch, "_decide_fusion")
    for _ in range(3):
        mlp(x)
    assert decisions == [] and mlp.fusion() == "mlp"


def test_the_usual_state_is_compared_in_place_and_anything_else_builds_it(monkeypatch):
    """No hook anywhere and no DeepSpeed: each forward compares the kept
    tuples (``run_plan``; no state list is built); a hooked projection or
    DeepSpeed loaded builds the whole state at each call, which still sees
    the hook go. ``fusion()`` asks ``fusion_of``, which builds it."""
    _, mlp = patched()
    x = torch.randn(3, 16, dtype=torch.float64)
    mlp(x)
    built = counted(monkeypatch, "_fusion_state")
    whole = whole_calls(monkeypatch)
    mlp(x), mlp(x)
    assert built == [] and len(whole) == 2
    assert mlp.fusion() == "mlp" and len(built) == 1
    handle = mlp.gate_proj.register_forward_pre_hook(lambda m, i: None)
    mlp(x), mlp(x)
    assert len(built) == 3 and len(whole) == 2 and mlp.fusion() == "activation"
    handle.remove()
    mlp(x)
    assert len(built) == 5 and len(whole) == 3  # decided again (the fusion() above built one more)
    mlp(x)
    assert len(built) == 5 and len(whole) == 4  # the usual state again: in place
    monkeypatch.setitem(sys.modules, "deepspeed", object())  # loaded: ZeRO-3's hooks may come and go
    monkeypatch.setattr(plan_runner, "_zero3", lambda: None)
    mlp(x)
    assert len(built) == 6 and len(whole) == 5


@pytest.mark.parametrize("change", ["forward_hook", "pre_hook", "backward_hook", "instance_forward",
                                    "replaced_projection", "global_hook"])
def test_a_change_is_seen_at_the_next_call_and_undone_when_removed(change, monkeypatch):
    reference, mlp = patched()
    x = torch.randn(3, 16, dtype=torch.float64)
    assert mlp.fusion() == "mlp"
    seen = []
    if change == "forward_hook":
        handle = mlp.up_proj.register_forward_hook(lambda m, i, o: seen.append(1))
        undo = handle.remove
    elif change == "pre_hook":
        handle = mlp.down_proj.register_forward_pre_hook(lambda m, i: seen.append(1))
        undo = handle.remove
    elif change == "backward_hook":
        handle = mlp.gate_proj.register_full_backward_hook(lambda m, gi, go: seen.append(1))
        undo = handle.remove
    elif change == "instance_forward":
        lin = mlp.gate_proj
        lin.forward = lambda inp: seen.append(1) or nn.Linear.forward(lin, inp)
        undo = lambda: lin.__dict__.pop("forward")  # noqa: E731
    elif change == "replaced_projection":
        original = mlp.up_proj

        class Counting(nn.Linear):
            def forward(self, inp):
                seen.append(1)
                return super().forward(inp)

        counting = Counting(16, 24, bias=False, dtype=torch.float64)
        counting.weight = original.weight
        mlp.up_proj = counting
        undo = lambda: setattr(mlp, "up_proj", original)  # noqa: E731
    else:
        handle = nn.modules.module.register_module_forward_hook(lambda m, i, o: seen.append(1))
        undo = handle.remove
    calls = whole_calls(monkeypatch)
    y = mlp(x.requires_grad_())
    y.sum().backward()
    assert mlp.fusion() == "activation" and calls == [] and seen, change
    torch.testing.assert_close(y, reference(x))
    undo()
    seen.clear()
    mlp(x)
    assert mlp.fusion() == "mlp" and calls == [1] and not seen


def test_a_dropout_whose_placement_was_unproven_runs_the_own_forward_once_it_drops(monkeypatch):
    """Patched at rate 0, the probe cannot see where the dropout sits (the plan
    puts it after down). Set to drop later, the module runs its own forward:
    the same masks as the unpatched module, never the guessed placement."""
    reference, mlp = patched(p=0.0)
    assert mlp.swiglu_plan.dropout_unproven == ("dropout",) and mlp.fusion() == "mlp"
    x = torch.randn(4, 16, dtype=torch.float64)
    reference.dropout.p = mlp.dropout.p = 0.5
    reference.train(), mlp.train()
    calls = whole_calls(monkeypatch)
    assert mlp.fusion() is None
    torch.manual_seed(3)
    expected = reference(x)
    torch.manual_seed(3)
    torch.testing.assert_close(mlp(x), expected)
    assert calls == []
    mlp.eval(), reference.eval()
    assert mlp.fusion() == "mlp"
    torch.testing.assert_close(mlp(x), reference(x))
    assert calls == [1]


def test_a_dropout_placed_by_the_probe_fuses_in_training():
    with pytest.raises(AssertionError, match="dropout placement differs"):
        patched(p=0.1)  # read as after down, and the probe at rate 0.1 sees it is not
    reference, mlp = patched(p=0.1, cls=DropoutBeforeDown)
    assert mlp.swiglu_plan.dropout_unproven == () and mlp.swiglu_plan.mid == ("dropout",)
    mlp.train()
    assert mlp.fusion() == "activation"  # dropout between the product and down: the projections run as themselves
    mlp.eval()
    assert mlp.fusion() == "mlp"


def test_a_copy_and_a_pickle_decide_for_themselves():
    _, mlp = patched()
    x = torch.randn(2, 16, dtype=torch.float64)
    mlp(x)
    twin = copy.deepcopy(mlp)
    twin.up_proj.register_forward_hook(lambda m, i, o: None)
    assert twin.fusion() == "activation" and mlp.fusion() == "mlp"
    loaded = pickle.loads(pickle.dumps(nn.Sequential(mlp)))[0]
    torch.testing.assert_close(loaded(x), mlp(x))
    assert loaded.fusion() == "mlp"


def test_a_parametrized_projection_runs_fused_with_its_computed_weight():
    """A parametrization moves a projection's weight out of its parameter
    registry: the whole-MLP call reads it through the module (the computed
    weight), as the reference does."""
    from torch.nn.utils import parametrize

    class Doubled(nn.Module):
        def forward(self, w):
            return 2 * w

    reference, mlp = patched()
    for module in (reference, mlp):
        parametrize.register_parametrization(module.up_proj, "weight", Doubled())
    x = torch.randn(3, 16, dtype=torch.float64, requires_grad=True)
    y = mlp(x)
    torch.testing.assert_close(y, reference(x))
    assert mlp.fusion() == "mlp"
    y.pow(2).sum().backward()
    reference(x).pow(2).sum().backward()
    grad = mlp.up_proj.parametrizations.weight.original.grad
    assert grad is not None and grad.abs().sum() > 0
    torch.testing.assert_close(grad, reference.up_proj.parametrizations.weight.original.grad)
