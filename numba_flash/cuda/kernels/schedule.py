"""Which query tile of which (batch, head) row a forward block computes: the grid's order.

The forward's grid is (query tiles, batch * heads_q); blocks start in the order of their linear
index (x fastest). Causal and banded rows give the tiles unequal work (the last query tile of a
causal row visits every key tile, the first one a single tile), so the order decides how well
the last wave fills the device. Taking each row's tiles longest first (the order until
2026-11-27) still hands the scheduler a light tile of one row next to heavy tiles of the next,
and at short sequences a few rows' heavy tiles end the kernel alone. Here the rows are taken in
groups whose K and V fit in part of the L2 cache (``L2_GROUP_BYTES``); inside a group the
blocks go tile by tile, longest first, across all of the group's rows (longest-processing-time
order), so the heavy tiles of a group start together and the light ones fill the end, while the
group's K / V, read by each of its tiles, stay in L2. A row's K / V larger than the budget makes
a group of one row: each row's tiles longest first, as before. Only rows whose tiles differ in
work are grouped: under a right bound (causal), and under interval masks on the warp-specialised
kernel (forward_ws.py); not in packed batches or the head_dim 64 wgmma kernel (``group_keys``,
forward_mma.py; the A/B behind these choices: docs/benchmarks.md, "Forward", and "Backward"
for the interval masks). The backward's dK / dV blocks go out in the same order, with groups
of their own size (backward.py ``key_block``).
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from ..primitives.base import inlined

__all__ = ["query_tile_of_block", "tile_order", "tile_order_inlined", "group_keys",
           "L2_GROUP_BYTES"]

L2_GROUP_BYTES = 8 * 1024 * 1024        # of the H100's / H200's 50 MB L2 (2026-11-27: 32 MB
                                        # made head_dim 64 at N 4096 1.5x slower)


def group_keys(kv_row_bytes: int, has_right: bool, varlen: bool = False,
               enabled: bool = True) -> int:
    """The ``budget_keys`` of a forward kernel (a compile-time constant): how many keys' K and V
    rows (``kv_row_bytes`` each) fill ``L2_GROUP_BYTES``; 0 (rows in order, each row's tiles
    longest first) without a right bound (``has_right``: the rows give their tiles unequal
    work, by a causal flag or, for the warp-specialised kernel, an interval mask), where the
    tiles of a row cost the same and grouping only spreads the blocks that run together over
    more rows' K / V (full attention lost 2-5 % at head_dim 128 / 256 and the bitmask case
    6 %), and for packed batches (their rows are sequences of unequal lengths, and their
    mma.sync kernels spilled in the key loop with the grouped order's extra registers); 0 too
    where the kernel says not ``enabled``."""
    return 0 if varlen or not has_right or not enabled else L2_GROUP_BYTES // kv_row_bytes


def tile_order(block, n_qtiles, n_rows, seqlen_k, heads_ratio, budget_keys):
    """``(qtile, x, row)`` of the block of linear index ``block`` (``blockIdx.y * n_qtiles +
    blockIdx.x``) in a grid of ``n_qtiles`` x ``n_rows``: its query tile, that tile's place
    among its row's blocks counted from the longest (what ``clear_unowned_rows`` shares rows
    by), and its row ``b * heads_q + h``, as int64. ``seqlen_k``: keys per row (the launch's
    maximum for packed batches); ``heads_ratio``: query heads per kv head (rows of one kv head
    share its K / V); ``budget_keys``: how many keys' K and V rows fit in ``L2_GROUP_BYTES``.
    In 32-bit unsigned arithmetic (every value fits: the grid has fewer than 2^32 blocks), so
    the divisions are 32-bit ones: int64 divisions are long instruction sequences (~250
    instructions more per kernel, and new spills in some configurations). Plain integer
    arithmetic otherwise (the kernels inline it; tests call it on the host)."""
    u32 = np.uint32
    rows = u32(n_rows)
    group = u32(max(u32(1), u32(budget_keys) // u32(max(seqlen_k, 1))) * u32(heads_ratio))
    group = u32(min(group, rows))                 # rows per group
    span = u32(group * u32(n_qtiles))
    first = u32(u32(u32(block) // span) * group)
    width = u32(min(group, u32(rows - first)))
    rank = u32(u32(block) - u32(first * u32(n_qtiles)))
    x = u32(rank // width)
    return (np.int64(u32(n_qtiles) - u32(1) - x), np.int64(x),
            np.int64(first + u32(rank - u32(x * width))))


tile_order_inlined = inlined(tile_order)     # the kernels' copy (backward.py's key_block too)


@inlined
def query_tile_of_block(seqlen_k, heads_ratio, budget_keys):
    """``tile_order`` of this block (``budget_keys``: a compile-time constant from
    ``group_keys``; 0: each row's tiles longest first, rows in order, with no division)."""
    if budget_keys == 0:    # each row's tiles longest first, rows in order (no division)
        x = cuda.blockIdx.x
        return np.int64(cuda.gridDim.x - 1 - x), np.int64(x), np.int64(cuda.blockIdx.y)
    n_qtiles = cuda.gridDim.x
    return tile_order_inlined(cuda.blockIdx.y * n_qtiles + cuda.blockIdx.x, n_qtiles,
                              cuda.gridDim.y, seqlen_k, heads_ratio, budget_keys)
