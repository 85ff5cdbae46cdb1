"""``ldmatrix``: four 8x8 16-bit matrices from shared memory into mma.sync fragments.

``ldmatrix_x4(smem, i, j)``: lanes 8m..8m+7 give the 8 row addresses (``&smem[i, j]``, 16 bytes
each) of 8x8 matrix m; every lane gets register m = row ``g``, 16-bit columns ``2t, 2t+1`` of
matrix m (with ``_trans``: rows ``2t, 2t+1``, column ``g``, i.e. of the transpose). These are
exactly B fragments (mma.py): of K^T from a [key][d] tile, and of V from a [key][d] tile with
``_trans``.

``ldmatrix_x4_a32`` / ``ldmatrix_x4_trans_a32`` are the same instructions addressed in 32-bit
shared-window arithmetic from a base converted once (base.shared_address_i32): a loop of
ldmatrix over one tile costs an add per load instead of 64-bit address arithmetic and a
conversion each. The backward kernels use them; the forward kernels keep the 64-bit form until
a GPU A/B of their (changed) register allocation.
"""
from __future__ import annotations

import numpy as np

from .base import SIMULATOR, TO_SHARED, collective, item_pointer_i64, shared_address_i32

__all__ = ["ldmatrix_x4", "ldmatrix_x4_trans", "ldmatrix_x4_a32", "ldmatrix_x4_trans_a32"]

if not SIMULATOR:
    from llvmlite import ir
    from numba import cuda
    from numba.cuda import types
    from numba.cuda.extending import intrinsic

    _U32 = types.uint32

    def _ldmatrix_intrinsic(trans: bool, addr32: bool):
        op = "ldmatrix.sync.aligned.m8n8.x4%s.shared.b16 {$0,$1,$2,$3}, [%s];" % (
            ".trans" if trans else "", "$4" if addr32 else "s")

        @intrinsic
        def ldm(typingctx, ary, i, j):
            sig = types.UniTuple(_U32, 4)(ary, i, j)

            def codegen(context, builder, sig, args):
                i32 = ir.IntType(32)
                if addr32:
                    addr = shared_address_i32(context, builder, sig.args[0], args[0],
                                              sig.args[1:], args[1:], last_apart=not trans)
                    fnty = ir.FunctionType(ir.LiteralStructType([i32] * 4), [i32])
                    asm = ir.InlineAsm(fnty, op, "=r,=r,=r,=r,r,~{memory}", side_effect=True)
                else:
                    addr = item_pointer_i64(context, builder, sig.args[0], args[0],
                                            sig.args[1:], args[1:])
                    fnty = ir.FunctionType(ir.LiteralStructType([i32] * 4), [ir.IntType(64)])
                    asm = ir.InlineAsm(fnty, TO_SHARED % (4, op), "=r,=r,=r,=r,l,~{memory}",
                                       side_effect=True)
                res = builder.call(asm, [addr])
                vals = [builder.extract_value(res, n) for n in range(4)]
                return context.make_tuple(builder, sig.return_type, vals)

            return sig, codegen

        return ldm

    ldmatrix_x4 = _ldmatrix_intrinsic(False, False)
    ldmatrix_x4_trans = _ldmatrix_intrinsic(True, False)
    ldmatrix_x4_a32 = _ldmatrix_intrinsic(False, True)
    ldmatrix_x4_trans_a32 = _ldmatrix_intrinsic(True, True)

else:
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
        return collective(tuple(ary[i, j + e] for e in range(4)), _ldm_combine)

    def ldmatrix_x4_trans(ary, i, j):
        """As ``ldmatrix_x4``, each matrix delivered transposed."""
        return collective(tuple(ary[i, j + e] for e in range(4)), _ldm_trans_combine)

    ldmatrix_x4_a32 = ldmatrix_x4
    ldmatrix_x4_trans_a32 = ldmatrix_x4_trans
