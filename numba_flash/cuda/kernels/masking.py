"""Device functions the attention kernels use to apply a mask object (see docs/masks.md).

Mask kinds (a compile-time constant of each kernel): ``NONE`` (flags only), ``INTERVALS``
(FlashMask column intervals: per-tile class from the min/max vectors, per-element test from the
int32 (4, seqlen_k) vectors), ``BITMASK`` (class table + uint32 words (seqlen_q, ceil(seqlen_k /
32))), ``MASK_MOD`` (class table + the user's compiled function).
"""
from __future__ import annotations

from numba import cuda

from ..primitives import SIMULATOR, ballot, lowest_bit
from .tile_classes import FULL, SKIP, interval_class
from ..primitives.base import inlined

__all__ = ["NONE", "INTERVALS", "BITMASK", "MASK_MOD", "tile_class", "chunk_classes", "key_tiles",
           "past_sinks", "skip_empty_chunks", "first_in_chunk", "walk_start", "walk_next",
           "flags_see_whole_tile", "interval_visible", "interval_visible2", "bit_visible",
           "always_visible", "score_unchanged", "mask_mod_device", "score_mod_device", "LOG2E", "LN2"]

NONE, INTERVALS, BITMASK, MASK_MOD = 0, 1, 2, 3


@inlined
def key_tiles(q_lo, q_hi, seqlen_k, block_n, has_left, has_right, has_sinks, window_left,
              window_right, sinks):
    """Key tiles that query positions ``q_lo..q_hi`` (bottom-right aligned, in key
    coordinates) can see through the window flags: ``(tile_lo, tile_hi, first, last,
    sink_tiles)``. The window's tiles are ``tile_lo..tile_hi`` (empty: ``1, 0``); with sinks
    the walk runs ``first = 0 .. last`` and tiles ``sink_tiles..tile_lo - 1`` hold no visible
    pair. The ``has_*`` flags are compile-time constants of the calling kernel."""
    n_start = 0
    n_end = seqlen_k
    if has_left:
        n_start = max(0, q_lo - window_left)
    if has_right:
        n_end = min(n_end, q_hi + window_right + 1)
    tile_lo = n_start // block_n
    tile_hi = (n_end - 1) // block_n
    if n_end <= n_start:
        tile_lo = 1
        tile_hi = 0
    first = tile_lo
    last = tile_hi
    sink_tiles = 0
    if has_sinks:
        sink_end = min(min(sinks, seqlen_k), q_hi + 1)
        if sink_end > 0:
            sink_tiles = (sink_end + block_n - 1) // block_n
            first = 0
            last = max(tile_hi, sink_tiles - 1)
    return tile_lo, tile_hi, first, last, sink_tiles


@inlined
def past_sinks(tile, tile_lo, sink_tiles, has_sinks):
    """Where ``key_tiles``' walk goes on from ``tile``: a tile between the sink tiles and the
    window (``sink_tiles <= tile < tile_lo``) holds no visible pair, so the walk jumps to
    ``tile_lo``; any other tile is itself."""
    if has_sinks and tile >= sink_tiles and tile < tile_lo:
        tile = tile_lo
    return tile


@inlined
def tile_class(kind, mm, tab, tb, qtile, tile, a, b):
    """Class (0 skip, 1 partial, 2 full) of key tile ``tile`` for query tile ``qtile`` (rows
    [a, b)): from the min/max vectors ``mm`` (INTERVALS) or the table ``tab[tb]`` (others)."""
    if kind == INTERVALS:
        return interval_class(mm, tile, a, b)
    if kind == BITMASK or kind == MASK_MOD:
        return int(tab[tb, qtile, tile])
    return FULL


@inlined
def interval_visible(iv, row, col):
    """Is query row ``row`` visible to key ``col`` under the column intervals ``iv`` (4, Sk)?"""
    return not ((iv[0, col] <= row and row < iv[1, col]) or (iv[2, col] <= row and row < iv[3, col]))


@inlined
def interval_visible2(iv, col, row0, row1):
    """``interval_visible`` for two query rows of one key column: its 4 bounds loaded once."""
    lts = iv[0, col]
    lte = iv[1, col]
    uts = iv[2, col]
    ute = iv[3, col]
    vis0 = (row0 < lts or row0 >= lte) and (row0 < uts or row0 >= ute)
    vis1 = (row1 < lts or row1 >= lte) and (row1 < uts or row1 >= ute)
    return vis0, vis1


@inlined
def bit_visible(bits, row, col):
    """Bit ``col`` of row ``row`` of the packed uint32 bitmask (1 = visible)."""
    return ((bits[row, col >> 5] >> (col & 31)) & 1) != 0


def always_visible(b, h, q_idx, kv_idx):
    """Placeholder mask_mod for kernels built without one (never called)."""
    return True


def score_unchanged(score, b, h, q_idx, kv_idx):
    """Placeholder score_mod for kernels built without one (never called)."""
    return score


@inlined
def chunk_classes(kind, mm, tab, tb, qtile, base, lane, tile_lo, tile_hi, sink_tiles, a, b):
    """Classify key tiles ``base .. base + 31`` at once, lane i taking tile ``base + i``.

    A tile counts when it lies in the flags' range (window tiles ``[tile_lo, tile_hi]`` or sink
    tiles ``[0, sink_tiles)``) and the mask does not skip it for query rows [a, b). Returns
    (visible, full): int64 32-bit sets (bit i: tile base + i), equal in every lane of the warp,
    hence block-uniform when every warp calls it with the same arguments. Must be called by
    the whole warp.
    """
    t = base + lane
    cls = SKIP
    if (t >= tile_lo and t <= tile_hi) or t < sink_tiles:
        cls = tile_class(kind, mm, tab, tb, qtile, t, a, b)
    return ballot(cls != SKIP), ballot(cls == FULL)


@inlined
def skip_empty_chunks(kind, mm, tab, tb, qtile, base, visible, full, lane, last, tile_lo,
                      tile_hi, sink_tiles, a, b, has_sinks):
    """The walk's move past exhausted chunks: while the chunk at ``base`` has no visible tile
    left (``visible == 0``) and a next chunk starts at or before tile ``last``, go to that
    chunk (past the gap between the sink tiles and the window, ``past_sinks``) and classify it
    (``chunk_classes``). Returns ``(base, visible, full)`` of the chunk reached. Must be called
    by the whole warp."""
    while visible == 0 and base + 32 <= last:
        base += 32
        base = past_sinks(base, tile_lo, sink_tiles, has_sinks)
        visible, full = chunk_classes(kind, mm, tab, tb, qtile, base, lane, tile_lo, tile_hi,
                                      sink_tiles, a, b)
    return base, visible, full


@inlined
def first_in_chunk(base, visible, last):
    """The first visible tile of the chunk at ``base`` (lowest set bit of ``visible``), or
    ``last + 1`` (the walk is over) when it has none."""
    return base + lowest_bit(visible) if visible != 0 else last + 1


@inlined
def walk_start(kind, mm, tab, tb, qtile, first, last, lane, tile_lo, tile_hi, sink_tiles, a, b,
               has_sinks):
    """The first tile of a query tile's walk over key tiles ``first .. last`` and the walk's
    state: ``(tile, base, visible, full)`` (``tile > last``: nothing to visit). With a mask
    object (``kind`` not NONE) the tiles it skips are never visited: the walk holds the
    visible / full bit sets of the 32-tile chunk at ``base`` (``chunk_classes``). Must be
    called by the whole warp."""
    base = first
    visible = 0
    full = 0
    tile = first
    if kind != NONE:
        visible, full = chunk_classes(kind, mm, tab, tb, qtile, base, lane, tile_lo, tile_hi,
                                      sink_tiles, a, b)
        base, visible, full = skip_empty_chunks(kind, mm, tab, tb, qtile, base, visible, full,
                                                lane, last, tile_lo, tile_hi, sink_tiles, a, b,
                                                has_sinks)
        tile = first_in_chunk(base, visible, last)
    return tile, base, visible, full


@inlined
def walk_next(kind, tile, base, visible, full, mm, tab, tb, qtile, last, lane, tile_lo, tile_hi,
              sink_tiles, a, b, has_sinks):
    """One step of ``walk_start``'s walk from ``tile``: ``(next tile, whether the mask sees all
    of ``tile``, base, visible, full)`` (with no mask object every tile counts as seen whole;
    the flags' own test is ``flags_see_whole_tile``). Must be called by the whole warp."""
    nxt = past_sinks(tile + 1, tile_lo, sink_tiles, has_sinks)
    mask_full = True
    if kind != NONE:
        mask_full = ((full >> (tile - base)) & 1) != 0
        visible &= visible - 1          # drop this tile; the next set bit is the next tile
        base, visible, full = skip_empty_chunks(kind, mm, tab, tb, qtile, base, visible, full,
                                                lane, last, tile_lo, tile_hi, sink_tiles, a, b,
                                                has_sinks)
        nxt = first_in_chunk(base, visible, last)
    return nxt, mask_full, base, visible, full


@inlined
def flags_see_whole_tile(k0, in_window, q_lo, q_hi, seqlen_k, window_left, window_right, sinks,
                         block_n, has_left, has_right, has_sinks):
    """Whether the flags let every query position ``q_lo..q_hi`` see every key of the tile
    ``k0 .. k0 + block_n - 1`` (``in_window``: a window tile of ``key_tiles``): all keys inside
    ``seqlen_k`` and inside every row's window, or all sinks that every row comes after. Such a
    tile needs no per-element mask of the flags."""
    full = k0 + block_n <= seqlen_k and in_window
    if has_left:
        full = full and k0 >= q_hi - window_left
    if has_right:
        full = full and k0 + block_n - 1 <= q_lo + window_right
    if has_sinks:
        full = full or (k0 + block_n <= sinks and k0 + block_n - 1 <= q_lo
                        and k0 + block_n <= seqlen_k)
    return full


LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

_ALWAYS = None if SIMULATOR else cuda.jit(device=True)(always_visible)
_UNCHANGED = None if SIMULATOR else cuda.jit(device=True)(score_unchanged)


def mask_mod_device(mask_mod):
    """The device function of a user's ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (None: every
    pair visible), as the kernels call it."""
    if mask_mod is None:
        return always_visible if SIMULATOR else _ALWAYS
    return mask_mod if SIMULATOR else cuda.jit(device=True)(mask_mod)


def score_mod_device(score_mod):
    """The device function of a user's ``score_mod(score, b, h, q_idx, kv_idx) -> float`` (None:
    scores unchanged)."""
    if score_mod is None:
        return score_unchanged if SIMULATOR else _UNCHANGED
    return score_mod if SIMULATOR else cuda.jit(device=True)(score_mod)
