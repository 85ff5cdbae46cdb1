"""Split-KV decode on CUDA cores (float16 / bfloat16, any head_dim multiple of 8; the launcher
takes it where the tensor-core kernel of decode_mma.py does not reach, i.e. head_dim 256).

One block of ``DECODE_WARPS`` warps per (split, batch item, kv head, row chunk). The query rows
of every query head that shares the kv head (GQA packing: ``group * seqlen_q`` rows, in chunks
of at most ``MAX_ROWS``) sit in registers, so each K/V byte of a split is read once per chunk.
Decoding is memory-bound, so the kernel is built around its loads, not its arithmetic:

* ``LPK`` lanes share one key row; each lane loads ``EPL`` elements of it as 16-byte vectors
  (``ld.global.nc.v4``), chunk ``c`` of lane ``sub`` at 16-byte offset ``sub + c * LPK`` so one
  load instruction of a warp covers ``LPK * 16`` contiguous bytes of each of ``32 / LPK`` rows.
* every lane issues all its K and V loads of an iteration (``U`` keys, 8 x 16 bytes of K and as
  many of V) before using any, so a warp keeps ~8 KiB in flight.
* scores are FMA dot products in fp32, reduced over the ``LPK`` lanes of a key with
  ``log2(LPK)`` xor-shuffles (2 FMA per K/V element and row: compute-bound at 8 rows, which is
  why the tensor-core kernel exists).
* each key group (the ``LPK`` lanes of one key) keeps its own online-softmax state (m, l, acc);
  all of them merge once, at the end, through shared memory (no shuffles).

The split's key range is counted on a "virtual" axis: ``[0, ns)`` are the attention-sink keys
below the window, then the keys of the window ``[lo, hi)``; ``num_splits`` blocks share it
evenly. With one split the block writes the output (and lse) directly; otherwise it writes an
fp32 partial state (o normalised, natural-log lse) for ``merge.make_merge_kernel``.

Masks: ``window_left`` / ``window_right`` (causal is right = 0) / ``sinks``, and a draft tree
(``tree_bits``: for query row s, bit t set iff tree node t is visible, i.e. an ancestor or
itself; the tree occupies the last ``tree_len`` keys of each sequence, keys before it are
visible causally). Scores are base 2 (log2 e folded into the scale) and use ``ex2.approx``.

The kernel's steps are ``@inlined`` device functions (``load_query_rows``, ``load_keys``,
``key_scores``, ``mask_scores``, ``softmax_rows``, ``accumulate_pv``, ``post_state``,
``merge_pair``), cut so that the machine code stays byte-identical to the single-body kernel
(scripts/sass_snapshot_decode.py --compare).
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda
from numba.cuda import types

from ..primitives import exp2, ld_v4, pack16, shfl_xor, unpack16
from .decode_split import cache_slot, split_keys, window_visible_decode
from .jitcache import jit_kernel
from ..primitives.base import inlined

__all__ = ["make_decode_kernel", "decode_kernel", "decode_geometry", "tree_visible", "DECODE_WARPS",
           "MAX_ROWS"]

DECODE_WARPS = 4
MAX_ROWS = 8
LN2 = 0.6931471805599453
_KERNELS: dict = {}


def decode_kernel(*config):
    """The cached kernel for one ``make_decode_kernel`` configuration."""
    if config not in _KERNELS:
        _KERNELS[config] = make_decode_kernel(*config)
    return _KERNELS[config]


def decode_geometry(head_dim: int, rows: int):
    """(LPK, EPL, U): lanes per key, elements per lane, keys per key group per iteration.

    ``rows`` query rows per block (<= MAX_ROWS). LPK is the fewest lanes (a power of two, at
    most 32 and at most head_dim / 8) that keep ``rows * EPL <= 64`` fp32 registers for q and as
    many for the accumulator; U makes each lane hold 8 x 16 bytes of K (and of V) per iteration,
    capped so that the ``rows * U`` scores stay within 32 registers.
    """
    if head_dim % 8:
        raise ValueError(f"head_dim must be a multiple of 8 for the decode kernel, got {head_dim}")
    lpk = 1
    chunks = head_dim // 8          # 16-byte chunks per row: LPK must divide them
    while rows * (head_dim // lpk) > 64 and lpk < 32 and chunks % (2 * lpk) == 0:
        lpk *= 2
    epl = head_dim // lpk
    unroll = max(1, min(64 // epl, 32 // rows))
    return lpk, epl, unroll


# ----------------------------------------------------------------------------- kernel steps
@inlined
def tree_visible(vis, kpos, qp, tree_start, word_lo, word_hi):
    """``vis`` and the draft-tree mask of the query at position ``qp`` for the key at ``kpos``:
    a key at or past ``tree_start`` is tree node ``kpos - tree_start``, visible iff its bit is
    set in the row's tree words ``word_lo`` (nodes 0..31) / ``word_hi`` (32..63); earlier keys
    are visible causally. Shared with decode_mma.py's kernel."""
    tk = kpos - tree_start
    if tk >= 0:
        word = word_lo if tk < 32 else word_hi
        vis = vis and ((word >> (tk & 31)) & 1) != 0
    else:
        vis = vis and kpos <= qp
    return vis


@inlined
def load_query_rows(qf, acc, mrow, lrow, qpos, rmask0, rmask1, q, tree_bits, b, hk, chunk,
                    heads_ratio, seqlen_q, m_rows, offset, sub, scale_log2, has_tree,
                    has_softcap, bf16, rows, ch, lpk, epl):
    """The block's ``rows`` packed query rows (row i of chunk ``chunk`` is query ``s`` of head
    ``hk * heads_ratio + gi``, ``rr = chunk * rows + i = gi * seqlen_q + s``): this lane's
    ``epl`` elements of each (16-byte chunks ``sub + c * lpk``) into ``qf`` as fp32, times
    ``scale_log2`` unless softcapped; the rows' key positions ``qpos`` and tree words
    ``rmask0`` / ``rmask1``; and the key group's zeroed online-softmax state (acc, mrow, lrow).
    Rows past ``m_rows`` are zero queries."""
    for i in range(rows):
        rr = chunk * rows + i
        gi = rr // seqlen_q
        s = rr - gi * seqlen_q
        live = rr < m_rows
        h = hk * heads_ratio + gi
        qpos[i] = s + offset
        if has_tree:
            rmask0[i] = tree_bits[s if live else 0, 0]
            rmask1[i] = tree_bits[s if live else 0, 1]
        for c in range(ch):
            for j in range(4):
                w = (sub + c * lpk) * 4 + j
                x0 = np.float32(0.0)
                x1 = np.float32(0.0)
                if live:
                    x0, x1 = unpack16(bf16, q[b, s, h, w])
                if not has_softcap:
                    x0 *= scale_log2
                    x1 *= scale_log2
                qf[i * epl + c * 8 + j * 2] = x0
                qf[i * epl + c * 8 + j * 2 + 1] = x1
        for e in range(epl):
            acc[i * epl + e] = np.float32(0.0)
        mrow[i] = np.float32(-math.inf)
        lrow[i] = np.float32(0.0)


@inlined
def load_keys(kw, vw, k, v, block_table, b, hk, base, kg, sub, ns, lo, v_end, paged, page_size,
              page_shift, unroll, groups, ch, lpk):
    """Issue every K and V load of one iteration: ``unroll`` keys of this lane's key group
    (virtual keys ``base + u * groups + kg``: sinks, then the window), ``ch`` 16-byte chunks
    each, into the registers ``kw`` / ``vw``; keys past the split's end read as zeros."""
    for u in range(unroll):
        vk = base + u * groups + kg
        key = vk if vk < ns else vk - ns + lo
        ok = vk < v_end
        bi, row, ok = cache_slot(paged, key, ok, b, block_table, k.shape[0], page_size,
                                 page_shift)
        for c in range(ch):
            w = (sub + c * lpk) * 4
            if ok:
                a0, a1, a2, a3 = ld_v4(k, bi, row, hk, w)
                c0, c1, c2, c3 = ld_v4(v, bi, row, hk, w)
            else:
                a0 = a1 = a2 = a3 = np.uint32(0)
                c0 = c1 = c2 = c3 = np.uint32(0)
            o = (u * ch + c) * 4
            kw[o] = a0
            kw[o + 1] = a1
            kw[o + 2] = a2
            kw[o + 3] = a3
            vw[o] = c0
            vw[o + 1] = c1
            vw[o + 2] = c2
            vw[o + 3] = c3


@inlined
def key_scores(sc, kw, qf, bf16, unroll, rows, ch, epl, log_lpk):
    """Scores of the iteration's keys against the rows: partial fp32 dot products over this
    lane's elements (``sc[i * unroll + u]``), summed over the key's ``2^log_lpk`` lanes by
    xor-shuffles."""
    for u in range(unroll):
        for i in range(rows):
            sc[i * unroll + u] = np.float32(0.0)
        for c in range(ch):
            for j in range(4):
                k0, k1 = unpack16(bf16, kw[(u * ch + c) * 4 + j])
                for i in range(rows):
                    e = i * epl + c * 8 + j * 2
                    sc[i * unroll + u] += qf[e] * k0 + qf[e + 1] * k1
    for u in range(unroll):
        for i in range(rows):
            x = sc[i * unroll + u]
            for sh in range(log_lpk):
                x += shfl_xor(x, 1 << sh)
            sc[i * unroll + u] = x


@inlined
def mask_scores(sc, qpos, rmask0, rmask1, base, kg, ns, lo, v_end, tree_start, scale_log2,
                cap_in, cap_out, window_left, window_right, sinks, has_left, has_right,
                has_sinks, has_softcap, has_tree, unroll, rows, groups):
    """Softcap the scores ``sc`` (when on) and set the pairs the masks hide to -inf: keys past
    the split, outside the window ``[qpos - window_left, qpos + window_right]`` (the first
    ``sinks`` keys visible causally) and, with a draft tree, tree nodes (keys from
    ``tree_start``) that are not the row's ancestors (``rmask0`` / ``rmask1``); keys before the
    tree are visible causally."""
    for u in range(unroll):
        vk = base + u * groups + kg
        kpos = vk if vk < ns else vk - ns + lo
        inrange = vk < v_end
        for i in range(rows):
            x = sc[i * unroll + u]
            if has_softcap:
                x = cap_out * math.tanh(cap_in * x)
            qp = qpos[i]
            vis = window_visible_decode(inrange, kpos, qp, window_left, window_right, sinks,
                                        has_left, has_right, has_sinks)
            if has_tree:
                vis = tree_visible(vis, kpos, qp, tree_start, rmask0[i], rmask1[i])
            if not vis:
                x = np.float32(-math.inf)
            sc[i * unroll + u] = x


@inlined
def softmax_rows(sc, mrow, lrow, acc, unroll, rows, epl):
    """One online-softmax step of every row in this key group's own state: new running maximum
    ``mrow``, ``sc`` turned into probabilities, running sum ``lrow`` and ``acc`` rescaled."""
    for i in range(rows):
        mx = mrow[i]
        for u in range(unroll):
            mx = max(mx, sc[i * unroll + u])
        mu = mx if mx != -math.inf else np.float32(0.0)
        alpha = exp2(mrow[i] - mu)
        mrow[i] = mx
        rs = np.float32(0.0)
        for u in range(unroll):
            p = exp2(sc[i * unroll + u] - mu)
            sc[i * unroll + u] = p
            rs += p
        lrow[i] = lrow[i] * alpha + rs
        for e in range(epl):
            acc[i * epl + e] *= alpha


@inlined
def accumulate_pv(acc, vw, sc, bf16, unroll, rows, ch, epl):
    """``acc`` += P V of the iteration's keys (``vw``, unpacked pair by pair) for every row."""
    for u in range(unroll):
        for c in range(ch):
            for j in range(4):
                v0, v1 = unpack16(bf16, vw[(u * ch + c) * 4 + j])
                for i in range(rows):
                    p = sc[i * unroll + u]
                    e = i * epl + c * 8 + j * 2
                    acc[e] += p * v0
                    acc[e + 1] += p * v1


@inlined
def post_state(sm_m, sm_l, sm_acc, mrow, lrow, acc, tid, rows, epl):
    """Post this lane's state of every row (maximum, sum, its ``epl`` accumulator elements) to
    row ``tid`` of the block's shared arrays."""
    for i in range(rows):
        sm_m[tid, i] = mrow[i]
        sm_l[tid, i] = lrow[i]
        for e in range(epl):
            sm_acc[tid, i * epl + e] = acc[i * epl + e]


@inlined
def merge_pair(sm_m, sm_l, sm_acc, i, w, states, groups, lpk, log_lpk, epl):
    """Combine the ``states`` posted key-group states of row ``i`` for output elements
    ``2w, 2w + 1``: the states of the lanes that loaded that 16-byte chunk (one per key group
    of each warp). Returns (mx, tot, o0, o1): the row's maximum, total weight and the two
    unnormalised outputs."""
    ch = w >> 2                    # 16-byte chunk of the row holding elements 2w, 2w+1
    owner = ch & (lpk - 1)         # the lane (within a key group) that loaded it
    e0 = i * epl + (ch >> log_lpk) * 8 + ((2 * w) & 7)
    mx = np.float32(-math.inf)
    for st in range(states):
        t = (st // groups) * 32 + (st % groups) * lpk + owner
        mx = max(mx, sm_m[t, i])
    mu = mx if mx != -math.inf else np.float32(0.0)
    tot = np.float32(0.0)
    o0 = np.float32(0.0)
    o1 = np.float32(0.0)
    for st in range(states):
        t = (st // groups) * 32 + (st % groups) * lpk + owner
        wt = exp2(sm_m[t, i] - mu)
        tot += sm_l[t, i] * wt
        o0 += sm_acc[t, e0] * wt
        o1 += sm_acc[t, e0 + 1] * wt
    return mx, tot, o0, o1


def make_decode_kernel(head_dim: int, is_bf16: bool, rows: int, paged: bool, has_left: bool,
                       has_right: bool, has_sinks: bool, has_softcap: bool, has_tree: bool,
                       direct: bool, write_lse: bool):
    """Build the decode kernel for one configuration (every argument compile-time).

    Kernel signature ``(q, k, v, block_table, cache_seqlens, tree_bits, out, lse, o_part,
    lse_part, heads_ratio, row_chunks, scale_log2, cap_in, cap_out, window_left, window_right,
    sinks, tree_len, page_size, page_shift)``:

    * q uint32 (B, Sq, Hq, D/2); k, v uint32 (B, S_max, Hkv, D/2), or paged
      (num_pages, page_size, Hkv, D/2) with block_table int32 (B, max_pages);
    * cache_seqlens int32 (B,); tree_bits uint32 (Sq, 2) (unused without a tree);
    * direct: out uint32 (B, Sq, Hq, D/2), lse float32 (B, Hq, Sq);
      else o_part float32 (splits, B, Sq, Hq, D), lse_part float32 (splits, B, Hq, Sq);
    * page_shift = log2(page_size) when a power of two, else -1.

    Grid ``(splits, B, Hkv * row_chunks)``, ``DECODE_WARPS * 32`` threads.
    """
    D = head_dim
    DW = D // 2
    R = rows
    LPK, EPL, U = decode_geometry(D, R)
    CH = EPL // 8                  # 16-byte chunks per lane per key
    LOG_LPK = int(math.log2(LPK))
    GROUPS = 32 // LPK             # key groups per warp
    KPW = GROUPS * U               # keys per warp per iteration
    NW = DECODE_WARPS
    NT = NW * 32
    KPB = NW * KPW                 # keys per block per iteration
    KWORDS = U * CH * 4
    RE, RU = R * EPL, R * U
    SMW = R * EPL + 1              # shared row per lane; +1 keeps the lanes on distinct banks
    # (The kernel calls the module's pack16 / unpack16 with this constant rather than holding
    # an intrinsic in its closure: Numba's disk cache hashes closure contents, and intrinsics
    # pickle differently in every process.)
    BF16 = bool(is_bf16)
    NEG_INF = -math.inf

    def kernel(q, k, v, block_table, cache_seqlens, tree_bits, out, lse, o_part, lse_part,
               heads_ratio, row_chunks, scale_log2, cap_in, cap_out, window_left, window_right,
               sinks, tree_len, page_size, page_shift):
        split = cuda.blockIdx.x
        n_splits = cuda.gridDim.x
        b = cuda.blockIdx.y
        hk = cuda.blockIdx.z // row_chunks
        chunk = cuda.blockIdx.z - hk * row_chunks
        seqlen_q = q.shape[1]
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        kg = lane >> LOG_LPK
        sub = lane & (LPK - 1)

        sm_acc = cuda.shared.array((NT, SMW), types.float32)
        sm_m = cuda.shared.array((NT, R), types.float32)
        sm_l = cuda.shared.array((NT, R), types.float32)
        qf = cuda.local.array(RE, types.float32)
        acc = cuda.local.array(RE, types.float32)
        mrow = cuda.local.array(R, types.float32)
        lrow = cuda.local.array(R, types.float32)
        qpos = cuda.local.array(R, types.int32)
        rmask0 = cuda.local.array(R, types.uint32)
        rmask1 = cuda.local.array(R, types.uint32)
        kw = cuda.local.array(KWORDS, types.uint32)
        vw = cuda.local.array(KWORDS, types.uint32)
        sc = cuda.local.array(RU, types.float32)

        if paged:
            capacity = block_table.shape[1] * page_size
        else:
            capacity = k.shape[1]
        n = cache_seqlens[b]
        n = max(0, min(n, capacity))    # memory safety only: the host validates when asked
        offset = n - seqlen_q
        m_rows = heads_ratio * seqlen_q

        # Packed rows: row i of this chunk is (query head hk * ratio + gi, query s).
        load_query_rows(qf, acc, mrow, lrow, qpos, rmask0, rmask1, q, tree_bits, b, hk, chunk,
                        heads_ratio, seqlen_q, m_rows, offset, sub, scale_log2, has_tree,
                        has_softcap, BF16, R, CH, LPK, EPL)

        # Keys this chunk's rows may see: the window [lo, hi) plus sinks [0, ns) below it.
        chunk_rows, q_lo, q_hi, lo, ns, v_start, v_end = split_keys(
            chunk, R, m_rows, seqlen_q, n, has_left, has_right, has_sinks, window_left,
            window_right, sinks, n_splits, split, KPB)
        tree_start = n - tree_len

        base = v_start + warp * KPW
        while base < v_end:
            # Issue every load of the iteration first (load_keys); consume them afterwards.
            load_keys(kw, vw, k, v, block_table, b, hk, base, kg, sub, ns, lo, v_end, paged,
                      page_size, page_shift, U, GROUPS, CH, LPK)
            key_scores(sc, kw, qf, BF16, U, R, CH, EPL, LOG_LPK)
            mask_scores(sc, qpos, rmask0, rmask1, base, kg, ns, lo, v_end, tree_start,
                        scale_log2, cap_in, cap_out, window_left, window_right, sinks, has_left,
                        has_right, has_sinks, has_softcap, has_tree, U, R, GROUPS)
            # Online softmax per row, in this key group's own state.
            softmax_rows(sc, mrow, lrow, acc, U, R, EPL)
            accumulate_pv(acc, vw, sc, BF16, U, R, CH, EPL)
            base += KPB

        # Every lane posts its key group's state; then each thread merges the NW * GROUPS states
        # of the output elements it finishes (pairs, for packed 16-bit stores).
        post_state(sm_m, sm_l, sm_acc, mrow, lrow, acc, tid, R, EPL)
        cuda.syncthreads()

        for idx in range(tid, R * DW, NT):
            i = idx // DW
            w = idx - i * DW
            rr = chunk * R + i
            if rr < m_rows:
                gi = rr // seqlen_q
                s = rr - gi * seqlen_q
                h = hk * heads_ratio + gi
                mx, tot, o0, o1 = merge_pair(sm_m, sm_l, sm_acc, i, w, NW * GROUPS, GROUPS, LPK,
                                             LOG_LPK, EPL)
                inv = np.float32(0.0)
                if tot != 0:
                    inv = np.float32(1.0) / tot
                lse_val = np.float32(NEG_INF)
                if tot != 0:
                    lse_val = (mx + math.log2(tot)) * np.float32(LN2)
                if direct:
                    out[b, s, h, w] = pack16(BF16, o0 * inv, o1 * inv)
                    if write_lse and w == 0:
                        lse[b, h, s] = lse_val
                else:
                    o_part[split, b, s, h, 2 * w] = o0 * inv
                    o_part[split, b, s, h, 2 * w + 1] = o1 * inv
                    if w == 0:
                        lse_part[split, b, h, s] = lse_val

    return jit_kernel(kernel, ("decode", head_dim, is_bf16, rows, paged, has_left, has_right,
                               has_sinks, has_softcap, has_tree, direct, write_lse))


# ----------------------------------------------------------------------------- launcher
