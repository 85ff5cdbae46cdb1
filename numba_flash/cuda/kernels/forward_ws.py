"""Warp-specialised FlashAttention forward on Hopper wgmma (float16 / bfloat16, fp32
accumulation): a producer warpgroup copies the Q tile and the K / V tiles into a ring of
shared-memory stages and two consumer warpgroups compute, synchronised per stage by mbarriers
instead of the block barriers of forward_mma.py's wgmma path, so the two consumer warpgroups
never wait for each other and one's softmax can run under the other's products.

Block: 384 threads, warps 0-3 the producer, warps 4-11 the consumers (warpgroup c = 0, 1 owns
query rows 64 c .. 64 c + 63 of the 128-row tile, exactly as forward_mma.py's wgmma warpgroups).
Per visited key tile, the i-th (stage ``i % STAGES``): the producer waits for the stage's
``empty`` barrier, issues its cp.async copies, and once a tile's copies have landed (then
``fence.proxy.async``, so that wgmma sees the bytes) arrives on its stage's ``full`` barrier
(``AHEAD``: two tiles in flight);
each consumer thread waits for ``full``, runs S = Q K^T, the online softmax and O += P V
(forward_mma_tiles.py's helpers) and arrives on ``empty``; the two consumer warpgroups take
turns issuing their products (named barriers), so one's softmax runs under the other's
products. Plain and causal configurations (a right window too), with or without a
column-interval mask object at head_dim 64 / 96 / 128 (FlashMask's: the walk visits only the
tiles the mask does not skip, as forward_mma.py's does, producer and consumers each walking the
same tiles; for a partial tile the producer packs its keys' bounds relative to the query tile
into one word per key beside the stage, ``row_bounds_word``); no left window, sinks, softcap,
packed batches, ALiBi, mask_mod or score_mod. Shapes and kernel arguments:
forward_mma.make_mma_kernel's.
"""
from __future__ import annotations

import numpy as np
from numba import cuda
from numba.cuda import types

from ..primitives import (cp_async_commit, cp_async_wait_1, cp_async_wait_all, fence_mbar_init,
                          fence_proxy_async, global_address, mbar_arrive, mbar_init,
                          mbar_try_wait, named_arrive, named_sync, regs_dec_72, regs_inc_216,
                          shfl_idx, sts32, wgmma_wait)
from .forward_geometry import wgmma_row_bytes
from .forward_mma_tiles import (TILE_ROWS, copy_coords, copy_rows, copy_whole_rows,
                                exp_and_pack, init_rows, mask_tile, mask_tile_rows,
                                pv_wgmma_start, qk_wgmma_start, rescale_acc, row_bounds_word,
                                store_output, update_row_max, wgmma_tiles)
from .jitcache import jit_kernel
from ..primitives.base import inlined
from .masking import (INTERVALS, NONE, flags_see_whole_tile, key_tiles, mask_mod_device,
                      walk_next, walk_start)
from .schedule import group_keys, query_tile_of_block

__all__ = ["make_ws_kernel", "WS_THREADS", "WS_BLOCK_M", "WS_LAUNCH_REGISTERS", "ws_head_dims",
           "ws_stages",
           "ws_smem_bytes", "ws_moves_registers"]

WS_THREADS = 384
WS_BLOCK_M = 128
assert WS_BLOCK_M == TILE_ROWS      # the packed key bounds (row_bounds_word) are per query tile
WS_LAUNCH_REGISTERS = 168     # 65,536 / 384, rounded down to a multiple of 8


def ws_head_dims(mask_kind: int) -> tuple:
    """The head dims this kernel is built for with mask kind ``mask_kind``: 96 / 128 / 256
    without a mask object, 64 / 96 / 128 with column intervals (at 256 the walk's state spilled
    the producer's 72 registers; at 64 without a mask the wgmma kernel of forward_mma.py runs 4
    blocks per multiprocessor, while its interval build holds 245 registers, one block); none
    for other kinds (their per-element data have no staging here)."""
    if mask_kind == NONE:
        return (96, 128, 256)
    if mask_kind == INTERVALS:
        return (64, 96, 128)
    return ()


def ws_moves_registers(head_dim: int) -> bool:
    """Whether the kernel moves registers from the producer (72) to the consumers (216) with
    ``setmaxnreg``: at head_dim 256, whose consumers need ~213 (128 x 72 + 256 x 216 = 384 x
    168: exactly ``WS_LAUNCH_REGISTERS`` per thread at launch). At 96 / 128 the consumers fit
    168, and a 72- or 88-register producer spilled (its copy addresses; two tiles in flight)."""
    return head_dim > 128


def ws_stages(head_dim: int) -> int:
    """K / V stages of the ring: as many as fit beside the Q tile in 227 KB (at most 4)."""
    rb = wgmma_row_bytes(head_dim)
    bn = 64 if head_dim > 128 else 128
    return max(2, min(4, (227 * 1024 - 2048 - WS_BLOCK_M * rb) // (2 * bn * rb)))


def ws_smem_bytes(head_dim: int, mask_kind: int = NONE) -> int:
    """Dynamic shared memory: Q, the stages' K and V tiles, the mbarriers, with an interval mask
    the stages' packed key bounds (4 bytes per key), 1 KB of alignment."""
    rb = wgmma_row_bytes(head_dim)
    bn = 64 if head_dim > 128 else 128
    stages = ws_stages(head_dim)
    bounds = 4 * bn * stages if mask_kind == INTERVALS else 0
    total = (WS_BLOCK_M + 2 * bn * stages) * rb + 16 * stages + bounds + 1024
    assert total <= 227 * 1024, (head_dim, mask_kind, total)   # the sm_90 block maximum
    return total


@inlined
def _wait(addr, parity):
    """Spin until the phase of parity ``parity`` of the mbarrier at ``addr`` has completed."""
    while not mbar_try_wait(addr, parity):
        pass


@inlined
def tile_seen_whole(tile, mask_full, tile_lo, tile_hi, q_lo, q_hi, seqlen_k, window_left,
                    window_right, bn, has_left, has_right):
    """Whether no pair of key tile ``tile`` needs the per-element mask: the mask object's class
    (``mask_full``, from the walk) and the flags (``flags_see_whole_tile``) both see all of it.
    The producer packs a tile's key bounds exactly when the consumers then mask it, so both
    take this one test."""
    return mask_full and flags_see_whole_tile(tile * bn, tile >= tile_lo and tile <= tile_hi,
                                              q_lo, q_hi, seqlen_k, window_left, window_right,
                                              0, bn, has_left, has_right, False)


@inlined
def copy_kv_tile(dyn, k_dst, k, v, b, hk, key0, seqlen_k, cp_row, cp_part, cp_swz, by_steps,
                 passes, nseg, tpl, rpp, blk, v_in, bn):
    """The producer's cp.async copies of key tile rows ``key0 .. key0 + bn - 1`` of K and V (kv
    head ``hk`` of batch entry ``b``) to shared address ``k_dst`` and ``k_dst + v_in``; commits
    nothing. A whole tile goes by address steps of the arrays' row strides when ``by_steps``
    (not at head_dim 256, whose producer keeps 72 registers: the addresses spilled there with
    ptxas 13.0); a ragged last tile row by row with bounds checks (rows past ``seqlen_k``:
    zeros)."""
    if by_steps and key0 + bn <= seqlen_k:
        row = key0 + cp_row                 # this thread's first chunk's row
        copy_whole_rows(k_dst, global_address(k, b, row, hk, cp_part * 4),
                        k.strides[1] * rpp, passes, nseg, tpl, rpp, blk)
        copy_whole_rows(k_dst + v_in, global_address(v, b, row, hk, cp_part * 4),
                        v.strides[1] * rpp, passes, nseg, tpl, rpp, blk)
    else:
        copy_rows(dyn, k_dst, k, b, 0, key0, seqlen_k, hk, cp_row, cp_part, cp_swz, passes,
                  nseg, tpl, rpp, blk, True)
        copy_rows(dyn, k_dst + v_in, v, b, 0, key0, seqlen_k, hk, cp_row, cp_part, cp_swz,
                  passes, nseg, tpl, rpp, blk, True)


@inlined
def mask_partial_tile(s, words, bounds_addr, k0, wrow, rel0, g, t, offset, seqlen_q, seqlen_k,
                      window_right, mk_iv, mk_bits, mod, ns, sf, bn, kind, has_right, hidden):
    """A consumer's per-element mask of a partial key tile (scores ``s``, float32, one m-tile of
    ``ns`` 8-key n-tiles): with an interval mask from the producer's packed words of the stage
    at ``bounds_addr`` (``mask_tile_rows``; ``rel0``: the thread's first row in the query tile),
    else (the causal flag alone) by ``mask_tile``'s flag tests."""
    if kind == INTERVALS:
        mask_tile_rows(s, bounds_addr, k0, rel0, wrow + g + offset, t, window_right, ns,
                       has_right, hidden)
    else:
        mask_tile(s, words, k0, wrow, g, t, offset, seqlen_q, seqlen_k, 0, 0, 0, window_right,
                  0, mk_iv, mk_bits, 0, mod, ns, sf, 2, bn, NONE, False, False, has_right, False,
                  hidden)


def make_ws_kernel(head_dim: int, is_bf16: bool, causal: bool, write_lse: bool,
                   mask_kind: int = NONE):
    """Build the warp-specialised kernel for one configuration (compile-time arguments): plain
    or causal, ``mask_kind`` NONE or INTERVALS at a head dim of ``ws_head_dims(mask_kind)`` (no
    left window or softcap: those need more registers; block_n 128, 64 at head_dim 256).
    Launch with ``WS_THREADS`` threads, a grid of (query tiles of ``WS_BLOCK_M`` rows, B * Hq)
    and ``ws_smem_bytes(head_dim, mask_kind)`` bytes of dynamic shared memory."""
    D = int(head_dim)
    BF16 = bool(is_bf16)
    KIND = int(mask_kind)
    assert D in ws_head_dims(KIND), (mask_kind, head_dim)
    BN = 64 if D > 128 else 128
    BM = WS_BLOCK_M
    STAGES = ws_stages(D)
    RB = wgmma_row_bytes(D)
    KS, NS, NP, ND = D // 16, BN // 8, BN // 16, D // 8
    SF, OF = NS * 4, ND * 4
    PK_N = SF // 2
    TPL = 8 if (D // 8) % 8 == 0 else 4         # producer copy plan (128 threads)
    RPP = 128 // TPL
    NSEG, KV_PASSES, Q_PASSES = (D // 8) // TPL, BN // RPP, BM // RPP
    BLK_Q, BLK_K = BM * 128, BN * 128
    Q_OFF, K_OFF = 0, BM * RB
    STAGE = 2 * BN * RB                         # bytes per stage: K then V
    V_IN = BN * RB
    MB_OFF = BM * RB + STAGES * STAGE           # full[s] at MB_OFF + 8 s, empty[s] after them
    BND_OFF = MB_OFF + 16 * STAGES              # stage s's packed key bounds: BN words
    has_left, has_right = False, bool(causal)
    # grouped rows (schedule.py) under the causal flag and interval masks, whose query tiles
    # differ in work (causal-like masks: the last tiles see the most keys)
    GROUP_KEYS = group_keys(4 * D, has_right or KIND == INTERVALS, False)
    NEG_INF = np.float32(-np.inf)
    REALLOC = ws_moves_registers(D)
    # With 3+ stages the producer keeps two tiles in flight: it announces tile i - 1 only
    # after issuing tile i, whose stage the consumers freed when they finished tile i - STAGES.
    # With 2 stages that is tile i - 2, just before they need tile i - 1: they would wait for
    # tile i's issue each time, so there the producer announces each tile first.
    AHEAD = STAGES >= 3
    U0, U1, U_STAGES = np.uint32(0), np.uint32(1), np.uint32(STAGES)
    mod = mask_mod_device(None)

    def kernel(q, k, v, out, lse, seqlen_q, seqlen_k, heads_ratio, scale_log2, cap_in, cap_out,
               window_left, window_right, sinks, mk_iv, mk_mm, mk_tab, mk_bits, cu_q, cu_k, alibi):
        qtile, _, row = query_tile_of_block(seqlen_k, heads_ratio, GROUP_KEYS)
        b = row // q.shape[2]
        h = row % q.shape[2]
        hk = h // heads_ratio
        tid = cuda.threadIdx.x
        # The warp index and the shared base broadcast from lane 0 (shfl_idx): ptxas then
        # knows them warp-uniform and keeps the wgmma descriptors built from them in uniform
        # registers instead of per-thread 64-bit arithmetic and R2UR moves in the loop.
        warp = shfl_idx(tid >> 5, 0)
        lane = tid & 31
        cw = (warp - 4) & 7                     # consumer warp 0..7 (producers: unused)
        cp_row, cp_part, cp_swz = copy_coords(tid & 127, TPL, 0)
        dyn = cuda.shared.array(0, types.uint32)
        sbase, cp_dst, dq, dk, dv = wgmma_tiles(dyn, cw, cp_row, cp_part, Q_OFF, K_OFF,
                                                K_OFF + V_IN, BLK_K, True)
        full0 = np.uint32(sbase + MB_OFF)
        empty0 = full0 + np.uint32(8 * STAGES)
        if tid == 0:
            for st in range(STAGES):
                mbar_init(full0 + np.uint32(8 * st), 128)
                mbar_init(empty0 + np.uint32(8 * st), 256)
            fence_mbar_init()
        cuda.syncthreads()

        offset = seqlen_k - seqlen_q
        r_lo = qtile * BM                       # the query tile's rows [r_lo, r_hi)
        r_hi = min(r_lo + BM, seqlen_q)
        q_lo = r_lo + offset
        q_hi = r_hi - 1 + offset
        tile_lo, tile_hi, first, last, _ = key_tiles(q_lo, q_hi, seqlen_k, BN, has_left,
                                                     has_right, False, window_left,
                                                     window_right, 0)
        # The key tiles to visit: every warp walks them (the mask's class votes are per warp).
        tile, base, vbits, fbits = walk_start(KIND, mk_mm, mk_tab, 0, qtile, first, last, lane,
                                              tile_lo, tile_hi, 0, r_lo, r_hi, False)
        if warp < 4:        # producer: Q with the first tile, then K / V tile by tile
            if REALLOC:
                regs_dec_72()
            if tile > last:
                return
            i = U0           # unsigned stage arithmetic (Numba widens it to uint64)
            while tile <= last:
                nxt, mask_full, base, vbits, fbits = walk_next(
                    KIND, tile, base, vbits, fbits, mk_mm, mk_tab, 0, qtile, last, lane,
                    tile_lo, tile_hi, 0, r_lo, r_hi, False)
                st = i % U_STAGES
                if not AHEAD and i > 0:     # the previous tile landed: stage full
                    cp_async_wait_all()
                    fence_proxy_async()     # the bytes visible to wgmma (the async proxy)
                    mbar_arrive(full0 + 8 * ((i - U1) % U_STAGES))
                _wait(empty0 + 8 * st, ((i // U_STAGES) + U1) & U1)
                # A tile the consumers will mask: its keys' bounds, loads in flight under the
                # copies.
                partial = not tile_seen_whole(tile, mask_full, tile_lo, tile_hi, q_lo, q_hi,
                                              seqlen_k, window_left, window_right, BN, has_left,
                                              has_right)
                bounds = np.uint32(0)
                if KIND == INTERVALS and partial:
                    bounds = row_bounds_word(mk_iv, tile * BN + (tid & 127), seqlen_k, r_lo)
                if i == 0:
                    copy_rows(dyn, sbase + Q_OFF + cp_dst, q, b, 0, r_lo, seqlen_q, h,
                              cp_row, cp_part, cp_swz, Q_PASSES, NSEG, TPL, RPP, BLK_Q, True)
                copy_kv_tile(dyn, sbase + K_OFF + st * STAGE + cp_dst, k, v, b, hk, tile * BN,
                             seqlen_k, cp_row, cp_part, cp_swz, not REALLOC, KV_PASSES, NSEG,
                             TPL, RPP, BLK_K, V_IN, BN)
                cp_async_commit()
                if KIND == INTERVALS and partial and (tid & 127) < BN:
                    sts32(sbase + BND_OFF + (st * BN + (tid & 127)) * 4, bounds)
                if AHEAD and i > 0:     # the previous tile landed, this one may not have
                    cp_async_wait_1()
                    fence_proxy_async()     # the bytes visible to wgmma (the async proxy)
                    mbar_arrive(full0 + 8 * ((i - U1) % U_STAGES))
                i += U1
                tile = nxt
            cp_async_wait_all()
            fence_proxy_async()
            mbar_arrive(full0 + 8 * ((i - U1) % U_STAGES))
            return

        if REALLOC:
            regs_inc_216()
        g = lane >> 2
        t = lane & 3
        s = cuda.local.array(SF, types.float32)
        acc = cuda.local.array(OF, types.float32)
        pk = cuda.local.array(PK_N, types.uint32)
        m_run = cuda.local.array(2, types.float32)
        l_run = cuda.local.array(2, types.float32)
        mx = cuda.local.array(2, types.float32)
        mu = cuda.local.array(2, types.float32)
        alpha = cuda.local.array(2, types.float32)
        words = cuda.local.array(2, types.uint32)
        # Raw scores (unscaled until the exponent): a negative scale hides with +inf.
        hidden = np.float32(np.inf) if scale_log2 < 0 else NEG_INF
        wrow = r_lo + cw * 16
        init_rows(acc, m_run, l_run, 1, OF)
        # Ping-pong (FlashAttention-3's): the warpgroups take turns issuing their products
        # (named barrier 1 + wg: "wg's turn"), so one's products run while the other's softmax
        # does instead of both at once. Warpgroup 1 gives the first turn to warpgroup 0.
        wg = cw >> 2
        if wg == 1 and tile <= last:
            named_arrive(1, 256)
        i = U0
        while tile <= last:
            nxt, mask_full, base, vbits, fbits = walk_next(
                KIND, tile, base, vbits, fbits, mk_mm, mk_tab, 0, qtile, last, lane, tile_lo,
                tile_hi, 0, r_lo, r_hi, False)
            st = i % U_STAGES
            _wait(full0 + 8 * st, (i // U_STAGES) & U1)
            k0 = tile * BN
            full = tile_seen_whole(tile, mask_full, tile_lo, tile_hi, q_lo, q_hi, seqlen_k,
                                   window_left, window_right, BN, has_left, has_right)
            stage_off = np.uint64((st * STAGE) >> 4)
            named_sync(1 + wg, 256)            # this warpgroup's turn to issue products
            qk_wgmma_start(s, dq, dk + stage_off, KS, BN, BLK_Q, BLK_K, BF16)
            named_arrive(2 - wg, 256)          # the other's turn
            wgmma_wait(BN, s)
            if not full:
                mask_partial_tile(s, words, sbase + BND_OFF + st * BN * 4, k0, wrow, cw * 16 + g,
                                  g, t, offset, seqlen_q, seqlen_k, window_right, mk_iv, mk_bits,
                                  mod, NS, SF, BN, KIND, has_right, hidden)
            update_row_max(s, m_run, mx, mu, alpha, NS, SF, 1, 2, True, scale_log2)
            exp_and_pack(s, pk, mx, mu, alpha, l_run, NS, SF, 1, 2, BF16, True, scale_log2)
            rescale_acc(acc, alpha, ND, OF, 1)
            named_sync(1 + wg, 256)
            pv_wgmma_start(acc, pk, dv + stage_off, NP, D, BF16)
            if wg == 0 or nxt <= last:    # warpgroup 1's arrivals: one ahead
                named_arrive(2 - wg, 256)
            wgmma_wait(D, acc)
            mbar_arrive(empty0 + 8 * st)
            i += U1
            tile = nxt
        store_output(out, lse, acc, l_run, m_run, b, 0, h, wrow, g, t, seqlen_q, 1, OF, ND,
                     BF16, write_lse)

    return jit_kernel(kernel, ("ws", D, BF16, has_right, write_lse, KIND),
                      launch_bounds=WS_THREADS)
