"""swiglu_cupy on torchtitan's real model classes (torchtitan 0.3.0).

Models are built with torchtitan's own code: its model registries
(``debugmodel`` flavors of llama3, qwen3, deepseek_v3 and qwen3's
``debugmodel_moe``), on the meta device, then ``to_empty`` + ``init_states``,
as its trainer does. Two changes to keep it a CPU test: the layer list is cut
to one or two blocks (deepseek_v3: its dense block and one MoE block), and the
inner attention is torchtitan's own ``ScaledDotProductAttention`` (causal), as
FlexAttention has no CPU backward; the model is called without attention
masks, which that backend requires.

CI: pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3 tyro docstring_parser triton
(torchtitan imports triton at package import, via minimal_async_ep; --no-deps
keeps the CPU torch).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import swiglu_cupy as sc

PIP_LINE = "pip install --no-deps -r tests/requirements/torchtitan.txt"  # README command 1
try:
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.feed_forward import FeedForward
    from torchtitan.models.common.moe import GroupedExperts
    from torchtitan.models.deepseek_v3 import model_registry as deepseek_v3_registry
    from torchtitan.models.llama3 import model_registry as llama3_registry
    from torchtitan.models.qwen3 import model_registry as qwen3_registry
except ImportError as e:  # pragma: no cover - depends on the environment
    pytest.skip(f"torchtitan is not importable ({e}); install it with: {PIP_LINE}", allow_module_level=True)

from swiglu_cupy.integrations import torchtitan as sctt  # noqa: E402

# name -> (registry, flavor, kept layers)
MODELS = {
    "llama3": (llama3_registry, "debugmodel", 2),
    "qwen3": (qwen3_registry, "debugmodel", 2),
    "deepseek_v3": (deepseek_v3_registry, "debugmodel", 2),  # layer 0 dense, layer 1 MoE
    "qwen3_moe": (qwen3_registry, "debugmodel_moe", 1),
}
MOE = {"deepseek_v3", "qwen3_moe"}
B, L = 2, 16


def model_config(name: str, converters=None):
    registry, flavor, n_layers = MODELS[name]
    cfg = registry(flavor, converters=converters).model
    cfg.layers = cfg.layers[:n_layers]
    if hasattr(cfg, "mtp_layers"):
        cfg.mtp_layers = []
    for layer in cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return cfg


def materialize(model, seed=0):
    """torchtitan's flow after a meta build: to_empty, then its own init."""
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_states(buffer_device=torch.device("cpu"))
    return model


def build(name: str, converters=None, seed=0):
    with torch.device("meta"):
        model = model_config(name, converters).build()
    model.verify_module_protocol()
    return materialize(model, seed)


def tokens(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.tok_embeddings.num_embeddings, (B, L), generator=g)


def run(model, toks):
    """Logits and every parameter gradient of a next-token loss."""
    model.zero_grad(set_to_none=True)
    logits = model(toks)
    if hasattr(logits, "full_tensor"):  # under TP: a DTensor sharded over the vocabulary
        logits = logits.full_tensor()
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), toks[:, 1:].flatten())
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return logits.detach(), grads


def rel(a: torch.Tensor, e: torch.Tensor) -> float:
    """max |a - e| / max |e|, in float64."""
    a, e = a.double(), e.double()
    return ((a - e).abs().max() / e.abs().max().clamp_min(1e-30)).item()


def _fp32_experts_forward(self, x_RD, num_tokens_per_expert_E):
    """Our own fp64 reference of a GroupedExperts (a loop over experts), the
    "same experts computed in full precision" the bf16 tolerance is sized by."""
    # Under EP the weights are DTensors: their local experts, as torchtitan's forward takes them.
    w1, w2, w3 = (getattr(w, "to_local", lambda: w)().double() for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
    x = x_RD.double()
    out, start = torch.zeros_like(x), 0
    for e, n in enumerate(num_tokens_per_expert_E.tolist()):
        rows = x[start:start + n]
        out[start:start + n] = (F.silu(rows @ w1[e].T) * (rows @ w3[e].T)) @ w2[e].T
        start += n
    return out.type_as(x_RD)


def full_precision_experts(model):
    ref = copy.deepcopy(model)
    for m in ref.modules():
        if type(m) is GroupedExperts:
            m.forward = _fp32_experts_forward.__get__(m)
    return ref


def assert_close(name, got, want, tol, ref=None, what=""):
    """got vs want within ``tol``, or, where ``ref`` (the full-precision
    experts' result) is given, within 3x the distance between want and ref."""
    err = rel(got, want)
    bound = tol if ref is None else max(tol, 3 * rel(want, ref))
    assert err <= bound, f"{what}{name}: rel error {err:.3g} > {bound:.3g}"
    return err


def compare(name, patched, unpatched, toks, ref_model=None):
    logits, grads = run(patched, toks)
    logits0, grads0 = run(unpatched, toks)
    ref = run(ref_model, toks) if ref_model is not None else (None, {})
    errs = {"logits": assert_close("logits", logits, logits0, 1e-5, ref[0], f"{name}: ")}
    assert set(grads) == set(grads0)
    for n in grads0:
        assert grads0[n].abs().max() > 0, f"{name}: {n}: trivial gradient"
        errs[n] = assert_close(n, grads[n], grads0[n], 1e-4, ref[1].get(n), f"{name}: ")
    return errs


def assert_report(name, model, report):
    n_ff = sum(type(m).__name__.endswith("FeedForward") for m in model.modules())
    n_ex = sum(isinstance(m, GroupedExperts) for m in model.modules())
    assert n_ff + n_ex > 0
    assert len(report.fused) == n_ff + n_ex, str(report)
    assert not report.partial and not report.skipped, str(report)
    from swiglu_cupy.integrations.fused import FusedGLUMLP

    for path, m in model.named_modules():
        if isinstance(m, (FeedForward, GroupedExperts)):
            assert isinstance(m, FusedGLUMLP) or type(m).__name__.startswith("SwiGLUCupy"), \
                f"{name}: {path} ({type(m).__name__}) not switched"


# ---- the tests --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(MODELS))
def test_patch_fuses_every_feed_forward_and_experts(name):
    model = build(name)
    reference = copy.deepcopy(model)
    ref_model = full_precision_experts(model) if name in MOE else None
    report = sc.patch(model)
    assert_report(name, model, report)
    assert report.already == []
    again = sc.patch(model)  # patching again changes nothing and says every module was fused before
    assert sorted(again.fused) == sorted(report.fused) == sorted(again.already), str(again)
    model.verify_module_protocol()
    assert list(model.state_dict()) == list(reference.state_dict())
    compare(name, model, reference, tokens(model), ref_model)


@pytest.mark.parametrize("ac", ["full", "selective"])
@pytest.mark.parametrize("name", ["llama3", "deepseek_v3"])
def test_patch_under_torchtitan_activation_checkpointing(name, ac):
    model = build(name)
    reference = copy.deepcopy(model)
    ref_model = full_precision_experts(model) if name in MOE else None
    assert_report(name, model, sc.patch(model))
    policy = (FullAC if ac == "full" else SelectiveAC).Config().build()
    for m in (model, reference) + ((ref_model,) if ref_model is not None else ()):
        policy.apply(m)
    assert "CheckpointWrapper" in type(model.layers["0"]).__name__
    compare(name, model, reference, tokens(model), ref_model)


@pytest.mark.parametrize("name", ["llama3", "deepseek_v3"])
def test_converter_builds_fused_modules(name):
    """torchtitan's ModelConfigConverter extension point: configs replaced
    before the (meta) build; init, protocol, state_dict and numerics kept."""
    converter = sctt.SwiGLUCupyConverter.Config()
    model = build(name, converters=[converter])
    reference = build(name)
    assert list(model.state_dict()) == list(reference.state_dict())
    for (n, p), (n0, p0) in zip(model.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(p, p0), f"{n}: torchtitan's init gave different values"
    kinds = {type(m).__name__ for m in model.modules() if isinstance(m, (FeedForward, GroupedExperts))}
    assert kinds and all(k.startswith("SwiGLUCupy") for k in kinds), kinds
    ref_model = full_precision_experts(reference) if name in MOE else None
    compare(name, model, reference, tokens(model), ref_model)
    # patch() on a converted model: reported as fused, nothing else touched
    report = sc.patch(model)
    assert not report.partial and not report.skipped, str(report)


@pytest.mark.parametrize("name", ["llama3", "deepseek_v3"])
@pytest.mark.parametrize("way", ["patch", "converter"])
def test_row_tiles_on_torchtitan_models_match_untiled(name, way):
    """tile_rows through patch() and through the converter's config: every
    FeedForward (B*L = 32 rows in tiles of 8) and GroupedExperts (its routed
    rows in tiles of 8) runs tiled, with the untiled fused model's logits and
    gradients (bf16 experts: within torchtitan's own bf16 distance)."""
    if way == "patch":
        tiled, untiled = build(name), build(name)
        assert_report(name, tiled, sc.patch(tiled, tile_rows=8))
        sc.patch(untiled)
    else:
        tiled = build(name, converters=[sctt.SwiGLUCupyConverter.Config(tile_rows=8)])
        untiled = build(name, converters=[sctt.SwiGLUCupyConverter.Config()])
    fused = [m for m in tiled.modules() if isinstance(m, (FeedForward, GroupedExperts))]
    assert fused and all(getattr(m, "tile_rows", None) == 8 or getattr(m, "_swiglu_cupy_tile_rows", None) == 8
                         for m in fused)
    toks = tokens(tiled)
    ref_model = full_precision_experts(build(name)) if name in MOE else None   # from the unpatched experts
    compare(name, tiled, untiled, toks, ref_model)


@pytest.mark.parametrize("name", ["llama3", "deepseek_v3"])
def test_patch_on_meta_then_materialize(name):
    """torchtitan's own flow: build on meta, patch there (the feed-forwards
    are switched undecided, the experts from their class), to_empty +
    init_states; the probe decides each feed-forward at its first forward."""
    with torch.device("meta"):
        model = model_config(name).build()
    report = sc.patch(model)
    n_ff = sum(isinstance(m, FeedForward) for m in model.modules())
    n_ex = sum(isinstance(m, GroupedExperts) for m in model.modules())
    assert len(report.pending) == n_ff and len(report.fused) == n_ex, str(report)
    assert not report.partial and not report.skipped, str(report)
    materialize(model)
    reference = build(name)
    compare(name, model, reference, tokens(model), full_precision_experts(reference) if name in MOE else None)
    assert_report(name, model, sc.patch(model))  # decided: every one fused, none pending
    assert all(m.fusion() == "mlp" for m in model.modules() if isinstance(m, FeedForward))


@pytest.mark.parametrize("name", ["deepseek_v3"])
def test_experts_patched_on_meta_then_materialized(name):
    """GroupedExperts are switched from their class (no probe): on meta too."""
    with torch.device("meta"):
        model = model_config(name).build()
    notes = [sctt.patch_torchtitan_class(m) for m in model.modules() if isinstance(m, GroupedExperts)]
    assert notes and all(notes)
    materialize(model)
    reference = build(name)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values()))
    compare(name, model, reference, tokens(model), full_precision_experts(reference))


FUSED_OVERRIDES = ["torchtitan.overrides.fused_swiglu.fused_swiglu",
                   "torchtitan.overrides.fused_swiglu.fused_grouped_experts"]


def _split_w13(grads):
    """Gradients of a model with torchtitan's fused w13 parameters, named as
    the stock model's (w13[:, 0] / w13[:, :, 0] is the gate w1, index 1 the up w3)."""
    out = {}
    for n, g in grads.items():
        if n.endswith(".w13") and g.dim() == 3:      # FusedSwiGLU: [F, 2, D]
            out[n[:-3] + "w1.weight"], out[n[:-3] + "w3.weight"] = g[:, 0], g[:, 1]
        elif n.endswith(".w13"):                     # FusedGroupedExperts: [E, F, 2, D]
            out[n[:-3] + "w1_EFD"], out[n[:-3] + "w3_EFD"] = g[:, :, 0], g[:, :, 1]
        else:
            out[n] = g
    return out


@pytest.mark.parametrize("name", ["llama3", "deepseek_v3"])
def test_fused_swiglu_overrides_patched(name):
    """torchtitan's own fused_swiglu overrides (FusedSwiGLU: one w13 [F, 2, D]
    gate/up parameter; FusedGroupedExperts: w13 [E, F, 2, D]), applied with
    its override mechanism, built on meta, patched there (decided from the
    class), then materialized with its init: every one fused, and the model
    matches the stock model holding the same weights (their state_dict hooks
    save w13 as w1/w3). Their own forwards are CUDA-only (Triton)."""
    from torchtitan.config.override import OverrideConfig, apply_overrides
    from torchtitan.overrides.fused_swiglu import FusedGroupedExperts, FusedSwiGLU

    cfg = model_config(name)
    assert apply_overrides(OverrideConfig(imports=FUSED_OVERRIDES), cfg)
    with torch.device("meta"):
        model = cfg.build()
    report = sc.patch(model)
    materialize(model)
    fused = [m for m in model.modules() if isinstance(m, (FusedSwiGLU, FusedGroupedExperts))]
    assert fused and len(report.fused) == len(fused), str(report)
    assert not report.partial and not report.skipped and not report.pending, str(report)
    assert all(type(m).__name__.startswith("SwiGLUCupy") for m in fused)
    model.verify_module_protocol()
    stock = build(name)
    stock.load_state_dict(model.state_dict())
    ref = run(full_precision_experts(stock), tokens(stock)) if name in MOE else (None, {})
    calls = _count_fused_calls()
    logits, grads = run(model, tokens(model))
    assert calls["swiglu"] > 0 and calls["glu_mul"] == 0 and (name not in MOE or calls["grouped_experts"]), calls
    assert calls["grouped_experts_unpacked"] == 0, calls  # w13: interleaved w12, a view
    logits0, grads0 = run(stock, tokens(stock))
    assert_close("logits", logits, logits0, 1e-5, ref[0], f"{name}: ")
    grads = _split_w13(grads)
    assert set(grads) == set(grads0)
    for n in grads0:
        assert grads0[n].abs().max() > 0, n
        assert_close(n, grads[n], grads0[n], 1e-4, ref[1].get(n), f"{name}: ")


def test_fused_swiglu_with_a_hooked_down_projection_runs_the_activation_only():
    """FusedSwiGLU whose w2 carries a hook: w13's GEMM and w2 run as
    themselves, only the activation here (glu_mul), and the hook still fires."""
    from torchtitan.models.common.linear import Linear
    from torchtitan.overrides.fused_swiglu import fused_swiglu

    lin = lambda i, o: Linear.Config(in_features=i, out_features=o, bias=False)  # noqa: E731
    stock = FeedForward.Config(w1=lin(32, 48), w2=lin(48, 32), w3=lin(32, 48)).build()
    module = fused_swiglu(FeedForward.Config(w1=lin(32, 48), w2=lin(48, 32), w3=lin(32, 48))).build()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / 6)
    stock.load_state_dict(module.state_dict())
    seen = []
    module.w2.register_forward_hook(lambda m, a, out: seen.append(out.shape))
    assert "fused" in str(sc.patch(module))
    calls = _count_fused_calls()
    x = torch.randn(3, 5, 32, generator=gen, dtype=torch.float64)
    module.double(), stock.double()
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    y, y0 = module(xs[0]), stock(xs[1])
    (y * y0.detach()).sum().backward()
    (y0 * y0.detach()).sum().backward()
    assert calls["glu_mul"] == 1 and calls["swiglu"] == 0 and seen == [(3, 5, 32)]
    torch.testing.assert_close(y, y0, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(xs[0].grad, xs[1].grad, rtol=1e-12, atol=1e-12)
    g13 = module.w13.grad
    torch.testing.assert_close(g13[:, 0], stock.w1.weight.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g13[:, 1], stock.w3.weight.grad, rtol=1e-12, atol=1e-12)


# ---- torch.compile ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["llama3", "deepseek_v3"])
def test_compiled_patched_block_fullgraph(name):
    """A patched torchtitan block (dense FFN; MoE with shared experts)
    compiles with fullgraph=True (no graph break) and matches eager torchtitan."""
    model = build(name)
    block = model.layers["1" if name in MOE else "0"]
    reference = copy.deepcopy(block)
    ref_fp = full_precision_experts(block) if name in MOE else None
    assert_report(name, block, sc.patch(block))
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    x = torch.randn(B, L, block.attention_norm.weight.shape[0], generator=torch.Generator().manual_seed(3))

    def go(b):
        xx = x.clone().requires_grad_(True)
        b.zero_grad(set_to_none=True)
        y = b(xx, None, None)
        y.square().sum().backward()
        grads = {n.replace("_orig_mod.", ""): p.grad.clone() for n, p in b.named_parameters()}
        return y.detach(), xx.grad, grads

    y, gx, g = go(compiled)
    y0, gx0, g0 = go(reference)
    ref = go(ref_fp) if ref_fp is not None else (None, None, {})
    assert_close("y", y, y0, 1e-5, ref[0], f"{name}: ")
    assert_close("x.grad", gx, gx0, 1e-4, ref[1], f"{name}: ")
    assert set(g) == set(g0)
    for n in g0:
        assert g0[n].abs().max() > 0, n
        assert_close(n, g[n], g0[n], 1e-4, ref[2].get(n), f"{name}: ")


# ---- torchtitan's own parallelize (FSDP2 + AC) on 2 gloo ranks -----------------------------------

def _cpu_parallel_dims(parallelism, world):
    """torchtitan's ParallelDims on the CPU: its device detection
    (tools.utils.get_device_info) falls back to "cuda" when no accelerator is
    present, so the mesh would be a CUDA mesh; point it at "cpu"."""
    import torchtitan.distributed.parallel_dims as pd

    pd.device_type = "cpu"
    dims = pd.ParallelDims.from_config(parallelism, world)
    assert dims.dp_shard * dims.tp == world and dims.fsdp_enabled == (dims.dp_shard > 1)
    return dims


def _sharding_configs(name, cfg, ep):
    """What torchtitan's Trainer does before the build (``update_from_config``):
    fill the model's sharding configs (experts Shard(0) over "ep" with EP, the
    all-to-all dispatcher's local_map; TP layouts on every Linear). Called
    directly: update_from_config imports torchtitan.trainer (torchdata,
    tensorboard, ...)."""
    if name == "llama3":
        from torchtitan.models.llama3.sharding import set_llama3_sharding_config
        set_llama3_sharding_config(cfg, enable_sp=False)
    elif name == "deepseek_v3":
        from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config
        set_deepseek_v3_sharding_config(cfg, enable_sp=False, enable_ep=ep > 1)
    else:
        from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config
        set_qwen3_sharding_config(cfg, enable_sp=False, enable_ep=ep > 1)


def _parallelized(name, patched, world, full_precision=False, ep=1, tp=1, backend="partial_dtensor"):
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.distributed.utils import set_spmd_backend

    registry, flavor, _ = MODELS[name]
    parallelize = registry(flavor).parallelize_fn
    # patched: torchtitan's own way in, the converter (decided from the config,
    # before the meta build and parallelize). patch() after parallelize cannot
    # probe FSDP-sharded (DTensor) parameters; patch() before it is on meta.
    converters = [sctt.SwiGLUCupyConverter.Config()] if patched else None
    # "partial_dtensor": DTensor for model-parallel axes only (FSDP on plain modules);
    # "spmd_types" (its default) parallelizes every module that has a sharding config.
    parallelism = ParallelismConfig(spmd_backend=backend, expert_parallel_degree=ep, tensor_parallel_degree=tp,
                                    data_parallel_shard_degree=world // tp)
    set_spmd_backend(parallelism.spmd_backend)
    cfg = model_config(name, converters)
    if ep > 1 or tp > 1 or backend != "partial_dtensor":
        _sharding_configs(name, cfg, ep)
    with torch.device("meta"):
        model = cfg.build()
    if full_precision:
        for m in model.modules():
            if type(m) is GroupedExperts:
                m.forward = _fp32_experts_forward.__get__(m)
    parallelize(model, parallel_dims=_cpu_parallel_dims(parallelism, world),
                training=TrainingConfig(mixed_precision_param="float32"), parallelism=parallelism,
                compile_config=CompileConfig(), ac_config=FullAC.Config(), dump_folder="")
    # Its apply_fsdp sets gradient_divide_factor=1.0 (its Trainer scales the
    # gradients), which torch reduces with PREMUL_SUM(1.0): gloo has no
    # PREMUL_SUM, so ask for the equal plain SUM.
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    materialize(model)
    kinds = {type(m).__name__ for m in model.modules() if isinstance(m, (FeedForward, GroupedExperts))}
    assert kinds and all(k.startswith("SwiGLUCupy") == patched for k in kinds), kinds
    return model


def _count_fused_calls():
    calls = {}
    for fn in ("swiglu_unpacked", "swiglu", "grouped_experts", "grouped_experts_unpacked", "glu_mul"):
        calls[fn] = 0
        original = getattr(sctt, fn)
        if hasattr(original, "_counted"):
            original = original._counted

        def counted(*a, _fn=fn, _original=original, **k):
            calls[_fn] += 1
            return _original(*a, **k)
        counted._counted = original
        setattr(sctt, fn, counted)
    return calls


def run_torchtitan_rank(case, rank, world):
    name, ep, tp = case
    out = {}
    for variant in ("torchtitan", "patched") + (("fp64 experts",) if name in MOE else ()):
        model = _parallelized(name, variant == "patched", world, full_precision=variant == "fp64 experts", ep=ep,
                              tp=tp)
        assert "CheckpointWrapper" in type(model.layers["0"]).__name__
        assert type(model).__name__.startswith("FSDP") or tp > 1
        for m in model.modules():
            if isinstance(m, GroupedExperts) and ep > 1:  # under EP each rank holds its share of the experts
                assert "ep" in m.w1_EFD.device_mesh.mesh_dim_names
                assert m.w1_EFD.to_local().shape[0] == m.w1_EFD.shape[0] // ep
        if variant == "patched":
            # Which Linear forward wrappers of torchtitan's parallelize are no-ops: none without
            # sharding configs (they are not wrapped), all three under EP alone, none under TP.
            for m in model.modules():
                if isinstance(m, FeedForward):
                    noop = set(m.__dict__.get("_swiglu_cupy_noop_forwards", {}))
                    assert noop == ({"w1", "w2", "w3"} if ep > 1 else set()), (ep, tp, noop)
        toks = tokens(model, seed=10 + (rank if tp == 1 else 0))  # TP ranks share one batch
        calls = _count_fused_calls()
        logits, grads = run(model, toks)
        if variant == "patched" and tp == 1:
            # The fused ops ran: FSDP hands plain unsharded weights to the forward, and the
            # forward wrappers torchtitan puts on each Linear under EP redistribute nothing.
            # GroupedExperts' separate w1_EFD/w3_EFD run the unpacked entry (no concatenated copy).
            assert calls["swiglu_unpacked"] > 0 and calls["grouped_experts"] == 0, calls
            assert (name in MOE) == (calls["grouped_experts_unpacked"] > 0), calls
            assert calls["glu_mul"] == 0, calls
        elif variant == "patched":
            # TP: the projections hold DTensor shards, so only the activation is ours,
            # on the local shards of torchtitan's column-parallel gate and up.
            assert calls["glu_mul"] > 0 and calls["swiglu_unpacked"] == 0, calls
        out[variant] = (logits, {n: (g.full_tensor() if hasattr(g, "full_tensor") else g) for n, g in grads.items()})
    return out


@pytest.mark.parametrize("name, ep, tp", [("llama3", 1, 1), ("deepseek_v3", 1, 1), ("deepseek_v3", 2, 1),
                                          ("llama3", 1, 2)], ids=["llama3", "deepseek_v3", "deepseek_v3-ep2",
                                                                  "llama3-tp2"])
def test_torchtitan_parallelize_two_gloo_ranks(name, ep, tp, tmp_path, monkeypatch):
    """torchtitan's own parallelize_fn on 2 gloo ranks with FullAC: FSDP2
    (each rank its own batch), FSDP2 + EP 2 (its all-to-all token dispatcher,
    each rank half the experts) and TP 2 (one batch), unpatched vs patched;
    gradients are the full tensors."""
    import rank_launcher

    results = rank_launcher.launch(run_torchtitan_rank, (name, ep, tp), tmp_path, monkeypatch, 2, 300)
    for rank, out in enumerate(results):
        (l0, g0), (l1, g1) = out["torchtitan"], out["patched"]
        lr, gr = out.get("fp64 experts", (None, {}))
        assert_close("logits", l1, l0, 1e-5, lr, f"rank {rank}: ")
        assert set(g0) == set(g1)
        for n in g0:
            assert g0[n].abs().max() > 0, n
            assert_close(n, g1[n], g0[n], 1e-4, gr.get(n), f"rank {rank}: ")


@pytest.mark.parametrize("name", ["llama3", "deepseek_v3"])
def test_patched_torchtitan_models_pickle_and_deepcopy_as_their_classes(name):
    """Switched torchtitan modules (experts) and the fused MLPs (FeedForward) come
    from the one switched-class mechanism: each pickles as its torchtitan class
    and loads switched, with its settings, and a deepcopy of the whole model
    (torchtitan's own init closures do not pickle) gives the same classes and
    numbers."""
    import pickle

    from swiglu_cupy.integrations import fused

    model = build(name)
    sc.patch(model, tile_rows=8)
    switched = {path: m for path, m in model.named_modules() if hasattr(type(m), "_swiglu_kind")}
    assert switched and all(type(m).__reduce_ex__ is fused._reduce_switched for m in switched.values())
    kinds = {type(m)._swiglu_kind for m in switched.values()}
    assert kinds == ({"glu_mlp", "torchtitan"} if name in MOE else {"glu_mlp"})
    settings = lambda m: (getattr(m, "tile_rows", None), getattr(m, "_swiglu_cupy_tile_rows", None))  # noqa: E731
    for kind in kinds:
        original = next(m for m in switched.values() if type(m)._swiglu_kind == kind)
        loaded = pickle.loads(pickle.dumps(original))
        assert type(loaded) is type(original) and settings(loaded) == settings(original) != (None, None)
        assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), original.state_dict().values()))
    toks = tokens(model)
    expected = run(model, toks)
    twin = copy.deepcopy(model)
    assert [type(m) for m in twin.modules()] == [type(m) for m in model.modules()]
    got = run(twin, toks)
    assert torch.equal(got[0], expected[0])
