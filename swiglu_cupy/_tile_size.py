"""How many rows a tile holds (``tile_rows=``), for the dense op
(``dense.tiled_passes``) and the experts (``moe.grouped``) alike."""
from __future__ import annotations

import torch

__all__ = ["AUTO_TILE_BYTES", "TILE_ROW_MULTIPLE", "HALF_DTYPES", "resolve_tile_rows", "tile_slices"]

#: ``tile_rows="auto"``: the largest tile whose x12 workspace fits in this many bytes...
AUTO_TILE_BYTES = 256 << 20
#: ...in a multiple of this many rows (whole GEMM blocks), and at least this many.
TILE_ROW_MULTIPLE = 256
#: Weights whose gradients accumulate across tiles in float32 (``tile_grads_fp32``).
HALF_DTYPES = (torch.float16, torch.bfloat16)


def resolve_tile_rows(tile_rows, rows: int, width: int, dtype: torch.dtype) -> int:
    """Rows (tokens, for the experts) per tile for one call, ``tile_rows`` checked
    by ``_validation.check_tile_rows``: 0 when untiled (None), or when every row
    fits in one tile, which takes the untiled path unchanged. ``width``: the x12
    elements per row over 2 (H; for the experts K*I per token)."""
    if tile_rows is None:
        return 0
    if tile_rows == "auto":
        per_row = 2 * max(width, 1) * dtype.itemsize
        tile_rows = max(TILE_ROW_MULTIPLE, AUTO_TILE_BYTES // per_row // TILE_ROW_MULTIPLE * TILE_ROW_MULTIPLE)
    return 0 if rows <= tile_rows else tile_rows


def tile_slices(rows: int, tile: int):
    """The row slices of the tiles, in order (the last one may be short)."""
    return [slice(start, min(start + tile, rows)) for start in range(0, rows, tile)]
