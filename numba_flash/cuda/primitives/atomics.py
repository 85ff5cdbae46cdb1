"""Vector reductions into global memory.

* ``red_add2(ary, i0, i1, i2, i3, a, b)``: ``ary[i0, i1, i2, i3] += a`` and the next element
  ``+= b`` (float32, 4-D, last axis contiguous, the index of the last axis even, the array
  8-byte aligned) by one ``red.relaxed.gpu.global.add.v2.f32`` (sm_90): half the atomic
  instructions of two scalar adds. Relaxed at GPU scope, like ``cuda.atomic.add``; the values
  are read only after the kernel ends.
"""
from __future__ import annotations

from .base import SIMULATOR

__all__ = ["red_add2"]

if SIMULATOR:
    from numba import cuda

    @cuda.jit(device=True)      # the simulator gives device functions its atomics
    def red_add2(ary, i0, i1, i2, i3, a, b):
        """``ary[i0, i1, i2, i3:i3 + 2] += (a, b)`` atomically (two adds in the simulator)."""
        cuda.atomic.add(ary, (i0, i1, i2, i3), a)
        cuda.atomic.add(ary, (i0, i1, i2, i3 + 1), b)
else:
    from llvmlite import ir
    from numba.cuda import types
    from numba.cuda.extending import intrinsic

    from .base import item_pointer_i64

    @intrinsic
    def red_add2(typingctx, ary, i0, i1, i2, i3, a, b):
        """One ``red.relaxed.gpu.global.add.v2.f32`` of (a, b) at ``&ary[i0, i1, i2, i3]``."""
        sig = types.void(ary, i0, i1, i2, i3, types.float32, types.float32)

        def codegen(context, builder, sig, args):
            addr = item_pointer_i64(context, builder, sig.args[0], args[0], sig.args[1:5],
                                    args[1:5])
            vals = [context.cast(builder, v, t, types.float32)
                    for v, t in zip(args[5:], sig.args[5:])]
            fnty = ir.FunctionType(ir.VoidType(), [ir.IntType(64), ir.FloatType(), ir.FloatType()])
            asm = ir.InlineAsm(fnty, "red.relaxed.gpu.global.add.v2.f32 [$0], {$1, $2};",
                               "l,f,f,~{memory}", side_effect=True)
            builder.call(asm, [addr] + vals)
            return context.get_dummy_value()

        return sig, codegen
