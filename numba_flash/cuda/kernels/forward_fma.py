"""Tiled FlashAttention-2 forward on CUDA cores, exact in float32 / float64: 2 to 8 lanes share 1
or 2 query rows, each holding its share of q and of the outputs in registers; K/V tiles in
shared memory (cp.async), online softmax per tile.

Shapes (kernel arguments): q (B, Sq, Hq, D), k and v (B, Sk, Hkv, D), out (B, Sq, Hq, D), lse
float32 (B, Hq, Sq); any strides. Grid: (number of query tiles, B * Hq).
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda
from numba.cuda import types

from ..primitives import (SIMULATOR, cp_async16, cp_async_commit, cp_async_wait_all, lds16,
                          lowest_bit, shfl_xor)
from .forward_geometry import fma_lanes_per_row, fma_rows_per_lane, fma_threads
from .jitcache import jit_kernel
from .masking import (BITMASK, INTERVALS, NONE, bit_visible, chunk_classes, interval_visible,
                      key_tiles, mask_mod_device, score_mod_device)
from .sequences import packed_sequence

__all__ = ["make_fma_kernel"]


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
        qtile = n_qtiles - 1 - cuda.blockIdx.x
        heads_q = q.shape[2]
        b = cuda.blockIdx.y // heads_q
        h = cuda.blockIdx.y % heads_q
        hk = h // heads_ratio
        tid = cuda.threadIdx.x
        ab = b
        q_off = 0
        k_off = 0
        if VARLEN:
            ab = 0
            q_off, seqlen_q = packed_sequence(cu_q, b, q.shape[1], seqlen_q)
            k_off, seqlen_k = packed_sequence(cu_k, b, k.shape[1], seqlen_k)
            if qtile * BM >= seqlen_q:
                return
        tb = min(cuda.blockIdx.y, mk_tab.shape[0] - 1)
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
        for r in range(RPR):
            row = qtile * BM + gi + r * G
            for c in range(NC):
                for i in range(CH):
                    x = npdt(0.0)
                    if row < seqlen_q:
                        x = q[ab, q_off + row, h, (c * TPR + part) * CH + i]
                    qr[r * E + c * CH + i] = x
                    acc[r * E + c * CH + i] = npdt(0.0)
            mrow[r] = npdt(NEG_INF)
            lrow[r] = npdt(0.0)

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
        if has_sinks and tile >= sink_tiles and tile < tile_lo:
            tile = tile_lo
        base = tile
        vbits = np.int64(0)
        fbits = np.int64(0)
        if KIND != NONE:
            vbits, fbits = chunk_classes(KIND, mk_mm, mk_tab, tb, qtile, base, lane, tile_lo,
                                         tile_hi, sink_tiles, r_lo, r_hi)
            while vbits == 0 and base + 32 <= last:
                base += 32
                if has_sinks and base >= sink_tiles and base < tile_lo:
                    base = tile_lo
                vbits, fbits = chunk_classes(KIND, mk_mm, mk_tab, tb, qtile, base, lane, tile_lo,
                                             tile_hi, sink_tiles, r_lo, r_hi)
            tile = base + lowest_bit(vbits) if vbits != 0 else last + 1
        if tile <= last:
            for it in range(COPY_ITERS):
                i = it * NT + tid
                if COPY_EXACT or i < BN * CPR:
                    kr = i // CPR
                    cc = (i - kr * CPR) * CH
                    key = tile * BN + kr
                    ok = key < seqlen_k
                    cp_async16(ks, kr, cc, k, ab, k_off + key if ok else 0, hk, cc, 16 if ok else 0)
            cp_async_commit()

        while tile <= last:
            nxt = tile + 1
            if has_sinks and nxt >= sink_tiles and nxt < tile_lo:
                nxt = tile_lo
            if KIND != NONE:
                mask_full = ((fbits >> (tile - base)) & 1) != 0
                vbits &= vbits - 1
                while vbits == 0 and base + 32 <= last:
                    base += 32
                    if has_sinks and base >= sink_tiles and base < tile_lo:
                        base = tile_lo
                    vbits, fbits = chunk_classes(KIND, mk_mm, mk_tab, tb, qtile, base, lane,
                                                 tile_lo, tile_hi, sink_tiles, r_lo, r_hi)
                nxt = base + lowest_bit(vbits) if vbits != 0 else last + 1
            in_window = tile >= tile_lo and tile <= tile_hi
            k0 = tile * BN
            full = k0 + BN <= seqlen_k and in_window
            if has_left:
                full = full and k0 >= q_hi - window_left
            if has_right:
                full = full and k0 + BN - 1 <= q_lo + window_right
            if has_sinks:
                full = full or (k0 + BN <= sinks and k0 + BN - 1 <= q_lo and k0 + BN <= seqlen_k)
            if KIND != NONE:
                full = full and mask_full

            cp_async_wait_all()
            cuda.syncthreads()  # K tile landed for every thread; everyone is done with V and P
            for it in range(COPY_ITERS):
                i = it * NT + tid
                if COPY_EXACT or i < BN * CPR:
                    kr = i // CPR
                    cc = (i - kr * CPR) * CH
                    key = k0 + kr
                    ok = key < seqlen_k
                    cp_async16(vs, kr, cc, v, ab, k_off + key if ok else 0, hk, cc, 16 if ok else 0)
            cp_async_commit()

            if active:  # a warp whose rows all lie past seqlen_q only copies and waits
                # S = Q K^T, TPR keys per round. In slot s this lane adds its chunks of key
                # (s ^ part): the butterfly below then needs no selects (at mask hm, slot s + hm of
                # the partner lane holds the key of this lane's slot s).
                for rnd in range(NS):
                    for s in range(TPR):
                        j = np.uint32(rnd * TPR + (s ^ part))
                        for z in range(CN):
                            cur[z] = npdt(0.0)
                        for c in range(NC):
                            kv = lds16(ks, j, col0, c * TPR * 16)
                            for r in range(RPR):
                                for i in range(CH):
                                    e = c * CH + i
                                    cur[r * SPLIT + e % SPLIT] += qr[r * E + e] * kv[i]
                        # Slots shift down one place and this one enters at the top: after TPR
                        # steps slot s sits at place s, and no index depends on s (whether or not
                        # the compiler unrolls this loop, pa stays in registers).
                        for r in range(RPR):
                            for t in range(TPR - 1):
                                for z in range(SPLIT):
                                    pa[r * 8 + t * SPLIT + z] = pa[r * 8 + (t + 1) * SPLIT + z]
                            for z in range(SPLIT):
                                pa[r * 8 + (TPR - 1) * SPLIT + z] = cur[r * SPLIT + z]
                    for r in range(RPR):
                        w = SPLIT // 2
                        while w >= 1:   # pairwise within the lane
                            for s in range(TPR):
                                for z in range(w):
                                    pa[r * 8 + s * SPLIT + z] += pa[r * 8 + s * SPLIT + z + w]
                            w //= 2
                        for lv in range(LOG_TPR):   # pairwise across lanes, scattering keys
                            hm = TPR >> (lv + 1)
                            for s in range(hm):
                                pa[r * 8 + s * SPLIT] += shfl_xor(pa[r * 8 + (s + hm) * SPLIT], hm)
                        ps[gi + r * G, rnd * TPR + part] = pa[r * 8]   # key k0 + rnd * TPR + part

                for r in range(RPR):
                    row = qtile * BM + gi + r * G
                    qpos = row + offset
                    mx = npdt(NEG_INF)
                    for c in range(NS):
                        dot = ps[gi + r * G, c * TPR + part]
                        if has_softcap:
                            x = cap_out * math.tanh(cap_in * dot)
                        else:
                            x = scale * dot
                        kpos = k0 + c * TPR + part
                        if ALIBI:
                            x -= slope * abs(qpos - kpos)
                        if SCORE_MOD:   # indices inside the sequence (see make_mma_kernel)
                            x = npdt(smod(x, b, h, min(row, seqlen_q - 1) + offset,
                                          min(kpos, seqlen_k - 1)))
                        if not full:
                            vis = kpos < seqlen_k
                            wv = True
                            if has_left:
                                wv = kpos >= qpos - window_left
                            if has_right:
                                wv = wv and kpos <= qpos + window_right
                            if has_sinks:
                                wv = wv or (kpos < sinks and kpos <= qpos)
                            if KIND != NONE and vis and wv and row < seqlen_q:
                                if KIND == INTERVALS:
                                    wv = interval_visible(mk_iv, row, kpos)
                                elif KIND == BITMASK:
                                    wv = bit_visible(mk_bits, row, kpos)
                                else:
                                    wv = mod(b, h, qpos, kpos)
                            if not (vis and wv):
                                x = npdt(NEG_INF)
                        ps[gi + r * G, c * TPR + part] = x
                        mx = max(mx, x)
                    for lv in range(LOG_TPR):
                        mx = max(mx, shfl_xor(mx, 1 << lv))
                    m = mrow[r]
                    mn = max(m, mx)
                    # A row that has seen no key yet keeps m = -inf; subtract 0 then so exp gives 0.
                    mu = mn if mn != NEG_INF else npdt(0.0)
                    alpha = math.exp(m - mu)
                    mrow[r] = mn
                    rs = npdt(0.0)
                    for c in range(NS):
                        p = math.exp(ps[gi + r * G, c * TPR + part] - mu)
                        ps[gi + r * G, c * TPR + part] = p
                        rs += p
                    lrow[r] = lrow[r] * alpha + rs   # per-lane partial; the group adds up at the end
                    for e in range(E):
                        acc[r * E + e] *= alpha

            cp_async_wait_all()
            cuda.syncthreads()  # V tile and P landed; everyone is done with K
            if nxt <= last:
                for it in range(COPY_ITERS):
                    i = it * NT + tid
                    if COPY_EXACT or i < BN * CPR:
                        kr = i // CPR
                        cc = (i - kr * CPR) * CH
                        key = nxt * BN + kr
                        ok = key < seqlen_k
                        cp_async16(ks, kr, cc, k, ab, k_off + key if ok else 0, hk, cc, 16 if ok else 0)
                cp_async_commit()

            if active:
                for jg in range(BN // 4):      # 4 keys per step (their p: 16 or 32 bytes per row)
                    j = np.uint32(jg * 4)
                    for r in range(RPR):
                        prow = np.uint32(gi + r * G)
                        if CH == 4:
                            p0, p1, p2, p3 = lds16(ps, prow, j, 0)
                        else:
                            p0, p1 = lds16(ps, prow, j, 0)
                            p2, p3 = lds16(ps, prow, j, 16)
                        pv[r * 4] = p0
                        pv[r * 4 + 1] = p1
                        pv[r * 4 + 2] = p2
                        pv[r * 4 + 3] = p3
                    for c in range(NC):
                        v0 = lds16(vs, j, col0, c * TPR * 16)
                        v1 = lds16(vs, j + np.uint32(1), col0, c * TPR * 16)
                        v2 = lds16(vs, j + np.uint32(2), col0, c * TPR * 16)
                        v3 = lds16(vs, j + np.uint32(3), col0, c * TPR * 16)
                        for r in range(RPR):
                            for i in range(CH):
                                a = acc[r * E + c * CH + i]
                                a += pv[r * 4] * v0[i]
                                a += pv[r * 4 + 1] * v1[i]
                                a += pv[r * 4 + 2] * v2[i]
                                a += pv[r * 4 + 3] * v3[i]
                                acc[r * E + c * CH + i] = a
            tile = nxt

        for r in range(RPR):
            l = lrow[r]
            for lv in range(LOG_TPR):
                l += shfl_xor(l, 1 << lv)
            row = qtile * BM + gi + r * G
            if row < seqlen_q:
                inv = npdt(0.0)
                if l != 0:
                    inv = npdt(1.0) / l
                for c in range(NC):
                    for i in range(CH):
                        out[ab, q_off + row, h, (c * TPR + part) * CH + i] = acc[r * E + c * CH + i] * inv
                if write_lse and part == 0:
                    lse[ab, h, q_off + row] = mrow[r] + math.log(l) if l != 0 else NEG_INF

    return jit_kernel(kernel, ("fma", D, bool(is_f64), has_left, has_right, has_sinks, has_softcap,
                         write_lse, BN, KIND, VARLEN, ALIBI, SCORE_MOD),
                cache=mask_mod is None and score_mod is None)
