"""Split-KV decode on tensor cores: one warp per (split, batch item, kv head, 16-row chunk).

The ``group * seqlen_q`` query rows that share a kv head (GQA packing) fill the 16 rows of an
m16n8k16 tile (rows past them are zero queries whose results are never written), so every K/V
byte of a split is read once for all of them:

* Q's A fragments sit in registers for the whole key loop (``D / 4`` words per lane);
* K and V tiles of ``BN`` keys stream into the warp's own ring of ``STAGES`` shared-memory
  buffers through ``cp.async`` (16 bytes per copy, zero-filled past the split's end), so
  ``STAGES - 1`` tiles are in flight while one is consumed; no block barrier anywhere;
* S = Q K^T from ``ldmatrix`` B fragments, online softmax on the accumulator fragment, which is
  already the A operand layout of O += P V (P never leaves registers; V fragments through
  ``ldmatrix.trans``), as in forward_mma.py.

A block holds ``WARPS`` independent warps: warp w of block x is split ``x * WARPS + w`` (more
warps per block only pack more splits per block; they never communicate). With one split the
warp writes the output and lse directly, else an fp32 partial state (normalised o, natural-log
lse); the last warp of each chunk to finish then merges them (``fold``). Masks as in
decode_fma.py's CUDA-core kernel: window / sinks / a draft tree of at most 64 nodes, keys
counted on the same "virtual" axis (sink keys, then the window).

The kernel body is the algorithm; the ``@inlined`` device functions below are its steps:
the lane's rows and Q fragments (``lane_layout``, ``lane_rows``, ``tree_words``,
``load_q_fragments``), the K/V tile pipeline (``fast_copy_fits`` and the three tile copies,
``cp_async_wait_behind``), one tile's S = Q K^T, mask and online softmax, O += P V
(``tile_scores``, ``tile_mask_max``, ``online_softmax``, ``tile_pv``), the output
(``finish_rows``, ``store_row``) and the folded merge (``arrive``, ``merge_layout``,
``merge_row``). The cuts keep the machine code of every configuration byte-identical to the
single-body kernel they came from (scripts/sass_snapshot_decode.py --compare): evaluation
order, loop structure and every expression's operand order as they were. Cuts that changed
it (register allocation) were left out: the tile's "every pair visible" test as a helper of its
own or inside ``tile_mask_max`` (it stays in the body), and the per-key window / sinks test as
a function shared with decode_fma.py (written out in ``tile_mask_max``; the tree test,
``tree_visible``, is shared).
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda
from numba.cuda import types

from ..primitives import (SIMULATOR, arrive_acq_rel, bcast0, cp_async16,
                          cp_async16_maybe_hint, cp_async_commit, cp_async_wait_1, cp_async_wait_2,
                          cp_async_wait_3, evict_first_policy, exp2, ld2, ldmatrix_x4,
                          ldmatrix_x4_trans, mma16, pack16, shfl_idx, shfl_xor, st2, syncwarp)
from .decode_fma import tree_visible
from .decode_split import cache_slot, split_keys
from .jitcache import jit_kernel
from ..primitives.base import inlined

__all__ = ["make_mma_decode_kernel", "mma_decode_supported", "mma_smem_bytes", "MMA_ROWS"]

MMA_ROWS = 16
LN2 = 0.6931471805599453
LOG2E = 1.4426950408889634


def mma_decode_supported(head_dim: int) -> bool:
    """Whether the tensor-core decode kernel takes this head_dim (multiples of 16 up to 128:
    beyond, Q fragments plus the accumulator pass the register budget)."""
    return head_dim % 16 == 0 and 16 <= head_dim <= 128


def _row_words(head_dim: int) -> tuple[int, int]:
    """(words per shared row, swizzle mask): rows of a multiple of 8 16-byte chunks are
    XOR-swizzled, others padded by 16 bytes, so an ldmatrix's 8 rows hit distinct banks."""
    dw = head_dim // 2
    if (head_dim // 8) % 8 == 0:
        return dw, 28
    return dw + 4, 0


def mma_smem_bytes(head_dim: int, block_n: int, stages: int, warps: int) -> int:
    """Static shared memory of one block: K and V rings of every warp."""
    kw, _ = _row_words(head_dim)
    return 2 * warps * stages * block_n * kw * 4


def _check_tile(head_dim: int, block_n: int, stages: int, warps: int):
    """Raise ValueError for a tile the kernel does not take."""
    if (block_n * (head_dim // 8) % 32 or block_n % 16 or not 2 <= stages <= 4
            or mma_smem_bytes(head_dim, block_n, stages, warps) > 49152):
        raise ValueError(f"unsupported decode tile: block_n {block_n}, stages {stages}, warps "
                         f"{warps} at head_dim {head_dim} (block_n a multiple of 16, stages "
                         f"2..4, K/V rings within 48 KB of shared memory)")


def _scatter_levels(ndtiles: int) -> int:
    """Reduce-scatter levels of the folded merge's group combination that keep whole output
    pairs in a lane (``2 * ndtiles >> levels`` stays even): min(3, the power of two dividing
    ``ndtiles``)."""
    levels = 0
    while levels < 3 and ndtiles % (2 << levels) == 0:
        levels += 1
    return levels


def _fast_copy_geometry(head_dim: int, block_n: int, paged: bool, page_pow2: int):
    """(RPI, PAGE, PSHIFT, FAST, NPG) of the fast copy (``make_mma_decode_kernel``'s
    ``page_pow2``): lanes cover whole rows, RPI rows per warp instruction (0: no fast copy);
    PAGE / PSHIFT the power-of-two page size and its log2 (0 when contiguous or not a power of
    two); FAST whether the tile takes the fast copy at all; NPG pages per tile on it."""
    cpr = head_dim // 8
    rpi = 32 // cpr if 32 % cpr == 0 else 0
    page = int(page_pow2) if paged else 0
    pshift = page.bit_length() - 1 if page else 0
    fast = rpi > 0 and (not paged or (page > 0 and page % rpi == 0
                                      and (page >= block_n or block_n % page == 0)))
    npg = block_n // page if 0 < page < block_n else 1
    return rpi, page, pshift, fast, npg


# ----------------------------------------------------------------------------- the lane's rows
@inlined
def lane_layout(lane, swz_mask):
    """(g, t, k_row, k_col, v_row, v_col, swz) of a lane: its fragment row group ``g`` and
    column pair ``t`` (mma.sync layout), the shared row and word column it gives ``ldmatrix``
    for K (x4: two n-tiles by two k-halves) and for V (x4.trans), and its XOR swizzle."""
    g = lane >> 2
    t = lane & 3
    k_row = (lane >> 4) * 8 + (lane & 7)
    k_col = ((lane >> 3) & 1) * 4
    v_row = ((lane >> 3) & 1) * 8 + (lane & 7)
    v_col = (lane >> 4) * 4
    swz = swz_mask & ((lane & 7) << 2)
    return g, t, k_row, k_col, v_row, v_col, swz


@inlined
def cache_length(k, block_table, cache_seqlens, b, page_size, paged, full_lens):
    """Keys of sequence ``b``: ``cache_seqlens[b]`` clamped to the cache's capacity, or the
    capacity itself with ``full_lens``."""
    if paged:
        capacity = block_table.shape[1] * page_size
    else:
        capacity = k.shape[1]
    if full_lens:
        n = capacity
    else:
        n = cache_seqlens[b]
        n = max(0, min(n, capacity))    # memory safety only: the host validates when asked
    return n


@inlined
def lane_rows(chunk, g, m_rows, seqlen_q, hk, heads_ratio, offset):
    """The lane's two rows, g and g + 8 of the 16-row chunk: (live0, live1, s0, s1, h0, h1,
    qpos0, qpos1): whether the packed row exists, its query index, query head and key position
    (packed row i is query ``i % seqlen_q`` of head ``hk * heads_ratio + i // seqlen_q``)."""
    rr0 = chunk * 16 + g
    rr1 = rr0 + 8
    live0 = rr0 < m_rows
    live1 = rr1 < m_rows
    gi0 = rr0 // seqlen_q
    gi1 = rr1 // seqlen_q
    s0 = rr0 - gi0 * seqlen_q
    s1 = rr1 - gi1 * seqlen_q
    h0 = hk * heads_ratio + gi0
    h1 = hk * heads_ratio + gi1
    qpos0 = s0 + offset
    qpos1 = s1 + offset
    return live0, live1, s0, s1, h0, h1, qpos0, qpos1


@inlined
def tree_words(tree_bits, s0, live0, s1, live1, has_tree):
    """(tb00, tb01, tb10, tb11): the draft-tree visibility words (nodes 0..31, 32..63) of the
    lane's two query rows (zeros without a tree)."""
    tb00 = np.uint32(0)
    tb01 = np.uint32(0)
    tb10 = np.uint32(0)
    tb11 = np.uint32(0)
    if has_tree:
        tb00 = tree_bits[s0 if live0 else 0, 0]
        tb01 = tree_bits[s0 if live0 else 0, 1]
        tb10 = tree_bits[s1 if live1 else 0, 0]
        tb11 = tree_bits[s1 if live1 else 0, 1]
    return tb00, tb01, tb10, tb11


@inlined
def load_q_fragments(qf, q, b, s0, h0, live0, s1, h1, live1, t, ksteps):
    """Q's A fragments of the ``ksteps`` k-steps into ``qf`` (4 words per k-step: rows g and
    g + 8, columns t and t + 4 of the step's 8 words); a row that does not exist is zeros."""
    zero_w = np.uint32(0)
    for kk in range(ksteps):
        w = kk * 8 + t
        x0 = zero_w
        x2 = zero_w
        if live0:
            x0 = q[b, s0, h0, w]
            x2 = q[b, s0, h0, w + 4]
        x1 = zero_w
        x3 = zero_w
        if live1:
            x1 = q[b, s1, h1, w]
            x3 = q[b, s1, h1, w + 4]
        qf[kk * 4] = x0
        qf[kk * 4 + 1] = x1
        qf[kk * 4 + 2] = x2
        qf[kk * 4 + 3] = x3


# ----------------------------------------------------------------------------- K/V tile pipeline
@inlined
def fast_copy_offsets(k, v, b, hk, lane, paged, cpr):
    """(lrow, lcol, ksr, vsr, kl, vl, ksp, vsp, n_pages) of the fast copies: this lane's first
    row and word column of a tile, the key-row strides of K and V in words, the element offsets
    of that row and column (the tile's key row and page are added per tile, the row step per
    copy), the page strides and the page count."""
    lrow = lane // cpr
    lcol = (lane - lrow * cpr) * 4
    ksr = np.int64(k.strides[1] // 4)
    vsr = np.int64(v.strides[1] // 4)
    kl = hk * np.int64(k.strides[2] // 4) + lcol + lrow * ksr
    vl = hk * np.int64(v.strides[2] // 4) + lcol + lrow * vsr
    if not paged:
        kl += b * np.int64(k.strides[0] // 4)
        vl += b * np.int64(v.strides[0] // 4)
    ksp = np.int64(k.strides[0] // 4)
    vsp = np.int64(v.strides[0] // 4)
    n_pages = k.shape[0]
    return lrow, lcol, ksr, vsr, kl, vl, ksp, vsp, n_pages


@inlined
def fast_copy_fits(t0, kstart, v_end, ns, paged, page_pow2, block_n):
    """Does the tile of virtual keys ``[t0, t0 + block_n)`` (first key ``kstart``) take the
    fast copy: every key in the split, past the sinks, and within one page (or whole pages)?"""
    fast_tile = t0 + block_n <= v_end and t0 >= ns
    if paged:
        if page_pow2 >= block_n:
            fast_tile = fast_tile and (kstart & (page_pow2 - 1)) <= page_pow2 - block_n
        else:
            fast_tile = fast_tile and (kstart & (page_pow2 - 1)) == 0   # whole pages
    return fast_tile


@inlined
def copy_tile_pages(ks, vs, k, v, block_table, b, lane, dst0, kstart, bt_base, bt_reg, bt_cols,
                    n_pages, kl, vl, ksp, vsp, ksr, vsr, lrow, lcol, hint, policy, page_pow2,
                    page_shift, pages, block_n, loads, rpi, swz_mask):
    """Fast copy of a paged tile (keys from ``kstart``, ``pages`` pages of it) into ring rows
    ``dst0..`` of ``ks`` / ``vs``. The warp keeps 32 consecutive block-table entries in
    registers (lane i holds entry ``bt_base + i`` in ``bt_reg``) and takes a page by shuffle,
    reloading them (one coalesced load) when the tile's pages leave that window; returns the
    window (bt_base, bt_reg)."""
    p0 = kstart >> page_shift
    if p0 < bt_base or p0 + pages > bt_base + 32:      # warp-uniform
        bt_base = p0
        bt_reg = np.int32(0)
        if p0 + lane < bt_cols:
            bt_reg = block_table[b, p0 + lane]
    for pi in range(pages):
        page = shfl_idx(bt_reg, p0 - bt_base + pi)
        if page < 0 or page >= n_pages:
            page = 0          # memory safety only (see check_indices)
        kb = page * ksp + kl
        vb = page * vsp + vl
        if page_pow2 >= block_n:
            kb += (kstart & (page_pow2 - 1)) * ksr
            vb += (kstart & (page_pow2 - 1)) * vsr
        for it2 in range(loads // pages):
            rr = (pi * (loads // pages) + it2) * rpi
            r = rr + lrow
            dc = lcol ^ (swz_mask & ((r & 7) << 2))
            pr = rr - pi * (block_n // pages)
            cp_async16_maybe_hint(hint, ks, dst0 + r, dc, k, kb + pr * ksr, 16, policy)
            cp_async16_maybe_hint(hint, vs, dst0 + r, dc, v, vb + pr * vsr, 16, policy)
    return bt_base, bt_reg


@inlined
def copy_tile_rows(ks, vs, k, v, dst0, kstart, kl, vl, ksr, vsr, lrow, lcol, hint, policy,
                   loads, rpi, swz_mask):
    """Fast copy of a contiguous tile (keys from ``kstart``) into ring rows ``dst0..``: ``loads``
    16-byte copies of K and of V per lane, ``rpi`` rows per warp instruction."""
    kb = kstart * ksr + kl
    vb = kstart * vsr + vl
    for it in range(loads):
        r = it * rpi + lrow
        dc = lcol ^ (swz_mask & ((r & 7) << 2))
        cp_async16_maybe_hint(hint, ks, dst0 + r, dc, k, kb + (it * rpi) * ksr, 16, policy)
        cp_async16_maybe_hint(hint, vs, dst0 + r, dc, v, vb + (it * rpi) * vsr, 16, policy)


@inlined
def copy_tile_any(ks, vs, k, v, block_table, b, hk, lane, dst0, t0, v_end, ns, lo, paged,
                  page_size, page_shift, loads, cpr, swz_mask):
    """General copy of the tile of virtual keys from ``t0`` into ring rows ``dst0..``: every
    16-byte copy looks its key's slot up (sinks, window, page); keys past the split's end are
    zero-filled."""
    for it in range(loads):
        i = it * 32 + lane
        r = i // cpr
        c = (i - r * cpr) * 4
        vk = t0 + r
        ok = vk < v_end
        key = vk if vk < ns else vk - ns + lo
        bi, row, ok = cache_slot(paged, key, ok, b, block_table, k.shape[0], page_size,
                                 page_shift)
        if not ok:
            row = 0
        dc = c ^ (swz_mask & ((r & 7) << 2))
        nbytes = 16 if ok else 0
        cp_async16(ks, dst0 + r, dc, k, bi, row, hk, c, nbytes)
        cp_async16(vs, dst0 + r, dc, v, bi, row, hk, c, nbytes)


@inlined
def cp_async_wait_behind(n):
    """Wait until at most ``n`` (1..3, compile-time) committed copy groups are in flight."""
    if n == 1:
        cp_async_wait_1()
    elif n == 2:
        cp_async_wait_2()
    else:
        cp_async_wait_3()


# ----------------------------------------------------------------------------- one key tile
@inlined
def mma_into(bf16, a0, a1, a2, a3, b0, b1, c, j):
    """``c`` n-tile ``j`` (fragment registers ``4 j .. 4 j + 3``) += the A fragment ``a0..a3``
    times the B fragment ``(b0, b1)`` (one m16n8k16 ``mma.sync``)."""
    c0, c1, c2, c3 = mma16(bf16, a0, a1, a2, a3, b0, b1, c[j * 4], c[j * 4 + 1], c[j * 4 + 2],
                           c[j * 4 + 3])
    c[j * 4] = c0
    c[j * 4 + 1] = c1
    c[j * 4 + 2] = c2
    c[j * 4 + 3] = c3


@inlined
def mma_pair(bf16, a0, a1, a2, a3, b0, b1, b2, b3, c, j):
    """``c`` n-tiles ``j`` and ``j + 1`` += the A fragment ``a0..a3`` times the two B fragments
    ``(b0, b1)``, ``(b2, b3)`` of one ``ldmatrix_x4``."""
    mma_into(bf16, a0, a1, a2, a3, b0, b1, c, j)
    mma_into(bf16, a0, a1, a2, a3, b2, b3, c, j + 1)


@inlined
def tile_scores(bf16, s, qf, ks, base, k_row, k_col, swz, ksteps, ntiles):
    """S = Q K^T of one key tile: ``s`` (``ntiles`` n-tiles of 8 keys) from the Q fragments
    ``qf`` (``ksteps`` k-steps) and the tile's K rows in shared ``ks`` from row ``base`` (this
    lane's ldmatrix row ``k_row`` of each 16, column ``k_col``, swizzle ``swz``)."""
    for i in range(ntiles * 4):
        s[i] = np.float32(0.0)
    for kk in range(ksteps):
        a0 = qf[kk * 4]
        a1 = qf[kk * 4 + 1]
        a2 = qf[kk * 4 + 2]
        a3 = qf[kk * 4 + 3]
        for jj in range(ntiles // 2):
            b0, b1, b2, b3 = ldmatrix_x4(ks, base + jj * 16 + k_row, (kk * 8 + k_col) ^ swz)
            mma_pair(bf16, a0, a1, a2, a3, b0, b1, b2, b3, s, 2 * jj)


@inlined
def tile_mask_max(s, full, kb0, t, ns, lo, v_end, qpos0, qpos1, tb00, tb01, tb10, tb11,
                  tree_start, scale_log2, cap_in, cap_out, window_left, window_right, sinks,
                  has_left, has_right, has_sinks, has_softcap, has_tree, ntiles):
    """Scale (or softcap) the tile's scores ``s`` in place, base 2, and unless ``full`` (every
    pair visible) set the pairs the masks hide to -inf: keys past the split, outside the window
    (sinks excepted) and, with a draft tree, tree nodes that are not the row's ancestors.
    Returns (mx0, mx1), this lane's maxima of its two rows."""
    mx0 = np.float32(-math.inf)
    mx1 = np.float32(-math.inf)
    for j in range(ntiles):
        for e in range(4):
            x = s[j * 4 + e]
            if has_softcap:
                x = cap_out * math.tanh(cap_in * x)
            else:
                x = x * scale_log2
            if not full:
                vk = kb0 + j * 8 + 2 * t + (e & 1)
                kpos = vk if vk < ns else vk - ns + lo
                qp = qpos0 if e < 2 else qpos1
                vis = vk < v_end
                # decode_split.window_visible_decode, written out: as a call it changed this
                # kernel's machine code (paged, folded merge: 5472 -> 5488 instructions).
                if has_right:
                    vis = vis and kpos <= qp + window_right
                if has_left:
                    inwin = kpos >= qp - window_left
                    if has_sinks:
                        inwin = inwin or (kpos < sinks and kpos <= qp)
                    vis = vis and inwin
                if has_tree:
                    if e < 2:
                        vis = tree_visible(vis, kpos, qp, tree_start, tb00, tb01)
                    else:
                        vis = tree_visible(vis, kpos, qp, tree_start, tb10, tb11)
                if not vis:
                    x = np.float32(-math.inf)
            s[j * 4 + e] = x
            if e < 2:
                mx0 = max(mx0, x)
            else:
                mx1 = max(mx1, x)
    return mx0, mx1


@inlined
def online_softmax(s, acc, m0, m1, l0, l1, mx0, mx1, ntiles, ndtiles):
    """One online-softmax step of the lane's two rows: the new running maxima from the tile's
    (``mx0``, ``mx1``, reduced over the quad), ``s`` turned into probabilities, the running sums
    ``l0`` / ``l1`` (per lane; the quad sums them at the end) and the ``ndtiles`` output
    n-tiles of ``acc`` rescaled. Returns (m0, m1, l0, l1)."""
    mx0 = max(mx0, shfl_xor(mx0, 1))
    mx0 = max(mx0, shfl_xor(mx0, 2))
    mx1 = max(mx1, shfl_xor(mx1, 1))
    mx1 = max(mx1, shfl_xor(mx1, 2))
    mn0 = max(m0, mx0)
    mn1 = max(m1, mx1)
    mu0 = mn0 if mn0 != -math.inf else np.float32(0.0)
    mu1 = mn1 if mn1 != -math.inf else np.float32(0.0)
    alpha0 = exp2(m0 - mu0)
    alpha1 = exp2(m1 - mu1)
    m0 = mn0
    m1 = mn1
    rs0 = np.float32(0.0)
    rs1 = np.float32(0.0)
    for j in range(ntiles):
        p0 = exp2(s[j * 4] - mu0)
        p1 = exp2(s[j * 4 + 1] - mu0)
        p2 = exp2(s[j * 4 + 2] - mu1)
        p3 = exp2(s[j * 4 + 3] - mu1)
        s[j * 4] = p0
        s[j * 4 + 1] = p1
        s[j * 4 + 2] = p2
        s[j * 4 + 3] = p3
        rs0 += p0 + p1
        rs1 += p2 + p3
    l0 = l0 * alpha0 + rs0
    l1 = l1 * alpha1 + rs1
    for dn in range(ndtiles):
        acc[dn * 4] *= alpha0
        acc[dn * 4 + 1] *= alpha0
        acc[dn * 4 + 2] *= alpha1
        acc[dn * 4 + 3] *= alpha1
    return m0, m1, l0, l1


@inlined
def tile_pv(bf16, acc, p, vs, base, v_row, v_col, swz, ksteps, ntiles):
    """O += P V of one key tile: the probabilities ``p`` (the score fragments, packed to 16 bits
    as A fragments, ``ksteps`` k-steps of 16 keys) times the tile's V rows in shared ``vs``
    (``ldmatrix.trans`` from row ``base``, lane row ``v_row``, column ``v_col``), into ``ntiles``
    n-tiles of ``acc``."""
    for kb in range(ksteps):
        a0 = pack16(bf16, p[kb * 8], p[kb * 8 + 1])
        a1 = pack16(bf16, p[kb * 8 + 2], p[kb * 8 + 3])
        a2 = pack16(bf16, p[kb * 8 + 4], p[kb * 8 + 5])
        a3 = pack16(bf16, p[kb * 8 + 6], p[kb * 8 + 7])
        for dd in range(ntiles // 2):
            b0, b1, b2, b3 = ldmatrix_x4_trans(vs, base + kb * 16 + v_row, (dd * 8 + v_col) ^ swz)
            mma_pair(bf16, a0, a1, a2, a3, b0, b1, b2, b3, acc, 2 * dd)


# ----------------------------------------------------------------------------- output
@inlined
def finish_rows(m0, m1, l0, l1):
    """(inv0, inv1, lse0, lse1) of the lane's two rows after the key loop: the quad's sum of
    the running sums, its reciprocal (0 for a row that saw no key) and the natural-log lse
    (-inf then)."""
    l0 += shfl_xor(l0, 1)
    l0 += shfl_xor(l0, 2)
    l1 += shfl_xor(l1, 1)
    l1 += shfl_xor(l1, 2)
    inv0 = np.float32(0.0)
    inv1 = np.float32(0.0)
    lse0 = np.float32(-math.inf)
    lse1 = np.float32(-math.inf)
    if l0 != 0:
        inv0 = np.float32(1.0) / l0
        lse0 = (m0 + math.log2(l0)) * np.float32(LN2)
    if l1 != 0:
        inv1 = np.float32(1.0) / l1
        lse1 = (m1 + math.log2(l1)) * np.float32(LN2)
    return inv0, inv1, lse0, lse1


@inlined
def store_row(out, lse, o_part, lse_part, acc, half, split, b, sq, hh, t, inv, lse_v, direct,
              write_lse, bf16, ndtiles):
    """Write one of the lane's rows (``half`` 0: row g, accumulator registers 0, 1 of each
    n-tile; 2: row g + 8, registers 2, 3) times ``inv``: ``direct``, the 16-bit output and lse
    (``write_lse``); else the split's fp32 partial state (8-byte stores) and its lse."""
    for dn in range(ndtiles):
        if direct:
            out[b, sq, hh, dn * 4 + t] = pack16(bf16, acc[dn * 4 + half] * inv,
                                                acc[dn * 4 + half + 1] * inv)
        else:
            st2(o_part, split, b, sq, hh, dn * 8 + 2 * t, acc[dn * 4 + half] * inv,
                acc[dn * 4 + half + 1] * inv)
    if t == 0:
        if direct:
            if write_lse:
                lse[b, hh, sq] = lse_v
        else:
            lse_part[split, b, hh, sq] = lse_v


# ----------------------------------------------------------------------------- folded merge
@inlined
def merge_layout(rl, g, chunk, seqlen_q, hk, heads_ratio, rs):
    """The merge's lane layout for a chunk of ``rl`` live rows: (lg, n_groups, slot, j, mbase,
    ls, sqa, hha, sqb, hhb). Lane group g takes row slot ``slot = g % RP`` (RP = live rows
    rounded up to a power of two, at most 8; 16 rows take two passes) and every
    ``n_groups``-th split from ``j = g // RP`` (``n_groups = 2^lg = 8 / RP`` groups per row);
    ``mbase`` is the lane-mask bit of j's bit 0, ``ls = min(lg, rs)`` the scatter levels the
    row's groups go through; rows ``slot`` (pass 0) and ``8 + slot`` (pass 1) are query
    ``sqa`` / ``sqb`` of head ``hha`` / ``hhb`` (32-bit division: rows and seqlen_q are
    small)."""
    lr = 0
    if rl > 1:
        lr = 1
    if rl > 2:
        lr = 2
    if rl > 4:
        lr = 3
    lg = 3 - lr
    n_groups = 1 << lg
    slot = g & ((1 << lr) - 1)
    j = g >> lr
    mbase = 4 << lr
    ls = min(lg, rs)
    rra = np.int32(chunk * 16 + slot)
    gia = rra // np.int32(seqlen_q)
    sqa = rra - gia * np.int32(seqlen_q)
    hha = hk * heads_ratio + gia
    rrb = rra + np.int32(8)
    gib = rrb // np.int32(seqlen_q)
    sqb = rrb - gib * np.int32(seqlen_q)
    hhb = hk * heads_ratio + gib
    return lg, n_groups, slot, j, mbase, ls, sqa, hha, sqb, hhb


@inlined
def arrive(counters, b, lane):
    """Publish this warp's partial state and count its arrival: (arrived, cidx), the counter's
    value before this warp's increment (the same in every lane) and its index.

    Memory-model argument (PTX ISA, "Memory Consistency Model"):

    * Release: every lane's partial-state stores precede this ``__syncwarp`` (bar.warp.sync,
      which orders memory among the lanes taking part), which precedes lane 0's
      atom.acq_rel.gpu in program order; the release side of that atom is cumulative (it covers
      every write that precedes it in causality order, the other lanes' included), so one
      atomic publishes the whole warp's state at GPU scope. It replaces a fence.sc.gpu
      (MEMBAR.SC + L1 invalidation) by every lane.
    * Acquire: the warp that brings the counter to n_splits - 1 reads, through the chain of
      atomic read-modify-writes on the counter (observation order relates a write to a read
      through atomic RMWs), the value of every earlier warp's release: its acquire
      synchronizes with all of them. The caller's ``__syncwarp`` after it orders lane 0's
      acquire before every lane's loads of the other splits' states.

    CUTLASS's generic barrier (cutlass/barrier.h: __syncthreads, then one thread's
    red.release.gpu / ld.acquire.gpu) and cooperative groups' grid sync (one thread fences for
    its block after a block barrier) rely on the same cumulativity.
    """
    syncwarp()
    cidx = b * cuda.gridDim.z + cuda.blockIdx.z
    arrived = np.int32(0)
    if lane == 0:
        arrived = arrive_acq_rel(counters, cidx)
    arrived = bcast0(arrived)
    return arrived, cidx


@inlined
def load_partial(x, base, o_part, lse_part, sp, b, hh, sq, t, ndtiles):
    """Split ``sp``'s partial state of row (query ``sq``, head ``hh``): this lane's output
    pairs into ``x[base:]`` (8-byte loads), its lse returned."""
    la = lse_part[sp, b, hh, sq]
    for dn in range(ndtiles):
        x0, x1 = ld2(o_part, sp, b, sq, hh, dn * 8 + 2 * t)
        x[base + 2 * dn] = x0
        x[base + 2 * dn + 1] = x1
    return la


@inlined
def gather_splits(macc, xs, lsv, o_part, lse_part, live, b, hh, sq, t, j, n_groups, n_splits,
                  ndtiles, mf, batch):
    """This lane group's share of a row's merge: splits ``j, j + n_groups, ...``, ``batch``
    per iteration with all their loads issued together (the tail is bound by the latency of
    these L2 reads: 66 splits of 8 rows took ~10 us two at a time), combined into ``macc``
    (``mf`` values) under a running maximum. Every split, this warp's own included, is read
    back from memory, so the summation order does not depend on which warp arrives last
    (bitwise reproducible results). Returns (m, tot): the group's maximum lse and its sum of
    weights."""
    m = np.float32(-math.inf)
    tot = np.float32(0.0)
    for e in range(mf):
        macc[e] = np.float32(0.0)
    if live:
        # A split past the end (lse -inf, weight exp2(-inf) = 0) leaves its slot of xs as it
        # was: zeros or an earlier split's values.
        for e in range(batch * mf):
            xs[e] = np.float32(0.0)
        for sp0 in range(j, n_splits, batch * n_groups):
            mn = m
            for u in range(batch):
                sp = sp0 + u * n_groups
                la = np.float32(-math.inf)
                if sp < n_splits:
                    la = load_partial(xs, u * mf, o_part, lse_part, sp, b, hh, sq, t, ndtiles)
                lsv[u] = la
                mn = max(mn, la)
            mu = mn if mn != -math.inf else np.float32(0.0)
            sc = exp2((m - mu) * np.float32(LOG2E))
            m = mn
            tot = tot * sc
            for e in range(mf):
                macc[e] = macc[e] * sc
            for u in range(batch):
                w = exp2((lsv[u] - mu) * np.float32(LOG2E))
                tot = tot + w
                for e in range(mf):
                    macc[e] = macc[e] + w * xs[u * mf + e]
    return m, tot


@inlined
def combine_groups(macc, m, tot, lg, mbase, mf):
    """Bring the ``2^lg`` lane groups of a row (lane bits ``mbase ..``) to their common maximum:
    max of the running maxima (lg shuffles), one rescale of ``macc``, a butterfly sum of the
    totals. Returns (mu, tot): the row's maximum (0 for -inf) and its total weight."""
    mx = m
    for lv in range(3):
        if lv < lg:
            mx = max(mx, shfl_xor(mx, mbase << lv))
    mu = mx if mx != -math.inf else np.float32(0.0)
    sc = exp2((m - mu) * np.float32(LOG2E))
    tot = tot * sc
    for lv in range(3):
        if lv < lg:
            tot += shfl_xor(tot, mbase << lv)
    for e in range(mf):
        macc[e] *= sc
    return mu, tot


@inlined
def scatter_level(macc, j, bit, lane_mask, half, nr, scatter):
    """One level of the row's reduce-scatter across the lanes ``lane_mask`` apart: with
    ``scatter`` the lane whose j bit ``bit`` is set keeps the upper ``half`` of its values, its
    partner the lower half, each adding the other's (returns the kept half's offset: ``half``
    or 0); without, the first ``nr`` values are summed in both lanes (returns 0)."""
    if scatter:
        hi = (j & bit) != 0
        for i in range(half):
            snd = macc[i] if hi else macc[i + half]
            kp = macc[i + half] if hi else macc[i]
            macc[i] = kp + shfl_xor(snd, lane_mask)
        return half if hi else 0
    for i in range(nr):
        macc[i] += shfl_xor(macc[i], lane_mask)
    return 0


@inlined
def store_pairs(out, macc, b, sq, hh, w0, inv, count, bf16):
    """``count`` 16-bit output pairs of ``macc`` times ``inv``, at words ``w0, w0 + 4, ...``."""
    for q in range(count):
        out[b, sq, hh, w0 + q * 4] = pack16(bf16, macc[2 * q] * inv, macc[2 * q + 1] * inv)


@inlined
def write_merged(out, lse, macc, j, ls, off, tot, mu, b, sq, hh, t, write_lse, bf16, ndtiles,
                 h0, h1, h2):
    """Write a lane's merged output columns (its ``mf >> ls`` values from column pair ``off / 2``
    of the lane's share: ``h2``, ``h1``, ``h0`` or ``2 ndtiles`` values after 3, 2, 1 or 0
    scatter levels) normalised by the row's total, and the row's lse (one lane)."""
    inv = np.float32(0.0)
    if tot != 0:
        inv = np.float32(1.0) / tot
    w0 = (off >> 1) * 4 + t
    if ls == 3:
        store_pairs(out, macc, b, sq, hh, w0, inv, h2 // 2, bf16)
    elif ls == 2:
        store_pairs(out, macc, b, sq, hh, w0, inv, h1 // 2, bf16)
    elif ls == 1:
        store_pairs(out, macc, b, sq, hh, w0, inv, h0 // 2, bf16)
    else:
        store_pairs(out, macc, b, sq, hh, w0, inv, ndtiles, bf16)
    if write_lse and j == 0 and t == 0:
        lse[b, hh, sq] = mu + math.log(tot) if tot != 0 else -math.inf


@inlined
def merge_row(out, lse, o_part, lse_part, macc, xs, lsv, live, b, hh, sq, t, j, n_groups, lg, ls,
              mbase, n_splits, write_lse, bf16, ndtiles, mf, rs, nr, batch):
    """Merge the splits' partial states of one row (query ``sq``, head ``hh``; the layout of
    ``merge_layout``) into the output: each lane group gathers its splits, the groups combine,
    a reduce-scatter of the ``mf`` sums (mf/2 + mf/4 + mf/8 shuffles at ``rs`` = 3, each lane
    then keeping mf/8 of the row's columns) lets every lane of the row write output. Past
    ``rs`` levels the groups hold copies, and only those with the remaining j bits clear
    write."""
    m, tot = gather_splits(macc, xs, lsv, o_part, lse_part, live, b, hh, sq, t, j, n_groups,
                           n_splits, ndtiles, mf, batch)
    mu, tot = combine_groups(macc, m, tot, lg, mbase, mf)
    off = 0
    if lg > 0:
        off += scatter_level(macc, j, 1, mbase, mf // 2, nr, rs > 0)
    if lg > 1:
        off += scatter_level(macc, j, 2, mbase << 1, mf // 4, nr, rs > 1)
    if lg > 2:
        off += scatter_level(macc, j, 4, mbase << 2, mf // 8, nr, rs > 2)
    if live and (j >> ls) == 0:
        write_merged(out, lse, macc, j, ls, off, tot, mu, b, sq, hh, t, write_lse, bf16,
                     ndtiles, mf // 2, mf // 4, mf // 8)


def make_mma_decode_kernel(head_dim: int, is_bf16: bool, paged: bool, has_left: bool,
                           has_right: bool, has_sinks: bool, has_softcap: bool, has_tree: bool,
                           direct: bool, write_lse: bool, block_n: int, stages: int, warps: int,
                           fold: bool = False, page_pow2: int = 0, full_lens: bool = False,
                           stream_hint: bool = False):
    """Build the tensor-core decode kernel for one configuration (every argument compile-time).

    Kernel signature ``(q, k, v, block_table, cache_seqlens, tree_bits, out, lse, o_part,
    lse_part, counters, heads_ratio, row_chunks, n_splits, scale_log2, cap_in, cap_out,
    window_left, window_right, sinks, tree_len, page_size, page_shift)``, arrays as in
    decode_fma.py's kernel: q uint32 (B, Sq, Hq, D/2); k, v uint32 (B, S_max, Hkv, D/2) or
    paged (num_pages, page_size, Hkv, D/2) with block_table int32 (B, max_pages);
    cache_seqlens int32 (B,); tree_bits uint32 (Sq, 2); direct: out uint32 (B, Sq, Hq, D/2),
    lse float32 (B, Hq, Sq); else o_part float32 (n_splits, B, Sq, Hq, D), lse_part float32
    (n_splits, B, Hq, Sq).

    ``fold`` (with splits): the merge is folded in. Each warp, after writing its partial
    state, bumps ``counters[b * gridDim.z + blockIdx.z]`` (int32, zero before the launch); the
    warp that brings it to ``n_splits`` is the last of its (batch item, kv head, chunk): it
    merges the partial states of its rows into out / lse and resets the counter to 0, so the
    same counters serve the next launch on the stream. No second kernel launch.

    ``page_pow2``: the page size when paged caches use a power-of-two page (else 0). Tiles
    whose keys are all valid, consecutive (past the sinks) and inside one page (or whole
    pages) then copy from offsets computed once per lane plus one ``block_table`` load per
    page of the tile (the "fast copy"); other tiles take the general per-copy lookup.

    The folded merge's tail (docs/decode.md, "Folded merge"): 8-byte partial-state stores, one
    acquire-release ``atom`` by lane 0 after ``__syncwarp`` (``arrive``), and a
    max-then-reduce-scatter combination of the lane groups (``merge_row``).

    ``full_lens``: every sequence fills the cache (``cache_seqlens=None``): the length is the
    capacity, ``cache_seqlens`` is not read, and the first copies wait for no load.

    ``stream_hint``: the fast copies fill L2 under an evict-first policy (``l2hints.py``), so
    the K/V stream, read once, does not push out of L2 what every call reuses (block table,
    lengths, queries, counters, the kernel's code). For one row chunk per kv head only: other
    chunks re-read the same K/V lines.

    Grid ``(ceil(n_splits / warps), B, Hkv * row_chunks)``, ``32 * warps`` threads;
    ``block_n`` a multiple of 16, ``stages`` in 2..4, within 48 KB of static shared memory.
    """
    D = head_dim
    KS = D // 16                  # k-steps of Q K^T
    ND = D // 8                   # n-tiles of the output
    CPR = D // 8                  # 16-byte chunks per row
    BN = block_n
    NS = BN // 8                  # n-tiles of S
    NP = BN // 16                 # k-steps of P V
    S = stages
    NW = warps
    KW, SWZ_MASK = _row_words(D)
    LOADS = BN * CPR // 32        # 16-byte copies per lane per tile, for K and again for V
    ROWS = NW * S * BN
    QF, SF, OF = KS * 4, NS * 4, ND * 4     # fragment registers: Q, scores, output
    MF = 2 * ND                   # folded merge: one row's output pairs per lane
    RS = _scatter_levels(ND)      # the merge's reduce-scatter levels
    NR = MF >> RS                 # values a lane holds after RS scatter levels
    GATHER = max(2, min(8, 128 // MF))    # splits whose partial states load at once
    GATHER_MF = GATHER * MF
    BF16 = bool(is_bf16)
    FOLD = bool(fold) and not direct
    FULL_LENS = bool(full_lens)
    RPI, PAGE, PSHIFT, FAST, NPG = _fast_copy_geometry(D, BN, paged, page_pow2)
    HINT = bool(stream_hint) and FAST
    NEG_INF = -math.inf
    _check_tile(D, BN, S, NW)

    def kernel(q, k, v, block_table, cache_seqlens, tree_bits, out, lse, o_part, lse_part,
               counters, heads_ratio, row_chunks, n_splits, scale_log2, cap_in, cap_out,
               window_left, window_right, sinks, tree_len, page_size, page_shift):
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        split = cuda.blockIdx.x * NW + warp
        if split >= n_splits:
            return
        b = cuda.blockIdx.y
        hk = cuda.blockIdx.z // row_chunks
        chunk = cuda.blockIdx.z - hk * row_chunks
        seqlen_q = q.shape[1]
        g, t, k_row, k_col, v_row, v_col, swz = lane_layout(lane, SWZ_MASK)

        if SIMULATOR:
            ks = cuda.shared.array((ROWS, KW), types.uint32)
            vs = cuda.shared.array((ROWS, KW), types.uint32)
        else:
            ks = cuda.shared.array((ROWS, KW), types.uint32, alignment=16)
            vs = cuda.shared.array((ROWS, KW), types.uint32, alignment=16)
        qf = cuda.local.array(QF, types.uint32)
        s = cuda.local.array(SF, types.float32)
        acc = cuda.local.array(OF, types.float32)

        n = cache_length(k, block_table, cache_seqlens, b, page_size, paged, FULL_LENS)
        offset = n - seqlen_q
        m_rows = heads_ratio * seqlen_q

        # Paged fast copies: 32 consecutive block-table entries of the split live in the warp's
        # registers (lane i holds entry bt_base + i) and a tile's pages come by shuffle, so a
        # tile's copies wait for no dependent global load; one coalesced reload per 32 pages,
        # the first at the first fast tile. (Defined in every variant: the typing of the loop
        # needs them.)
        bt_base = np.int64(-(1 << 40))
        bt_reg = np.int32(0)
        bt_cols = block_table.shape[1]

        # This lane's two rows (g and g + 8 of the chunk): (query head, query index).
        live0, live1, s0, s1, h0, h1, qpos0, qpos1 = lane_rows(chunk, g, m_rows, seqlen_q, hk,
                                                               heads_ratio, offset)
        tb00, tb01, tb10, tb11 = tree_words(tree_bits, s0, live0, s1, live1, has_tree)
        load_q_fragments(qf, q, b, s0, h0, live0, s1, h1, live1, t, KS)
        for i in range(ND * 4):
            acc[i] = np.float32(0.0)

        # Keys the chunk's rows may see: the window [lo, hi) plus sinks [0, ns) below it.
        chunk_rows, q_lo, q_hi, lo, ns, v_start, v_end = split_keys(
            chunk, 16, m_rows, seqlen_q, n, has_left, has_right, has_sinks, window_left,
            window_right, sinks, n_splits, split, BN)
        n_tiles = 0
        if v_end > v_start:
            n_tiles = (v_end - v_start + BN - 1) // BN
        tree_start = n - tree_len

        if FAST:
            lrow, lcol, ksr, vsr, kl, vl, ksp, vsp, n_pages = fast_copy_offsets(
                k, v, b, hk, lane, paged, CPR)
        policy = evict_first_policy() if HINT else np.uint64(0)

        m0 = np.float32(NEG_INF)
        m1 = np.float32(NEG_INF)
        l0 = np.float32(0.0)
        l1 = np.float32(0.0)
        ring = warp * S * BN
        kstart = 0

        # Step `step` issues tile `step` and consumes tile `step - S + 1`: S - 1 tiles in flight.
        for step in range(n_tiles + S - 1):
            syncwarp()        # every lane is done reading the buffer about to be refilled
            fast_tile = False
            if step < n_tiles:
                t0 = v_start + step * BN
                dst0 = ring + (step % S) * BN
                if FAST:
                    kstart = t0 - ns + lo
                    fast_tile = fast_copy_fits(t0, kstart, v_end, ns, paged, PAGE, BN)
            if fast_tile:
                if paged:
                    bt_base, bt_reg = copy_tile_pages(
                        ks, vs, k, v, block_table, b, lane, dst0, kstart, bt_base, bt_reg, bt_cols,
                        n_pages, kl, vl, ksp, vsp, ksr, vsr, lrow, lcol, HINT, policy, PAGE,
                        PSHIFT, NPG, BN, LOADS, RPI, SWZ_MASK)
                else:
                    copy_tile_rows(ks, vs, k, v, dst0, kstart, kl, vl, ksr, vsr, lrow, lcol, HINT,
                                   policy, LOADS, RPI, SWZ_MASK)
            elif step < n_tiles:
                copy_tile_any(ks, vs, k, v, block_table, b, hk, lane, dst0, t0, v_end, ns, lo,
                              paged, page_size, page_shift, LOADS, CPR, SWZ_MASK)
            cp_async_commit()
            if step >= S - 1:
                cp_async_wait_behind(S - 1)
                syncwarp()    # the tile's copies by every lane have landed
                tile = step - S + 1
                kb0 = v_start + tile * BN
                base = ring + (tile % S) * BN

                tile_scores(BF16, s, qf, ks, base, k_row, k_col, swz, KS, NS)

                # Is every (row, key) pair of the tile visible? Then no per-element mask.
                full = kb0 + BN <= v_end and kb0 >= ns
                kp0 = kb0 - ns + lo
                if has_right:
                    full = full and kp0 + BN - 1 <= q_lo + window_right
                if has_left:
                    full = full and kp0 >= q_hi - window_left
                if has_tree:
                    full = full and kp0 + BN - 1 < tree_start and kp0 + BN - 1 <= q_lo

                mx0, mx1 = tile_mask_max(s, full, kb0, t, ns, lo, v_end, qpos0, qpos1, tb00, tb01,
                                         tb10, tb11, tree_start, scale_log2, cap_in, cap_out,
                                         window_left, window_right, sinks, has_left, has_right,
                                         has_sinks, has_softcap, has_tree, NS)
                m0, m1, l0, l1 = online_softmax(s, acc, m0, m1, l0, l1, mx0, mx1, NS, ND)

                tile_pv(BF16, acc, s, vs, base, v_row, v_col, swz, NP, ND)

        inv0, inv1, lse0, lse1 = finish_rows(m0, m1, l0, l1)
        if live0:
            store_row(out, lse, o_part, lse_part, acc, 0, split, b, s0, h0, t, inv0, lse0,
                      direct, write_lse, BF16, ND)
        if live1:
            store_row(out, lse, o_part, lse_part, acc, 2, split, b, s1, h1, t, inv1, lse1,
                      direct, write_lse, BF16, ND)

        if FOLD:
            # The merge's lane layout and row indices do not depend on the arrival: computed
            # first, they overlap the atomic's round trip instead of following it.
            rl = chunk_rows
            lg, n_groups, slot, j, mbase, ls, sqa, hha, sqb, hhb = merge_layout(
                rl, g, chunk, seqlen_q, hk, heads_ratio, RS)
            arrived, cidx = arrive(counters, b, lane)
            if arrived == n_splits - 1:
                syncwarp()         # lane 0's acquire precedes the reads below (see arrive)
                # Last warp of the chunk: merge the chunk's rows, up to 8 per pass.
                macc = cuda.local.array(MF, types.float32)
                xs = cuda.local.array(GATHER_MF, types.float32)
                lsv = cuda.local.array(GATHER, types.float32)
                for ps in range(2):
                    if ps == 0 or rl > 8:
                        live = ps * 8 + slot < rl
                        sq = sqa if ps == 0 else sqb
                        hh = hha if ps == 0 else hhb
                        merge_row(out, lse, o_part, lse_part, macc, xs, lsv, live, b, hh, sq, t,
                                  j, n_groups, lg, ls, mbase, n_splits, write_lse, BF16, ND, MF,
                                  RS, NR, GATHER)
                if lane == 0:
                    counters[cidx] = 0

    return jit_kernel(kernel, ("decode_mma", head_dim, is_bf16, paged, has_left, has_right,
                               has_sinks, has_softcap, has_tree, direct, write_lse, block_n,
                               stages, warps, fold, PAGE, FULL_LENS))
