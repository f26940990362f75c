"""The live-bytes tracker (tools/live_bytes.py): exact, deterministic, and it
catches a planted [S, H] tensor."""
import torch

import swiglu_cupy as sc
from swiglu_cupy.tools.live_bytes import LiveBytes


def test_counts_new_storages_exactly_and_follows_their_release():
    before = torch.randn(100)              # made before the mode: never counted
    with LiveBytes() as live:
        a = torch.empty(100)               # 400 bytes
        view = a[10:]                      # a view: no allocation
        b = a + 1                          # 400 bytes
        torch.add(a, 1, out=b)             # out=: no allocation
        b.mul_(2)                          # in place: no allocation
        c = before.double()                # 800 bytes
        del b
        d = torch.empty(50, dtype=torch.float16)   # 100 bytes, made after b was freed
        del c, d
    assert [(r.nbytes, r.freed) for r in live.allocations] == [(400, False), (400, True), (800, True), (100, True)]
    assert live.peak_bytes() == 1600
    assert live.live_bytes() == 400
    assert live.largest().nbytes == 800
    del a
    assert live.live_bytes() == 400        # the view keeps the storage
    del view
    assert live.live_bytes() == 0


def test_exclude_replays_the_timeline_without_the_named_storages():
    with LiveBytes() as live:
        kept = torch.empty(1000)           # 4000 bytes, alive at the end
        tmp = torch.empty(500)             # 2000 bytes, freed
        del tmp
    assert live.peak_bytes() == 6000
    assert live.peak_bytes(exclude=[kept]) == 2000
    assert live.largest(exclude=[kept]).nbytes == 2000


def test_follows_a_resize():
    with LiveBytes() as live:
        t = torch.empty(0)
        t.resize_(256)
    assert live.peak_bytes() == 1024 and live.live_bytes() == 1024


def _mlp_with_a_planted_buffer(x, w12, w3, plant):
    y = sc.swiglu(x, w12, None, w3, None, tile_rows=64)
    if plant:
        y = y + torch.zeros(x.shape[0], w3.shape[1]).sum() * 0   # an [S, H] tensor, freed at once
    return y


def test_catches_a_planted_tokens_by_hidden_tensor_and_is_deterministic():
    S, D, H = 512, 16, 96
    x, w12, w3 = torch.randn(S, D), torch.randn(2 * H, D), torch.randn(D, H)
    runs = []
    for plant in (False, True, True):
        with LiveBytes() as live:
            y = _mlp_with_a_planted_buffer(x, w12, w3, plant)
        runs.append(((live.largest(exclude=[y]).nbytes, live.largest(exclude=[y]).shape),
                     live.peak_bytes(exclude=[y]), [(r.op, r.shape, r.nbytes) for r in live.allocations]))
    clean, planted, again = runs
    assert clean[0] == (64 * 2 * H * 4, (64, 2 * H))      # a tile's x12 workspace is the largest
    assert planted[0] == (S * H * 4, (S, H))               # the plant is found, with its shape
    assert planted[1] >= S * H * 4 > clean[1]
    assert again == planted                                # the same figures every run
