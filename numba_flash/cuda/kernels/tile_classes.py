"""Tile classification on the device: which (query tile, key tile) blocks the attention kernel
skips, runs unmasked, or masks element by element.

Classes are int8, as in ``numba_flash_reference.tiles``: ``SKIP = 0``, ``PARTIAL = 1``,
``FULL = 2``. Three sources:

* column intervals (FlashMask): ``tile_minmax`` reduces the four int32 vectors (4, seqlen_k) to
  the 8 per-key-tile vectors (8, n_ktiles) in ``MINMAX_FIELDS`` order, with the reference's
  convention (empty intervals left out of the min/max bounds); ``interval_class`` is the device
  function the attention kernel calls per tile, ``classify_intervals`` fills a whole table;
* a packed bitmask (uint32 words (seqlen_q, ceil(seqlen_k / 32)), bit b of word w = key 32w + b):
  ``classify_bitmask`` counts the visible pairs of every tile (exact);
* a user ``mask_mod(b, h, q_idx, kv_idx) -> bool``: ``classify_mask_mod`` evaluates every pair of
  every tile on the device (exact; FlexAttention's block-mask precomputation), one block per tile.

Only in-range pairs count (a ragged last tile is the kernel's bounds check, not the mask's).
Every launcher takes and returns device arrays (NumPy arrays under the simulator) and runs on the
given stream without synchronising.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from ..primitives import SIMULATOR
from ..primitives.base import inlined

__all__ = ["SKIP", "PARTIAL", "FULL", "MINMAX_FIELDS", "interval_class", "skipped_rows_end",
           "tile_minmax", "tile_minmax_into", "classify_intervals", "classify_bitmask",
           "classify_mask_mod", "device_mask_mod"]

SKIP, PARTIAL, FULL = 0, 1, 2
MINMAX_FIELDS = ("lts_min", "lts_max", "lte_min", "lte_max",
                 "uts_min", "uts_max", "ute_min", "ute_max")
_THREADS = 128
_BIG = 2**31 - 1


def _jit(fn):
    return cuda.jit(fn) if SIMULATOR else cuda.jit(cache=True)(fn)


@inlined
def interval_class(mm, t, a, b):
    """Class of the tile of query rows [a, b) and key tile t, from the (8, n_ktiles) min/max
    vectors ``mm`` (rows in ``MINMAX_FIELDS`` order): FlashMask's rule, as in the reference."""
    # All 8 loads first (one round trip), then the tests: short-circuit tests would wait for
    # each load in turn.
    lts_min = mm[0, t]
    lts_max = mm[1, t]
    lte_min = mm[2, t]
    lte_max = mm[3, t]
    uts_min = mm[4, t]
    uts_max = mm[5, t]
    ute_min = mm[6, t]
    ute_max = mm[7, t]
    if (lts_max <= a and b <= lte_min) or (uts_max <= a and b <= ute_min):
        return SKIP
    if (b <= lts_min or a >= lte_max) and (b <= uts_min or a >= ute_max):
        return FULL
    return PARTIAL


@inlined
def skipped_rows_end(mm, t, a, b):
    """For rows [a, b) that ``interval_class`` skips for key tile t: where the run of skipped
    rows that holds them ends (every row from a up to it is masked for the whole key tile), so
    a walk over query tiles jumps there instead of classifying each skipped tile in turn."""
    end = b
    if mm[1, t] <= a and b <= mm[2, t]:
        end = mm[2, t]
    if mm[5, t] <= a and b <= mm[6, t]:
        end = max(end, mm[6, t])
    return end


def _minmax_kernel(iv, mm, seqlen_q, seqlen_k, block_n):
    t = cuda.grid(1)
    if t >= mm.shape[1]:
        return
    c0 = t * block_n
    c1 = min(c0 + block_n, seqlen_k)
    for kind in range(2):           # 0: LT (rows 0, 1 of iv / fields 0..3), 1: UT
        s_max = -_BIG
        e_min = _BIG
        s_min = _BIG
        e_max = -_BIG
        for c in range(c0, c1):
            s = iv[2 * kind, c]
            e = iv[2 * kind + 1, c]
            s_max = max(s_max, s)
            e_min = min(e_min, e)
            if s < e:               # empty intervals stay out of the bounds
                s_min = min(s_min, s)
                e_max = max(e_max, e)
        if s_min == _BIG:
            s_min = seqlen_q
            e_max = 0
        mm[4 * kind, t] = s_min
        mm[4 * kind + 1, t] = s_max
        mm[4 * kind + 2, t] = e_min
        mm[4 * kind + 3, t] = e_max


def _classify_intervals_kernel(mm, classes, seqlen_q, block_m):
    kt, qt = cuda.grid(2)
    if kt >= classes.shape[1] or qt >= classes.shape[0]:
        return
    a = qt * block_m
    b = min(a + block_m, seqlen_q)
    classes[qt, kt] = interval_class(mm, kt, a, b)


def _classify_bitmask_kernel(words, classes, seqlen_q, seqlen_k, block_m, block_n):
    kt, qt = cuda.grid(2)
    if kt >= classes.shape[1] or qt >= classes.shape[0]:
        return
    r0 = qt * block_m
    r1 = min(r0 + block_m, seqlen_q)
    c0 = kt * block_n
    c1 = min(c0 + block_n, seqlen_k)
    count = 0
    for r in range(r0, r1):
        for w in range(c0 >> 5, ((c1 - 1) >> 5) + 1):
            bits = words[r, w]
            lo = max(c0 - 32 * w, 0)        # keep bits [lo, hi) of this word
            hi = min(c1 - 32 * w, 32)
            keep = np.uint32(0xFFFFFFFF) >> np.uint32(32 - (hi - lo))
            count += cuda.popc((bits >> np.uint32(lo)) & keep)
    area = (r1 - r0) * (c1 - c0)
    cls = PARTIAL
    if count == 0:
        cls = SKIP
    elif count == area:
        cls = FULL
    classes[qt, kt] = cls


_MINMAX = None
_CLASSIFY_IV = None
_CLASSIFY_BITS = None
_MOD_CLASSIFIERS: dict = {}


def _kernels():
    global _MINMAX, _CLASSIFY_IV, _CLASSIFY_BITS
    if _MINMAX is None:
        _MINMAX = _jit(_minmax_kernel)
        _CLASSIFY_IV = _jit(_classify_intervals_kernel)
        _CLASSIFY_BITS = _jit(_classify_bitmask_kernel)
    return _MINMAX, _CLASSIFY_IV, _CLASSIFY_BITS


def _check_block(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def _empty(shape, dtype):
    return np.empty(shape, dtype=dtype) if SIMULATOR else cuda.device_array(shape, dtype=dtype)


def tile_minmax(iv, seqlen_q: int, block_n: int, stream=0):
    """Per-key-tile min/max vectors on the device.

    iv : int32 device array (4, seqlen_k), rows lts, lte, uts, ute (``ColumnIntervals.stacked()``).
    Returns int32 (8, ceil(seqlen_k / block_n)), rows in ``MINMAX_FIELDS`` order, equal to the
    reference's ``tile_minmax``.
    """
    block_n = _check_block("block_n", block_n)
    seqlen_k = int(iv.shape[1])
    n_k = -(-seqlen_k // block_n)
    return tile_minmax_into(iv, _empty((8, n_k), np.int32), seqlen_q, block_n, stream)


def tile_minmax_into(iv, mm, seqlen_q: int, block_n: int, stream=0):
    """``tile_minmax`` into an existing int32 (8, ceil(seqlen_k / block_n)) device array."""
    n_k = int(mm.shape[1])
    if n_k:
        minmax = _kernels()[0]
        minmax[(n_k + _THREADS - 1) // _THREADS, _THREADS, stream](iv, mm, int(seqlen_q),
                                                                    int(iv.shape[1]), int(block_n))
    return mm


def _table_launch(kernel, n_q, n_k, stream, *args):
    classes = _empty((n_q, n_k), np.int8)
    if n_q and n_k:
        grid = ((n_k + 15) // 16, (n_q + 7) // 8)
        kernel[grid, (16, 8), stream](*args[:1], classes, *args[1:])
    return classes


def classify_intervals(mm, seqlen_q: int, block_m: int, stream=0):
    """The (ceil(seqlen_q / block_m), n_ktiles) int8 class table from ``tile_minmax``'s vectors;
    equal to the reference's ``classify_tiles``."""
    block_m = _check_block("block_m", block_m)
    n_q = -(-int(seqlen_q) // block_m)
    return _table_launch(_kernels()[1], n_q, int(mm.shape[1]), stream, mm, int(seqlen_q), block_m)


def classify_bitmask(words, seqlen_q: int, seqlen_k: int, block_m: int, block_n: int, stream=0):
    """Exact int8 class table (ceil(seqlen_q / block_m), ceil(seqlen_k / block_n)) of a packed
    bitmask given as uint32 words (seqlen_q, ceil(seqlen_k / 32)) (bit b of word w = key 32w+b)."""
    block_m = _check_block("block_m", block_m)
    block_n = _check_block("block_n", block_n)
    n_q, n_k = -(-int(seqlen_q) // block_m), -(-int(seqlen_k) // block_n)
    return _table_launch(_kernels()[2], n_q, n_k, stream, words, int(seqlen_q), int(seqlen_k),
                         block_m, block_n)


def device_mask_mod(fn):
    """``fn`` compiled as a CUDA device function (the simulator runs it as Python)."""
    return fn if SIMULATOR else cuda.jit(device=True)(fn)


def _make_mod_classifier(fn):
    mod = device_mask_mod(fn)

    def kernel(classes, seqlen_q, seqlen_k, block_m, block_n, heads):
        kt = cuda.blockIdx.x
        qt = cuda.blockIdx.y
        bh = cuda.blockIdx.z
        b = bh // heads
        h = bh - b * heads
        r0 = qt * block_m
        c0 = kt * block_n
        rows = min(block_m, seqlen_q - r0)
        cols = min(block_n, seqlen_k - c0)
        offset = seqlen_k - seqlen_q
        any_vis = 0
        all_vis = 1
        for i in range(cuda.threadIdx.x, rows * cols, cuda.blockDim.x):
            r = i // cols
            c = i - r * cols
            if mod(b, h, r0 + r + offset, c0 + c):
                any_vis = 1
            else:
                all_vis = 0
        any_vis = cuda.syncthreads_or(any_vis)
        all_vis = cuda.syncthreads_and(all_vis)
        if cuda.threadIdx.x == 0:
            cls = PARTIAL
            if any_vis == 0:
                cls = SKIP
            elif all_vis != 0:
                cls = FULL
            classes[bh, qt, kt] = cls

    return cuda.jit(kernel)  # a user function: no on-disk cache


def classify_mask_mod(fn, batch: int, heads: int, seqlen_q: int, seqlen_k: int, block_m: int,
                      block_n: int, stream=0):
    """Exact int8 class table (batch * heads, n_qtiles, n_ktiles) of ``fn(b, h, q_idx, kv_idx)``.

    q_idx is the aligned query position (row + seqlen_k - seqlen_q), kv_idx the key index; every
    pair of every tile is evaluated on the device. ``batch = heads = 1`` for a mask that does not
    depend on (b, h) (evaluated at b = h = 0).
    """
    block_m = _check_block("block_m", block_m)
    block_n = _check_block("block_n", block_n)
    n_q, n_k = -(-int(seqlen_q) // block_m), -(-int(seqlen_k) // block_n)
    classes = _empty((batch * heads, n_q, n_k), np.int8)
    if n_q and n_k and batch * heads:
        kern = _MOD_CLASSIFIERS.get(fn)
        if kern is None:
            kern = _MOD_CLASSIFIERS[fn] = _make_mod_classifier(fn)
        kern[(n_k, n_q, batch * heads), _THREADS, stream](classes, int(seqlen_q), int(seqlen_k),
                                                           block_m, block_n, int(heads))
    return classes
