"""Read-only 16-byte global loads and 16-bit unpacking for the CUDA-core decode kernel.

* ``ld_v4(ary, i0, i1, i2, i3)``: four uint32 words ``ary[i0, i1, i2, i3:i3+4]`` in one
  ``ld.global.nc.v4.u32``.
* ``unpack_f16(word)`` / ``unpack_bf16(word)``: a word of two 16-bit values -> (low, high) as
  float32 (the lower-indexed element sits in the low half, as in mma.py).
"""
from __future__ import annotations

import numpy as np

from .base import SIMULATOR, inlined, item_pointer_i64

__all__ = ["ld_v4", "unpack_f16", "unpack_bf16", "unpack16"]

if not SIMULATOR:
    from llvmlite import ir
    from numba.cuda import types
    from numba.cuda.extending import intrinsic

    _U32 = types.uint32
    _F32 = types.float32

    @intrinsic
    def ld_v4(typingctx, ary, i0, i1, i2, i3):
        """Four uint32 words ``ary[i0, i1, i2, i3:i3+4]`` in one 16-byte read-only global load."""
        sig = types.UniTuple(_U32, 4)(ary, i0, i1, i2, i3)

        def codegen(context, builder, sig, args):
            addr = item_pointer_i64(context, builder, sig.args[0], args[0], sig.args[1:], args[1:])
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

    # A word holds the lower-indexed element in its low half (as in mma.py).
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


if not SIMULATOR:

    @inlined
    def unpack16(is_bf16, word):
        """(low, high) float32 of a word of two bfloat16 (``is_bf16``, a compile-time constant
        at the call site) or float16 values."""
        if is_bf16:
            return unpack_bf16(word)
        return unpack_f16(word)
else:
    def unpack16(is_bf16, word):
        """(low, high) float32 of a word of two bfloat16 (``is_bf16``) or float16 values."""
        return unpack_bf16(word) if is_bf16 else unpack_f16(word)
