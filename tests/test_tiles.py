"""Row tiles (dense/tiled_passes.py, ``tile_rows=``): the whole feed-forward a tile
of rows at a time inside SwiGLUFunction. Parity with the untiled op and an
fp64 reference, what is saved and allocated (exact, tools/live_bytes.py),
and every mode the untiled op has: no_grad, checkpoint (both), autocast,
torch.compile, torch.func, a second backward, FSDP2."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import swiglu_cupy as sc
from conftest import UNIT_ROUNDOFF, assert_compiled_matches_eager, assert_nontrivial, rel_rms
from swiglu_cupy import _tile_size as tile_size
from swiglu_cupy.tools.live_bytes import LiveBytes

D, H, O = 24, 40, 16
M, TILE = 203, 32           # 7 tiles, the last one short


def _weights(dtype=torch.float64, bias=True, packed=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: (torch.randn(*s, generator=g, dtype=torch.float64) * 0.5).to(dtype).requires_grad_()  # noqa: E731
    if packed:
        return [r(2 * H, D), r(2 * H) if bias else None, r(O, H), r(O) if bias else None]
    return [r(H, D), r(H) if bias else None, r(H, D), r(H) if bias else None, r(O, H), r(O) if bias else None]


def _x(dtype=torch.float64, shape=(M, D), seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_()


def _run(fn, x, weights, dy=None, **kw):
    """y and every gradient (x first) of ``fn(x, *weights, **kw)`` against ``dy``."""
    leaves = [x] + [w for w in weights if w is not None]
    for t in leaves:
        t.grad = None
    y = fn(x, *weights, **kw)
    if dy is None:
        dy = torch.linspace(-1, 1, y.numel(), dtype=torch.float64).view_as(y).to(y.dtype)
    y.backward(dy)
    return [y.detach()] + [t.grad.clone() for t in leaves]


def _sum_bound(x, weights, dy, dtype):
    """Per-gradient error bounds between two implementations that both sum in
    fp32 (fp64 for float64) and round each result once: one storage ulp of the
    value plus 64 math ulps of the sum of |terms| (an abs-value recompute in fp64)."""
    d = lambda t: None if t is None else t.detach().double()  # noqa: E731
    w12, b12, w3, b3 = map(d, weights)
    xd = d(x)
    x12 = F.linear(xd, w12, b12)
    g, u = x12[:, :H], x12[:, H:]
    s = torch.sigmoid(g)
    h = F.silu(g) * u
    dh = dy.double() @ w3
    dx12 = torch.cat([dh * u * s * (1 + g * (1 - s)), dh * F.silu(g)], 1)
    a = torch.abs
    terms = [a(dx12) @ a(w12), a(dx12).t() @ a(xd), a(dx12).sum(0), a(dy.double()).t() @ a(h), a(dy.double()).sum(0)]
    exact = [dx12 @ w12, dx12.t() @ xd, dx12.sum(0), dy.double().t() @ h, dy.double().sum(0)]
    ulp, eps = 2 * UNIT_ROUNDOFF[dtype], 64 * UNIT_ROUNDOFF[torch.float64 if dtype == torch.float64 else torch.float32]
    return [a(e) * ulp + eps * t + torch.finfo(dtype).tiny for e, t in zip(exact, terms)]


def _row_blocks_exact(x, w12, b12, w3, b3, tile):
    """Whether this BLAS gives each tile's rows of both GEMMs the bits of the whole GEMM."""
    x12 = F.linear(x, w12, b12)
    h = F.silu(x12[:, :H]) * x12[:, H:]
    y = F.linear(h, w3, b3)
    return all(torch.equal(F.linear(x[r], w12, b12), x12[r]) and torch.equal(F.linear(h[r], w3, b3), y[r])
               for r in (slice(s, s + tile) for s in range(0, x.shape[0], tile)))


def _forward_bound(x, weights, dtype):
    """Per-element bound on y between two single-rounding implementations summing
    in another order: one storage ulp of y plus 64 math ulps of the terms of both
    GEMMs, the gate/up ones carried through the activation's slopes."""
    d = lambda t: None if t is None else t.detach().double()  # noqa: E731
    w12, b12, w3, b3 = map(d, weights)
    a = torch.abs
    x12 = F.linear(d(x), w12, b12)
    x12_terms = F.linear(a(d(x)), a(w12), None if b12 is None else a(b12))
    g, u = x12[:, :H], x12[:, H:]
    h = F.silu(g) * u
    eps = 64 * UNIT_ROUNDOFF[torch.float64 if dtype == torch.float64 else torch.float32]
    h_err = eps * (x12_terms[:, :H] * 1.1 * a(u) + x12_terms[:, H:] * a(g)) + eps * a(h)
    y_terms = F.linear(a(h), a(w3), None if b3 is None else a(b3))
    y = F.linear(h, w3, b3)
    return 2 * UNIT_ROUNDOFF[dtype] * a(y) + eps * y_terms + h_err @ a(w3).t() + torch.finfo(dtype).tiny


# ---- choosing the tile ----------------------------------------------------------------------

def test_resolve_tile_rows():
    assert tile_size.resolve_tile_rows(None, 10**6, 14336, torch.bfloat16) == 0
    assert tile_size.resolve_tile_rows(64, 64, 8, torch.float32) == 0        # fits in one tile: untiled
    assert tile_size.resolve_tile_rows(64, 65, 8, torch.float32) == 64
    # auto: the largest multiple of 256 rows whose [tile, 2H] workspace fits in 256 MiB
    auto = tile_size.resolve_tile_rows("auto", 10**6, 14336, torch.bfloat16)
    assert auto == 4608 and auto * 2 * 14336 * 2 <= tile_size.AUTO_TILE_BYTES < (auto + 256) * 2 * 14336 * 2
    assert tile_size.resolve_tile_rows("auto", 10**6, 1408, torch.float32) == 23808
    assert tile_size.resolve_tile_rows("auto", 10**7, 10**6, torch.float32) == 256   # never below 256 rows
    assert tile_size.resolve_tile_rows("auto", 4608, 14336, torch.bfloat16) == 0   # one tile: untiled


@pytest.mark.parametrize("bad, error", [(0, ValueError), (-3, ValueError), (True, TypeError), (2.5, TypeError),
                                        ("big", TypeError), ([4], TypeError)])
def test_bad_tile_rows_is_refused_by_name(bad, error):
    x, (w12, b12, w3, b3) = _x(), _weights()
    with pytest.raises(error, match="tile_rows"):
        sc.swiglu(x, w12, b12, w3, b3, tile_rows=bad)
    with pytest.raises(error, match="tile_rows"):
        sc.SwiGLU(D, H, tile_rows=bad)
    with pytest.raises(error, match="tile_rows"):
        sc.patch(torch.nn.Linear(2, 2), tile_rows=bad)
    with pytest.raises(TypeError, match="tile_grads_fp32"):
        sc.swiglu(x, w12, b12, w3, b3, tile_rows=8, tile_grads_fp32=1)


# ---- parity ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("bias", [True, False])
def test_tiled_equals_untiled_and_the_fp64_bound(dtype, bias):
    x, weights = _x(dtype), _weights(dtype, bias)
    dy = torch.randn(M, O, dtype=torch.float64, generator=torch.Generator().manual_seed(2)).to(dtype)
    base = _run(sc.swiglu, x, weights, dy)
    tiled = _run(sc.swiglu, x, weights, dy, tile_rows=TILE)
    # The forward: each row's y comes from that row's GEMMs alone, so the tiles give the
    # untiled bits wherever this BLAS gives a row block the bits of the whole GEMM.
    if _row_blocks_exact(x.detach(), *(w.detach() if w is not None else None for w in weights), TILE):
        assert torch.equal(tiled[0], base[0])
    else:
        err = (tiled[0].double() - base[0].double()).abs()
        assert (err <= _forward_bound(x, weights, dtype)).all()
    # Gradients: dx rows as the forward; the weight sums are re-associated across tiles.
    bounds = _sum_bound(x, weights, dy, dtype)
    kept = [0, 1, 2, 3, 4] if bias else [0, 1, 3]   # x, w12, b12, w3, b3: the gradients there are
    names = [["x", "w12", "b12", "w3", "b3"][i] for i in kept]
    for name, bound, g, r in zip(names, [bounds[i] for i in kept], tiled[1:], base[1:]):
        assert_nontrivial(g, name)
        err = (g.double() - r.double()).abs()
        assert (err <= bound).all(), f"{name}: max excess {(err - bound).max().item():.3g}"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_tiled_bf16_grads_accumulate_in_fp32_within_one_rounding(device):
    """bf16 with 32 tiles: every weight and bias gradient within one bf16
    rounding (plus fp32 accumulation) of the untiled op's, which rounds its
    fp32 sum once; accumulating in bf16 (``tile_grads_fp32=False``) rounds once
    per tile and leaves that bound (the contrast). On CUDA the fp32 shares come
    from cuBLAS's fp32-output GEMM (gemm._mm_fp32), on the CPU from widened operands."""
    rows = 1024
    x, weights = _x(torch.bfloat16, (rows, D)), _weights(torch.bfloat16)
    dy = torch.randn(rows, O, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    bounds = _sum_bound(x, weights, dy, torch.bfloat16)[1:]   # w12, b12, w3, b3 (computed on the CPU)
    x, dy = x.detach().to(device).requires_grad_(), dy.to(device)
    weights = [w.detach().to(device).requires_grad_() for w in weights]

    def excess(grads, reference):
        return max(((g.double().cpu() - r.double().cpu()).abs() - b).max().item()
                   for g, r, b in zip(grads[2:], reference[2:], bounds))

    untiled = _run(sc.swiglu, x, weights, dy)
    fp32 = _run(sc.swiglu, x, weights, dy, tile_rows=32)
    bf16 = _run(sc.swiglu, x, weights, dy, tile_rows=32, tile_grads_fp32=False)
    assert excess(fp32, untiled) <= 0
    assert excess(bf16, untiled) > 0   # the contrast: per-tile rounding is visible
    for g in fp32[1:]:
        assert_nontrivial(g, "grad")
        assert g.dtype == torch.bfloat16


@pytest.mark.parametrize("activation", ["gelu_tanh", sc.GPT_OSS, sc.GLUActivation("silu", limit=0.7)])
def test_tiled_glu_variants_and_unpacked_weights(activation):
    x = _x(torch.float64, (3, 71, D))   # 3-D input, 213 rows
    packed = _weights()
    base = _run(sc.swiglu, x, packed, activation=activation)
    tiled = _run(sc.swiglu, x, packed, activation=activation, tile_rows=50)
    for a, b in zip(tiled, base):
        assert_nontrivial(a, "output or grad")
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    if isinstance(activation, sc.GLUActivation) and activation.interleaved:
        return  # separate weights take the halves layout only
    unpacked = _weights(packed=False)
    base = _run(sc.swiglu_unpacked, x, unpacked, activation=activation)
    tiled = _run(sc.swiglu_unpacked, x, unpacked, activation=activation, tile_rows=50)
    assert tiled[0].shape == (3, 71, O)
    for a, b in zip(tiled, base):
        assert_nontrivial(a, "output or grad")
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_tiled_matches_under_saved_x12_fp8_and_saves_the_8bit_rows():
    """With saved_x12='fp8' the tiles save their 8-bit x12 rows (one [M, R]
    tensor) and backward reads them. x and the weights are small multiples of
    powers of two, so x12 is exact in any summation order: the saved bytes must
    equal the untiled op's (an e4m3 rounding flip would otherwise hide a bug)."""
    from swiglu_cupy.primitives.saved_x12 import saved_row_bytes

    g = torch.Generator().manual_seed(4)
    grid = lambda *s, scale: (torch.randint(-4, 5, s, generator=g) * scale).float().requires_grad_()  # noqa: E731
    x = grid(M, D, scale=0.25)
    weights = [grid(2 * H, D, scale=0.125), grid(2 * H, scale=0.5), grid(O, H, scale=0.125), grid(O, scale=0.5)]

    def saved_bytes(**kw):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            sc.swiglu(x, *weights, saved_x12="fp8", **kw)
        return [t for t in saved if t.dtype == torch.uint8]

    tiled_saved = saved_bytes(tile_rows=TILE)
    assert [tuple(t.shape) for t in tiled_saved] == [(M, saved_row_bytes(H, False))]
    assert torch.equal(tiled_saved[0], saved_bytes()[0])
    base = _run(sc.swiglu, x, weights, saved_x12="fp8")
    tiled = _run(sc.swiglu, x, weights, saved_x12="fp8", tile_rows=TILE)
    for a, b in zip(tiled, base):
        assert_nontrivial(a, "output or grad")
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())


# ---- what is saved and allocated ------------------------------------------------------------

def test_tiled_saves_only_x_and_the_weights():
    x, weights = _x(torch.float32), _weights(torch.float32)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        sc.swiglu(x, *weights, tile_rows=TILE)
    params = {w.data_ptr() for w in weights}
    activations = [t for t in saved if t.numel() and t.data_ptr() not in params]
    assert [tuple(t.shape) for t in activations] == [(M, D)]


def _live_call(fn, x, dy):
    with LiveBytes() as live:
        y = fn(x)
        y.backward(dy)
    return live, y


def test_tiles_bound_every_allocation_and_the_peak():
    """At M rows no transient is larger than a tile's x12 workspace, and what
    is left alive is exactly y, dx and the weight gradients; untiled, x12 of
    all rows exists."""
    rows, tile = 2048, 256
    model = sc.SwiGLU(D, H)
    x, dy = torch.randn(rows, D, requires_grad=True), torch.randn(rows, D)
    grads_of = lambda: [x.grad] + [p.grad for p in model.parameters()]  # noqa: E731
    model.tile_rows = tile
    live, y = _live_call(model, x, dy)
    outputs = [y] + grads_of()
    assert live.largest(exclude=outputs).nbytes <= tile * 2 * H * 4
    assert live.live_bytes() == sum(t.untyped_storage().nbytes() for t in outputs)
    tiled_peak = live.peak_bytes(exclude=grads_of()[1:])
    model.tile_rows, x.grad = None, None
    model.zero_grad(set_to_none=True)
    model.recompute_gate_up = True
    live, y = _live_call(model, x, dy)
    assert live.largest(exclude=[y] + grads_of()).nbytes == rows * 2 * H * 4
    assert tiled_peak <= 0.35 * live.peak_bytes(exclude=grads_of()[1:])


def test_no_grad_tiles_bound_the_peak_too():
    rows, tile = 2048, 256
    model = sc.SwiGLU(D, H, tile_rows=tile)
    x = torch.randn(rows, D)
    with torch.no_grad(), LiveBytes() as live:
        y = model(x)
    assert live.largest(exclude=[y]).nbytes <= tile * 2 * H * 4
    model.tile_rows = None
    with torch.no_grad():
        assert torch.equal(model(x), y) or torch.allclose(model(x), y, rtol=1e-6, atol=1e-7)


# ---- the untiled op's modes, tiled ------------------------------------------------------------

def test_single_tile_takes_the_untiled_path_bit_for_bit():
    x, weights = _x(torch.float32, (TILE, D)), _weights(torch.float32)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        sc.swiglu(x, *weights, tile_rows=TILE)
    assert (TILE, 2 * H) in [tuple(t.shape) for t in saved]   # today's path saves x12
    for a, b in zip(_run(sc.swiglu, x, weights, tile_rows=TILE), _run(sc.swiglu, x, weights)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("inplace_backward", [False, True])
def test_a_second_backward_works_tiled(inplace_backward):
    """The tiled graph keeps no x12 to overwrite: retain_graph works, whatever inplace_backward says."""
    x, weights = _x(), _weights()
    y = sc.swiglu(x, *weights, tile_rows=TILE, inplace_backward=inplace_backward)
    y.sum().backward(retain_graph=True)
    first = x.grad.clone()
    y.sum().backward()
    torch.testing.assert_close(x.grad, 2 * first, rtol=1e-14, atol=0)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoint_of_a_tiled_block(use_reentrant):
    model = sc.SwiGLU(D, H, dtype=torch.float64, tile_rows=TILE)
    x = _x()
    plain = _run(lambda x: model(x), x, [])
    grads_plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    ckpt = _run(lambda x: checkpoint(model, x, use_reentrant=use_reentrant), x, [])
    for a, b in zip(ckpt + [p.grad for p in model.parameters()], plain + grads_plain):
        assert_nontrivial(b, "grad")
        assert torch.equal(a, b)


def test_autocast_tiled_matches_autocast_untiled():
    model = sc.SwiGLU(D, H)
    x = torch.randn(M, D, requires_grad=True)
    results = []
    for tile_rows in (None, TILE):
        model.tile_rows = tile_rows
        model.zero_grad(set_to_none=True)
        x.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = model(x)
        assert y.dtype == torch.bfloat16
        y.float().pow(2).sum().backward()
        results.append([y.float()] + [x.grad] + [p.grad for p in model.parameters()])
    for a, b in zip(*results):
        assert_nontrivial(a, "output or grad")
        assert a.dtype == b.dtype
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2 * b.float().abs().max().item())


def test_torch_compile_of_a_tiled_block_has_no_graph_break():
    torch._dynamo.reset()
    model = sc.SwiGLU(D, H, tile_rows=64)
    x = torch.randn(M, D, requires_grad=True)
    assert_compiled_matches_eager(model, x, tol=1e-5)


def test_torch_func_grad_and_vmap_of_a_tiled_call():
    x, (w12, b12, w3, b3) = _x(), _weights()
    f = lambda x, w: sc.swiglu(x, w, b12, w3, b3, tile_rows=TILE).pow(2).sum()  # noqa: E731
    g_func = torch.func.grad(f, argnums=(0, 1))(x.detach(), w12.detach())
    x.grad = w12.grad = None
    f(x, w12).backward()
    torch.testing.assert_close(g_func[0], x.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g_func[1], w12.grad, rtol=1e-12, atol=1e-12)
    xs = _x(shape=(2, M, D)).detach()
    batched = torch.func.vmap(lambda x: sc.swiglu(x, w12, b12, w3, b3, tile_rows=TILE))(xs)
    torch.testing.assert_close(batched, torch.stack([sc.swiglu(t, w12, b12, w3, b3) for t in xs]),
                               rtol=1e-12, atol=1e-12)


def test_patch_passes_tile_rows_to_the_fused_modules():
    pytest.importorskip("transformers", reason="needs transformers: pip install 'swiglu-cupy[hf]'")
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    mlp = LlamaMLP(LlamaConfig(hidden_size=D, intermediate_size=H, num_attention_heads=2, num_key_value_heads=2)).double()
    x = _x(shape=(M, D))
    expected = _run(mlp, x, [])
    report = sc.patch(mlp, tile_rows=TILE)
    assert "" in report.fused and mlp.tile_rows == TILE
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        mlp(x)
    assert all(t.shape[-1] != 2 * H or t.shape[0] != M for t in saved)   # no x12 saved: tiled
    for a, b in zip(_run(mlp, x, []), expected):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


# ---- FSDP2 ----------------------------------------------------------------------------------

def _tiled_stack(ckpt=None):
    """test_distributed's model (3 SwiGLU blocks), every block in tiles of 6 rows
    (each rank's 20 rows: 4 tiles, the last short)."""
    import test_distributed as td

    model = td.build_model(ckpt)
    for block in model.blocks:
        block.tile_rows = 6
    return model


def _case_fsdp2_tiled(rank, world):
    import test_distributed as td

    return td._case_fsdp2(rank, world, build=_tiled_stack)


def _case_ddp_tiled(rank, world):
    import test_distributed as td

    return td._case_ddp(rank, world, build=_tiled_stack)


@pytest.mark.parametrize("engine", ["fsdp2", "ddp"])
def test_fsdp2_and_ddp_with_tiles_match_the_untiled_single_process_run(engine, tmp_path, monkeypatch):
    """FSDP2 (per block + root) and DDP, non-reentrant checkpoint of every block,
    2 gloo ranks, every block tiled: losses and every full gradient of 2 steps
    equal one untiled process's (the tiles run inside the block's one forward,
    so FSDP2 all-gathers once per call)."""
    import test_distributed as td

    ref = td.reference_run()
    for result in td.launch(f"test_tiles:_case_{engine}_tiled", tmp_path, monkeypatch):
        td.assert_matches(result, ref)


# ---- against DeepSpeed's TiledMLP (the generic tiled wrapper) --------------------------------

def test_tiles_peak_at_most_deepspeed_tiled_mlp_with_as_many_tiles():
    """The real TiledMLP (deepspeed, the `test` extra) around the same MLP's eager
    forward, the same number of tiles: same results, and our peak is not above its."""
    pytest.importorskip("deepspeed.runtime.sequence_parallel.ulysses_sp")
    from swiglu_cupy.tools.bench.long_context import _calls, measure_memory

    rows, tile = 2048, 256
    torch.manual_seed(0)
    module = sc.SwiGLU(D, H)
    x, dy = torch.randn(rows, D, requires_grad=True), torch.randn(rows, D)
    calls = _calls(module, tile, rows)
    assert not isinstance(calls["deepspeed_tiled_mlp"], str), calls["deepspeed_tiled_mlp"]
    ours, theirs = (measure_memory(module, x, dy, calls[n]) for n in ("tiled", "deepspeed_tiled_mlp"))
    torch.testing.assert_close(ours["y"], theirs["y"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours["dx"], theirs["dx"], rtol=1e-5, atol=1e-6)
    assert ours["peak_bytes"] <= theirs["peak_bytes"]
    assert ours["largest_bytes"] <= tile * 2 * H * 4


def test_the_issue_goal_shape_memory():
    """Issue 32's goal, at its shape: S = 32768, D = 512, H = 1408, fp32, tiles of
    4096. No allocation beside the outputs above a tile's x12 (tile x 2H
    elements), a peak <= 0.35x recompute_gate_up's and <= TiledMLP's (as many
    tiles), and the peaks the per-token formula of docs/long-context.md gives."""
    pytest.importorskip("deepspeed.runtime.sequence_parallel.ulysses_sp")
    from swiglu_cupy.tools.bench.long_context import _calls, measure_memory

    S, D_, H_, tile = 32768, 512, 1408, 4096
    torch.manual_seed(0)
    module = sc.SwiGLU(D_, H_)
    x, dy = torch.randn(S, D_, requires_grad=True), torch.randn(S, D_)
    calls = _calls(module, tile, S)
    got = {n: measure_memory(module, x, dy, calls[n]) for n in ("tiled", "recompute_gate_up", "deepspeed_tiled_mlp")}
    assert got["tiled"]["largest_bytes"] <= tile * 2 * H_ * 4
    assert got["tiled"]["peak_bytes"] <= 0.35 * got["recompute_gate_up"]["peak_bytes"]
    assert got["tiled"]["peak_bytes"] <= got["deepspeed_tiled_mlp"]["peak_bytes"]
    assert got["recompute_gate_up"]["peak_bytes"] == S * (4 * H_ + 2 * D_) * 4
    small = 2 * H_ * 4 * 64   # small tensors beside: bias sums, a CPU-path row block
    assert 0 <= got["tiled"]["peak_bytes"] - (S * 2 * D_ + tile * 4 * H_) * 4 <= small
    torch.testing.assert_close(got["tiled"]["y"], got["recompute_gate_up"]["y"], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got["tiled"]["dx"], got["recompute_gate_up"]["dx"], rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
def test_tiles_bound_the_cuda_peak():
    """On the GPU (caching allocator): a tiled forward and backward of a long
    bf16 sequence peaks at most 0.35x the recompute_gate_up peak above what
    both hold anyway, and the tiled y and dx agree with the untiled op's."""
    rows, d, h, tile = 65536, 512, 1408, 4096
    model = sc.SwiGLU(d, h, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(rows, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(rows, d, device="cuda", dtype=torch.bfloat16)

    def peak_and_outputs(**settings):
        for name, value in settings.items():
            setattr(model, name, value)
        x.grad = None
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        y = model(x)
        y.backward(dy)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before, y.detach(), x.grad.clone()

    recompute_peak, y_ref, dx_ref = peak_and_outputs(recompute_gate_up=True, tile_rows=None)
    tiled_peak, y, dx = peak_and_outputs(recompute_gate_up=False, tile_rows=tile)
    assert tiled_peak <= 0.35 * recompute_peak, (tiled_peak, recompute_peak)
    assert rel_rms(y, y_ref) < 1e-2 and rel_rms(dx, dx_ref) < 1e-2
    assert_nontrivial(dx, "dx")
