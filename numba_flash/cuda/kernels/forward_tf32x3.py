"""Tiled FlashAttention-2 forward in float32 on the TF32 tensor cores with error compensation
(3xTF32, as in CUTLASS): every product ``a b`` is ``a_hi b_hi + a_hi b_lo + a_lo b_hi`` with
``a = a_hi + a_lo`` split into two TF32 numbers (primitives/mma_exact.py ``split_tf32``) and
fp32 accumulation, which keeps float32-level accuracy at tensor-core rate. Flags only (causal,
window, sinks, softcap) and GQA; mask objects, packed batches, ALiBi and score_mod stay on the
CUDA-core kernel.

A warp owns 16 query rows (one ``m16n8k8`` m-tile), a block 4 warps up to head_dim 64 and 2
beyond (``tf32x3_geometry``). Q's A fragments (``Q[g, kk*8 + t]``, ``Q[g + 8, ...]``, columns
``+ 4``) sit in registers as float32 at head_dim 32, in shared memory from 64 on, and are
split per k-step; K and V tiles of ``BN`` keys go to shared memory by cp.async (rows padded by
4 floats). Per tile: S = Q K^T (B fragment ``K[n*8 + g, kk*8 + t (+ 4)]``), the online softmax
on the accumulator fragment (lane (g, t): rows g and g + 8, columns 2t, 2t + 1 of each 8-key
n-tile; a row's 4 lanes combine by shuffles), P staged through the warp's shared buffer into A
fragments, then O = alpha O + P V (B fragment ``V[kk*8 + t (+ 4), n*8 + g]``).

Accumulation order. The tensor cores round each D = A B + C toward zero (primitives/mma_exact.py),
so an mma into a long-lived accumulator adds an error of up to one ulp of that accumulator,
always toward zero: with S and O each accumulated in place, the ~3 N / 8 mmas of O += P V over
N keys added up linearly (H100: 13x the IEEE kernel's error at N = 2048, 3-4x at 20-40 keys
from S's 3 D / 8 mmas). So every product starts from a zeroed accumulator and is added in IEEE
float32: S one k-step at a time (``s += Q_kk K_kk^T``: one truncation of an 8-term partial sum,
whose sign varies), O one key tile at a time (``o = alpha o + P V``). Modelled error (the
simulator's truncating tensor cores): 1.0-1.8x the IEEE kernel's on the tests' cases, at most
1.2x at 2048-4096 keys (docs/perf-notes.md, 2026-11-25).

Kernel signature: the CUDA-core kernel's (forward_fma.make_fma_kernel); the mask / varlen /
ALiBi arguments are never read. Grid (ceil(Sq / rows per block), B * Hq).
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda
from numba.cuda import types

from ..primitives import SIMULATOR, mma_tf32, shfl_xor, split_tf32, syncwarp
from .jitcache import jit_kernel
from .masking import key_tiles, past_sinks
from .schedule import group_keys, query_tile_of_block
from .tile_ops import load_kv_tile, masked_score, store_q_rows
from ..primitives.base import inlined

__all__ = ["make_tf32x3_kernel", "tf32x3_supported", "tf32x3_geometry", "TF32_BLOCK_N"]

TF32_BLOCK_N = 16
_PAD = 4


def tf32x3_supported(head_dim: int) -> bool:
    """Head dims of the 3xTF32 kernel: 32, 64, 96 (offline sm_90: 125-131 / 128-131 / 168-231
    registers over the 32 flag combinations, no local memory). At 128 the output accumulator and
    the split operands spilled (160 bytes, before the per-k-step S of 2026-11-25), so 128 stays
    on the CUDA-core kernel."""
    return head_dim in (32, 64, 96)


def tf32x3_geometry(head_dim: int) -> tuple[int, int]:
    """(query rows per block, threads per block). Up to head_dim 64, 4 warps; beyond, 2 warps
    (Q, K, V and P tiles within 48 KB of shared memory). Q's fragments stay in registers only at
    head_dim 32. Offline sm_90: at 64, Q in registers took the kernel to 248-255 registers and
    local memory in the sink builds, Q in shared memory to 128-132 and none (2026-11-25); at
    96 / 128, Q in registers spilled 60 / 492 bytes (the kernel before that)."""
    return (64, 128) if head_dim <= 64 else (32, 64)


@inlined
def mma3(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """c + a b in 3xTF32: the two small cross terms first, then hi x hi."""
    a0h, a0l = split_tf32(a0)
    a1h, a1l = split_tf32(a1)
    a2h, a2l = split_tf32(a2)
    a3h, a3l = split_tf32(a3)
    b0h, b0l = split_tf32(b0)
    b1h, b1l = split_tf32(b1)
    c0, c1, c2, c3 = mma_tf32(a0l, a1l, a2l, a3l, b0h, b1h, c0, c1, c2, c3)
    c0, c1, c2, c3 = mma_tf32(a0h, a1h, a2h, a3h, b0l, b1l, c0, c1, c2, c3)
    return mma_tf32(a0h, a1h, a2h, a3h, b0h, b1h, c0, c1, c2, c3)


def make_tf32x3_kernel(head_dim: int, has_left: bool, has_right: bool, has_sinks: bool,
                       has_softcap: bool, write_lse: bool):
    """Build the 3xTF32 forward kernel for one configuration (module docstring): q, k, v, out
    float32 (B, S, H, D) any strides; lse float32 (B, Hq, Sq) when ``write_lse``."""
    D = int(head_dim)
    if not tf32x3_supported(D):
        raise ValueError(f"head_dim must be 32, 64 or 96 for the 3xTF32 kernel, got {D}")
    KS, ND = D // 8, D // 8              # k-steps of Q K^T; n-tiles of the output
    BN = TF32_BLOCK_N
    BM, NT = tf32x3_geometry(D)
    WARPS = NT // 32
    Q_SMEM = D >= 64                     # Q in shared memory (else its fragments in registers)
    NS, KP = BN // 8, BN // 8            # n-tiles of S; k-steps of P V
    DP = D + _PAD
    CPR = D // 4                         # 16-byte copies per K / V row
    COPIES = BN * CPR // NT
    QN = 1 if Q_SMEM else 4 * KS          # registers per lane: Q fragments, S, O
    SN, ON = 4 * NS, 4 * ND
    QROWS = BM if Q_SMEM else 1
    f32 = types.float32
    GROUP_KEYS = group_keys(8 * D, has_right)     # the grid's order (schedule.py)
    NEG_INF = -math.inf
    ZERO = np.float32(0.0)

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
            ks = cuda.shared.array((BN, DP), f32)
            vs = cuda.shared.array((BN, DP), f32)
        else:
            ks = cuda.shared.array((BN, DP), f32, alignment=16)
            vs = cuda.shared.array((BN, DP), f32, alignment=16)
        ps = cuda.shared.array((WARPS, 16, BN), f32)
        qs = cuda.shared.array((QROWS, DP), f32)
        qf = cuda.local.array(QN, f32)
        s = cuda.local.array(SN, f32)
        o = cuda.local.array(ON, f32)
        row0 = qtile * BM + warp * 16 + g
        shift = seqlen_k - seqlen_q
        if Q_SMEM:      # visible to every warp after the key loop's first barrier
            store_q_rows(qs, q, b, h, qtile * BM, seqlen_q, tid, NT, BM, D, ZERO)
        else:
            for kk in range(KS):
                for i in range(4):           # a0..a3: rows g, g + 8; columns t, t + 4
                    r = row0 + 8 * (i & 1)
                    qf[4 * kk + i] = (q[b, r, h, kk * 8 + t + 4 * (i >> 1)] if r < seqlen_q
                                      else ZERO)
        for e in range(ON):
            o[e] = ZERO
        m0 = m1 = np.float32(NEG_INF)
        l0 = l1 = ZERO
        q_lo = qtile * BM + shift
        q_hi = min(qtile * BM + BM, seqlen_q) - 1 + shift
        tile_lo, tile_hi, tile, last, sink_tiles = key_tiles(
            q_lo, q_hi, seqlen_k, BN, has_left, has_right, has_sinks, window_left, window_right,
            sinks)
        tile = past_sinks(tile, tile_lo, sink_tiles, has_sinks)
        while tile <= last:
            k0 = tile * BN
            load_kv_tile(ks, vs, k, v, b, hk, k0, seqlen_k, tid, NT, COPIES, CPR, 4)
            for e in range(SN):
                s[e] = ZERO
            for kk in range(KS):             # S = Q K^T, each k-step's product from zero
                if Q_SMEM:
                    r = warp * 16 + g
                    c = kk * 8 + t
                    a0, a1, a2, a3 = qs[r, c], qs[r + 8, c], qs[r, c + 4], qs[r + 8, c + 4]
                else:
                    a0, a1, a2, a3 = qf[4 * kk], qf[4 * kk + 1], qf[4 * kk + 2], qf[4 * kk + 3]
                for n in range(NS):
                    d0, d1, d2, d3 = mma3(a0, a1, a2, a3, ks[n * 8 + g, kk * 8 + t],
                                          ks[n * 8 + g, kk * 8 + t + 4], ZERO, ZERO, ZERO, ZERO)
                    s[4 * n] += d0
                    s[4 * n + 1] += d1
                    s[4 * n + 2] += d2
                    s[4 * n + 3] += d3
            mx0 = mx1 = np.float32(NEG_INF)
            for n in range(NS):              # scale, softcap, mask; each row's max
                for e in range(4):
                    x = masked_score(s[4 * n + e], k0 + n * 8 + 2 * t + (e & 1),
                                     row0 + 8 * (e >> 1) + shift, seqlen_k, scale, cap_in,
                                     cap_out, has_softcap, has_left, has_right, has_sinks,
                                     window_left, window_right, sinks, np.float32(NEG_INF))
                    s[4 * n + e] = x
                    if e < 2:
                        mx0 = max(mx0, x)
                    else:
                        mx1 = max(mx1, x)
            mx0 = max(mx0, shfl_xor(mx0, 1))
            mx0 = max(mx0, shfl_xor(mx0, 2))
            mx1 = max(mx1, shfl_xor(mx1, 1))
            mx1 = max(mx1, shfl_xor(mx1, 2))
            n0, n1 = max(m0, mx0), max(m1, mx1)
            mu0 = n0 if n0 != NEG_INF else ZERO
            mu1 = n1 if n1 != NEG_INF else ZERO
            alpha0, alpha1 = math.exp(m0 - mu0), math.exp(m1 - mu1)
            m0, m1 = n0, n1
            rs0 = rs1 = ZERO
            for n in range(NS):              # P, staged for the A fragments of P V
                for e in range(4):
                    p = math.exp(s[4 * n + e] - (mu0 if e < 2 else mu1))
                    if e < 2:
                        rs0 += p
                    else:
                        rs1 += p
                    ps[warp, g + 8 * (e >> 1), n * 8 + 2 * t + (e & 1)] = p
            rs0 += shfl_xor(rs0, 1)
            rs0 += shfl_xor(rs0, 2)
            rs1 += shfl_xor(rs1, 1)
            rs1 += shfl_xor(rs1, 2)
            l0 = l0 * alpha0 + rs0
            l1 = l1 * alpha1 + rs1
            syncwarp()
            for n in range(ND):              # O = alpha O + P V, the tile's P V from zero
                d0 = d1 = d2 = d3 = ZERO
                for kk in range(KP):
                    d0, d1, d2, d3 = mma3(
                        ps[warp, g, kk * 8 + t], ps[warp, g + 8, kk * 8 + t],
                        ps[warp, g, kk * 8 + t + 4], ps[warp, g + 8, kk * 8 + t + 4],
                        vs[kk * 8 + t, n * 8 + g], vs[kk * 8 + t + 4, n * 8 + g], d0, d1, d2, d3)
                o[4 * n] = o[4 * n] * alpha0 + d0
                o[4 * n + 1] = o[4 * n + 1] * alpha0 + d1
                o[4 * n + 2] = o[4 * n + 2] * alpha1 + d2
                o[4 * n + 3] = o[4 * n + 3] * alpha1 + d3
            syncwarp()
            tile = past_sinks(tile + 1, tile_lo, sink_tiles, has_sinks)
        for half in range(2):
            row = row0 + 8 * half
            l = l0 if half == 0 else l1
            if row < seqlen_q:
                inv = np.float32(1.0) / l if l != 0 else ZERO
                for n in range(ND):
                    out[b, row, h, n * 8 + 2 * t] = o[4 * n + 2 * half] * inv
                    out[b, row, h, n * 8 + 2 * t + 1] = o[4 * n + 2 * half + 1] * inv
                if write_lse and t == 0:
                    mrow = m0 if half == 0 else m1
                    lse[b, h, row] = mrow + math.log(l) if l != 0 else np.float32(NEG_INF)

    return jit_kernel(kernel, ("tf32x3", D, bool(has_left), bool(has_right), bool(has_sinks),
                               bool(has_softcap), bool(write_lse)))
