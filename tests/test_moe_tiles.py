"""Row tiles of the experts (``tile_rows=`` on moe.routed_experts,
moe.grouped_experts and the Hugging Face experts): the tiled routing
(routing.sort_by_expert_in_tiles), parity with the untiled op on every way
in (tokens, rows, post-expert rows, expert-parallel sentinels, 8-bit x12),
the tiles' gradient accumulation, what is allocated (tools/live_bytes.py),
checkpoint and torch.compile."""
import pytest
import torch
from torch.utils.checkpoint import checkpoint

import swiglu_cupy as sc
import swiglu_cupy.moe as moe
from conftest import assert_compiled_matches_eager, assert_nontrivial, rel_rms
from swiglu_cupy.activations import GPT_OSS, SILU
from swiglu_cupy.moe import grouped, routing
from swiglu_cupy.tools.live_bytes import LiveBytes
from test_moe import TinyMoE, make, routing_weights

TILE = 16


def _leaves(inputs):
    x, logits, _, *weights = inputs
    return [t for t in (x, logits, *weights) if t is not None]


def _run(inputs, fn, **kw):
    """(y, every gradient) of routed_experts-like ``fn`` under a fixed dy; the
    routing weights are sigmoids of the chosen logits (a gradient for any K)."""
    x, logits, ids, w12, w3, b12, b3 = inputs
    y = fn(x, ids, logits.gather(1, ids).sigmoid(), w12, w3, b12, b3, **kw)
    dy = torch.linspace(-1, 1, y.numel(), dtype=torch.float64).view_as(y).to(y.dtype)
    return [y.detach(), *torch.autograd.grad(y, _leaves(inputs), dy)]


def _assert_all_close(got, expected, rtol):
    for i, (a, b) in enumerate(zip(got, expected)):
        assert_nontrivial(a, f"output/grad {i}")
        assert a.dtype == b.dtype and a.shape == b.shape
        assert rel_rms(a, b) <= rtol, (i, rel_rms(a, b))


def test_sort_by_expert_in_tiles_groups_each_tile_by_expert():
    T, K, E, tile = 37, 3, 5, 8
    ids = torch.randint(0, E + 2, (T, K), generator=torch.Generator().manual_seed(0))   # ids 5, 6: sentinels
    perm, local, offsets = routing.sort_by_expert_in_tiles(ids, E, tile)
    assert offsets.shape == (5, E) and offsets.dtype == torch.int32
    flat = ids.reshape(-1)
    for i, start in enumerate(range(0, T, tile)):
        rows = slice(start * K, min(start + tile, T) * K)
        slots = perm[rows]
        assert torch.equal(slots.sort().values, torch.arange(start * K, min(start + tile, T) * K))
        assert torch.equal(local[rows], slots - start * K)
        tile_ids = flat[slots]
        counts = torch.bincount(tile_ids.clamp(max=E), minlength=E + 1)
        assert torch.equal(offsets[i], torch.cumsum(counts[:E], 0).int())
        assert (tile_ids[int(offsets[i, -1]):] >= E).all()            # the tile's sentinels last
        grouped_ids = tile_ids[:int(offsets[i, -1])]
        assert torch.equal(grouped_ids, grouped_ids.sort().values)   # grouped by expert, sentinels after


@pytest.mark.parametrize("spec, transposed, bias, K", [("silu", False, False, 2), ("gpt_oss", True, True, 3),
                                                       ("silu", False, True, 1)])
@pytest.mark.parametrize("recompute", [False, True])
def test_routed_tiles_match_untiled(spec, transposed, bias, K, recompute):
    spec = {"silu": SILU, "gpt_oss": GPT_OSS}[spec]
    inputs = make(T=75, K=K, dtype=torch.float64, transposed=transposed, bias=bias)   # 5 tiles, the last short
    kw = dict(activation=spec, transposed=transposed, recompute_gate_up=recompute)
    _assert_all_close(_run(inputs, moe.routed_experts, tile_rows=TILE, **kw),
                      _run(inputs, moe.routed_experts, **kw), 1e-13)


def test_grouped_rows_tiles_match_untiled_across_group_and_empty_expert_boundaries():
    E, D, I, S = 5, 32, 16, 90
    g = torch.Generator().manual_seed(3)
    x = torch.randn(S, D, generator=g, dtype=torch.float64).requires_grad_()
    w12 = (torch.randn(E, 2 * I, D, generator=g, dtype=torch.float64) / 4).requires_grad_()
    w3 = (torch.randn(E, D, I, generator=g, dtype=torch.float64) / 4).requires_grad_()
    b3 = torch.randn(E, D, generator=g, dtype=torch.float64).requires_grad_()
    rw = torch.rand(S, generator=g, dtype=torch.float64).requires_grad_()
    offsets = torch.tensor([25, 25, 61, 62, 90], dtype=torch.int32)   # an empty expert, a one-row group
    assert torch.equal(grouped.rows_tile_offsets(offsets, S, 20),
                       torch.tensor([[20] * 5, [5, 5, 20, 20, 20], [0, 0, 20, 20, 20], [0, 0, 1, 2, 20],
                                     [0, 0, 0, 0, 10]], dtype=torch.int32))

    def run(**kw):
        y = moe.grouped_experts(x, offsets, w12, w3, None, b3, routing_weights=rw, **kw)
        return [y.detach(), *torch.autograd.grad(y, (x, w12, w3, b3, rw), torch.cos(y.detach()))]

    _assert_all_close(run(tile_rows=20), run(), 1e-13)


def test_sentinels_and_the_post_expert_path_tiled():
    """Expert-parallel sentinel ids (tile-local tails) and a post-expert module
    (rows out, weights and sum after it) give the untiled results."""
    inputs = make(E=4, T=50, K=2, dtype=torch.float64, bias=True)
    x, logits, ids, w12, w3, b12, b3 = inputs
    ids = ids.clone()
    ids[::3, 1] = 4 + torch.arange(ids[::3].shape[0]) % 3   # sentinels 4, 5, 6
    norm = torch.nn.LayerNorm(x.shape[1], dtype=torch.float64)
    for post in (None, norm):
        def run(**kw):
            rw = routing_weights(logits, ids.clamp(max=3))
            y = routing.route_and_combine(x, ids, rw, w12, b12, w3, b3, SILU, False, False, True, post, **kw)
            return [y.detach(), *torch.autograd.grad(y, (x, logits, w12, w3, b12, b3), torch.sin(y.detach()))]
        _assert_all_close(run(tile_rows=TILE), run(), 1e-13)


def test_fp8_saved_x12_tiled_saves_the_8bit_rows_and_matches():
    inputs = make(T=64, dtype=torch.float32)
    saved = []
    x, logits, ids, w12, w3, b12, b3 = inputs
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        moe.routed_experts(x, ids, routing_weights(logits, ids), w12, w3, saved_x12="fp8", tile_rows=TILE)
    from swiglu_cupy.primitives.saved_x12 import saved_row_bytes
    assert [tuple(t.shape) for t in saved if t.dtype == torch.uint8] == [(64 * 2, saved_row_bytes(32, False))]
    # x12 is rounded to 8 bits per row and block: tiling changes no row's scales, only GEMM orders
    _assert_all_close(_run(inputs, moe.routed_experts, saved_x12="fp8", tile_rows=TILE),
                      _run(inputs, moe.routed_experts, saved_x12="fp8"), 2e-3)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_bf16_tiles_sum_weight_gradients_in_fp32(device):
    """bf16 over 16 tiles: the fp32 sum of the tiles' weight gradients is closer
    to the untiled op's than a bf16 sum (tile_grads_fp32=False). On CUDA the
    groups run torch's grouped_mm."""
    inputs = make(T=256, K=2, dtype=torch.bfloat16, device=device)
    base = _run(inputs, moe.routed_experts)
    fp32 = _run(inputs, moe.routed_experts, tile_rows=TILE)
    bf16 = _run(inputs, moe.routed_experts, tile_rows=TILE, tile_grads_fp32=False)
    w_index = [2, 3]   # w12, w3 among (y, dx, dlogits, dw12, dw3)
    for i in w_index:
        i += 1
        assert fp32[i].dtype == torch.bfloat16
        assert rel_rms(fp32[i], base[i]) < 0.5 * rel_rms(bf16[i], base[i]), i
        assert rel_rms(fp32[i], base[i]) < 4e-3


def test_tiles_bound_the_routed_intermediate_at_top8():
    """Top-8, T tokens in tiles of 128: no transient larger than tile x K x 2I
    elements (beside the outputs), and the peak far below the untiled op's."""
    E, D, I, T, K, tile = 16, 32, 48, 1024, 8, 128
    inputs = make(E=E, D=D, I=I, T=T, K=K)
    x, logits, ids, w12, w3, _, _ = inputs
    rw = routing_weights(logits, ids).detach().requires_grad_()
    dy = torch.randn(T, D)

    def measure(**kw):
        for t in (x, rw, w12, w3):
            t.grad = None
        with LiveBytes() as live:
            y = moe.routed_experts(x, ids, rw, w12, w3, **kw)
            y.backward(dy)
        outputs = [y, x.grad, rw.grad, w12.grad, w3.grad]
        return live.largest(exclude=outputs).nbytes, live.peak_bytes(exclude=[w12.grad, w3.grad])

    largest, peak = measure(tile_rows=tile)
    assert largest <= tile * K * 2 * I * 4
    untiled_largest, untiled_peak = measure(recompute_gate_up=True)
    assert untiled_largest >= T * K * 2 * I * 4
    assert peak <= 0.35 * untiled_peak


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoint_of_tiled_experts(use_reentrant):
    inputs = make(T=40, dtype=torch.float64)
    x, logits, ids, w12, w3, _, _ = inputs
    f = lambda x, logits, w12, w3: moe.routed_experts(x, ids, routing_weights(logits, ids), w12, w3,  # noqa: E731
                                                       tile_rows=TILE)
    leaves = (x, logits, w12, w3)

    def grads(y):
        for t in leaves:
            t.grad = None
        y.sum().backward()   # .backward, not autograd.grad: reentrant checkpoint takes only this
        return [t.grad.clone() for t in leaves]

    plain = grads(f(*leaves))
    ckpt = grads(checkpoint(f, *leaves, use_reentrant=use_reentrant))
    for a, b in zip(ckpt, plain):
        assert_nontrivial(b, "grad")
        assert torch.equal(a, b)


def test_torch_compile_of_tiled_experts_has_no_graph_break():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyMoE(spec=GPT_OSS, transposed=True, bias=True)
    forward = model.forward

    def tiled(x):
        top, ids = model.router(x).topk(model.K, dim=-1)
        return x + moe.routed_experts(x, ids, top.softmax(-1), model.w12, model.w3, model.b12, model.b3,
                                      activation=model.spec, transposed=True, tile_rows=8)
    model.forward = tiled
    try:
        assert_compiled_matches_eager(model, torch.randn(2, 9, 32, requires_grad=True), tol=1e-5)
    finally:
        model.forward = forward


def test_hf_experts_patched_with_tiles_match_untiled():
    pytest.importorskip("transformers")
    from swiglu_cupy.tools.bench.moe import tiny_model

    ids = torch.randint(2, 97, (2, 40), generator=torch.Generator().manual_seed(1))
    results = []
    for tile_rows in (None, 16):
        model = tiny_model("mixtral")
        report = sc.patch(model, tile_rows=tile_rows)
        assert report.experts >= 1
        out = model(ids, labels=ids)
        out.loss.backward()
        results.append([out.logits.detach()] + [p.grad for p in model.parameters() if p.grad is not None])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
