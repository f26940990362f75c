"""swiglu_cupy.integrations.glu_source, the walk's safety net: a module that
computes a gated unit in a form the walk does not recognise is named in
``report.skipped``, read from its forward's source; and tests/reach_scan.py,
which finds such classes in a library's sources (tests/test_reach.py)."""
from __future__ import annotations

import ast
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import swiglu_cupy as sc
from glu_zoo import TorchtitanFeedForward
from swiglu_cupy.integrations.glu_source import forward_computes_glu, gated_products

NAMED = "its forward computes a gated unit (read from its source"


def _products(source: str):
    return gated_products(ast.parse(textwrap.dedent(source)).body[0])


@pytest.mark.parametrize("source,expected", [
    ("def f(self, x):\n    return self.down(F.silu(self.gate(x)) * self.up(x))\n", [{"gate", "up"}]),
    ("def f(self, x):\n    h = self.act(self.w1(x))\n    h = h * self.w3(x)\n    return h\n", [{"act", "w1", "w3"}]),
    ("def f(self, x):\n    h = torch.sigmoid(x)\n    h *= self.up(x)\n    return h\n", [{"up"}]),
    ("def f(self, x):\n    return F.glu(self.proj(x), dim=-1)\n", [set()]),
    ("def f(self, x):\n    if self.w3 is not None:\n        x = F.gelu(x) * self.w3(x)\n    return x\n", [{"w3"}]),
    ("def f(self, x):\n    return F.silu(x) * self.scale\n", []),       # a scale, not a computed tensor
    ("def f(self, x):\n    return self.a(x) * self.b(x)\n", []),        # no activation
    ("def f(self, x):\n    return F.silu(x) * 2.0\n", []),
    ("def f(self, x):\n    return self.extract(x) * self.factor(x)\n", []),  # words, not substrings
    ("def f(self, x):\n    return nn.SiLU()(self.a(x)) * self.b(x)\n", [{"a", "b"}]),
    ("def f(self, x):\n    h = self.hidden_act(self.w1(x))\n    return h * self.w3(x)\n", [{"hidden_act", "w1", "w3"}]),
])
def test_the_rule_on_small_functions(source, expected):
    assert [set(p) for p in _products(source)] == expected


class _ConvGLU(nn.Module):
    """A GLU feed-forward over 1x1 convolutions: no linear-like child, so
    not a candidate of the walk."""

    def __init__(self):
        super().__init__()
        self.gate, self.up, self.down = nn.Conv2d(4, 8, 1), nn.Conv2d(4, 8, 1), nn.Conv2d(8, 4, 1)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp, self.gate = TorchtitanFeedForward(8, 16), nn.Linear(8, 8)

    def forward(self, x):
        return self.mlp(x) * torch.sigmoid(self.gate(x))


class _GatedAttention(nn.Module):
    """Attention-like: two inputs; its output gated."""

    def __init__(self):
        super().__init__()
        self.qkv, self.gate = nn.Linear(8, 24), nn.Linear(8, 8)

    def forward(self, x, mask):
        q, k, v = self.qkv(x).chunk(3, -1)
        return v * torch.sigmoid(self.gate(x))


class _OptionalGate(nn.Module):
    """torchtune-like (over 1x1 convolutions, which the walk does not take
    for projections): the product needs ``w3``, which an ungated instance lacks."""

    def __init__(self, gated: bool):
        super().__init__()
        self.w1, self.w2 = nn.Conv1d(8, 16, 1), nn.Conv1d(16, 8, 1)
        self.w3 = nn.Conv1d(8, 16, 1) if gated else None

    def forward(self, x):
        h = F.gelu(self.w1(x))
        if self.w3 is not None:
            h = h * self.w3(x)
        return self.w2(h)


def test_an_unrecognised_gated_unit_is_named_and_left_as_it_is():
    model = nn.Sequential(_ConvGLU())
    x = torch.randn(2, 4, 3, 3)
    before = model(x)
    report = sc.patch(model)
    assert report.skipped["0"].startswith(NAMED), str(report)
    assert report.classes["0"] == "_ConvGLU" and type(model[0]) is _ConvGLU
    assert torch.equal(model(x), before)


def test_around_handled_modules_attention_and_absent_children_are_not_named():
    model = nn.ModuleDict({"block": _Block(), "attn": _GatedAttention(), "ungated": _OptionalGate(False)})
    report = sc.patch(model)
    assert set(report.fused) == {"block.mlp"} and report.skipped == {}, str(report)
    # the same classes where they do compute it: named
    gated = nn.ModuleDict({"ffn": _OptionalGate(True)})
    assert sc.patch(gated).skipped["ffn"].startswith(NAMED)


def test_hf_patch_model_leaves_the_safety_net_to_patch():
    """The narrowed walks (``hf.patch_model``) look only at their families."""
    from swiglu_cupy.hf import patch_model

    model = nn.Sequential(_ConvGLU())
    patch_model(model)
    assert type(model[0]) is _ConvGLU


def test_the_rule_is_read_once_per_class():
    from swiglu_cupy.integrations.glu_source import forward_gated_products

    forward_computes_glu(_ConvGLU)
    hits = forward_gated_products.cache_info().hits
    assert forward_computes_glu(_ConvGLU)
    assert forward_gated_products.cache_info().hits == hits + 1


# ---- the reach scan (tests/reach_scan.py) and its check (tests/test_reach.py) ------------------

LIBRARY = '''
import torch
import torch.nn.functional as F
from torch import nn


class HelperGLU(nn.Module):
    """Stacked experts weights, its gated unit in a helper method: neither a
    structure the walk recognises nor a forward its safety net reads."""

    def __init__(self):
        super().__init__()
        self.w12 = nn.Parameter(torch.randn(2, 32, 8))
        self.w3 = nn.Parameter(torch.randn(2, 8, 16))

    def _gated(self, x, e):
        gate, up = (x @ self.w12[e].T).chunk(2, -1)
        return F.silu(gate) * up

    def forward(self, x):
        return self._gated(x, 0) @ self.w3[0].T


class LoRAHelperGLU(HelperGLU):
    pass


class NotGated(nn.Module):
    def forward(self, x):
        return x * 2
'''


@pytest.fixture
def planted_library(tmp_path, monkeypatch):
    package = tmp_path / "planted_glu_lib"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "layers.py").write_text(LIBRARY)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "planted_glu_lib"
    for name in [m for m in sys.modules if m.startswith("planted_glu_lib")]:
        del sys.modules[name]


def test_the_scan_finds_a_planted_class_and_its_subclass(planted_library):
    from reach_scan import gated_classes, module_classes

    found = gated_classes(planted_library)
    assert found == ["planted_glu_lib.layers.HelperGLU", "planted_glu_lib.layers.LoRAHelperGLU"]
    classes, dropped = module_classes(found)
    assert set(classes) == set(found) and dropped == {}


def test_the_reach_check_fails_on_a_gated_class_patch_does_not_report(planted_library):
    """The walk cannot read a gated unit in a helper method: built, the class
    passes unreported and the check fails; not built, it is not held by its
    source and the check fails too."""
    from reach_scan import gated_classes, module_classes
    from test_reach import check

    classes, _ = module_classes(gated_classes(planted_library))
    with pytest.raises(AssertionError, match="neither fused nor named.*HelperGLU"):
        check("planted", classes, [nn.ModuleDict({"a": classes["planted_glu_lib.layers.HelperGLU"]()})])
    with pytest.raises(AssertionError, match="not built here.*HelperGLU"):
        check("planted", classes, [])
