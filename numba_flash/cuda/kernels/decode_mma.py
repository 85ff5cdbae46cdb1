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
decode_fma.py's CUDA-core kernel: window / sinks / a draft
tree of at most 64 nodes, keys counted on the same "virtual" axis (sink keys, then the window).
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda
from numba.cuda import types

from ..primitives import (SIMULATOR, arrive_acq_rel, bcast0, cp_async16,
                          cp_async16_maybe_hint, cp_async_commit, cp_async_wait_1, cp_async_wait_2,
                          cp_async_wait_3, evict_first_policy, exp2,
                          grid_dependency_wait, grid_launch_dependents, ld2, ldmatrix_x4,
                          ldmatrix_x4_trans, mma16, pack16, shfl_idx, shfl_xor, st2, syncwarp)
from .decode_split import cache_slot, split_keys
from .jitcache import jit_kernel

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


def make_mma_decode_kernel(head_dim: int, is_bf16: bool, paged: bool, has_left: bool,
                           has_right: bool, has_sinks: bool, has_softcap: bool, has_tree: bool,
                           direct: bool, write_lse: bool, block_n: int, stages: int, warps: int,
                           fold: bool = False, pdl: bool = False, page_pow2: int = 0,
                           pdl_late: bool = False, full_lens: bool = False,
                           stream_hint: bool = False):
    """Build the tensor-core decode kernel for one configuration (every argument compile-time).

    Kernel signature ``(q, k, v, block_table, cache_seqlens, tree_bits, out, lse, o_part,
    lse_part, counters, heads_ratio, row_chunks, n_splits, scale_log2, cap_in, cap_out,
    window_left, window_right, sinks, tree_len, page_size, page_shift)``, arrays as in decode_fma.py's kernel:
    q uint32 (B, Sq, Hq, D/2); k, v uint32 (B, S_max, Hkv, D/2) or paged (num_pages, page_size,
    Hkv, D/2) with block_table int32 (B, max_pages); cache_seqlens int32 (B,); tree_bits uint32
    (Sq, 2); direct: out uint32 (B, Sq, Hq, D/2), lse float32 (B, Hq, Sq); else o_part float32
    (n_splits, B, Sq, Hq, D), lse_part float32 (n_splits, B, Hq, Sq).

    ``fold`` (with splits): the merge is folded in. Each warp, after writing its partial
    state, bumps ``counters[b * gridDim.z + blockIdx.z]`` (int32, zero before the launch); the
    warp that brings it to ``n_splits`` is the last of its (batch item, kv head, chunk): it
    merges the partial states of its rows into out / lse and resets the counter to 0, so the
    same counters serve the next launch on the stream. No second kernel launch.

    ``pdl`` (sm_90 and later only): the kernel first waits on ``griddepcontrol.wait`` (the
    previous grid on the stream has finished and its writes are visible; immediate without a
    programmatic-dependent launch), then signals ``griddepcontrol.launch_dependents``, so a
    next launch made with programmatic stream serialization is scheduled while this one runs
    and waits in its own prologue instead of paying the launch gap after it.

    ``pdl_late``: signal ``launch_dependents`` after the key loop instead of at the start, so
    the next grid's blocks are placed while this one merges and writes (its tail), not while
    it loads.

    ``page_pow2``: the page size when paged caches use a power-of-two page (else 0). Tiles
    whose keys are all valid, consecutive (past the sinks) and inside one page (or whole
    pages) then copy from offsets computed once per lane plus one ``block_table`` load per
    page of the tile (the "fast copy"); other tiles take the general per-copy lookup.

    The folded merge's tail (docs/decode.md, "Folded merge"): 8-byte partial-state stores, one
    acquire-release ``atom`` by lane 0 after ``__syncwarp``, the last warp's own state taken
    from registers, and a max-then-reduce-scatter combination of the lane groups.

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
    # New tail: reduce-scatter levels of the merge's group combination that keep whole output
    # pairs in a lane (MF >> RS stays even): min(3, the power of two dividing ND).
    RS = 0
    while RS < 3 and ND % (2 << RS) == 0:
        RS += 1
    H0, H1, H2 = MF // 2, MF // 4, MF // 8
    NR = MF >> RS                 # values a lane holds after RS scatter levels
    BF16 = bool(is_bf16)
    FOLD = bool(fold) and not direct
    PDL = bool(pdl)
    PDL_LATE = PDL and bool(pdl_late)
    FULL_LENS = bool(full_lens)
    # Fast copy (see the docstring): lanes cover whole rows, RPI rows per warp instruction.
    RPI = 32 // CPR if 32 % CPR == 0 else 0
    PAGE = int(page_pow2) if paged else 0
    PSHIFT = PAGE.bit_length() - 1 if PAGE else 0
    FAST = RPI > 0 and (not paged or (PAGE > 0 and PAGE % RPI == 0
                                        and (PAGE >= BN or BN % PAGE == 0)))
    NPG = BN // PAGE if 0 < PAGE < BN else 1        # pages per tile on the fast path
    HINT = bool(stream_hint) and FAST
    NEG_INF = -math.inf
    if BN * CPR % 32 or BN % 16 or not 2 <= S <= 4 or mma_smem_bytes(D, BN, S, NW) > 49152:
        raise ValueError(f"unsupported decode tile: block_n {BN}, stages {S}, warps {NW} at "
                         f"head_dim {D} (block_n a multiple of 16, stages 2..4, K/V rings within "
                         f"48 KB of shared memory)")

    def kernel(q, k, v, block_table, cache_seqlens, tree_bits, out, lse, o_part, lse_part,
               counters, heads_ratio, row_chunks, n_splits, scale_log2, cap_in, cap_out,
               window_left, window_right, sinks, tree_len, page_size, page_shift):
        if PDL:
            grid_dependency_wait()
            if not PDL_LATE:
                grid_launch_dependents()
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
        g = lane >> 2
        t = lane & 3
        k_row = (lane >> 4) * 8 + (lane & 7)
        k_col = ((lane >> 3) & 1) * 4
        v_row = ((lane >> 3) & 1) * 8 + (lane & 7)
        v_col = (lane >> 4) * 4
        swz = SWZ_MASK & ((lane & 7) << 2)

        if SIMULATOR:
            ks = cuda.shared.array((ROWS, KW), types.uint32)
            vs = cuda.shared.array((ROWS, KW), types.uint32)
        else:
            ks = cuda.shared.array((ROWS, KW), types.uint32, alignment=16)
            vs = cuda.shared.array((ROWS, KW), types.uint32, alignment=16)
        qf = cuda.local.array(QF, types.uint32)
        s = cuda.local.array(SF, types.float32)
        acc = cuda.local.array(OF, types.float32)

        if paged:
            capacity = block_table.shape[1] * page_size
        else:
            capacity = k.shape[1]
        if FULL_LENS:
            n = capacity
        else:
            n = cache_seqlens[b]
            n = max(0, min(n, capacity))    # memory safety only: the host validates when asked
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
        tb00 = np.uint32(0)
        tb01 = np.uint32(0)
        tb10 = np.uint32(0)
        tb11 = np.uint32(0)
        if has_tree:
            tb00 = tree_bits[s0 if live0 else 0, 0]
            tb01 = tree_bits[s0 if live0 else 0, 1]
            tb10 = tree_bits[s1 if live1 else 0, 0]
            tb11 = tree_bits[s1 if live1 else 0, 1]
        zero_w = np.uint32(0)
        for kk in range(KS):
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
            # Element offsets of this lane's first row and column in K and V (the tile's
            # key row and page are added per tile, the row step per copy).
            lrow = lane // CPR
            lcol = (lane - lrow * CPR) * 4
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
                    fast_tile = t0 + BN <= v_end and t0 >= ns
                    if paged:
                        if PAGE >= BN:
                            fast_tile = fast_tile and (kstart & (PAGE - 1)) <= PAGE - BN
                        else:
                            fast_tile = fast_tile and (kstart & (PAGE - 1)) == 0   # whole pages
            if fast_tile:
                if paged:
                    p0 = kstart >> PSHIFT
                    if p0 < bt_base or p0 + NPG > bt_base + 32:      # warp-uniform
                        bt_base = p0
                        bt_reg = np.int32(0)
                        if p0 + lane < bt_cols:
                            bt_reg = block_table[b, p0 + lane]
                    for pi in range(NPG):
                        page = shfl_idx(bt_reg, p0 - bt_base + pi)
                        if page < 0 or page >= n_pages:
                            page = 0          # memory safety only (see check_indices)
                        kb = page * ksp + kl
                        vb = page * vsp + vl
                        if PAGE >= BN:
                            kb += (kstart & (PAGE - 1)) * ksr
                            vb += (kstart & (PAGE - 1)) * vsr
                        for it2 in range(LOADS // NPG):
                            rr = (pi * (LOADS // NPG) + it2) * RPI
                            r = rr + lrow
                            dc = lcol ^ (SWZ_MASK & ((r & 7) << 2))
                            pr = rr - pi * (BN // NPG)
                            cp_async16_maybe_hint(HINT, ks, dst0 + r, dc, k, kb + pr * ksr, 16, policy)
                            cp_async16_maybe_hint(HINT, vs, dst0 + r, dc, v, vb + pr * vsr, 16, policy)
                else:
                    kb = kstart * ksr + kl
                    vb = kstart * vsr + vl
                    for it in range(LOADS):
                        r = it * RPI + lrow
                        dc = lcol ^ (SWZ_MASK & ((r & 7) << 2))
                        cp_async16_maybe_hint(HINT, ks, dst0 + r, dc, k, kb + (it * RPI) * ksr, 16, policy)
                        cp_async16_maybe_hint(HINT, vs, dst0 + r, dc, v, vb + (it * RPI) * vsr, 16, policy)
            elif step < n_tiles:
                for it in range(LOADS):
                    i = it * 32 + lane
                    r = i // CPR
                    c = (i - r * CPR) * 4
                    vk = t0 + r
                    ok = vk < v_end
                    key = vk if vk < ns else vk - ns + lo
                    bi, row, ok = cache_slot(paged, key, ok, b, block_table, k.shape[0],
                                             page_size, page_shift)
                    if not ok:
                        row = 0
                    dc = c ^ (SWZ_MASK & ((r & 7) << 2))
                    nbytes = 16 if ok else 0
                    cp_async16(ks, dst0 + r, dc, k, bi, row, hk, c, nbytes)
                    cp_async16(vs, dst0 + r, dc, v, bi, row, hk, c, nbytes)
            cp_async_commit()
            if step >= S - 1:
                if S == 2:
                    cp_async_wait_1()
                elif S == 3:
                    cp_async_wait_2()
                else:
                    cp_async_wait_3()
                syncwarp()    # the tile's copies by every lane have landed
                tile = step - S + 1
                kb0 = v_start + tile * BN
                base = ring + (tile % S) * BN

                for i in range(NS * 4):
                    s[i] = np.float32(0.0)
                for kk in range(KS):
                    a0 = qf[kk * 4]
                    a1 = qf[kk * 4 + 1]
                    a2 = qf[kk * 4 + 2]
                    a3 = qf[kk * 4 + 3]
                    for jj in range(NS // 2):
                        b0, b1, b2, b3 = ldmatrix_x4(ks, base + jj * 16 + k_row,
                                                     (kk * 8 + k_col) ^ swz)
                        j = 2 * jj
                        c0, c1, c2, c3 = mma16(BF16, a0, a1, a2, a3, b0, b1, s[j * 4],
                                               s[j * 4 + 1], s[j * 4 + 2], s[j * 4 + 3])
                        s[j * 4] = c0
                        s[j * 4 + 1] = c1
                        s[j * 4 + 2] = c2
                        s[j * 4 + 3] = c3
                        j = 2 * jj + 1
                        c0, c1, c2, c3 = mma16(BF16, a0, a1, a2, a3, b2, b3, s[j * 4],
                                               s[j * 4 + 1], s[j * 4 + 2], s[j * 4 + 3])
                        s[j * 4] = c0
                        s[j * 4 + 1] = c1
                        s[j * 4 + 2] = c2
                        s[j * 4 + 3] = c3

                # Is every (row, key) pair of the tile visible? Then no per-element mask.
                full = kb0 + BN <= v_end and kb0 >= ns
                kp0 = kb0 - ns + lo
                if has_right:
                    full = full and kp0 + BN - 1 <= q_lo + window_right
                if has_left:
                    full = full and kp0 >= q_hi - window_left
                if has_tree:
                    full = full and kp0 + BN - 1 < tree_start and kp0 + BN - 1 <= q_lo

                mx0 = np.float32(NEG_INF)
                mx1 = np.float32(NEG_INF)
                for j in range(NS):
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
                                    if e < 2:
                                        word = tb00 if tk < 32 else tb01
                                    else:
                                        word = tb10 if tk < 32 else tb11
                                    vis = vis and ((word >> (tk & 31)) & 1) != 0
                                else:
                                    vis = vis and kpos <= qp
                            if not vis:
                                x = np.float32(NEG_INF)
                        s[j * 4 + e] = x
                        if e < 2:
                            mx0 = max(mx0, x)
                        else:
                            mx1 = max(mx1, x)
                mx0 = max(mx0, shfl_xor(mx0, 1))
                mx0 = max(mx0, shfl_xor(mx0, 2))
                mx1 = max(mx1, shfl_xor(mx1, 1))
                mx1 = max(mx1, shfl_xor(mx1, 2))
                mn0 = max(m0, mx0)
                mn1 = max(m1, mx1)
                mu0 = mn0 if mn0 != NEG_INF else np.float32(0.0)
                mu1 = mn1 if mn1 != NEG_INF else np.float32(0.0)
                alpha0 = exp2(m0 - mu0)
                alpha1 = exp2(m1 - mu1)
                m0 = mn0
                m1 = mn1
                rs0 = np.float32(0.0)
                rs1 = np.float32(0.0)
                for j in range(NS):
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
                l0 = l0 * alpha0 + rs0     # per-lane partial sums; the quad sums them at the end
                l1 = l1 * alpha1 + rs1
                for dn in range(ND):
                    acc[dn * 4] *= alpha0
                    acc[dn * 4 + 1] *= alpha0
                    acc[dn * 4 + 2] *= alpha1
                    acc[dn * 4 + 3] *= alpha1

                for kb in range(NP):
                    a0 = pack16(BF16, s[kb * 8], s[kb * 8 + 1])
                    a1 = pack16(BF16, s[kb * 8 + 2], s[kb * 8 + 3])
                    a2 = pack16(BF16, s[kb * 8 + 4], s[kb * 8 + 5])
                    a3 = pack16(BF16, s[kb * 8 + 6], s[kb * 8 + 7])
                    for dd in range(ND // 2):
                        b0, b1, b2, b3 = ldmatrix_x4_trans(vs, base + kb * 16 + v_row,
                                                           (dd * 8 + v_col) ^ swz)
                        dn = 2 * dd
                        c0, c1, c2, c3 = mma16(BF16, a0, a1, a2, a3, b0, b1, acc[dn * 4],
                                               acc[dn * 4 + 1], acc[dn * 4 + 2], acc[dn * 4 + 3])
                        acc[dn * 4] = c0
                        acc[dn * 4 + 1] = c1
                        acc[dn * 4 + 2] = c2
                        acc[dn * 4 + 3] = c3
                        dn = 2 * dd + 1
                        c0, c1, c2, c3 = mma16(BF16, a0, a1, a2, a3, b2, b3, acc[dn * 4],
                                               acc[dn * 4 + 1], acc[dn * 4 + 2], acc[dn * 4 + 3])
                        acc[dn * 4] = c0
                        acc[dn * 4 + 1] = c1
                        acc[dn * 4 + 2] = c2
                        acc[dn * 4 + 3] = c3

        if PDL_LATE:
            grid_launch_dependents()
        l0 += shfl_xor(l0, 1)
        l0 += shfl_xor(l0, 2)
        l1 += shfl_xor(l1, 1)
        l1 += shfl_xor(l1, 2)
        inv0 = np.float32(0.0)
        inv1 = np.float32(0.0)
        lse0 = np.float32(NEG_INF)
        lse1 = np.float32(NEG_INF)
        if l0 != 0:
            inv0 = np.float32(1.0) / l0
            lse0 = (m0 + math.log2(l0)) * np.float32(LN2)
        if l1 != 0:
            inv1 = np.float32(1.0) / l1
            lse1 = (m1 + math.log2(l1)) * np.float32(LN2)
        if live0:
            for dn in range(ND):
                if direct:
                    out[b, s0, h0, dn * 4 + t] = pack16(BF16, acc[dn * 4] * inv0,
                                                        acc[dn * 4 + 1] * inv0)
                else:
                    st2(o_part, split, b, s0, h0, dn * 8 + 2 * t, acc[dn * 4] * inv0,
                        acc[dn * 4 + 1] * inv0)
            if t == 0:
                if direct:
                    if write_lse:
                        lse[b, h0, s0] = lse0
                else:
                    lse_part[split, b, h0, s0] = lse0
        if live1:
            for dn in range(ND):
                if direct:
                    out[b, s1, h1, dn * 4 + t] = pack16(BF16, acc[dn * 4 + 2] * inv1,
                                                        acc[dn * 4 + 3] * inv1)
                else:
                    st2(o_part, split, b, s1, h1, dn * 8 + 2 * t, acc[dn * 4 + 2] * inv1,
                        acc[dn * 4 + 3] * inv1)
            if t == 0:
                if direct:
                    if write_lse:
                        lse[b, h1, s1] = lse1
                else:
                    lse_part[split, b, h1, s1] = lse1

        if FOLD:
            # Arrival. Memory-model argument (PTX ISA, "Memory Consistency Model"):
            # * Release: every lane's partial-state stores above precede this __syncwarp
            #   (bar.warp.sync, which orders memory among the lanes taking part), which precedes
            #   lane 0's atom.acq_rel.gpu in program order; the release side of that atom is
            #   cumulative (it covers every write that precedes it in causality order, the other
            #   lanes' included), so one atomic publishes the whole warp's state at GPU scope.
            #   It replaces a fence.sc.gpu (MEMBAR.SC + L1 invalidation) by every lane.
            # * Acquire: the warp that brings the counter to n_splits - 1 reads, through the
            #   chain of atomic read-modify-writes on the counter (observation order relates a
            #   write to a read through atomic RMWs), the value of every earlier warp's release:
            #   its acquire synchronizes with all of them. The __syncwarp after it orders lane
            #   0's acquire before every lane's loads of the other splits' states.
            # CUTLASS's generic barrier (cutlass/barrier.h: __syncthreads, then one thread's
            # red.release.gpu / ld.acquire.gpu) and cooperative groups' grid sync (one thread
            # fences for its block after a block barrier) rely on the same cumulativity.
            # The merge's lane layout and row indices do not depend on the arrival: computed
            # here, they overlap the atomic's round trip instead of following it.
            rl = chunk_rows
            lr = 0
            if rl > 1:
                lr = 1
            if rl > 2:
                lr = 2
            if rl > 4:
                lr = 3
            lg = 3 - lr
            G = 1 << lg
            slot = g & ((1 << lr) - 1)
            j = g >> lr
            mbase = 4 << lr              # lane-mask bit of j's bit 0
            ls = min(lg, RS)
            # Row slot (pass 0) and 8 + slot (pass 1): query head and query index (32-bit
            # division: rows and seqlen_q are small).
            rra = np.int32(chunk * 16 + slot)
            gia = rra // np.int32(seqlen_q)
            sqa = rra - gia * np.int32(seqlen_q)
            hha = hk * heads_ratio + gia
            rrb = rra + np.int32(8)
            gib = rrb // np.int32(seqlen_q)
            sqb = rrb - gib * np.int32(seqlen_q)
            hhb = hk * heads_ratio + gib
            syncwarp()
            cidx = b * cuda.gridDim.z + cuda.blockIdx.z
            arrived = np.int32(0)
            if lane == 0:
                arrived = arrive_acq_rel(counters, cidx)
            arrived = bcast0(arrived)
            if arrived == n_splits - 1:
                syncwarp()         # lane 0's acquire precedes the reads below (see above)
                # Last warp of the chunk: merge the chunk's rows. Lane group g takes row slot
                # g % RP (RP = live rows rounded up to a power of two, at most 8; 16 rows take
                # two passes) and every G-th split from j = g // RP (G = 8 / RP groups per row),
                # two splits per iteration with all their loads issued together; every split,
                # this warp's own included, is read back from memory, so the summation order
                # does not depend on which warp arrives last (results are bitwise
                # reproducible; starting from the own state in registers saved one split's
                # loads but changed the order with the arrival). Then the groups of a row combine: max of their running maxima
                # (lg shuffles), one rescale, a butterfly sum of the totals and a
                # reduce-scatter of the MF sums (MF/2 + MF/4 + MF/8 shuffles, each lane then
                # keeping MF/8 of the row's columns), so every lane of the row writes output.
                macc = cuda.local.array(MF, types.float32)
                xa = cuda.local.array(MF, types.float32)
                xb = cuda.local.array(MF, types.float32)
                for ps in range(2):
                    if ps == 0 or rl > 8:
                        live = ps * 8 + slot < rl
                        sq = sqa if ps == 0 else sqb
                        hh = hha if ps == 0 else hhb
                        m = np.float32(NEG_INF)
                        tot = np.float32(0.0)
                        for e in range(MF):
                            macc[e] = np.float32(0.0)
                        if live:
                            # A skipped split (la or lb -inf, weight exp2(-inf) = 0) leaves xa /
                            # xb as they were: zeros or an earlier split's (finite) values.
                            for e in range(MF):
                                xa[e] = np.float32(0.0)
                                xb[e] = np.float32(0.0)
                            for sp in range(j, n_splits, 2 * G):
                                spb = sp + G
                                oka = True
                                okb = spb < n_splits
                                la = np.float32(NEG_INF)
                                lb = np.float32(NEG_INF)
                                if oka:
                                    la = lse_part[sp, b, hh, sq]
                                    for dn in range(ND):
                                        x0, x1 = ld2(o_part, sp, b, sq, hh, dn * 8 + 2 * t)
                                        xa[2 * dn] = x0
                                        xa[2 * dn + 1] = x1
                                if okb:
                                    lb = lse_part[spb, b, hh, sq]
                                    for dn in range(ND):
                                        x0, x1 = ld2(o_part, spb, b, sq, hh, dn * 8 + 2 * t)
                                        xb[2 * dn] = x0
                                        xb[2 * dn + 1] = x1
                                mn = max(m, max(la, lb))
                                mu = mn if mn != NEG_INF else np.float32(0.0)
                                sc = exp2((m - mu) * np.float32(LOG2E))
                                wa = exp2((la - mu) * np.float32(LOG2E))
                                wb = exp2((lb - mu) * np.float32(LOG2E))
                                m = mn
                                tot = tot * sc + wa + wb
                                for e in range(MF):
                                    macc[e] = macc[e] * sc + wa * xa[e] + wb * xb[e]
                        # Combine the G groups of the row (lane bits 2 + lr .. 4).
                        mx = m
                        for lv in range(3):
                            if lv < lg:
                                mx = max(mx, shfl_xor(mx, mbase << lv))
                        mu = mx if mx != NEG_INF else np.float32(0.0)
                        sc = exp2((m - mu) * np.float32(LOG2E))
                        tot = tot * sc
                        for lv in range(3):
                            if lv < lg:
                                tot += shfl_xor(tot, mbase << lv)
                        for e in range(MF):
                            macc[e] *= sc
                        # Reduce-scatter: at level k the lane whose j bit k is set keeps the
                        # upper half of its values, its partner the lower half.
                        off = 0
                        if lg > 0:
                            if RS > 0:
                                hi = (j & 1) != 0
                                for i in range(H0):
                                    snd = macc[i] if hi else macc[i + H0]
                                    kp = macc[i + H0] if hi else macc[i]
                                    macc[i] = kp + shfl_xor(snd, mbase)
                                off += H0 if hi else 0
                            else:
                                for i in range(NR):
                                    macc[i] += shfl_xor(macc[i], mbase)
                        if lg > 1:
                            if RS > 1:
                                hi = (j & 2) != 0
                                for i in range(H1):
                                    snd = macc[i] if hi else macc[i + H1]
                                    kp = macc[i + H1] if hi else macc[i]
                                    macc[i] = kp + shfl_xor(snd, mbase << 1)
                                off += H1 if hi else 0
                            else:
                                for i in range(NR):
                                    macc[i] += shfl_xor(macc[i], mbase << 1)
                        if lg > 2:
                            if RS > 2:
                                hi = (j & 4) != 0
                                for i in range(H2):
                                    snd = macc[i] if hi else macc[i + H2]
                                    kp = macc[i + H2] if hi else macc[i]
                                    macc[i] = kp + shfl_xor(snd, mbase << 2)
                                off += H2 if hi else 0
                            else:
                                for i in range(NR):
                                    macc[i] += shfl_xor(macc[i], mbase << 2)
                        # Lanes that went through every scatter level they could hold MF >> ls
                        # values (ls = min(lg, RS)); past RS levels the groups hold copies and
                        # only those with the remaining j bits clear write.
                        if live and (j >> ls) == 0:
                            inv = np.float32(0.0)
                            if tot != 0:
                                inv = np.float32(1.0) / tot
                            w0 = (off >> 1) * 4 + t
                            if ls == 3:
                                for q in range(H2 // 2):
                                    out[b, sq, hh, w0 + q * 4] = pack16(
                                        BF16, macc[2 * q] * inv, macc[2 * q + 1] * inv)
                            elif ls == 2:
                                for q in range(H1 // 2):
                                    out[b, sq, hh, w0 + q * 4] = pack16(
                                        BF16, macc[2 * q] * inv, macc[2 * q + 1] * inv)
                            elif ls == 1:
                                for q in range(H0 // 2):
                                    out[b, sq, hh, w0 + q * 4] = pack16(
                                        BF16, macc[2 * q] * inv, macc[2 * q + 1] * inv)
                            else:
                                for q in range(ND):
                                    out[b, sq, hh, w0 + q * 4] = pack16(
                                        BF16, macc[2 * q] * inv, macc[2 * q + 1] * inv)
                            if write_lse and j == 0 and t == 0:
                                lse[b, hh, sq] = mu + math.log(tot) if tot != 0 else NEG_INF
                if lane == 0:
                    counters[cidx] = 0

    return jit_kernel(kernel, ("decode_mma", head_dim, is_bf16, paged, has_left, has_right, has_sinks,
                         has_softcap, has_tree, direct, write_lse, block_n, stages, warps, fold,
                         pdl, PAGE, PDL_LATE, FULL_LENS))
