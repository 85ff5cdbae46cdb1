"""Hopper (sm_90) bulk reductions: the copy engine adds a run of float32 from shared memory into
global memory (``cp.reduce.async.bulk ... .add.f32``), asynchronously, in whole L2 lines.

Why: the backward adds each dK / dV block's dQ tile into a float32 accumulator that every key
block of the head shares. Per-thread ``red.global.add`` sends one 8-byte pair per lane, and on
the H200 those reductions took ~40 % of the dK / dV kernel's time (docs/backward.md); a block
that stages its tile in shared memory and hands each row to the copy engine sends the same
bytes as 256- / 512-byte runs.

Ordering: generic-proxy writes of the staged tile need ``fence.proxy.async`` (wgmma.py's
``fence_proxy_async``) and a barrier before the issuing thread starts a reduction; the shared
bytes may be overwritten once that thread's ``bulk_wait_read`` returns (its groups have read
their source), and ``bulk_wait`` (every group complete) before the block exits. Groups are per
thread. Not in Numba's simulator.
"""
from __future__ import annotations

from .base import SIMULATOR

__all__ = ["bulk_add_f32", "bulk_commit", "bulk_wait_read", "bulk_wait", "sts_f32x2"]

if not SIMULATOR:
    from llvmlite import ir
    from numba.cuda import types
    from numba.cuda.extending import intrinsic

    from .base import bare_asm_intrinsic

    _I32, _I64, _F32 = ir.IntType(32), ir.IntType(64), ir.FloatType()

    @intrinsic
    def bulk_add_f32(typingctx, gaddr, saddr, nbytes):
        """Add ``nbytes`` (a multiple of 16) of float32 at shared address ``saddr`` (uint32,
        16-byte aligned) into global memory at ``gaddr`` (int64, 16-byte aligned), in this
        thread's current bulk group."""
        sig = types.void(gaddr, saddr, nbytes)

        def codegen(context, builder, sig, args):
            g = context.cast(builder, args[0], sig.args[0], types.int64)
            s = context.cast(builder, args[1], sig.args[1], types.uint32)
            n = context.cast(builder, args[2], sig.args[2], types.uint32)
            fnty = ir.FunctionType(ir.VoidType(), [_I64, _I32, _I32])
            text = "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$0], [$1], $2;"
            builder.call(ir.InlineAsm(fnty, text, "l,r,r,~{memory}", side_effect=True),
                         [g, s, n])
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def sts_f32x2(typingctx, saddr, x0, x1):
        """Store two float32 at shared address ``saddr`` (uint32, 8-byte aligned)."""
        sig = types.void(saddr, types.float32, types.float32)

        def codegen(context, builder, sig, args):
            s = context.cast(builder, args[0], sig.args[0], types.uint32)
            fnty = ir.FunctionType(ir.VoidType(), [_I32, _F32, _F32])
            builder.call(ir.InlineAsm(fnty, "st.shared.v2.f32 [$0], {$1, $2};",
                                      "r,f,f,~{memory}", side_effect=True), [s, args[1], args[2]])
            return context.get_dummy_value()

        return sig, codegen

    bulk_commit = bare_asm_intrinsic("cp.async.bulk.commit_group;")
    bulk_wait_read = bare_asm_intrinsic("cp.async.bulk.wait_group.read 0;")
    bulk_wait = bare_asm_intrinsic("cp.async.bulk.wait_group 0;")
else:
    def _unavailable(*args):
        raise NotImplementedError("bulk reductions need a compute-capability 9.0 GPU (not the "
                                  "simulator)")

    bulk_add_f32 = bulk_commit = bulk_wait_read = bulk_wait = sts_f32x2 = _unavailable
