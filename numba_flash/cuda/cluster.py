"""Thread-block-cluster primitives (sm_90 and later) for decode's cluster merge (decode_mma.py).

A cluster is a group of blocks that the hardware schedules together on one GPC; each block
can read the others' shared memory ("distributed shared memory") and all can meet at one
barrier. Decode launches the splits of one (batch item, kv head, row chunk) as one cluster,
so their partial states meet in shared memory instead of global memory and no arrival
counter is needed.

* ``cluster_sync()``: ``barrier.cluster.arrive.release`` then ``barrier.cluster.wait.acquire``
  (every thread of every block of the cluster; ``.aligned``: the whole warp executes it
  together). Release / acquire at cluster scope: shared-memory writes made before the barrier
  by any thread of the cluster are visible to every thread of the cluster after it.
* ``st_smem_f2(ary, i, j, a, b)`` / ``st_smem_f1(ary, i, j, a)``: float32 values into this
  block's shared ``uint32`` array at ``ary[i, j]`` (and ``ary[i, j + 1]``: an 8-byte store,
  ``j`` even).
* ``ld_dsmem_f2(ary, i, j, rank)`` / ``ld_dsmem_f1(ary, i, j, rank)``: the float32 values at
  the same place in the shared memory of block ``rank`` of the cluster (``mapa`` maps this
  block's shared address to the cluster window; ``ld.shared::cluster`` reads it).

Numba's CUDA simulator runs the blocks of a grid one after another, so it cannot meet a
cluster barrier: there these names raise, and decode never selects the cluster merge under
the simulator.
"""
from __future__ import annotations

from .warp import SIMULATOR

__all__ = ["cluster_sync", "st_smem_f2", "st_smem_f1", "ld_dsmem_f2", "ld_dsmem_f1"]

if not SIMULATOR:
    from llvmlite import ir
    from numba.cuda import types
    from numba.cuda.extending import intrinsic

    from .warp import _TO_SHARED, _bare_asm_intrinsic, _item_pointer_i64

    _F32 = types.float32

    cluster_sync = _bare_asm_intrinsic("barrier.cluster.arrive.release.aligned; "
                                       "barrier.cluster.wait.acquire.aligned;")

    @intrinsic
    def st_smem_f2(typingctx, ary, i, j, a, b):
        """``ary[i, j], ary[i, j + 1] = bits of a, b`` (shared uint32 array, 8-byte store)."""
        sig = types.void(ary, i, j, _F32, _F32)

        def codegen(context, builder, sig, args):
            addr = _item_pointer_i64(context, builder, sig.args[0], args[0], sig.args[1:3],
                                     args[1:3])
            f32 = ir.FloatType()
            fnty = ir.FunctionType(ir.VoidType(), [ir.IntType(64), f32, f32])
            asm = ir.InlineAsm(fnty, _TO_SHARED % (0, "st.shared.v2.f32 [s], {$1, $2};"),
                               "l,f,f,~{memory}", side_effect=True)
            builder.call(asm, [addr, args[3], args[4]])
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def st_smem_f1(typingctx, ary, i, j, a):
        """``ary[i, j] = bits of a`` (shared uint32 array)."""
        sig = types.void(ary, i, j, _F32)

        def codegen(context, builder, sig, args):
            addr = _item_pointer_i64(context, builder, sig.args[0], args[0], sig.args[1:3],
                                     args[1:3])
            fnty = ir.FunctionType(ir.VoidType(), [ir.IntType(64), ir.FloatType()])
            asm = ir.InlineAsm(fnty, _TO_SHARED % (0, "st.shared.f32 [s], $1;"),
                               "l,f,~{memory}", side_effect=True)
            builder.call(asm, [addr, args[3]])
            return context.get_dummy_value()

        return sig, codegen

    # mapa turns this block's shared-window address into block `rank`'s address in the
    # cluster's shared window.
    _REMOTE = ("{ .reg .u64 t; .reg .u32 s; .reg .u32 r; cvta.to.shared.u64 t, $%d; "
               "cvt.u32.u64 s, t; mapa.shared::cluster.u32 r, s, $%d; %s }")

    @intrinsic
    def ld_dsmem_f2(typingctx, ary, i, j, rank):
        """``(ary[i, j], ary[i, j + 1])`` as float32 from block ``rank``'s shared memory."""
        sig = types.UniTuple(_F32, 2)(ary, i, j, rank)

        def codegen(context, builder, sig, args):
            addr = _item_pointer_i64(context, builder, sig.args[0], args[0], sig.args[1:3],
                                     args[1:3])
            rank32 = context.cast(builder, args[3], sig.args[3], types.uint32)
            f32, i32 = ir.FloatType(), ir.IntType(32)
            fnty = ir.FunctionType(ir.LiteralStructType([f32, f32]), [ir.IntType(64), i32])
            # Memory clobber without side effect: never hoisted above the cluster barrier (an
            # asm with a memory clobber) and free to be scheduled with the other loads.
            asm = ir.InlineAsm(fnty, _REMOTE % (2, 3, "ld.shared::cluster.v2.f32 {$0, $1}, [r];"),
                               "=f,=f,l,r,~{memory}")
            res = builder.call(asm, [addr, rank32])
            vals = [builder.extract_value(res, n) for n in range(2)]
            return context.make_tuple(builder, sig.return_type, vals)

        return sig, codegen

    @intrinsic
    def ld_dsmem_f1(typingctx, ary, i, j, rank):
        """``ary[i, j]`` as float32 from block ``rank``'s shared memory."""
        sig = _F32(ary, i, j, rank)

        def codegen(context, builder, sig, args):
            addr = _item_pointer_i64(context, builder, sig.args[0], args[0], sig.args[1:3],
                                     args[1:3])
            rank32 = context.cast(builder, args[3], sig.args[3], types.uint32)
            fnty = ir.FunctionType(ir.FloatType(), [ir.IntType(64), ir.IntType(32)])
            asm = ir.InlineAsm(fnty, _REMOTE % (1, 2, "ld.shared::cluster.f32 $0, [r];"),
                               "=f,l,r,~{memory}")
            return builder.call(asm, [addr, rank32])

        return sig, codegen

else:
    def _no_cluster(*args):
        raise NotImplementedError("thread-block clusters need a GPU of compute capability 9.0 "
                                  "or later; Numba's simulator runs blocks one at a time")

    cluster_sync = st_smem_f2 = st_smem_f1 = ld_dsmem_f2 = ld_dsmem_f1 = _no_cluster
