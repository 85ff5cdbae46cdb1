"""Fast math on the special-function unit: ``exp2`` (``ex2.approx.ftz.f32``; exp2(-inf) = 0)."""
from __future__ import annotations

import numpy as np

from .base import SIMULATOR

__all__ = ["exp2"]

if not SIMULATOR:
    from llvmlite import ir
    from numba import cuda
    from numba.cuda import types
    from numba.cuda.extending import intrinsic

    _F32 = types.float32

    @intrinsic
    def exp2(typingctx, x):
        """2**x in float32 through the special-function unit (ex2.approx; exp2(-inf) = 0)."""
        sig = _F32(_F32)

        def codegen(context, builder, sig, args):
            fnty = ir.FunctionType(ir.FloatType(), [ir.FloatType()])
            asm = ir.InlineAsm(fnty, "ex2.approx.ftz.f32 $0, $1;", "=f,f")
            return builder.call(asm, args)

        return sig, codegen

else:
    def exp2(x):
        """2**x in float32 (exp2(-inf) = 0)."""
        return np.float32(np.exp2(np.float32(x)))
