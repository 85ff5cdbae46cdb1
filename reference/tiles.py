"""Tile classification: which (query tile, key tile) blocks a kernel may skip, run unmasked, or
must mask element by element.

The attention matrix (seqlen_q, seqlen_k) is cut into tiles of block_m query rows by block_n key
columns; the last tile of each axis may be ragged (shorter). Classes (int8):

* ``SKIP = 0``: every pair in the tile is masked - no loads, no math;
* ``PARTIAL = 1``: some pairs are masked - apply the per-element mask;
* ``FULL = 2``: no pair is masked - no per-element mask.

Only the in-range pairs count: a ragged tile's out-of-range padding is the kernel's bounds
check, not the mask's.
"""
from __future__ import annotations

import numpy as np

from .intervals import ColumnIntervals

__all__ = ["SKIP", "PARTIAL", "FULL", "MINMAX_FIELDS", "tile_minmax", "classify_tiles",
           "classify_tiles_dense", "tile_counts"]

SKIP, PARTIAL, FULL = 0, 1, 2
_NAMES = {SKIP: "skip", PARTIAL: "partial", FULL: "full"}

MINMAX_FIELDS = ("lts_min", "lts_max", "lte_min", "lte_max",
                 "uts_min", "uts_max", "ute_min", "ute_max")


def _check_block(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return int(value)


def _tile_reduce(values: np.ndarray, block: int, ufunc, fill: int) -> np.ndarray:
    """ufunc-reduce consecutive chunks of ``block`` entries (the last one ragged) -> int64."""
    n_tiles = -(-len(values) // block)
    padded = np.full(n_tiles * block, fill, dtype=np.int64)
    padded[:len(values)] = values
    return ufunc.reduce(padded.reshape(n_tiles, block), axis=1)


def tile_minmax(intervals: ColumnIntervals, block_n: int) -> dict[str, np.ndarray]:
    """The 8 per-key-tile vectors FlashMask classifies tiles with (seed 003, "preprocessing").

    intervals : ColumnIntervals (seqlen_q, seqlen_k). block_n : key tile width >= 1.
    Returns a dict keyed by ``MINMAX_FIELDS``, each int32 (ceil(seqlen_k / block_n),); over the
    key columns c of tile t (the last tile only has the columns that exist):

    * ``lts_max[t] = max_c lts[c]`` and ``lte_min[t] = min_c lte[c]`` (same for uts / ute): the
      rows [lts_max, lte_min) are masked in *every* column of the tile (empty if any column's LT
      interval is empty, since then lte_min <= lts_max);
    * ``lts_min[t] = min_c lts[c]`` and ``lte_max[t] = max_c lte[c]`` taken over the columns
      whose LT interval is *non-empty* only (same for UT): [lts_min, lte_max) bounds every
      masked LT row of the tile. A tile with no non-empty LT interval gets lts_min = seqlen_q,
      lte_max = 0 (an empty bound). Leaving empty intervals out keeps a column that masks
      nothing from widening the bound, so more tiles classify as full.
    """
    if not isinstance(intervals, ColumnIntervals):
        raise TypeError(f"intervals must be ColumnIntervals, got {type(intervals).__name__}")
    block_n = _check_block("block_n", block_n)
    seqlen_q = intervals.seqlen_q
    big = np.iinfo(np.int64).max
    out = {}
    for kind, start, end in (("lt", intervals.lts, intervals.lte),
                             ("ut", intervals.uts, intervals.ute)):
        start, end = start.astype(np.int64), end.astype(np.int64)
        live = start < end
        out[f"{kind}s_max"] = _tile_reduce(start, block_n, np.maximum, -big)
        out[f"{kind}e_min"] = _tile_reduce(end, block_n, np.minimum, big)
        s_min = _tile_reduce(np.where(live, start, big), block_n, np.minimum, big)
        e_max = _tile_reduce(np.where(live, end, -big), block_n, np.maximum, -big)
        out[f"{kind}s_min"] = np.where(s_min == big, seqlen_q, s_min)
        out[f"{kind}e_max"] = np.where(e_max == -big, 0, e_max)
    return {name: out[name].astype(np.int32) for name in MINMAX_FIELDS}


def classify_tiles(intervals: ColumnIntervals, block_m: int, block_n: int) -> np.ndarray:
    """Classify tiles from column intervals alone, by FlashMask's min/max rule.

    intervals : ColumnIntervals (seqlen_q, seqlen_k); block_m, block_n >= 1: tile sizes.
    Returns int8 (ceil(seqlen_q / block_m), ceil(seqlen_k / block_n)) of SKIP / PARTIAL / FULL.
    With the query tile's rows [a, b) (b = min(a + block_m, seqlen_q)) and ``tile_minmax``:

    * SKIP if ``lts_max <= a and b <= lte_min`` or ``uts_max <= a and b <= ute_min`` (the tile
      lies inside rows every column masks through the same interval);
    * FULL if the tile misses both bounds: ``b <= lts_min or a >= lte_max`` and
      ``b <= uts_min or a >= ute_max``;
    * PARTIAL otherwise.

    Sound: a SKIP tile has no visible pair and a FULL tile no masked one. It is conservative: a
    tile masked half by UT and half by LT intervals, or one lying between the masked runs of
    its columns, classifies PARTIAL (``classify_tiles_dense`` is exact).
    """
    block_m = _check_block("block_m", block_m)
    mm = tile_minmax(intervals, block_n)
    a = np.arange(0, intervals.seqlen_q, block_m, dtype=np.int64)[:, None]
    b = np.minimum(a + block_m, intervals.seqlen_q)
    skip = (((mm["lts_max"] <= a) & (b <= mm["lte_min"]))
            | ((mm["uts_max"] <= a) & (b <= mm["ute_min"])))
    full = (((b <= mm["lts_min"]) | (a >= mm["lte_max"]))
            & ((b <= mm["uts_min"]) | (a >= mm["ute_max"])))
    classes = np.where(skip, SKIP, np.where(full, FULL, PARTIAL)).astype(np.int8)
    return classes.reshape(len(a), len(mm["lts_max"]))


def classify_tiles_dense(visible, block_m: int, block_n: int) -> np.ndarray:
    """Exact classification from a dense bool visibility matrix (seqlen_q, seqlen_k).

    Returns int8 (ceil(seqlen_q / block_m), ceil(seqlen_k / block_n)): SKIP iff the tile has no
    visible pair, FULL iff every pair in it is visible, else PARTIAL.
    """
    visible = np.asarray(visible)
    if visible.dtype != bool or visible.ndim != 2:
        raise TypeError(f"visible must be a 2-D bool array, got {visible.dtype} with shape "
                        f"{visible.shape}")
    block_m = _check_block("block_m", block_m)
    block_n = _check_block("block_n", block_n)
    seqlen_q, seqlen_k = visible.shape
    n_m, n_n = -(-seqlen_q // block_m), -(-seqlen_k // block_n)
    if n_m == 0 or n_n == 0:
        return np.zeros((n_m, n_n), dtype=np.int8)
    counts = np.add.reduceat(np.add.reduceat(visible.astype(np.int64),
                                             np.arange(0, seqlen_q, block_m), axis=0),
                             np.arange(0, seqlen_k, block_n), axis=1)
    rows = np.diff(np.append(np.arange(0, seqlen_q, block_m), seqlen_q))
    cols = np.diff(np.append(np.arange(0, seqlen_k, block_n), seqlen_k))
    area = rows[:, None] * cols[None, :]
    return np.where(counts == 0, SKIP, np.where(counts == area, FULL, PARTIAL)).astype(np.int8)


def tile_counts(classes) -> dict[str, int]:
    """Number of tiles of each class: {"skip": n, "partial": n, "full": n}."""
    classes = np.asarray(classes)
    return {name: int((classes == value).sum()) for value, name in _NAMES.items()}
