"""Tiled FlashAttention-2 forward in float64 on the DMMA tensor cores (``mma.sync.m8n8k4`` f64,
primitives/mma_exact.py): the same products as the CUDA-core kernel (every multiply-add in IEEE
float64), at tensor-core rate. Flags only (causal, window, sinks, softcap) and GQA; mask
objects, packed batches, ALiBi and score_mod stay on the CUDA-core kernel.

A block of 4 warps owns 32 query rows per m-tile, a warp 8 per m-tile; at head_dim 32 / 64 a
warp owns two m-tiles (16 rows, a 64-row block), so that every K / V fragment it reads from
shared memory feeds two DMMAs (one B fragment load per DMMA was the shared-memory bandwidth
at the DMMA rate; docs/perf-notes.md). Q's A fragments (``a0 = Q[g, kk*4 + t]`` per m-tile) sit
in registers for the whole key loop; K and V tiles of ``BN`` keys go to shared memory by
cp.async (rows padded by 4 doubles so a fragment load touches distinct banks). Per tile:
S = Q K^T on DMMA (B fragment ``K[n*8 + g, kk*4 + t]``), the online softmax on the accumulator
fragment (lane (g, t) holds S[g, 2t], S[g, 2t + 1] of each 8-key n-tile; the row's 4 lanes
combine by shuffles), P staged through the warp's own shared buffer into A fragments
(``P[g, kk*4 + t]``), then O += P V on DMMA (B fragment ``V[kk*4 + t, n*8 + g]``).

Kernel signature: the CUDA-core kernel's (forward_fma.make_fma_kernel), so one launch plan
shape serves both; the mask / varlen / ALiBi arguments are never read. Grid (ceil(Sq / 32),
B * Hq) with block_m = ``dmma_block_m(head_dim)``, 128 threads.
"""
from __future__ import annotations

import math

from numba import cuda
from numba.cuda import types

from ..primitives import SIMULATOR, mma_f64, shfl_xor, syncwarp
from ..primitives.base import inlined
from .jitcache import jit_kernel
from .masking import key_tiles, past_sinks
from .schedule import group_keys, query_tile_of_block
from .tile_ops import load_kv_tile, masked_score

__all__ = ["make_dmma_kernel", "dmma_supported", "dmma_m_tiles", "dmma_block_m", "DMMA_THREADS",
           "DMMA_BLOCK_N"]

DMMA_THREADS = 128
DMMA_BLOCK_N = 16
_PAD = 4                         # doubles of padding per shared row


def dmma_supported(head_dim: int) -> bool:
    """Head dims of the DMMA kernel: Q fragments and the output accumulator of one lane
    (head_dim / 4 + head_dim / 4 doubles) fit the registers up to 128."""
    return head_dim in (32, 64, 96, 128)


def dmma_m_tiles(head_dim: int) -> int:
    """8-row m-tiles per warp: two up to head_dim 64 (Q fragments and output accumulators of
    both, head_dim / 2 doubles per lane, fit the registers), one above."""
    return 2 if head_dim <= 64 else 1


def dmma_block_m(head_dim: int) -> int:
    """Query rows per block: 4 warps x 8 rows x ``dmma_m_tiles``."""
    return 8 * (DMMA_THREADS // 32) * dmma_m_tiles(head_dim)


@inlined
def _softmax_to_p(s, o, ps, m_run, l_run, mt, sn, on, ns, warp, g, t, k0, qpos, seqlen_k,
                  scale, cap_in, cap_out, has_softcap, has_left, has_right, has_sinks,
                  window_left, window_right, sinks, neg_inf):
    """Online softmax of m-tile ``mt``'s scores ``s[mt sn .. (mt + 1) sn]`` (keys from
    ``k0``, this lane's row at query position ``qpos``): scale / softcap / flags, the row max
    and sum across the row's 4 lanes, ``o``'s m-tile rescaled, P written to the warp's buffer
    ``ps[warp, mt]`` (float64 (8, BN)) for the A fragments of P V."""
    mx = neg_inf
    for n in range(ns):
        for e in range(2):
            x = masked_score(s[mt * sn + 2 * n + e], k0 + n * 8 + 2 * t + e, qpos, seqlen_k,
                             scale, cap_in, cap_out, has_softcap, has_left, has_right,
                             has_sinks, window_left, window_right, sinks, neg_inf)
            s[mt * sn + 2 * n + e] = x
            mx = max(mx, x)
    mx = max(mx, shfl_xor(mx, 1))
    mx = max(mx, shfl_xor(mx, 2))
    m_new = max(m_run[mt], mx)
    mu = m_new if m_new != neg_inf else 0.0
    alpha = math.exp(m_run[mt] - mu)
    m_run[mt] = m_new
    rs = 0.0
    for n in range(ns):
        for e in range(2):
            p = math.exp(s[mt * sn + 2 * n + e] - mu)
            rs += p
            ps[warp, mt, g, n * 8 + 2 * t + e] = p
    rs += shfl_xor(rs, 1)
    rs += shfl_xor(rs, 2)
    l_run[mt] = l_run[mt] * alpha + rs
    for e in range(on):
        o[mt * on + e] *= alpha


@inlined
def _store_rows(out, lse, o, m_run, l_run, mt, on, nd, b, h, row, t, seqlen_q, write_lse,
                neg_inf):
    """Row ``row`` of m-tile ``mt``: this lane's output columns ``o / l`` (a NaN l stays NaN,
    docs/api.md; a row that saw no key gives 0) and, from lane t = 0, its lse."""
    if row < seqlen_q:
        l = l_run[mt]
        inv = 1.0 / l if l != 0 else 0.0
        for n in range(nd):
            out[b, row, h, n * 8 + 2 * t] = o[mt * on + 2 * n] * inv
            out[b, row, h, n * 8 + 2 * t + 1] = o[mt * on + 2 * n + 1] * inv
        if write_lse and t == 0:
            lse[b, h, row] = m_run[mt] + math.log(l) if l != 0 else neg_inf


def make_dmma_kernel(head_dim: int, has_left: bool, has_right: bool, has_sinks: bool,
                     has_softcap: bool, write_lse: bool):
    """Build the float64 DMMA forward kernel for one configuration (module docstring): q, k, v,
    out float64 (B, S, H, D) any strides; lse (B, Hq, Sq) float64 when ``write_lse``."""
    D = int(head_dim)
    if not dmma_supported(D):
        raise ValueError(f"head_dim must be one of 32, 64, 96, 128 for the DMMA kernel, got {D}")
    KS, ND = D // 4, D // 8              # k-steps of Q K^T; n-tiles of the output
    BN, NT, MT = DMMA_BLOCK_N, DMMA_THREADS, dmma_m_tiles(D)
    BM, WR = dmma_block_m(D), 8 * MT     # rows per block, per warp
    NS, KP = BN // 8, BN // 4            # n-tiles of S; k-steps of P V
    DP = D + _PAD                        # shared row length (doubles)
    CPR = D // 2                         # 16-byte copies per K / V row
    COPIES = BN * CPR // NT              # per thread and tile, for K and again for V
    SN, ON = NS * 2, ND * 2              # accumulator doubles per lane and m-tile: S, O
    QF_N, S_N, O_N = KS * MT, SN * MT, ON * MT     # local-array sizes (compile-time)
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
        ps = cuda.shared.array((4, MT, 8, BN), f64)    # each warp's P tiles
        qf = cuda.local.array(QF_N, f64)            # m-tile mt: qf[mt * KS + kk]
        s = cuda.local.array(S_N, f64)
        o = cuda.local.array(O_N, f64)
        m_run = cuda.local.array(MT, f64)
        l_run = cuda.local.array(MT, f64)
        row0 = qtile * BM + warp * WR + g    # this lane's row of m-tile mt: row0 + 8 mt
        offset = seqlen_k - seqlen_q
        for mt in range(MT):
            r = row0 + 8 * mt
            for kk in range(KS):
                qf[mt * KS + kk] = q[b, r, h, kk * 4 + t] if r < seqlen_q else 0.0
            m_run[mt] = NEG_INF
            l_run[mt] = 0.0
        for e in range(O_N):
            o[e] = 0.0
        q_lo = qtile * BM + offset
        q_hi = min(qtile * BM + BM, seqlen_q) - 1 + offset
        tile_lo, tile_hi, tile, last, sink_tiles = key_tiles(
            q_lo, q_hi, seqlen_k, BN, has_left, has_right, has_sinks, window_left, window_right,
            sinks)
        tile = past_sinks(tile, tile_lo, sink_tiles, has_sinks)
        while tile <= last:
            k0 = tile * BN
            load_kv_tile(ks, vs, k, v, b, hk, k0, seqlen_k, tid, NT, COPIES, CPR, 2)
            for e in range(S_N):
                s[e] = 0.0
            for n in range(NS):                  # S = Q K^T, each K fragment for every m-tile
                for kk in range(KS):
                    kb = ks[n * 8 + g, kk * 4 + t]
                    for mt in range(MT):
                        j = mt * SN + 2 * n
                        s[j], s[j + 1] = mma_f64(qf[mt * KS + kk], kb, s[j], s[j + 1])
            for mt in range(MT):
                _softmax_to_p(s, o, ps, m_run, l_run, mt, SN, ON, NS, warp, g, t, k0,
                              row0 + 8 * mt + offset, seqlen_k, scale, cap_in, cap_out,
                              has_softcap, has_left, has_right, has_sinks, window_left,
                              window_right, sinks, NEG_INF)
            syncwarp()
            for kk in range(KP):                 # O += P V, each V fragment for every m-tile
                a0 = ps[warp, 0, g, kk * 4 + t]
                a1 = ps[warp, MT - 1, g, kk * 4 + t]     # (unused with one m-tile)
                for n in range(ND):
                    vb = vs[kk * 4 + t, n * 8 + g]
                    o[2 * n], o[2 * n + 1] = mma_f64(a0, vb, o[2 * n], o[2 * n + 1])
                    if MT == 2:
                        j = ON + 2 * n
                        o[j], o[j + 1] = mma_f64(a1, vb, o[j], o[j + 1])
            syncwarp()                           # P read before the next tile overwrites it
            tile = past_sinks(tile + 1, tile_lo, sink_tiles, has_sinks)
        for mt in range(MT):
            _store_rows(out, lse, o, m_run, l_run, mt, ON, ND, b, h, row0 + 8 * mt, t, seqlen_q,
                        write_lse, NEG_INF)

    return jit_kernel(kernel, ("dmma", D, bool(has_left), bool(has_right), bool(has_sinks),
                               bool(has_softcap), bool(write_lse)))
