"""Shared-memory helpers.

* ``lds16(ary, i, j, skip)`` returns the 16 bytes at ``&ary[i, j]`` plus ``skip`` bytes of a
  shared float32 / float64 array as a tuple (4 float32 or 2 float64), one
  ``ld.shared.v4.f32`` / ``.v2.f64`` (LLVM does not vectorise these on its own).
* ``shared_view(dyn, offset, rows, cols)``: a (rows, cols) C-contiguous view of a 1-D (dynamic)
  shared array from element ``offset``: how a kernel carves its dynamic shared memory (more
  than the 48 KB a block may hold statically) into 2-D tiles. Numba's ``reshape`` would call a
  runtime helper through local memory; this only builds the array header.
"""
from __future__ import annotations

from .base import SIMULATOR

__all__ = ["lds16", "shared_view"]

if SIMULATOR:
    def lds16(ary, i, j, skip):
        """The 16 bytes at ``&ary[i, j]`` plus ``skip`` bytes of a shared float32 / float64
        array, as a tuple."""
        item = ary.dtype.itemsize
        return tuple(ary[i, j + skip // item + e] for e in range(16 // item))

    def shared_view(dyn, offset, rows, cols):
        """The (rows, cols) view of ``dyn[offset:offset + rows * cols]``."""
        return dyn[offset:offset + rows * cols].reshape(rows, cols)
else:
    from llvmlite import ir
    from numba.cuda import types
    from numba.cuda.extending import intrinsic

    from .base import shared_address_i32

    @intrinsic
    def lds16(typingctx, ary, i, j, skip):
        """One 16-byte shared-memory load (``ld.shared.v4.f32`` / ``.v2.f64``) at ``&ary[i, j]``
        plus ``skip`` bytes (16-byte aligned; a constant ``skip`` becomes the instruction's
        immediate offset): LLVM does not vectorise these loads on its own. Side-effecting, so
        it is never moved across a barrier or merged with a load of an earlier tile."""
        f64 = ary.dtype == types.float64
        n = 2 if f64 else 4
        sig = types.UniTuple(ary.dtype, n)(ary, i, j, skip)

        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            addr = shared_address_i32(context, builder, sig.args[0], args[0], sig.args[1:3],
                                      args[1:3])
            extra = context.cast(builder, args[3], sig.args[3], types.int32)
            addr = builder.add(addr, extra)
            ft = ir.DoubleType() if f64 else ir.FloatType()
            fnty = ir.FunctionType(ir.LiteralStructType([ft] * n), [i32])
            outs = ",".join(f"${e}" for e in range(n))
            op = f"ld.shared.v{n}.{'f64' if f64 else 'f32'} {{{outs}}}, [${n}];"
            cons = ",".join(["=d" if f64 else "=f"] * n) + ",r,~{memory}"
            res = builder.call(ir.InlineAsm(fnty, op, cons, side_effect=True), [addr])
            vals = [builder.extract_value(res, e) for e in range(n)]
            return context.make_tuple(builder, sig.return_type, vals)

        return sig, codegen

    @intrinsic
    def shared_view(typingctx, dyn, offset, rows, cols):
        """The (rows, cols) C-contiguous view of ``dyn[offset:offset + rows * cols]`` (``dyn``
        a 1-D shared array; no bounds check: the caller sizes the dynamic shared memory)."""
        sig = types.Array(dyn.dtype, 2, "C")(dyn, offset, rows, cols)

        def codegen(context, builder, sig, args):
            from numba.np.arrayobj import make_array, populate_array

            src = make_array(sig.args[0])(context, builder, args[0])
            off, nrows, ncols = (context.cast(builder, v, t, types.intp)
                                 for v, t in zip(args[1:], sig.args[1:]))
            item = context.get_constant(types.intp, context.get_abi_sizeof(
                context.get_data_type(sig.args[0].dtype)))
            view = make_array(sig.return_type)(context, builder)
            populate_array(view, data=builder.gep(src.data, [off]),
                           shape=[nrows, ncols], strides=[builder.mul(ncols, item), item],
                           itemsize=item, meminfo=None)
            return view._getvalue()

        return sig, codegen
