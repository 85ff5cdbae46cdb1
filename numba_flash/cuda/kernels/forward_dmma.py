"""Tiled FlashAttention-2 forward in float64 on the DMMA tensor cores (``mma.sync.m8n8k4`` f64,
primitives/mma_exact.py): the same products as the CUDA-core kernel (every multiply-add in IEEE
float64), at tensor-core rate. Flags only (causal, window, sinks, softcap) and GQA; mask
objects, packed batches, ALiBi and score_mod stay on the CUDA-core kernel.

A block of 4 warps owns 32 query rows, a warp 8 (one m-tile). Q's A fragments (``a0 = Q[g, kk*4
+ t]``) sit in registers for the whole key loop; K and V tiles of ``BN`` keys go to shared memory
by cp.async (rows padded by 4 doubles so a fragment load touches distinct banks). Per tile:
S = Q K^T on DMMA (B fragment ``K[n*8 + g, kk*4 + t]``), the online softmax on the accumulator
fragment (lane (g, t) holds S[g, 2t], S[g, 2t + 1] of each 8-key n-tile; the row's 4 lanes
combine by shuffles), P staged through the warp's own shared buffer into A fragments
(``P[g, kk*4 + t]``), then O += P V on DMMA (B fragment ``V[kk*4 + t, n*8 + g]``).

Kernel signature: the CUDA-core kernel's (forward_fma.make_fma_kernel), so one launch plan
shape serves both; the mask / varlen / ALiBi arguments are never read. Grid (ceil(Sq / 32),
B * Hq), 128 threads.
"""
from __future__ import annotations

import math

from numba import cuda
from numba.cuda import types

from ..primitives import SIMULATOR, mma_f64, shfl_xor, syncwarp
from .jitcache import jit_kernel
from .masking import key_tiles, past_sinks
from .schedule import group_keys, query_tile_of_block
from .tile_ops import load_kv_tile, masked_score

__all__ = ["make_dmma_kernel", "dmma_supported", "DMMA_BLOCK_M", "DMMA_THREADS", "DMMA_BLOCK_N"]

DMMA_BLOCK_M = 32
DMMA_THREADS = 128
DMMA_BLOCK_N = 16
_PAD = 4                         # doubles of padding per shared row


def dmma_supported(head_dim: int) -> bool:
    """Head dims of the DMMA kernel: Q fragments and the output accumulator of one lane
    (head_dim / 4 + head_dim / 4 doubles) fit the registers up to 128."""
    return head_dim in (32, 64, 96, 128)


def make_dmma_kernel(head_dim: int, has_left: bool, has_right: bool, has_sinks: bool,
                     has_softcap: bool, write_lse: bool):
    """Build the float64 DMMA forward kernel for one configuration (module docstring): q, k, v,
    out float64 (B, S, H, D) any strides; lse (B, Hq, Sq) float64 when ``write_lse``."""
    D = int(head_dim)
    if not dmma_supported(D):
        raise ValueError(f"head_dim must be one of 32, 64, 96, 128 for the DMMA kernel, got {D}")
    KS, ND = D // 4, D // 8              # k-steps of Q K^T; n-tiles of the output
    BN, BM, NT = DMMA_BLOCK_N, DMMA_BLOCK_M, DMMA_THREADS
    NS, KP = BN // 8, BN // 4            # n-tiles of S; k-steps of P V
    DP = D + _PAD                        # shared row length (doubles)
    CPR = D // 2                         # 16-byte copies per K / V row
    COPIES = BN * CPR // NT              # per thread and tile, for K and again for V
    SN, ON = NS * 2, ND * 2              # accumulator doubles per lane: S, O
    f64 = types.float64
    GROUP_KEYS = group_keys(16 * D, has_right)     # the grid's order (schedule.py)
    NEG_INF = -math.inf

    def kernel(q, k, v, out, lse, seqlen_q, seqlen_k, heads_ratio, scale, cap_in, cap_out,
               window_left, window_right, sinks, mk_iv, mk_mm, mk_tab, mk_bits, cu_q, cu_k, alibi):
        qtile, _, row = query_tile_of_block(seqlen_k, heads_ratio, GROUP_KEYS)
        b = row // q.shape[2]
        h = row % q.shape[2]
        hk = h // heads_ratio
        tid = cuda.threadIdx.x
        warp, lane = tid >> 5, tid & 31
        g, t = lane >> 2, lane & 3
        if SIMULATOR:
            ks = cuda.shared.array((BN, DP), f64)
            vs = cuda.shared.array((BN, DP), f64)
        else:       # cp.async writes 16-byte aligned rows
            ks = cuda.shared.array((BN, DP), f64, alignment=16)
            vs = cuda.shared.array((BN, DP), f64, alignment=16)
        ps = cuda.shared.array((4, 8, BN), f64)        # each warp's P tile
        qf = cuda.local.array(KS, f64)
        s = cuda.local.array(SN, f64)
        o = cuda.local.array(ON, f64)
        row = qtile * BM + warp * 8 + g
        qpos = row + seqlen_k - seqlen_q
        for kk in range(KS):
            qf[kk] = q[b, row, h, kk * 4 + t] if row < seqlen_q else 0.0
        for e in range(ON):
            o[e] = 0.0
        m = NEG_INF
        l = 0.0
        q_lo = qtile * BM + seqlen_k - seqlen_q
        q_hi = min(qtile * BM + BM, seqlen_q) - 1 + seqlen_k - seqlen_q
        tile_lo, tile_hi, tile, last, sink_tiles = key_tiles(
            q_lo, q_hi, seqlen_k, BN, has_left, has_right, has_sinks, window_left, window_right,
            sinks)
        tile = past_sinks(tile, tile_lo, sink_tiles, has_sinks)
        while tile <= last:
            k0 = tile * BN
            load_kv_tile(ks, vs, k, v, b, hk, k0, seqlen_k, tid, NT, COPIES, CPR, 2)
            for e in range(SN):
                s[e] = 0.0
            for n in range(NS):                  # S = Q K^T
                for kk in range(KS):
                    s[2 * n], s[2 * n + 1] = mma_f64(qf[kk], ks[n * 8 + g, kk * 4 + t],
                                                     s[2 * n], s[2 * n + 1])
            mx = NEG_INF
            for n in range(NS):                  # scale, softcap, mask; the row's max
                for e in range(2):
                    x = masked_score(s[2 * n + e], k0 + n * 8 + 2 * t + e, qpos, seqlen_k,
                                     scale, cap_in, cap_out, has_softcap, has_left, has_right,
                                     has_sinks, window_left, window_right, sinks, NEG_INF)
                    s[2 * n + e] = x
                    mx = max(mx, x)
            mx = max(mx, shfl_xor(mx, 1))
            mx = max(mx, shfl_xor(mx, 2))
            m_new = max(m, mx)
            mu = m_new if m_new != NEG_INF else 0.0
            alpha = math.exp(m - mu)
            m = m_new
            rs = 0.0
            for n in range(NS):                  # P, staged for the A fragments of P V
                for e in range(2):
                    p = math.exp(s[2 * n + e] - mu)
                    rs += p
                    ps[warp, g, n * 8 + 2 * t + e] = p
            rs += shfl_xor(rs, 1)
            rs += shfl_xor(rs, 2)
            l = l * alpha + rs
            for e in range(ON):
                o[e] *= alpha
            syncwarp()
            for kk in range(KP):                 # O += P V
                a0 = ps[warp, g, kk * 4 + t]
                for n in range(ND):
                    o[2 * n], o[2 * n + 1] = mma_f64(a0, vs[kk * 4 + t, n * 8 + g],
                                                     o[2 * n], o[2 * n + 1])
            syncwarp()                           # P read before the next tile overwrites it
            tile = past_sinks(tile + 1, tile_lo, sink_tiles, has_sinks)
        if row < seqlen_q:
            inv = 1.0 / l if l != 0 else 0.0     # a NaN l stays NaN (docs/api.md)
            for n in range(ND):
                out[b, row, h, n * 8 + 2 * t] = o[2 * n] * inv
                out[b, row, h, n * 8 + 2 * t + 1] = o[2 * n + 1] * inv
            if write_lse and t == 0:
                lse[b, h, row] = m + math.log(l) if l != 0 else NEG_INF

    return jit_kernel(kernel, ("dmma", D, bool(has_left), bool(has_right), bool(has_sinks),
                               bool(has_softcap), bool(write_lse)))
