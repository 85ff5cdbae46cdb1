"""Tile operations shared by the exact-precision tensor-core kernels (forward_dmma.py,
forward_tf32x3.py): the block's cooperative K / V tile copy and Q tile store, the flags'
per-pair visibility with the score transform, and the 4-lane row reductions of an mma
accumulator. Module-level device functions called with compile-time flags, so a
kernel's closure holds constants only (the disk cache hashes it; kernels/jitcache.py)."""
from __future__ import annotations

import math

from ..primitives import cp_async16, cp_async_commit, shfl_xor
from ..primitives.base import inlined

__all__ = ["copy_kv_tile", "exp_scores", "masked_score", "row_max", "row_maxima", "row_sum",
           "store_q_rows", "window_visible"]


@inlined
def copy_kv_tile(ks, vs, k, v, b, hk, k0, seqlen_k, tid, threads, copies, per_row, per_copy):
    """Start copying rows ``k0 ..`` of ``k[b, :, hk, :]`` and ``v[...]`` into the shared tiles
    ``ks`` / ``vs`` (zeros past ``seqlen_k``) by cp.async: ``copies`` 16-byte copies per
    thread, ``per_row`` per row, ``per_copy`` elements each, committed as one group."""
    for c in range(copies):
        i = c * threads + tid
        r = i // per_row
        col = (i - r * per_row) * per_copy
        ok = k0 + r < seqlen_k
        src = k0 + r if ok else 0
        cp_async16(ks, r, col, k, b, src, hk, col, 16 if ok else 0)
        cp_async16(vs, r, col, v, b, src, hk, col, 16 if ok else 0)
    cp_async_commit()


@inlined
def store_q_rows(qs, q, b, h, q0, seqlen_q, tid, threads, rows, head_dim, zero):
    """Rows ``q0 .. q0 + rows - 1`` of ``q[b, :, h, :]`` into the shared tile ``qs`` (``zero``
    past ``seqlen_q``), the block's threads striding over the elements; other warps see them
    after the next barrier."""
    for i in range(tid, rows * head_dim, threads):
        r = i // head_dim
        c = i - r * head_dim
        qrow = q0 + r
        qs[r, c] = q[b, qrow, h, c] if qrow < seqlen_q else zero


@inlined
def window_visible(key, qpos, window_left, window_right, sinks, has_left, has_right, has_sinks):
    """Whether the flags let query position ``qpos`` see key ``key`` (bottom-right aligned): inside
    the window (``has_left`` / ``has_right``: ``qpos - window_left <= key <= qpos +
    window_right``), or a sink (``key < sinks``, not after the query)."""
    in_window = True
    if has_left:
        in_window = key >= qpos - window_left
    if has_right:
        in_window = in_window and key <= qpos + window_right
    if has_sinks:
        in_window = in_window or (key < sinks and key <= qpos)
    return in_window


@inlined
def masked_score(x, key, qpos, seqlen_k, scale, cap_in, cap_out, has_softcap, has_left,
                 has_right, has_sinks, window_left, window_right, sinks, neg_inf):
    """The score of the raw product ``x = q.k`` for the pair (query position ``qpos``, key
    ``key``): ``scale x``, or ``cap_out tanh(cap_in x)`` with a softcap; ``neg_inf`` when the
    key is past the sequence or outside the window and not a sink (bottom-right aligned)."""
    if has_softcap:
        x = cap_out * math.tanh(cap_in * x)
    else:
        x = scale * x
    visible = key < seqlen_k
    in_window = window_visible(key, qpos, window_left, window_right, sinks, has_left, has_right,
                               has_sinks)
    return x if visible and in_window else neg_inf


@inlined
def row_max(x):
    """Max over the 4 lanes of an mma accumulator row (lanes 4g .. 4g + 3)."""
    x = max(x, shfl_xor(x, 1))
    return max(x, shfl_xor(x, 2))


@inlined
def row_sum(x):
    """Sum over the 4 lanes of an mma accumulator row."""
    x += shfl_xor(x, 1)
    return x + shfl_xor(x, 2)


@inlined
def row_maxima(m0, m1, mx0, mx1, zero):
    """The rows' new maxima of an online softmax on an mma accumulator tile (a lane's rows g
    and g + 8) from the running ``m0`` / ``m1`` and this lane's tile maxima ``mx0`` / ``mx1``:
    ``(n0, n1, mu0, mu1, alpha0, alpha1)``, ``mu`` what the exponents subtract (``zero`` for a
    row that saw no key, whose max stays -inf) and ``alpha = exp(old - new)`` the factors for
    the running state."""
    n0, n1 = max(m0, row_max(mx0)), max(m1, row_max(mx1))
    mu0 = n0 if n0 != -math.inf else zero
    mu1 = n1 if n1 != -math.inf else zero
    return n0, n1, mu0, mu1, math.exp(m0 - mu0), math.exp(m1 - mu1)


@inlined
def exp_scores(s, mu0, mu1, lo, hi, rs0, rs1):
    """P = exp(S - mu) in place of the scores ``s[lo:hi]`` (``lo``, ``hi`` multiples of 4: whole
    n-tiles; row maxima ``mu0`` / ``mu1``: a lane's rows g, g + 8 own elements 0, 1 / 2, 3 of
    each n-tile); returns the rows' partial sums ``rs0`` / ``rs1`` with these P added."""
    for n in range(lo // 4, hi // 4):
        for e in range(4):
            p = math.exp(s[4 * n + e] - (mu0 if e < 2 else mu1))
            s[4 * n + e] = p
            if e < 2:
                rs0 += p
            else:
                rs1 += p
    return rs0, rs1


@inlined
def exponentiate_rows(s, m0, m1, mx0, mx1, n_tiles, zero):
    """The exponential step of an online softmax on an mma accumulator tile ``s`` (``n_tiles``
    8-column n-tiles; a lane's rows g and g + 8): the rows' new maxima from the running
    ``m0`` / ``m1`` and this lane's tile maxima ``mx0`` / ``mx1``, ``exp(s - max)`` in place of
    ``s`` (a row that saw no key keeps max -inf and subtracts ``zero``). Returns the new maxima,
    the factors ``exp(old - new)`` for the running state and the rows' sums over the tile:
    ``(n0, n1, alpha0, alpha1, sum0, sum1)``."""
    n0, n1, mu0, mu1, alpha0, alpha1 = row_maxima(m0, m1, mx0, mx1, zero)
    rs0, rs1 = exp_scores(s, mu0, mu1, 0, 4 * n_tiles, zero, zero)
    return n0, n1, alpha0, alpha1, row_sum(rs0), row_sum(rs1)
