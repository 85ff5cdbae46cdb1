"""The Hopper (sm_90) dK / dV kernel of the 16-bit backward: warpgroup products (wgmma).

Same algorithm, arguments and outputs as ``backward.make_mma_dkdv_kernel`` (column-parallel,
FlashMask tile classes, atomic dQ unless deterministic), with every product on
``wgmma.mma_async`` and its operands read by the tensor cores straight from shared memory:
the mma.sync kernel's ldmatrix traffic (each warp re-reading its K / V rows and the shared
Q / dO slices for every 16-row slice) was the limit there (Nsight Compute, H200, head_dim 128:
L1 73 % busy with shared-memory wavefronts, tensor pipe 29 %).

Block: two warpgroups (8 warps) own 128 keys, 64 each (warp w: keys 16 w .. 16 w + 15, the
wgmma accumulator rows, as in the mma.sync kernel); 64-row query tiles stream through two
shared buffers by cp.async. Per query tile, per warpgroup (``Q``, ``dO`` the tile's rows)::

    S^T  = K_w Q^T          wgmma m64n64, A = K_w, B = Q    (both K-major, shared)
    dP^T = V_w dO^T         idem
    P^T, dS^T               registers (backward.probs_grads: mask, softcap, ALiBi)
    dV_w += P^T dO          wgmma m64n{D}, A = P^T (registers), B = dO (MN-major, shared)
    dK_w += dS^T Q          idem
    dQ   += scale dS K      wgmma m64n{D / 2}, A = dS (dS^T in shared memory, MN-major),
                            B = K (MN-major): warpgroup w the columns D / 2 w .. over all
                            the block's keys, added into dQ by atomics (one per element
                            and block) after the next tile's first barrier

head_dim 256 (``wgmma_split``): the block owns 64 keys; both warpgroups compute S^T and dP^T of
all of them, each accumulates dK / dV for 128 of the columns and adds dQ's 128 columns of the
same half.

Shared memory (128-byte swizzle, 64-column blocks; primitives/wgmma.py): the stats of two
tiles (base-2 lse, delta), then from a 1024-byte aligned base K and V (the block's keys), two Q
and two dO buffers (64 rows), dS^T (keys x 64 rows). head_dim 128: 149.5 KB, one block per SM;
256: 202 KB.
"""
from __future__ import annotations

import numpy as np
from numba import cuda
from numba.cuda import types

from ..primitives import (cp_async_commit, cp_async_wait_all, fence_proxy_async,
                          shared_addr, shared_view, sts32, sw128_desc, wgmma_commit, wgmma_fence,
                          wgmma_hold, wgmma_rs, wgmma_ss, wgmma_ss_mn, wgmma_wait)
from .backward import (LOG2E, block_table_and_slope, key_block, next_query_tile,
                       prefetch_stats, probs_grads, query_rows, stage_key_block, stage_words,
                       store_dkdv, store_fragments, zero)
from .forward_mma_tiles import copy_rows
from .jitcache import jit_kernel
from .masking import INTERVALS, NONE, mask_mod_device
from ..primitives.base import inlined

__all__ = ["WG_BWD_HEAD_DIMS", "WG_BWD_THREADS", "WG_BWD_BLOCK_M", "wgmma_block_n",
           "wgmma_dkdv_smem_bytes", "make_wgmma_dkdv_kernel"]

WG_BWD_HEAD_DIMS = (64, 128, 256)
WG_BWD_THREADS = 256
WG_BWD_BLOCK_M = 64         # rows per streamed query tile
STAT_ROWS = 2               # query tiles in flight: rows of the shared lse / delta tiles


def wgmma_split(head_dim: int) -> int:
    """Warpgroups sharing each 64 keys: 1 (head_dim 64, 128: a block owns 128 keys), or 2 at
    head_dim 256, where dK and dV of 64 keys by the whole head would fill a warpgroup's
    registers: both compute S^T and dP^T of the block's 64 keys, each accumulates dK / dV (and
    adds dQ) for half of the columns."""
    return 2 if head_dim == 256 else 1


def wgmma_block_n(head_dim: int) -> int:
    """Keys owned per block: 64 per warpgroup, or 64 in all with the column split."""
    return 128 // wgmma_split(head_dim)


def _tile_bytes(head_dim: int) -> tuple:
    """Byte offsets, from the aligned base, of K, V, the two Q and two dO buffers and the dS^T
    tile, and the total."""
    bn = wgmma_block_n(head_dim)
    kv = bn * head_dim * 2
    qd = 2 * WG_BWD_BLOCK_M * head_dim * 2
    k_off, v_off = 0, kv
    q_off, do_off = 2 * kv, 2 * kv + qd
    ds_off = 2 * kv + 2 * qd
    return k_off, v_off, q_off, do_off, ds_off, ds_off + bn * WG_BWD_BLOCK_M * 2


def _head_words(head_dim: int) -> int:
    """32-bit words before the aligned tiles: the stats (2 x rows x 64 floats), then the
    block's staged mask intervals (``backward.stage_key_block``)."""
    return 2 * STAT_ROWS * WG_BWD_BLOCK_M + stage_words(wgmma_block_n(head_dim))


def wgmma_dkdv_smem_bytes(head_dim: int) -> int:
    """Dynamic shared memory of the kernel: the stats and staged mask (``_head_words``), 1024
    bytes of alignment slack, the tiles (head_dim 64: 82 KB; 128: 146 KB; 256: 202 KB)."""
    return 4 * _head_words(head_dim) + 1024 + _tile_bytes(head_dim)[-1]


@inlined
def ksteps_desc(desc, kk, blk):
    """Descriptor of k-step ``kk`` (16 columns) of a K-major tile: column block kk // 4
    (``blk`` bytes each), 32 bytes per step inside it (descriptor addresses count 16 bytes)."""
    return desc + np.uint64((kk // 4) * (blk >> 4) + (kk % 4) * 2)


@inlined
def rows_desc(desc, kb):
    """Descriptor of k-step ``kb`` of an MN-major tile: 16 rows of 128 bytes further."""
    return desc + np.uint64(kb * 128)


@inlined
def prefetch_query_tile(ls, dls, buf, q_addr, do_addr, q, dout, lse2, delta, ab, q_off, b, h, r0,
                        seqlen_q, cp_row, cp_part, tid, passes, nseg, blk):
    """Start the copies of query tile rows r0 .. (sequence-relative; zeros past seqlen_q) of Q
    and dO into the swizzled tiles at shared addresses ``q_addr`` / ``do_addr`` (this thread's
    first destination) and of their stats into row ``buf`` of ``ls`` / ``dls``."""
    copy_rows(ls, q_addr, q, ab, q_off, r0, seqlen_q, h, cp_row, cp_part, 0, passes, nseg, 8,
              WG_BWD_THREADS // 8, blk, True)
    copy_rows(ls, do_addr, dout, ab, q_off, r0, seqlen_q, h, cp_row, cp_part, 0, passes, nseg, 8,
              WG_BWD_THREADS // 8, blk, True)
    prefetch_stats(ls, dls, buf, lse2, delta, b, h, r0, tid)


@inlined
def issue_scores(st, dpt, dk_a, dv_a, dq_b, ddo_b, k_steps, blk_k, blk_q, bf16):
    """Start S^T = K_w Q^T into ``st`` and dP^T = V_w dO^T into ``dpt`` (float32, 32 each: the
    accumulator layout of the warp's 16 keys x 64 rows), committed as one group."""
    wgmma_fence()
    for kk in range(k_steps):
        wgmma_ss(bf16, 64, st, ksteps_desc(dk_a, kk, blk_k), ksteps_desc(dq_b, kk, blk_q),
                 0 if kk == 0 else 1)
    for kk in range(k_steps):
        wgmma_ss(bf16, 64, dpt, ksteps_desc(dv_a, kk, blk_k), ksteps_desc(ddo_b, kk, blk_q),
                 0 if kk == 0 else 1)
    wgmma_commit()


@inlined
def scores_t(st, dpt, dk_a, dv_a, dq_b, ddo_b, k_steps, blk_k, blk_q, bf16):
    """``issue_scores`` and wait for both."""
    issue_scores(st, dpt, dk_a, dv_a, dq_b, ddo_b, k_steps, blk_k, blk_q, bf16)
    wgmma_wait(64, st)
    wgmma_wait(64, dpt)


@inlined
def accumulate_kv(dv, dk, pkp, pkd, ddo_mn, dq_mn, d, bf16):
    """dV_w += P^T dO and dK_w += dS^T Q (A: the packed ``pkp`` / ``pkd``, 16 uint32 each, four
    per 16-row k-step; B: the MN-major dO / Q tiles); committed, not waited for."""
    wgmma_fence()
    for kb in range(4):
        j = 4 * kb
        wgmma_rs(bf16, d, dv, pkp[j], pkp[j + 1], pkp[j + 2], pkp[j + 3], rows_desc(ddo_mn, kb))
    for kb in range(4):
        j = 4 * kb
        wgmma_rs(bf16, d, dk, pkd[j], pkd[j + 1], pkd[j + 2], pkd[j + 3], rows_desc(dq_mn, kb))
    wgmma_commit()


@inlined
def store_ds_t(ds_row, pkd, lane):
    """The warp's packed dS^T (16 keys x 64 rows) into the swizzled shared tile; ``ds_row``:
    the shared address of the warp's first key row. Key row r holds rows 8 j .. 8 j + 7 in
    16-byte chunk j ^ (r & 7)."""
    g = lane >> 2
    t = lane & 3
    base = ds_row + g * 128 + 4 * t
    for j in range(8):
        addr = base + ((j ^ g) << 4)
        sts32(addr, pkd[2 * j])
        sts32(addr + 8 * 128, pkd[2 * j + 1])


@inlined
def issue_dq(dqa, ds_a, k_b, steps, n, bf16):
    """Start ``dqa`` (float32 n / 2: the warp's 16 rows x n columns) = dS K over ``steps``
    16-key k-steps (A = dS from the MN-major dS^T tile, B = K's MN-major column blocks),
    committed as one group."""
    wgmma_fence()
    for kb in range(steps):
        wgmma_ss_mn(bf16, n, dqa, rows_desc(ds_a, kb), rows_desc(k_b, kb), 0 if kb == 0 else 1)
    wgmma_commit()


@inlined
def dq_product(dqa, ds_a, k_b, steps, n, bf16):
    """``issue_dq`` and wait for it."""
    issue_dq(dqa, ds_a, k_b, steps, n, bf16)
    wgmma_wait(n, dqa)


def make_wgmma_dkdv_kernel(head_dim: int, is_bf16: bool, has_left: bool, has_right: bool,
                           has_sinks: bool, has_softcap: bool, atomic_dq: bool,
                           mask_kind: int = NONE, mask_mod=None, has_alibi: bool = False,
                           varlen: bool = False, direct: bool = False):
    """The wgmma dK / dV kernel (module docstring) for head_dim 64, 128 or 256: the signature,
    arguments and outputs of ``backward.make_mma_dkdv_kernel``; grid ``(ceil(Sk /
    wgmma_block_n), B * Hq)``, ``WG_BWD_THREADS`` threads, ``wgmma_dkdv_smem_bytes`` of dynamic
    shared memory."""
    D = int(head_dim)
    assert D in WG_BWD_HEAD_DIMS, D
    SPLIT, BN = wgmma_split(D), wgmma_block_n(D)
    BM, NT = WG_BWD_BLOCK_M, WG_BWD_THREADS
    DH = D // SPLIT                                # dK / dV columns of a warpgroup
    KS, NSEG = D // 16, D // 64
    BLK_K, BLK_Q = BN * 128, BM * 128              # bytes per 64-column block of a tile
    K_OFF, V_OFF, Q_OFF, DO_OFF, DS_OFF, _ = _tile_bytes(D)
    HEAD_WORDS = _head_words(D)
    BUF = BM * D * 2                               # bytes of one Q (dO) buffer
    RPP = NT // 8                                  # rows per copy pass (8 threads per segment)
    KV_PASSES, Q_PASSES = BN // RPP, BM // RPP
    # dQ per warpgroup: all the block's keys x its D / 2 columns (head_dim 64: 32 columns that
    # start inside a 64-column block; 128: 64; 256: 128), so each dQ element gets one atomic
    # per block
    DQ_STEPS = BN // 16
    DQ_N = D // 2
    ACC_N, DQA_N = DH // 2, DQ_N // 2
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
        wg = warp >> 2                      # the warpgroup
        kw0 = 64 * wg if SPLIT == 1 else 0  # its 64 keys in the block's tile
        own0 = 16 * warp if SPLIT == 1 else 16 * (warp & 3)   # the warp's 16 keys
        col0 = wg * DH if SPLIT == 2 else 0  # the warpgroup's first dK / dV column
        k0 = ktile * BN
        if VARLEN and k0 >= seqlen_k:
            return
        tb, slope = block_table_and_slope(ALIBI, alibi, mk_tab, b, h, q.shape[2], np.float32)
        slope_log2 = slope * np.float32(LOG2E)
        where = (seqlen_q, seqlen_k, wl, wr, sinks, b, h)
        dynf = cuda.shared.array(0, f32)
        ls = shared_view(dynf, 0, STAT_ROWS, BM)
        dls = shared_view(dynf, STAT_ROWS * BM, STAT_ROWS, BM)
        mm, iv, mtile = stage_key_block(KIND, mk_iv, mk_mm, ktile, k0, seqlen_k,
                                        cuda.shared.array(0, types.int32), 2 * STAT_ROWS * BM,
                                        BN, tid, NT)
        sbase = (np.int64(shared_addr(dynf)) + 4 * HEAD_WORDS + 1023) & ~1023
        cp_row = tid >> 3
        cp_part = tid & 7
        cp_dst = cp_row * 128 + ((cp_part ^ (cp_row & 7)) << 4)
        dk_a = sw128_desc(sbase + K_OFF + kw0 * 128, 16, 1024)        # K_w, K-major
        dv_a = sw128_desc(sbase + V_OFF + kw0 * 128, 16, 1024)
        dq_b = sw128_desc(sbase + Q_OFF, 16, 1024)                    # Q, K-major
        ddo_b = sw128_desc(sbase + DO_OFF, 16, 1024)
        cblk = (col0 // 64) * BLK_Q                                   # its dO / Q columns
        dq_mn = sw128_desc(sbase + Q_OFF + cblk, BLK_Q, 1024)         # Q, MN-major
        ddo_mn = sw128_desc(sbase + DO_OFF + cblk, BLK_Q, 1024)
        dq_col0 = DQ_N * wg              # the warpgroup's dQ columns, over all the keys
        ds_a = sw128_desc(sbase + DS_OFF, BLK_K, 1024)
        k_b = sw128_desc(sbase + K_OFF + (dq_col0 // 64) * BLK_K + (dq_col0 % 64) * 2, BLK_K,
                         1024)
        st = cuda.local.array(32, f32)
        dpt = cuda.local.array(32, f32)
        pkp = cuda.local.array(16, u32)
        pkd = cuda.local.array(16, u32)
        dk = cuda.local.array(ACC_N, f32)
        dv = cuda.local.array(ACC_N, f32)
        dqa = cuda.local.array(DQA_N, f32)
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
        copy_rows(ls, sbase + K_OFF + cp_dst, k, ab, k_off, k0, seqlen_k, hk, cp_row, cp_part, 0,
                  KV_PASSES, NSEG, 8, RPP, BLK_K, True)
        copy_rows(ls, sbase + V_OFF + cp_dst, v, ab, k_off, k0, seqlen_k, hk, cp_row, cp_part, 0,
                  KV_PASSES, NSEG, 8, RPP, BLK_K, True)
        if t < end:
            prefetch_query_tile(ls, dls, 0, sbase + Q_OFF + cp_dst, sbase + DO_OFF + cp_dst, q,
                                dout, lse2, delta, ab, q_off, b, h, t * BM, seqlen_q, cp_row,
                                cp_part, tid, Q_PASSES, NSEG, BLK_Q)
        cp_async_commit()
        cur = 0
        dq_row = -1                 # first row of the dQ tile awaiting its reductions
        while t < end:
            nxt, nxt_full = next_query_tile(t + 1, end, KIND, mm, mk_tab, tb, mtile, BM, k0,
                                            BN, seqlen_q, seqlen_k, has_left, has_right,
                                            has_sinks, wl, wr, sinks)
            cp_async_wait_all()
            fence_proxy_async()     # the copies' bytes visible to wgmma (the async proxy)
            cuda.syncthreads()      # tile t has landed; every warp is done with buffer 1 - cur
            if nxt < end:
                nb = (1 - cur) * BUF + cp_dst
                prefetch_query_tile(ls, dls, 1 - cur, sbase + Q_OFF + nb, sbase + DO_OFF + nb,
                                    q, dout, lse2, delta, ab, q_off, b, h, nxt * BM, seqlen_q,
                                    cp_row, cp_part, tid, Q_PASSES, NSEG, BLK_Q)
            cp_async_commit()
            if ATOMIC and dq_row >= 0:      # the previous tile's dQ (see below)
                store_fragments(dq_acc, ab, dq_row, h, dqa, scale, q_off + seqlen_q, dq_col0,
                                DQ_N // 8, lane, True)
            r0 = t * BM
            cb = np.uint64((cur * BUF) >> 4)
            scores_t(st, dpt, dk_a, dv_a, dq_b + cb, ddo_b + cb, KS, BLK_K, BLK_Q, BF16)
            probs_grads(st, dpt, pkp, pkd, 8, lane, True, own0, r0, k0, ls[cur], dls[cur], 0,
                        scale_log2, cap_in, cap_log2, has_softcap, BF16, full, where,
                        has_left, has_right, has_sinks, KIND, iv, mk_bits, mod, ALIBI,
                        slope_log2)
            if ATOMIC and (SPLIT == 1 or wg == 0):      # one copy of each key's dS^T
                store_ds_t(sbase + DS_OFF + own0 * 128, pkd, lane)
            accumulate_kv(dv, dk, pkp, pkd, ddo_mn + cb, dq_mn + cb, DH, BF16)
            if SPLIT == 2:  # free the packed P^T / dS^T registers before dQ's accumulators
                wgmma_wait(DH, dv)
                wgmma_wait(DH, dk)
                wgmma_hold(pkp)
                wgmma_hold(pkd)
            if ATOMIC:
                fence_proxy_async()     # dS^T (generic stores) visible to wgmma
                cuda.syncthreads()      # the whole tile's dS^T is in place
                dq_product(dqa, ds_a, k_b, DQ_STEPS, DQ_N, BF16)
                # added into dQ after the next tile's first barrier, not here: the proxy fence
                # before that barrier (MEMBAR.ALL.CTA in the SASS) waits for the thread's
                # outstanding reductions (docs/backward.md, status of 2026-11-29)
                dq_row = q_off + r0 + 16 * (warp & 3)
            wgmma_wait(DH, dv)
            wgmma_wait(DH, dk)
            if SPLIT != 2:
                wgmma_hold(pkp)
                wgmma_hold(pkd)
            cur = 1 - cur
            t, full = nxt, nxt_full
        cp_async_wait_all()         # nothing may be in flight when the block exits
        if ATOMIC and dq_row >= 0:
            store_fragments(dq_acc, ab, dq_row, h, dqa, scale, q_off + seqlen_q, dq_col0,
                            DQ_N // 8, lane, True)
        store_dkdv(dk_acc, dv_acc, ab, k0 + own0, h, dk, dv, scale, k_off, seqlen_k, col0,
                   DH // 8, lane, BF16, DIRECT)

    return jit_kernel(kernel, ("bwd_wgmma_dkdv", D, BF16, has_left, has_right, has_sinks,
                               has_softcap, ATOMIC, KIND, ALIBI, VARLEN)
                      + (("direct",) if DIRECT else ()),
                      cache=mask_mod is None)
