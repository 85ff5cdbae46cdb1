"""Tiled FlashAttention-2 forward in float32 on the TF32 tensor cores with error compensation
(3xTF32, as in CUTLASS): every product ``a b`` is ``a_hi b_hi + a_hi b_lo + a_lo b_hi`` with
``a = a_hi + a_lo`` split into a TF32 number and its remainder (primitives/mma_exact.py
``split_tf32_fast``) and fp32 accumulation, which keeps float32-level accuracy at tensor-core
rate. Flags only (causal, window, sinks, softcap) and GQA; mask objects, packed batches, ALiBi
and score_mod stay on the CUDA-core kernel.

Tiling (``tf32x3_geometry``). A warp owns 16 query rows (one ``m16n8k8`` m-tile), a block 4
warps (8 beyond head_dim 64, so that one block's 176 KB of shared memory keeps 8 warps per
multiprocessor); key tiles of ``BN`` = 32 keys (64 spilled: 255 registers), 16 at head_dim 128
(``tf32x3_block_n``: 32 spilled there; 178 KB of shared memory). K and V tiles land
by cp.async in one landing buffer of dynamic shared memory; per tile the block splits the landed
tile once into hi / lo tiles (one pass of 16-byte loads and stores, a barrier), then starts the
next tile's copy, which runs during this one's products: two barriers per tile (the tile landed
and the last one's products done; the split tiles written). Q is split once per block into
per-lane fragment slots of shared memory (``store_q_split``: a lane's a0..a3 of one k-step in
16 bytes, hi and lo; only the lane reads them, so no barrier; in registers they cost 176
registers at head_dim 32 and spilled at 64). A tile the warp sees whole (``tile_is_full``)
skips the per-pair mask.

Fragments. ``m16n8k8`` TF32 (lane (g, t) = (lane >> 2, lane & 3)): A ``a0 = A[g, t]``,
``a1 = A[g + 8, t]``, ``a2 = A[g, t + 4]``, ``a3 = A[g + 8, t + 4]``; B ``b0 = B[t, g]``,
``b1 = B[t + 4, g]``; C / D rows g, g + 8, columns 2t, 2t + 1. A dot product does not care
about the order of its terms, so each product runs over its reduction index in the order that
makes a lane's operands adjacent in shared memory:

* S = Q K^T: k-step ``2j + h`` takes head-dim columns ``16j + 4t + 2h`` (A column t) and
  ``16j + 4t + 2h + 1`` (A column t + 4), for Q and K alike; so one 16-byte load of K's row
  ``n*8 + g`` at column ``16j + 4t`` is the B fragments of k-steps 2j and 2j + 1 (and Q's rows
  g, g + 8 likewise).
* O = P V: P comes straight from the score accumulator (no shared staging). The accumulator of
  8-key n-tile kp holds ``P[g, 2t], P[g, 2t + 1], P[g + 8, 2t], P[g + 8, 2t + 1]`` (c0..c3);
  k-step kp of P V maps A column t to key ``kp*8 + 2t`` and column t + 4 to key
  ``kp*8 + 2t + 1``, so ``a0, a1, a2, a3 = c0, c2, c1, c3`` and V's B fragment is rows
  ``kp*8 + 2t``, ``kp*8 + 2t + 1`` at column ``n*8 + g``. The split V tile stores each pair of
  keys as one row of ``(hi, lo)`` pairs: row ``r`` column ``4c + 2e + w`` holds part w (hi, lo)
  of ``V[2r + e, c]``, so one 16-byte load is ``b0_hi, b0_lo, b1_hi, b1_lo``.

Bank conflicts (4-byte words, 32 banks; a 16-byte load is served 8 lanes at a time, lanes
(g, t) with g = 2p, 2p + 1). K hi / lo rows are padded to ``D + 16`` words: lane (g, t) reads
words ``g (D + 16) + 4t + const``, and (D + 16) = 16 mod 32 for D a multiple of 32, so rows g
and g + 1 fill the two halves of the 32 banks. Split V rows (a pair of keys) are ``4 D + 8``
words: lane (g, t) reads ``t (4 D + 8) + 4g + const``, i.e. 4-word groups ``2t + g`` (mod 8),
distinct over the 8 lanes. Q's slots are consecutive per lane (conflict-free). The landing
tiles are unpadded (the split pass reads them along rows); the split pass's V stores (16 bytes
at a 64-byte stride) conflict 4-way, once per element and tile.

Split (``split_tf32_fast``): ``hi`` rounded to nearest TF32 by two integer operations on the
bits, ``lo = x - hi`` exact and unrounded (the tensor core truncates it to TF32: hi + trunc(lo)
keeps ~22 bits). Each operand is split once: Q per block, K and V per tile by the block (each
element once, where splitting B fragments in every warp would split it once per warp), P per
tile in registers.

Accumulation order. The tensor cores round each D = A B + C toward zero (primitives/mma_exact.py),
so an mma into a long-lived accumulator adds an error of up to one ulp of that accumulator,
always toward zero (H100, S and O each accumulated in place: 13x the IEEE kernel's error at
N = 2048). So the large products start from small accumulators: S's hi x hi product of each
k-step from zero (one truncation of an 8-term partial sum, whose sign varies), added to S in
IEEE float32; S's cross terms (``hi lo``, ``lo hi``, ~2^-11 of S) chain in one accumulator over
the tile's k-steps, added at the end. P V per tile: the tile's cross terms chain from zero, then
its hi x hi products chain on top (one truncation per 8 keys, at the size of the tile's P V),
and ``o = alpha o + (P V)`` in IEEE float32.

Kernel signature: the CUDA-core kernel's (forward_fma.make_fma_kernel); the mask / varlen /
ALiBi arguments are never read. Grid (ceil(Sq / rows per block), B * Hq), ``tf32x3_smem_bytes``
bytes of dynamic shared memory.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda
from numba.cuda import types

from ..primitives import cp_async_wait_all, lds16, mma_tf32, shared_view, split_tf32_fast
from ..primitives.base import inlined
from .forward_dmma import store_rows
from .jitcache import jit_kernel
from .masking import key_tiles, past_sinks
from .schedule import group_keys, query_tile_of_block
from .tile_ops import copy_kv_tile, exponentiate_rows, masked_score

__all__ = ["make_tf32x3_kernel", "tf32x3_supported", "tf32x3_geometry", "tf32x3_smem_bytes",
           "tf32x3_block_n", "TF32_BLOCK_N"]

TF32_BLOCK_N = 32
TF32_WARPS = 4
_PAD_K = 16                     # words of padding per K / Q hi-lo row (module docstring)
_PAD_V = 8                      # words of padding per split-V row (a pair of keys)
NEG_INF = np.float32(-math.inf)
ZERO = np.float32(0.0)


def tf32x3_supported(head_dim: int) -> bool:
    """Head dims of the 3xTF32 kernel: 32, 64, 96, 128 (offline sm_90, 16 flag combinations:
    132-180 / 173-176 / 172-177 registers at 32 / 64 / 96, 170-171 at 128 with 16-key tiles;
    no local memory)."""
    return head_dim in (32, 64, 96, 128)


def tf32x3_block_n(head_dim: int) -> int:
    """Keys per tile: 32, or 16 at head_dim 128, where the 32-key build took 255 registers and
    spilled 92-108 bytes (offline sm_90) and the 16-key build takes 170-171 and none."""
    return 16 if head_dim > 96 else TF32_BLOCK_N


def _warps(head_dim: int) -> int:
    """Warps per block: 4, 8 beyond head_dim 64 (there a 4-warp block's 127 KB of shared memory
    would leave one block, 4 warps, per multiprocessor; 8 warps share one split K / V tile)."""
    return 8 if head_dim > 64 else TF32_WARPS


def tf32x3_geometry(head_dim: int) -> tuple[int, int]:
    """(query rows per block, threads per block): warps of 16 rows (``_warps``)."""
    return 16 * _warps(head_dim), 32 * _warps(head_dim)


def _smem_words(head_dim: int, block_n: int):
    """Word offsets of the shared tiles: Q hi, Q lo, K hi, K lo, split V, landing K, landing V,
    and the total."""
    rows = 16 * _warps(head_dim)
    dk = head_dim + _PAD_K
    q = rows * head_dim
    k = block_n * dk
    vs = (block_n // 2) * (4 * head_dim + _PAD_V)
    land = block_n * head_dim
    offs, at = [], 0
    for size in (q, q, k, k, vs, land, land):
        offs.append(at)
        at += size
    return offs + [at]


def tf32x3_smem_bytes(head_dim: int, block_n: int | None = None) -> int:
    """Dynamic shared memory of the 3xTF32 kernel at ``head_dim`` (``block_n`` keys per tile,
    default ``tf32x3_block_n``): Q's hi / lo fragments, K hi / lo, the split V tile and the
    landing K / V tiles (head_dim 128: 178 KB)."""
    return 4 * _smem_words(head_dim, block_n or tf32x3_block_n(head_dim))[-1]


@inlined
def mma3(ah0, ah1, ah2, ah3, al0, al1, al2, al3, bh0, bh1, bl0, bl1, c0, c1, c2, c3):
    """The two cross terms of a 3xTF32 product into ``c``: ``c + a_lo b_hi + a_hi b_lo``."""
    c0, c1, c2, c3 = mma_tf32(al0, al1, al2, al3, bh0, bh1, c0, c1, c2, c3)
    return mma_tf32(ah0, ah1, ah2, ah3, bl0, bl1, c0, c1, c2, c3)


@inlined
def chunk_of(c, tid, threads, per_row):
    """Row and first column of the ``c``-th 16-byte chunk (of ``per_row`` per row) a thread
    splits: chunk ``c threads + tid``; a fixed column and rows ``threads / per_row`` apart when
    ``per_row`` divides ``threads`` (then the offsets of the chunks are constants)."""
    if threads % per_row == 0:
        return tid // per_row + c * (threads // per_row), (tid % per_row) * 4
    i = c * threads + tid
    r = i // per_row
    return r, (i - r * per_row) * 4


@inlined
def split_tile(kh, kl, vsp, lk, lv, tid, threads, block_n, head_dim):
    """The landed tiles ``lk`` / ``lv`` split into K hi / lo (``kh``, ``kl``) and the
    pair-of-keys V tile ``vsp`` (module docstring), 16 bytes per load and store."""
    cpr = head_dim // 4
    for c in range(block_n * cpr // threads):
        r, col = chunk_of(c, tid, threads, cpr)
        x0, x1, x2, x3 = lds16(lk, r, col, 0)
        h0, e0 = split_tf32_fast(x0)
        h1, e1 = split_tf32_fast(x1)
        h2, e2 = split_tf32_fast(x2)
        h3, e3 = split_tf32_fast(x3)
        kh[r, col], kh[r, col + 1], kh[r, col + 2], kh[r, col + 3] = h0, h1, h2, h3
        kl[r, col], kl[r, col + 1], kl[r, col + 2], kl[r, col + 3] = e0, e1, e2, e3
    for c in range(((block_n // 2) * cpr + threads - 1) // threads):
        r, col = chunk_of(c, tid, threads, cpr)
        if (block_n // 2) * cpr % threads and r >= block_n // 2:
            break                       # (a last, partial round of chunks: head_dim 96)
        x0, x1, x2, x3 = lds16(lv, 2 * r, col, 0)
        y0, y1, y2, y3 = lds16(lv, 2 * r + 1, col, 0)
        w = 4 * col
        store_pair_split(vsp, r, w, x0, y0)
        store_pair_split(vsp, r, w + 4, x1, y1)
        store_pair_split(vsp, r, w + 8, x2, y2)
        store_pair_split(vsp, r, w + 12, x3, y3)


@inlined
def store_pair_split(vsp, r, w, x, y):
    """One head-dim column of two keys (``x``, ``y``) into the pair-of-keys V tile: words
    ``w .. w + 3`` of row ``r`` = x hi, y hi, x lo, y lo."""
    xh, xl = split_tf32_fast(x)
    yh, yl = split_tf32_fast(y)
    vsp[r, w], vsp[r, w + 1], vsp[r, w + 2], vsp[r, w + 3] = xh, yh, xl, yl


@inlined
def store_q_split(qb, q, b, h, row0, seqlen_q, t, qa, q_step, q_lo, k_steps):
    """A lane's Q A fragments, split, into its own 16-byte slots of the flat shared ``qb``:
    k-step kk's ``a0..a3`` hi at word ``qa + q_step kk``, lo ``q_lo`` words on; ``a_i`` is row
    ``row0 + 8 (i & 1)``, head-dim column ``16 (kk >> 1) + 4t + 2 (kk & 1) + (i >> 1)`` (the
    order of the module docstring), zero past ``seqlen_q``. Only the lane reads them back: no
    barrier."""
    for kk in range(k_steps):
        w = qa + q_step * kk
        for i in range(4):
            r = row0 + 8 * (i & 1)
            c = 16 * (kk >> 1) + 4 * t + 2 * (kk & 1) + (i >> 1)
            x = q[b, r, h, c] if r < seqlen_q else ZERO
            qb[0, w + i], qb[0, q_lo + w + i] = split_tf32_fast(x)


@inlined
def scores(s, x, qb, kb, qa, ka, k_lo, q_step, q_lo, k_row, k_pairs, n_tiles):
    """S = Q K^T for the split tile in the flat ``kb`` (hi, then lo at ``k_lo`` words; a lane's
    row ``g`` and column ``4t`` at word ``ka``; Q's fragments in the lane's slots of ``qb`` from
    word ``qa``, ``q_step`` words per k-step, lo at ``q_lo`` words on: ``store_q_split``):
    ``s[4n .. 4n + 3]`` the scores of 8-key n-tile n (each k-step's hi x hi from zero, added in
    float32; the cross terms chained in ``x``, added at the end)."""
    for e in range(4 * n_tiles):
        x[e] = ZERO
    for j in range(k_pairs):
        c = 64 * j                                      # bytes: column 16 j
        w = 8 * q_step * j                              # a0..a3 of k-steps 2j, 2j + 1
        h00, h20, h01, h21 = lds16(qb, 0, qa, w)
        h10, h30, h11, h31 = lds16(qb, 0, qa, w + 4 * q_step)
        l00, l20, l01, l21 = lds16(qb, 0, qa, w + 4 * q_lo)
        l10, l30, l11, l31 = lds16(qb, 0, qa, w + 4 * q_step + 4 * q_lo)
        for n in range(n_tiles):
            off = c + 32 * n * k_row                    # key n*8 + g
            b0, b1, b2, b3 = lds16(kb, 0, ka, off)      # b0, b1 of k-steps 2j and 2j + 1
            e0, e1, e2, e3 = lds16(kb, 0, ka, off + 4 * k_lo)
            i = 4 * n
            x[i], x[i + 1], x[i + 2], x[i + 3] = mma3(
                h00, h20, h01, h21, l00, l20, l01, l21, b0, b1, e0, e1,
                x[i], x[i + 1], x[i + 2], x[i + 3])
            x[i], x[i + 1], x[i + 2], x[i + 3] = mma3(
                h10, h30, h11, h31, l10, l30, l11, l31, b2, b3, e2, e3,
                x[i], x[i + 1], x[i + 2], x[i + 3])
            d0, d1, d2, d3 = mma_tf32(h00, h20, h01, h21, b0, b1, ZERO, ZERO, ZERO, ZERO)
            if j == 0:
                s[i], s[i + 1], s[i + 2], s[i + 3] = d0, d1, d2, d3
            else:
                s[i] += d0
                s[i + 1] += d1
                s[i + 2] += d2
                s[i + 3] += d3
            d0, d1, d2, d3 = mma_tf32(h10, h30, h11, h31, b2, b3, ZERO, ZERO, ZERO, ZERO)
            s[i] += d0
            s[i + 1] += d1
            s[i + 2] += d2
            s[i + 3] += d3
    for e in range(4 * n_tiles):
        s[e] += x[e]


@inlined
def softmax_step(s, m0, m1, l0, l1, k0, qpos0, t, seqlen_k, scale, cap_in, cap_out,
                 window_left, window_right, sinks, has_softcap, has_left, has_right, has_sinks,
                 n_tiles, full):
    """The online softmax of one tile of scores ``s`` (keys from ``k0``; a lane's rows at query
    positions ``qpos0``, ``qpos0 + 8``), in float32: P in place of S; returns the rows' new
    max and sum and the old state's factors ``(m0, m1, l0, l1, alpha0, alpha1)``. ``full``:
    the warp sees every pair of the tile (``tile_is_full``), so no pair is masked."""
    mx0 = mx1 = NEG_INF
    for n in range(n_tiles):
        for e in range(4):
            if full:
                v = s[4 * n + e]
                v = cap_out * math.tanh(cap_in * v) if has_softcap else scale * v
            else:
                v = masked_score(s[4 * n + e], k0 + n * 8 + 2 * t + (e & 1),
                                 qpos0 + 8 * (e >> 1), seqlen_k, scale, cap_in, cap_out,
                                 has_softcap, has_left, has_right, has_sinks, window_left,
                                 window_right, sinks, NEG_INF)
            s[4 * n + e] = v
            if e < 2:
                mx0 = max(mx0, v)
            else:
                mx1 = max(mx1, v)
    n0, n1, alpha0, alpha1, rs0, rs1 = exponentiate_rows(s, m0, m1, mx0, mx1, n_tiles, ZERO)
    return n0, n1, l0 * alpha0 + rs0, l1 * alpha1 + rs1, alpha0, alpha1


@inlined
def tile_is_full(k0, block_n, q_first, q_last, seqlen_k, window_left, window_right, has_left,
                 has_right):
    """Whether query positions ``q_first .. q_last`` see every key of the tile from ``k0``:
    inside the sequence and the window (sinks only add pairs)."""
    full = k0 + block_n <= seqlen_k
    if has_right:
        full = full and k0 + block_n - 1 <= q_first + window_right
    if has_left:
        full = full and k0 >= q_last - window_left
    return full


@inlined
def add_pv(o, s, ph, pl, vsp, va, alpha0, alpha1, v_row, k_steps, d_tiles):
    """O = alpha O + P V for P in the score accumulator ``s`` (keys in the order of the module
    docstring), split into ``ph`` / ``pl``; V split in the flat ``vsp`` (a lane's pair row t,
    column 4g at word ``va``): per head-dim n-tile, the tile's cross terms chain from zero, its
    hi x hi products on top, added in float32."""
    for e in range(4 * k_steps):
        ph[e], pl[e] = split_tf32_fast(s[e])
    for n in range(d_tiles):
        d0 = d1 = d2 = d3 = ZERO
        for kp in range(k_steps):
            i = 4 * kp
            bh0, bh1, bl0, bl1 = lds16(vsp, 0, va, 16 * (kp * v_row + 8 * n))
            d0, d1, d2, d3 = mma3(ph[i], ph[i + 2], ph[i + 1], ph[i + 3],
                                  pl[i], pl[i + 2], pl[i + 1], pl[i + 3],
                                  bh0, bh1, bl0, bl1, d0, d1, d2, d3)
        for kp in range(k_steps):
            i = 4 * kp
            bh0, bh1, bl0, bl1 = lds16(vsp, 0, va, 16 * (kp * v_row + 8 * n))
            d0, d1, d2, d3 = mma_tf32(ph[i], ph[i + 2], ph[i + 1], ph[i + 3], bh0, bh1,
                                      d0, d1, d2, d3)
        o[4 * n] = o[4 * n] * alpha0 + d0
        o[4 * n + 1] = o[4 * n + 1] * alpha0 + d1
        o[4 * n + 2] = o[4 * n + 2] * alpha1 + d2
        o[4 * n + 3] = o[4 * n + 3] * alpha1 + d3


def make_tf32x3_kernel(head_dim: int, has_left: bool, has_right: bool, has_sinks: bool,
                       has_softcap: bool, write_lse: bool, block_n: int | None = None):
    """Build the 3xTF32 forward kernel for one configuration (module docstring): q, k, v, out
    float32 (B, S, H, D) any strides (K / V rows 16-byte aligned); lse float32 (B, Hq, Sq) when
    ``write_lse``. ``block_n``: keys per tile (default ``tf32x3_block_n``); launched with
    ``tf32x3_geometry`` and ``tf32x3_smem_bytes``."""
    D = int(head_dim)
    if not tf32x3_supported(D):
        raise ValueError(f"head_dim must be 32, 64, 96 or 128 for the 3xTF32 kernel, got {D}")
    BN = int(block_n or tf32x3_block_n(D))
    BM, NT = tf32x3_geometry(D)
    if BN % 16 or (BN * D // 4) % NT:
        raise ValueError(f"block_n {BN} is not one the kernel takes (a multiple of 16 whose "
                         f"K / V copies divide over the threads)")
    KPAIRS, ND = D // 16, D // 8         # k-step pairs of Q K^T; n-tiles of the output
    NS = BN // 8                         # n-tiles of S = k-steps of P V
    DK, DV = D + _PAD_K, 4 * D + _PAD_V
    _, _, OKH, _, OVS, OLK, OLV, _ = _smem_words(D, BN)
    CPR = D // 4                         # 16-byte copies per K / V row
    COPIES = BN * CPR // NT
    SN, ON = 4 * NS, 4 * ND              # registers per lane: S (and P), O
    f32 = types.float32
    GROUP_KEYS = group_keys(8 * D, has_right)     # the grid's order (schedule.py)

    def kernel(q, k, v, out, lse, seqlen_q, seqlen_k, heads_ratio, scale, cap_in, cap_out,
               window_left, window_right, sinks, mk_iv, mk_mm, mk_tab, mk_bits, cu_q, cu_k, alibi):
        qtile, _, row = query_tile_of_block(seqlen_k, heads_ratio, GROUP_KEYS)
        b = row // q.shape[2]
        h = row % q.shape[2]
        hk = h // heads_ratio
        tid = cuda.threadIdx.x
        warp, lane = tid >> 5, tid & 31
        g, t = lane >> 2, lane & 3
        dyn = cuda.shared.array(0, f32)
        # flat (one-row) views: a lane's loads are its base word plus constant byte offsets
        qb = shared_view(dyn, 0, 1, 2 * BM * D)         # Q hi, lo
        kb = shared_view(dyn, OKH, 1, 2 * BN * DK)      # K hi, lo
        vsp = shared_view(dyn, OVS, 1, BN // 2 * DV)
        kh2 = shared_view(dyn, OKH, BN, DK)             # the same tiles as rows (split pass)
        kl2 = shared_view(dyn, OKH + BN * DK, BN, DK)
        vsp2 = shared_view(dyn, OVS, BN // 2, DV)
        lk = shared_view(dyn, OLK, BN, D)
        lv = shared_view(dyn, OLV, BN, D)
        s = cuda.local.array(SN, f32)
        x = cuda.local.array(SN, f32)
        ph = cuda.local.array(SN, f32)
        pl = cuda.local.array(SN, f32)
        o = cuda.local.array(ON, f32)
        row0 = qtile * BM + warp * 16 + g
        shift = seqlen_k - seqlen_q
        store_q_split(qb, q, b, h, row0, seqlen_q, t, 4 * tid, 4 * NT, NT * D // 2, D // 8)
        for e in range(ON):
            o[e] = ZERO
        m0 = m1 = NEG_INF
        l0 = l1 = ZERO
        q_lo = qtile * BM + shift
        w_first = qtile * BM + warp * 16 + shift        # the warp's query positions
        w_last = min(w_first + 15, seqlen_q - 1 + shift)
        q_hi = min(qtile * BM + BM, seqlen_q) - 1 + shift
        tile_lo, tile_hi, tile, last, sink_tiles = key_tiles(
            q_lo, q_hi, seqlen_k, BN, has_left, has_right, has_sinks, window_left, window_right,
            sinks)
        tile = past_sinks(tile, tile_lo, sink_tiles, has_sinks)
        if tile <= last:
            copy_kv_tile(lk, lv, k, v, b, hk, tile * BN, seqlen_k, tid, NT, COPIES, CPR, 4)
        while tile <= last:
            k0 = tile * BN
            nxt = past_sinks(tile + 1, tile_lo, sink_tiles, has_sinks)
            cp_async_wait_all()
            cuda.syncthreads()           # the tile landed; every warp is done with the last one
            split_tile(kh2, kl2, vsp2, lk, lv, tid, NT, BN, D)
            cuda.syncthreads()           # split tiles complete; the landing tiles free
            if nxt <= last:
                copy_kv_tile(lk, lv, k, v, b, hk, nxt * BN, seqlen_k, tid, NT, COPIES, CPR, 4)
            scores(s, x, qb, kb, 4 * tid, g * DK + 4 * t, BN * DK, 4 * NT, NT * D // 2, DK,
                   KPAIRS, NS)
            m0, m1, l0, l1, alpha0, alpha1 = softmax_step(
                s, m0, m1, l0, l1, k0, row0 + shift, t, seqlen_k, scale, cap_in, cap_out,
                window_left, window_right, sinks, has_softcap, has_left, has_right, has_sinks,
                NS, tile_is_full(k0, BN, w_first, w_last, seqlen_k, window_left, window_right,
                                 has_left, has_right))
            add_pv(o, s, ph, pl, vsp, t * DV + 4 * g, alpha0, alpha1, DV, NS, ND)
            tile = nxt
        store_rows(out, lse, o, m0, m1, l0, l1, b, 0, h, row0, seqlen_q, t, write_lse, ND)

    return jit_kernel(kernel, ("tf32x3", D, bool(has_left), bool(has_right), bool(has_sinks),
                               bool(has_softcap), bool(write_lse), BN))
