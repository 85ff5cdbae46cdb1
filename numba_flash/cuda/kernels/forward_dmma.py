"""Tiled FlashAttention-2 forward in float64 on the DMMA tensor cores: the same products as the
CUDA-core kernel (every multiply-add in IEEE float64), at tensor-core rate. Flags only (causal,
window, sinks, softcap) and GQA; mask objects, packed batches, ALiBi and score_mod stay on the
CUDA-core kernel.

Products: ``mma.sync.m16n8k16`` float64 (primitives/mma_exact.py ``mma_f64_k16``: one
DMMA.16x8x16 on sm_90, whose float64 tensor cores run at twice an A100's rate per clock only
through the shapes sm_90 added), or the same product as eight m8n8k4 DMMAs before sm_90
(``native=False``).

A warp owns 16 query rows (one m-tile), a block ``geo.warps`` warps (``dmma_geometry``). Q's A
fragments (``a[2j + h] = Q[g + 8h, kk*16 + t + 4j]``) sit in registers up to head_dim 32 and in
shared memory beyond; K and V tiles of ``BN`` keys go to dynamic shared memory by cp.async (with
two stages the next tile's copy runs during this one's products). Each thread copies 16-byte
chunks of one key row per pass (``copy_kv_rows``: 32-bit shared addresses, byte offsets from
the arrays' strides), so the key loop keeps two 64-bit source offsets for the copies and no
per-copy index arithmetic. Per tile: S = Q K^T (B fragment ``K[n*8 + g, kk*16 + t +
4j]``), the online softmax on the accumulator fragment (lane (g, t): rows g and g + 8, keys
2t, 2t + 1 of each 8-key n-tile; a row's 4 lanes combine by shuffles), then O = alpha O + P V
straight from the registers, P = exp(S - max) computed for the whole tile first or for each
16-key k-step just before its products (``dmma_exp_ahead``: the faster order where it does
not spill): the A
fragment of a 16-key k-step wants keys t + 4j of a lane's rows, the accumulator holds keys
2t, 2t + 1, 2t + 8, 2t + 9, so P V runs over the keys in the order ``pi(t + 4j) = 2t, 2t + 1,
2t + 8, 2t + 9`` and V's B fragment reads rows ``pi(t + 4j)`` (a sum over keys does not care
about their order; no shared staging of P).

Shared rows are padded so that the fragment loads of a half-warp (8-byte words: 16 lanes per
pass) touch distinct banks: K and Q by 4 doubles (rows g, columns t: word 2(g (D + 4) + t) =
8g + 2t mod 32), V by 2 (rows 2t, columns g: 2(2t (D + 2) + g) = 8t + 2g mod 32).

Kernel signature: the CUDA-core kernel's (forward_fma.make_fma_kernel), so one launch plan
shape serves both; the mask and ALiBi arguments are never read, ``cu_q`` / ``cu_k`` only by
the packed-batch build (``varlen``). Grid (ceil(Sq / BM),
B * Hq), ``32 geo.warps`` threads per block, ``dmma_smem_bytes`` bytes of dynamic shared
memory.
"""
from __future__ import annotations

import math
from typing import NamedTuple

from numba import cuda
from numba.cuda import types

from ..primitives import (cp_async16_flat, cp_async_commit, cp_async_wait_all, mma_f64_k16,
                          mma_f64_k16_884, shared_view)
from ..primitives.base import inlined
from .jitcache import jit_kernel
from .masking import key_tiles, past_sinks
from .sequences import clear_unowned_rows, packed_sequence
from .schedule import group_keys, query_tile_of_block
from .tile_ops import exp_scores, masked_score, row_maxima, row_sum, store_q_rows

__all__ = ["make_dmma_kernel", "dmma_supported", "dmma_geometry", "dmma_smem_bytes",
           "dmma_exp_ahead", "DmmaGeometry"]

DMMA_WARPS = 4
_PAD_K, _PAD_V = 4, 2               # doubles of padding per shared row (module docstring)
NEG_INF = -math.inf


class DmmaGeometry(NamedTuple):
    """A DMMA kernel's tiling: keys per tile, whether Q sits in shared memory, warps per block
    (16 query rows each), K / V stages (2: the next tile's copy runs during this one's
    products)."""
    block_n: int
    q_smem: bool
    warps: int = DMMA_WARPS
    stages: int = 1


def dmma_supported(head_dim: int) -> bool:
    """Head dims of the DMMA kernel: a lane's output accumulator (head_dim / 2 doubles) fits
    the registers up to 128."""
    return head_dim in (32, 64, 96, 128)


def dmma_geometry(head_dim: int, hopper: bool = True) -> DmmaGeometry:
    """The tiling at ``head_dim``. ``hopper`` (compute capability 9.0: 227 KB of shared memory
    per block): from the H200 sweep of 2026-11-28 (scripts/experiments/dmma_geometry_probe.py,
    docs/perf-notes.md), 32-key tiles in two stages up to 64 (Q's fragments in registers only at
    32: at 64 they spill), 16-key tiles beyond; 8 warps at 128, where 4 warps' ptxas allocation
    spilled (the same two blocks' worth of warps per multiprocessor, by registers). Otherwise
    16-key tiles, one stage, 2 warps: at most 67 KB, within every sm_80+ GPU's 99 KB."""
    if not hopper:
        return DmmaGeometry(16, head_dim > 32, 2, 1)
    if head_dim <= 64:
        return DmmaGeometry(32, head_dim > 32, 4, 2)
    return DmmaGeometry(16, True, 8 if head_dim == 128 else 4, 1)


def dmma_exp_ahead(head_dim: int, has_left: bool, has_sinks: bool) -> bool:
    """Whether a tile's P is exponentiated whole before P V (else per 16-key k-step, just
    before its products). H200 in-process A/B (2026-11-29, docs/perf-notes.md "DMMA on
    m16n8k16"): per k-step 2-3 % slower at head_dim 64 full / causal, 3 % faster at 32, equal at
    128; whole-tile exponentials at 64 with a left window or sinks hold 255 registers and spill
    (offline), so those builds keep the per-k-step order."""
    return head_dim == 64 and not (has_left or has_sinks)


def _smem_words(head_dim: int, geo: DmmaGeometry) -> tuple[int, int, int, int]:
    """Shared row lengths of Q / K and of V, Q's doubles (0 when Q sits in registers) and one
    K / V stage's doubles, for ``head_dim`` under ``geo``."""
    dk, dv = head_dim + _PAD_K, head_dim + _PAD_V
    return dk, dv, (16 * geo.warps * dk if geo.q_smem else 0), geo.block_n * (dk + dv)


def dmma_smem_bytes(head_dim: int, geo: DmmaGeometry | None = None) -> int:
    """Dynamic shared memory of the DMMA kernel at ``head_dim``: Q (when it sits there), then
    each stage's K and V tiles."""
    geo = geo or dmma_geometry(head_dim)
    _, _, q_words, stage_words = _smem_words(head_dim, geo)
    return 8 * (q_words + geo.stages * stage_words)


@inlined
def dmma(native, a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, c0, c1, c2, c3):
    """One m16n8k16 float64 product: the sm_90 instruction (``native``) or eight m8n8k4."""
    if native:
        return mma_f64_k16(a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, c0, c1, c2, c3)
    return mma_f64_k16_884(a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, c0, c1, c2, c3)


@inlined
def q_fragment(qf, qs, q_smem, kk, r, t):
    """A fragment of Q for k-step ``kk`` (the warp's rows ``r``, ``r + 8`` of ``qs``, or the
    registers ``qf``), as 8 doubles."""
    if q_smem:
        c = kk * 16 + t
        return (qs[r, c], qs[r + 8, c], qs[r, c + 4], qs[r + 8, c + 4],
                qs[r, c + 8], qs[r + 8, c + 8], qs[r, c + 12], qs[r + 8, c + 12])
    i = 8 * kk
    return qf[i], qf[i + 1], qf[i + 2], qf[i + 3], qf[i + 4], qf[i + 5], qf[i + 6], qf[i + 7]


@inlined
def scores(s, qf, qs, ks, q_smem, native, r, g, t, k_steps, n_tiles):
    """S = Q K^T for the tile in shared ``ks``: ``s[4n .. 4n + 3]`` the accumulator of 8-key
    n-tile ``n``."""
    for e in range(4 * n_tiles):
        s[e] = 0.0
    for kk in range(k_steps):
        a0, a1, a2, a3, a4, a5, a6, a7 = q_fragment(qf, qs, q_smem, kk, r, t)
        c = kk * 16 + t
        for n in range(n_tiles):
            key = n * 8 + g
            s[4 * n], s[4 * n + 1], s[4 * n + 2], s[4 * n + 3] = dmma(
                native, a0, a1, a2, a3, a4, a5, a6, a7, ks[key, c], ks[key, c + 4],
                ks[key, c + 8], ks[key, c + 12], s[4 * n], s[4 * n + 1], s[4 * n + 2],
                s[4 * n + 3])


@inlined
def add_pv(o, s, vs, mu0, mu1, exp_ahead, native, g, t, k_steps, n_tiles):
    """O += P V with P = exp(S - mu) (row maxima ``mu0`` / ``mu1``) in place of the scores in
    ``s`` (keys in the order pi of the module docstring); ``o[4n .. 4n + 3]`` the accumulator
    of head-dim n-tile ``n``. ``exp_ahead``: the whole tile's P first, else each 16-key k-step's
    just before its products (``dmma_exp_ahead``). Returns this lane's part of the rows' sums
    of P."""
    rs0 = rs1 = 0.0
    if exp_ahead:
        rs0, rs1 = exp_scores(s, mu0, mu1, 0, 8 * k_steps, rs0, rs1)
    for kp in range(k_steps):
        i, j = 8 * kp, 8 * kp + 4       # the 8-key n-tiles 2 kp, 2 kp + 1 of S
        if not exp_ahead:
            rs0, rs1 = exp_scores(s, mu0, mu1, i, i + 8, rs0, rs1)
        key = kp * 16 + 2 * t
        for n in range(n_tiles):
            col = n * 8 + g
            o[4 * n], o[4 * n + 1], o[4 * n + 2], o[4 * n + 3] = dmma(
                native, s[i], s[i + 2], s[i + 1], s[i + 3], s[j], s[j + 2], s[j + 1], s[j + 3],
                vs[key, col], vs[key + 1, col], vs[key + 8, col], vs[key + 9, col],
                o[4 * n], o[4 * n + 1], o[4 * n + 2], o[4 * n + 3])
    return rs0, rs1


@inlined
def kv_stage(dyn, q_words, stage, block_n, k_row, v_row):
    """Shared K and V tiles of K / V buffer ``stage`` (after Q's ``q_words`` doubles)."""
    base = q_words + stage * block_n * (k_row + v_row)
    return (shared_view(dyn, base, block_n, k_row),
            shared_view(dyn, base + block_n * k_row, block_n, v_row))


def _copy_split(head_dim: int, geo: DmmaGeometry) -> tuple[int, int, int, int]:
    """How a block's threads copy one K / V tile (``copy_kv_rows``): threads per key row, rows
    per pass, passes, 16-byte chunks per thread and row; ValueError for a tiling whose copies
    do not split evenly over the threads."""
    threads, chunks = 32 * geo.warps, head_dim // 2
    per_row = max(1, threads // geo.block_n)
    rows = threads // per_row
    passes = geo.block_n // rows
    if (geo.block_n % 16 or rows * passes != geo.block_n or per_row * rows != threads
            or chunks % per_row or geo.stages not in (1, 2) or geo.warps < 1):
        raise ValueError(f"the tiling {tuple(geo)} is not one the kernel takes (keys per tile a "
                         f"multiple of 16 whose copies split evenly over the threads; 1 or 2 "
                         f"stages)")
    return per_row, rows, passes, chunks // per_row


@inlined
def copy_offsets(k, v, ab, hk, tid, q_words, block_n, k_row, v_row, tpl):
    """This thread's part of every K / V tile copy: ``(row, k_dst, v_dst, k_src, v_src, k_step,
    v_step)``: its first key row in a tile, the words of its first chunk in stage 0's shared K
    / V tiles, the byte offsets of that chunk in row 0 of ``k[ab, :, hk]`` / ``v[ab, :, hk]``
    and the arrays' bytes per row."""
    row, part = tid // tpl, tid % tpl
    k_dst = q_words + row * k_row + 2 * part
    v_dst = q_words + block_n * k_row + row * v_row + 2 * part
    return (row, k_dst, v_dst, ab * k.strides[0] + hk * k.strides[2] + 16 * part,
            ab * v.strides[0] + hk * v.strides[2] + 16 * part, k.strides[1], v.strides[1])


@inlined
def copy_kv_rows(dyn, cp, stage_words, k, v, row0, k_end, k_row, v_row, tpl, rpp, passes, nseg):
    """Start this thread's cp.async copies of one K / V tile into the stage ``stage_words``
    past stage 0, committed as one group: array rows ``row0 + cp_row + rpp ps`` (``ps <
    passes``; zeros at or past ``k_end``), in each ``nseg`` 16-byte chunks ``tpl`` apart (``cp``:
    ``copy_offsets``; ``k_row`` / ``v_row`` words per shared row)."""
    cp_row, k_dst, v_dst, k_src, v_src, k_step, v_step = cp
    for ps in range(passes):
        r = row0 + cp_row + ps * rpp
        ok = r < k_end
        src_bytes = 16 if ok else 0
        r = r if ok else 0
        for sg in range(nseg):
            c = 2 * tpl * sg
            cp_async16_flat(dyn, stage_words + k_dst + ps * rpp * k_row + c, k,
                            k_src + r * k_step + 8 * c, src_bytes)
            cp_async16_flat(dyn, stage_words + v_dst + ps * rpp * v_row + c, v,
                            v_src + r * v_step + 8 * c, src_bytes)
    cp_async_commit()


@inlined
def softmax_step(s, o, m0, m1, base, qpos0, seqlen_k, scale, cap_in, cap_out, window_left,
                 window_right, sinks, has_softcap, has_left, has_right, has_sinks, n_tiles,
                 d_tiles):
    """The online softmax's first half on one tile of scores ``s`` (a lane's keys ``base +
    n*8 + c``, c = 0, 1; its rows at query positions ``qpos0``, ``qpos0 + 8``): mask and scale
    in place, the rows' new maxima, ``o`` rescaled; returns ``row_maxima``'s six values (P
    follows in ``add_pv``)."""
    mx0 = mx1 = NEG_INF
    for n in range(n_tiles):             # scale, softcap, mask; each row's max
        for e in range(4):
            x = masked_score(s[4 * n + e], base + n * 8 + (e & 1), qpos0 + 8 * (e >> 1),
                             seqlen_k, scale, cap_in, cap_out, has_softcap, has_left, has_right,
                             has_sinks, window_left, window_right, sinks, NEG_INF)
            s[4 * n + e] = x
            if e < 2:
                mx0 = max(mx0, x)
            else:
                mx1 = max(mx1, x)
    n0, n1, mu0, mu1, alpha0, alpha1 = row_maxima(m0, m1, mx0, mx1, 0.0)
    for n in range(d_tiles):
        o[4 * n] *= alpha0
        o[4 * n + 1] *= alpha0
        o[4 * n + 2] *= alpha1
        o[4 * n + 3] *= alpha1
    return n0, n1, mu0, mu1, alpha0, alpha1


@inlined
def load_q_fragments(qf, q, ab, q_off, h, row0, seqlen_q, t, count):
    """Q's A fragments of a lane into the registers ``qf`` (``count`` doubles: ``a[2j + h]`` of
    k-step kk at ``qf[8 kk + 2j + h]``, row ``row0 + 8h``, column ``kk*16 + t + 4j`` of
    ``q[ab, q_off + row, h, :]``; zeros past ``seqlen_q``)."""
    for i in range(count):
        r = row0 + 8 * (i & 1)
        c = (i >> 3) * 16 + t + 4 * ((i >> 1) & 3)
        qf[i] = q[ab, q_off + r, h, c] if r < seqlen_q else 0.0


@inlined
def store_rows(out, lse, o, m0, m1, l0, l1, ab, q_off, h, row0, seqlen_q, t, write_lse,
               d_tiles):
    """A lane's two output rows (``row0``, ``row0 + 8``) of ``out[ab, q_off + row, h, :]``:
    ``o / l``, 0 for a row that saw no key (a NaN ``l`` stays NaN, docs/api.md), and with
    ``write_lse`` ``m + log l`` (-inf for such a row) in ``lse[ab, h, q_off + row]``."""
    for half in range(2):
        row = row0 + 8 * half
        l = l0 if half == 0 else l1
        if row < seqlen_q:
            inv = 1.0 / l if l != 0 else 0.0
            for n in range(d_tiles):
                out[ab, q_off + row, h, n * 8 + 2 * t] = o[4 * n + 2 * half] * inv
                out[ab, q_off + row, h, n * 8 + 2 * t + 1] = o[4 * n + 2 * half + 1] * inv
            if write_lse and t == 0:
                mrow = m0 if half == 0 else m1
                lse[ab, h, q_off + row] = mrow + math.log(l) if l != 0 else NEG_INF


def make_dmma_kernel(head_dim: int, has_left: bool, has_right: bool, has_sinks: bool,
                     has_softcap: bool, write_lse: bool, native: bool = True,
                     geo: DmmaGeometry | None = None, varlen: bool = False):
    """Build the float64 DMMA forward kernel for one configuration (module docstring): q, k, v,
    out float64 (B, S, H, D) any strides (rows 16-byte aligned); lse (B, Hq, Sq) float64 when
    ``write_lse``. ``native``: sm_90's m16n8k16 instruction (else eight m8n8k4 per product);
    ``geo``: the tiling (default ``dmma_geometry(head_dim)``), launched with ``16 geo.warps``
    query rows and ``32 geo.warps`` threads per block, ``dmma_smem_bytes`` of shared memory.
    ``varlen``: packed sequences (q / k / v / out (1, total, H, D), lse (1, Hq, total_q),
    ``cu_q`` / ``cu_k`` int32 (B + 1,); blockIdx.y runs over B * Hq as for padded batches)."""
    D = int(head_dim)
    if not dmma_supported(D):
        raise ValueError(f"head_dim must be one of 32, 64, 96, 128 for the DMMA kernel, got {D}")
    geo = geo or dmma_geometry(D)
    BN, Q_SMEM, WARPS, STAGES = geo
    BM, NT = 16 * WARPS, 32 * WARPS
    NATIVE = bool(native)
    KS, ND = D // 16, D // 8             # k-steps of Q K^T; n-tiles of the output
    NS, KP = BN // 8, BN // 16           # n-tiles of S; k-steps of P V
    DK, DV, Q_WORDS, STAGE_WORDS = _smem_words(D, geo)
    TPL, RPP, PASSES, NSEG = _copy_split(D, geo)     # threads per K / V row, rows per pass, ...
    QN = 1 if Q_SMEM else D // 2         # registers per lane: Q fragments, S, O
    SN, ON = 4 * NS, 4 * ND
    f64 = types.float64
    VARLEN = bool(varlen)
    EXP_AHEAD = dmma_exp_ahead(D, has_left, has_sinks)
    GROUP_KEYS = group_keys(16 * D, has_right, VARLEN)    # the grid's order (schedule.py)

    def kernel(q, k, v, out, lse, seqlen_q, seqlen_k, heads_ratio, scale, cap_in, cap_out,
               window_left, window_right, sinks, mk_iv, mk_mm, mk_tab, mk_bits, cu_q, cu_k, alibi):
        qtile, x, bh = query_tile_of_block(seqlen_k, heads_ratio, GROUP_KEYS)
        b = bh // q.shape[2]
        h = bh % q.shape[2]
        hk = h // heads_ratio
        tid = cuda.threadIdx.x
        ab, q_off, k_off = b, 0, 0       # the arrays' batch index; the sequence's first rows
        if VARLEN:
            ab = 0
            clear_unowned_rows(out, lse, cu_q, b, h, x, cuda.gridDim.x, BM, D, seqlen_q, tid,
                               NT, NEG_INF, write_lse)
            q_off, seqlen_q = packed_sequence(cu_q, b, q.shape[1], seqlen_q)
            k_off, seqlen_k = packed_sequence(cu_k, b, k.shape[1], seqlen_k)
            if qtile * BM >= seqlen_q:
                return
        warp, lane = tid >> 5, tid & 31
        g, t = lane >> 2, lane & 3
        dyn = cuda.shared.array(0, f64)
        qs = shared_view(dyn, 0, BM if Q_SMEM else 1, DK)     # (unused when Q is in registers)
        qf = cuda.local.array(QN, f64)
        s = cuda.local.array(SN, f64)
        o = cuda.local.array(ON, f64)
        row0 = qtile * BM + warp * 16 + g
        shift = seqlen_k - seqlen_q
        if Q_SMEM:      # visible to every warp after the key loop's first barrier
            store_q_rows(qs, q, ab, h, q_off + qtile * BM, q_off + seqlen_q, tid, NT, BM, D,
                         0.0)
        else:
            load_q_fragments(qf, q, ab, q_off, h, row0, seqlen_q, t, D // 2)
        for e in range(ON):
            o[e] = 0.0
        m0 = m1 = NEG_INF
        l0 = l1 = 0.0
        q_lo = qtile * BM + shift
        q_hi = min(qtile * BM + BM, seqlen_q) - 1 + shift
        tile_lo, tile_hi, tile, last, sink_tiles = key_tiles(
            q_lo, q_hi, seqlen_k, BN, has_left, has_right, has_sinks, window_left, window_right,
            sinks)
        tile = past_sinks(tile, tile_lo, sink_tiles, has_sinks)
        k_end = k_off + seqlen_k         # the copies' bound, in the arrays' rows
        cp = copy_offsets(k, v, ab, hk, tid, Q_WORDS, BN, DK, DV, TPL)
        if STAGES == 2 and tile <= last:
            copy_kv_rows(dyn, cp, 0, k, v, k_off + tile * BN, k_end, DK, DV, TPL, RPP, PASSES,
                         NSEG)
        stage = 0
        while tile <= last:
            k0 = tile * BN
            nxt = past_sinks(tile + 1, tile_lo, sink_tiles, has_sinks)
            ks, vs = kv_stage(dyn, Q_WORDS, stage, BN, DK, DV)
            if STAGES == 2:
                cp_async_wait_all()
                cuda.syncthreads()       # this tile landed; every warp is done with the other
                if nxt <= last:
                    copy_kv_rows(dyn, cp, (1 - stage) * STAGE_WORDS, k, v, k_off + nxt * BN,
                                 k_end, DK, DV, TPL, RPP, PASSES, NSEG)
                stage = 1 - stage
            else:
                cuda.syncthreads()       # every warp is done with the previous tile
                copy_kv_rows(dyn, cp, 0, k, v, k_off + k0, k_end, DK, DV, TPL, RPP, PASSES,
                             NSEG)
                cp_async_wait_all()
                cuda.syncthreads()
            scores(s, qf, qs, ks, Q_SMEM, NATIVE, warp * 16 + g, g, t, KS, NS)
            m0, m1, mu0, mu1, alpha0, alpha1 = softmax_step(
                s, o, m0, m1, k0 + 2 * t, row0 + shift, seqlen_k, scale, cap_in, cap_out,
                window_left, window_right, sinks, has_softcap, has_left, has_right, has_sinks,
                NS, ND)
            rs0, rs1 = add_pv(o, s, vs, mu0, mu1, EXP_AHEAD, NATIVE, g, t, KP, ND)
            l0 = l0 * alpha0 + row_sum(rs0)
            l1 = l1 * alpha1 + row_sum(rs1)
            tile = nxt
        store_rows(out, lse, o, m0, m1, l0, l1, ab, q_off, h, row0, seqlen_q, t, write_lse, ND)

    return jit_kernel(kernel, ("dmma16", D, bool(has_left), bool(has_right), bool(has_sinks),
                               bool(has_softcap), bool(write_lse), NATIVE, BN, bool(Q_SMEM),
                               WARPS, STAGES, VARLEN))
