"""Tile-level device helpers of the tensor-core forward kernel (forward_mma.py).

Every helper is ``@inlined`` (primitives/base.py: NVVM inlines it) and
takes the kernel's compile-time constants (``m_tiles``, fragment counts, dtype and mask flags)
as arguments, so the kernel's closure keeps plain constants (the disk cache hashes it;
kernels/jitcache.py). Fragment layouts are mma.sync m16n8k16's: lane ``4 g + t`` of a warp holds
rows ``g`` and ``g + 8`` of each 16-row m-tile; accumulator element ``e`` of 8-column n-tile ``j``
sits at row ``g + 8 (e >> 1)``, column ``8 j + 2 t + (e & 1)``. Each helper's body is the
kernel's code as it was, in the same order: the kernels' machine code does not change
(``scripts/sass_snapshot.py --compare``).
"""
from __future__ import annotations

import math

import numpy as np

from ..primitives import (cp_async4_to, cp_async16, cp_async16_at_address, cp_async16_to,
                          cp_async_commit, exp2, lds_i32x2, ldmatrix_x4, ldmatrix_x4_trans, mma16,
                          pack16, shared_addr, shfl_idx, shfl_xor, sw128_desc, wgmma_commit,
                          wgmma_fence, wgmma_rs, wgmma_ss, wgmma_wait)
from .masking import BITMASK, INTERVALS, LN2, LOG2E, MASK_MOD
from ..primitives.base import inlined

__all__ = ["store_output", "ldmatrix_lane", "copy_coords", "load_q_fragments", "init_rows",
           "copy_rows", "mma_pair", "qk_mma", "qk_wgmma", "pv_mma", "pv_wgmma", "score_logits",
           "mask_tile", "update_row_max", "exp_and_pack", "rescale_acc", "copy_bounds",
           "wgmma_tiles", "copy_k_stage", "qk_wgmma_start", "pv_wgmma_start", "row_bounds_word",
           "mask_tile_rows", "TILE_ROWS", "TILE_ROWS_HIDDEN"]

NEG_INF = -math.inf
POS_INF = math.inf
# Query rows per tile of ``row_bounds_word`` (the warp-specialised kernel's WS_BLOCK_M): its
# bounds 0 .. TILE_ROWS fit a byte.
TILE_ROWS = 128
# ``row_bounds_word`` of a key that no row of the query tile sees (interval [0, TILE_ROWS)).
TILE_ROWS_HIDDEN = TILE_ROWS << 8


@inlined
def store_output(out, lse, acc, l_run, m_run, ab, q_off, h, wrow, g, t, seqlen_q, m_tiles,
                 of, nd, bf16, write_lse):
    """Epilogue: O = acc / l into ``out[ab, q_off + row, h, :]`` and (``write_lse``) the
    natural-log ``lse[ab, h, q_off + row] = (m + log2 l) ln 2`` (-inf for a row that saw no
    key) of this thread's rows ``wrow + 16 mt + g (+ 8)`` inside the sequence.

    out uint32 (B, S, H, D/2), 16-bit pairs (``bf16``: bfloat16, else float16); lse float32
    (B, Hq, S); acc float32 (m_tiles * of,), m-tile mt at ``mt * of + 4 dn + e`` for n-tile
    ``dn < nd`` of 8 columns; l_run / m_run float32 (2 m_tiles,): per-lane partial row sums
    (summed over the lane quad here) and base-2 running maxima, index ``2 mt + half``.
    """
    for mt in range(m_tiles):
        for half in range(2):
            row = wrow + mt * 16 + g + 8 * half
            l = l_run[2 * mt + half]
            l += shfl_xor(l, 1)
            l += shfl_xor(l, 2)
            inv = np.float32(0.0)
            if l != 0:
                inv = np.float32(1.0) / l
            if row < seqlen_q:
                for dn in range(nd):
                    o = mt * of + dn * 4 + 2 * half
                    out[ab, q_off + row, h, dn * 4 + t] = pack16(bf16, acc[o] * inv,
                                                                 acc[o + 1] * inv)
                if write_lse and t == 0:
                    lse[ab, h, q_off + row] = ((m_run[2 * mt + half] + math.log2(l)) * LN2
                                               if l != 0 else NEG_INF)


@inlined
def ldmatrix_lane(lane, swz_mask):
    """``(v_row, v_col, swz)``: the tile row and word column this lane addresses in an
    ldmatrix.x4 (lanes 8m .. 8m + 7 address matrix m: rows 0-7 / 8-15, word columns 0 / 4),
    and its swizzle term: every ldmatrix row this lane addresses is = lane (mod 8), so one
    XOR ``swz_mask & ((lane & 7) << 2)`` per thread (``swz_mask`` 0 for padded rows)."""
    v_row = ((lane >> 3) & 1) * 8 + (lane & 7)
    v_col = (lane >> 4) * 4
    swz = swz_mask & ((lane & 7) << 2)
    return v_row, v_col, swz


@inlined
def copy_coords(tid, tpl, swz_mask):
    """``(cp_row, cp_part, cp_swz)``: thread ``tid``'s tile-copy coordinates (``tpl`` threads per
    row segment; see ``copy_rows``) and the swizzle term of its rows."""
    cp_row = tid // tpl
    cp_part = tid % tpl
    cp_swz = swz_mask & ((cp_row & 7) << 2)
    return cp_row, cp_part, cp_swz


@inlined
def load_q_fragments(qf, q, ab, q_off, h, row0, row1, t, seqlen_q, k_steps):
    """Register-Q path: the A fragments of Q rows ``row0`` and ``row1 = row0 + 8`` for
    ``k_steps`` 16-column k-steps into ``qf`` (uint32, 4 per k-step: (row0, w), (row1, w),
    (row0, w + 4), (row1, w + 4) with word column ``w = 8 kk + t``); rows at or past
    ``seqlen_q`` give zeros. q uint32 (B, S, H, D/2); ``k_steps`` 0 when Q is in shared memory."""
    zero_w = np.uint32(0)
    for kk in range(k_steps):
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


@inlined
def init_rows(acc, m_run, l_run, m_tiles, of):
    """Zero the output accumulator ``acc`` (float32, ``m_tiles * of``) and start the running row
    maxima ``m_run`` at -inf and row sums ``l_run`` at 0 (float32, ``2 m_tiles`` each)."""
    for i in range(m_tiles * of):
        acc[i] = np.float32(0.0)
    for i in range(2 * m_tiles):
        m_run[i] = np.float32(NEG_INF)
        l_run[i] = np.float32(0.0)


@inlined
def swizzled_chunk(dst_addr, sg, tpl, blk, row):
    """Shared address of this thread's chunk of segment ``sg`` (``tpl`` chunks each), ``row``
    rows (a multiple of 8) below its first row, in a 128-byte-swizzled tile (128 bytes per row,
    ``blk`` bytes per 64-column block); ``dst_addr``: the thread's place in segment 0 of its
    first row. The segment's first chunk sg * tpl
    lies in block sg * tpl // 8 at chunk sg * tpl % 8 (4 with 4-chunk segments: this thread's
    chunk cp_part + 4 < 8, whose swizzled place is dst_addr's with bit 2 of the chunk index
    flipped)."""
    return (dst_addr ^ ((sg * tpl % 8) << 4)) + (sg * tpl // 8) * blk + row * 128


@inlined
def copy_whole_rows(dst_addr, src_addr, pass_bytes, passes, nseg, tpl, rpp, blk):
    """``copy_rows``' copy with ``wg`` (same threads, chunks and swizzled places) of a tile
    whose rows are all in bounds, from this thread's first chunk's global address ``src_addr``
    (int64) stepping ``pass_bytes`` per pass: no bounds, no per-copy indexing."""
    for ps in range(passes):
        row_addr = src_addr + ps * pass_bytes
        for sg in range(nseg):
            cp_async16_at_address(swizzled_chunk(dst_addr, sg, tpl, blk, ps * rpp),
                                  row_addr + sg * tpl * 16)


@inlined
def copy_rows(dst, dst_addr, src, ab, off, row0, limit, hk, cp_row, cp_part, cp_swz, passes,
              nseg, tpl, rpp, blk, wg):
    """This thread's share of the block's cp.async copy of tile rows ``row0 ..`` of
    ``src[ab, off + row, hk, :]`` (uint32 (B, S, H, D/2)); rows at or past ``limit`` become
    zeros (source row 0, 0 bytes read). Thread (``cp_row``, ``cp_part``) copies 16-byte chunk
    ``cp_part`` of each ``tpl``-chunk segment (``nseg`` per row) of rows ``cp_row + rpp ps``,
    ``ps < passes``: into the static shared tile ``dst`` (uint32 (rows, cols), word column
    XOR ``cp_swz``), or with ``wg`` to the shared address ``dst_addr`` (this thread's first
    destination in a 128-byte-swizzled tile; 128 bytes per row, ``blk`` bytes per 64-column
    block; segments of 8 chunks are whole blocks, of 4 chunks half blocks). Commits nothing."""
    for ps in range(passes):
        key = row0 + cp_row + ps * rpp
        ok = key < limit
        src_row = off + key if ok else 0
        for sg in range(nseg):
            c = (sg * tpl + cp_part) * 4
            if wg:
                cp_async16_to(swizzled_chunk(dst_addr, sg, tpl, blk, ps * rpp), src, ab, src_row,
                              hk, c, 16 if ok else 0)
            else:
                cp_async16(dst, cp_row + ps * rpp, c ^ cp_swz, src, ab, src_row, hk, c,
                           16 if ok else 0)


@inlined
def mma_pair(c, o, a0, a1, a2, a3, b0, b1, b2, b3, bf16):
    """Two mma.sync m16n8k16 products of one A fragment (``a0..a3``, uint32 16-bit pairs) with
    two B fragments (``b0, b1`` and ``b2, b3``): 16 x 16 outputs accumulated in place into
    ``c[o .. o + 7]`` (float32, two n-tiles of 4 accumulator registers each)."""
    c0, c1, c2, c3 = mma16(bf16, a0, a1, a2, a3, b0, b1, c[o], c[o + 1], c[o + 2], c[o + 3])
    c[o] = c0
    c[o + 1] = c1
    c[o + 2] = c2
    c[o + 3] = c3
    c0, c1, c2, c3 = mma16(bf16, a0, a1, a2, a3, b2, b3, c[o + 4], c[o + 5], c[o + 6], c[o + 7])
    c[o + 4] = c0
    c[o + 5] = c1
    c[o + 6] = c2
    c[o + 7] = c3


@inlined
def qk_mma(s, qs, qf, ks, warp, v_row, v_col, swz, k_steps, ns, sf, s_n, wrows, m_tiles,
           q_smem, bf16):
    """S = Q K^T of one key tile on mma.sync m16n8k16 (fp32 accumulation), into ``s`` (float32
    ``s_n = m_tiles * sf``; m-tile mt's ``ns`` 8-key n-tiles at ``mt * sf + 4 j + e``).

    A fragments: ldmatrix from the shared Q tile ``qs`` (uint32 (BM, row words), this warp's
    rows from ``warp * wrows``) when ``q_smem``, else the registers ``qf`` (uint32, 4 per
    k-step; ``load_q_fragments``). B fragments: ldmatrix from the shared K tile ``ks`` (uint32
    (BN, row words)); each feeds every m-tile (``m_tiles`` 1 or 2). ``k_steps`` 16-column
    k-steps; ``v_row`` / ``v_col`` / ``swz`` this lane's ldmatrix row, word column and swizzle.
    """
    for i in range(s_n):
        s[i] = np.float32(0.0)
    for kk in range(k_steps):
        if q_smem:
            a0, a1, a2, a3 = ldmatrix_x4(qs, warp * wrows + v_row, (kk * 8 + v_col) ^ swz)
        else:
            a0 = qf[kk * 4]
            a1 = qf[kk * 4 + 1]
            a2 = qf[kk * 4 + 2]
            a3 = qf[kk * 4 + 3]
        if m_tiles > 1:
            e0, e1, e2, e3 = ldmatrix_x4(qs, warp * wrows + 16 + v_row, (kk * 8 + v_col) ^ swz)
        for jj in range(ns // 2):
            # Same lane addressing as the Q and V loads (one set of swizzled column offsets
            # for all three): matrices (keys 0-7, k 0-7), (keys 8-15, k 0-7), (keys 0-7,
            # k 8-15), (keys 8-15, k 8-15) -> b0, b2, b1, b3.
            b0, b2, b1, b3 = ldmatrix_x4(ks, jj * 16 + v_row, (kk * 8 + v_col) ^ swz)
            j = 8 * jj
            mma_pair(s, j, a0, a1, a2, a3, b0, b1, b2, b3, bf16)
            if m_tiles > 1:
                j += sf
                mma_pair(s, j, e0, e1, e2, e3, b0, b1, b2, b3, bf16)


@inlined
def qk_wgmma_start(s, dq, dk, k_steps, bn, blk_q, blk_k, bf16):
    """Issue S = Q K^T of one key tile on wgmma m64n{bn}k16 (this warpgroup's 64 query rows,
    fp32 accumulation into ``s``, float32 ``bn / 2``: the mma.sync accumulator layout of the
    warp's 16 rows) as one committed group; ``s`` is undefined until a ``wgmma_wait`` that
    passes it through. Q and K are K-major in 128-byte-swizzled shared tiles (descriptors
    ``dq`` / ``dk``, uint64); k-step kk is column block kk // 4 (``blk_q`` / ``blk_k`` bytes
    each), 32 bytes per step inside it (descriptor addresses count 16-byte units); the first
    step overwrites ``s`` (scale-d 0)."""
    wgmma_fence()
    for kk in range(k_steps):
        wgmma_ss(bf16, bn, s,
                 dq + np.uint64((kk // 4) * (blk_q >> 4) + (kk % 4) * 2),
                 dk + np.uint64((kk // 4) * (blk_k >> 4) + (kk % 4) * 2),
                 0 if kk == 0 else 1)
    wgmma_commit()


@inlined
def qk_wgmma(s, dq, dk, k_steps, bn, blk_q, blk_k, bf16):
    """S = Q K^T of one key tile on wgmma (``qk_wgmma_start``), waiting for the result."""
    qk_wgmma_start(s, dq, dk, k_steps, bn, blk_q, blk_k, bf16)
    wgmma_wait(bn, s)


@inlined
def pv_mma(acc, pk, vs, v_row, v_col, swz, p_steps, nd, sf, of, m_tiles, bf16):
    """O += P V of one key tile on mma.sync m16n8k16. A fragments: the packed probabilities
    ``pk`` (uint32 16-bit pairs, ``m_tiles * sf / 2``, the S accumulator layout, which is the A
    layout: k-step kb's four words at ``4 kb``, m-tile 1's from ``sf / 2``). B fragments:
    ldmatrix.trans from the shared V tile ``vs`` (uint32 (BN, row words)), each feeding every
    m-tile. ``acc`` float32 (``m_tiles * of``; ``nd`` 8-column n-tiles per m-tile);
    ``p_steps`` 16-key k-steps."""
    for kb in range(p_steps):
        j = kb * 4
        a0 = pk[j]
        a1 = pk[j + 1]
        a2 = pk[j + 2]
        a3 = pk[j + 3]
        if m_tiles > 1:
            j += sf // 2
            e0 = pk[j]
            e1 = pk[j + 1]
            e2 = pk[j + 2]
            e3 = pk[j + 3]
        for dd in range(nd // 2):
            b0, b1, b2, b3 = ldmatrix_x4_trans(vs, kb * 16 + v_row, (dd * 8 + v_col) ^ swz)
            o = 8 * dd
            mma_pair(acc, o, a0, a1, a2, a3, b0, b1, b2, b3, bf16)
            if m_tiles > 1:
                o += of
                mma_pair(acc, o, e0, e1, e2, e3, b0, b1, b2, b3, bf16)


@inlined
def pv_wgmma_start(acc, pk, dv, p_steps, d, bf16):
    """Issue O += P V of one key tile on wgmma m64n{d}k16 as one committed group: A = the
    packed probabilities ``pk`` (uint32, registers: the mma.sync A fragments of the warp's 16
    rows), B = the V tile (MN-major, 128-byte-swizzled shared memory, descriptor ``dv``);
    k-step kb covers keys 16 kb .. 16 kb + 15, i.e. 16 rows of 128 bytes further. ``acc``
    float32 (``d / 2``). Wait before any other work: ptxas may reuse ``pk``'s registers while
    the product still reads them (docs/backward.md, item 5)."""
    wgmma_fence()
    for kb in range(p_steps):
        j = kb * 4
        wgmma_rs(bf16, d, acc, pk[j], pk[j + 1], pk[j + 2], pk[j + 3],
                 dv + np.uint64(kb * 16 * 128 >> 4))
    wgmma_commit()


@inlined
def pv_wgmma(acc, pk, dv, p_steps, d, bf16):
    """O += P V of one key tile on wgmma (``pv_wgmma_start``), waiting for the result."""
    pv_wgmma_start(acc, pk, dv, p_steps, d, bf16)
    wgmma_wait(d, acc)


@inlined
def score_logits(s, k0, wrow, g, t, offset, seqlen_q, seqlen_k, b, h, scale_log2, cap_in,
                 cap_out, slope, smod, ns, sf, m_tiles, has_softcap, alibi, score_mod):
    """The raw products ``s`` (float32, the S accumulator layout; keys from ``k0``, the warp's
    rows from ``wrow``) to base-2 logits in place: ``cap_out tanh(cap_in x)`` (``has_softcap``)
    or ``scale_log2 x``; minus ``slope |i - j|`` (``alibi``; slope already times log2 e);
    then the user's ``smod(score, b, h, q_idx, kv_idx)`` (``score_mod``) on the natural-log
    score with indices clamped into the sequence. The m-tile loop is innermost so that every
    loop unrolls fully."""
    for j in range(ns):
        for e in range(4):
            kpos = k0 + j * 8 + 2 * t + (e & 1)
            for mt in range(m_tiles):
                x = s[mt * sf + j * 4 + e]
                if has_softcap:
                    x = cap_out * math.tanh(cap_in * x)
                else:
                    x = x * scale_log2
                if alibi:
                    qpos = wrow + mt * 16 + g + 8 * (e >> 1) + offset
                    x -= slope * abs(np.float32(qpos - kpos))
                if score_mod:   # natural-log score in, indices inside the sequence
                    qc = min(wrow + mt * 16 + g + 8 * (e >> 1), seqlen_q - 1) + offset
                    kc = min(kpos, seqlen_k - 1)
                    x = np.float32(smod(x * np.float32(LN2), b, h, qc, kc)) * np.float32(LOG2E)
                s[mt * sf + j * 4 + e] = x


@inlined
def mask_tile(s, words, k0, wrow, g, t, offset, seqlen_q, seqlen_k, b, h, window_left,
              window_right, sinks, mk_iv, mk_bits, iv_addr, mod, ns, sf, run_n, bn, kind,
              iv_smem, has_left, has_right, has_sinks, hidden):
    """Per-element mask of a partial key tile: scores ``s`` (float32, S accumulator layout) of
    invisible (row, key) pairs become ``hidden`` (-inf; +inf for raw scores under a negative
    scale, which the scale turns into -inf). Visible: key inside the sequence, inside the
    window (``has_left`` / ``has_right``, bottom-right aligned by ``offset``) or a sink
    (``has_sinks``), and by the mask object ``kind``: INTERVALS (the key column's 4 bounds
    from ``mk_iv`` int32 (4, Sk), or with ``iv_smem`` from the shared copy at ``iv_addr``: 4 x
    ``bn`` int32), BITMASK (``mk_bits`` uint32 (Sq, words) through ``words``, uint32
    ``run_n``), MASK_MOD (``mod(b, h, q, k)``). A key column's mask data is loaded once for
    all the thread's rows; bitwise & / | on the booleans (not ``and`` / ``or``) make selects,
    no branches, so the pass is one scheduled stretch per column."""
    for j in range(ns):
        if kind == BITMASK:
            wcol = min((k0 + j * 8) >> 5, mk_bits.shape[1] - 1)
            for r in range(run_n):
                row = wrow + (r >> 1) * 16 + g + 8 * (r & 1)
                words[r] = mk_bits[min(row, seqlen_q - 1), wcol]
        if iv_smem:   # this thread's two columns of each bound: one 8-byte load
            ivc = iv_addr + (j * 8 + 2 * t) * 4
            lts0, lts1 = lds_i32x2(ivc)
            lte0, lte1 = lds_i32x2(ivc + bn * 4)
            uts0, uts1 = lds_i32x2(ivc + bn * 8)
            ute0, ute1 = lds_i32x2(ivc + bn * 12)
        for c in range(2):
            kpos = k0 + j * 8 + 2 * t + c
            if iv_smem:
                lts = lts0 if c == 0 else lts1
                lte = lte0 if c == 0 else lte1
                uts = uts0 if c == 0 else uts1
                ute = ute0 if c == 0 else ute1
            elif kind == INTERVALS:
                col = min(kpos, seqlen_k - 1)
                lts = mk_iv[0, col]
                lte = mk_iv[1, col]
                uts = mk_iv[2, col]
                ute = mk_iv[3, col]
            for r in range(run_n):
                row = wrow + (r >> 1) * 16 + g + 8 * (r & 1)
                qpos = row + offset
                vis = kpos < seqlen_k
                if has_left:
                    vis = vis & (kpos >= qpos - window_left)
                if has_right:
                    vis = vis & (kpos <= qpos + window_right)
                if has_sinks:
                    vis = vis | ((kpos < sinks) & (kpos <= qpos) & (kpos < seqlen_k))
                if kind == INTERVALS:
                    vis = vis & ((row < lts) | (row >= lte)) & ((row < uts) | (row >= ute))
                elif kind == BITMASK:
                    vis = vis & (((words[r] >> (kpos & 31)) & 1) != 0)
                elif kind == MASK_MOD:
                    if vis and row < seqlen_q:
                        vis = mod(b, h, qpos, kpos)
                e = (r >> 1) * sf + j * 4 + c + 2 * (r & 1)
                s[e] = s[e] if vis else hidden


@inlined
def _extreme(a, b, smallest):
    """min(a, b) if ``smallest`` else max(a, b) (``smallest`` is block-uniform: the compiler
    hoists the choice out of update_row_max's loops)."""
    return min(a, b) if smallest else max(a, b)


@inlined
def update_row_max(s, m_run, mx, mu, alpha, ns, sf, m_tiles, run_n, raw, scale_log2):
    """Online softmax, step 1: the tile's row maxima of the logits, reduced over the lane quad
    that holds a row, update the running maxima ``m_run`` (base-2 logits); ``alpha = exp2(m_old
    - m_new)`` rescales the old sums and output, ``mu`` is the maximum to subtract (0 for a row
    that has seen no key yet: exp2 then gives 0). ``s`` (float32, S accumulator layout) holds
    the logits, or with ``raw`` the unscaled products, whose logits are ``scale_log2 s``: their
    row maximum is scale times the row's largest product, or smallest under a negative scale.
    ``mx`` (maxima scratch) is left at 0 for the row sums. Row arrays float32 (``run_n`` =
    2 m_tiles, index ``2 mt + half``)."""
    negative = raw and scale_log2 < 0       # block-uniform
    for i in range(run_n):
        mx[i] = np.float32(POS_INF) if negative else np.float32(NEG_INF)
    for j in range(ns):
        for e in range(4):
            for mt in range(m_tiles):
                r = 2 * mt + (e >> 1)
                mx[r] = _extreme(mx[r], s[mt * sf + j * 4 + e], negative)
    for r in range(run_n):
        # The 4 lanes of a quad hold one row: reduce across them.
        x = _extreme(mx[r], shfl_xor(mx[r], 1), negative)
        x = _extreme(x, shfl_xor(x, 2), negative)
        if raw:
            x = x * scale_log2
        m_new = max(m_run[r], x)
        # A row that has seen no key yet keeps m = -inf; subtract 0 then so exp2 gives 0.
        mu[r] = m_new if m_new != NEG_INF else np.float32(0.0)
        alpha[r] = exp2(m_run[r] - mu[r])
        m_run[r] = m_new
        mx[r] = np.float32(0.0)      # from here on: this tile's row sums


@inlined
def exp_and_pack(s, pk, mx, mu, alpha, l_run, ns, sf, m_tiles, run_n, bf16, raw, scale_log2):
    """Online softmax, step 2: P = exp2(S - mu) (``raw``: exp2(scale_log2 S - mu), one FFMA
    per score), packed at once to 16-bit pairs into ``pk``
    (uint32, ``m_tiles * sf / 2``, same order as ``s``: the A operand of P V; half the
    registers of the fp32 scores stay live across the barrier that follows); the tile's row
    sums (``mx``) join the running per-lane partial sums ``l_run = l_run alpha + sum`` (the
    quad is summed once, in the epilogue)."""
    for j in range(ns):
        for e in range(0, 4, 2):
            for mt in range(m_tiles):
                r = 2 * mt + (e >> 1)
                x0 = s[mt * sf + j * 4 + e]
                x1 = s[mt * sf + j * 4 + e + 1]
                if raw:
                    p0 = exp2(x0 * scale_log2 - mu[r])
                    p1 = exp2(x1 * scale_log2 - mu[r])
                else:
                    p0 = exp2(x0 - mu[r])
                    p1 = exp2(x1 - mu[r])
                mx[r] += p0 + p1
                pk[(mt * sf + j * 4 + e) >> 1] = pack16(bf16, p0, p1)
    for r in range(run_n):
        # per-lane partial sums; the quad is summed once at the end
        l_run[r] = l_run[r] * alpha[r] + mx[r]


@inlined
def rescale_acc(acc, alpha, nd, of, m_tiles):
    """Online softmax, step 3: the output accumulator ``acc`` (float32, ``m_tiles * of``: ``nd``
    n-tiles per m-tile) times its rows' ``alpha`` (float32, index ``2 mt + half``)."""
    for dn in range(nd):
        for e in range(4):
            for mt in range(m_tiles):
                acc[mt * of + dn * 4 + e] *= alpha[2 * mt + (e >> 1)]


@inlined
def copy_bounds(iv_addr, mk_iv, key0, seqlen_k, tid, threads, per_thread, bn):
    """This thread's share of the cp.async copy (4 bytes each) of the interval bounds of keys
    ``key0 .. key0 + bn - 1`` (``mk_iv`` int32 (4, Sk); keys past ``seqlen_k``: zeros) to the
    shared address ``iv_addr`` (4 x ``bn`` int32: bound idx // bn of column idx % bn at
    ``iv_addr + 4 idx``). Commits nothing."""
    for u in range(per_thread):
        idx = tid + u * threads          # bound idx // BN of column idx % BN
        key = key0 + idx % bn
        cp_async4_to(iv_addr + idx * 4, mk_iv, idx // bn, key if key < seqlen_k else 0,
                     4 if key < seqlen_k else 0)


@inlined
def wgmma_tiles(dyn, warp, cp_row, cp_part, q_off, k_off, v_off, blk_k, broadcast):
    """wgmma path: ``(sbase, cp_dst, dq, dk, dv)``: the 1024-byte aligned shared address of the
    dynamic tiles (``dyn``, the kernel's dynamic shared array), this thread's first copy
    destination relative to a tile's start (row ``cp_row``, 16-byte chunk ``cp_part``,
    128-byte swizzle), and the uint64 descriptors of this warpgroup's 64 Q rows and of the K
    tile (both K-major) and the V tile (MN-major: leading offset = one 64-column block of V,
    ``blk_k`` bytes); the tiles sit ``q_off`` / ``k_off`` / ``v_off`` bytes from ``sbase``.
    ``broadcast``: the base read from lane 0, so that ptxas knows it (and the descriptors)
    warp-uniform."""
    base = shared_addr(dyn)
    if broadcast:
        base = np.uint32(shfl_idx(np.int32(base), 0))
    sbase = (np.int64(base) + 1023) & ~1023
    cp_dst = cp_row * 128 + ((cp_part ^ (cp_row & 7)) << 4)
    dq = sw128_desc(sbase + q_off + (warp >> 2) * 64 * 128, 16, 1024)
    dk = sw128_desc(sbase + k_off, 16, 1024)
    dv = sw128_desc(sbase + v_off, blk_k, 1024)
    return sbase, cp_dst, dq, dk, dv



@inlined
def copy_k_stage(ks, k_addr, k, ab, k_off, key0, seqlen_k, hk, cp_row, cp_part, cp_swz, passes,
                 nseg, tpl, rpp, blk, wg, iv_addr, mk_iv, tid, threads, iv_per_thread, bn,
                 iv_smem):
    """Start the cp.async group of key tile rows ``key0 ..``: the K tile (``copy_rows`` into
    ``ks`` / to ``k_addr``) and, with ``iv_smem``, its interval bounds (``copy_bounds`` to
    ``iv_addr``); commits the group (with any copies issued before it, e.g. the Q tile)."""
    copy_rows(ks, k_addr, k, ab, k_off, key0, seqlen_k, hk, cp_row, cp_part, cp_swz, passes,
              nseg, tpl, rpp, blk, wg)
    if iv_smem:
        copy_bounds(iv_addr, mk_iv, key0, seqlen_k, tid, threads, iv_per_thread, bn)
    cp_async_commit()


@inlined
def row_bounds_word(mk_iv, key, seqlen_k, row0):
    """The masked rows of key ``key`` (``mk_iv`` int32 (4, Sk): rows [lts, lte) and [uts, ute)
    hidden) inside the ``TILE_ROWS``-row query tile that starts at row ``row0``, packed in one
    uint32 for ``mask_tile_rows``: bytes (start, length) of each interval relative to ``row0``,
    clamped to the tile (0 .. ``TILE_ROWS``), so a row r of the tile is hidden when
    ``r - row0 - start`` is below ``length`` as unsigned numbers. A key past ``seqlen_k`` hides
    every row (``TILE_ROWS_HIDDEN``)."""
    word = np.uint32(TILE_ROWS_HIDDEN)
    if key < seqlen_k:
        lts = min(max(mk_iv[0, key] - row0, 0), TILE_ROWS)
        lte = min(max(mk_iv[1, key] - row0, lts), TILE_ROWS)
        uts = min(max(mk_iv[2, key] - row0, 0), TILE_ROWS)
        ute = min(max(mk_iv[3, key] - row0, uts), TILE_ROWS)
        word = np.uint32(lts | ((lte - lts) << 8) | (uts << 16) | ((ute - uts) << 24))
    return word


@inlined
def mask_tile_rows(s, words_addr, k0, rel0, qpos0, t, window_right, ns, has_right, hidden):
    """Per-element mask of a partial key tile from the packed interval bounds of its keys
    (``row_bounds_word``, one uint32 per key of the tile from shared address ``words_addr``,
    8-byte aligned: two keys per load): the scores
    ``s`` (float32, one m-tile's S accumulator) of the thread's rows ``rel0`` / ``rel0 + 8``
    (relative to the query tile's first row; key coordinates ``qpos0`` / ``qpos0 + 8``) become
    ``hidden`` where an interval hides the pair, or (``has_right``) where the key lies past
    ``qpos + window_right``. Keys past the sequence are hidden by their words. Selects, no
    branches."""
    for j in range(ns):
        w0, w1 = lds_i32x2(words_addr + (j * 8 + 2 * t) * 4)
        for c in range(2):
            w = np.uint32(w0 if c == 0 else w1)
            lts = w & np.uint32(0xFF)
            lln = (w >> np.uint32(8)) & np.uint32(0xFF)
            uts = (w >> np.uint32(16)) & np.uint32(0xFF)
            uln = w >> np.uint32(24)
            for r in range(2):
                rel = np.uint32(rel0 + 8 * r)
                vis = (np.uint32(rel - lts) >= lln) & (np.uint32(rel - uts) >= uln)
                if has_right:
                    vis = vis & (k0 + j * 8 + 2 * t + c <= qpos0 + 8 * r + window_right)
                e = j * 4 + c + 2 * r
                s[e] = s[e] if vis else hidden
