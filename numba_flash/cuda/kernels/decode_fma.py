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
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda
from numba.cuda import types

from ..primitives import exp2, ld_v4, pack16, shfl_xor, unpack16
from .decode_split import cache_slot, split_keys
from .jitcache import jit_kernel

__all__ = ["make_decode_kernel", "decode_kernel", "decode_geometry", "DECODE_WARPS", "MAX_ROWS"]

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
        for i in range(R):
            rr = chunk * R + i
            gi = rr // seqlen_q
            s = rr - gi * seqlen_q
            live = rr < m_rows
            h = hk * heads_ratio + gi
            qpos[i] = s + offset
            if has_tree:
                rmask0[i] = tree_bits[s if live else 0, 0]
                rmask1[i] = tree_bits[s if live else 0, 1]
            for c in range(CH):
                for j in range(4):
                    w = (sub + c * LPK) * 4 + j
                    x0 = np.float32(0.0)
                    x1 = np.float32(0.0)
                    if live:
                        x0, x1 = unpack16(BF16, q[b, s, h, w])
                    if not has_softcap:
                        x0 *= scale_log2
                        x1 *= scale_log2
                    qf[i * EPL + c * 8 + j * 2] = x0
                    qf[i * EPL + c * 8 + j * 2 + 1] = x1
            for e in range(EPL):
                acc[i * EPL + e] = np.float32(0.0)
            mrow[i] = np.float32(NEG_INF)
            lrow[i] = np.float32(0.0)

        # Keys this chunk's rows may see: the window [lo, hi) plus sinks [0, ns) below it.
        chunk_rows, q_lo, q_hi, lo, ns, v_start, v_end = split_keys(
            chunk, R, m_rows, seqlen_q, n, has_left, has_right, has_sinks, window_left,
            window_right, sinks, n_splits, split, KPB)
        tree_start = n - tree_len

        base = v_start + warp * KPW
        while base < v_end:
            # Issue every load of the iteration first; consume them afterwards.
            for u in range(U):
                vk = base + u * GROUPS + kg
                key = vk if vk < ns else vk - ns + lo
                ok = vk < v_end
                bi, row, ok = cache_slot(paged, key, ok, b, block_table, k.shape[0], page_size,
                                         page_shift)
                for c in range(CH):
                    w = (sub + c * LPK) * 4
                    if ok:
                        a0, a1, a2, a3 = ld_v4(k, bi, row, hk, w)
                        c0, c1, c2, c3 = ld_v4(v, bi, row, hk, w)
                    else:
                        a0 = a1 = a2 = a3 = np.uint32(0)
                        c0 = c1 = c2 = c3 = np.uint32(0)
                    o = (u * CH + c) * 4
                    kw[o] = a0
                    kw[o + 1] = a1
                    kw[o + 2] = a2
                    kw[o + 3] = a3
                    vw[o] = c0
                    vw[o + 1] = c1
                    vw[o + 2] = c2
                    vw[o + 3] = c3

            # Scores: partial dot products over this lane's elements, reduced over the LPK lanes.
            for u in range(U):
                for i in range(R):
                    sc[i * U + u] = np.float32(0.0)
                for c in range(CH):
                    for j in range(4):
                        k0, k1 = unpack16(BF16, kw[(u * CH + c) * 4 + j])
                        for i in range(R):
                            e = i * EPL + c * 8 + j * 2
                            sc[i * U + u] += qf[e] * k0 + qf[e + 1] * k1
            for u in range(U):
                for i in range(R):
                    x = sc[i * U + u]
                    for sh in range(LOG_LPK):
                        x += shfl_xor(x, 1 << sh)
                    sc[i * U + u] = x
            for u in range(U):
                vk = base + u * GROUPS + kg
                kpos = vk if vk < ns else vk - ns + lo
                inrange = vk < v_end
                for i in range(R):
                    x = sc[i * U + u]
                    if has_softcap:
                        x = cap_out * math.tanh(cap_in * x)
                    qp = qpos[i]
                    vis = inrange
                    if has_right:
                        vis = vis and kpos <= qp + window_right
                    if has_left:
                        inwin = kpos >= qp - window_left
                        if has_sinks:
                            inwin = inwin or (kpos < sinks and kpos <= qp)
                        vis = vis and inwin
                    if has_tree:
                        tk = kpos - tree_start
                        if tk >= 0:
                            word = rmask0[i] if tk < 32 else rmask1[i]
                            vis = vis and ((word >> (tk & 31)) & 1) != 0
                        else:
                            vis = vis and kpos <= qp
                    if not vis:
                        x = np.float32(NEG_INF)
                    sc[i * U + u] = x

            # Online softmax per row, in this key group's own state.
            for i in range(R):
                mx = mrow[i]
                for u in range(U):
                    mx = max(mx, sc[i * U + u])
                mu = mx if mx != NEG_INF else np.float32(0.0)
                alpha = exp2(mrow[i] - mu)
                mrow[i] = mx
                rs = np.float32(0.0)
                for u in range(U):
                    p = exp2(sc[i * U + u] - mu)
                    sc[i * U + u] = p
                    rs += p
                lrow[i] = lrow[i] * alpha + rs
                for e in range(EPL):
                    acc[i * EPL + e] *= alpha
            for u in range(U):
                for c in range(CH):
                    for j in range(4):
                        v0, v1 = unpack16(BF16, vw[(u * CH + c) * 4 + j])
                        for i in range(R):
                            p = sc[i * U + u]
                            e = i * EPL + c * 8 + j * 2
                            acc[e] += p * v0
                            acc[e + 1] += p * v1
            base += KPB

        # Every lane posts its key group's state; then each thread merges the NW * GROUPS states
        # of the output elements it finishes (pairs, for packed 16-bit stores).
        for i in range(R):
            sm_m[tid, i] = mrow[i]
            sm_l[tid, i] = lrow[i]
            for e in range(EPL):
                sm_acc[tid, i * EPL + e] = acc[i * EPL + e]
        cuda.syncthreads()

        for idx in range(tid, R * DW, NT):
            i = idx // DW
            w = idx - i * DW
            rr = chunk * R + i
            if rr < m_rows:
                gi = rr // seqlen_q
                s = rr - gi * seqlen_q
                h = hk * heads_ratio + gi
                ch = w >> 2                    # 16-byte chunk of the row holding elements 2w, 2w+1
                owner = ch & (LPK - 1)         # the lane (within a key group) that loaded it
                e0 = i * EPL + (ch >> LOG_LPK) * 8 + ((2 * w) & 7)
                mx = np.float32(NEG_INF)
                for st in range(NW * GROUPS):
                    t = (st // GROUPS) * 32 + (st % GROUPS) * LPK + owner
                    mx = max(mx, sm_m[t, i])
                mu = mx if mx != NEG_INF else np.float32(0.0)
                tot = np.float32(0.0)
                o0 = np.float32(0.0)
                o1 = np.float32(0.0)
                for st in range(NW * GROUPS):
                    t = (st // GROUPS) * 32 + (st % GROUPS) * LPK + owner
                    wt = exp2(sm_m[t, i] - mu)
                    tot += sm_l[t, i] * wt
                    o0 += sm_acc[t, e0] * wt
                    o1 += sm_acc[t, e0 + 1] * wt
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

    return jit_kernel(kernel, ("decode", head_dim, is_bf16, rows, paged, has_left, has_right, has_sinks,
                         has_softcap, has_tree, direct, write_lse))


# ----------------------------------------------------------------------------- launcher
