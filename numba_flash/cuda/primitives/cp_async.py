"""Asynchronous global -> shared copies (``cp.async``, 16 bytes, bypassing registers) and the
group commit / wait instructions of a multi-stage pipeline.

``cp_async16`` copies 16 bytes (zero-filled when ``src_bytes`` is 0) from an indexed element,
``cp_async16_at`` from an element offset the caller computed from the strides (no per-copy
index arithmetic), ``cp_async16_flat`` from a byte offset (the strides are in bytes, so a
kernel parameter's stride multiplies as it is) to an element of a 1-D (dynamic) shared array,
addressed in 32 bits. In the simulator the copy happens at once (an IndexError for elements
outside the source array) and the waits are no-ops.
"""
from __future__ import annotations

import numpy as np

from .base import (SIMULATOR, TO_SHARED, bare_asm_intrinsic, item_pointer_i64, offset_pointer_i64,
                   shared_address_i32)

__all__ = ["cp_async16", "cp_async16_at", "cp_async16_flat", "cp_async_commit",
           "cp_async_wait_all", "cp_async_wait_1", "cp_async_wait_2", "cp_async_wait_3"]

if not SIMULATOR:
    from llvmlite import ir
    from numba.cuda import types
    from numba.cuda.extending import intrinsic

    def emit_cp_async16(builder, saddr, gaddr, src_bytes):
        """Emit one 16-byte ``cp.async.cg`` from global address ``gaddr`` (i64) to shared
        address ``saddr`` (i32), zero-filled past ``src_bytes`` (i32) bytes, inside an
        intrinsic's codegen."""
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i32, ir.IntType(64), i32])
        asm = ir.InlineAsm(fnty, "cp.async.cg.shared.global [$0], [$1], 16, $2;",
                           "r,l,r,~{memory}", side_effect=True)
        builder.call(asm, [saddr, gaddr, src_bytes])

    @intrinsic
    def cp_async16(typingctx, dst, di, dj, src, s0, s1, s2, s3, src_bytes):
        """16 bytes from ``&src[s0, s1, s2, s3]`` (global) to ``&dst[di, dj]`` (shared)."""
        sig = types.void(dst, di, dj, src, s0, s1, s2, s3, src_bytes)

        def codegen(context, builder, sig, args):
            d = item_pointer_i64(context, builder, sig.args[0], args[0], sig.args[1:3], args[1:3])
            g = item_pointer_i64(context, builder, sig.args[3], args[3], sig.args[4:8], args[4:8])
            n = context.cast(builder, args[8], sig.args[8], types.int32)
            fnty = ir.FunctionType(ir.VoidType(), [ir.IntType(64), ir.IntType(64), ir.IntType(32)])
            asm = ir.InlineAsm(fnty, TO_SHARED % (0, "cp.async.cg.shared.global [s], [$1], 16, $2;"),
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
            d = item_pointer_i64(context, builder, sig.args[0], args[0], sig.args[1:3], args[1:3])
            g = offset_pointer_i64(context, builder, sig.args[3], args[3], sig.args[4], args[4])
            i64 = ir.IntType(64)
            n = context.cast(builder, args[5], sig.args[5], types.int32)
            fnty = ir.FunctionType(ir.VoidType(), [i64, i64, ir.IntType(32)])
            asm = ir.InlineAsm(fnty, TO_SHARED % (0, "cp.async.cg.shared.global [s], [$1], 16, $2;"),
                               "l,l,r,~{memory}", side_effect=True)
            builder.call(asm, [d, g, n])
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def cp_async16_flat(typingctx, dst, dst_word, src, src_byte, src_bytes):
        """16 bytes from ``src``'s first element + ``src_byte`` bytes (global, any strides: the
        caller computed the offset) to element ``dst_word`` of the 1-D shared array ``dst`` (a
        32-bit shared address: a constant part of ``dst_word`` folds into the instruction's
        immediate); zero-filled when ``src_bytes`` is 0."""
        sig = types.void(dst, dst_word, src, src_byte, src_bytes)

        def codegen(context, builder, sig, args):
            d = shared_address_i32(context, builder, sig.args[0], args[0], sig.args[1:2],
                                   args[1:2])
            data = context.make_array(sig.args[2])(context, builder, args[2]).data
            g = builder.add(builder.ptrtoint(data, ir.IntType(64)),
                            context.cast(builder, args[3], sig.args[3], types.int64))
            emit_cp_async16(builder, d, g, context.cast(builder, args[4], sig.args[4], types.int32))
            return context.get_dummy_value()

        return sig, codegen

    cp_async_commit = bare_asm_intrinsic("cp.async.commit_group;")
    cp_async_wait_all = bare_asm_intrinsic("cp.async.wait_group 0;")
    cp_async_wait_1 = bare_asm_intrinsic("cp.async.wait_group 1;")
    cp_async_wait_2 = bare_asm_intrinsic("cp.async.wait_group 2;")
    cp_async_wait_3 = bare_asm_intrinsic("cp.async.wait_group 3;")

else:
    def cp_async16(dst, di, dj, src, s0, s1, s2, s3, src_bytes):
        """Copy 16 bytes ``src[s0, s1, s2, s3:]`` to ``dst[di, dj:]`` (4 words or float32, 2
        float64; zeros if src_bytes is 0)."""
        for e in range(16 // dst.dtype.itemsize):
            dst[di, dj + e] = src[s0, s1, s2, s3 + e] if src_bytes else 0

    def _words_at(src, word_offset, count):
        """``count`` elements from ``word_offset`` elements past ``src``'s first one (any
        non-negative strides); IndexError for elements outside the array's extent, as an
        out-of-bounds copy on a GPU would read memory that is not the array's."""
        a = np.asarray(getattr(src, "_ary", src))
        off = int(word_offset)
        extent = 1 + sum((n - 1) * st for n, st in zip(a.shape, a.strides)) // a.itemsize
        if a.size == 0 or off < 0 or off + count > extent:
            raise IndexError(f"a copy of elements {off}..{off + count - 1} from an array whose "
                             f"extent is {extent} elements")
        flat = np.lib.stride_tricks.as_strided(a, shape=(off + count,), strides=(a.itemsize,))
        return flat[off:off + count]

    def cp_async16_at(dst, di, dj, src, word_offset, src_bytes):
        """Copy 4 elements at ``word_offset`` elements past ``src``'s first one (any strides)."""
        words = _words_at(src, word_offset, 4)
        for e in range(4):
            dst[di, dj + e] = words[e] if src_bytes else 0

    def cp_async16_flat(dst, dst_word, src, src_byte, src_bytes):
        """Copy 16 bytes at ``src_byte`` bytes past ``src``'s first element (any strides) to
        ``dst[dst_word:]`` (a 1-D shared array; zeros if src_bytes is 0)."""
        n = 16 // dst.dtype.itemsize
        itemsize = np.asarray(getattr(src, "_ary", src)).itemsize
        words = _words_at(src, src_byte // itemsize, n)
        for e in range(n):
            dst[dst_word + e] = words[e] if src_bytes else 0

    def cp_async_commit():
        """Close the current group of asynchronous copies (a no-op in the simulator)."""

    def cp_async_wait_all():
        """Wait for every committed asynchronous copy (a no-op in the simulator)."""

    def cp_async_wait_1():
        """Wait until at most one committed copy group is pending (no-op in the simulator)."""

    def cp_async_wait_2():
        """Wait until at most two committed copy groups are pending (no-op in the simulator)."""

    def cp_async_wait_3():
        """Wait until at most three committed copy groups are pending (no-op in the simulator)."""
