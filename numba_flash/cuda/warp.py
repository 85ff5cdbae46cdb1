"""Warp-collective primitives for the kernels, with fallbacks for Numba's CUDA simulator.

On a GPU every function here is an ``@intrinsic`` that emits inline PTX (``mma.sync``,
``cvt.rn.f16x2.f32``, ``ex2.approx``) or a Numba CUDA built-in (``shfl_xor_sync``). Under
``NUMBA_ENABLE_CUDASIM=1`` the simulator has neither inline PTX nor warp shuffles, so the same
names are plain Python functions: each simulated lane posts its operand to a per-warp exchange
(a ``threading.Barrier`` of 32), and every lane computes its own share of the collective result
from the gathered operands. The kernel source is therefore identical on both.

Register conventions (PTX ISA, "Matrix Fragments for mma.m16n8k16", with ``g = lane >> 2`` and
``t = lane & 3``): a ``uint32`` holds two 16-bit values, the lower-indexed column in the low half.

* A (16 x 16, row-major): ``a0 = A[g, 2t:2t+2]``, ``a1 = A[g+8, 2t:2t+2]``,
  ``a2 = A[g, 2t+8:2t+10]``, ``a3 = A[g+8, 2t+8:2t+10]``.
* B (16 x 8, k x n), given as its transpose ``BT`` (n x k, row-major):
  ``b0 = BT[g, 2t:2t+2]``, ``b1 = BT[g, 2t+8:2t+10]``.
* C/D (16 x 8, float32): ``c0, c1 = C[g, 2t], C[g, 2t+1]``; ``c2, c3 = C[g+8, 2t], C[g+8, 2t+1]``.

``ldmatrix_x4(smem, i, j)``: lanes 8m..8m+7 give the 8 row addresses (``&smem[i, j]``, 16 bytes
each) of 8x8 matrix m; every lane gets register m = row ``g``, 16-bit columns ``2t, 2t+1`` of
matrix m (with ``_trans``: rows ``2t, 2t+1``, column ``g``, i.e. of the transpose). These are
exactly B fragments: of K^T from a [key][d] tile, and of V from a [key][d] tile with ``_trans``.
``cp_async16`` copies 16 bytes global -> shared without passing through registers (zero-filled
when ``src_bytes`` is 0); ``cp_async_commit`` / ``cp_async_wait_all`` close and await a group.
"""
from __future__ import annotations

import math
import threading

import numpy as np
from numba.cuda import config

SIMULATOR = bool(config.ENABLE_CUDASIM)

__all__ = ["SIMULATOR", "mma_f16", "mma_bf16", "pack_f16", "pack_bf16", "exp2", "shfl_xor",
           "mma16", "pack16", "ldmatrix_x4", "ldmatrix_x4_trans", "cp_async16", "cp_async16_at", "cp_async_commit", "cp_async_wait_all",
           "ballot", "lowest_bit", "shfl_idx"]

if not SIMULATOR:
    from llvmlite import ir
    from numba import cuda
    from numba.cuda import types
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    _U32 = types.uint32
    _F32 = types.float32

    def _mma_intrinsic(ptx_types: str):
        """An intrinsic for ``mma.sync.aligned.m16n8k16.row.col.f32.<ptx_types>.f32``."""

        @intrinsic
        def mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
            sig = types.UniTuple(_F32, 4)(_U32, _U32, _U32, _U32, _U32, _U32,
                                          _F32, _F32, _F32, _F32)

            def codegen(context, builder, sig, args):
                f32, i32 = ir.FloatType(), ir.IntType(32)
                fnty = ir.FunctionType(ir.LiteralStructType([f32] * 4), [i32] * 6 + [f32] * 4)
                asm = ir.InlineAsm(
                    fnty,
                    f"mma.sync.aligned.m16n8k16.row.col.f32.{ptx_types}.f32 "
                    "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};",
                    "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
                res = builder.call(asm, args)
                vals = [builder.extract_value(res, i) for i in range(4)]
                return context.make_tuple(builder, sig.return_type, vals)

            return sig, codegen

        return mma

    mma_f16 = _mma_intrinsic("f16.f16")
    mma_bf16 = _mma_intrinsic("bf16.bf16")

    def _pack_intrinsic(ptx_type: str):
        """Two float32 -> one uint32 of two ``ptx_type`` values (round to nearest even)."""

        @intrinsic
        def pack(typingctx, lo, hi):
            sig = _U32(_F32, _F32)

            def codegen(context, builder, sig, args):
                fnty = ir.FunctionType(ir.IntType(32), [ir.FloatType()] * 2)
                # cvt.rn.f16x2.f32 d, a, b puts a in the upper half and b in the lower half.
                asm = ir.InlineAsm(fnty, f"cvt.rn.{ptx_type}x2.f32 $0, $2, $1;", "=r,f,f")
                return builder.call(asm, args)

            return sig, codegen

        return pack

    pack_f16 = _pack_intrinsic("f16")
    pack_bf16 = _pack_intrinsic("bf16")

    @intrinsic
    def exp2(typingctx, x):
        """2**x in float32 through the special-function unit (ex2.approx; exp2(-inf) = 0)."""
        sig = _F32(_F32)

        def codegen(context, builder, sig, args):
            fnty = ir.FunctionType(ir.FloatType(), [ir.FloatType()])
            asm = ir.InlineAsm(fnty, "ex2.approx.ftz.f32 $0, $1;", "=f,f")
            return builder.call(asm, args)

        return sig, codegen

    @cuda.jit(device=True, inline=True)
    def shfl_xor(value, lane_mask):
        """``value`` from lane ``lane ^ lane_mask`` of the same (fully active) warp."""
        return cuda.shfl_xor_sync(0xFFFFFFFF, value, lane_mask)

    def _item_pointer_i64(context, builder, aryty, aryval, idx_types, idx_vals):
        """Address (i64) of ``ary[idx...]`` for a Numba array value inside an intrinsic."""
        ary = context.make_array(aryty)(context, builder, aryval)
        inds = [context.cast(builder, v, t, types.intp) for v, t in zip(idx_vals, idx_types)]
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, inds)
        return builder.ptrtoint(ptr, ir.IntType(64))

    def _offset_pointer_i64(context, builder, aryty, aryval, offty, offval):
        """Address (i64) of ``ary``'s first element + ``off`` elements (any strides: the
        caller computed the offset)."""
        ary = context.make_array(aryty)(context, builder, aryval)
        off = context.cast(builder, offval, offty, types.int64)
        size = context.get_constant(types.int64, aryty.dtype.bitwidth // 8)
        return builder.add(builder.ptrtoint(ary.data, ir.IntType(64)), builder.mul(off, size))

    # Shared arrays reach an intrinsic as generic pointers: cvta.to.shared makes the 32-bit
    # shared-window address that ldmatrix and cp.async take.
    _TO_SHARED = "{ .reg .u64 t; .reg .u32 s; cvta.to.shared.u64 t, $%d; cvt.u32.u64 s, t; %s }"

    def _ldmatrix_intrinsic(trans: bool):
        op = "ldmatrix.sync.aligned.m8n8.x4%s.shared.b16 {$0,$1,$2,$3}, [s];" % (
            ".trans" if trans else "")

        @intrinsic
        def ldm(typingctx, ary, i, j):
            sig = types.UniTuple(_U32, 4)(ary, i, j)

            def codegen(context, builder, sig, args):
                addr = _item_pointer_i64(context, builder, sig.args[0], args[0], sig.args[1:],
                                         args[1:])
                i32 = ir.IntType(32)
                fnty = ir.FunctionType(ir.LiteralStructType([i32] * 4), [ir.IntType(64)])
                asm = ir.InlineAsm(fnty, _TO_SHARED % (4, op), "=r,=r,=r,=r,l,~{memory}",
                                   side_effect=True)
                res = builder.call(asm, [addr])
                vals = [builder.extract_value(res, n) for n in range(4)]
                return context.make_tuple(builder, sig.return_type, vals)

            return sig, codegen

        return ldm

    ldmatrix_x4 = _ldmatrix_intrinsic(False)
    ldmatrix_x4_trans = _ldmatrix_intrinsic(True)

    @intrinsic
    def cp_async16(typingctx, dst, di, dj, src, s0, s1, s2, s3, src_bytes):
        """16 bytes from ``&src[s0, s1, s2, s3]`` (global) to ``&dst[di, dj]`` (shared)."""
        sig = types.void(dst, di, dj, src, s0, s1, s2, s3, src_bytes)

        def codegen(context, builder, sig, args):
            d = _item_pointer_i64(context, builder, sig.args[0], args[0], sig.args[1:3], args[1:3])
            g = _item_pointer_i64(context, builder, sig.args[3], args[3], sig.args[4:8], args[4:8])
            n = context.cast(builder, args[8], sig.args[8], types.int32)
            fnty = ir.FunctionType(ir.VoidType(), [ir.IntType(64), ir.IntType(64), ir.IntType(32)])
            asm = ir.InlineAsm(fnty, _TO_SHARED % (0, "cp.async.cg.shared.global [s], [$1], 16, $2;"),
                               "l,l,r,~{memory}", side_effect=True)
            builder.call(asm, [d, g, n])
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def cp_async16_at(typingctx, dst, di, dj, src, word_offset, src_bytes):
        """16 bytes from ``src``'s first element + ``word_offset`` elements (global; the caller
        computes the offset from the strides, so no per-copy index arithmetic) to ``&dst[di,
        dj]`` (shared)."""
        sig = types.void(dst, di, dj, src, word_offset, src_bytes)

        def codegen(context, builder, sig, args):
            d = _item_pointer_i64(context, builder, sig.args[0], args[0], sig.args[1:3], args[1:3])
            g = _offset_pointer_i64(context, builder, sig.args[3], args[3], sig.args[4], args[4])
            i64 = ir.IntType(64)
            n = context.cast(builder, args[5], sig.args[5], types.int32)
            fnty = ir.FunctionType(ir.VoidType(), [i64, i64, ir.IntType(32)])
            asm = ir.InlineAsm(fnty, _TO_SHARED % (0, "cp.async.cg.shared.global [s], [$1], 16, $2;"),
                               "l,l,r,~{memory}", side_effect=True)
            builder.call(asm, [d, g, n])
            return context.get_dummy_value()

        return sig, codegen

    def _bare_asm_intrinsic(text):
        @intrinsic
        def op(typingctx):
            sig = types.void()

            def codegen(context, builder, sig, args):
                fnty = ir.FunctionType(ir.VoidType(), [])
                builder.call(ir.InlineAsm(fnty, text, "~{memory}", side_effect=True), [])
                return context.get_dummy_value()

            return sig, codegen

        return op

    @cuda.jit(device=True, inline=True)
    def mma16(is_bf16, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """``mma_bf16`` if ``is_bf16`` (a compile-time constant at the call site) else ``mma_f16``."""
        if is_bf16:
            return mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)
        return mma_f16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)

    @cuda.jit(device=True, inline=True)
    def pack16(is_bf16, lo, hi):
        """``pack_bf16`` if ``is_bf16`` else ``pack_f16``."""
        if is_bf16:
            return pack_bf16(lo, hi)
        return pack_f16(lo, hi)

    cp_async_commit = _bare_asm_intrinsic("cp.async.commit_group;")
    cp_async_wait_all = _bare_asm_intrinsic("cp.async.wait_group 0;")

else:
    _exchange_lock = threading.Lock()
    _exchanges: dict = {}

    class _WarpExchange:
        """Per-warp meeting point: 32 slots in, one combined result per lane out."""

        def __init__(self):
            self.slots = [None] * 32
            self.results = None
            self.combine = None
            # The barrier's action runs once, in one thread, after all 32 lanes have posted.
            self.barrier = threading.Barrier(32, action=self._run, timeout=300)

        def _run(self):
            self.results = self.combine(self.slots)

    def _collective(value, combine):
        """Post ``value`` for this simulated lane; ``combine(values_by_lane)`` returns 32 results."""
        thread = threading.current_thread()
        tid = thread.thread_id
        key = (id(thread._manager), tuple(thread.blockIdx), tid // 32)
        with _exchange_lock:
            ex = _exchanges.get(key)
            if ex is None:
                ex = _exchanges[key] = _WarpExchange()
        lane = tid % 32
        ex.slots[lane] = value
        ex.combine = combine
        ex.barrier.wait()
        result = ex.results[lane]
        ex.barrier.wait()  # nobody starts the next collective before every lane has its result
        return result

    _G = np.arange(32) >> 2
    _T = np.arange(32) & 3

    def _halves_f16(words):
        return np.ascontiguousarray(words, dtype=np.uint32).view(np.float16).astype(np.float64)

    def _halves_bf16(words):
        w = np.ascontiguousarray(words, dtype=np.uint32)
        pair = np.stack([(w & 0xFFFF) << 16, w & 0xFFFF0000], axis=-1).astype(np.uint32)
        return pair.view(np.float32).reshape(w.shape[:-1] + (2 * w.shape[-1],)).astype(np.float64)

    def _mma_combine(halves):
        def combine(slots):
            frags = np.array([[int(x) & 0xFFFFFFFF for x in f[:6]] for f in slots], dtype=np.uint32)
            h = halves(frags)                               # (32 lanes, 12 values)
            A = np.zeros((16, 16))
            BT = np.zeros((8, 16))
            for r, (dr, dc) in enumerate(((0, 0), (8, 0), (0, 8), (8, 8))):
                for e in range(2):
                    A[_G + dr, 2 * _T + dc + e] = h[:, 2 * r + e]
            for r, dc in enumerate((0, 8)):
                for e in range(2):
                    BT[_G, 2 * _T + dc + e] = h[:, 8 + 2 * r + e]
            C = np.array([f[6:] for f in slots], dtype=np.float32)
            D = (A @ BT.T).astype(np.float32)                # exact products, one rounding
            prod = np.stack([D[_G, 2 * _T], D[_G, 2 * _T + 1], D[_G + 8, 2 * _T],
                             D[_G + 8, 2 * _T + 1]], axis=1)
            out = (C + prod).astype(np.float32)
            return [tuple(np.float32(x) for x in row) for row in out]
        return combine

    _combine_f16 = _mma_combine(_halves_f16)
    _combine_bf16 = _mma_combine(_halves_bf16)

    def mma_f16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """D = A @ B + C for one warp; fragments as in the module docstring (float16 inputs)."""
        return _collective((a0, a1, a2, a3, b0, b1, c0, c1, c2, c3), _combine_f16)

    def mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """D = A @ B + C for one warp; fragments as in the module docstring (bfloat16 inputs)."""
        return _collective((a0, a1, a2, a3, b0, b1, c0, c1, c2, c3), _combine_bf16)

    def mma16(is_bf16, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """``mma_bf16`` if ``is_bf16`` else ``mma_f16``."""
        return (mma_bf16 if is_bf16 else mma_f16)(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)

    def pack16(is_bf16, lo, hi):
        """``pack_bf16`` if ``is_bf16`` else ``pack_f16``."""
        return (pack_bf16 if is_bf16 else pack_f16)(lo, hi)

    def pack_f16(lo, hi):
        """Two float32 -> uint32 holding float16(lo) in the low half, float16(hi) in the high."""
        h = np.array([lo, hi], dtype=np.float32).astype(np.float16)
        return np.uint32(h.view(np.uint32)[0])

    def _bf16_bits(x):
        bits = int(np.array([x], dtype=np.float32).view(np.uint32)[0])
        if math.isnan(float(x)):
            return 0x7FC0
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF

    def pack_bf16(lo, hi):
        """Two float32 -> uint32 holding bfloat16(lo) low, bfloat16(hi) high (nearest even)."""
        return np.uint32(_bf16_bits(lo) | (_bf16_bits(hi) << 16))

    def exp2(x):
        """2**x in float32 (exp2(-inf) = 0)."""
        return np.float32(np.exp2(np.float32(x)))

    def _xor_combine(mask):
        def combine(slots):
            return [slots[lane ^ mask] for lane in range(32)]
        return combine

    _XOR = {m: _xor_combine(m) for m in (1, 2, 4, 8, 16)}

    def shfl_xor(value, lane_mask):
        """``value`` from lane ``lane ^ lane_mask`` of the same warp."""
        return _collective(value, _XOR[lane_mask])

    def _ldm_combine(slots):
        return [tuple(slots[8 * m + (lane >> 2)][lane & 3] for m in range(4)) for lane in range(32)]

    def _ldm_trans_combine(slots):
        words = np.array([[int(x) & 0xFFFFFFFF for x in row] for row in slots], dtype=np.uint32)
        halves = words.view(np.uint16)                 # (32 row addresses, 8 columns)
        out = []
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            regs = []
            for m in range(4):
                lo = int(halves[8 * m + 2 * t, g])
                hi = int(halves[8 * m + 2 * t + 1, g])
                regs.append(np.uint32(lo | (hi << 16)))
            out.append(tuple(regs))
        return out

    def ldmatrix_x4(ary, i, j):
        """Four 8x8 16-bit matrices from shared memory; this lane gives row ``&ary[i, j]``."""
        return _collective(tuple(ary[i, j + e] for e in range(4)), _ldm_combine)

    def ldmatrix_x4_trans(ary, i, j):
        """As ``ldmatrix_x4``, each matrix delivered transposed."""
        return _collective(tuple(ary[i, j + e] for e in range(4)), _ldm_trans_combine)

    def cp_async16(dst, di, dj, src, s0, s1, s2, s3, src_bytes):
        """Copy 4 words ``src[s0, s1, s2, s3:s3+4]`` to ``dst[di, dj:dj+4]`` (zeros if src_bytes 0)."""
        for e in range(4):
            dst[di, dj + e] = src[s0, s1, s2, s3 + e] if src_bytes else 0

    def cp_async16_at(dst, di, dj, src, word_offset, src_bytes):
        """Copy 4 elements at ``word_offset`` elements past ``src``'s first one (any strides)."""
        a = np.asarray(getattr(src, "_ary", src))
        off = int(word_offset)
        flat = np.lib.stride_tricks.as_strided(a, shape=(off + 4,), strides=(a.itemsize,))
        for e in range(4):
            dst[di, dj + e] = flat[off + e] if src_bytes else 0

    def cp_async_commit():
        """Close the current group of asynchronous copies (a no-op in the simulator)."""

    def cp_async_wait_all():
        """Wait for every committed asynchronous copy (a no-op in the simulator)."""


# ----------------------------------------------------------------------------- added for decode
# Partial waits for multi-stage cp.async pipelines (no-ops in the simulator, whose cp_async16
# copies at once) and a warp barrier.
if not SIMULATOR:
    cp_async_wait_1 = _bare_asm_intrinsic("cp.async.wait_group 1;")
    cp_async_wait_2 = _bare_asm_intrinsic("cp.async.wait_group 2;")
    cp_async_wait_3 = _bare_asm_intrinsic("cp.async.wait_group 3;")

    @cuda.jit(device=True, inline=True)
    def syncwarp():
        """Barrier of the (fully active) warp; orders its lanes' shared-memory accesses."""
        cuda.syncwarp(0xFFFFFFFF)
else:
    def cp_async_wait_1():
        """Wait until at most one committed copy group is pending (no-op in the simulator)."""

    def cp_async_wait_2():
        """Wait until at most two committed copy groups are pending (no-op in the simulator)."""

    def cp_async_wait_3():
        """Wait until at most three committed copy groups are pending (no-op in the simulator)."""

    _NONE32 = [None] * 32

    def syncwarp():
        """Warp barrier: every simulated lane of the warp arrives before any goes on."""
        _collective(None, lambda slots: _NONE32)


# Warp votes for the mask tile walk (maskdev.py): a block-uniform bit set of 32 key tiles.
if not SIMULATOR:
    @cuda.jit(device=True, inline=True)
    def ballot(pred):
        """int64 with bit i set where lane i's ``pred`` is true (fully active warp)."""
        # Numba types the vote's result as a signed int32: keep the low 32 bits only (lane 31
        # set would otherwise sign-extend into bits 32..63).
        return np.int64(cuda.ballot_sync(0xFFFFFFFF, pred)) & 0xFFFFFFFF

    @cuda.jit(device=True, inline=True)
    def lowest_bit(x):
        """Index (0-based) of the lowest set bit of a non-zero 32-bit value ``x`` (int64)."""
        return np.int64(cuda.ffs(np.uint32(x))) - 1
else:
    def _ballot_combine(slots):
        word = 0
        for lane, pred in enumerate(slots):
            if pred:
                word |= 1 << lane
        return [np.int64(word)] * 32

    def ballot(pred):
        """int64 with bit i set where lane i's ``pred`` is true (fully active warp)."""
        return _collective(bool(pred), _ballot_combine)

    def lowest_bit(x):
        """Index (0-based) of the lowest set bit of a non-zero 32-bit value ``x`` (int64)."""
        x = int(x)
        return np.int64((x & -x).bit_length() - 1)


# Indexed shuffle: the paged decode kernel keeps 32 block-table entries in a warp's registers.
if not SIMULATOR:
    @cuda.jit(device=True, inline=True)
    def shfl_idx(value, src_lane):
        """``value`` of lane ``src_lane`` (0..31) of the same, fully active warp."""
        return cuda.shfl_sync(0xFFFFFFFF, value, src_lane)
else:
    def _idx_combine(slots):
        return [slots[int(src)][0] for _, src in slots]

    def shfl_idx(value, src_lane):
        """``value`` of lane ``src_lane`` (0..31) of the same, fully active warp."""
        return _collective((value, src_lane), _idx_combine)
