"""The 8-bit saved x12 (``saved_x12="fp8"``): its format and its torch
implementation (the CPU path; the kernels in ``kernels_cu/swiglu_fp8.cu``
write and read the same bytes).

One uint8 tensor ``saved [M, R]`` per x12 [M, 2H], so that a Function saves
one tensor, as it saves x12 otherwise:

- columns ``[0, 2H)``: x12 as float8 e4m3fn, in x12's own layout (halves or
  interleaved);
- columns ``[pad4(2H), R)``: the float32 scales (``R = pad4(2H) + 4 * blocks``,
  every row and the scales 4-byte aligned).

Blocks: 128 consecutive columns of one row. Halves layout: each half is cut
into ``ceil(H / 128)`` blocks (gate blocks first, then up blocks), so a block
never mixes gate and up; interleaved: x12 itself is cut into ``ceil(2H / 128)``
blocks (64 gate/up pairs each).

Per block: ``amax`` = max |x| (fp32, NaN propagates), ``scale = amax / 448``
(fp32 division; 448 is e4m3fn's largest finite value, so nothing saturates),
``q = e4m3fn(x / scale)`` rounded to nearest even, and ``x' = float(q) *
scale`` is what backward reads. A block of zeros (``scale == 0``) saves q = 0.
A non-finite value gives its block a non-finite scale: that block reads back
non-finite, as its gradients would be anyway.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..activations import GLUActivation

__all__ = ["BLOCK", "FP8_MAX", "scale_blocks", "saved_row_bytes", "saved_views",
           "new_saved", "quantize_torch", "dequantize_torch"]

BLOCK = 128
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def scale_blocks(H: int, interleaved: bool) -> int:
    """Scales per row of an x12 [M, 2H]."""
    return -(-2 * H // BLOCK) if interleaved else 2 * -(-H // BLOCK)


def _scales_start(H: int) -> int:
    return -(-2 * H // 4) * 4


def saved_row_bytes(H: int, interleaved: bool) -> int:
    """R: bytes per row of the saved tensor (8-bit x12, then its scales)."""
    return _scales_start(H) + 4 * scale_blocks(H, interleaved)


def new_saved(M: int, H: int, interleaved: bool, device) -> torch.Tensor:
    """A saved tensor to fill; its row padding (odd H: 2 bytes) is zeroed, so every byte is defined."""
    saved = torch.empty(M, saved_row_bytes(H, interleaved), dtype=torch.uint8, device=device)
    if _scales_start(H) > 2 * H:
        saved[:, 2 * H:_scales_start(H)].zero_()
    return saved


def saved_views(saved: torch.Tensor, H: int, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [M, 2H] float8_e4m3fn, scales [M, blocks] float32): views of ``saved``."""
    start = _scales_start(H)
    scales = saved[:, start:start + 4 * scale_blocks(H, interleaved)]
    return saved[:, :2 * H].view(torch.float8_e4m3fn), scales.view(torch.float32)


def _parts(t: torch.Tensor, H: int, interleaved: bool) -> list[torch.Tensor]:
    """The column ranges cut into blocks: x12 itself (interleaved) or its two halves."""
    return [t] if interleaved else [t[:, :H], t[:, H:]]


def _blocked(part: torch.Tensor) -> torch.Tensor:
    """[M, n] -> [M, ceil(n / 128), 128], zero-padded."""
    M, n = part.shape
    blocks = -(-n // BLOCK)
    return F.pad(part, (0, blocks * BLOCK - n)).view(M, blocks, BLOCK)


def quantize_torch(x12: torch.Tensor, spec: GLUActivation, saved: torch.Tensor | None = None) -> torch.Tensor:
    """x12 [M, 2H] (float32/bfloat16/float16) -> the saved tensor [M, R] uint8."""
    M, C = x12.shape
    H = C // 2
    if saved is None:
        saved = new_saved(M, H, spec.interleaved, x12.device)
    q_out, scales_out = saved_views(saved, H, spec.interleaved)
    x = x12.float()
    first = 0
    for part, q_part in zip(_parts(x, H, spec.interleaved), _parts(q_out, H, spec.interleaved)):
        n = part.shape[1]
        blocked = _blocked(part)
        scale = blocked.abs().amax(2) / FP8_MAX                                           # [M, blocks]
        scaled = (blocked / scale.unsqueeze(2)).masked_fill_(scale.unsqueeze(2) == 0, 0.0)  # zero blocks: 0
        q_part.copy_(scaled.view(M, -1)[:, :n].to(torch.float8_e4m3fn))
        scales_out[:, first:first + scale.shape[1]].copy_(scale)
        first += scale.shape[1]
    return saved


def _decoded(q: torch.Tensor) -> torch.Tensor:
    """``q.float()`` through the 256-entry table of torch's own decoding
    (built per call, so tracers see it too): several times faster than
    torch's CPU float8 cast."""
    codes = q.view(torch.uint8)
    table = torch.arange(256, dtype=torch.int32, device=q.device).to(torch.uint8).view(torch.float8_e4m3fn).float()
    return table.index_select(0, codes.reshape(-1).int()).view(codes.shape)


def dequantize_torch(saved: torch.Tensor, H: int, spec: GLUActivation) -> torch.Tensor:
    """The saved tensor -> x12' [M, 2H] in float32 (what backward reads)."""
    q, scales = saved_views(saved, H, spec.interleaved)
    M = q.shape[0]
    parts, first = [], 0
    for q_part in _parts(q, H, spec.interleaved):
        n = q_part.shape[1]
        blocks = -(-n // BLOCK)
        blocked = _blocked(_decoded(q_part)) * scales[:, first:first + blocks].unsqueeze(2)
        parts.append(blocked.view(M, -1)[:, :n])
        first += blocks
    return parts[0] if spec.interleaved else torch.cat(parts, 1)

