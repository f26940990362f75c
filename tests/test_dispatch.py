"""The one place a primitive call is decided, kernels or torch, and
dispatched (``swiglu_cupy.primitives.dispatch``): the dense API decides once
per call and the Function runs that decision; the backward decides once for
itself; tracers and torch.func get no eager path; only lasting decisions are
kept, and a self-check reset forgets them."""
import pytest
import torch
from torch.func import vmap

import swiglu_cupy as sc
from swiglu_cupy.activations import SILU
from swiglu_cupy.dense import api
from swiglu_cupy.primitives import dispatch
from swiglu_cupy.primitives import first_use_check as selfcheck
from swiglu_cupy.tools import host_cost

D, H = 16, 24


def _counting(monkeypatch):
    """Counts of the decisions (each looks its path up: the dense API's call in
    ``api._DECIDED``, the backward and the primitives in ``dispatch._PATHS``)
    and of the per-primitive entry (never on the dense eager path)."""
    counts = {"decisions": 0, "per_primitive": 0}
    real_path = dispatch._kernel_path

    class CountedPaths(dict):
        def get(self, key, default=None):
            counts["decisions"] += 1
            return super().get(key, default)

    def kernel_path(*a, **k):
        counts["per_primitive"] += 1
        return real_path(*a, **k)

    monkeypatch.setattr(dispatch, "_PATHS", CountedPaths(dispatch._PATHS))
    monkeypatch.setattr(api, "_DECIDED", CountedPaths(api._DECIDED))
    monkeypatch.setattr(dispatch, "_kernel_path", kernel_path)
    return counts


@pytest.mark.parametrize("mode", list(host_cost.MODES))
def test_a_swiglu_call_decides_once_and_runs_that_decision(mode, monkeypatch):
    torch.manual_seed(0)
    model = sc.SwiGLU(D, H)
    x, dy = torch.randn(3, D, requires_grad=mode != "no_grad forward"), torch.randn(3, D)
    with host_cost.cuda_route() as launcher, host_cost.MODES[mode]():
        step = host_cost.mode_step(mode, model, model, x, dy)
        step()  # the first call decides (and caches) the path
        counts = _counting(monkeypatch)
        launched = launcher.launches
        step()
    expected = 2 if mode == "forward+backward" else 1   # the forward's, and the backward's own
    assert counts == {"decisions": expected, "per_primitive": 0}
    assert launcher.launches == launched + expected      # and each ran the kernels it chose


def test_the_cpu_path_decides_torch_and_matches_the_reference():
    torch.manual_seed(1)
    model = sc.SwiGLU(D, H).double()
    x = torch.randn(4, D, dtype=torch.float64, requires_grad=True)
    path = dispatch.eager_path(x, SILU)
    assert isinstance(path, dispatch.TorchPath) and path.launcher is False
    y = model(x)
    ref = sc.swiglu_reference(x, model.w12.weight, model.w12.bias, model.w3.weight, model.w3.bias)
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
    y.sum().backward()
    assert x.grad.abs().sum() > 0


def test_tracers_and_transforms_get_no_eager_path(monkeypatch):
    x = torch.randn(2, 2 * H)
    seen = []
    vmap(lambda row: seen.append(dispatch.eager_path(row, SILU)) or row)(x)
    assert seen == [None]
    monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True)  # what export and AOT tracing set
    assert dispatch.eager_path(x, SILU) is None


def test_only_lasting_decisions_are_kept_and_reset_forgets_them():
    x = torch.randn(2, 2 * H)
    launcher = host_cost.NullLauncher()
    with host_cost.cuda_route(launcher):
        path = dispatch.eager_path(x, SILU)
        assert isinstance(path, dispatch.KernelPath) and path.launcher is launcher
        assert dispatch.eager_path(x, SILU) is path                       # kept
        with sc.kernels.launch_config.using_launch_config(sc.kernels.launch_config.LaunchConfig(2, 128, 1)):
            other = dispatch.eager_path(x, SILU)                          # another config: its own decision
        assert other is not path and other.config.packs_per_thread == 2
        selfcheck.reset()
        assert not dispatch._PATHS
        assert dispatch.eager_path(x, SILU) is not path
    selfcheck.reset()


def test_a_deferred_decision_is_asked_again(monkeypatch):
    """Inside a compile trace the self-check waits: the call gets torch, and nothing is kept."""
    launcher = host_cost.NullLauncher()   # a module never checked
    x = torch.randn(2, 2 * H)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    path = dispatch.path_for(x, SILU, launcher)
    assert isinstance(path, dispatch.TorchPath)
    assert not any(entry[0] is launcher for entry in dispatch._PATHS.values())
    assert selfcheck.result_of(launcher, SILU, x.dtype, x.device) is None   # no probe ran in the trace


def test_a_decided_kernel_path_follows_the_clamp_rule_in_force(host_launcher, monkeypatch):
    """A KernelPath holds launch plans whose clamp-gradient bound was read when
    they were built: the rule is part of the path's key, so a switched rule
    decides (and runs) a path of its own, never a stale one."""
    from swiglu_cupy import _torch_compat, primitives
    from swiglu_cupy.activations import GLUActivation
    from swiglu_cupy.kernels.launch_config import using_launcher

    spec = GLUActivation("silu", limit=2.0)
    x12 = torch.tensor([[2.0, 0.5, 1.0, -2.0]], dtype=torch.float64)  # gate at +L; up at -L
    dh = torch.tensor([[1.5, 0.75]], dtype=torch.float64)
    at_bound = {}
    with using_launcher(host_launcher):
        for rule in (True, False, True):
            monkeypatch.setattr(_torch_compat, "CLAMP_GRADIENT_AT_BOUND", rule)
            path = dispatch.eager_path(x12, spec)
            assert isinstance(path, dispatch.KernelPath)
            dx12, h = path.backward(x12, dh, False)
            expected, _ = primitives.swiglu_backward(x12, dh, implementation="torch", activation=spec)
            assert torch.equal(dx12, expected)
            at_bound[rule] = (dx12[0, 0].item(), dx12[0, 3].item())  # gate at +L, up at -L
    assert all(g != 0 for g in at_bound[True]) and at_bound[False] == (0.0, 0.0)
