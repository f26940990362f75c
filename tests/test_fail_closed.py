"""patch() fails closed: a module whose forward cannot be shown equal to the
fused one is left as it is, with a reason that says what happened."""
from __future__ import annotations

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
