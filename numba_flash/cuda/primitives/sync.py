"""Memory-ordering and paired global accesses for the folded merge of split-KV decode (its tail in
kernels/decode_mma.py), with pure-Python stand-ins for the simulator (base.py).

* ``arrive_acq_rel(counters, i)``: ``atom.acq_rel.gpu.global.add.u32`` of 1 on ``counters[i]``
  (int32), returning the old value. One lane of a warp calls it after ``__syncwarp()``; the
  memory-model argument is in decode_mma.py, at its use.
* ``bcast0(x)``: lane 0's int32 ``x`` to every lane of the (fully active) warp.
* ``st2(ary, i0, i1, i2, i3, i4, a, b)``: float32 ``a``, ``b`` to ``ary[i0, i1, i2, i3, i4]`` and
  the next element, one 8-byte ``st.global.v2.f32`` (the index of the last axis even, the last
  axis contiguous, the array 8-byte aligned: decode's own fp32 partial states).
* ``ld2(ary, i0, i1, i2, i3, i4)``: the matching 8-byte load (``ld.global.v2.f32``, an ordinary
  weak load: the caller orders it after an acquire).
"""
from __future__ import annotations

import numpy as np

from .base import SIMULATOR, inlined

__all__ = ["arrive_acq_rel", "bcast0", "st2", "ld2"]

if not SIMULATOR:
    from llvmlite import ir
    from numba import cuda
    from numba.cuda import types
    from numba.cuda.extending import intrinsic

    from .base import item_pointer_i64

    _F32 = types.float32

    @intrinsic
    def arrive_acq_rel(typingctx, ary, idx):
        """Old value of ``ary[idx]`` (int32, 1-D), which gets + 1 by an acquire-release atomic at
        GPU scope."""
        sig = types.int32(ary, idx)

        def codegen(context, builder, sig, args):
            addr = item_pointer_i64(context, builder, sig.args[0], args[0], sig.args[1:2],
                                     args[1:2])
            i32 = ir.IntType(32)
            fnty = ir.FunctionType(i32, [ir.IntType(64)])
            asm = ir.InlineAsm(
                fnty, "{ .reg .u64 t; cvta.to.global.u64 t, $1; "
                      "atom.acq_rel.gpu.global.add.u32 $0, [t], 1; }",
                "=r,l,~{memory}", side_effect=True)
            return builder.call(asm, [addr])

        return sig, codegen

    @inlined
    def bcast0(x):
        """Lane 0's ``x`` on every lane of the fully active warp."""
        return cuda.shfl_sync(0xFFFFFFFF, x, 0)

    @intrinsic
    def st2(typingctx, ary, i0, i1, i2, i3, i4, a, b):
        """``ary[i0, i1, i2, i3, i4:i4+2] = a, b`` as one 8-byte global store."""
        sig = types.void(ary, i0, i1, i2, i3, i4, _F32, _F32)

        def codegen(context, builder, sig, args):
            addr = item_pointer_i64(context, builder, sig.args[0], args[0], sig.args[1:6],
                                     args[1:6])
            f32 = ir.FloatType()
            fnty = ir.FunctionType(ir.VoidType(), [ir.IntType(64), f32, f32])
            asm = ir.InlineAsm(
                fnty, "{ .reg .u64 t; cvta.to.global.u64 t, $0; "
                      "st.global.v2.f32 [t], {$1, $2}; }",
                "l,f,f,~{memory}", side_effect=True)
            builder.call(asm, [addr, args[6], args[7]])
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def ld2(typingctx, ary, i0, i1, i2, i3, i4):
        """``(ary[i0, i1, i2, i3, i4], ary[..., i4 + 1])`` as one 8-byte global load."""
        sig = types.UniTuple(_F32, 2)(ary, i0, i1, i2, i3, i4)

        def codegen(context, builder, sig, args):
            addr = item_pointer_i64(context, builder, sig.args[0], args[0], sig.args[1:6],
                                     args[1:6])
            f32 = ir.FloatType()
            fnty = ir.FunctionType(ir.LiteralStructType([f32, f32]), [ir.IntType(64)])
            # A memory clobber, no side effect: never moved across the acquire (an asm with a
            # memory clobber) nor speculated above the branch that guards it.
            asm = ir.InlineAsm(
                fnty, "{ .reg .u64 t; cvta.to.global.u64 t, $2; "
                      "ld.global.v2.f32 {$0, $1}, [t]; }",
                "=f,=f,l,~{memory}")
            res = builder.call(asm, [addr])
            vals = [builder.extract_value(res, n) for n in range(2)]
            return context.make_tuple(builder, sig.return_type, vals)

        return sig, codegen

else:
    import threading

    from .base import collective

    _ATOMIC = threading.Lock()

    def arrive_acq_rel(ary, idx):
        """Old value of ``ary[idx]``, incremented under a lock (simulated threads share the
        process's memory: the lock is the atomic and the full fence at once)."""
        with _ATOMIC:
            old = ary[idx]
            ary[idx] = old + 1
        return np.int32(old)

    def _from_lane0(slots):
        return [slots[0]] * 32

    def bcast0(x):
        """Lane 0's ``x`` on every lane of the warp."""
        return collective(x, _from_lane0)

    def st2(ary, i0, i1, i2, i3, i4, a, b):
        """``ary[i0, i1, i2, i3, i4:i4+2] = a, b``."""
        ary[i0, i1, i2, i3, i4] = a
        ary[i0, i1, i2, i3, i4 + 1] = b

    def ld2(ary, i0, i1, i2, i3, i4):
        """``(ary[i0, i1, i2, i3, i4], ary[i0, i1, i2, i3, i4 + 1])``."""
        return np.float32(ary[i0, i1, i2, i3, i4]), np.float32(ary[i0, i1, i2, i3, i4 + 1])
