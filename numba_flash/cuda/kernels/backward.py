"""FlashAttention-2 backward kernels (FlashMask Algorithm 2 shape), built by factories whose
arguments are compile-time constants.

Kernels (see ``launch/backward.py`` for the order they run in):

* ``make_preprocess_kernel``: ``delta[b, h, i] = rowsum(dO_i * O_i)`` (B, Hq, Sq), float32
  (float64 for float64 inputs).
* ``make_fma_dkdv_kernel`` (float32 / float64, CUDA cores) and ``make_mma_dkdv_kernel``
  (float16 / bfloat16, ``mma.sync`` m16n8k16 with fp32 accumulation): column-parallel. A block
  owns a key tile (K_j, V_j; dK_j, dV_j in registers) and walks the query tiles that can see it,
  recomputing ``P = exp(S - lse)`` from the saved lse; ``dV += P^T dO``, ``dS = P (dP - delta)``,
  ``dK += scale dS^T Q``; with ``atomic_dq`` also ``dQ += scale dS K`` by atomics into a
  float32 (float64) accumulator.
* ``make_fma_dq_kernel`` / ``make_mma_dq_kernel``: row-parallel dQ for ``deterministic=True``: a
  block owns a query tile and walks the key tiles it sees (the forward's walk), recomputing P
  and dS; no atomics, so dQ is bitwise reproducible.
* ``make_reduce_kernel``: sums per-query-head dK / dV partials (B, Sk, Hq, D) over each GQA group
  into (B, Sk, Hkv, D) in a fixed order, converting to the output dtype (also converts the fp32
  dQ accumulator of the 16-bit path, with group size 1).

GQA choice: every (batch, query head) block writes its own dK / dV partial rows (no atomics,
so dK / dV are deterministic in both modes); the reduce kernel adds the ``Hq / Hkv`` heads of a
group in head order. Workspace: 2 x B x Sk x Hq x D accumulator elements when Hq > Hkv or for
16-bit inputs; float32 / float64 inputs with Hq == Hkv write dK / dV directly.

Masks: the forward's flags (window left / right, causal = right 0, bottom-right alignment,
sinks with a left bound, softcap) and FlashMask column intervals (``masking.INTERVALS``: the
per-key-tile min/max vectors classify each (query tile, key tile) as skipped, fully visible or
partial; per-element tests only in partial tiles: the CUDA-core kernels load a key column's
4 bounds once per block into registers, the tensor-core dK / dV kernels stage their key tile's
intervals in shared memory (``stage_key_block``) and test a lane's keys against 64-bit row
masks built once per call of ``probs_grads`` (a tile, or a 16-row slice; ``key_rows``), and a walk over query tiles jumps over a masked run
(``next_query_tile``)); bitmask and mask_mod objects (``BITMASK`` / ``MASK_MOD``: a class
table built for the kernel's tiles, per-element tests from the bitmask words or the user's
compiled function). ALiBi (``has_alibi``): scores less slope * |q_pos - k_pos| when P is
recomputed; the gradient formulas are unchanged (the bias is constant in q.k).

Every kernel body is a short sequence of the ``@inlined`` tile
helpers below; compile-time choices enter as closure constants.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda
from numba.cuda import types

from ..primitives import (cp_async16, cp_async16_at, cp_async_commit, cp_async_wait_all, exp2,
                          ldmatrix_x4_a32, ldmatrix_x4_trans_a32, mma16, pack16, red_add2,
                          shared_view, shfl_xor, unpack16)
from .jitcache import jit_kernel
from .masking import (BITMASK, INTERVALS, MASK_MOD, NONE, bit_visible, key_tiles,
                      mask_mod_device, past_sinks, tile_class)
from .schedule import tile_order_inlined
from .sequences import packed_sequence
from .tile_ops import window_visible
from .tile_classes import FULL, SKIP, skipped_rows_end
from ..primitives.base import inlined

__all__ = ["make_preprocess_kernel", "make_reduce_kernel", "make_convert_kernel", "make_fma_dkdv_kernel",
           "make_fma_dq_kernel", "make_mma_dkdv_kernel", "make_mma_dq_kernel", "fma_layout",
           "mma_layout", "mma_dsplit", "mma_dq_layout", "mma_dkdv_smem_bytes", "PRE_THREADS",
           "PRE_ROWS", "REDUCE_THREADS", "ROW_PAD"]

LOG2E = 1.4426950408889634
PRE_THREADS = 128
PRE_LANES = 8                   # preprocess lanes per row (a power of two up to 32)
PRE_ROWS = PRE_THREADS // PRE_LANES
PRE_SHUFFLES = tuple(PRE_LANES >> i for i in range(1, PRE_LANES.bit_length()))   # 4, 2, 1
ROW_PAD = 64           # delta / lse2 rows are padded to a multiple of this
REDUCE_THREADS = 256

# ----------------------------------------------------------------------------- tile helpers
@inlined
def query_rows(k0, k1, seqlen_q, offset, has_left, has_right, has_sinks, wl, wr, sinks):
    """Query rows [lo, hi) that can see a key of [k0, k1) through the flags (bottom-right
    aligned: row r sits at key position r + offset). Sink keys are seen by every later row."""
    lo = 0
    hi = seqlen_q
    if has_right:
        lo = max(0, k0 - wr - offset)
    if has_left:
        hi = min(seqlen_q, k1 + wl - offset)
    if has_sinks and k0 < sinks:
        lo = min(lo, max(0, k0 - offset))
        hi = seqlen_q
    return lo, hi


@inlined
def tile_full(r0, r1, k0, k1, seqlen_q, seqlen_k, offset, has_left, has_right, has_sinks, wl,
              wr, sinks):
    """Is every pair of rows [r0, r1) x keys [k0, k1) in range and visible through the flags?"""
    q_lo = r0 + offset
    q_hi = r1 - 1 + offset
    win = True
    if has_left:
        win = k0 >= q_hi - wl
    if has_right:
        win = win and k1 - 1 <= q_lo + wr
    if has_sinks:
        win = win or (k1 <= sinks and k1 - 1 <= q_lo)
    return win and r1 <= seqlen_q and k1 <= seqlen_k


@inlined
def pair_visible(row, kpos, seqlen_q, seqlen_k, offset, has_left, has_right, has_sinks, wl, wr,
                 sinks, kind, lts, lte, uts, ute, b, h, bits, mod):
    """Is (query row, key) visible: in range, through the flags and the mask object of
    ``kind``: INTERVALS, outside the key column's masked rows [lts, lte) and [uts, ute);
    BITMASK, its bit in ``bits`` (uint32 (Sq, ceil(Sk / 32))); MASK_MOD, the user's
    ``mod(b, h, q_idx, kv_idx)`` (both asked only for pairs in range)."""
    qpos = row + offset
    win = window_visible(kpos, qpos, wl, wr, sinks, has_left, has_right, has_sinks)
    if kind == INTERVALS:
        win = win and (row < lts or row >= lte) and (row < uts or row >= ute)
    vis = win and row < seqlen_q and kpos < seqlen_k
    if kind == BITMASK:
        vis = vis and bit_visible(bits, row, kpos)
    elif kind == MASK_MOD:
        vis = vis and mod(b, h, qpos, kpos)
    return vis


@inlined
def column_bounds(kind, iv, kpos, seqlen_k, kbase=0):
    """The 4 interval bounds (lts, lte, uts, ute) of key column ``kpos`` (clamped into range;
    zeros, i.e. nothing masked, without intervals); ``iv`` holds columns from ``kbase`` on
    (a block's staged copy, ``stage_key_block``) or all of them (``kbase`` 0)."""
    if kind == INTERVALS:
        c = min(kpos, seqlen_k - 1) - kbase
        return int(iv[0, c]), int(iv[1, c]), int(iv[2, c]), int(iv[3, c])
    return 0, 0, 0, 0


MINMAX_ROWS = 8                 # a key tile's min/max values (tile_classes.MINMAX_FIELDS)


def stage_words(block_n: int) -> int:
    """32-bit words of shared memory ``stage_key_block`` fills for a ``block_n``-key block
    (reserved whatever the mask kind: at most 2 KB, no change of occupancy)."""
    return MINMAX_ROWS + 4 * block_n


@inlined
def stage_key_block(kind, mk_iv, mk_mm, ktile, k0, seqlen_k, dyn, off, bn, tid, nthreads):
    """A column-parallel block's mask intervals, copied once into shared memory (``dyn``: the
    int32 dynamic shared array, ``stage_words(bn)`` words from ``off``) so that its walk over
    query tiles reads no global memory for the mask: the key tile's 8 min/max values (``mm``
    (8, 1): tile classes) and its ``bn`` columns' 4 bounds (``iv`` (4, bn), column c = key
    k0 + c, clamped as ``column_bounds``). Returns ``(mm, iv, mtile)``: the views and the key
    tile index to classify with (0); kinds other than INTERVALS get the global arrays and
    ``ktile`` back. The caller synchronises the block before the first use."""
    if kind != INTERVALS:
        return mk_mm, mk_iv, ktile
    for i in range(tid, MINMAX_ROWS + 4 * bn, nthreads):
        if i < MINMAX_ROWS:
            dyn[off + i] = mk_mm[i, ktile]
        else:
            c = (i - MINMAX_ROWS) % bn
            dyn[off + i] = mk_iv[(i - MINMAX_ROWS) // bn, min(k0 + c, seqlen_k - 1)]
    return (shared_view(dyn, off, MINMAX_ROWS, 1), shared_view(dyn, off + MINMAX_ROWS, 4, bn),
            0)


@inlined
def tile_kind(kind, mm, tab, tb, qtile, ktile, r0, bm, k0, bn, seqlen_q, seqlen_k, has_left,
              has_right, has_sinks, wl, wr, sinks):
    """(skip, full) of rows [r0, r0 + bm) x keys [k0, k0 + bn) (query tile ``qtile``, key tile
    ``ktile``): the mask object's class (``masking.tile_class``: the min/max vectors ``mm`` of
    intervals, or the class table ``tab[tb]`` built for these tiles) intersected with the
    flags' fullness."""
    cls = FULL
    if kind != NONE:
        cls = tile_class(kind, mm, tab, tb, qtile, ktile, r0, min(r0 + bm, seqlen_q))
    full = tile_full(r0, r0 + bm, k0, k0 + bn, seqlen_q, seqlen_k, seqlen_k - seqlen_q,
                     has_left, has_right, has_sinks, wl, wr, sinks)
    return cls == SKIP, full and cls == FULL


@inlined
def block_sequence(varlen, cu_q, cu_k, b, total_q, total_k, seqlen_q, seqlen_k):
    """``(ab, q_off, k_off, seqlen_q, seqlen_k)`` of batch entry ``b``: the batch index of q, k,
    v and the outputs, the row offsets of its sequence and its lengths. A packed batch
    (``varlen``): batch index 0, offsets and lengths from ``cu_q`` / ``cu_k`` (clamped to the
    ``total_*`` rows and the launch's maximum lengths ``seqlen_*``); else ``b``, 0, 0 and the
    lengths as given."""
    if varlen:
        q_off, n_q = packed_sequence(cu_q, b, total_q, seqlen_q)
        k_off, n_k = packed_sequence(cu_k, b, total_k, seqlen_k)
        return 0, q_off, k_off, n_q, n_k
    return b, 0, 0, seqlen_q, seqlen_k


# The 16-bit dK / dV kernels' blocks go out in groups of (batch, head) rows (``key_block``): at
# most MAX_GROUP_HEADS, and no more than whose Q and dO (2 bytes each per element) fit in
# GROUP_QDO_BYTES of the 50 MB L2 (not schedule.L2_GROUP_BYTES, the forward's K / V budget)
GROUP_QDO_BYTES = 32 * 1024 * 1024
MAX_GROUP_HEADS = 8


@inlined
def key_block(q, k, heads_ratio, seqlen_q, seqlen_k, cu_q, cu_k, varlen):
    """``(ktile, b, h, hk, ab, q_off, k_off, seqlen_q, seqlen_k)`` of a column-parallel block of
    the 16-bit dK / dV kernels (grid: key tiles x B * Hq; q float16 / bfloat16): its key tile,
    batch entry, query head and that head's kv head, then ``block_sequence``'s batch index,
    row offsets and lengths.

    The blocks go out a group of (batch, head) rows at a time, key tile by key tile within the
    group (``schedule.tile_order``): the first key tiles of all the group's heads, the
    longest walks under causal-like masks, start before the short ones, so the grid does not
    end on a few long blocks (list scheduling, longest first), while the heads that run at once stay
    few enough for their Q and dO to stay in L2 (the forward's query tiles go out the same way:
    ``schedule.query_tile_of_block``). The grid has fewer than 2^32 blocks (launch/backward.py
    ``dkdv_grid``)."""
    u32 = np.uint32
    fit = u32(u32(GROUP_QDO_BYTES) // u32(4 * q.shape[3])) // u32(max(seqlen_q, 1))
    group = min(u32(MAX_GROUP_HEADS), max(u32(1), u32(fit)))
    block = u32(cuda.blockIdx.y) * u32(cuda.gridDim.x) + u32(cuda.blockIdx.x)
    # the forward's grouped order with ``group`` rows per group (a budget of ``group`` keys of
    # one row each); its place x counted from the first tile is the key tile
    _, ktile, row = tile_order_inlined(block, cuda.gridDim.x, cuda.gridDim.y, 1, 1, group)
    b = np.int64(u32(u32(row) // u32(q.shape[2])))
    h = row - b * q.shape[2]
    ab, q_off, k_off, seqlen_q, seqlen_k = block_sequence(varlen, cu_q, cu_k, b, q.shape[1],
                                                          k.shape[1], seqlen_q, seqlen_k)
    return ktile, b, h, h // heads_ratio, ab, q_off, k_off, seqlen_q, seqlen_k


@inlined
def block_table_and_slope(has_alibi, alibi, mk_tab, b, h, heads, dtype):
    """``(tb, slope)`` of the block (b, h) of ``heads`` query heads: its slab of the mask's
    class table (0 for a table shared by every batch entry and head) and its ALiBi slope as
    ``dtype`` (0 without ``has_alibi``; alibi (1 or B, Hq))."""
    tb = min(b * heads + h, mk_tab.shape[0] - 1)
    slope = dtype(0.0)
    if has_alibi:
        slope = dtype(alibi[min(b, alibi.shape[0] - 1), h])
    return tb, slope


@inlined
def load_tile(dst, src, b, r0, h, limit, tid, nthreads):
    """Cooperative copy of rows r0.. of ``src[b, :, h, :]`` into the shared tile ``dst`` (rows,
    at least W columns: a padded tile keeps its pad); rows at or past ``limit`` become zeros."""
    rows = dst.shape[0]
    cols = src.shape[3]
    for i in range(tid, rows * cols, nthreads):
        r = i // cols
        c = i - r * cols
        if r0 + r < limit:
            dst[r, c] = src[b, r0 + r, h, c]
        else:
            dst[r, c] = 0


@inlined
def load_rowvec(dst, src, b, h, r0, limit, tid, nthreads):
    """Cooperative copy of ``src[b, h, r0:r0 + len(dst)]`` into shared ``dst`` (zeros past
    ``limit``)."""
    for i in range(tid, dst.shape[0], nthreads):
        if r0 + i < limit:
            dst[i] = src[b, h, r0 + i]
        else:           # (not a conditional expression: int 0 and float32 unify to float64)
            dst[i] = 0


@inlined
def load_query_tile(qs, dos, ls, dls, q, dout, lse, delta, ab, q_off, b, h, r0, seqlen_q, tid,
                    nthreads):
    """Rows r0.. of Q and dO (rows ``q_off + r`` of batch entry ``ab``), with their lse and
    delta (entry ``b``, rows r), into shared memory (zeros past Sq)."""
    load_tile(qs, q, ab, q_off + r0, h, q_off + seqlen_q, tid, nthreads)
    load_tile(dos, dout, ab, q_off + r0, h, q_off + seqlen_q, tid, nthreads)
    load_rowvec(ls, lse, b, h, r0, seqlen_q, tid, nthreads)
    load_rowvec(dls, delta, b, h, r0, seqlen_q, tid, nthreads)


# load_share, zero and store_share stay inlined by Numba, not NVVM: with all three NVVM-inlined
# the fp32 / fp64 backward kernels came out ~300 integer instructions (SEL / ISETP / IADD3)
# longer; Numba-inlining them restores the old machine code (docs/perf-notes.md, "Compile time").
@cuda.jit(device=True, inline="always")
def load_share(dst, src, b, row, h, c0, n, ok):
    """This lane's share ``dst[:n] = src[b, row, h, c0:c0 + n]`` (zeros unless ``ok``)."""
    for e in range(n):
        if ok:
            dst[e] = src[b, row, h, c0 + e]
        else:
            dst[e] = 0


@cuda.jit(device=True, inline="always")   # see load_share
def zero(acc, n):
    for e in range(n):
        acc[e] = 0


@inlined
def dot_share(regs, tile, r, c0, n, lanes):
    """Dot product of a row split over ``lanes`` consecutive lanes (this lane: ``regs[:n]``
    against ``tile[r, c0:c0 + n]``); the xor butterfly leaves the same sum in every lane."""
    acc = regs[0] * tile[r, c0]
    for e in range(1, n):
        acc += regs[e] * tile[r, c0 + e]
    m = 1
    while m < lanes:
        acc += shfl_xor(acc, m)
        m *= 2
    return acc


@inlined
def axpy(acc, a, tile, r, c0, n):
    """``acc[:n] += a * tile[r, c0:c0 + n]``."""
    for e in range(n):
        acc[e] += a * tile[r, c0 + e]


@inlined
def grad_scores(qk, dp, lse_r, delta_r, scale, cap_in, cap_out, has_softcap, base2, has_alibi,
                bias):
    """(p, ds) of one pair from its q.k and dO.v: ``s = scale q.k`` (softcap:
    ``cap_out tanh(cap_in q.k)``), minus the ALiBi ``bias`` (``has_alibi``: slope times the
    distance, in s's base), ``p = exp(s - lse)``, ``ds = p (dp - delta)``, times ``1 - tanh^2``
    under softcap (the bias is constant in q.k). ``base2``: s and lse are in base 2 (exp2)."""
    t = cap_in * qk
    if has_softcap:
        t = math.tanh(t)
        s = cap_out * t
    else:
        s = scale * qk
    if has_alibi:
        s -= bias
    # s <= lse for every visible pair (p <= 1); the clamp only bounds pairs the caller masks
    # afterwards, whose exp could overflow (NaN still passes: min keeps a NaN first operand).
    x = min(s - lse_r, scale - scale)  # zero in the working float type (scale * 0 would be
    #                                    float64 for a float32 scale: int * float32 -> float64)
    if base2:
        p = exp2(np.float32(x))
    else:
        p = math.exp(x)
    ds = p * (dp - delta_r)
    if has_softcap:
        ds -= ds * t * t
    return p, ds


@cuda.jit(device=True, inline="always")   # see load_share
def store_share(dst, b, row, h, c0, acc, factor, n, ok):
    """``dst[b, row, h, c0:c0 + n] = factor * acc[:n]`` if ``ok``."""
    if ok:
        for e in range(n):
            dst[b, row, h, c0 + e] = acc[e] * factor


@inlined
def dq_atomic(dss, k, b, hk, k0, seqlen_k, dq_acc, r0, h, seqlen_q, scale, tid, nthreads):
    """``dq_acc[b, r0 + r, h, :] += scale * sum_j dss[r, j] k[b, k0 + j, hk, :]`` for the tile's
    rows, one atomic per element (K rows are read from global memory: L1-resident)."""
    rows, keys = dss.shape
    width = k.shape[3]
    nk = min(keys, seqlen_k - k0)
    for i in range(tid, rows * width, nthreads):
        r = i // width
        c = i - r * width
        if r0 + r < seqlen_q:
            acc = dss[r, 0] * k[b, k0, hk, c]
            for j in range(1, nk):
                acc += dss[r, j] * k[b, k0 + j, hk, c]
            cuda.atomic.add(dq_acc, (b, r0 + r, h, c), acc * scale)


# ----------------------------------------------------------------------------- small kernels
def make_preprocess_kernel(half: bool, is_bf16: bool, is_f64: bool, varlen: bool = False):
    """``delta = rowsum(dout * out)`` and the lse in the kernels' layout and base.

    Kernel ``(out, dout, lse, delta, lse2, cu_q, max_seqlen_q)``: out, dout (B, Sq, Hq, W) in
    the working dtype (``half``: uint32 words of two float16 / bfloat16, W = D / 2); lse (B, Hq,
    Sq) natural log; delta and lse2 (B, Hq, SqP) float32 (float64 when ``is_f64``), SqP >= Sq a
    multiple of ``ROW_PAD`` so that the kernels copy whole 16-byte groups of them: ``lse2 = lse
    * log2 e`` (``half``; the lse itself otherwise), and for the pad rows delta 0 and lse2 +inf
    (P = 0 there). ``varlen``: out, dout (1, total_q, Hq, W) and lse (1, Hq, total_q) are packed
    (sequence b at rows ``cu_q[b]..``, int32 cu_q (B + 1,), at most ``max_seqlen_q`` rows), and
    delta / lse2 get each sequence's rows from 0 (what the main kernels read). Grid
    ``(ceil(SqP / PRE_ROWS), B * Hq)``, ``PRE_THREADS`` threads: ``PRE_LANES`` lanes per row,
    each reading every PRE_LANES-th word (a group's loads cover whole 32-byte sectors), summed
    by shuffles.
    """
    HALF, BF16, VARLEN = bool(half), bool(is_bf16), bool(varlen)
    npdt = np.float64 if is_f64 else np.float32
    LSE_FACTOR = LOG2E if HALF else 1.0

    def kernel(out, dout, lse, delta, lse2, cu_q, max_seqlen_q):
        heads = out.shape[2]
        b = cuda.blockIdx.y // heads
        h = cuda.blockIdx.y % heads
        part = cuda.threadIdx.x % PRE_LANES
        row = cuda.blockIdx.x * PRE_ROWS + cuda.threadIdx.x // PRE_LANES
        ab, q_off, _, n_rows, _ = block_sequence(VARLEN, cu_q, cu_q, b, out.shape[1], 0,
                                                 max_seqlen_q, 0)
        if not VARLEN:
            n_rows = out.shape[1]
        src = q_off + row
        acc = npdt(0.0)
        if row < n_rows:
            for w in range(part, out.shape[3], PRE_LANES):
                if HALF:
                    o0, o1 = unpack16(BF16, out[ab, src, h, w])
                    d0, d1 = unpack16(BF16, dout[ab, src, h, w])
                    acc += o0 * d0 + o1 * d1
                else:
                    acc += out[ab, src, h, w] * dout[ab, src, h, w]
        for m in PRE_SHUFFLES:      # the row's PRE_LANES lanes (every lane takes part)
            acc += shfl_xor(acc, m)
        if part == 0 and row < delta.shape[2]:
            if row < n_rows:
                delta[b, h, row] = acc
                lse2[b, h, row] = lse[ab, h, src] * npdt(LSE_FACTOR)
            else:
                delta[b, h, row] = 0
                lse2[b, h, row] = math.inf

    return jit_kernel(kernel, ("bwd_pre", HALF, BF16, bool(is_f64), VARLEN))


def make_reduce_kernel(half: bool, is_bf16: bool):
    """Sum of per-query-head partials over each group, in head order, to the output dtype.

    Kernel ``(acc, dst, ratio)``: acc (B, S, Hq, D) float32 / float64, dst (B, S, Hq / ratio, W)
    (``half``: uint32 words of two 16-bit values, W = D / 2). 1-D grid over dst's elements,
    ``REDUCE_THREADS`` threads per block.
    """
    HALF, BF16 = bool(half), bool(is_bf16)

    def kernel(acc, dst, ratio):
        nb, ns, nh, nw = dst.shape
        i = cuda.grid(1)
        if i >= nb * ns * nh * nw:
            return
        w = i % nw
        h = (i // nw) % nh
        s = (i // (nw * nh)) % ns
        b = i // (nw * nh * ns)
        per = 2 if HALF else 1
        x0 = acc[b, s, h * ratio, w * per]
        x1 = acc[b, s, h * ratio, w * per + per - 1]
        for g in range(1, ratio):
            x0 += acc[b, s, h * ratio + g, w * per]
            x1 += acc[b, s, h * ratio + g, w * per + per - 1]
        if HALF:
            dst[b, s, h, w] = pack16(BF16, x0, x1)
        else:
            dst[b, s, h, w] = x0

    return jit_kernel(kernel, ("bwd_reduce", HALF, BF16))


def make_convert_kernel(half: bool, is_bf16: bool):
    """The reduce kernel's group-of-one case on flat arrays: ``dst[i]`` = ``acc[2 i], acc[2 i +
    1]`` rounded to two 16-bit values in one word (``half``), else ``acc[i]``. Kernel ``(acc,
    dst)``, both 1-D and contiguous (the dQ accumulator and a C-contiguous dq); a 1-D grid of
    ``REDUCE_THREADS``: no per-element index arithmetic."""
    HALF, BF16 = bool(half), bool(is_bf16)

    def kernel(acc, dst):
        i = cuda.grid(1)
        if i < dst.shape[0]:
            if HALF:
                dst[i] = pack16(BF16, acc[2 * i], acc[2 * i + 1])
            else:
                dst[i] = acc[i]

    return jit_kernel(kernel, ("bwd_convert", HALF, BF16))


# ----------------------------------------------------------------------------- CUDA-core path
def fma_layout(head_dim: int, itemsize: int):
    """(lanes per key / row, keys (rows) owned per block, rows (keys) per streamed tile) of the
    float32 / float64 kernels: 2 lanes up to head_dim 32, then head_dim / 16 rounded down to a
    power of two (lanes must divide the warp), at most 8; 32 owned rows; streamed tiles of Q and
    dO (K and V) within 32 KB of shared memory."""
    lanes = 1 << (min(8, max(2, head_dim // 16)).bit_length() - 1)
    stream = max(8, min(32, 16384 // (head_dim * itemsize)))
    return lanes, 32, stream


def make_fma_dkdv_kernel(head_dim: int, is_f64: bool, has_left: bool, has_right: bool,
                         has_sinks: bool, has_softcap: bool, atomic_dq: bool,
                         mask_kind: int = NONE, lanes: int = 0, block_n: int = 0,
                         block_m: int = 0, mask_mod=None, has_alibi: bool = False,
                         varlen: bool = False):
    """Column-parallel dK / dV (and with ``atomic_dq`` dQ) kernel, float32 or float64.

    Kernel ``(q, k, v, dout, lse, delta, dq_acc, dk_acc, dv_acc, seqlen_q, seqlen_k,
    heads_ratio, scale, cap_in, cap, window_left, window_right, sinks, mk_iv, mk_mm, mk_tab,
    mk_bits, alibi, cu_q, cu_k)``:
    q, dout (B, Sq, Hq, D), k, v (B, Sk, Hkv, D) in the working dtype; lse, delta (B, Hq, Sq)
    (natural log; float32 lse is fine for float64); dq_acc (B, Sq, Hq, D) working dtype, zeroed,
    atomically accumulated (unused without ``atomic_dq``); dk_acc, dv_acc (B, Sk, Hq, D) written
    (the outputs themselves when Hq == Hkv); mk_iv int32 (4, Sk) intervals, mk_mm int32
    (8, ceil(Sk / block_n)) their min/max (``tiles.tile_minmax`` with ``block_n``); mk_tab
    int8 (1 or B * Hq, ceil(Sq / block_m), ceil(Sk / block_n)) the class table and mk_bits
    uint32 (Sq, ceil(Sk / 32)) the words of a bitmask (``mask_kind`` BITMASK; the table also
    for MASK_MOD, whose function ``mask_mod`` is compiled in); alibi float32 (1 or B, Hq)
    slopes (``has_alibi``). Scalars: scale, cap_in = scale / softcap, cap = softcap in the
    working dtype. ``varlen``: a packed batch (``block_sequence``): q, dout, dq_acc (1, total_q,
    Hq, D), k, v (1, total_k, Hkv, D), dk_acc, dv_acc (1, total_k, Hq, D), sequence b at the rows
    of int32 cu_q / cu_k (B + 1,), seqlen_q / seqlen_k the maximum lengths; lse and delta
    (B, Hq, SqP) from the preprocess kernel (each sequence's rows from 0).

    Geometry (``fma_layout``; overridable for tests): ``lanes`` consecutive lanes share a key,
    each holding head_dim / lanes elements of k, v, dk, dv in registers; ``block_n`` keys per
    block (``lanes * block_n`` threads); query tiles of ``block_m`` rows of Q, dO, lse, delta
    (and dS for atomic dQ) in shared memory. Grid ``(ceil(Sk / block_n), B * Hq)``.
    """
    D = int(head_dim)
    ITEM = 8 if is_f64 else 4
    L0, N0, M0 = fma_layout(D, ITEM)
    TP, BN, BM = (int(x) for x in (lanes or L0, block_n or N0, block_m or M0))
    NT, E = TP * BN, D // TP
    assert D % TP == 0 and 32 % TP == 0 and NT % 32 == 0, (D, TP, BN)
    dt = types.float64 if is_f64 else types.float32
    npdt = np.float64 if is_f64 else np.float32
    KIND, ATOMIC, ALIBI = int(mask_kind), bool(atomic_dq), bool(has_alibi)
    VARLEN = bool(varlen)
    flags = (has_left, has_right, has_sinks)
    mod = mask_mod_device(mask_mod)

    def kernel(q, k, v, dout, lse, delta, dq_acc, dk_acc, dv_acc, seqlen_q, seqlen_k,
               heads_ratio, scale, cap_in, cap, wl, wr, sinks, mk_iv, mk_mm, mk_tab, mk_bits,
               alibi, cu_q, cu_k):
        ktile = cuda.blockIdx.x
        b = cuda.blockIdx.y // q.shape[2]
        h = cuda.blockIdx.y % q.shape[2]
        hk = h // heads_ratio
        tid = cuda.threadIdx.x
        c0 = (tid % TP) * E
        k0 = ktile * BN
        ab, q_off, k_off, seqlen_q, seqlen_k = block_sequence(
            VARLEN, cu_q, cu_k, b, q.shape[1], k.shape[1], seqlen_q, seqlen_k)
        if VARLEN and k0 >= seqlen_k:
            return
        key = k0 + tid // TP
        offset = seqlen_k - seqlen_q
        tb, slope = block_table_and_slope(ALIBI, alibi, mk_tab, b, h, q.shape[2], npdt)
        qs = cuda.shared.array((BM, D), dt)
        dos = cuda.shared.array((BM, D), dt)
        ls = cuda.shared.array(BM, dt)
        dls = cuda.shared.array(BM, dt)
        dss = cuda.shared.array((BM, BN), dt)
        kr = cuda.local.array(E, dt)
        vr = cuda.local.array(E, dt)
        dk = cuda.local.array(E, dt)
        dv = cuda.local.array(E, dt)
        load_share(kr, k, ab, k_off + key, hk, c0, E, key < seqlen_k)
        load_share(vr, v, ab, k_off + key, hk, c0, E, key < seqlen_k)
        zero(dk, E)
        zero(dv, E)
        lts, lte, uts, ute = column_bounds(KIND, mk_iv, key, seqlen_k)
        lo, hi = query_rows(k0, min(k0 + BN, seqlen_k), seqlen_q, offset, has_left, has_right,
                            has_sinks, wl, wr, sinks)
        for qt in range(lo // BM, (hi + BM - 1) // BM if hi > lo else 0):
            r0 = qt * BM
            skip, full = tile_kind(KIND, mk_mm, mk_tab, tb, qt, ktile, r0, BM, k0, BN, seqlen_q,
                                   seqlen_k, has_left, has_right, has_sinks, wl, wr, sinks)
            if skip:
                continue
            cuda.syncthreads()      # every thread is done with the previous tile
            load_query_tile(qs, dos, ls, dls, q, dout, lse, delta, ab, q_off, b, h, r0, seqlen_q,
                            tid, NT)
            cuda.syncthreads()
            for r in range(BM):
                p, ds = grad_scores(dot_share(kr, qs, r, c0, E, TP),
                                    dot_share(vr, dos, r, c0, E, TP), ls[r], dls[r], scale,
                                    cap_in, cap, has_softcap, False, ALIBI,
                                    slope * npdt(abs(r0 + r + offset - key)))
                if not full and not pair_visible(r0 + r, key, seqlen_q, seqlen_k, offset,
                                                 has_left, has_right, has_sinks, wl, wr, sinks,
                                                 KIND, lts, lte, uts, ute, b, h, mk_bits, mod):
                    p = npdt(0.0)
                    ds = npdt(0.0)
                axpy(dv, p, dos, r, c0, E)
                axpy(dk, ds, qs, r, c0, E)
                if ATOMIC and c0 == 0:
                    dss[r, tid // TP] = ds
            if ATOMIC:
                cuda.syncthreads()
                dq_atomic(dss, k, ab, hk, k_off + k0, k_off + seqlen_k, dq_acc, q_off + r0, h,
                          q_off + seqlen_q, scale, tid, NT)
        store_share(dk_acc, ab, k_off + key, h, c0, dk, scale, E, key < seqlen_k)
        store_share(dv_acc, ab, k_off + key, h, c0, dv, npdt(1.0), E, key < seqlen_k)

    return jit_kernel(kernel, ("bwd_fma_dkdv", D, bool(is_f64), *flags, has_softcap, ATOMIC,
                               KIND, TP, BN, BM, ALIBI, VARLEN), cache=mask_mod is None)


def make_fma_dq_kernel(head_dim: int, is_f64: bool, has_left: bool, has_right: bool,
                       has_sinks: bool, has_softcap: bool, mask_kind: int = NONE,
                       lanes: int = 0, block_m: int = 0, block_n: int = 0, mask_mod=None,
                       has_alibi: bool = False, varlen: bool = False):
    """Row-parallel dQ kernel (deterministic mode), float32 or float64.

    Kernel ``(q, k, v, dout, lse, delta, dq, seqlen_q, seqlen_k, heads_ratio, scale, cap_in, cap,
    window_left, window_right, sinks, mk_iv, mk_mm, mk_tab, mk_bits, alibi, cu_q, cu_k)``:
    arrays (and ``varlen``) as in ``make_fma_dkdv_kernel``, dq (B, Sq, Hq, D) written; mk_mm
    and mk_tab for tiles of ``block_m`` rows and ``block_n`` keys.

    Geometry: the dual of the dK / dV kernel: ``lanes`` lanes share a query row (q, dO, dq in
    registers), ``block_m`` rows per block (``lanes * block_m`` threads), key tiles of
    ``block_n`` K and V rows in shared memory. Grid ``(ceil(Sq / block_m), B * Hq)``.
    """
    D = int(head_dim)
    ITEM = 8 if is_f64 else 4
    L0, M0, N0 = fma_layout(D, ITEM)
    TP, BM, BN = (int(x) for x in (lanes or L0, block_m or M0, block_n or N0))
    NT, E = TP * BM, D // TP
    assert D % TP == 0 and 32 % TP == 0 and NT % 32 == 0, (D, TP, BM)
    dt = types.float64 if is_f64 else types.float32
    npdt = np.float64 if is_f64 else np.float32
    KIND, ALIBI, VARLEN = int(mask_kind), bool(has_alibi), bool(varlen)
    flags = (has_left, has_right, has_sinks)
    mod = mask_mod_device(mask_mod)

    def kernel(q, k, v, dout, lse, delta, dq, seqlen_q, seqlen_k, heads_ratio, scale, cap_in,
               cap, wl, wr, sinks, mk_iv, mk_mm, mk_tab, mk_bits, alibi, cu_q, cu_k):
        qtile = cuda.blockIdx.x
        b = cuda.blockIdx.y // q.shape[2]
        h = cuda.blockIdx.y % q.shape[2]
        hk = h // heads_ratio
        tid = cuda.threadIdx.x
        c0 = (tid % TP) * E
        r0 = qtile * BM
        ab, q_off, k_off, seqlen_q, seqlen_k = block_sequence(
            VARLEN, cu_q, cu_k, b, q.shape[1], k.shape[1], seqlen_q, seqlen_k)
        if VARLEN and r0 >= seqlen_q:
            return
        r1 = min(r0 + BM, seqlen_q)
        row = r0 + tid // TP
        ok = row < seqlen_q
        offset = seqlen_k - seqlen_q
        tb, slope = block_table_and_slope(ALIBI, alibi, mk_tab, b, h, q.shape[2], npdt)
        ks = cuda.shared.array((BN, D), dt)
        vs = cuda.shared.array((BN, D), dt)
        qr = cuda.local.array(E, dt)
        dor = cuda.local.array(E, dt)
        dq_r = cuda.local.array(E, dt)
        load_share(qr, q, ab, q_off + row, h, c0, E, ok)
        load_share(dor, dout, ab, q_off + row, h, c0, E, ok)
        zero(dq_r, E)
        lse_r = lse[b, h, min(row, seqlen_q - 1)]
        delta_r = delta[b, h, min(row, seqlen_q - 1)]
        tile_lo, tile_hi, tile, last, sink_tiles = key_tiles(
            r0 + offset, r1 - 1 + offset, seqlen_k, BN, has_left, has_right, has_sinks, wl, wr,
            sinks)
        while tile <= last:
            k0 = tile * BN
            skip, full = tile_kind(KIND, mk_mm, mk_tab, tb, qtile, tile, r0, BM, k0, BN,
                                   seqlen_q, seqlen_k, has_left, has_right, has_sinks, wl, wr,
                                   sinks)
            if not skip:
                cuda.syncthreads()
                load_tile(ks, k, ab, k_off + k0, hk, k_off + seqlen_k, tid, NT)
                load_tile(vs, v, ab, k_off + k0, hk, k_off + seqlen_k, tid, NT)
                cuda.syncthreads()
                for c in range(BN):
                    lts, lte, uts, ute = column_bounds(KIND, mk_iv, k0 + c, seqlen_k)
                    p, ds = grad_scores(dot_share(qr, ks, c, c0, E, TP),
                                        dot_share(dor, vs, c, c0, E, TP), lse_r, delta_r, scale,
                                        cap_in, cap, has_softcap, False, ALIBI,
                                        slope * npdt(abs(row + offset - k0 - c)))
                    if full or pair_visible(row, k0 + c, seqlen_q, seqlen_k, offset, has_left,
                                            has_right, has_sinks, wl, wr, sinks, KIND, lts, lte,
                                            uts, ute, b, h, mk_bits, mod):
                        axpy(dq_r, ds, ks, c, c0, E)
            tile = past_sinks(tile + 1, tile_lo, sink_tiles, has_sinks)
        store_share(dq, ab, q_off + row, h, c0, dq_r, scale, E, ok)

    return jit_kernel(kernel, ("bwd_fma_dq", D, bool(is_f64), *flags, has_softcap, KIND, TP,
                               BM, BN, ALIBI, VARLEN), cache=mask_mod is None)


# ----------------------------------------------------------------------------- tensor-core path
# Fragments (primitives/mma.py's module docstring): a warp's 16 x 8 accumulator n-tile j holds, in lane
# (g, t) = (lane >> 2, lane & 3), element e of rows g + 8 (e >> 1), columns 8 j + 2 t + (e & 1).
# Pairs of n-tiles packed to 16 bits are A fragments of the next product (P never leaves
# registers); with S^T = K Q^T the accumulator of a key tile's warp is P^T, the A operand of
# dV += P^T dO, and dS^T the A operand of dK += dS^T Q.
def mma_layout(head_dim: int):
    """(warps, keys owned per block, rows per streamed query tile) of the 16-bit dK / dV
    kernel. Up to head_dim 128: 8 warps own 16 keys each, 128 keys (as FlashAttention-2's: half
    the dQ atomics and Q / dO traffic of 64) and stream 64-row query tiles, double-buffered in
    dynamic shared memory (``mma_dkdv_smem_bytes``: 157 KiB at 128, one block per SM; 93 KiB at
    64, two); each tile is worked in 16-row slices so that the per-warp fragment arrays stay
    small and in registers. head_dim 160-256 (multiples of 32): the dK / dV accumulators of 16
    keys by the whole head would fill a warp's registers, so two warps share 16 keys, each
    accumulating half the head's columns (``mma_dsplit``): 8 warps, 64 keys, 32-row tiles.
    Other head dims above 128: one warp, 16 keys, 16-row tiles."""
    if head_dim <= 128:
        return 8, 128, 64
    if head_dim % 32 == 0:
        return 8, 64, 32
    return 1, 16, 16


def dq_chunk(head_dim: int, m_tiles: int = 1, warps: int = 1) -> int:
    """Columns of one unit of the dK / dV kernel's atomic dQ product, whose (m-tile, column
    chunk) units are dealt to the warps: the largest of 64, 48, 32, 16 that divides head_dim
    (units must tile the head exactly; 64 columns bound a unit's accumulator registers) and
    still gives every warp a unit (at head_dim 64, 64-row tiles: 32 columns, eight units for
    eight warps rather than four), else the smallest that divides it."""
    fits = [c for c in (64, 48, 32, 16) if head_dim % c == 0]
    return next((c for c in fits if m_tiles * (head_dim // c) >= warps), fits[-1])


def mma_dsplit(warps: int, block_n: int) -> int:
    """Warps sharing each 16 owned keys (each accumulates dK / dV for 1 / dsplit of the head's
    columns): 1, or 2 when a block owns 8 keys per warp."""
    return 16 * warps // block_n


def mma_dq_layout(head_dim: int):
    """(warps, rows owned per block = 16 x warps, keys per streamed tile) of the 16-bit
    row-parallel dQ kernel (deterministic mode; static shared memory): 32-key tiles up to
    head_dim 96, 16 up to 128, one warp beyond."""
    if head_dim <= 96:
        return 4, 64, 32
    if head_dim <= 128:
        return 4, 64, 16
    return 1, 16, 16


def _padded(words: int) -> int:
    """Row length in 32-bit words of a shared tile read by ldmatrix: 4 words (16 bytes) of pad
    put the 8 rows of one 8x8 matrix in 8 different bank groups (no conflicts)."""
    return words + 4


def mma_dkdv_smem_bytes(head_dim: int, warps: int, block_m: int, block_n: int = 0) -> int:
    """Dynamic shared memory of the 16-bit dK / dV kernel: K, V (``block_n`` rows, default 16
    per warp), two buffers of Q, dO (block_m rows) and of their base-2 lse and delta, and dS^T
    (keys x block_m / 2 words), and the staged mask intervals (``stage_words``)."""
    bn, dwp = block_n or 16 * warps, _padded(head_dim // 2)
    return 4 * (2 * bn * dwp + 4 * block_m * dwp + bn * _padded(block_m // 2) + 4 * block_m
                + stage_words(bn))


@inlined
def mma_pair(acc, o, is_bf16, a0, a1, a2, a3, b0, b1, b2, b3):
    """Two 16 x 8 n-tiles ``acc[o:o + 4]`` (B fragment b0, b1) and ``acc[o + 4:o + 8]``
    (b2, b3) += A B for one warp."""
    acc[o], acc[o + 1], acc[o + 2], acc[o + 3] = mma16(
        is_bf16, a0, a1, a2, a3, b0, b1, acc[o], acc[o + 1], acc[o + 2], acc[o + 3])
    acc[o + 4], acc[o + 5], acc[o + 6], acc[o + 7] = mma16(
        is_bf16, a0, a1, a2, a3, b2, b3, acc[o + 4], acc[o + 5], acc[o + 6], acc[o + 7])


@inlined
def mma_abt(acc, is_bf16, a_tile, a_row, b_tile, b_row, n_pairs, ksteps, lane):
    """``acc`` = A B^T for one warp: A = 16 rows of ``a_tile`` from ``a_row``, B = rows
    b_row .. b_row + 16 n_pairs of ``b_tile`` (both [row][k] word tiles, k = 16 ksteps); n-tile
    j in ``acc[4 j:4 j + 4]``."""
    v_row = ((lane >> 3) & 1) * 8 + (lane & 7)
    v_col = (lane >> 4) * 4
    # B's matrices in the order the two n-tiles' mma operands take them, (rows 0-7, k 0-7),
    # (0-7, k 8-15), (8-15, k 0-7), (8-15, k 8-15), so each operand pair is two consecutive
    # registers of the load (another order costs register moves before every mma).
    b_row_lane = (lane >> 4) * 8 + (lane & 7)
    b_col_lane = ((lane >> 3) & 1) * 4
    for i in range(8 * n_pairs):
        acc[i] = 0
    for kk in range(ksteps):
        # A's matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (0-7, 8-15), (8-15, 8-15)
        a0, a1, a2, a3 = ldmatrix_x4_a32(a_tile, a_row + v_row, kk * 8 + v_col)
        for jj in range(n_pairs):
            b0, b1, b2, b3 = ldmatrix_x4_a32(b_tile, b_row + jj * 16 + b_row_lane,
                                             kk * 8 + b_col_lane)
            mma_pair(acc, 8 * jj, is_bf16, a0, a1, a2, a3, b0, b1, b2, b3)


@inlined
def mma_pb(acc, is_bf16, pk, b_tile, b_row, ksteps, n_pairs, col0, lane):
    """``acc`` += A B for one warp: A from packed fragments ``pk`` (16 rows x 16 ksteps),
    B = rows b_row .. b_row + 16 ksteps, word columns col0 .. col0 + 8 n_pairs of the [k][n]
    word tile ``b_tile`` (ldmatrix.trans)."""
    v_row = ((lane >> 3) & 1) * 8 + (lane & 7)
    v_col = (lane >> 4) * 4
    for kb in range(ksteps):
        for dd in range(n_pairs):
            b0, b1, b2, b3 = ldmatrix_x4_trans_a32(b_tile, b_row + kb * 16 + v_row,
                                               col0 + dd * 8 + v_col)
            mma_pair(acc, 8 * dd, is_bf16, pk[4 * kb], pk[4 * kb + 1], pk[4 * kb + 2],
                     pk[4 * kb + 3], b0, b1, b2, b3)


@inlined
def transposed_fragments(pk, ts, row_word, ksteps, lane):
    """A fragments of M (16 rows x 16 ksteps keys) from the shared word tile ``ts`` holding
    M^T ([key][row pair]; M's rows from word ``row_word``), by ldmatrix.trans."""
    # lanes 8-15 address M's rows 8-15 and lanes 16-23 its keys 8-15, so the four matrices
    # arrive in A-fragment order (a0, a1, a2, a3): consecutive registers, no moves
    t_row = (lane >> 4) * 8 + (lane & 7)
    t_col = ((lane >> 3) & 1) * 4
    for kb in range(ksteps):
        a0, a1, a2, a3 = ldmatrix_x4_trans_a32(ts, kb * 16 + t_row, row_word + t_col)
        pk[4 * kb] = a0
        pk[4 * kb + 1] = a1
        pk[4 * kb + 2] = a2
        pk[4 * kb + 3] = a3


@inlined
def probs_grads(st, dpt, pkp, pkd, n_tiles, lane, transposed, own0, r0, k0, ls, dls, lbuf,
                scale_log2, cap_in, cap_log2, has_softcap, is_bf16, full, where, has_left,
                has_right, has_sinks, kind, mk_iv, mk_bits, mod, has_alibi, slope_log2):
    """P and dS of a warp's score fragments ``st`` (S, or S^T when ``transposed``) and ``dpt``
    (dP or dP^T), packed to 16-bit A fragments ``pkp`` / ``pkd``. Fragment rows are the warp's
    own 16 (from ``own0`` in the tile), columns the streamed tile's; query row r0 + i has its
    base-2 lse and its delta at ``ls[lbuf, i]`` / ``dls[lbuf, i]`` (shared; lbuf: the buffer
    and row offset as one flat index base, see ``row_stats``). Masked pairs give 0; ``where``:
    the block's (seqlen_q, seqlen_k, window_left, window_right, sinks, b, h) (one argument: a
    call of more than 30 arguments is compiled as ``f(*args)``, which Numba cannot inline), the
    mask arguments as in ``pair_visible``, except that a transposed call with INTERVALS passes
    its block's staged copy as ``mk_iv`` (columns from k0: ``stage_key_block``);
    ``has_alibi``: scores less ``slope_log2`` times the distance.

    Full tiles take a branch without the mask tests: selected per pair, they ran on every tile
    (if-converted by the compiler), on the critical path between the score products and the
    gradient products."""
    if full:
        probs_grads_as(st, dpt, pkp, pkd, n_tiles, lane, transposed, own0, r0, k0, ls, dls, lbuf,
                       scale_log2, cap_in, cap_log2, has_softcap, is_bf16, True, where,
                       has_left, has_right, has_sinks, kind, mk_iv, mk_bits, mod, has_alibi,
                       slope_log2)
    else:
        probs_grads_as(st, dpt, pkp, pkd, n_tiles, lane, transposed, own0, r0, k0, ls, dls, lbuf,
                       scale_log2, cap_in, cap_log2, has_softcap, is_bf16, False, where,
                       has_left, has_right, has_sinks, kind, mk_iv, mk_bits, mod, has_alibi,
                       slope_log2)


@inlined
def probs_grads_as(st, dpt, pkp, pkd, n_tiles, lane, transposed, own0, r0, k0, ls, dls, lbuf,
                   scale_log2, cap_in, cap_log2, has_softcap, is_bf16, full, where, has_left,
                   has_right, has_sinks, kind, mk_iv, mk_bits, mod, has_alibi, slope_log2):
    """``probs_grads`` with ``full`` a constant of the call site."""
    # a transposed fragment's keys are the lane's two (rows g, g + 8): their visible rows,
    # once (flags and intervals; bitmask / mask_mod pairs are tested one by one)
    key_masks = key_pair_rows(transposed and not full and row_mask_kind(kind), kind, where,
                              mk_iv, k0, own0 + (lane >> 2), r0, lane, has_left, has_right,
                              has_sinks)
    # n-tiles one call each, not a loop: NVVM's unroller left such a loop rolled in some
    # kernels, which puts the fragments in local memory. n_tiles is 1, 2, 4 or 8 (no assert:
    # in device code it compiles to a runtime test and an exception path)
    probs_tile(0, st, dpt, pkp, pkd, lane, transposed, own0, r0, k0, ls, dls, lbuf, scale_log2,
               cap_in, cap_log2, has_softcap, is_bf16, full, where, has_left, has_right, has_sinks,
               kind, mk_iv, key_masks, mk_bits, mod, has_alibi, slope_log2)
    if n_tiles > 1:
        probs_tile(1, st, dpt, pkp, pkd, lane, transposed, own0, r0, k0, ls, dls, lbuf, scale_log2,
                   cap_in, cap_log2, has_softcap, is_bf16, full, where, has_left, has_right,
                   has_sinks, kind, mk_iv, key_masks, mk_bits, mod, has_alibi, slope_log2)
    if n_tiles > 2:
        probs_tile(2, st, dpt, pkp, pkd, lane, transposed, own0, r0, k0, ls, dls, lbuf, scale_log2,
                   cap_in, cap_log2, has_softcap, is_bf16, full, where, has_left, has_right,
                   has_sinks, kind, mk_iv, key_masks, mk_bits, mod, has_alibi, slope_log2)
        probs_tile(3, st, dpt, pkp, pkd, lane, transposed, own0, r0, k0, ls, dls, lbuf, scale_log2,
                   cap_in, cap_log2, has_softcap, is_bf16, full, where, has_left, has_right,
                   has_sinks, kind, mk_iv, key_masks, mk_bits, mod, has_alibi, slope_log2)
    if n_tiles > 4:
        probs_tile(4, st, dpt, pkp, pkd, lane, transposed, own0, r0, k0, ls, dls, lbuf, scale_log2,
                   cap_in, cap_log2, has_softcap, is_bf16, full, where, has_left, has_right,
                   has_sinks, kind, mk_iv, key_masks, mk_bits, mod, has_alibi, slope_log2)
        probs_tile(5, st, dpt, pkp, pkd, lane, transposed, own0, r0, k0, ls, dls, lbuf, scale_log2,
                   cap_in, cap_log2, has_softcap, is_bf16, full, where, has_left, has_right,
                   has_sinks, kind, mk_iv, key_masks, mk_bits, mod, has_alibi, slope_log2)
        probs_tile(6, st, dpt, pkp, pkd, lane, transposed, own0, r0, k0, ls, dls, lbuf, scale_log2,
                   cap_in, cap_log2, has_softcap, is_bf16, full, where, has_left, has_right,
                   has_sinks, kind, mk_iv, key_masks, mk_bits, mod, has_alibi, slope_log2)
        probs_tile(7, st, dpt, pkp, pkd, lane, transposed, own0, r0, k0, ls, dls, lbuf, scale_log2,
                   cap_in, cap_log2, has_softcap, is_bf16, full, where, has_left, has_right,
                   has_sinks, kind, mk_iv, key_masks, mk_bits, mod, has_alibi, slope_log2)


@inlined
def low_bits(n):
    """uint64 with its n low bits set (0 <= n <= 64)."""
    if n <= 0:
        return np.uint64(0)
    return ~np.uint64(0) >> np.uint64(64 - n)


@inlined
def row_bits(lo, hi, r0):
    """uint64: bit i set where row r0 + i (i < 64) lies in [lo, hi)."""
    return low_bits(min(max(hi - r0, 0), 64)) & ~low_bits(min(max(lo - r0, 0), 64))


@inlined
def key_rows(kpos, r0, where, has_left, has_right, has_sinks, kind, iv, kbase):
    """uint64: bit i set where query row r0 + i sees key ``kpos`` (``pair_visible`` for kinds
    NONE and INTERVALS, a key at a time): for one key the flags leave one run of rows
    (bottom-right aligned: the window's [key - right, key + left] less the offset; a sink, every
    row from its own position on), cut to the sequence, less the key's two masked intervals
    (``iv``, columns from ``kbase``). As the callers' flags guarantee: window left >= 0 with
    ``has_left``, right >= 0 with ``has_right``, ``has_sinks`` only with ``has_left``."""
    seqlen_q, seqlen_k, wl, wr, sinks, b, h = where
    offset = seqlen_k - seqlen_q
    lo = 0
    hi = seqlen_q
    if has_right:
        lo = max(lo, kpos - wr - offset)
    if has_left:
        hi = min(hi, kpos + wl - offset + 1)
    if has_sinks and kpos < sinks:   # the window's rows and every row from the key's own on
        lo = min(lo, max(kpos - offset, 0))
        hi = seqlen_q
    bits = row_bits(lo, hi, r0)
    if kpos >= seqlen_k:
        bits = np.uint64(0)
    if kind == INTERVALS:
        lts, lte, uts, ute = column_bounds(kind, iv, kpos, seqlen_k, kbase)
        bits &= ~(row_bits(lts, lte, r0) | row_bits(uts, ute, r0))
    return bits


@inlined
def row_mask_kind(kind):
    """Whether ``probs_grads`` tests a transposed fragment's pairs against its keys' row masks
    (``key_pair_rows``: flags and interval masks) rather than one by one (``pair_visible``)."""
    return kind == NONE or kind == INTERVALS


@inlined
def key_pair_rows(load, kind, where, iv, k0, own, r0, lane, has_left, has_right, has_sinks):
    """The visible rows (``key_rows``) of a transposed fragment's two keys k0 + own and
    k0 + own + 8 (``own``: the warp's first key plus lane >> 2) over tile rows r0.., shifted
    so that bit 8 j + c is the lane's column 8 j + 2 (lane & 3) + c; zeros unless ``load``.
    ``iv``: the block's staged intervals."""
    rows_key0 = np.uint64(0)
    rows_key8 = np.uint64(0)
    if load:
        shift = np.uint64(2 * (lane & 3))
        rows_key0 = key_rows(k0 + own, r0, where, has_left, has_right, has_sinks, kind, iv,
                             k0) >> shift
        rows_key8 = key_rows(k0 + own + 8, r0, where, has_left, has_right, has_sinks, kind,
                             iv, k0) >> shift
    return rows_key0, rows_key8


@inlined
def probs_tile(j, st, dpt, pkp, pkd, lane, transposed, own0, r0, k0, ls, dls, lbuf, scale_log2,
               cap_in, cap_log2, has_softcap, is_bf16, full, where, has_left, has_right,
               has_sinks, kind, mk_iv, key_masks, mk_bits, mod, has_alibi, slope_log2):
    """``probs_grads`` for n-tile ``j``: the packed pairs are built from values, ``st`` and
    ``dpt`` are only read (ptxas serialises wgmma when the accumulators of a completed group
    are written in a branch while later groups are in flight)."""
    for e in range(0, 4, 2):
        p0, ds0 = pair_grads(j, e, 0, st, dpt, lane, transposed, own0, r0, k0, ls, dls, lbuf,
                             scale_log2, cap_in, cap_log2, has_softcap, full, where, has_left,
                             has_right, has_sinks, kind, mk_iv, key_masks, mk_bits, mod,
                             has_alibi, slope_log2)
        p1, ds1 = pair_grads(j, e, 1, st, dpt, lane, transposed, own0, r0, k0, ls, dls, lbuf,
                             scale_log2, cap_in, cap_log2, has_softcap, full, where, has_left,
                             has_right, has_sinks, kind, mk_iv, key_masks, mk_bits, mod,
                             has_alibi, slope_log2)
        pkp[2 * j + e // 2] = pack16(is_bf16, p0, p1)
        pkd[2 * j + e // 2] = pack16(is_bf16, ds0, ds1)


@inlined
def pair_grads(j, e, c, st, dpt, lane, transposed, own0, r0, k0, ls, dls, lbuf, scale_log2,
               cap_in, cap_log2, has_softcap, full, where, has_left, has_right, has_sinks, kind,
               mk_iv, key_masks, mk_bits, mod, has_alibi, slope_log2):
    """(p, ds) of fragment element 4 j + e + c (0 where masked); ``key_masks``: the visible rows of
    a transposed fragment's two keys (``key_pair_rows``)."""
    seqlen_q, seqlen_k, wl, wr, sinks, b, h = where
    offset = seqlen_k - seqlen_q
    own = own0 + (lane >> 2) + 4 * e
    col = 8 * j + 2 * (lane & 3) + c
    lrow = col if transposed else own
    row = r0 + lrow
    key = k0 + (own if transposed else col)
    p, ds = grad_scores(st[4 * j + e + c], dpt[4 * j + e + c], ls[lbuf + lrow], dls[lbuf + lrow],
                        scale_log2, cap_in, cap_log2, has_softcap, True, has_alibi,
                        slope_log2 * np.float32(abs(row + offset - key)))
    if not full:
        if transposed and row_mask_kind(kind):
            rows = key_masks[0] if e == 0 else key_masks[1]
            vis = ((rows >> np.uint64(8 * j + c)) & np.uint64(1)) != np.uint64(0)
        else:
            lts, lte, uts, ute = column_bounds(kind, mk_iv, key, seqlen_k)
            vis = pair_visible(row, key, seqlen_q, seqlen_k, offset, has_left, has_right,
                               has_sinks, wl, wr, sinks, kind, lts, lte, uts, ute, b, h,
                               mk_bits, mod)
        p = p if vis else np.float32(0.0)
        ds = ds if vis else np.float32(0.0)
    return p, ds


@inlined
def store_fragments(dst, b, r0, h, acc, factor, limit, col0, n_tiles, lane, atomic):
    """Rows r0 + g (+ 8) and columns col0 + 8 j + 2 t (+ 1) of a warp's accumulator (n-tiles
    0 .. n_tiles) times ``factor`` into ``dst[b, row, h, col]`` (rows below ``limit``), stored,
    or added by atomics (one two-float reduction per pair of columns; ``dst`` C-contiguous)."""
    g = lane >> 2
    t = lane & 3
    for e in range(0, 4, 2):
        row = r0 + g + 4 * e
        if row < limit:
            base = ((b * dst.shape[1] + row) * dst.shape[2] + h) * dst.shape[3] + col0 + 2 * t
            for j in range(n_tiles):
                x0 = acc[4 * j + e] * factor
                x1 = acc[4 * j + e + 1] * factor
                if atomic:
                    red_add2(dst, base + 8 * j, x0, x1)
                else:
                    col = col0 + 8 * j + 2 * t
                    dst[b, row, h, col] = x0
                    dst[b, row, h, col + 1] = x1


@inlined
def store_rows16(dst, b, r0, h, acc, factor, limit, col0, n_tiles, lane, is_bf16):
    """``store_fragments``' rows and columns times ``factor``, rounded to 16 bits: one word of
    two values per pair of columns into ``dst[b, row, h, word]`` (uint32 (B, S, H, D / 2)):
    dK / dV written as the outputs themselves (no float32 partials, no reduce pass)."""
    g = lane >> 2
    t = lane & 3
    for e in range(0, 4, 2):
        row = r0 + g + 4 * e
        if row < limit:
            for j in range(n_tiles):
                dst[b, row, h, (col0 >> 1) + 4 * j + t] = pack16(
                    is_bf16, acc[4 * j + e] * factor, acc[4 * j + e + 1] * factor)


@inlined
def store_dkdv(dk_acc, dv_acc, ab, key0, h, dk, dv, scale, k_off, seqlen_k, col0, n_tiles, lane,
               is_bf16, direct):
    """A warp's dK (times ``scale``) and dV accumulators, keys key0 + g (+ 8) of the sequence
    (rows k_off + ... of a packed batch), columns col0 + 8 j + 2 t (+ 1): rounded into the
    16-bit outputs (``direct``: uint32 words (B, Sk, Hkv, D / 2)), else as float32 partials."""
    if direct:
        store_rows16(dk_acc, ab, key0, h, dk, scale, seqlen_k, col0, n_tiles, lane, is_bf16)
        store_rows16(dv_acc, ab, key0, h, dv, np.float32(1.0), seqlen_k, col0, n_tiles, lane,
                     is_bf16)
    else:
        store_fragments(dk_acc, ab, k_off + key0, h, dk, scale, k_off + seqlen_k, col0,
                        n_tiles, lane, False)
        store_fragments(dv_acc, ab, k_off + key0, h, dv, np.float32(1.0), k_off + seqlen_k,
                        col0, n_tiles, lane, False)


@inlined
def store_packed(ts, own0, col0, pk, n_tiles, lane):
    """Packed fragments (16 rows from ``own0`` x 8 n_tiles columns) into the shared word tile
    ``ts`` [row][column pair] from word ``col0``: the transpose that the dQ product reads
    back."""
    g = lane >> 2
    t = lane & 3
    for j in range(n_tiles):
        ts[own0 + g, col0 + 4 * j + t] = pk[2 * j]
        ts[own0 + g + 8, col0 + 4 * j + t] = pk[2 * j + 1]


@inlined
def prefetch_rows(dst, drow, src, b, r0, h, limit, rows, chunks, tid, nthreads):
    """Asynchronous copy of rows r0 .. r0 + rows of ``src[b, :, h, :]`` (uint32 words,
    ``chunks`` = words / 4 per row: a compile-time constant, so the division below is a
    shift) into the shared tile ``dst`` from row ``drow``, 16 bytes per copy; rows at or past
    ``limit`` become zeros (their source address clamped into the array)."""
    if nthreads % chunks == 0 and (rows * chunks) % nthreads == 0:
        # the common geometry: every thread copies the same column of rows nthreads / chunks
        # apart, a compile-time number of times (no per-copy division or loop bound)
        step = nthreads // chunks
        r = tid // chunks
        c = 4 * (tid - r * chunks)
        for _ in range(rows * chunks // nthreads):
            copy_row_piece(dst, drow, r, c, src, b, r0, h, limit)
            r += step
    else:
        for i in range(tid, rows * chunks, nthreads):
            r = i // chunks
            copy_row_piece(dst, drow, r, 4 * (i - r * chunks), src, b, r0, h, limit)


@inlined
def copy_row_piece(dst, drow, r, c, src, b, r0, h, limit):
    """cp.async of the 16 bytes at word ``c`` of row r0 + r of ``src[b, :, h, :]`` into row
    drow + r of ``dst``; zeros for rows at or past ``limit`` (the source clamped into the
    array)."""
    row = r0 + r
    cp_async16(dst, drow + r, c, src, b, min(row, limit - 1), h, c, 16 if row < limit else 0)


@inlined
def prefetch_stats(ls, dls, buf, lse2, delta, b, h, r0, tid):
    """Asynchronous copy of the base-2 lse and delta of rows r0 .. r0 + ls.shape[1] into row
    ``buf`` of the shared (2, rows) tiles (the arrays are padded to whole 16-byte groups)."""
    n = ls.shape[1] // 4
    base = (b * lse2.shape[1] + h) * lse2.shape[2] + r0
    if tid < n:
        cp_async16_at(ls, buf, 4 * tid, lse2, base + 4 * tid, 16)
    elif tid < 2 * n:
        cp_async16_at(dls, buf, 4 * (tid - n), delta, base + 4 * (tid - n), 16)


@inlined
def next_query_tile(t, end, kind, mm, tab, tb, ktile, bm, k0, bn, seqlen_q, seqlen_k, has_left,
                    has_right, has_sinks, wl, wr, sinks):
    """``(tile, full)``: the first query tile of [t, end) that the mask does not skip for key
    tile ``ktile`` (``end`` if none) and whether it is full (``tile_kind``; False at ``end``),
    so that each tile is classified once. Interval masks jump over a run of skipped tiles at
    once (a document mask's key block skips every tile before its document and after it: one
    classification per tile put a chain of dependent loads and tests before the block's first
    copy)."""
    full = False
    while t < end:
        skip, full = tile_kind(kind, mm, tab, tb, t, ktile, t * bm, bm, k0, bn, seqlen_q,
                               seqlen_k, has_left, has_right, has_sinks, wl, wr, sinks)
        if not skip:
            break
        nxt = t + 1
        if kind == INTERVALS:
            run_end = skipped_rows_end(mm, ktile, t * bm, min(t * bm + bm, seqlen_q))
            nxt = max(nxt, run_end // bm)
        t = nxt
    return t, full


@inlined
def dq_from_shared(dq_acc, dqa, pka, is_bf16, dst, ks, b, h, r0, seqlen_q, scale, warp, warps,
                   m_tiles, chunks, chunk_cols, block_n, lane):
    """``dq_acc[b, r0:r0 + 16 m_tiles, h, :] += scale dS K`` by atomics, from dS^T (keys x
    query-row pairs, shared) and K (shared): the (m-tile, column chunk) units are dealt to the
    warps in turn; each is a 16 x chunk_cols product over the block's keys."""
    for unit in range(warp, m_tiles * chunks, warps):
        mq = unit % m_tiles
        col0 = (unit // m_tiles) * chunk_cols
        transposed_fragments(pka, dst, 8 * mq, block_n // 16, lane)
        zero(dqa, chunk_cols // 2)
        mma_pb(dqa, is_bf16, pka, ks, 0, block_n // 16, chunk_cols // 16, col0 // 2, lane)
        store_fragments(dq_acc, b, r0 + 16 * mq, h, dqa, scale, seqlen_q, col0, chunk_cols // 8,
                        lane, True)


def make_mma_dkdv_kernel(head_dim: int, is_bf16: bool, has_left: bool, has_right: bool,
                         has_sinks: bool, has_softcap: bool, atomic_dq: bool,
                         mask_kind: int = NONE, warps: int = 0, block_n: int = 0,
                         block_m: int = 0, mask_mod=None, has_alibi: bool = False,
                         varlen: bool = False, direct: bool = False):
    """Column-parallel dK / dV (and with ``atomic_dq`` dQ) kernel on tensor cores, float16 /
    bfloat16 with fp32 accumulation. ``direct`` (one query head per kv head, no packed batch):
    dk_acc / dv_acc are the 16-bit outputs themselves (uint32 words (B, Sk, Hkv, D / 2)).

    Kernel ``(q, k, v, dout, lse2, delta, dq_acc, dk_acc, dv_acc, seqlen_q, seqlen_k,
    heads_ratio, scale, scale_log2, cap_in, cap_log2, window_left, window_right, sinks, mk_iv,
    mk_mm, mk_tab, mk_bits, alibi, cu_q, cu_k)``: q, dout uint32 (B, Sq, Hq, D / 2), k, v uint32 (B, Sk, Hkv, D / 2) (two 16-bit
    values per word, rows 16-byte aligned); lse2, delta float32 (B, Hq, SqP) from the
    preprocess kernel (base-2 lse, padded rows); dq_acc float32 (B, Sq, Hq, D) zeroed,
    atomically accumulated; dk_acc, dv_acc float32 (B, Sk, Hq, D) per-query-head partials,
    written; masks, ALiBi and ``varlen`` as in ``make_fma_dkdv_kernel`` (min/max and class
    table of these tiles). Scalars
    float32: scale, scale * log2 e, scale / softcap, softcap * log2 e.

    Geometry (``mma_layout``): warp w owns keys 16 w .. 16 w + 15 of the ``block_n = 16 warps``
    key tile (K, V in shared memory; dK, dV accumulators in registers: head_dim / 2 floats
    each per lane); with ``block_n = 8 warps`` (``mma_dsplit`` 2, head_dim above 128) warps
    2 i and 2 i + 1 own keys 16 i .. 16 i + 15, both compute their S^T and dP^T, and each
    accumulates half of dK's and dV's columns. Query tiles of ``block_m`` rows stream through two shared buffers by
    cp.async (the next live tile loads while this one is worked). Per 16-row slice of a tile:
    S^T = K Q^T and dP^T = V dO^T (B operands by ldmatrix), P^T and dS^T in registers,
    dV += P^T dO and dK += dS^T Q (A from registers, B by ldmatrix.trans), dS^T to shared
    memory; atomic dQ: then dQ = dS K by (m-tile, column chunk) units over the warps. Grid
    ``(ceil(Sk / block_n), B * Hq)``, ``32 warps`` threads, ``mma_dkdv_smem_bytes`` of dynamic
    shared memory.
    """
    D = int(head_dim)
    W0, N0, M0 = mma_layout(D)
    WARPS = warps or W0
    BN, BM = int(block_n or (N0 if not warps else 16 * WARPS)), int(block_m or M0)
    DSPLIT = mma_dsplit(WARPS, BN)
    DH = D // DSPLIT                      # dK / dV columns a warp accumulates
    assert DSPLIT in (1, 2) and DH % 16 == 0, (WARPS, BN, D)
    assert D % 16 == 0 and BM in (16, 32, 64) and ROW_PAD % BM == 0, (D, BM)
    NT, KS, NPD, CH = 32 * WARPS, D // 16, DH // 16, D // 8
    DWP, STW = _padded(D // 2), _padded(BM // 2)
    K_OFF, V_OFF, Q_OFF = 0, BN * DWP, 2 * BN * DWP
    DO_OFF = Q_OFF + 2 * BM * DWP
    ST_OFF = DO_OFF + 2 * BM * DWP
    L_OFF = ST_OFF + BN * STW
    DC = dq_chunk(D, BM // 16, WARPS)     # dQ: columns per unit of work
    MQ, NCH = BM // 16, D // DC
    # Local array sizes must be plain constants (an expression in the kernel types as a
    # runtime integer on a GPU).
    ACC_N, DQ_N, PA_N = DH // 2, DC // 2, BN // 4
    BF16, KIND, ATOMIC = bool(is_bf16), int(mask_kind), bool(atomic_dq)
    ALIBI, VARLEN, DIRECT = bool(has_alibi), bool(varlen), bool(direct)
    assert not (DIRECT and VARLEN)
    mod = mask_mod_device(mask_mod)
    u32, f32 = types.uint32, types.float32

    def kernel(q, k, v, dout, lse2, delta, dq_acc, dk_acc, dv_acc, seqlen_q, seqlen_k,
               heads_ratio, scale, scale_log2, cap_in, cap_log2, wl, wr, sinks, mk_iv, mk_mm,
               mk_tab, mk_bits, alibi, cu_q, cu_k):
        ktile, b, h, hk, ab, q_off, k_off, seqlen_q, seqlen_k = key_block(
            q, k, heads_ratio, seqlen_q, seqlen_k, cu_q, cu_k, VARLEN)
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        own0 = 16 * (warp // DSPLIT)        # the warp's 16 keys in the block's tile
        col0 = (warp % DSPLIT) * DH         # and its first dK / dV column
        k0 = ktile * BN
        if VARLEN and k0 >= seqlen_k:
            return
        tb, slope = block_table_and_slope(ALIBI, alibi, mk_tab, b, h, q.shape[2], np.float32)
        slope_log2 = slope * np.float32(LOG2E)
        where = (seqlen_q, seqlen_k, wl, wr, sinks, b, h)
        dyn = cuda.shared.array(0, u32)
        dynf = cuda.shared.array(0, f32)
        ks = shared_view(dyn, K_OFF, BN, DWP)
        vs = shared_view(dyn, V_OFF, BN, DWP)
        qs = shared_view(dyn, Q_OFF, 2 * BM, DWP)        # two buffers of BM rows
        dos = shared_view(dyn, DO_OFF, 2 * BM, DWP)
        dst = shared_view(dyn, ST_OFF, BN, STW)          # dS^T, for the dQ product
        ls = shared_view(dynf, L_OFF, 2, BM)
        dls = shared_view(dynf, L_OFF + 2 * BM, 2, BM)
        mm, iv, mtile = stage_key_block(KIND, mk_iv, mk_mm, ktile, k0, seqlen_k,
                                        cuda.shared.array(0, types.int32), L_OFF + 4 * BM, BN,
                                        tid, NT)
        st = cuda.local.array(8, f32)
        dpt = cuda.local.array(8, f32)
        pkp = cuda.local.array(4, u32)
        pkd = cuda.local.array(4, u32)
        dk = cuda.local.array(ACC_N, f32)
        dv = cuda.local.array(ACC_N, f32)
        dqa = cuda.local.array(DQ_N, f32)
        pka = cuda.local.array(PA_N, u32)
        zero(dk, ACC_N)
        zero(dv, ACC_N)
        lo, hi = query_rows(k0, min(k0 + BN, seqlen_k), seqlen_q, seqlen_k - seqlen_q,
                            has_left, has_right, has_sinks, wl, wr, sinks)
        end = (hi + BM - 1) // BM if hi > lo else 0
        if KIND == INTERVALS:
            cuda.syncthreads()      # the staged intervals
        t, full = next_query_tile(lo // BM, end, KIND, mm, mk_tab, tb, mtile, BM, k0, BN,
                                  seqlen_q, seqlen_k, has_left, has_right, has_sinks, wl, wr,
                                  sinks)
        prefetch_rows(ks, 0, k, ab, k_off + k0, hk, k_off + seqlen_k, BN, CH, tid, NT)
        prefetch_rows(vs, 0, v, ab, k_off + k0, hk, k_off + seqlen_k, BN, CH, tid, NT)
        if t < end:
            prefetch_rows(qs, 0, q, ab, q_off + t * BM, h, q_off + seqlen_q, BM, CH, tid, NT)
            prefetch_rows(dos, 0, dout, ab, q_off + t * BM, h, q_off + seqlen_q, BM, CH, tid,
                          NT)
            prefetch_stats(ls, dls, 0, lse2, delta, b, h, t * BM, tid)
        cp_async_commit()
        cur = 0
        while t < end:
            nxt, nxt_full = next_query_tile(t + 1, end, KIND, mm, mk_tab, tb, mtile, BM, k0,
                                            BN, seqlen_q, seqlen_k, has_left, has_right,
                                            has_sinks, wl, wr, sinks)
            cp_async_wait_all()
            cuda.syncthreads()      # tile t has landed; every warp is done with buffer 1 - cur
            if nxt < end:
                prefetch_rows(qs, (1 - cur) * BM, q, ab, q_off + nxt * BM, h, q_off + seqlen_q,
                              BM, CH, tid, NT)
                prefetch_rows(dos, (1 - cur) * BM, dout, ab, q_off + nxt * BM, h,
                              q_off + seqlen_q, BM, CH, tid, NT)
                prefetch_stats(ls, dls, 1 - cur, lse2, delta, b, h, nxt * BM, tid)
            cp_async_commit()
            r0 = t * BM
            for sl in range(MQ):
                row = cur * BM + 16 * sl              # the slice's first row in the buffers
                mma_abt(st, BF16, ks, own0, qs, row, 1, KS, lane)           # S^T = K Q^T
                mma_abt(dpt, BF16, vs, own0, dos, row, 1, KS, lane)         # dP^T = V dO^T
                probs_grads(st, dpt, pkp, pkd, 2, lane, True, own0, r0 + 16 * sl, k0,
                            ls[cur], dls[cur], 16 * sl, scale_log2, cap_in, cap_log2,
                            has_softcap, BF16, full, where, has_left, has_right, has_sinks, KIND,
                            iv, mk_bits, mod, ALIBI, slope_log2)
                mma_pb(dv, BF16, pkp, dos, row, 1, NPD, col0 // 2, lane)    # dV += P^T dO
                mma_pb(dk, BF16, pkd, qs, row, 1, NPD, col0 // 2, lane)     # dK += dS^T Q
                if ATOMIC and col0 == 0:
                    store_packed(dst, own0, 8 * sl, pkd, 2, lane)
            if ATOMIC:
                cuda.syncthreads()                    # dS^T of the whole tile is in place
                dq_from_shared(dq_acc, dqa, pka, BF16, dst, ks, ab, h, q_off + r0,
                               q_off + seqlen_q, scale, warp,
                               WARPS, MQ, NCH, DC, BN, lane)
            cur = 1 - cur
            t, full = nxt, nxt_full
        cp_async_wait_all()         # nothing may be in flight when the block exits
        store_dkdv(dk_acc, dv_acc, ab, k0 + own0, h, dk, dv, scale, k_off, seqlen_k, col0,
                   DH // 8, lane, BF16, DIRECT)

    return jit_kernel(kernel, ("bwd_mma_dkdv", D, BF16, has_left, has_right, has_sinks,
                               has_softcap, ATOMIC, KIND, WARPS, BM, ALIBI, VARLEN)
                      + ((BN,) if DSPLIT > 1 else ()) + (("direct",) if DIRECT else ()),
                      cache=mask_mod is None)


def make_mma_dq_kernel(head_dim: int, is_bf16: bool, has_left: bool, has_right: bool,
                       has_sinks: bool, has_softcap: bool, mask_kind: int = NONE,
                       warps: int = 0, block_m: int = 0, block_n: int = 0, mask_mod=None,
                       has_alibi: bool = False, varlen: bool = False):
    """Row-parallel dQ kernel on tensor cores (deterministic mode), float16 / bfloat16.

    Kernel ``(q, k, v, dout, lse2, delta, dq_acc, seqlen_q, seqlen_k, heads_ratio, scale,
    scale_log2, cap_in, cap_log2, window_left, window_right, sinks, mk_iv, mk_mm, mk_tab, mk_bits,
    alibi, cu_q, cu_k)``: arrays (and ``varlen``) as in ``make_mma_dkdv_kernel``; dq_acc float32 (B, Sq, Hq, D) written;
    mk_mm and mk_tab for tiles of ``block_m`` rows and ``block_n`` keys.

    Geometry (``mma_dq_layout``): the dual of the dK / dV kernel: warp w owns query rows 16 w .. 16 w + 15 of the
    ``block_m = 16 warps`` row tile (Q, dO, lse, delta in shared memory, dQ in registers), key
    tiles of ``block_n`` keys (K, V in shared memory). Per tile: S = Q K^T, dP = dO V^T, P and dS
    in registers, dQ += dS K. Grid ``(ceil(Sq / block_m), B * Hq)``, ``32 warps`` threads.
    """
    D = int(head_dim)
    W0, _, N0 = mma_dq_layout(D)
    WARPS = warps or W0
    BM, BN = 16 * int(WARPS), int(block_n or N0)
    assert not block_m or block_m == BM, (block_m, BM)
    NT, DWP, KS, NPK, NPD = 32 * WARPS, _padded(D // 2), D // 16, BN // 16, D // 16
    assert D % 16 == 0 and BN % 16 == 0, (D, BN)
    S_N, PK_N, ACC_N = BN // 2, BN // 4, D // 2
    BF16, KIND, ALIBI = bool(is_bf16), int(mask_kind), bool(has_alibi)
    VARLEN = bool(varlen)
    mod = mask_mod_device(mask_mod)
    u32, f32 = types.uint32, types.float32

    def kernel(q, k, v, dout, lse2, delta, dq_acc, seqlen_q, seqlen_k, heads_ratio, scale,
               scale_log2, cap_in, cap_log2, wl, wr, sinks, mk_iv, mk_mm, mk_tab, mk_bits, alibi,
               cu_q, cu_k):
        qtile = cuda.blockIdx.x
        b = cuda.blockIdx.y // q.shape[2]
        h = cuda.blockIdx.y % q.shape[2]
        hk = h // heads_ratio
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        r0 = qtile * BM
        ab, q_off, k_off, seqlen_q, seqlen_k = block_sequence(
            VARLEN, cu_q, cu_k, b, q.shape[1], k.shape[1], seqlen_q, seqlen_k)
        if VARLEN and r0 >= seqlen_q:
            return
        r1 = min(r0 + BM, seqlen_q)
        offset = seqlen_k - seqlen_q
        tb, slope = block_table_and_slope(ALIBI, alibi, mk_tab, b, h, q.shape[2], np.float32)
        slope_log2 = slope * np.float32(LOG2E)
        where = (seqlen_q, seqlen_k, wl, wr, sinks, b, h)
        qs = cuda.shared.array((BM, DWP), u32)
        dos = cuda.shared.array((BM, DWP), u32)
        ks = cuda.shared.array((BN, DWP), u32)
        vs = cuda.shared.array((BN, DWP), u32)
        ls = cuda.shared.array(BM, f32)
        dls = cuda.shared.array(BM, f32)
        s = cuda.local.array(S_N, f32)
        dp = cuda.local.array(S_N, f32)
        pkp = cuda.local.array(PK_N, u32)
        pkd = cuda.local.array(PK_N, u32)
        dq = cuda.local.array(ACC_N, f32)
        load_query_tile(qs, dos, ls, dls, q, dout, lse2, delta, ab, q_off, b, h, r0, seqlen_q,
                        tid, NT)
        zero(dq, ACC_N)
        tile_lo, tile_hi, tile, last, sink_tiles = key_tiles(
            r0 + offset, r1 - 1 + offset, seqlen_k, BN, has_left, has_right, has_sinks, wl, wr,
            sinks)
        while tile <= last:
            k0 = tile * BN
            skip, full = tile_kind(KIND, mk_mm, mk_tab, tb, qtile, tile, r0, BM, k0, BN,
                                   seqlen_q, seqlen_k, has_left, has_right, has_sinks, wl, wr,
                                   sinks)
            if not skip:
                cuda.syncthreads()      # every warp is done with the previous K, V tiles
                load_tile(ks, k, ab, k_off + k0, hk, k_off + seqlen_k, tid, NT)
                load_tile(vs, v, ab, k_off + k0, hk, k_off + seqlen_k, tid, NT)
                cuda.syncthreads()
                mma_abt(s, BF16, qs, 16 * warp, ks, 0, NPK, KS, lane)      # S = Q K^T
                mma_abt(dp, BF16, dos, 16 * warp, vs, 0, NPK, KS, lane)    # dP = dO V^T
                probs_grads(s, dp, pkp, pkd, 2 * NPK, lane, False, 16 * warp, r0, k0, ls, dls, 0,
                            scale_log2, cap_in, cap_log2, has_softcap, BF16, full, where, has_left,
                            has_right, has_sinks, KIND, mk_iv, mk_bits, mod, ALIBI, slope_log2)
                mma_pb(dq, BF16, pkd, ks, 0, NPK, NPD, 0, lane)            # dQ += dS K
            tile = past_sinks(tile + 1, tile_lo, sink_tiles, has_sinks)
        store_fragments(dq_acc, ab, q_off + r0 + 16 * warp, h, dq, scale, q_off + seqlen_q, 0,
                        D // 8, lane, False)

    return jit_kernel(kernel, ("bwd_mma_dq", D, BF16, has_left, has_right, has_sinks,
                               has_softcap, KIND, WARPS, BN, ALIBI, VARLEN),
                      cache=mask_mod is None)
