"""L2 cache hints for streaming copies (the decode kernel's fast copies), with no-op stand-ins for
Numba's CUDA simulator (which runs no inline PTX; see base.py).

* ``evict_first_policy()``: a 64-bit L2 cache policy (``createpolicy.fractional
  .L2::evict_first.b64``, fraction 1.0): lines filled under it are the first to be evicted.
  Decode reads every K/V byte of a chunk once, so marking that stream evict-first keeps the
  small, reused data (block tables, sequence lengths, queries, partial states, arrival
  counters) in L2 from one call to the next instead of behind 100+ MB of dead K/V lines.
* ``cp_async16_hint(dst, di, dj, src, word_offset, src_bytes, policy)``: ``cp_async16_at``
  (cp_async.py) with the policy attached (``cp.async.cg.shared.global.L2::cache_hint``).
"""
from __future__ import annotations

from .base import SIMULATOR, inlined

__all__ = ["evict_first_policy", "cp_async16_hint", "cp_async16_maybe_hint"]

if not SIMULATOR:
    from llvmlite import ir
    from numba.cuda import types
    from numba.cuda.extending import intrinsic

    from .base import TO_SHARED, item_pointer_i64, offset_pointer_i64

    @intrinsic
    def evict_first_policy(typingctx):
        """An L2 cache policy (uint64) marking every line it fills evict-first."""
        sig = types.uint64()

        def codegen(context, builder, sig, args):
            fnty = ir.FunctionType(ir.IntType(64), [])
            asm = ir.InlineAsm(fnty, "createpolicy.fractional.L2::evict_first.b64 $0, 1.0;",
                               "=l", side_effect=False)
            return builder.call(asm, [])

        return sig, codegen

    @intrinsic
    def cp_async16_hint(typingctx, dst, di, dj, src, word_offset, src_bytes, policy):
        """16 bytes from ``src``'s first element + ``word_offset`` elements (global) to
        ``&dst[di, dj]`` (shared), filled into L2 under ``policy``."""
        sig = types.void(dst, di, dj, src, word_offset, src_bytes, policy)

        def codegen(context, builder, sig, args):
            d = item_pointer_i64(context, builder, sig.args[0], args[0], sig.args[1:3],
                                  args[1:3])
            g = offset_pointer_i64(context, builder, sig.args[3], args[3], sig.args[4],
                                    args[4])
            n = context.cast(builder, args[5], sig.args[5], types.int32)
            pol = context.cast(builder, args[6], sig.args[6], types.uint64)
            i64 = ir.IntType(64)
            fnty = ir.FunctionType(ir.VoidType(), [i64, i64, ir.IntType(32), i64])
            text = TO_SHARED % (
                0, "cp.async.cg.shared.global.L2::cache_hint [s], [$1], 16, $2, $3;")
            asm = ir.InlineAsm(fnty, text, "l,l,r,l,~{memory}", side_effect=True)
            builder.call(asm, [d, g, n, pol])
            return context.get_dummy_value()

        return sig, codegen

else:
    import numpy as np

    from .cp_async import cp_async16_at

    def evict_first_policy():
        """A placeholder policy: the simulator has no L2."""
        return np.uint64(0)

    def cp_async16_hint(dst, di, dj, src, word_offset, src_bytes, policy):
        """``cp_async16_at`` (the policy has no meaning in the simulator)."""
        cp_async16_at(dst, di, dj, src, word_offset, src_bytes)


if not SIMULATOR:

    from .cp_async import cp_async16_at

    @inlined
    def cp_async16_maybe_hint(hint, dst, di, dj, src, word_offset, src_bytes, policy):
        """``cp_async16_hint`` when ``hint`` (a compile-time constant at the call site), else
        ``cp_async16_at`` (``policy`` unused)."""
        if hint:
            cp_async16_hint(dst, di, dj, src, word_offset, src_bytes, policy)
        else:
            cp_async16_at(dst, di, dj, src, word_offset, src_bytes)
else:
    def cp_async16_maybe_hint(hint, dst, di, dj, src, word_offset, src_bytes, policy):
        """``cp_async16_hint`` when ``hint``, else ``cp_async16_at`` (the same copy here)."""
        from .cp_async import cp_async16_at

        cp_async16_at(dst, di, dj, src, word_offset, src_bytes)
