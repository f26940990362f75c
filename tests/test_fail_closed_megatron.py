"""megatron-core's MLP is accepted from what was proven (its CUDA-only paths
cannot run here): the installed version, the source of MLP.forward, and an
allow-list of config values; outside them it is refused with the reason and
computes megatron's own math. One process, a gloo group of one rank (TP 1)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

try:
    import megatron.core.parallel_state  # noqa: F401
    from megatron.core.transformer.mlp import MLP
except ImportError as e:  # pragma: no cover - depends on the environment
    pytest.skip(f"megatron-core is not importable ({e})", allow_module_level=True)

import swiglu_cupy as sc
from swiglu_cupy.integrations import megatron as scm
from test_megatron import _config, _dense, _experts, _twins

S, B, D = 6, 2, 16


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    store = tmp_path_factory.mktemp("gloo") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    yield
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def _x():
    return torch.randn(S, B, D, generator=torch.Generator().manual_seed(3))


def _out(module, *args):
    with torch.no_grad():
        y, bias = module(*args)
    return y if bias is None else y + bias


def test_proven_version_and_config_are_fused(one_rank):
    mlp, ref = _twins(_dense, _config(1))
    report = sc.patch(mlp)
    assert "" in report.fused and not report.skipped, str(report)
    assert (_out(mlp, _x()) - _out(ref, _x())).abs().max() <= 1e-5 * _out(ref, _x()).abs().max()


def test_changed_forward_is_refused(one_rank, monkeypatch):
    original = MLP.forward

    def scaled(self, hidden_states, *args, **kwargs):
        y, bias = original(self, hidden_states, *args, **kwargs)
        return 2.0 * y, bias

    monkeypatch.setattr(MLP, "forward", scaled)
    mlp, ref = _twins(_dense, _config(1))
    report = sc.patch(mlp)
    assert not report.fused and "MLP.forward is not the forward proven" in report.skipped[""], str(report)
    assert type(mlp) is MLP
    assert torch.equal(_out(mlp, _x()), _out(ref, _x()))


def test_changed_activation_attribute_is_refused(one_rank):
    mlp, ref = _twins(_dense, _config(1))
    mlp.activation_func = ref.activation_func = F.gelu  # the config still says silu
    report = sc.patch(mlp)
    assert not report.fused and "activation_func differs" in report.skipped[""], str(report)
    assert torch.equal(_out(mlp, _x()), _out(ref, _x()))


def test_changed_activation_in_torch_is_refused(one_rank, monkeypatch):
    """torch.nn.functional.silu is no longer the function the config holds:
    not an activation proven, refused."""
    mlp, ref = _twins(_dense, _config(1))
    monkeypatch.setattr(F, "silu", lambda x, inplace=False: torch.nn.functional.gelu(x))
    report = sc.patch(mlp)
    assert not report.fused and "activation_func=silu has no swiglu_cupy form" in report.skipped[""], str(report)
    assert type(mlp) is MLP


@pytest.mark.parametrize("version", ["0.17.0", "0.16.0", None])
def test_version_outside_the_range_is_refused(one_rank, monkeypatch, version):
    monkeypatch.setattr(scm, "megatron_version", lambda: version)
    mlp, ref = _twins(_dense, _config(1))
    report = sc.patch(mlp)
    assert not report.fused and report.skipped[""].startswith(f"megatron-core {version} is installed"), str(report)
    assert type(mlp) is MLP


def test_config_value_outside_the_allow_list_is_refused(one_rank):
    mlp = _dense(_config(1))
    object.__setattr__(mlp.config, "cpu_offloading", "yes")
    report = sc.patch(mlp)
    assert not report.fused and report.skipped[""].startswith("cpu_offloading"), str(report)


def test_config_without_a_proven_field_is_refused(one_rank):
    mlp = _dense(_config(1))

    class Renamed:  # a release whose config renamed delay_wgrad_compute
        def __init__(self, config):
            self._config = config

        def __getattr__(self, name):
            if name == "delay_wgrad_compute":
                raise AttributeError(name)
            return getattr(self._config, name)

    mlp.config = Renamed(mlp.config)
    report = sc.patch(mlp)
    assert not report.fused and "its config has no delay_wgrad_compute" in report.skipped[""], str(report)


def _expert_config(**overrides):
    return _config(1, num_moe_experts=2, moe_ffn_hidden_size=32, moe_router_topk=2,
                   moe_token_dispatcher_type="allgather", **overrides)


@pytest.mark.parametrize("way", ["forward", "version"])
def test_sequential_mlp_experts_refused(one_rank, monkeypatch, way):
    """SequentialMLP's experts are megatron MLPs: a changed MLP.forward or
    another version leaves each of them as is, and the layer computes
    megatron's own math."""
    experts, ref = _twins(_experts, _expert_config())
    assert sc.patch(experts).fused  # the proven release: every expert fused
    experts, ref = _twins(_experts, _expert_config())
    if way == "forward":
        original = MLP.forward

        def scaled(self, hidden_states, *args, **kwargs):
            y, bias = original(self, hidden_states, *args, **kwargs)
            return 2.0 * y, bias

        monkeypatch.setattr(MLP, "forward", scaled)
    else:
        monkeypatch.setattr(scm, "megatron_version", lambda: "0.17.0")
    report = sc.patch(experts)
    paths = [p for p, m in experts.named_modules() if isinstance(m, MLP)]
    assert paths and not report.fused and sorted(report.skipped) == sorted(paths), str(report)
    assert all(type(experts.get_submodule(p)) is MLP for p in paths)
    x = torch.randn(10, D, generator=torch.Generator().manual_seed(4))
    tokens, probs = torch.tensor([6, 4]), torch.rand(10, generator=torch.Generator().manual_seed(5)) + 0.5
    assert torch.equal(_out(experts, x, tokens, probs), _out(ref, x, tokens, probs))
