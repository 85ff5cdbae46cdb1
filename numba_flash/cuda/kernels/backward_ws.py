"""The warp-specialised dK / dV kernel of the 16-bit backward on Hopper (sm_90): a producer
warpgroup streams the query tiles through a ring of shared-memory stages and two consumer
warpgroups compute, each on its own 64 keys, never waiting for the other at a block barrier.

Why: the wgmma kernel of backward_wgmma.py runs one 256-thread block per multiprocessor whose
two warpgroups meet at two block barriers per query tile (the tile's copies, then the whole
tile's dS^T for the dQ product), so the tensor cores idle while both compute probabilities
(Nsight Compute: 60 % of cycles without an eligible warp). Here, as FlashAttention-3's backward
and this package's warp-specialised forward (forward_ws.py):

* warps 0-3, the producer (40 registers after ``setmaxnreg``): K and V of the block's 128 keys
  once, then per visited query tile (the walk of backward.next_query_tile) its Q and dO rows
  and their base-2 lse / delta into stage ``i % STAGES``, announced on the stage's ``full``
  mbarrier once landed; it waits for the stage's ``empty`` mbarrier before refilling it.
* warps 4-11, two consumer warpgroups (232 registers): warpgroup c owns keys 64 c .. 64 c + 63
  and runs backward_wgmma.py's products on them (S^T, dP^T; probabilities and dS^T by
  backward.probs_grads; dV += P^T dO, dK += dS^T Q), then its own part of dQ: dQ += scale dS_c
  K_c over its 64 keys, 64 columns per product, added by atomics. So each dQ element gets two
  atomic adds per block (one per warpgroup) where the wgmma kernel's gets one, and no
  warpgroup reads the other's dS^T. The two take turns issuing their products (named barriers
  1 and 2, as the forward's ping-pong), so one's probabilities run under the other's products.

Same arguments, grid and outputs as ``backward_wgmma.make_wgmma_dkdv_kernel`` with atomic dQ
(the deterministic mode keeps that kernel): head_dim 64 and 128.
"""
from __future__ import annotations

import numpy as np
from numba import cuda
from numba.cuda import types

from ..primitives import (cp_async_commit, cp_async_wait_1, cp_async_wait_all, fence_mbar_init,
                          fence_proxy_async, mbar_arrive, mbar_init, mbar_try_wait,
                          named_arrive, named_sync, regs_dec_40, regs_inc_232, shared_addr,
                          shared_view, sw128_desc, wgmma_hold, wgmma_wait)
from ..primitives.base import inlined
from .backward import (LOG2E, block_table_and_slope, key_block, next_query_tile,
                       prefetch_stats, probs_grads, query_rows, stage_key_block, stage_words,
                       store_dkdv, store_fragments, tile_kind, zero)
from .backward_wgmma import (accumulate_kv, dq_product, issue_dq, issue_scores, store_ds_t)
from .forward_mma_tiles import copy_rows
from .jitcache import jit_kernel
from .masking import INTERVALS, mask_mod_device

__all__ = ["WS_BWD_HEAD_DIMS", "WS_BWD_THREADS", "WS_BWD_BLOCK_N", "ws_dkdv_smem_bytes",
           "make_ws_dkdv_kernel"]

WS_BWD_HEAD_DIMS = (64, 128)
WS_BWD_THREADS = 384
WS_BWD_BLOCK_N = 128        # keys per block: 64 per consumer warpgroup
BLOCK_M = 64                # rows per streamed query tile
STAGES = 3                  # query tiles in the ring: two in flight while one is computed
DQ_COLS = 64                # dQ columns per product (32 accumulator floats per thread)


def _tile_bytes(head_dim: int) -> tuple:
    """Byte offsets from the aligned base of K, V, the ring (stage s: Q then dO at
    ``RING + s * stage``), dS^T (128 keys x 64 rows), the mbarriers, and the total."""
    kv = WS_BWD_BLOCK_N * head_dim * 2
    tile = BLOCK_M * head_dim * 2
    ring = 2 * kv
    ds = ring + STAGES * 2 * tile
    mbar = ds + WS_BWD_BLOCK_N * BLOCK_M * 2
    return 0, kv, ring, 2 * tile, ds, mbar, mbar + 16 * STAGES


def _head_words() -> int:
    """32-bit words before the aligned tiles: each stage's base-2 lse and delta rows, then the
    block's staged mask intervals."""
    return 2 * STAGES * BLOCK_M + stage_words(WS_BWD_BLOCK_N)


def ws_dkdv_smem_bytes(head_dim: int) -> int:
    """Dynamic shared memory of the kernel: head_dim 64 114 KB, 128 181 KB."""
    return 4 * _head_words() + 1024 + _tile_bytes(head_dim)[-1]


@inlined
def _wait(addr, parity):
    """Spin until the phase of parity ``parity`` of the mbarrier at ``addr`` has completed."""
    while not mbar_try_wait(addr, parity):
        pass


@inlined
def copy_query_tile(ls, dls, stage, q_addr, do_addr, q, dout, lse2, delta, ab, q_off, b, h,
                    r0, seqlen_q, cp_row, cp_part, ptid, nseg, blk):
    """The producer's copies of query tile rows r0 .. r0 + 63 (zeros past seqlen_q) of Q and dO
    to ``q_addr`` / ``do_addr`` (this thread's first destination) and of their stats into row
    ``stage`` of ``ls`` / ``dls``; commits nothing."""
    copy_rows(ls, q_addr, q, ab, q_off, r0, seqlen_q, h, cp_row, cp_part, 0, BLOCK_M // 16,
              nseg, 8, 16, blk, True)
    copy_rows(ls, do_addr, dout, ab, q_off, r0, seqlen_q, h, cp_row, cp_part, 0, BLOCK_M // 16,
              nseg, 8, 16, blk, True)
    prefetch_stats(ls, dls, stage, lse2, delta, b, h, r0, ptid)


def make_ws_dkdv_kernel(head_dim: int, is_bf16: bool, has_left: bool, has_right: bool,
                        has_sinks: bool, has_softcap: bool, mask_kind: int, mask_mod=None,
                        has_alibi: bool = False, varlen: bool = False, direct: bool = False,
                        pingpong: bool = True, dq_mode: str = "atomic"):
    """The warp-specialised dK / dV kernel with atomic dQ (module docstring) for head_dim 64 or
    128: the arguments and outputs of ``backward.make_mma_dkdv_kernel``; grid ``(ceil(Sk /
    128), B * Hq)``, ``WS_BWD_THREADS`` threads, ``ws_dkdv_smem_bytes`` of dynamic shared
    memory."""
    D = int(head_dim)
    assert D in WS_BWD_HEAD_DIMS, D
    BN, BM = WS_BWD_BLOCK_N, BLOCK_M
    KS, NSEG = D // 16, D // 64
    BLK_K, BLK_Q = BN * 128, BM * 128              # bytes per 64-column block of a tile
    K_OFF, V_OFF, RING, STAGE, DS_OFF, MB_OFF, _ = _tile_bytes(D)
    HEAD_WORDS = _head_words()
    Q_BYTES = BM * D * 2
    BF16, KIND = bool(is_bf16), int(mask_kind)
    ALIBI, VARLEN, DIRECT = bool(has_alibi), bool(varlen), bool(direct)
    assert not (DIRECT and VARLEN)
    PP, DQ_ON, DQ_ADD = bool(pingpong), dq_mode != "none", dq_mode == "atomic"
    ACC_N, DQA_N, DQ_TILES = D // 2, DQ_COLS // 2, DQ_COLS // 8
    U0, U1, U_STAGES = np.uint32(0), np.uint32(1), np.uint32(STAGES)
    mod = mask_mod_device(mask_mod)
    u32, f32 = types.uint32, types.float32

    def kernel(q, k, v, dout, lse2, delta, dq_acc, dk_acc, dv_acc, seqlen_q, seqlen_k,
               heads_ratio, scale, scale_log2, cap_in, cap_log2, wl, wr, sinks, mk_iv, mk_mm,
               mk_tab, mk_bits, alibi, cu_q, cu_k):
        ktile, b, h, hk, ab, q_off, k_off, seqlen_q, seqlen_k = key_block(
            q, k, heads_ratio, seqlen_q, seqlen_k, cu_q, cu_k, VARLEN)
        k0 = ktile * BN
        if VARLEN and k0 >= seqlen_k:
            return
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        dynf = cuda.shared.array(0, f32)
        ls = shared_view(dynf, 0, STAGES, BM)
        dls = shared_view(dynf, STAGES * BM, STAGES, BM)
        mm, iv, mtile = stage_key_block(KIND, mk_iv, mk_mm, ktile, k0, seqlen_k,
                                        cuda.shared.array(0, types.int32), 2 * STAGES * BM,
                                        BN, tid, WS_BWD_THREADS)
        sbase = (np.int64(shared_addr(dynf)) + 4 * HEAD_WORDS + 1023) & ~1023
        full0 = np.uint32(sbase + MB_OFF)
        empty0 = full0 + np.uint32(8 * STAGES)
        if tid == 0:
            for s in range(STAGES):
                mbar_init(full0 + np.uint32(8 * s), 128)
                mbar_init(empty0 + np.uint32(8 * s), 256)
            fence_mbar_init()
        cuda.syncthreads()          # the barriers and the staged intervals
        tb, slope = block_table_and_slope(ALIBI, alibi, mk_tab, b, h, np.float32)
        lo, hi = query_rows(k0, min(k0 + BN, seqlen_k), seqlen_q, seqlen_k - seqlen_q,
                            has_left, has_right, has_sinks, wl, wr, sinks)
        end = (hi + BM - 1) // BM if hi > lo else 0
        t = next_query_tile(lo // BM, end, KIND, mm, mk_tab, tb, mtile, BM, k0, BN, seqlen_q,
                            seqlen_k, has_left, has_right, has_sinks, wl, wr, sinks)

        if warp < 4:                # the producer
            regs_dec_40()
            cp_row = tid >> 3
            cp_part = tid & 7
            cp_dst = cp_row * 128 + ((cp_part ^ (cp_row & 7)) << 4)
            copy_rows(ls, sbase + K_OFF + cp_dst, k, ab, k_off, k0, seqlen_k, hk, cp_row,
                      cp_part, 0, BN // 16, NSEG, 8, 16, BLK_K, True)
            copy_rows(ls, sbase + V_OFF + cp_dst, v, ab, k_off, k0, seqlen_k, hk, cp_row,
                      cp_part, 0, BN // 16, NSEG, 8, 16, BLK_K, True)
            i = U0          # unsigned stage arithmetic
            while t < end:
                nxt = next_query_tile(t + 1, end, KIND, mm, mk_tab, tb, mtile, BM, k0, BN,
                                      seqlen_q, seqlen_k, has_left, has_right, has_sinks, wl,
                                      wr, sinks)
                s = i % U_STAGES
                _wait(empty0 + 8 * s, ((i // U_STAGES) + U1) & U1)
                dst = sbase + RING + s * STAGE + cp_dst
                copy_query_tile(ls, dls, s, dst, dst + Q_BYTES, q, dout, lse2, delta, ab,
                                q_off, b, h, t * BM, seqlen_q, cp_row, cp_part, tid, NSEG,
                                BLK_Q)
                cp_async_commit()   # tile 0's group holds K and V too
                if i > 0:           # the previous tile landed; this one may not have
                    cp_async_wait_1()
                    fence_proxy_async()     # the bytes visible to wgmma (the async proxy)
                    mbar_arrive(full0 + 8 * ((i - U1) % U_STAGES))
                i += U1
                t = nxt
            cp_async_wait_all()     # nothing may be in flight when the block exits
            if i > 0:
                fence_proxy_async()
                mbar_arrive(full0 + 8 * ((i - U1) % U_STAGES))
            return

        regs_inc_232()
        cw = warp - 4               # consumer warp 0..7
        wg = cw >> 2                # its warpgroup: keys 64 wg .. 64 wg + 63
        own0 = 16 * cw              # the warp's 16 keys in the block
        kw0 = 64 * wg
        slope_log2 = slope * np.float32(LOG2E)
        where = (seqlen_q, seqlen_k, wl, wr, sinks, b, h)
        dk_a = sw128_desc(sbase + K_OFF + kw0 * 128, 16, 1024)        # K_w, K-major
        dv_a = sw128_desc(sbase + V_OFF + kw0 * 128, 16, 1024)
        dq_b = sw128_desc(sbase + RING, 16, 1024)                     # Q, K-major
        ddo_b = sw128_desc(sbase + RING + Q_BYTES, 16, 1024)
        dq_mn = sw128_desc(sbase + RING, BLK_Q, 1024)                 # Q, MN-major
        ddo_mn = sw128_desc(sbase + RING + Q_BYTES, BLK_Q, 1024)
        ds_a = sw128_desc(sbase + DS_OFF + kw0 * 128, BLK_K, 1024)    # dS_w (from dS^T)
        k_b = sw128_desc(sbase + K_OFF + kw0 * 128, BLK_K, 1024)      # K_w, MN-major
        st = cuda.local.array(32, f32)
        dpt = cuda.local.array(32, f32)
        pkp = cuda.local.array(16, u32)
        pkd = cuda.local.array(16, u32)
        dk = cuda.local.array(ACC_N, f32)
        dv = cuda.local.array(ACC_N, f32)
        dqa = cuda.local.array(DQA_N, f32)
        zero(dk, ACC_N)
        zero(dv, ACC_N)
        dq_row = q_off + 16 * (cw & 3)   # the warp's dQ rows in a tile, from the tile's first
        # Ping-pong: warpgroup wg issues products on its turn (named barrier 1 + wg) and then
        # hands the turn over; warpgroup 1 gives the first turn to warpgroup 0.
        if PP and wg == 1 and t < end:
            named_arrive(1, 256)
        i = U0
        while t < end:
            nxt = next_query_tile(t + 1, end, KIND, mm, mk_tab, tb, mtile, BM, k0, BN,
                                  seqlen_q, seqlen_k, has_left, has_right, has_sinks, wl, wr,
                                  sinks)
            s = i % U_STAGES
            _wait(full0 + 8 * s, (i // U_STAGES) & U1)
            r0 = t * BM
            _, full = tile_kind(KIND, mm, mk_tab, tb, t, mtile, r0, BM, k0, BN, seqlen_q,
                                seqlen_k, has_left, has_right, has_sinks, wl, wr, sinks)
            cb = np.uint64((s * STAGE) >> 4)
            if PP:
                named_sync(1 + wg, 256)
            issue_scores(st, dpt, dk_a, dv_a, dq_b + cb, ddo_b + cb, KS, BLK_K, BLK_Q, BF16)
            if PP:
                named_arrive(2 - wg, 256)
            wgmma_wait(64, st)
            wgmma_wait(64, dpt)
            probs_grads(st, dpt, pkp, pkd, 8, lane, True, own0, r0, k0, ls[s], dls[s], 0,
                        scale_log2, cap_in, cap_log2, has_softcap, BF16, full, where,
                        has_left, has_right, has_sinks, KIND, iv, mk_bits, mod, ALIBI,
                        slope_log2)
            named_sync(3 + wg, 128)     # the warpgroup's last dQ product has read dS^T
            store_ds_t(sbase + DS_OFF + own0 * 128, pkd, lane)
            fence_proxy_async()         # dS^T (generic stores) visible to wgmma
            named_sync(3 + wg, 128)     # the warpgroup's dS^T is in place
            if PP:
                named_sync(1 + wg, 256)
            accumulate_kv(dv, dk, pkp, pkd, ddo_mn + cb, dq_mn + cb, D, BF16)
            if DQ_ON:
                issue_dq(dqa, ds_a, k_b, 4, DQ_COLS, BF16)
            if PP and (wg == 0 or nxt < end):    # warpgroup 1's arrivals: one ahead
                named_arrive(2 - wg, 256)
            if DQ_ON:
                wgmma_wait(DQ_COLS, dqa)    # every group: dV, dK and the first dQ columns
            wgmma_wait(D, dv)
            wgmma_wait(D, dk)
            wgmma_hold(pkp)
            wgmma_hold(pkd)
            mbar_arrive(empty0 + 8 * s)  # Q, dO and the stats of stage s are read
            if DQ_ADD:
                store_fragments(dq_acc, ab, dq_row + r0, h, dqa, scale, q_off + seqlen_q, 0,
                                DQ_TILES, lane, True)
            if DQ_ON:
                for p in range(1, D // DQ_COLS):
                    dq_product(dqa, ds_a, k_b + np.uint64((p * BLK_K) >> 4), 4, DQ_COLS, BF16)
                    if DQ_ADD:
                        store_fragments(dq_acc, ab, dq_row + r0, h, dqa, scale,
                                        q_off + seqlen_q, p * DQ_COLS, DQ_TILES, lane, True)
            i += U1
            t = nxt
        store_dkdv(dk_acc, dv_acc, ab, k0 + own0, h, dk, dv, scale, k_off, seqlen_k, 0, D // 8,
                   lane, BF16, DIRECT)

    return jit_kernel(kernel, ("bwd_ws_dkdv", D, BF16, has_left, has_right, has_sinks,
                               has_softcap, KIND, ALIBI, VARLEN, PP, dq_mode)
                      + (("direct",) if DIRECT else ()),
                      cache=mask_mod is None, launch_bounds=WS_BWD_THREADS)
