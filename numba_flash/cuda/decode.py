"""Split-KV decode (FlashDecoding): few query rows, a long (optionally paged) KV cache.

This module holds the launcher (``decode_cuda``) and split heuristics for both decode kernels,
and the CUDA-core kernel. float16 / bfloat16 with head_dim a multiple of 16 up to 128 go to
the tensor-core kernel of ``decode_mma.py`` (merge folded in, direct cuda.core launch); other
head_dims (256) and ``NUMBA_FLASH_DECODE_KERNEL=fma`` use the CUDA-core kernel below, whose
splits ``merge.py``'s kernel combines. docs/decode.md describes both and the measurements.

CUDA-core kernel: one block of ``DECODE_WARPS`` warps per (split, batch item, kv head, row
chunk). The query rows of every query head that shares the kv head (GQA packing:
``group * seqlen_q`` rows, in chunks of at most ``MAX_ROWS``) sit in registers, so each K/V byte
of a split is read once per chunk.

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
import os

import numpy as np
from numba import cuda
from numba.cuda import types

from . import launch
from .device import current_device_id
from .decode_mma import CLUSTER_MAX_SPLITS, MMA_ROWS, make_mma_decode_kernel, mma_decode_supported
from .decodedev import cache_slot, split_keys
from .jitcache import jit_kernel
from .merge import OUT_BF16, OUT_F16, launch_merge
from .warp import SIMULATOR, exp2, pack_bf16, pack_f16, shfl_xor

__all__ = ["make_decode_kernel", "decode_geometry", "DECODE_WARPS", "MAX_ROWS", "ld_v4",
           "unpack_f16", "unpack_bf16"]

DECODE_WARPS = 4
MAX_ROWS = 8
LN2 = 0.6931471805599453

if not SIMULATOR:
    from llvmlite import ir
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    _U32 = types.uint32
    _F32 = types.float32

    def _address(context, builder, aryty, aryval, idx_types, idx_vals):
        ary = context.make_array(aryty)(context, builder, aryval)
        inds = [context.cast(builder, v, t, types.intp) for v, t in zip(idx_vals, idx_types)]
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, inds)
        return builder.ptrtoint(ptr, ir.IntType(64))

    @intrinsic
    def ld_v4(typingctx, ary, i0, i1, i2, i3):
        """Four uint32 words ``ary[i0, i1, i2, i3:i3+4]`` in one 16-byte read-only global load."""
        sig = types.UniTuple(_U32, 4)(ary, i0, i1, i2, i3)

        def codegen(context, builder, sig, args):
            addr = _address(context, builder, sig.args[0], args[0], sig.args[1:], args[1:])
            i32 = ir.IntType(32)
            fnty = ir.FunctionType(ir.LiteralStructType([i32] * 4), [ir.IntType(64)])
            asm = ir.InlineAsm(fnty, "{ .reg .u64 g; cvta.to.global.u64 g, $4; "
                                     "ld.global.nc.v4.u32 {$0,$1,$2,$3}, [g]; }",
                               "=r,=r,=r,=r,l", side_effect=False)
            res = builder.call(asm, [addr])
            return context.make_tuple(builder, sig.return_type,
                                      [builder.extract_value(res, n) for n in range(4)])

        return sig, codegen

    def _unpack_intrinsic(body):
        @intrinsic
        def unpack(typingctx, word):
            sig = types.UniTuple(_F32, 2)(_U32)

            def codegen(context, builder, sig, args):
                f32 = ir.FloatType()
                fnty = ir.FunctionType(ir.LiteralStructType([f32, f32]), [ir.IntType(32)])
                res = builder.call(ir.InlineAsm(fnty, body, "=f,=f,r"), args)
                return context.make_tuple(builder, sig.return_type,
                                          [builder.extract_value(res, n) for n in range(2)])

            return sig, codegen

        return unpack

    # A word holds the lower-indexed element in its low half (as everywhere in warp.py).
    unpack_f16 = _unpack_intrinsic("{ .reg .b16 l, h; mov.b32 {l, h}, $2; "
                                   "cvt.f32.f16 $0, l; cvt.f32.f16 $1, h; }")
    # bfloat16 is the top half of a float32: shift / mask, no conversion instruction needed.
    unpack_bf16 = _unpack_intrinsic("{ .reg .b32 t; shl.b32 t, $2, 16; mov.b32 $0, t; "
                                    "and.b32 t, $2, 0xffff0000; mov.b32 $1, t; }")
else:
    def ld_v4(ary, i0, i1, i2, i3):
        """Four uint32 words ``ary[i0, i1, i2, i3:i3+4]``."""
        return (ary[i0, i1, i2, i3], ary[i0, i1, i2, i3 + 1], ary[i0, i1, i2, i3 + 2],
                ary[i0, i1, i2, i3 + 3])

    def unpack_f16(word):
        """uint32 of two float16 -> (low, high) as float32."""
        h = np.array([word], dtype=np.uint32).view(np.float16).astype(np.float32)
        return h[0], h[1]

    def unpack_bf16(word):
        """uint32 of two bfloat16 -> (low, high) as float32."""
        w = int(word) & 0xFFFFFFFF
        f = np.array([(w << 16) & 0xFFFFFFFF, w & 0xFFFF0000], dtype=np.uint32).view(np.float32)
        return f[0], f[1]


def _jit(fn, config):
    # On-disk caching, one cache index per configuration (jitcache.py).
    return jit_kernel(fn, config)


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
    unpack = unpack_bf16 if is_bf16 else unpack_f16
    pack = pack_bf16 if is_bf16 else pack_f16
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
                        x0, x1 = unpack(q[b, s, h, w])
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
                        k0, k1 = unpack(kw[(u * CH + c) * 4 + j])
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
                        v0, v1 = unpack(vw[(u * CH + c) * 4 + j])
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
                if tot > 0:
                    inv = np.float32(1.0) / tot
                lse_val = np.float32(NEG_INF)
                if tot > 0:
                    lse_val = (mx + math.log2(tot)) * np.float32(LN2)
                if direct:
                    out[b, s, h, w] = pack(o0 * inv, o1 * inv)
                    if write_lse and w == 0:
                        lse[b, h, s] = lse_val
                else:
                    o_part[split, b, s, h, 2 * w] = o0 * inv
                    o_part[split, b, s, h, 2 * w + 1] = o1 * inv
                    if w == 0:
                        lse_part[split, b, h, s] = lse_val

    return _jit(kernel, ("decode", head_dim, is_bf16, rows, paged, has_left, has_right, has_sinks,
                         has_softcap, has_tree, direct, write_lse))


# ----------------------------------------------------------------------------- launcher

_KERNELS: dict = {}
_DUMMIES: dict = {}
_TREES: dict = {}
_SM_COUNTS: dict = {}
MIN_KEYS_PER_SPLIT = 256
WAVES = 2            # "auto" aims at this many blocks per multiprocessor (resident at ~240 regs)
MAX_SPLITS = 128


def decode_kernel(*config):
    """The cached kernel for one ``make_decode_kernel`` configuration."""
    if config not in _KERNELS:
        _KERNELS[config] = make_decode_kernel(*config)
    return _KERNELS[config]


def _sm_count(device) -> int:
    if SIMULATOR:
        return 4
    key = device if device is not None else -1
    if key not in _SM_COUNTS:
        dev = cuda.gpus[device] if device is not None else cuda.get_current_device()
        _SM_COUNTS[key] = int(dev.MULTIPROCESSOR_COUNT)
    return _SM_COUNTS[key]


def auto_num_splits(blocks: int, keys: int, sm_count: int) -> int:
    """Splits of the key range so that the grid fills the device in one wave.

    ``blocks``: blocks without splitting (B * heads_kv * row_chunks); ``keys``: an upper bound
    of the keys one block visits (the cache capacity, or the window's extent). The most splits
    whose grid still fits ``WAVES * sm_count`` resident blocks (rounding down: a partial second
    wave costs nearly a whole one), at least MIN_KEYS_PER_SPLIT keys per split, at most
    MAX_SPLITS. Returns 1 (no merge) when the grid is already full.
    """
    want = (WAVES * sm_count) // max(blocks, 1)
    by_len = max(1, keys // MIN_KEYS_PER_SPLIT)
    return int(max(1, min(want, by_len, MAX_SPLITS)))


# ----------------------------------------------------------------------------- tensor-core path

_MMA_KERNELS: dict = {}
# (keys per tile, cp.async stages, warps per block) and the warps per multiprocessor "auto"
# aims at, from the H100 and H200 sweeps in docs/decode.md. Paged caches (power-of-two pages
# take the same fast copies as contiguous ones, plus one block_table load per page of a tile)
# use the same tile and one more warp per multiprocessor to cover that load.
MMA_TILE = (32, 2, 1)
MMA_WARPS_PER_SM = 3
MMA_TILE_PAGED = (32, 2, 1)
MMA_WARPS_PER_SM_PAGED = 4
# Page sizes that are not powers of two look every key's page up per copy (an integer division
# and a dependent load): instruction-bound, they keep 16-key tiles, three stages and more warps.
MMA_TILE_PAGED_ANY = (16, 3, 1)
MMA_WARPS_PER_SM_PAGED_ANY = 8
SHORT_SPLIT_KEYS = 1024      # fewer keys per split than this: one more warp per SM


def _use_mma(head_dim: int) -> bool:
    """Tensor-core kernel unless NUMBA_FLASH_DECODE_KERNEL=fma (or head_dim unsupported)."""
    return mma_decode_supported(head_dim) and \
        os.environ.get("NUMBA_FLASH_DECODE_KERNEL", "mma") != "fma"


def mma_tile(head_dim: int, paged: bool = False, pow2_pages: bool = True
             ) -> tuple[int, int, int]:
    """(block_n, stages, warps) of the tensor-core kernel (``pow2_pages``: the page size of a
    paged cache is a power of two); NUMBA_FLASH_DECODE_TILE="32,2,1" overrides it (tuning)."""
    forced = os.environ.get("NUMBA_FLASH_DECODE_TILE")
    if forced:
        bn, st, nw = (int(x) for x in forced.split(","))
        return bn, st, nw
    if paged:
        return MMA_TILE_PAGED if pow2_pages else MMA_TILE_PAGED_ANY
    return MMA_TILE


def _pdl_wanted():
    """Programmatic dependent launch of the tensor-core kernel (compute capability 9.0 and
    later, direct launch only): NUMBA_FLASH_DECODE_PDL=1 or 2 forces it (with the pad of
    NUMBA_FLASH_DECODE_SMEM_PAD), 0 turns it off; unset ("auto", returned as the string) the
    plan decides by ``_launch_policy``. The kernel waits on griddepcontrol on every sm_90+
    device either way: the variable only changes the launch."""
    mode = os.environ.get("NUMBA_FLASH_DECODE_PDL", "auto")
    if mode == "auto":
        return "auto"
    return mode in ("1", "2")


def _launch_policy(core_kernel, threads: int, blocks: int, sm_count: int):
    """(pdl, pad, late) of the automatic launch (H100 A/B, docs/decode.md "Launch policy").

    Programmatic dependent launch lets the next call's blocks be placed while this call runs;
    they then wait in ``griddepcontrol.wait``. That saves the gap between back-to-back calls
    when the placement stays even, and costs up to 17 points of bandwidth when it does not (the
    blocks pile onto the multiprocessors with room). So:

    * a grid of more than one wave: no PDL;
    * a grid whose next copy fits in the room this one leaves (2 x blocks within the device's
      blocks at once): PDL, the next grid lands evenly at once;
    * otherwise PDL with a multiprocessor capped at this grid's own ``ceil(blocks / SMs)``
      blocks (by the occupancy itself, or by a shared-memory pad), so the next grid's blocks
      only take the places of finished ones; without such a cap, no PDL. Here ``late``: the
      kernel signals ``launch_dependents`` after its key loop (the next grid is placed during
      this one's merge), which the A/B measured as good or better than the early signal for
      capped grids, and worse for the grids of the previous case.
    """
    try:
        per_sm = core_kernel.occupancy.max_active_blocks_per_multiprocessor(threads, 0)
    except Exception:  # noqa: BLE001 - no occupancy query: plain launches
        return False, 0, False
    if blocks > per_sm * sm_count:
        return False, 0, False
    if 2 * blocks <= per_sm * sm_count:
        return True, 0, False
    if per_sm == -(-blocks // sm_count):
        return True, 0, True
    pad = _cap_pad(core_kernel, threads, blocks, sm_count)
    return (True, pad, True) if pad else (False, 0, False)


def _pdl_late() -> bool:
    """NUMBA_FLASH_DECODE_PDL=2: programmatic dependent launch with the trigger after the key
    loop (the next grid is placed during this one's tail) instead of at the kernel's start."""
    return os.environ.get("NUMBA_FLASH_DECODE_PDL", "0") == "2"


_PDL_DEVICES: dict = {}


def _pdl_device(device) -> bool:
    """Whether ``device`` (None: the current one) runs griddepcontrol (sm_90 and later)."""
    key = device if device is not None else -1
    if key not in _PDL_DEVICES:
        dev = cuda.gpus[device] if device is not None else cuda.get_current_device()
        _PDL_DEVICES[key] = tuple(dev.compute_capability) >= (9, 0)
    return _PDL_DEVICES[key]


def auto_num_splits_mma(units: int, keys: int, sm_count: int,
                        warps_per_sm: int = MMA_WARPS_PER_SM, short_keys: int = SHORT_SPLIT_KEYS
                        ) -> int:
    """Splits for the tensor-core kernel, whose unit of work is one warp.

    ``units``: warps without splitting (B * heads_kv * row_chunks); ``keys``: an upper bound of
    the keys a unit visits. The most splits whose warps stay within ``warps_per_sm * sm_count``
    (rounding down); if a split would then hold fewer than ``short_keys`` keys (a short call,
    where the per-warp start and the merge weigh more), one more warp per multiprocessor. At
    least MIN_KEYS_PER_SPLIT keys per split, at most MAX_SPLITS; 1 when the units alone fill
    the target. The H100 sweep (docs/decode.md) peaks at about 3 warps per multiprocessor for
    contiguous caches (~400 warps; one warp keeps 16-32 KB of copies in flight).
    """
    units = max(units, 1)
    want = (warps_per_sm * sm_count) // units
    if want > 1 and short_keys and keys // want < short_keys:
        want = ((warps_per_sm + 1) * sm_count) // units
    by_len = max(1, keys // MIN_KEYS_PER_SPLIT)
    return int(max(1, min(want, by_len, MAX_SPLITS)))


_COUNTERS: dict = {}
LAST_PLAN: dict = {}         # splits and tile of the last decode_cuda call (benchmarks read it)


def _fold_merge() -> bool:
    """Merge inside the decode kernel (last warp per row chunk) unless
    NUMBA_FLASH_DECODE_FOLD=0 (then a separate merge launch)."""
    return os.environ.get("NUMBA_FLASH_DECODE_FOLD", "1") != "0"


def _new_tail() -> bool:
    """The folded merge's cheaper tail (decode_mma.py, ``new_tail``) unless
    NUMBA_FLASH_DECODE_TAIL=old (the previous tail, kept for A/B timings)."""
    return os.environ.get("NUMBA_FLASH_DECODE_TAIL", "new") != "old"


def _stream_hint(chunks: int) -> bool:
    """Whether the fast copies fill L2 evict-first (decode_mma.py, ``stream_hint``): by
    default with one row chunk per kv head (every K/V line is then read once per call; more
    chunks re-read them); NUMBA_FLASH_DECODE_HINT=0 / 1 forces it off / on."""
    mode = os.environ.get("NUMBA_FLASH_DECODE_HINT", "auto")
    if mode not in ("auto", "0", "1"):
        raise ValueError(f"NUMBA_FLASH_DECODE_HINT must be auto, 0 or 1, got {mode!r}")
    return chunks == 1 if mode == "auto" else mode == "1"


_CLUSTER = {"on": not SIMULATOR, "error": None}     # "on": False after a failed launch


def _cluster_merge(device, splits: int, warps: int) -> bool:
    """Whether the tensor-core kernel merges its splits inside thread-block clusters
    (decode_mma.py, ``cluster``): a real GPU of compute capability 9.0 or later, 2 to
    CLUSTER_MAX_SPLITS splits, one warp per block, the direct launch, and
    NUMBA_FLASH_DECODE_CLUSTER=1 (read per call, for A/B timings in one process). Off by
    default: on the H100 a 16-block cluster leaves 16 of the 132 multiprocessors unused and the
    call is slower (docs/decode.md). Otherwise the last-warp fold merges."""
    if not (_CLUSTER["on"] and _FAST["on"] and warps == 1 and 2 <= splits <= CLUSTER_MAX_SPLITS):
        return False
    if os.environ.get("NUMBA_FLASH_DECODE_CLUSTER", "0") != "1":
        return False
    return _pdl_device(device)       # sm_90 and later


def _cluster_config(grid, threads, cluster_x, pad=0):
    """A cuda.core launch configuration for ``grid`` blocks in clusters of ``cluster_x`` blocks
    along x. cuda.core counts ``grid`` in clusters when a cluster is given (since the fix of
    NVIDIA/cuda-python#867; its LaunchConfig docstring says so), in blocks before."""
    key = (grid, threads, cluster_x, pad)
    cfg = _CLUSTER_CONFIGS.get(key)
    if cfg is None:
        in_clusters = "number of clusters" in (launch._CoreLaunchConfig.__doc__ or "")
        g = (grid[0] // cluster_x, grid[1], grid[2]) if in_clusters else grid
        cfg = _CLUSTER_CONFIGS[key] = launch._CoreLaunchConfig(grid=g, cluster=(cluster_x, 1, 1),
                                                               block=threads, shmem_size=pad)
    return cfg


_CLUSTER_CONFIGS: dict = {}


def _allow_large_clusters(cufunc, dev):
    """Clusters of more than 8 blocks (non-portable; H100 takes 16) for this kernel."""
    from cuda.bindings import driver as cu

    attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
    err, = cu.cuKernelSetAttribute(attr, 1, cufunc.handle, cu.CUdevice(dev))
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuKernelSetAttribute(NON_PORTABLE_CLUSTER_SIZE_ALLOWED) failed: {err}")


class GraphCaptureError(RuntimeError):
    """A decode call inside a CUDA graph capture needs a buffer that cannot be made there."""


# Folded-merge counters of calls made while a stream is being captured into a CUDA graph: one
# buffer per capture (the graph may be replayed on any stream, any time, so it shares its
# counters with nothing else), kept for the life of the process. Memory cannot be allocated
# during a capture, so each comes from a reserve of zeroed buffers made outside captures.
_SPARE_COUNTERS: dict = {}
SPARE_COUNTERS = 2


def _capture_id(handle):
    """The id of the CUDA graph capture in progress on the stream of int ``handle``
    (``_stream_key``), or None when it is not capturing (or cannot be asked)."""
    if handle is None:
        return None
    try:
        from cuda.bindings import driver
    except ImportError:         # without the bindings, no capture can be detected
        return None
    res = driver.cuStreamGetCaptureInfo(driver.CUstream(handle))
    if res[0] != driver.CUresult.CUDA_SUCCESS or \
            res[1] != driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE:
        return None
    return int(res[2])


def _top_up_spares(device, n):
    """Keep SPARE_COUNTERS zeroed buffers of at least n entries ready for captures."""
    spares = _SPARE_COUNTERS.setdefault(device, [])
    spares[:] = [b for b in spares if b.shape[0] >= n]
    while len(spares) < SPARE_COUNTERS:
        spares.append(cuda.to_device(np.zeros(max(n, 1024), dtype=np.int32)))


def _counters(kind, device, n, stream):
    """int32 zeros (>= n) for the folded merge's arrival counters, one buffer per (device,
    stream): every launch leaves them at zero again, and launches on one stream are ordered.
    Launches on different streams get different buffers; a call inside a CUDA graph capture
    gets its capture's own buffer (from the reserve: see ``_SPARE_COUNTERS``)."""
    if kind == "numpy" or SIMULATOR:
        return np.zeros(max(n, 1), dtype=np.int32)
    handle = _stream_key(stream)
    capture = _capture_id(handle)
    if capture is not None:
        key = (device, "capture", capture)
        buf = _COUNTERS.get(key)
        if buf is None or buf.shape[0] < n:
            spares = [b for b in _SPARE_COUNTERS.get(device, []) if b.shape[0] >= n]
            if not spares:
                raise GraphCaptureError(
                    f"numba_flash.decode inside a CUDA graph capture needs {n} merge counters "
                    f"and none were set aside: make one decode call of this size (or larger) "
                    f"outside the capture first, e.g. the usual warm-up before capturing")
            buf = spares[0]
            _SPARE_COUNTERS[device].remove(buf)
            _COUNTERS.setdefault(("old",), []).append(_COUNTERS.get(key))
            _COUNTERS[key] = buf
        return buf
    key = (device, handle)
    if handle is None:       # a stream we cannot identify: fresh zeros, never shared
        return cuda.to_device(np.zeros(max(n, 1), dtype=np.int32))
    buf = _COUNTERS.get(key)
    if buf is None or buf.shape[0] < n:
        size = max(n, 1024, 2 * (buf.shape[0] if buf is not None else 0))
        buf = cuda.to_device(np.zeros(size, dtype=np.int32))     # synchronous: zeros first
        _COUNTERS.setdefault(("old",), []).append(_COUNTERS.get(key))   # never freed mid-flight
        _COUNTERS[key] = buf
    spares = _SPARE_COUNTERS.get(device)
    if spares is None or len(spares) < SPARE_COUNTERS or min(b.shape[0] for b in spares) < n:
        _top_up_spares(device, n)
    return buf


# Direct launches (no dispatcher typing, no device-array wrappers): see launch.py's module
# docstring; NUMBA_FLASH_SLOW_LAUNCH=1 turns them off, as for the forward kernels.
_FAST = {"on": not SIMULATOR and os.environ.get("NUMBA_FLASH_SLOW_LAUNCH", "") != "1",
         "error": None}
_FAST_LAUNCHERS: dict = {}
_WORD_ARRAYS = (0, 1, 2, 6)          # q, k, v, out: uint32 words of two 16-bit values
_ELEMS = None


def _elem_types():
    global _ELEMS
    if _ELEMS is None:
        _ELEMS = (types.uint32, types.uint32, types.uint32, types.int32, types.int32,
                  types.uint32, types.uint32, types.float32, types.float32, types.float32,
                  types.int32)
    return _ELEMS


def _is_numba_array(x) -> bool:
    """A Numba device array (our cached placeholders and counters): fixed pointer and shape."""
    return type(x).__module__.startswith("numba")


def _flat_param(x, kind, as_words):
    """(layout, ndim, flattened Numba array parameters) of a kernel array argument. A Numba
    device array (the dummies, the counters) keeps its result: its pointer, shape and strides
    never change, and reading its ``__cuda_array_interface__`` costs microseconds per call."""
    numba_array = _is_numba_array(x)
    if numba_array:
        cached = x.__dict__.get("_nf_flat_param", {}).get(as_words)
        if cached is not None:
            return cached
        ptr = int(x.__cuda_array_interface__["data"][0] or 0)
        shape, strides, itemsize = x.shape, x.strides, x.dtype.itemsize
    else:
        ptr, shape, strides, itemsize, _ = launch._interface(x, kind)
    if as_words:
        shape, strides = launch._as_words(ptr, shape, strides)
        itemsize = 4
    lay, flat = launch._flat_array(ptr, tuple(shape), tuple(strides), itemsize)
    result = (lay, len(shape), flat)
    if numba_array:
        x.__dict__.setdefault("_nf_flat_param", {})[as_words] = result
    return result


def _launch_mma_fast(kind, device, config, arrays, ints, floats, ints2, grid, threads, stream,
                     like, interfaces=None):
    """Launch the tensor-core kernel through cuda.core with packed parameters.

    ``arrays``: the 10 array arguments before ``counters`` (user arrays or Numba device arrays);
    the counters are appended here when the configuration folds the merge. ``interfaces``:
    ``launch._interface`` of the leading arrays (q, k, v) when already read. Compiles (or
    loads from Numba's disk cache) once per (configuration, layouts, device); the parameter
    block is built once per configuration and array geometry (``_DECODE_PLANS``), after which
    a call only writes the data pointers of the caller's arrays into it (the Numba arrays, the
    placeholders and the merge counters, keep theirs: they are part of the key).
    """
    raw = launch._raw_stream_handle(stream, kind, like)
    n_units = grid[1] * grid[2]
    counters = _counters(kind, device, n_units, raw) if config[13] else \
        _dummy(kind, device, (1,), np.int32)
    all_arrays = arrays + (counters,)
    ptrs, metas = [], []
    for i, x in enumerate(all_arrays):
        if _is_numba_array(x):
            metas.append(id(x))
            continue
        ptr, shape, strides, itemsize, _ = (interfaces[i] if interfaces is not None and
                                            i < len(interfaces) else launch._interface(x, kind))
        if i in _WORD_ARRAYS and ptr % 4:
            launch._as_words(ptr, shape, strides)      # raises: not 4-byte aligned
        ptrs.append(ptr)
        metas.append((tuple(shape), tuple(strides), itemsize))
    current = current_device_id()
    dev = current if device is None else device
    ctx = cuda.gpus[dev] if dev != current else launch._nullcontext()
    pdl = _pdl_wanted() if config[14] else False
    pad = _smem_pad()
    pkey = (config, tuple(metas), ints, floats, ints2, grid, threads, dev, pdl, pad)
    plan = _DECODE_PLANS.get(pkey)
    if plan is None:
        with ctx:
            plan = _decode_plan(kind, dev, config, all_arrays, ints, floats, ints2, grid,
                                threads, pdl, pad)
        if len(_DECODE_PLANS) >= _DECODE_PLANS_MAX:
            _DECODE_PLANS.clear()
        _DECODE_PLANS[pkey] = plan
    core_kernel, cfg, head, slots, _, (LAST_PLAN["smem_pad"], LAST_PLAN["pdl"]) = plan
    params = list(head)
    for slot, ptr in zip(slots, ptrs):
        params[slot] = ptr
    with ctx:
        launch._core_launch(launch._core_stream(raw), cfg, core_kernel, *params)


_DECODE_PLANS: dict = {}
_KERNEL_PADS: dict = {}       # the dynamic shared-memory limit set on each kernel (bytes)
_DECODE_PLANS_MAX = 256


def _smem_pad() -> int:
    """NUMBA_FLASH_DECODE_SMEM_PAD: bytes of unused dynamic shared memory per block, which
    cap the blocks a multiprocessor takes; "auto" (-1 here): the pad that caps them at the
    grid's own blocks per multiprocessor, ``ceil(blocks / SMs)`` (``_cap_pad``). 0 by
    default."""
    text = os.environ.get("NUMBA_FLASH_DECODE_SMEM_PAD", "0") or "0"
    return -1 if text == "auto" else int(text)


def _cap_pad(core_kernel, threads: int, blocks: int, sm_count: int) -> int:
    """The least dynamic shared memory (a multiple of 1 KB) with which a multiprocessor holds
    at most ``ceil(blocks / sm_count)`` blocks of ``core_kernel`` (cuda.core's occupancy
    query); 0 when its occupancy is already that low, or when no pad gives exactly that cap."""
    occupancy = core_kernel.occupancy.max_active_blocks_per_multiprocessor
    cap = -(-blocks // sm_count)
    if occupancy(threads, 0) <= cap:
        return 0
    # Only pads within the default dynamic limit (48 KB of shared memory per block in all):
    # beyond it the query answers 0 until the kernel's limit is raised.
    for pad in range(1024, 48 * 1024, 1024):
        n = occupancy(threads, pad)
        if n <= cap:
            return pad if n == cap else 0
    return 0


def _decode_plan(kind, dev, config, all_arrays, ints, floats, ints2, grid, threads, pdl,
                 pad=0):
    """(cuda.core kernel, launch config, parameter block, index of each caller array's data
    pointer in it, the Numba arrays the block points to, (dynamic shared-memory pad, whether
    the launch is programmatic-dependent)) for one configuration. ``pdl``: True, False or
    "auto" (``_launch_policy``); ``pad``: bytes, or -1 for ``_cap_pad``."""
    import ctypes

    params, layouts, slots = [], [], []
    for i, x in enumerate(all_arrays):
        lay, ndim, flat = _flat_param(x, kind, i in _WORD_ARRAYS)
        layouts.append((lay, ndim))
        if not _is_numba_array(x):
            slots.append(len(params) + 4)          # the data pointer of a flattened array
        params.extend(flat)
    key = (config, tuple(layouts), dev)
    cufunc = _compiled(key)
    blocks = grid[0] * grid[1] * grid[2]
    if pdl == "auto":
        pdl, pad, late = _launch_policy(cufunc.kernel, threads, blocks, _sm_count(dev))
        if late and config[14] and not config[16]:
            # the kernel variant that signals launch_dependents after its key loop
            key = (config[:16] + (True,) + config[17:], tuple(layouts), dev)
            cufunc = _compiled(key)
            pdl = "late"
    elif pad < 0:
        pad = _cap_pad(cufunc.kernel, threads, blocks, _sm_count(dev))
    if pad > _KERNEL_PADS.get(key, 0):
        # The limit is the kernel's, shared by all its plans: only ever raised (a plan with a
        # smaller pad lowering it made the launches of a larger-pad plan fail).
        from cuda.bindings import driver as cu

        attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        err, = cu.cuKernelSetAttribute(attr, pad, cufunc.handle, cu.CUdevice(dev))
        if err != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuKernelSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES, {pad}) "
                               f"failed: {err}")
        _KERNEL_PADS[key] = pad
    params.extend(ctypes.c_int64(v) for v in ints)
    params.extend(ctypes.c_float(v) for v in floats)
    params.extend(ctypes.c_int64(v) for v in ints2)
    if config[19]:
        cfg = _cluster_config(grid, threads, grid[0], pad)
    elif pdl:
        cfg = _pdl_config(grid, threads, pad)
    else:
        cfg = launch._launch_config(grid, threads, pad)
    numba_arrays = tuple(x for x in all_arrays if _is_numba_array(x))
    return cufunc.kernel, cfg, tuple(params), tuple(slots), numba_arrays, (pad, pdl)


def _compiled(key):
    """Numba's function object for ``key`` = (configuration, array layouts, device), compiled
    (or loaded from Numba's disk cache) once: ``.kernel`` is the cuda.core kernel, ``.handle``
    its driver handle."""
    cufunc = _FAST_LAUNCHERS.get(key)
    if cufunc is None:
        config, layouts, dev = key
        elems = _elem_types()
        arg_types = [types.Array(e, nd, lay) for e, (lay, nd) in zip(elems, layouts)]
        sig = types.void(*arg_types, types.int64, types.int64, types.int64, types.float32,
                         types.float32, types.float32, *([types.int64] * 6))
        kobj = mma_decode_kernel(*config).compile(sig)
        cufunc = kobj._codelibrary.get_cufunc()
        if config[19]:          # cluster merge
            _allow_large_clusters(cufunc, dev)
        _FAST_LAUNCHERS[key] = cufunc
    return cufunc


_PDL_CONFIGS: dict = {}


def _pdl_config(grid, threads, pad=0):
    """A cuda.core launch configuration with programmatic stream serialization."""
    cfg = _PDL_CONFIGS.get((grid, threads, pad))
    if cfg is None:
        try:
            cfg = launch._CoreLaunchConfig(grid=grid, block=threads, shmem_size=pad,
                                           programmatic_stream_serialization=True)
        except TypeError:      # a cuda.core without the option: plain launches
            cfg = launch._launch_config(grid, threads, pad)
        _PDL_CONFIGS[(grid, threads, pad)] = cfg
    return cfg


def _stream_key(stream):
    """An int for a raw handle or a Numba stream (one stream, one key); None if unknown."""
    if isinstance(stream, int):
        return stream
    handle = getattr(stream, "handle", None)
    value = getattr(handle, "value", handle)
    if isinstance(value, int):
        return value
    return 0 if value is None and handle is not None else None


def mma_decode_kernel(*config):
    """The cached kernel for one ``make_mma_decode_kernel`` configuration."""
    if config not in _MMA_KERNELS:
        _MMA_KERNELS[config] = make_mma_decode_kernel(*config)
    return _MMA_KERNELS[config]


def _dummy(kind, device, shape, dtype):
    if kind == "numpy" or SIMULATOR:
        return np.zeros(shape, dtype=dtype)
    key = (device, shape, np.dtype(dtype).str)
    if key not in _DUMMIES:
        _DUMMIES[key] = cuda.to_device(np.zeros(shape, dtype=dtype))
    return _DUMMIES[key]


def tree_row_bits(parents: np.ndarray, seqlen_q: int) -> np.ndarray:
    """uint32 (seqlen_q, 2): bit t of row s set iff tree node t is query s's node or an ancestor.

    Query s is node ``s - seqlen_q + len(parents)`` (the queries are the last nodes); a query
    outside the tree sees no node. At most 64 nodes.
    """
    n = len(parents)
    anc = np.zeros((n, n), dtype=bool)
    for node in range(n):
        if node:
            anc[node] = anc[parents[node]]
        anc[node, node] = True
    bits = np.zeros((seqlen_q, 2), dtype=np.uint32)
    for s in range(seqlen_q):
        tq = s - seqlen_q + n
        if 0 <= tq < n:
            word = sum(1 << t for t in range(n) if anc[tq, t])
            bits[s, 0] = word & 0xFFFFFFFF
            bits[s, 1] = word >> 32
    return bits


def _tree_array(kind, device, parents, seqlen_q):
    bits = tree_row_bits(parents, seqlen_q)
    if kind == "numpy" or SIMULATOR:
        return bits
    key = (device, bits.tobytes(), seqlen_q)
    if key not in _TREES:
        _TREES[key] = cuda.to_device(bits)
    return _TREES[key]


def decode_cuda(q, k_cache, v_cache, *, cache_seqlens, block_table, softmax_scale: float,
                causal=True, window_size=(-1, -1), sinks=0, tree_parents=None, softcap=None,
                num_splits="auto", return_lse=False, stream=None):
    """Split-KV decode on the GPU (arguments already validated by ``numba_flash.decode``).

    ``cache_seqlens=None``: every sequence fills the cache (the tensor-core kernel then reads
    no lengths; the CUDA-core kernel gets a full-length array).

    q (B, Sq, Hq, D) float16/bfloat16; k_cache, v_cache (B, S_max, Hkv, D) or paged
    (num_pages, page_size, Hkv, D) with block_table int32 (B, max_pages); cache_seqlens int32
    (B,); all of one array kind. tree_parents: int array of a draft tree (<= 64 nodes, the
    last keys of each sequence) or None. Returns out (B, Sq, Hq, D) in q's dtype, and lse
    float32 (B, Hq, Sq) with ``return_lse``. Launches on ``stream`` or the current stream.
    """
    kind, dtype_name, device, interfaces = launch._gpu_inputs(q, k_cache, v_cache)
    if dtype_name not in ("float16", "bfloat16"):
        raise TypeError(f"decode on the GPU takes float16 or bfloat16 q / k_cache / v_cache, got "
                        f"{dtype_name}; use NumPy arrays (CPU mode) for float32 / float64")
    is_bf16 = dtype_name == "bfloat16"
    batch, seqlen_q, heads_q, head_dim = q.shape
    heads_kv = k_cache.shape[2]
    paged = block_table is not None
    for name, (ptr, _, strides, _, _) in (("k_cache", interfaces[1]), ("v_cache", interfaces[2])):
        if ptr % 16 or any(st % 16 for st in strides[:3]):
            raise ValueError(f"{name} must be 16-byte aligned (pointer and the strides of its first "
                             f"three axes) for vector loads, got strides {tuple(strides)} bytes; "
                             f"make a contiguous copy")
    ratio = heads_q // heads_kv
    m_rows = ratio * seqlen_q
    use_mma = _use_mma(head_dim)
    pow2_pages = not paged or k_cache.shape[1] & (k_cache.shape[1] - 1) == 0
    if use_mma:
        block_n, stages, warps = mma_tile(head_dim, paged, pow2_pages)
        chunks = -(-m_rows // MMA_ROWS)
        rows = MMA_ROWS
    else:
        chunks = -(-m_rows // MAX_ROWS)
        rows = -(-m_rows // chunks)
    if paged:
        page_size = k_cache.shape[1]
        capacity = block_table.shape[1] * page_size
    else:
        page_size = 1
        capacity = k_cache.shape[1]
    page_shift = page_size.bit_length() - 1 if page_size & (page_size - 1) == 0 else -1
    page_pow2 = page_size if paged and page_shift >= 0 else 0
    full_lens = cache_seqlens is None and use_mma
    if cache_seqlens is None and not use_mma:   # the CUDA-core kernel always reads lengths
        from ..decode import _full_lengths

        cache_seqlens = _full_lengths(kind, q, batch, capacity)

    left, right, has_left, has_right, has_sinks, has_softcap = launch.window_flags(
        causal, window_size, sinks, softcap)
    has_tree = tree_parents is not None

    if num_splits == "auto":
        keys = capacity
        if has_left:
            keys = min(keys, left + seqlen_q + max(right, 0) + int(sinks))
        if use_mma:
            if paged:
                wps = MMA_WARPS_PER_SM_PAGED if pow2_pages else MMA_WARPS_PER_SM_PAGED_ANY
                splits = auto_num_splits_mma(batch * heads_kv * chunks, keys, _sm_count(device),
                                             wps, 0)
            else:
                splits = auto_num_splits_mma(batch * heads_kv * chunks, keys, _sm_count(device))
        else:
            splits = auto_num_splits(batch * heads_kv * chunks, keys, _sm_count(device))
    else:
        splits = int(num_splits)
    direct = splits == 1
    fold = _fold_merge()
    cluster = (use_mma and not direct and kind != "numpy" and fold and
               _cluster_merge(device, splits, warps))

    out = launch._empty_like_kind(kind, q, (batch, seqlen_q, heads_q, head_dim), dtype_name)
    lse = launch._empty_like_kind(kind, q, (batch, heads_q, seqlen_q), "float32") \
        if return_lse else None
    if batch * seqlen_q * heads_q == 0:
        return (out, lse) if return_lse else out

    dummy_f = _dummy(kind, device, (1, 1, 1), np.float32)
    o_part = lse_part = None
    if not direct and not cluster:
        o_part = launch._empty_like_kind(kind, q, (splits, batch, seqlen_q, heads_q, head_dim),
                                         "float32")
        lse_part = launch._empty_like_kind(kind, q, (splits, batch, heads_q, seqlen_q), "float32")
    tree_arg = _tree_array(kind, device, np.asarray(tree_parents), seqlen_q) if has_tree else \
        _dummy(kind, device, (1, 2), np.uint32)
    tree_len = len(tree_parents) if has_tree else 0

    scale = float(softmax_scale)
    log2e = 1.0 / math.log(2.0)
    cap = float(softcap) if has_softcap else 1.0
    f32 = np.float32
    LAST_PLAN.update(splits=splits, tile=(block_n, stages, warps) if use_mma else None,
                     merge="direct" if direct else "cluster" if cluster else
                     "fold" if use_mma and fold else "kernel")
    if use_mma and kind != "numpy" and _FAST["on"] and (direct or fold):
        # The caller's arrays as they are (no Numba device-array wrappers: see launch.py).
        arrays = (q, k_cache, v_cache,
                  block_table if paged else _dummy(kind, device, (1, 1), np.int32),
                  _dummy(kind, device, (1,), np.int32) if full_lens else cache_seqlens,
                  tree_arg, out, lse if return_lse else dummy_f,
                  _dummy(kind, device, (1, 1, 1, 1, 1), np.float32) if direct or cluster
                  else o_part,
                  _dummy(kind, device, (1, 1, 1, 1), np.float32) if direct or cluster
                  else lse_part)
        config = (head_dim, is_bf16, paged, has_left, has_right, has_sinks, has_softcap,
                  has_tree, direct, bool(return_lse), block_n, stages, warps,
                  not direct and not cluster, _pdl_device(device), page_pow2, _pdl_late(),
                  not direct and _new_tail(), full_lens, cluster, _stream_hint(chunks))
        ints = (ratio, chunks, splits)
        floats = (scale * log2e, scale / cap, cap * log2e)
        ints2 = (left, right, int(sinks), tree_len, page_size, page_shift)
        grid = (-(-splits // warps), batch, heads_kv * chunks)
        try:
            _launch_mma_fast(kind, device, config, arrays, ints, floats, ints2, grid,
                             32 * warps, stream, q, interfaces)
            if kind == "cai" and is_bf16:
                out = launch._BFloat16Array(out)
            return (out, lse) if return_lse else out
        except GraphCaptureError:
            raise
        except Exception as exc:  # noqa: BLE001 - keep working through the dispatcher
            import warnings

            if cluster:             # the cluster launch failed: the last-warp fold from now on
                _CLUSTER["on"] = False
                _CLUSTER["error"] = repr(exc)
                warnings.warn(f"numba_flash.decode: cluster launch failed ({exc!r}); merging "
                              f"splits with the last-warp fold from now on", RuntimeWarning)
                return decode_cuda(q, k_cache, v_cache, cache_seqlens=cache_seqlens,
                                   block_table=block_table, softmax_scale=softmax_scale,
                                   causal=causal, window_size=window_size, sinks=sinks,
                                   tree_parents=tree_parents, softcap=softcap,
                                   num_splits=num_splits, return_lse=return_lse, stream=stream)
            _FAST["on"] = False
            _FAST["error"] = repr(exc)
            warnings.warn(f"numba_flash.decode: direct launch failed ({exc!r}); using Numba's "
                          f"dispatcher from now on", RuntimeWarning)

    # Numba's dispatcher: its device-array wrappers are built only on this path (they cost
    # about a quarter of a direct call's host time).
    lse_arg = launch._kernel_array(lse, kind, False) if return_lse else dummy_f
    if direct:
        o_part_arg = _dummy(kind, device, (1, 1, 1, 1, 1), np.float32)
        lse_part_arg = _dummy(kind, device, (1, 1, 1, 1), np.float32)
    else:
        o_part_arg = launch._kernel_array(o_part, kind, False)
        lse_part_arg = launch._kernel_array(lse_part, kind, False)
    bt_arg = launch._kernel_array(block_table, kind, False) if paged else \
        _dummy(kind, device, (1, 1), np.int32)
    sl_arg = _dummy(kind, device, (1,), np.int32) if full_lens else \
        launch._kernel_array(cache_seqlens, kind, False)
    if kind == "numpy":
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        tree_arg = FakeCUDAArray(tree_arg)
        if not paged:
            bt_arg = FakeCUDAArray(bt_arg)
        if direct:
            o_part_arg, lse_part_arg = FakeCUDAArray(o_part_arg), FakeCUDAArray(lse_part_arg)
        if not return_lse:
            lse_arg = FakeCUDAArray(lse_arg)

    qa, ka, va, oa = (launch._kernel_array(x, kind, True) for x in (q, k_cache, v_cache, out))
    launch_stream = launch._resolve_stream(stream, kind, q)
    ctx = cuda.gpus[device] if (device is not None and not SIMULATOR) else launch._nullcontext()
    with ctx:
        if use_mma:
            fold = fold and not direct
            counters = _counters(kind, device, batch * heads_kv * chunks, launch_stream) \
                if fold else _dummy(kind, device, (1,), np.int32)
            kern = mma_decode_kernel(head_dim, is_bf16, paged, has_left, has_right, has_sinks,
                                     has_softcap, has_tree, direct, bool(return_lse), block_n,
                                     stages, warps, fold, False, page_pow2, False,
                                     not direct and _new_tail(), full_lens, False,
                                     _stream_hint(chunks))
            kern[(-(-splits // warps), batch, heads_kv * chunks), 32 * warps, launch_stream](
                qa, ka, va, bt_arg, sl_arg, tree_arg, oa, lse_arg, o_part_arg, lse_part_arg,
                counters, ratio, chunks, splits, f32(scale * log2e), f32(scale / cap),
                f32(cap * log2e),
                left, right, int(sinks), tree_len, page_size, page_shift)
        else:
            kern = decode_kernel(head_dim, is_bf16, rows, paged, has_left, has_right, has_sinks,
                                 has_softcap, has_tree, direct, bool(return_lse))
            kern[(splits, batch, heads_kv * chunks), DECODE_WARPS * 32, launch_stream](
                qa, ka, va, bt_arg, sl_arg, tree_arg, oa, lse_arg, o_part_arg, lse_part_arg,
                ratio, chunks, f32(scale * log2e), f32(scale / cap), f32(cap * log2e), left,
                right, int(sinks), tree_len, page_size, page_shift)
        if not direct and not (use_mma and fold):
            launch_merge(o_part_arg, lse_part_arg, oa, lse_arg,
                         out_mode=OUT_BF16 if is_bf16 else OUT_F16, write_lse=bool(return_lse),
                         stream=launch_stream)
    if kind == "cai" and is_bf16:
        out = launch._BFloat16Array(out)
    return (out, lse) if return_lse else out
