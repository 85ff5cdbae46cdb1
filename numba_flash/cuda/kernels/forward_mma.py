"""Tiled FlashAttention-2 forward on tensor cores (float16 / bfloat16, fp32 accumulation).

A block of 4 warps owns a 64-row (two m-tiles: 128-row) query tile, each warp 16 rows per
m-tile; K and V tiles of ``block_n`` keys stream through shared memory (cp.async, 16 bytes per
copy; B fragments through ldmatrix, transposed for V); scores, running max/sum and the output
accumulator stay in registers and the score fragment becomes the A operand of P @ V without
leaving them. On compute capability 9.0 at head_dim 64 / 96 / 128 / 256 the same walk runs on
wgmma (two warpgroups, 128-row query tiles, 128-key tiles (64 at head_dim 256) in
128-byte-swizzled dynamic shared memory). Inputs are ``uint32`` views (two 16-bit values per
word along head_dim).

Shapes (kernel arguments): q (B, Sq, Hq, D/2), k and v (B, Sk, Hkv, D/2), out (B, Sq, Hq, D/2),
lse float32 (B, Hq, Sq); any strides. Grid: (number of query tiles, B * Hq).
"""
from __future__ import annotations

import numpy as np
from numba import cuda
from numba.cuda import types

from ..primitives import SIMULATOR, cp_async_commit, cp_async_wait_all, fence_proxy_async
from .forward_geometry import (MMA_THREADS, WG_HEAD_DIMS, WG_THREADS, mma_q_in_smem,
                               mma_swizzled, wgmma_row_bytes)
from .forward_mma_tiles import (copy_coords, copy_k_stage, copy_rows, exp_and_pack, init_rows,
                                ldmatrix_lane, load_q_fragments, mask_tile, pv_mma, pv_wgmma,
                                qk_mma, qk_wgmma, rescale_acc, score_logits, store_output,
                                update_row_max, wgmma_tiles)
from .jitcache import jit_kernel
from .masking import (INTERVALS, LOG2E, NONE, flags_see_whole_tile, key_tiles,
                      mask_mod_device, score_mod_device, walk_next, walk_start)
from .schedule import group_keys, query_tile_of_block
from .sequences import clear_unowned_rows, packed_sequence

__all__ = ["make_mma_kernel"]


def _fragment_counts(head_dim: int, block_n: int):
    """``(KS, NS, NP, ND, SF, OF)`` of the mma.sync m16n8k16 tiling: 16-column k-steps of
    S = Q K^T, 8-key n-tiles of S, 16-key k-steps of O += P V, 8-column n-tiles of O, and the
    float32 accumulator registers per m-tile of S and of O."""
    ks, ns, n_p, nd = head_dim // 16, block_n // 8, block_n // 16, head_dim // 8
    return ks, ns, n_p, nd, ns * 4, nd * 4


def _copy_plan(head_dim: int, threads: int, block_m: int, block_n: int):
    """``(TPL, RPP, NSEG, KV_PASSES, Q_PASSES)`` of the block's cp.async tile copies.

    TPL consecutive threads cover a 16 * TPL-byte segment of a row (a whole 128-byte line when
    TPL = 8; NSEG segments per row), RPP rows per pass (KV_PASSES per K / V tile, Q_PASSES per
    Q tile); thread ``part`` copies chunk part of each segment of its rows cp_row + RPP * pass.
    Per pass one global row pointer (the segments are immediate offsets from it) and one bounds
    predicate; its shared-memory addresses are one register plus immediates (RPP is a multiple
    of 8, so the swizzle is the same in every pass); 8 consecutive lanes write 8 distinct bank
    groups; a warp instruction touches 4 whole lines of global memory (one chunk per row and
    lane touched 16 lines and ran slower)."""
    cpr = head_dim // 8         # 16-byte chunks per row
    tpl = 8 if cpr % 8 == 0 else 4
    rpp = threads // tpl
    assert block_n % rpp == 0 and block_m % rpp == 0, (block_n, block_m, rpp)
    return tpl, rpp, cpr // tpl, block_n // rpp, block_m // rpp


def _smem_layout(head_dim: int, block_m: int, block_n: int, q_smem: bool, wg: bool):
    """``(KW, SWZ_MASK, QS_ROWS, QS_COLS, KS_ROWS, KS_COLS, BLK_Q, BLK_K, Q_OFF, K_OFF, V_OFF,
    IV_OFF)``: the shared-memory tiles.

    Static tiles (mma.sync path; (1, 4) placeholders where unused): Q (QS_ROWS x QS_COLS
    words) and K / V (KS_ROWS x KS_COLS), row stride KW words. Bank conflicts of ldmatrix (8
    rows, same logical column) are avoided either by 16 bytes of padding per row, or by
    storing 16-byte chunk c of row r at chunk c ^ (r & 7): with word columns that are
    multiples of 4, that is col ^ ((r & 7) << 2), i.e. XOR SWZ_MASK & ((r & 7) << 2).
    wgmma path: byte offsets in dynamic shared memory of the Q, K and V tiles, each made of
    64-column blocks of rows x 128 bytes (primitives/wgmma.py; BLK_Q / BLK_K bytes per block;
    at head_dim 96 the second block half used), and of the key tile's 4 interval-bound vectors
    (IV_OFF)."""
    swz = mma_swizzled(head_dim)
    kw = head_dim // 2 if swz else head_dim // 2 + 4
    qs_rows, qs_cols = (block_m, kw) if q_smem and not wg else (1, 4)
    ks_rows, ks_cols = (1, 4) if wg else (block_n, kw)
    row_bytes = wgmma_row_bytes(head_dim) if wg else head_dim * 2
    return (kw, 28 if swz else 0, qs_rows, qs_cols, ks_rows, ks_cols, block_m * 128,
            block_n * 128, 0, block_m * row_bytes, (block_m + block_n) * row_bytes,
            (block_m + 2 * block_n) * row_bytes)


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
    ``has_alibi``: alibi float32 (B, Hq) slopes, ``-slope * |i - j|`` added after the softcap.
    With softcap the base-2 score is ``cap_out * tanh(cap_in * q.k)``, else ``scale_log2 * q.k``.
    ``score_mod``: the user's ``fn(score, b, h, q_idx, kv_idx)``, compiled in and applied after
    the softcap and ALiBi to the natural-log score (the kernel's base-2 score times ln 2; the
    result times log2 e), with q_idx and kv_idx clamped into the sequence (rows and keys past
    it are never used).

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
    NEG_INF = np.float32(-np.inf)       # the lse of packed rows no block computes
    POS_INF = np.float32(np.inf)
    # The grid's order (schedule.py). Not at head_dim 64 on wgmma: that kernel sits at 127
    # registers (4 blocks per multiprocessor) and the grouped order's index arithmetic took it
    # to 135 (3 blocks): causal 1.36x slower on the H200 (2026-11-27).
    GROUP_KEYS = group_keys(4 * D, has_right, varlen, enabled=not (wgmma and D == 64))
    if WG:
        assert MT == 1 and D in WG_HEAD_DIMS and block_n in (64, 128), (MT, D, block_n)
    BM, BN = 16 * (THREADS // 32) * MT, block_n
    WROWS = 16 * MT      # rows per warp
    KS, NS, NP, ND, SF, OF = _fragment_counts(D, BN)
    S_N, ACC_N, RUN_N, PK_N = SF * MT, OF * MT, 2 * MT, SF * MT // 2   # local-array sizes
    Q_SMEM = mma_q_in_smem(D) or MT > 1 or WG
    QF = 4 if Q_SMEM else KS * 4          # Q fragment registers (unused when Q is in smem)
    TPL, RPP, NSEG, KV_PASSES, Q_PASSES = _copy_plan(D, THREADS, BM, BN)
    (KW, SWZ_MASK, QS_ROWS, QS_COLS, KS_ROWS, KS_COLS, BLK_Q, BLK_K, Q_OFF, K_OFF, V_OFF,
     IV_OFF) = _smem_layout(D, BM, BN, Q_SMEM, WG)
    # Interval masks on the wgmma path: the key tile's 4 bound vectors (4 x BN int32) travel
    # with the K tile (4-byte cp.async) and the mask pass reads them from shared memory. From
    # global memory, ptxas interleaved each column's loads with their uses (255 registers),
    # so a partial tile waited for ~64 L2 round trips in a row.
    IV_SMEM = WG and int(mask_kind) == INTERVALS
    IV_PER_THREAD = 4 * BN // THREADS
    # Closure cells must be plain constants: the on-disk cache keys on their pickled bytes, and
    # an intrinsic object pickles differently in every process.
    BF16 = bool(is_bf16)
    KIND = int(mask_kind)
    VARLEN = bool(varlen)
    ALIBI = bool(has_alibi)
    mod = mask_mod_device(mask_mod)
    SCORE_MOD = score_mod is not None
    smod = score_mod_device(score_mod)
    # Raw scores (wgmma path): without a softcap, ALiBi or score_mod the logit is scale_log2 *
    # q.k, so the scores stay unscaled until the exponent, where scale and max subtraction are
    # one FFMA. Not on mma.sync: its two-m-tile kernels sit at the register cap, and the
    # max / min branch pair made the head_dim 64 window kernel spill.
    RAW = WG and not (has_softcap or ALIBI or SCORE_MOD)

    def kernel(q, k, v, out, lse, seqlen_q, seqlen_k, heads_ratio, scale_log2, cap_in, cap_out,
               window_left, window_right, sinks, mk_iv, mk_mm, mk_tab, mk_bits, cu_q, cu_k, alibi):
        n_qtiles = cuda.gridDim.x
        qtile, x, row = query_tile_of_block(seqlen_k, heads_ratio, GROUP_KEYS)
        heads_q = q.shape[2]
        b = row // heads_q
        h = row % heads_q
        hk = h // heads_ratio
        ab = b          # batch index into the arrays (0 for a packed batch)
        q_off = 0       # first row of this sequence in q / out / lse, first key in k / v
        k_off = 0
        if VARLEN:
            ab = 0
            clear_unowned_rows(out, lse, cu_q, b, h, x, n_qtiles, BM, D // 2,
                               seqlen_q, cuda.threadIdx.x, THREADS, NEG_INF, write_lse)
            q_off, seqlen_q = packed_sequence(cu_q, b, q.shape[1], seqlen_q)
            k_off, seqlen_k = packed_sequence(cu_k, b, k.shape[1], seqlen_k)
            if qtile * BM >= seqlen_q:
                return
        tb = min(row, mk_tab.shape[0] - 1)
        slope = np.float32(0.0)
        if ALIBI:
            slope = alibi[b, h] * np.float32(LOG2E)
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        g = lane >> 2
        t = lane & 3
        v_row, v_col, swz = ldmatrix_lane(lane, SWZ_MASK)
        cp_row, cp_part, cp_swz = copy_coords(tid, TPL, SWZ_MASK)

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
            sbase, cp_dst, dq, dk, dv = wgmma_tiles(dyn, warp, cp_row, cp_part, Q_OFF, K_OFF,
                                                    V_OFF, BLK_K, False)
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
        words = cuda.local.array(RUN_N, types.uint32)     # bitmask words of the rows

        offset = seqlen_k - seqlen_q
        # What the mask writes for a hidden pair: -inf, or +inf for raw scores under a
        # negative scale (the scale makes it -inf).
        hidden = POS_INF if RAW and scale_log2 < 0 else NEG_INF
        wrow = qtile * BM + warp * WROWS     # first row of this warp
        row0 = wrow + g                      # rows of m-tile 0 (the register-Q path has MT = 1)
        row1 = row0 + 8

        load_q_fragments(qf, q, ab, q_off, h, row0, row1, t, seqlen_q, 0 if Q_SMEM else KS)
        init_rows(acc, m_run, l_run, MT, OF)

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
        tile, base, vbits, fbits = walk_start(KIND, mk_mm, mk_tab, tb, qtile, first, last, lane,
                                              tile_lo, tile_hi, sink_tiles, r_lo, r_hi,
                                              has_sinks)
        if tile <= last:
            if Q_SMEM:  # the Q tile joins the first K tile's copy group (rows past Sq: zeros)
                copy_rows(qs, sbase + Q_OFF + cp_dst, q, ab, q_off, qtile * BM, seqlen_q, h, cp_row,
                          cp_part, cp_swz, Q_PASSES, NSEG, TPL, RPP, BLK_Q, WG)
            copy_k_stage(ks, sbase + K_OFF + cp_dst, k, ab, k_off, tile * BN, seqlen_k, hk, cp_row,
                         cp_part, cp_swz, KV_PASSES, NSEG, TPL, RPP, BLK_K, WG, sbase + IV_OFF,
                         mk_iv, tid, THREADS, IV_PER_THREAD, BN, IV_SMEM)

        while tile <= last:
            nxt, mask_full, base, vbits, fbits = walk_next(KIND, tile, base, vbits, fbits, mk_mm,
                                                           mk_tab, tb, qtile, last, lane, tile_lo,
                                                           tile_hi, sink_tiles, r_lo, r_hi,
                                                           has_sinks)
            # Is every (row, key) pair of this tile visible? Then no per-element mask.
            in_window = tile >= tile_lo and tile <= tile_hi
            k0 = tile * BN
            full = flags_see_whole_tile(k0, in_window, q_lo, q_hi, seqlen_k, window_left,
                                        window_right, sinks, BN, has_left, has_right, has_sinks)
            full = full and mask_full

            cp_async_wait_all()
            if WG:
                fence_proxy_async()   # the copies' bytes visible to wgmma (the async proxy)
            cuda.syncthreads()  # K tile landed for every thread; every warp is done with V
            copy_rows(vs, sbase + V_OFF + cp_dst, v, ab, k_off, k0, seqlen_k, hk, cp_row, cp_part,
                      cp_swz, KV_PASSES, NSEG, TPL, RPP, BLK_K, WG)
            cp_async_commit()

            # S = Q K^T: NS independent 16x8 accumulators per m-tile.
            if WG:
                qk_wgmma(s, dq, dk, KS, BN, BLK_Q, BLK_K, BF16)
            else:
                qk_mma(s, qs, qf, ks, warp, v_row, v_col, swz, KS, NS, SF, S_N, WROWS, MT,
                       Q_SMEM, BF16)

            # Scores to base-2 logits; per-element mask in its own pass behind one block-uniform
            # branch, so that tiles without masked pairs run straight-line code; online softmax.
            if not RAW:
                score_logits(s, k0, wrow, g, t, offset, seqlen_q, seqlen_k, b, h, scale_log2,
                             cap_in, cap_out, slope, smod, NS, SF, MT, has_softcap, ALIBI,
                             SCORE_MOD)
            if not full:
                mask_tile(s, words, k0, wrow, g, t, offset, seqlen_q, seqlen_k, b, h, window_left,
                          window_right, sinks, mk_iv, mk_bits, sbase + IV_OFF, mod, NS, SF, RUN_N,
                          BN, KIND, IV_SMEM, has_left, has_right, has_sinks, hidden)
            update_row_max(s, m_run, mx, mu, alpha, NS, SF, MT, RUN_N, RAW, scale_log2)
            exp_and_pack(s, pk, mx, mu, alpha, l_run, NS, SF, MT, RUN_N, BF16, RAW, scale_log2)
            rescale_acc(acc, alpha, ND, OF, MT)

            cp_async_wait_all()
            if WG:
                fence_proxy_async()
            cuda.syncthreads()  # V tile landed; every warp is done with K
            if nxt <= last:
                copy_k_stage(ks, sbase + K_OFF + cp_dst, k, ab, k_off, nxt * BN, seqlen_k, hk,
                             cp_row, cp_part, cp_swz, KV_PASSES, NSEG, TPL, RPP, BLK_K, WG,
                             sbase + IV_OFF, mk_iv, tid, THREADS, IV_PER_THREAD, BN, IV_SMEM)

            # O += P V: P (the S accumulator layout, packed to 16 bits) is the A operand.
            if WG:
                pv_wgmma(acc, pk, dv, NP, D, BF16)
            else:
                pv_mma(acc, pk, vs, v_row, v_col, swz, NP, ND, SF, OF, MT, BF16)
            tile = nxt

        store_output(out, lse, acc, l_run, m_run, ab, q_off, h, wrow, g, t, seqlen_q, MT, OF, ND,
                     BF16, write_lse)

    return jit_kernel(kernel, ("mma", D, BF16, has_left, has_right, has_sinks, has_softcap,
                               write_lse, BN, KIND, VARLEN, ALIBI, MT, WG, SCORE_MOD),
                      cache=mask_mod is None and score_mod is None)
