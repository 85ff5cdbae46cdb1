"""Tiled FlashAttention-2 forward on CUDA cores, exact in float32 / float64: 2 to 8 lanes share 1
or 2 query rows, each holding its share of q and of the outputs in registers; K/V tiles in
shared memory (cp.async), online softmax per tile.

Shapes (kernel arguments): q (B, Sq, Hq, D), k and v (B, Sk, Hkv, D), out (B, Sq, Hq, D), lse
float32 (B, Hq, Sq); any strides. Grid: (number of query tiles, B * Hq).

The kernel body is the algorithm's steps as inline device functions (Numba IR inlining, with
the builder's compile-time constants as arguments): ``load_q_rows``, ``copy_tile_async``,
``qk_scores``, ``score_transform``, ``mask_score``, ``softmax_update``, ``pv_accumulate``,
``store_rows``. Each was cut so that the machine code stays byte-identical
(``scripts/sass_snapshot.py --compare``). The key-tile walk's pieces shared with the tensor-core
kernel (``skip_empty_chunks``, ``first_in_chunk``, ``flags_see_whole_tile``) live in masking.py;
they change the machine code of the causal and mask-object configurations (no new spills;
docs/perf-notes.md).
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda
from numba.cuda import types

from ..primitives import (SIMULATOR, cp_async16, cp_async_commit, cp_async_wait_all, lds16,
                          shfl_xor)
from .forward_geometry import fma_lanes_per_row, fma_rows_per_lane, fma_threads
from .jitcache import jit_kernel
from .masking import (BITMASK, INTERVALS, NONE, bit_visible, chunk_classes, first_in_chunk,
                      flags_see_whole_tile, interval_visible, key_tiles, mask_mod_device,
                      past_sinks, score_mod_device, skip_empty_chunks)
from .schedule import group_keys, query_tile_of_block
from .sequences import clear_unowned_rows, packed_sequence
from .tile_ops import window_visible
from ..primitives.base import inlined

__all__ = ["make_fma_kernel"]



@inlined
def load_q_rows(qr, acc, mrow, lrow, q, b, q_off, h, qtile, block_m, group, stride, seqlen_q,
                part, lanes, rows, chunks, per_chunk, per_row, dtype, neg_inf):
    """The prologue: this lane's share of its ``rows`` query rows (row r is ``qtile * block_m +
    group + r * stride``) of ``q[b, q_off + row, h, :]`` into ``qr`` (local, working dtype
    ``dtype``, rows * per_row: row r, element e at ``r * per_row + e``; its chunk c of
    ``per_chunk`` elements is the row's chunk ``c * lanes + part``; zeros past ``seqlen_q``);
    zeroes the output accumulator ``acc`` (same layout) and starts the running max ``mrow`` at
    ``neg_inf`` and the sum ``lrow`` at 0 (local, rows)."""
    for r in range(rows):
        row = qtile * block_m + group + r * stride
        for c in range(chunks):
            for i in range(per_chunk):
                x = dtype(0.0)
                if row < seqlen_q:
                    x = q[b, q_off + row, h, (c * lanes + part) * per_chunk + i]
                qr[r * per_row + c * per_chunk + i] = x
                acc[r * per_row + c * per_chunk + i] = dtype(0.0)
        mrow[r] = dtype(neg_inf)
        lrow[r] = dtype(0.0)


@inlined
def copy_tile_async(dst, src, b, k_off, hk, k0, seqlen_k, tid, threads, copies, exact, rows,
                    per_row, per_copy):
    """Start copying rows ``k0 .. k0 + rows - 1`` of ``src[b, k_off + key, hk, :]`` (K or V,
    working dtype, (B, S, H, D)) into the shared tile ``dst`` (rows, >= D), zeros past
    ``seqlen_k``, by cp.async and commit the group: ``copies`` 16-byte copies per thread
    (``exact``: ``copies * threads`` is the whole tile), ``per_row`` per row, ``per_copy``
    elements each."""
    for it in range(copies):
        i = it * threads + tid
        if exact or i < rows * per_row:
            kr = i // per_row
            cc = (i - kr * per_row) * per_copy
            key = k0 + kr
            ok = key < seqlen_k
            cp_async16(dst, kr, cc, src, b, k_off + key if ok else 0, hk, cc, 16 if ok else 0)
    cp_async_commit()


@inlined
def qk_scores(ps, qr, pa, cur, ks, group, stride, part, col0, lanes, log_lanes, split, keys,
              rows, chunks, per_chunk, per_row, dtype):
    """S = Q K^T for one key tile, unscaled: row ``group + r * stride`` of the shared ``ps``
    (block_m, >= keys; working dtype) gets the dot products of this lane's ``rows`` rows of
    ``qr`` (local, layout as in ``load_q_rows``) with the ``keys`` rows of the shared K tile
    ``ks``, ``lanes`` keys per round. Each key is ``split`` partial sums per lane (``cur``:
    local, rows * split; ``pa``: local, rows * 8, row r, slot s, partial z at ``r * 8 + s *
    split + z``), added pairwise in the lane, then across the row's lanes by an xor butterfly
    (``log_lanes`` rounds) that also scatters: after a round lane ``part`` holds key ``part``'s
    dot product."""
    for rnd in range(keys // lanes):
        # In slot s this lane adds its chunks of key (s ^ part): the butterfly below then needs
        # no selects (at mask hm, slot s + hm of the partner lane holds the key of this lane's
        # slot s).
        for s in range(lanes):
            j = np.uint32(rnd * lanes + (s ^ part))
            for z in range(rows * split):
                cur[z] = dtype(0.0)
            for c in range(chunks):
                kv = lds16(ks, j, col0, c * lanes * 16)
                for r in range(rows):
                    for i in range(per_chunk):
                        e = c * per_chunk + i
                        cur[r * split + e % split] += qr[r * per_row + e] * kv[i]
            # Slots shift down one place and this one enters at the top: after ``lanes`` steps
            # slot s sits at place s, and no index depends on s (whether or not the compiler
            # unrolls this loop, pa stays in registers).
            for r in range(rows):
                for t in range(lanes - 1):
                    for z in range(split):
                        pa[r * 8 + t * split + z] = pa[r * 8 + (t + 1) * split + z]
                for z in range(split):
                    pa[r * 8 + (lanes - 1) * split + z] = cur[r * split + z]
        for r in range(rows):
            w = split // 2
            while w >= 1:   # pairwise within the lane
                for s in range(lanes):
                    for z in range(w):
                        pa[r * 8 + s * split + z] += pa[r * 8 + s * split + z + w]
                w //= 2
            for lv in range(log_lanes):   # pairwise across lanes, scattering keys
                hm = lanes >> (lv + 1)
                for s in range(hm):
                    pa[r * 8 + s * split] += shfl_xor(pa[r * 8 + (s + hm) * split], hm)
            ps[group + r * stride, rnd * lanes + part] = pa[r * 8]   # key rnd * lanes + part


@inlined
def score_transform(dot, c, b, h, row, qpos, k0, lanes, part, seqlen_q, seqlen_k, offset,
                    scale, cap_in, cap_out, slope, smod, has_softcap, has_alibi, has_score_mod,
                    dtype):
    """The natural-log score of the product ``dot = q.k`` (working dtype ``dtype``) of query row
    ``row`` (position ``qpos``) and this lane's key c of the tile, ``kpos = k0 + c * lanes +
    part``: ``scale * dot`` or with the softcap ``cap_out * tanh(cap_in * dot)``, minus the
    ALiBi ``slope * |qpos - kpos|``, then the score_mod device function ``smod`` (given indices
    inside the sequences, as in make_mma_kernel)."""
    if has_softcap:
        x = cap_out * math.tanh(cap_in * dot)
    else:
        x = scale * dot
    kpos = k0 + c * lanes + part
    if has_alibi:
        x -= slope * dtype(abs(qpos - kpos))
    if has_score_mod:
        x = dtype(smod(x, b, h, min(row, seqlen_q - 1) + offset, min(kpos, seqlen_k - 1)))
    return x


@inlined
def mask_score(x, b, h, row, qpos, kpos, seqlen_q, seqlen_k, window_left, window_right, sinks,
               mk_iv, mk_bits, mod, has_left, has_right, has_sinks, kind, dtype, neg_inf):
    """The score ``x`` of query row ``row`` (position ``qpos``, bottom-right aligned) and key
    ``kpos``, or ``neg_inf`` (as ``dtype``) where the row does not see the key: a key past
    ``seqlen_k``, outside the window and not a sink, or hidden by the mask object of ``kind``
    (intervals ``mk_iv``, bitmask ``mk_bits`` or the device function ``mod``; rows inside
    ``seqlen_q``)."""
    vis = kpos < seqlen_k
    wv = window_visible(kpos, qpos, window_left, window_right, sinks, has_left, has_right,
                        has_sinks)
    if kind != NONE and vis and wv and row < seqlen_q:
        if kind == INTERVALS:
            wv = interval_visible(mk_iv, row, kpos)
        elif kind == BITMASK:
            wv = bit_visible(mk_bits, row, kpos)
        else:
            wv = mod(b, h, qpos, kpos)
    if not (vis and wv):
        x = dtype(neg_inf)
    return x


@inlined
def softmax_update(ps, acc, mrow, lrow, mx, r, group, stride, part, lanes, log_lanes, keys,
                   per_row, dtype, neg_inf):
    """The online-softmax step of row r (``group + r * stride`` of the shared ``ps``) after a key
    tile: ``mx`` (this lane's maximum of its ``keys / lanes`` scores) becomes the row's maximum
    over its lanes; the running max ``mrow[r]`` moves to the new maximum, the scores in ``ps``
    become probabilities ``exp(x - m)``, and ``lrow[r]`` (this lane's partial sum) and the
    row's ``per_row`` accumulators in ``acc`` are rescaled by ``exp(m_old - m)``."""
    for lv in range(log_lanes):
        mx = max(mx, shfl_xor(mx, 1 << lv))
    m = mrow[r]
    mn = max(m, mx)
    # A row that has seen no key yet keeps m = -inf; subtract 0 then so exp gives 0.
    mu = mn if mn != neg_inf else dtype(0.0)
    alpha = math.exp(m - mu)
    mrow[r] = mn
    rs = dtype(0.0)
    for c in range(keys // lanes):
        p = math.exp(ps[group + r * stride, c * lanes + part] - mu)
        ps[group + r * stride, c * lanes + part] = p
        rs += p
    lrow[r] = lrow[r] * alpha + rs   # per-lane partial; the group adds up at the end
    for e in range(per_row):
        acc[r * per_row + e] *= alpha


# Numba-level inlining: per_chunk (a constant per kernel) picks a 4- or 2-tuple load, which
# only types once the other branch is pruned.
@cuda.jit(device=True, inline="always")
def pv_accumulate(acc, pv, ps, vs, group, stride, col0, lanes, keys, rows, chunks, per_chunk,
                  per_row):
    """O += P V for one key tile: ``acc`` (local, layout as in ``load_q_rows``) of ``rows`` rows
    ``group, group + stride, ...`` of the shared probabilities ``ps`` (block_m, >= keys) times
    the shared V tile ``vs`` (keys, D), 4 keys per step (``pv``: local, rows * 4, their p);
    this lane's chunks start at column ``col0`` (uint32), ``lanes * 16`` bytes apart."""
    for jg in range(keys // 4):      # 4 keys per step (their p: 16 or 32 bytes per row)
        j = np.uint32(jg * 4)
        for r in range(rows):
            prow = np.uint32(group + r * stride)
            if per_chunk == 4:
                p0, p1, p2, p3 = lds16(ps, prow, j, 0)
            else:
                p0, p1 = lds16(ps, prow, j, 0)
                p2, p3 = lds16(ps, prow, j, 16)
            pv[r * 4] = p0
            pv[r * 4 + 1] = p1
            pv[r * 4 + 2] = p2
            pv[r * 4 + 3] = p3
        for c in range(chunks):
            v0 = lds16(vs, j, col0, c * lanes * 16)
            v1 = lds16(vs, j + np.uint32(1), col0, c * lanes * 16)
            v2 = lds16(vs, j + np.uint32(2), col0, c * lanes * 16)
            v3 = lds16(vs, j + np.uint32(3), col0, c * lanes * 16)
            for r in range(rows):
                for i in range(per_chunk):
                    a = acc[r * per_row + c * per_chunk + i]
                    a += pv[r * 4] * v0[i]
                    a += pv[r * 4 + 1] * v1[i]
                    a += pv[r * 4 + 2] * v2[i]
                    a += pv[r * 4 + 3] * v3[i]
                    acc[r * per_row + c * per_chunk + i] = a


@inlined
def store_rows(out, lse, acc, mrow, lrow, b, q_off, h, qtile, block_m, group, stride, seqlen_q,
               part, lanes, log_lanes, rows, chunks, per_chunk, per_row, write_lse, dtype,
               neg_inf):
    """The epilogue: adds each row's per-lane partial sums ``lrow`` across the row's ``lanes``
    lanes (xor butterfly, ``log_lanes`` rounds) and writes this lane's chunks of ``acc / l``
    (layout as in ``load_q_rows``) to ``out[b, q_off + row, h, :]`` (working dtype) for the rows
    inside ``seqlen_q``; with ``write_lse`` the row's first lane writes ``m + log l`` (``neg_inf``
    for a row that saw no key) to ``lse[b, h, q_off + row]`` (float32)."""
    for r in range(rows):
        l = lrow[r]
        for lv in range(log_lanes):
            l += shfl_xor(l, 1 << lv)
        row = qtile * block_m + group + r * stride
        if row < seqlen_q:
            inv = dtype(0.0)
            if l != 0:
                inv = dtype(1.0) / l
            for c in range(chunks):
                for i in range(per_chunk):
                    out[b, q_off + row, h, (c * lanes + part) * per_chunk + i] = (
                        acc[r * per_row + c * per_chunk + i] * inv)
            if write_lse and part == 0:
                lse[b, h, q_off + row] = mrow[r] + math.log(l) if l != 0 else neg_inf


def make_fma_kernel(head_dim: int, is_f64: bool, has_left: bool, has_right: bool,
                    has_sinks: bool, has_softcap: bool, write_lse: bool, block_n: int,
                    mask_kind: int = NONE, varlen: bool = False, has_alibi: bool = False,
                    mask_mod=None, score_mod=None):
    """Build the exact CUDA-core kernel (float32 or float64) for one configuration.

    Kernel signature: ``(q, k, v, out, lse, seqlen_q, seqlen_k, heads_ratio, scale, cap_in,
    cap_out, window_left, window_right, sinks, mk_iv, mk_mm, mk_tab, mk_bits, cu_q, cu_k,
    alibi)`` (mask, varlen and alibi arguments as in ``make_mma_kernel``); q/k/v/out in the
    working dtype (B, S, H, D), lse float32 (B, Hq, Sq). Scores are natural-log: ``scale * q.k``,
    or with softcap ``cap_out * tanh(cap_in * q.k)``, then ALiBi, then ``score_mod`` (as in
    ``make_mma_kernel``, in the working dtype). Launch with ``fma_threads(D, itemsize)``
    threads per block; a block owns ``fma_block_m(D, itemsize)`` query rows.

    Layout: ``TPR = fma_lanes_per_row(D, itemsize)`` consecutive lanes (a lane group) share
    ``RPR = fma_rows_per_lane(D, itemsize)`` query rows (group g: rows g, g + G, ...; G groups
    per block); lane ``part`` keeps 16-byte chunks ``part, part + TPR, ...`` of q and of the
    output accumulator of each of its rows in registers (every index a compile-time constant),
    so each K or V chunk it loads feeds RPR rows. A key's dot product is 8 partial sums
    (``8 / TPR`` per lane, added pairwise, then across the group's lanes by an xor butterfly
    that also scatters: after a round of TPR keys, lane ``part`` holds key ``part``'s score).
    Probabilities go through shared memory to every lane of the group for P V. K and V tiles
    stream through shared memory by cp.async in FlashAttention-2's order (V copied under
    Q K^T, the next K under P V), as in the tensor-core kernel.
    """
    D = head_dim
    ITEM = 8 if is_f64 else 4
    TPR = fma_lanes_per_row(D, ITEM)
    RPR = fma_rows_per_lane(D, ITEM)
    NT = fma_threads(D, ITEM)
    G = NT // TPR                 # lane groups per block
    BM, BN = G * RPR, block_n
    if BN % TPR or BN % 4:
        raise ValueError(f"block_n must be a multiple of 4 and of the {TPR} lanes per row, "
                         f"got {BN}")
    dt = types.float64 if is_f64 else types.float32
    npdt = np.float64 if is_f64 else np.float32
    GROUP_KEYS = group_keys(2 * D * ITEM, has_right, varlen)     # the grid's order (schedule.py)
    CH = 16 // ITEM               # elements per 16-byte chunk
    E = D // TPR                  # elements of q (and of acc) per lane and row
    NC = E // CH                  # chunks per lane
    NS = BN // TPR                # scores per lane, row and key tile
    SPLIT = max(1, 8 // TPR)      # partial sums per key per lane (SPLIT * TPR = 8 in all)
    LOG_TPR = TPR.bit_length() - 1
    CPR = D // CH                 # chunks per K/V row
    COPY_ITERS = (BN * CPR + NT - 1) // NT
    COPY_EXACT = (BN * CPR) % NT == 0
    PW = BN + CH                  # P row stride: rows 16 bytes apart, no bank conflicts
    QN, PN, VN, CN = RPR * E, RPR * 8, RPR * 4, RPR * SPLIT
    NEG_INF = -math.inf
    KIND = int(mask_kind)
    VARLEN = bool(varlen)
    ALIBI = bool(has_alibi)
    mod = mask_mod_device(mask_mod)
    SCORE_MOD = score_mod is not None
    smod = score_mod_device(score_mod)

    def kernel(q, k, v, out, lse, seqlen_q, seqlen_k, heads_ratio, scale, cap_in, cap_out,
               window_left, window_right, sinks, mk_iv, mk_mm, mk_tab, mk_bits, cu_q, cu_k, alibi):
        n_qtiles = cuda.gridDim.x
        qtile, x, row = query_tile_of_block(seqlen_k, heads_ratio, GROUP_KEYS)
        heads_q = q.shape[2]
        b = row // heads_q
        h = row % heads_q
        hk = h // heads_ratio
        tid = cuda.threadIdx.x
        neg_inf = npdt(NEG_INF)     # in the working dtype: a float64 -inf would promote the scores
        ab = b
        q_off = 0
        k_off = 0
        if VARLEN:
            ab = 0
            clear_unowned_rows(out, lse, cu_q, b, h, x, n_qtiles, BM, D, seqlen_q,
                               tid, NT, neg_inf, write_lse)
            q_off, seqlen_q = packed_sequence(cu_q, b, q.shape[1], seqlen_q)
            k_off, seqlen_k = packed_sequence(cu_k, b, k.shape[1], seqlen_k)
            if qtile * BM >= seqlen_q:
                return
        tb = min(row, mk_tab.shape[0] - 1)
        slope = npdt(0.0)
        if ALIBI:
            slope = npdt(alibi[b, h])

        if SIMULATOR:
            ks = cuda.shared.array((BN, D), dt)
            vs = cuda.shared.array((BN, D), dt)
            ps = cuda.shared.array((BM, PW), dt)
        else:  # cp.async writes and 16-byte loads need 16-byte aligned rows
            ks = cuda.shared.array((BN, D), dt, alignment=16)
            vs = cuda.shared.array((BN, D), dt, alignment=16)
            ps = cuda.shared.array((BM, PW), dt, alignment=16)
        qr = cuda.local.array(QN, dt)      # row r, element e at r * E + e
        acc = cuda.local.array(QN, dt)
        pa = cuda.local.array(PN, dt)      # row r, slot s, partial z at r * 8 + s * SPLIT + z
        cur = cuda.local.array(CN, dt)     # the slot being summed: row r, partial z
        mrow = cuda.local.array(RPR, dt)        # running max and (per-lane partial) sum per row
        lrow = cuda.local.array(RPR, dt)
        pv = cuda.local.array(VN, dt)      # p of 4 keys per row in P V

        gi = tid // TPR               # lane group
        part = tid % TPR              # this lane's share of each row
        col0 = np.uint32(part * CH)   # its first column; chunk c is c * TPR * CH further
        offset = seqlen_k - seqlen_q
        # Warp-uniform: does any row of this warp exist? (Its lowest row is its first group's.)
        active = qtile * BM + (tid // 32) * (32 // TPR) < seqlen_q
        load_q_rows(qr, acc, mrow, lrow, q, ab, q_off, h, qtile, BM, gi, G, seqlen_q, part, TPR,
                    RPR, NC, CH, E, npdt, neg_inf)

        q_lo = qtile * BM + offset
        q_hi = min(qtile * BM + BM, seqlen_q) - 1 + offset
        tile_lo, tile_hi, first, last, sink_tiles = key_tiles(
            q_lo, q_hi, seqlen_k, BN, has_left, has_right, has_sinks, window_left, window_right,
            sinks)

        r_lo = qtile * BM
        r_hi = min(r_lo + BM, seqlen_q)
        lane = tid & 31
        # Tile walk as in the tensor-core kernel: flag ranges, and for a mask object 32 tiles
        # classified at once (warp votes; both warps compute the same sets).
        tile = first
        tile = past_sinks(tile, tile_lo, sink_tiles, has_sinks)
        base = tile
        vbits = np.int64(0)
        fbits = np.int64(0)
        if KIND != NONE:
            vbits, fbits = chunk_classes(KIND, mk_mm, mk_tab, tb, qtile, base, lane, tile_lo,
                                         tile_hi, sink_tiles, r_lo, r_hi)
            base, vbits, fbits = skip_empty_chunks(KIND, mk_mm, mk_tab, tb, qtile, base, vbits,
                                                   fbits, lane, last, tile_lo, tile_hi,
                                                   sink_tiles, r_lo, r_hi, has_sinks)
            tile = first_in_chunk(base, vbits, last)
        if tile <= last:
            copy_tile_async(ks, k, ab, k_off, hk, tile * BN, seqlen_k, tid, NT, COPY_ITERS,
                            COPY_EXACT, BN, CPR, CH)

        while tile <= last:
            nxt = past_sinks(tile + 1, tile_lo, sink_tiles, has_sinks)
            if KIND != NONE:
                mask_full = ((fbits >> (tile - base)) & 1) != 0
                vbits &= vbits - 1
                base, vbits, fbits = skip_empty_chunks(KIND, mk_mm, mk_tab, tb, qtile, base, vbits,
                                                       fbits, lane, last, tile_lo, tile_hi,
                                                       sink_tiles, r_lo, r_hi, has_sinks)
                nxt = first_in_chunk(base, vbits, last)
            # Is every (row, key) pair of this tile visible? Then no per-element mask.
            in_window = tile >= tile_lo and tile <= tile_hi
            k0 = tile * BN
            full = flags_see_whole_tile(k0, in_window, q_lo, q_hi, seqlen_k, window_left,
                                        window_right, sinks, BN, has_left, has_right, has_sinks)
            if KIND != NONE:
                full = full and mask_full

            cp_async_wait_all()
            cuda.syncthreads()  # K tile landed for every thread; everyone is done with V and P
            copy_tile_async(vs, v, ab, k_off, hk, k0, seqlen_k, tid, NT, COPY_ITERS, COPY_EXACT,
                            BN, CPR, CH)

            if active:  # a warp whose rows all lie past seqlen_q only copies and waits
                # S = Q K^T into ps; per row: scores (scale or softcap, ALiBi, score_mod), the
                # mask unless the flags and the mask object see the whole tile, online softmax.
                qk_scores(ps, qr, pa, cur, ks, gi, G, part, col0, TPR, LOG_TPR, SPLIT, BN, RPR, NC,
                          CH, E, npdt)

                for r in range(RPR):
                    row = qtile * BM + gi + r * G
                    qpos = row + offset
                    mx = neg_inf
                    for c in range(NS):
                        x = score_transform(ps[gi + r * G, c * TPR + part], c, b, h, row, qpos,
                                            k0, TPR, part, seqlen_q, seqlen_k, offset, scale,
                                            cap_in, cap_out, slope, smod, has_softcap, ALIBI,
                                            SCORE_MOD, npdt)
                        kpos = k0 + c * TPR + part
                        if not full:
                            x = mask_score(x, b, h, row, qpos, kpos, seqlen_q, seqlen_k,
                                           window_left, window_right, sinks, mk_iv, mk_bits, mod,
                                           has_left, has_right, has_sinks, KIND, npdt, neg_inf)
                        ps[gi + r * G, c * TPR + part] = x
                        mx = max(mx, x)
                    softmax_update(ps, acc, mrow, lrow, mx, r, gi, G, part, TPR, LOG_TPR, BN, E,
                                   npdt, neg_inf)

            cp_async_wait_all()
            cuda.syncthreads()  # V tile and P landed; everyone is done with K
            if nxt <= last:
                copy_tile_async(ks, k, ab, k_off, hk, nxt * BN, seqlen_k, tid, NT, COPY_ITERS,
                                COPY_EXACT, BN, CPR, CH)

            if active:  # O += P V
                pv_accumulate(acc, pv, ps, vs, gi, G, col0, TPR, BN, RPR, NC, CH, E)
            tile = nxt

        store_rows(out, lse, acc, mrow, lrow, ab, q_off, h, qtile, BM, gi, G, seqlen_q, part, TPR,
                   LOG_TPR, RPR, NC, CH, E, write_lse, npdt, neg_inf)

    return jit_kernel(kernel, ("fma", D, bool(is_f64), has_left, has_right, has_sinks, has_softcap,
                         write_lse, BN, KIND, VARLEN, ALIBI, SCORE_MOD),
                cache=mask_mod is None and score_mod is None)
