"""Vector reductions into global memory.

* ``red_add2(ary, offset, a, b)``: the float32 elements ``offset`` and ``offset + 1`` past
  ``ary``'s first (the caller computes the offset from the strides; even, the array 8-byte
  aligned, the two elements adjacent) get ``+= a`` and ``+= b`` by one
  ``red.relaxed.gpu.global.add.v2.f32`` (sm_90): half the atomic instructions of two scalar
  adds, and no per-element index arithmetic. Relaxed at GPU scope, like ``cuda.atomic.add``; the values
  are read only after the kernel ends.
"""
from __future__ import annotations

from .base import SIMULATOR

__all__ = ["red_add2"]

if SIMULATOR:
    from numba import cuda

    @cuda.jit(device=True)      # the simulator gives device functions its atomics
    def red_add2(ary, offset, a, b):
        """Elements ``offset``, ``offset + 1`` of ``ary`` (flat, C order) ``+= (a, b)``
        atomically (two adds in the simulator)."""
        flat = ary.reshape(-1)
        cuda.atomic.add(flat, offset, a)
        cuda.atomic.add(flat, offset + 1, b)
else:
    from llvmlite import ir
    from numba.cuda import types
    from numba.cuda.extending import intrinsic

    from .base import offset_pointer_i64

    @intrinsic
    def red_add2(typingctx, ary, offset, a, b):
        """One ``red.relaxed.gpu.global.add.v2.f32`` of (a, b) at element ``offset``."""
        sig = types.void(ary, offset, types.float32, types.float32)

        def codegen(context, builder, sig, args):
            addr = offset_pointer_i64(context, builder, sig.args[0], args[0], sig.args[1],
                                      args[1])
            vals = [context.cast(builder, v, t, types.float32)
                    for v, t in zip(args[2:], sig.args[2:])]
            fnty = ir.FunctionType(ir.VoidType(), [ir.IntType(64), ir.FloatType(), ir.FloatType()])
            asm = ir.InlineAsm(fnty, "red.relaxed.gpu.global.add.v2.f32 [$0], {$1, $2};",
                               "l,f,f,~{memory}", side_effect=True)
            builder.call(asm, [addr] + vals)
            return context.get_dummy_value()

        return sig, codegen
