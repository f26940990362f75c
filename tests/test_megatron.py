"""swiglu_cupy.patch on megatron-core's ``MLP`` (megatron-core 0.16.1), on the CPU.

Built with megatron's own code: ``parallel_state.initialize_model_parallel``
over 2 gloo ranks (tests/rank_launcher.py), a ``TransformerConfig`` with
``gated_linear_unit=True`` and ``use_cpu_initialization=True``, and the local
spec (``get_mlp_module_spec(use_te=False)``: ColumnParallelLinear fc1,
RowParallelLinear fc2). One launch runs every case at tensor-parallel size 1
and then 2: dense MLPs (silu/gelu, biases on and off, megatron's
``bias_activation_fusion`` on and off) and a ``SequentialMLP`` of 2 local
experts called as its token dispatcher calls it (permuted rows,
tokens_per_expert, probabilities as ``per_token_scale``). The full MoELayer
does not run on the CPU (its router moves its weight to
``torch.cuda.current_device()``, megatron/core/transformer/moe/router.py:90),
nor does ``GroupedMLP`` (it asserts the grouped_gemm CUDA package) nor
sequence parallelism (megatron/core/utils.py:631 allocates its all-gather
buffer on CUDA): see docs/distributed.md.

Each rank compares, against an unpatched MLP built from the same seed, the
output, the returned bias, the input gradient and every parameter gradient
(its own shards), and counts the fused op's calls.

Tolerance (fp32): each tensor within ``RTOL`` of its largest entry. Measured
on this CPU at most 3.8e-7 (outputs, returned biases, input and parameter
gradients; TP 1 and 2, EP 2): the fused op runs the same GEMMs and rounds
``act(gate) * up`` once; the experts scale the output rows by the
probabilities after fc2 instead of before (exact in real arithmetic, a
rounding apart). Measured against it, with the weights' ``INIT_STD``: the wrong
activation (gelu for its tanh form, either way) is 1e-4 to 6e-4, silu for gelu
0.15, a swapped gate/up 1.2.

CI: megatron-core==0.16.1 in tests/requirements/peers.txt (README command 1;
installed --no-deps: it needs only numpy and packaging besides torch).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

try:
    import megatron.core.parallel_state  # noqa: F401
    from megatron.core.activations import quick_gelu
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.experts import GroupedMLP
except ImportError as e:  # pragma: no cover - depends on the environment
    pytest.skip(f"megatron-core is not importable ({e}); CI installs it with: "
                "pip install --no-deps -r tests/requirements/peers.txt", allow_module_level=True)

import swiglu_cupy as sc
from rank_launcher import launch

RTOL = 2e-6
S, B, D, F_HIDDEN = 6, 2, 16, 32
E, T = 2, 10  # local experts, permuted rows
# Weights' init std: megatron's default 0.02 keeps the gate within ~0.1 of 0, where
# gelu and its tanh form differ by 1e-5 of the scale; at 0.5 they differ by 1e-4..6e-4.
INIT_STD = 0.5

# name -> TransformerConfig overrides
DENSE = {
    "silu_bias": dict(activation_func=F.silu, add_bias_linear=True, bias_activation_fusion=False),
    "silu_bias_fusion": dict(activation_func=F.silu, add_bias_linear=True, bias_activation_fusion=True),
    "silu_nobias": dict(activation_func=F.silu, add_bias_linear=False, bias_activation_fusion=False),
    "gelu_nobias": dict(activation_func=F.gelu, add_bias_linear=False, bias_activation_fusion=False),
    "gelu_bias_fusion": dict(activation_func=F.gelu, add_bias_linear=True, bias_activation_fusion=True),
    "relu": dict(activation_func=F.relu),
    # megatron's glu clamps (gate max, up both sides) and offsets up; the clamp is hit at this init
    "silu_clamp": dict(activation_func=F.silu, activation_func_clamp_value=1.5),
    "quick_gelu_clamp_offset": dict(activation_func=quick_gelu, activation_func_clamp_value=1.5,
                                    glu_linear_offset=1.0),
}
DENSE_ACTIVATION = {"silu_bias": "silu", "silu_bias_fusion": "silu", "silu_nobias": "silu",
                    "gelu_nobias": "gelu", "gelu_bias_fusion": "gelu_tanh", "relu": "relu",
                    "silu_clamp": "silu, limit=1.5",
                    "quick_gelu_clamp_offset": "oai, alpha=1.702, up_offset=1, limit=1.5"}
# name -> (overrides, the (TP, EP) sizes it runs at). Megatron takes biased
# experts only at expert-TP 1 (transformer_config.py:1590), and at EP 1 too its
# own MLP raises (mlp.py:247 adds the scaled bias in place to the output of
# _ReduceFromModelParallelRegion, which on one rank returns its input as is:
# "a view and is being modified inplace"): their reference runs at EP 2.
EXPERTS = {
    "silu": (dict(activation_func=F.silu, add_bias_linear=False), ((1, 1), (2, 1))),
    "silu_fusion": (dict(activation_func=F.silu, add_bias_linear=False, bias_activation_fusion=True),
                    ((1, 1), (2, 1))),
    "silu_bias": (dict(activation_func=F.silu, add_bias_linear=True), ((1, 2),)),  # biases scaled by the probs
}
EXPERT_CASES = [(name, tp, ep) for name, (_, sizes) in EXPERTS.items() for tp, ep in sizes]
# refused configs -> the start of the report's reason
REFUSED = {
    "not_gated": (dict(gated_linear_unit=False), "gated_linear_unit=False"),
    "unknown_activation": (dict(activation_func=torch.tanh), "activation_func=tanh has no swiglu_cupy form"),
    "offset": (dict(glu_linear_offset=1.0), "glu_linear_offset=1 with silu"),
}
REFUSED_TP2 = {"sequence_parallel": (dict(sequence_parallel=True), "sequence_parallel: not reproduced")}


def _config(tp: int, **overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(num_layers=1, hidden_size=D, ffn_hidden_size=F_HIDDEN, num_attention_heads=2,
              gated_linear_unit=True, activation_func=F.silu, add_bias_linear=True,
              bias_activation_fusion=False, use_cpu_initialization=True, params_dtype=torch.float32,
              init_method_std=INIT_STD,
              tensor_model_parallel_size=tp)
    kw.update(overrides)
    return TransformerConfig(**kw)


def _dense(config):
    from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec
    from megatron.core.transformer.spec_utils import build_module

    return build_module(get_mlp_module_spec(use_te=False), config=config, ffn_hidden_size=F_HIDDEN)


def _experts(config):
    from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.spec_utils import build_module

    spec = get_mlp_module_spec(use_te=False, num_experts=E, moe_grouped_gemm=False).submodules.experts
    return build_module(spec, E, config=config, pg_collection=get_default_pg_collection())


def _twins(build, config):
    """Two modules with the same weights: megatron's CPU init draws the full
    master weight from torch's generator, then keeps this rank's shard."""
    torch.manual_seed(0)
    ref = build(config)
    torch.manual_seed(0)
    mod = build(config)
    return mod, ref


def _rel(actual, expected) -> float:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype == torch.float32
    scale = expected.abs().max().item()
    return (actual - expected).abs().max().item() / max(scale, 1e-30)


def _step(module, args, x, g):
    """Output (+ returned bias), input gradient and parameter gradients of ``(out * g).sum()``."""
    x = x.clone().requires_grad_(True)
    out, bias = module(x, *args)
    fc2_biases = [m.linear_fc2.bias for m in module.modules() if isinstance(m, MLP)]
    returned_is_fc2_bias = bias is not None and any(bias is b for b in fc2_biases)
    full = out if bias is None else out + bias
    (full * g).sum().backward()
    return full.detach(), x.grad, {n: p.grad for n, p in module.named_parameters()}, bias is None, \
        returned_is_fc2_bias


def _parity(module, ref, args, x):
    """Errors of module vs ref (relative to each tensor's scale), and what each returned."""
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(7))
    mine, theirs = _step(module, args, x, g), _step(ref, args, x, g)
    errors = {"output": _rel(mine[0], theirs[0]), "x.grad": _rel(mine[1], theirs[1])}
    assert list(mine[2]) == list(theirs[2])  # the same parameters, under the same names
    for name, ref_grad in theirs[2].items():
        assert mine[2][name] is not None and ref_grad is not None, name
        errors[name] = _rel(mine[2][name], ref_grad)
    return errors, mine[3:], theirs[3:]


def _counted(fn, calls):
    def counting(x, *args, **kwargs):
        calls.append(x.shape[:-1].numel())
        return fn(x, *args, **kwargs)
    return counting


def _run_ranks(case, rank, world):
    from megatron.core import parallel_state as ps
    from swiglu_cupy.integrations import megatron as scm

    calls: list[int] = []
    scm.swiglu = _counted(scm.swiglu, calls)  # this rank process only
    out = {}
    for tp, ep in ((1, 1), (2, 1), (1, 2)):
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
        if ep == 1:
            _dense_cases(tp, calls, out)
        _expert_cases(tp, ep, calls, out)
        ps.destroy_model_parallel()
    return out


def _dense_cases(tp, calls, out):
    x = torch.randn(S, B, D, generator=torch.Generator().manual_seed(3))
    for name, overrides in DENSE.items():
        mlp, ref = _twins(_dense, _config(tp, **overrides))
        report = sc.patch(mlp)
        calls.clear()
        errors, mine, theirs = _parity(mlp, ref, (), x)
        out["dense", name, tp] = dict(errors=errors, calls=list(calls), fused=dict(report.fused),
                                      skipped=dict(report.skipped), mine=mine, theirs=theirs,
                                      activation=str(mlp._swiglu_cupy_activation),
                                      repatch=str(sc.patch(mlp).fused.get("", "")))
    # a hook put on fc1 after patching (megatron DDP's param-gather pre-hooks): megatron's forward runs
    mlp, ref = _twins(_dense, _config(tp, **DENSE["silu_bias"]))
    sc.patch(mlp)
    fired = []
    mlp.linear_fc1.register_forward_pre_hook(lambda m, args: fired.append(1))
    calls.clear()
    errors, _, _ = _parity(mlp, ref, (), x)
    out["hooked", tp] = dict(errors=errors, calls=list(calls), fired=len(fired))
    refused = {**REFUSED, **(REFUSED_TP2 if tp == 2 else {})}
    for name, (overrides, _) in refused.items():
        mlp = _dense(_config(tp, **overrides))
        report = sc.patch(mlp)
        out["refused", name, tp] = dict(fused=dict(report.fused), skipped=dict(report.skipped),
                                        cls=type(mlp) is MLP)


def _expert_cases(tp, ep, calls, out):
    xe = torch.randn(T, D, generator=torch.Generator().manual_seed(4))
    tokens = torch.tensor([6, 4])
    probs = torch.rand(T, generator=torch.Generator().manual_seed(5)) + 0.5
    for name, (overrides, sizes) in EXPERTS.items():
        if (tp, ep) not in sizes:
            continue
        config = _config(tp, num_moe_experts=E * ep, moe_ffn_hidden_size=F_HIDDEN, moe_router_topk=2,
                         moe_token_dispatcher_type="allgather", expert_model_parallel_size=ep, **overrides)
        experts, ref = _twins(_experts, config)
        report = sc.patch(experts)
        calls.clear()
        errors, mine, theirs = _parity(experts, ref, (tokens, probs), xe)
        out["experts", name, tp, ep] = dict(errors=errors, calls=list(calls), fused=dict(report.fused),
                                            skipped=dict(report.skipped), mine=mine, theirs=theirs)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    try:
        return launch(_run_ranks, "all", tmp_path_factory.mktemp("megatron"), mp, world=2, timeout=180)
    finally:
        mp.undo()


def _assert_parity(entry, what):
    bad = {k: v for k, v in entry["errors"].items() if not v <= RTOL}
    assert not bad, f"{what}: errors above {RTOL} of scale: {bad}"


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", sorted(DENSE))
def test_dense_mlp_is_fused_whole_with_parity(results, name, tp):
    for rank, res in enumerate(results):
        entry = res["dense", name, tp]
        assert list(entry["fused"]) == [""] and entry["skipped"] == {}, (rank, entry)
        assert entry["fused"][""].startswith(f"{DENSE_ACTIVATION[name]}: swiglu_cupy.swiglu")
        assert f"TP {tp}: megatron's copy-to / reduce-from" in entry["fused"][""]
        assert entry["activation"] == DENSE_ACTIVATION[name]
        assert entry["repatch"].endswith("(already fused)")
        assert entry["calls"] == [S * B], f"rank {rank}: the fused op ran {entry['calls']}"
        # (bias is None, the bias returned is fc2's own): megatron's contract, kept
        assert entry["mine"] == entry["theirs"], (rank, entry["mine"], entry["theirs"])
        _assert_parity(entry, f"rank {rank}, {name}, TP {tp}")


@pytest.mark.parametrize("name,tp,ep", EXPERT_CASES)
def test_sequential_mlp_experts_are_fused_with_parity(results, name, tp, ep):
    for rank, res in enumerate(results):
        entry = res["experts", name, tp, ep]
        assert sorted(entry["fused"]) == [f"local_experts.{i}" for i in range(E)], (rank, entry)
        assert entry["skipped"] == {}
        comm = "TP 1" if tp == ep == 1 else "no TP collectives"  # under TP or EP: the dispatcher communicates
        assert all(comm in v for v in entry["fused"].values()), entry["fused"]
        assert entry["calls"] == [6, 4], f"rank {rank}: the fused op ran {entry['calls']}"
        assert entry["mine"] == entry["theirs"] == (True, False)  # biases added scaled, inside
        _assert_parity(entry, f"rank {rank}, experts {name}, TP {tp}, EP {ep}")


@pytest.mark.parametrize("tp", [1, 2])
def test_a_hook_added_on_a_linear_after_patching_runs_megatrons_forward(results, tp):
    for res in results:
        entry = res["hooked", tp]
        assert entry["calls"] == [] and entry["fired"] == 1, entry
        assert max(entry["errors"].values()) == 0.0  # the very same forward


@pytest.mark.parametrize("tp", [1, 2])
def test_refused_configs_are_reported_with_their_reason(results, tp):
    refused = {**REFUSED, **(REFUSED_TP2 if tp == 2 else {})}
    for res in results:
        for name, (_, reason) in refused.items():
            entry = res["refused", name, tp]
            assert entry["fused"] == {} and entry["cls"], (name, entry)
            assert entry["skipped"][""].startswith(reason), (name, entry["skipped"])


def test_grouped_mlp_is_named_with_its_reason():
    # GroupedMLP.__init__ asserts the grouped_gemm CUDA package (experts.py:81),
    # so on the CPU only an unbuilt instance can stand for it: the walk looks
    # at its class alone.
    grouped = GroupedMLP.__new__(GroupedMLP)
    nn.Module.__init__(grouped)
    report = sc.patch(nn.ModuleDict({"experts": grouped}))
    assert list(report.skipped) == ["experts"] and report.fused == {}, str(report)
    assert "grouped_gemm CUDA package" in report.skipped["experts"]
    assert report.classes["experts"] == "GroupedMLP"


def test_compat_seam_exists():
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from swiglu_cupy.integrations.megatron import megatron_linear_impl

    assert megatron_linear_impl(ColumnParallelLinear) is not None
    assert megatron_linear_impl(RowParallelLinear) is not None



def test_patch_does_not_import_megatron():
    """A model without megatron: the walk's megatron checks import nothing."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys, torch, swiglu_cupy as sc\n"
            "m = torch.nn.Sequential(torch.nn.Linear(4, 4))\n"
            "sc.patch(m)\n"
            "assert not [n for n in sys.modules if n.startswith('megatron')], 'megatron imported'\n")
    repo = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=repo, timeout=120,
                   env={**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"})
