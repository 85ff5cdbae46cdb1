"""The grids' block orders: the forward's (kernels/schedule.py), every (query tile, row) exactly
once, longest tiles first across the rows of an L2-sized group, groups in row order; the
backward's column-parallel blocks (kernels/backward.py ``key_block``: the same order, a group
being up to 8 rows), every (key tile, row) once, key tile by key tile within a group."""
from __future__ import annotations

import pytest

from numba_flash.cuda.launch.backward import dkdv_grid
from numba_flash.cuda.kernels.schedule import L2_GROUP_BYTES, tile_order


def _order(n_qtiles, n_rows, seqlen_k, ratio, row_bytes):
    order = [tile_order(i, n_qtiles, n_rows, seqlen_k, ratio, L2_GROUP_BYTES // row_bytes)
             for i in range(n_qtiles * n_rows)]
    return [tuple(int(v) for v in item) for item in order]


@pytest.mark.parametrize("n_qtiles, n_rows, seqlen_k, ratio, group", [
    (8, 64, 1024, 1, 16),       # (4, 16, 1024, 128) causal: 16 rows' K / V in 8 MB
    (32, 64, 4096, 1, 4),
    (5, 7, 300_000, 1, 1),      # a row's K / V beyond the budget: groups of one row
    (3, 13, 4096, 4, 13),       # GQA: 4 kv heads' worth of rows, all 13 in one group
    (3, 20, 8192, 4, 8),        # GQA: 8-row groups of whole kv heads, a short last group
    (1, 9, 10, 1, 9),           # one query tile
    (7, 3, 1, 8, 3),            # one key: the group is every row
])
def test_every_tile_once_longest_first_within_groups(n_qtiles, n_rows, seqlen_k, ratio, group):
    """``group``: the rows per group the budget allows (written out by hand from 8 MB / (4 *
    128 bytes per key), not recomputed by the test), whole kv heads of ``ratio`` rows."""
    row_bytes = 4 * 128
    order = _order(n_qtiles, n_rows, seqlen_k, ratio, row_bytes)
    assert sorted((row, q) for q, _, row in order) == \
        [(r, q) for r in range(n_rows) for q in range(n_qtiles)]
    assert all(x == n_qtiles - 1 - q for q, x, _ in order)
    for start in range(0, len(order), group * n_qtiles):
        chunk = order[start:start + group * n_qtiles]
        first = start // n_qtiles
        assert {row for _, _, row in chunk} == set(range(first, min(first + group, n_rows)))
        tiles = [q for q, _, _ in chunk]
        assert tiles == sorted(tiles, reverse=True)      # longest (causal) tiles first


def test_one_row_per_group_is_the_old_order():
    """K / V of a row beyond the budget: each row's tiles longest first, rows in order."""
    order = _order(4, 3, 10 ** 6, 1, 512)
    assert [(q, row) for q, _, row in order] == [(q, r) for r in range(3) for q in (3, 2, 1, 0)]


@pytest.mark.parametrize("n_keys, n_rows, group", [
    (64, 32, 8),        # bf16 (2, 16, 8192, 128): four groups of 8 heads
    (5, 13, 4),         # a short last group
    (3, 7, 1),          # groups of one row: each row's key tiles in order
    (1, 9, 8),          # one key tile
    (4, 3, 8),          # fewer rows than a group
])
def test_backward_blocks_key_tile_by_key_tile_within_groups(n_keys, n_rows, group):
    # key_block's call: a budget of ``group`` keys of one-key rows, x the key tile
    order = [tuple(int(v) for v in tile_order(i, n_keys, n_rows, 1, 1, group)[1:])
             for i in range(n_keys * n_rows)]
    assert sorted((row, kt) for kt, row in order) == \
        [(r, kt) for r in range(n_rows) for kt in range(n_keys)]
    for start in range(0, len(order), group * n_keys):
        chunk = order[start:start + group * n_keys]
        first = start // n_keys
        rows = list(range(first, min(first + group, n_rows)))
        assert chunk == [(kt, r) for kt in range(n_keys) for r in rows]


def test_backward_grid_of_2_32_blocks_is_refused():
    """The order numbers blocks in 32 bits: 2^32 - 1 blocks pass, 2^32 or more raise."""
    assert dkdv_grid(65537, 65535) == (65537, 65535)            # 2^32 - 1 blocks
    with pytest.raises(ValueError, match="65538 key tiles x 65535 .* fewer than 2\\^32"):
        dkdv_grid(65538, 65535)
