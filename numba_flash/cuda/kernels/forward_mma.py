"""Tiled FlashAttention-2 forward on tensor cores (float16 / bfloat16, fp32 accumulation).

A block of 4 warps owns a 64-row (two m-tiles: 128-row) query tile, each warp 16 rows per
m-tile; K and V tiles of ``block_n`` keys stream through shared memory (cp.async, 16 bytes per
copy; B fragments through ldmatrix, transposed for V); scores, running max/sum and the output
accumulator stay in registers and the score fragment becomes the A operand of P @ V without
leaving them. On compute capability 9.0 at head_dim 64 / 128 the same walk runs on wgmma (two
warpgroups, 128x128 tiles in 128-byte-swizzled dynamic shared memory). Inputs are ``uint32``
views (two 16-bit values per word along head_dim).

Shapes (kernel arguments): q (B, Sq, Hq, D/2), k and v (B, Sk, Hkv, D/2), out (B, Sq, Hq, D/2),
lse float32 (B, Hq, Sq); any strides. Grid: (number of query tiles, B * Hq).
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda
from numba.cuda import types

from ..primitives import (SIMULATOR, cp_async4_to, cp_async16, cp_async16_to, cp_async_commit,
                          cp_async_wait_all, exp2, fence_proxy_async, ldmatrix_x4,
                          ldmatrix_x4_trans, lds_i32x2, lowest_bit, mma16, pack16, shared_addr,
                          shfl_xor, sw128_desc, wgmma_commit, wgmma_fence, wgmma_rs, wgmma_ss,
                          wgmma_wait)
from .forward_geometry import MMA_THREADS, WG_THREADS, mma_q_in_smem, mma_swizzled
from .jitcache import jit_kernel
from .masking import (BITMASK, INTERVALS, LN2, LOG2E, MASK_MOD, NONE, chunk_classes, key_tiles,
                      mask_mod_device, score_mod_device)
from .sequences import packed_sequence

__all__ = ["make_mma_kernel"]


def make_mma_kernel(head_dim: int, is_bf16: bool, has_left: bool, has_right: bool,
                    has_sinks: bool, has_softcap: bool, write_lse: bool, block_n: int,
                    mask_kind: int = NONE, varlen: bool = False, has_alibi: bool = False,
                    mask_mod=None, m_tiles: int = 1, wgmma: bool = False, score_mod=None):
    """Build the tensor-core kernel for one configuration (all arguments compile-time).

    Kernel signature: ``(q, k, v, out, lse, seqlen_q, seqlen_k, heads_ratio, scale_log2,
    cap_in, cap_out, window_left, window_right, sinks, mk_iv, mk_mm, mk_tab, mk_bits, cu_q, cu_k,
    alibi)``; q/k/v/out uint32 (B, S, H, D/2), lse float32 (B, Hq, Sq); float scalars as float32.
    Mask arrays (dummies when unused; see masking.py): mk_iv int32 (4, Sk) intervals, mk_mm int32
    (8, n_ktiles) their min/max, mk_tab int8 (T, n_qtiles, n_ktiles) class table (T = 1 or
    B * Hq), mk_bits uint32 bitmask words. ``varlen``: q/k/v/out are (1, total, H, D/2), lse
    (1, Hq, total_q), sequence b owns rows cu_q[b]:cu_q[b+1] and keys cu_k[b]:cu_k[b+1].
    ``has_alibi``: alibi float32 (B, Hq) slopes, ``-slope * |i - j|`` added after the softcap. With softcap the base-2 score is
    ``cap_out * tanh(cap_in * q.k)``, else ``scale_log2 * q.k``. ``score_mod``: the user's
    ``fn(score, b, h, q_idx, kv_idx)``, compiled in and applied after the softcap and ALiBi to
    the natural-log score (the kernel's base-2 score times ln 2; the result times log2 e), with
    q_idx and kv_idx clamped into the sequence (rows and keys past it are never used).

    Pipeline per key tile (FlashAttention-2's): wait for K, barrier, start the V copy
    (cp.async), S = Q K^T from ldmatrix fragments, online softmax, wait for V, barrier, start
    the next K copy, O += P V (ldmatrix.trans fragments). Each copy overlaps one matrix product.
    Each warp owns ``m_tiles`` consecutive 16-row m-tiles (block: 64 * m_tiles rows); every
    K / V fragment it loads feeds the HMMAs of all of them.

    ``wgmma`` (Hopper, compute capability 9.0; primitives/wgmma.py): two warpgroups (8 warps, 256
    threads, ``WG_THREADS``) own a 128-row query tile, 64 rows each; S = Q K^T and O += P V are
    warpgroup products (``wgmma`` m64nNk16: Q, K, V from 128-byte-swizzled tiles in dynamic
    shared memory, P from registers), with ``m_tiles`` 1 and ``block_n`` 64 or 128. The
    fragments, the online softmax, the masks and the tile walk are the mma.sync path's: warp w
    owns rows 16 w .. 16 w + 15 of the block either way. Dynamic shared memory:
    ``wgmma_smem_bytes(head_dim, block_n)``.
    """
    D = head_dim
    MT = int(m_tiles)
    assert MT in (1, 2), m_tiles
    WG = bool(wgmma)
    THREADS = WG_THREADS if WG else MMA_THREADS
    if WG:
        assert MT == 1 and D in (64, 128) and block_n in (64, 128), (MT, D, block_n)
    BM, BN = 16 * (THREADS // 32) * MT, block_n
    WROWS = 16 * MT      # rows per warp
    DW = D // 2
    KS, NS, NP, ND = D // 16, BN // 8, BN // 16, D // 8
    SF, OF = NS * 4, ND * 4
    S_N, ACC_N, RUN_N, PK_N = SF * MT, OF * MT, 2 * MT, SF * MT // 2   # local-array sizes
    Q_SMEM = mma_q_in_smem(D) or MT > 1 or WG
    QF = 4 if Q_SMEM else KS * 4          # Q fragment registers (unused when Q is in smem)
    SWZ = mma_swizzled(D)
    # Row stride in words. Bank conflicts of ldmatrix (8 rows, same logical column) are avoided
    # either by 16 bytes of padding per row, or by storing 16-byte chunk c of row r at chunk
    # c ^ (r & 7): with word columns that are multiples of 4, that is col ^ ((r & 7) << 2).
    KW = DW if SWZ else DW + 4
    SWZ_MASK = 28 if SWZ else 0
    CPR = D // 8         # 16-byte chunks per row
    # Tile copies: TPL consecutive threads cover a 16 * TPL-byte segment of a row (a whole
    # 128-byte line when TPL = 8), RPP rows per pass; thread `part` copies chunk part of each
    # segment of its rows cp_row + RPP * pass. Per pass one global row pointer (the segments
    # are immediate offsets from it) and one bounds predicate; its shared-memory addresses are
    # one register plus immediates (RPP is a multiple of 8, so the swizzle is the same in every
    # pass); 8 consecutive lanes write 8 distinct bank groups; a warp instruction touches 4
    # whole lines of global memory (one chunk per row and lane touched 16 lines and ran slower).
    TPL = 8 if CPR % 8 == 0 else 4
    RPP = THREADS // TPL
    NSEG = CPR // TPL
    KV_PASSES = BN // RPP
    Q_PASSES = BM // RPP
    assert BN % RPP == 0 and BM % RPP == 0, (BN, BM, RPP)
    QS_ROWS, QS_COLS = (BM, KW) if Q_SMEM and not WG else (1, 4)
    KS_ROWS, KS_COLS = (1, 4) if WG else (BN, KW)     # static tiles (unused by the wgmma path)
    # wgmma path: byte offsets in dynamic shared memory of the Q, K and V tiles, each made of
    # 64-column blocks of rows x 128 bytes (primitives/wgmma.py), and the size of one block.
    BLK_Q, BLK_K = BM * 128, BN * 128
    Q_OFF, K_OFF, V_OFF = 0, BM * D * 2, (BM + BN) * D * 2
    # Interval masks on the wgmma path: the key tile's 4 bound vectors (4 x BN int32) travel
    # with the K tile (4-byte cp.async) and the mask pass reads them from shared memory. From
    # global memory, ptxas interleaved each column's loads with their uses (255 registers),
    # so a partial tile waited for ~64 L2 round trips in a row.
    IV_SMEM = WG and int(mask_kind) == INTERVALS
    IV_OFF = (BM + 2 * BN) * D * 2
    IV_PER_THREAD = 4 * BN // THREADS
    # Closure cells must be plain constants: the on-disk cache keys on their pickled bytes, and
    # an intrinsic object pickles differently in every process.
    BF16 = bool(is_bf16)
    NEG_INF = -math.inf
    KIND = int(mask_kind)
    VARLEN = bool(varlen)
    ALIBI = bool(has_alibi)
    mod = mask_mod_device(mask_mod)
    SCORE_MOD = score_mod is not None
    smod = score_mod_device(score_mod)

    def kernel(q, k, v, out, lse, seqlen_q, seqlen_k, heads_ratio, scale_log2, cap_in, cap_out,
               window_left, window_right, sinks, mk_iv, mk_mm, mk_tab, mk_bits, cu_q, cu_k, alibi):
        n_qtiles = cuda.gridDim.x
        qtile = n_qtiles - 1 - cuda.blockIdx.x      # longest (causal) tiles first
        heads_q = q.shape[2]
        b = cuda.blockIdx.y // heads_q
        h = cuda.blockIdx.y % heads_q
        hk = h // heads_ratio
        ab = b          # batch index into the arrays (0 for a packed batch)
        q_off = 0       # first row of this sequence in q / out / lse, first key in k / v
        k_off = 0
        if VARLEN:
            ab = 0
            q_off, seqlen_q = packed_sequence(cu_q, b, q.shape[1], seqlen_q)
            k_off, seqlen_k = packed_sequence(cu_k, b, k.shape[1], seqlen_k)
            if qtile * BM >= seqlen_q:
                return
        tb = min(cuda.blockIdx.y, mk_tab.shape[0] - 1)
        slope = np.float32(0.0)
        if ALIBI:
            slope = alibi[b, h] * np.float32(LOG2E)
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        g = lane >> 2
        t = lane & 3
        # ldmatrix row addresses: lanes 8m..8m+7 address matrix m.
        v_row = ((lane >> 3) & 1) * 8 + (lane & 7)
        v_col = (lane >> 4) * 4
        # Every ldmatrix row this lane addresses is = lane (mod 8): one swizzle term per thread.
        swz = SWZ_MASK & ((lane & 7) << 2)
        cp_row = tid // TPL                      # tile-copy coordinates (see TPL above)
        cp_part = tid % TPL
        cp_swz = SWZ_MASK & ((cp_row & 7) << 2)

        if SIMULATOR:  # the simulator rejects an alignment argument
            ks = cuda.shared.array((KS_ROWS, KS_COLS), types.uint32)
            vs = cuda.shared.array((KS_ROWS, KS_COLS), types.uint32)
            qs = cuda.shared.array((QS_ROWS, QS_COLS), types.uint32)
        else:          # cp.async and ldmatrix need 16-byte aligned rows
            ks = cuda.shared.array((KS_ROWS, KS_COLS), types.uint32, alignment=16)
            vs = cuda.shared.array((KS_ROWS, KS_COLS), types.uint32, alignment=16)
            qs = cuda.shared.array((QS_ROWS, QS_COLS), types.uint32, alignment=16)
        sbase = 0       # wgmma path: 1024-byte aligned start of the dynamic tiles
        cp_dst = 0      # this thread's first copy destination, relative to a tile's start
        dq = np.uint64(0)
        dk = np.uint64(0)
        dv = np.uint64(0)
        if WG:
            dyn = cuda.shared.array(0, types.uint32)
            sbase = (np.int64(shared_addr(dyn)) + 1023) & ~1023
            cp_dst = cp_row * 128 + ((cp_part ^ (cp_row & 7)) << 4)
            # Descriptors: this warpgroup's 64 Q rows, the K tile (both K-major) and the V tile
            # (MN-major: leading offset = one 64-column block of V).
            dq = sw128_desc(sbase + Q_OFF + (warp >> 2) * 64 * 128, 16, 1024)
            dk = sw128_desc(sbase + K_OFF, 16, 1024)
            dv = sw128_desc(sbase + V_OFF, BLK_K, 1024)
        qf = cuda.local.array(QF, types.uint32)
        s = cuda.local.array(S_N, types.float32)           # m-tile mt: s[mt * SF:(mt + 1) * SF]
        acc = cuda.local.array(ACC_N, types.float32)
        pk = cuda.local.array(PK_N, types.uint32)         # P as 16-bit pairs, same order as s
        # Running max and sum of rows g and g + 8 of each m-tile (index 2 * mt + half).
        m_run = cuda.local.array(RUN_N, types.float32)
        l_run = cuda.local.array(RUN_N, types.float32)
        mx = cuda.local.array(RUN_N, types.float32)       # per tile: row maxima, then row sums
        mu = cuda.local.array(RUN_N, types.float32)
        alpha = cuda.local.array(RUN_N, types.float32)
        words = cuda.local.array(RUN_N, types.uint32)     # bitmask words of the rows (partial tiles)

        offset = seqlen_k - seqlen_q
        wrow = qtile * BM + warp * WROWS     # first row of this warp
        row0 = wrow + g                      # rows of m-tile 0 (the register-Q path has MT = 1)
        row1 = row0 + 8

        zero_w = np.uint32(0)
        for kk in range(0 if Q_SMEM else KS):
            w = kk * 8 + t
            x0 = zero_w
            x2 = zero_w
            if row0 < seqlen_q:
                x0 = q[ab, q_off + row0, h, w]
                x2 = q[ab, q_off + row0, h, w + 4]
            x1 = zero_w
            x3 = zero_w
            if row1 < seqlen_q:
                x1 = q[ab, q_off + row1, h, w]
                x3 = q[ab, q_off + row1, h, w + 4]
            qf[kk * 4 + 0] = x0
            qf[kk * 4 + 1] = x1
            qf[kk * 4 + 2] = x2
            qf[kk * 4 + 3] = x3
        for i in range(MT * OF):
            acc[i] = np.float32(0.0)
        for i in range(2 * MT):
            m_run[i] = np.float32(NEG_INF)
            l_run[i] = np.float32(0.0)

        # Key tiles this query tile can see (block-uniform): the window's tiles, plus sink tiles.
        q_lo = qtile * BM + offset
        q_hi = min(qtile * BM + BM, seqlen_q) - 1 + offset
        tile_lo, tile_hi, first, last, sink_tiles = key_tiles(
            q_lo, q_hi, seqlen_k, BN, has_left, has_right, has_sinks, window_left, window_right,
            sinks)

        # Mask object: its skipped tiles are never loaded. Tiles are classified 32 at a time
        # (lane i: tile base + i) into block-uniform bit sets of visible / full tiles (warp
        # votes), and the walk jumps from set bit to set bit: no serial chain of class loads.
        r_lo = qtile * BM
        r_hi = min(r_lo + BM, seqlen_q)
        tile = first
        base = first
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
            if Q_SMEM:  # the Q tile joins the first K tile's copy group (rows past Sq: zeros)
                for ps in range(Q_PASSES):
                    qrow = qtile * BM + cp_row + ps * RPP
                    q_ok = qrow < seqlen_q
                    q_src = q_off + qrow if q_ok else 0
                    for sg in range(NSEG):
                        c = (sg * TPL + cp_part) * 4
                        if WG:
                            cp_async16_to(sbase + Q_OFF + cp_dst + ps * RPP * 128 + sg * BLK_Q,
                                          q, ab, q_src, h, c, 16 if q_ok else 0)
                        else:
                            cp_async16(qs, cp_row + ps * RPP, c ^ cp_swz, q, ab, q_src, h, c,
                                       16 if q_ok else 0)
            for ps in range(KV_PASSES):
                key = tile * BN + cp_row + ps * RPP
                ok = key < seqlen_k
                src = k_off + key if ok else 0
                for sg in range(NSEG):
                    c = (sg * TPL + cp_part) * 4
                    if WG:
                        cp_async16_to(sbase + K_OFF + cp_dst + ps * RPP * 128 + sg * BLK_K,
                                      k, ab, src, hk, c, 16 if ok else 0)
                    else:
                        cp_async16(ks, cp_row + ps * RPP, c ^ cp_swz, k, ab, src, hk, c,
                                   16 if ok else 0)
            if IV_SMEM:
                for u in range(IV_PER_THREAD):
                    idx = tid + u * THREADS          # bound idx // BN of column idx % BN
                    key = tile * BN + idx % BN
                    cp_async4_to(sbase + IV_OFF + idx * 4, mk_iv, idx // BN,
                                 key if key < seqlen_k else 0, 4 if key < seqlen_k else 0)
            cp_async_commit()

        while tile <= last:
            nxt = tile + 1
            if has_sinks and nxt >= sink_tiles and nxt < tile_lo:
                nxt = tile_lo
            if KIND != NONE:
                mask_full = ((fbits >> (tile - base)) & 1) != 0
                vbits &= vbits - 1          # drop this tile; the next set bit is nxt
                while vbits == 0 and base + 32 <= last:
                    base += 32
                    if has_sinks and base >= sink_tiles and base < tile_lo:
                        base = tile_lo
                    vbits, fbits = chunk_classes(KIND, mk_mm, mk_tab, tb, qtile, base, lane,
                                                 tile_lo, tile_hi, sink_tiles, r_lo, r_hi)
                nxt = base + lowest_bit(vbits) if vbits != 0 else last + 1
            in_window = tile >= tile_lo and tile <= tile_hi
            k0 = tile * BN
            # Is every (row, key) pair of this tile visible? Then no per-element mask.
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
            if WG:
                fence_proxy_async()   # the copies' bytes visible to wgmma (the async proxy)
            cuda.syncthreads()  # K tile landed for every thread; every warp is done with V
            for ps in range(KV_PASSES):
                key = k0 + cp_row + ps * RPP
                ok = key < seqlen_k
                src = k_off + key if ok else 0
                for sg in range(NSEG):
                    c = (sg * TPL + cp_part) * 4
                    if WG:
                        cp_async16_to(sbase + V_OFF + cp_dst + ps * RPP * 128 + sg * BLK_K,
                                      v, ab, src, hk, c, 16 if ok else 0)
                    else:
                        cp_async16(vs, cp_row + ps * RPP, c ^ cp_swz, v, ab, src, hk, c,
                                   16 if ok else 0)
            cp_async_commit()

            # S = Q K^T: NS independent 16x8 accumulators per m-tile; each K fragment feeds the
            # m-tiles (A fragments a* of m-tile 0, e* of m-tile 1; MT is at most 2).
            if WG:
                # k-step kk: column block kk // 4, 32 bytes per step inside it (descriptor
                # addresses count 16-byte units); the first step overwrites s (scale-d 0).
                wgmma_fence()
                for kk in range(KS):
                    wgmma_ss(BF16, BN, s,
                             dq + np.uint64((kk // 4) * (BLK_Q >> 4) + (kk % 4) * 2),
                             dk + np.uint64((kk // 4) * (BLK_K >> 4) + (kk % 4) * 2),
                             0 if kk == 0 else 1)
                wgmma_commit()
                wgmma_wait(BN, s)
            else:
                for i in range(S_N):
                    s[i] = np.float32(0.0)
            for kk in range(0 if WG else KS):
                if Q_SMEM:
                    a0, a1, a2, a3 = ldmatrix_x4(qs, warp * WROWS + v_row, (kk * 8 + v_col) ^ swz)
                else:
                    a0 = qf[kk * 4]
                    a1 = qf[kk * 4 + 1]
                    a2 = qf[kk * 4 + 2]
                    a3 = qf[kk * 4 + 3]
                if MT > 1:
                    e0, e1, e2, e3 = ldmatrix_x4(qs, warp * WROWS + 16 + v_row,
                                                 (kk * 8 + v_col) ^ swz)
                for jj in range(NS // 2):
                    # Same lane addressing as the Q and V loads (one set of swizzled column
                    # offsets for all three): matrices (keys 0-7, k 0-7), (keys 8-15, k 0-7),
                    # (keys 0-7, k 8-15), (keys 8-15, k 8-15) -> b0, b2, b1, b3.
                    b0, b2, b1, b3 = ldmatrix_x4(ks, jj * 16 + v_row, (kk * 8 + v_col) ^ swz)
                    j = 8 * jj
                    c0, c1, c2, c3 = mma16(BF16, a0, a1, a2, a3,
                                           b0, b1, s[j], s[j + 1], s[j + 2], s[j + 3])
                    s[j] = c0
                    s[j + 1] = c1
                    s[j + 2] = c2
                    s[j + 3] = c3
                    c0, c1, c2, c3 = mma16(BF16, a0, a1, a2, a3,
                                           b2, b3, s[j + 4], s[j + 5], s[j + 6], s[j + 7])
                    s[j + 4] = c0
                    s[j + 5] = c1
                    s[j + 6] = c2
                    s[j + 7] = c3
                    if MT > 1:
                        j += SF
                        c0, c1, c2, c3 = mma16(BF16, e0, e1, e2, e3,
                                               b0, b1, s[j], s[j + 1], s[j + 2], s[j + 3])
                        s[j] = c0
                        s[j + 1] = c1
                        s[j + 2] = c2
                        s[j + 3] = c3
                        c0, c1, c2, c3 = mma16(BF16, e0, e1, e2, e3,
                                               b2, b3, s[j + 4], s[j + 5], s[j + 6], s[j + 7])
                        s[j + 4] = c0
                        s[j + 5] = c1
                        s[j + 6] = c2
                        s[j + 7] = c3

            # Scores to base-2 logits, mask, row maxima. Element e of n-tile j of m-tile mt: row
            # g (e < 2) or g + 8 of the m-tile, key k0 + 8 j + 2 t + (e & 1). The m-tile loop is
            # innermost so that every loop here unrolls fully.
            for j in range(NS):
                for e in range(4):
                    kpos = k0 + j * 8 + 2 * t + (e & 1)
                    for mt in range(MT):
                        x = s[mt * SF + j * 4 + e]
                        if has_softcap:
                            x = cap_out * math.tanh(cap_in * x)
                        else:
                            x = x * scale_log2
                        if ALIBI:
                            qpos = wrow + mt * 16 + g + 8 * (e >> 1) + offset
                            x -= slope * abs(qpos - kpos)
                        if SCORE_MOD:   # natural-log score in, indices inside the sequence
                            qc = min(wrow + mt * 16 + g + 8 * (e >> 1), seqlen_q - 1) + offset
                            kc = min(kpos, seqlen_k - 1)
                            x = np.float32(smod(x * np.float32(LN2), b, h, qc, kc)) * \
                                np.float32(LOG2E)
                        s[mt * SF + j * 4 + e] = x
            # Per-element masking in its own pass behind one block-uniform branch, so that
            # tiles without masked pairs run straight-line code. A key column's mask data (4
            # interval bounds, or a bitmask word per row and 8 keys) is loaded once for all
            # the thread's rows.
            if not full:
                for j in range(NS):
                    if KIND == BITMASK:
                        wcol = min((k0 + j * 8) >> 5, mk_bits.shape[1] - 1)
                        for r in range(RUN_N):
                            row = wrow + (r >> 1) * 16 + g + 8 * (r & 1)
                            words[r] = mk_bits[min(row, seqlen_q - 1), wcol]
                    if IV_SMEM:   # this thread's two columns of each bound: one 8-byte load
                        ivc = sbase + IV_OFF + (j * 8 + 2 * t) * 4
                        lts0, lts1 = lds_i32x2(ivc)
                        lte0, lte1 = lds_i32x2(ivc + BN * 4)
                        uts0, uts1 = lds_i32x2(ivc + BN * 8)
                        ute0, ute1 = lds_i32x2(ivc + BN * 12)
                    for c in range(2):
                        kpos = k0 + j * 8 + 2 * t + c
                        if IV_SMEM:
                            lts = lts0 if c == 0 else lts1
                            lte = lte0 if c == 0 else lte1
                            uts = uts0 if c == 0 else uts1
                            ute = ute0 if c == 0 else ute1
                        elif KIND == INTERVALS:
                            col = min(kpos, seqlen_k - 1)
                            lts = mk_iv[0, col]
                            lte = mk_iv[1, col]
                            uts = mk_iv[2, col]
                            ute = mk_iv[3, col]
                        # Bitwise & / | on the booleans (not `and` / `or`): selects, no
                        # branches, so the pass is one scheduled stretch per column.
                        for r in range(RUN_N):
                            row = wrow + (r >> 1) * 16 + g + 8 * (r & 1)
                            qpos = row + offset
                            vis = kpos < seqlen_k
                            if has_left:
                                vis = vis & (kpos >= qpos - window_left)
                            if has_right:
                                vis = vis & (kpos <= qpos + window_right)
                            if has_sinks:
                                vis = vis | ((kpos < sinks) & (kpos <= qpos) & (kpos < seqlen_k))
                            if KIND == INTERVALS:
                                vis = vis & ((row < lts) | (row >= lte)) & ((row < uts) |
                                                                            (row >= ute))
                            elif KIND == BITMASK:
                                vis = vis & (((words[r] >> (kpos & 31)) & 1) != 0)
                            elif KIND == MASK_MOD:
                                if vis and row < seqlen_q:
                                    vis = mod(b, h, qpos, kpos)
                            e = (r >> 1) * SF + j * 4 + c + 2 * (r & 1)
                            s[e] = s[e] if vis else np.float32(NEG_INF)
            for i in range(RUN_N):
                mx[i] = np.float32(NEG_INF)
            for j in range(NS):
                for e in range(4):
                    for mt in range(MT):
                        r = 2 * mt + (e >> 1)
                        mx[r] = max(mx[r], s[mt * SF + j * 4 + e])
            for r in range(RUN_N):
                # The 4 lanes of a quad hold one row: reduce across them.
                x = mx[r]
                x = max(x, shfl_xor(x, 1))
                x = max(x, shfl_xor(x, 2))
                m_new = max(m_run[r], x)
                # A row that has seen no key yet keeps m = -inf; subtract 0 then so exp2 gives 0.
                mu[r] = m_new if m_new != NEG_INF else np.float32(0.0)
                alpha[r] = exp2(m_run[r] - mu[r])
                m_run[r] = m_new
                mx[r] = np.float32(0.0)      # from here on: this tile's row sums
            # P = exp2(S - m), packed at once to 16-bit pairs (the A operand of P V): half the
            # registers of the fp32 scores stay live across the barrier below.
            for j in range(NS):
                for e in range(0, 4, 2):
                    for mt in range(MT):
                        r = 2 * mt + (e >> 1)
                        p0 = exp2(s[mt * SF + j * 4 + e] - mu[r])
                        p1 = exp2(s[mt * SF + j * 4 + e + 1] - mu[r])
                        mx[r] += p0 + p1
                        pk[(mt * SF + j * 4 + e) >> 1] = pack16(BF16, p0, p1)
            for r in range(RUN_N):
                # per-lane partial sums; the quad is summed once at the end
                l_run[r] = l_run[r] * alpha[r] + mx[r]
            for dn in range(ND):
                for e in range(4):
                    for mt in range(MT):
                        acc[mt * OF + dn * 4 + e] *= alpha[2 * mt + (e >> 1)]

            cp_async_wait_all()
            if WG:
                fence_proxy_async()
            cuda.syncthreads()  # V tile landed; every warp is done with K
            if nxt <= last:
                for ps in range(KV_PASSES):
                    key = nxt * BN + cp_row + ps * RPP
                    ok = key < seqlen_k
                    src = k_off + key if ok else 0
                    for sg in range(NSEG):
                        c = (sg * TPL + cp_part) * 4
                        if WG:
                            cp_async16_to(sbase + K_OFF + cp_dst + ps * RPP * 128 + sg * BLK_K,
                                          k, ab, src, hk, c, 16 if ok else 0)
                        else:
                            cp_async16(ks, cp_row + ps * RPP, c ^ cp_swz, k, ab, src, hk, c,
                                       16 if ok else 0)
                if IV_SMEM:
                    for u in range(IV_PER_THREAD):
                        idx = tid + u * THREADS
                        key = nxt * BN + idx % BN
                        cp_async4_to(sbase + IV_OFF + idx * 4, mk_iv, idx // BN,
                                     key if key < seqlen_k else 0, 4 if key < seqlen_k else 0)
                cp_async_commit()

            # O += P V: the S accumulator layout is the A-fragment layout, packed to 16 bits;
            # each V fragment feeds the m-tiles (a*: m-tile 0, e*: m-tile 1).
            if WG:
                # k-step kb: keys 16 kb .. 16 kb + 15, i.e. 16 rows of 128 bytes further.
                wgmma_fence()
                for kb in range(NP):
                    j = kb * 4
                    wgmma_rs(BF16, D, acc, pk[j], pk[j + 1], pk[j + 2], pk[j + 3],
                             dv + np.uint64(kb * 16 * 128 >> 4))
                wgmma_commit()
                wgmma_wait(D, acc)
            for kb in range(0 if WG else NP):
                j = kb * 4
                a0 = pk[j]
                a1 = pk[j + 1]
                a2 = pk[j + 2]
                a3 = pk[j + 3]
                if MT > 1:
                    j += SF // 2
                    e0 = pk[j]
                    e1 = pk[j + 1]
                    e2 = pk[j + 2]
                    e3 = pk[j + 3]
                for dd in range(ND // 2):
                    b0, b1, b2, b3 = ldmatrix_x4_trans(vs, kb * 16 + v_row, (dd * 8 + v_col) ^ swz)
                    o = 8 * dd
                    c0, c1, c2, c3 = mma16(BF16, a0, a1, a2, a3, b0, b1, acc[o], acc[o + 1],
                                           acc[o + 2], acc[o + 3])
                    acc[o] = c0
                    acc[o + 1] = c1
                    acc[o + 2] = c2
                    acc[o + 3] = c3
                    c0, c1, c2, c3 = mma16(BF16, a0, a1, a2, a3, b2, b3, acc[o + 4], acc[o + 5],
                                           acc[o + 6], acc[o + 7])
                    acc[o + 4] = c0
                    acc[o + 5] = c1
                    acc[o + 6] = c2
                    acc[o + 7] = c3
                    if MT > 1:
                        o += OF
                        c0, c1, c2, c3 = mma16(BF16, e0, e1, e2, e3, b0, b1, acc[o], acc[o + 1],
                                               acc[o + 2], acc[o + 3])
                        acc[o] = c0
                        acc[o + 1] = c1
                        acc[o + 2] = c2
                        acc[o + 3] = c3
                        c0, c1, c2, c3 = mma16(BF16, e0, e1, e2, e3, b2, b3, acc[o + 4],
                                               acc[o + 5], acc[o + 6], acc[o + 7])
                        acc[o + 4] = c0
                        acc[o + 5] = c1
                        acc[o + 6] = c2
                        acc[o + 7] = c3
            tile = nxt

        for mt in range(MT):
            for half in range(2):
                row = wrow + mt * 16 + g + 8 * half
                l = l_run[2 * mt + half]
                l += shfl_xor(l, 1)
                l += shfl_xor(l, 2)
                inv = np.float32(0.0)
                if l != 0:
                    inv = np.float32(1.0) / l
                if row < seqlen_q:
                    for dn in range(ND):
                        o = mt * OF + dn * 4 + 2 * half
                        out[ab, q_off + row, h, dn * 4 + t] = pack16(BF16, acc[o] * inv,
                                                                     acc[o + 1] * inv)
                    if write_lse and t == 0:
                        lse[ab, h, q_off + row] = ((m_run[2 * mt + half] + math.log2(l)) * LN2
                                                   if l != 0 else NEG_INF)

    return jit_kernel(kernel, ("mma", D, BF16, has_left, has_right, has_sinks, has_softcap, write_lse,
                         BN, KIND, VARLEN, ALIBI, MT, WG, SCORE_MOD),
                cache=mask_mod is None and score_mod is None)
