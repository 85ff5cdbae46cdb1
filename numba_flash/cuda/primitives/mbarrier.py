"""Hopper (sm_90) mbarriers: 8-byte barrier objects in shared memory that count arrivals per
phase, so that some warps of a block can wait for others without a block-wide barrier (the
warp-specialised forward: producer warps copy K / V tiles, consumer warpgroups compute).

A barrier initialised with count n completes a phase when n arrivals have been made; waiting
threads test the parity of the phase they wait for: phase k (0, 1, 2, ...) has parity k & 1,
and ``mbar_try_wait(addr, p)`` is true once the phase of parity p that precedes the current one
has completed (so parity 1 passes at once on a fresh barrier). Arrivals release and waits
acquire at CTA scope (the PTX defaults), which orders the arriving threads' earlier writes
before the waiting threads' later reads. Addresses are 32-bit shared-window addresses
(``shared_addr``). Also the named barriers (``bar.sync`` / ``bar.arrive`` with an id and a
thread count) that order two warpgroups' turns. Not in Numba's simulator.
"""
from __future__ import annotations

from .base import SIMULATOR

__all__ = ["mbar_init", "mbar_arrive", "mbar_try_wait", "fence_mbar_init", "named_sync",
           "named_arrive", "regs_dec_72", "regs_inc_216"]

if not SIMULATOR:
    from llvmlite import ir
    from numba.cuda import types
    from numba.cuda.extending import intrinsic

    from .base import bare_asm_intrinsic, u32_asm_intrinsic

    _I32 = ir.IntType(32)

    # Initialise the mbarrier at shared address $0 for $1 arrivals per phase.
    mbar_init = u32_asm_intrinsic("mbarrier.init.shared::cta.b64 [$0], $1;", 2)
    # One arrival on the mbarrier at $0 (release: this thread's earlier writes are visible to
    # the threads that then see the phase complete).
    mbar_arrive = u32_asm_intrinsic("mbarrier.arrive.shared::cta.b64 _, [$0];", 1)

    @intrinsic
    def mbar_try_wait(typingctx, addr, parity):
        """Whether the phase of parity ``parity`` (0 / 1) of the mbarrier at ``addr`` has
        completed (the hardware may suspend the thread a while before answering false); call
        it in a loop."""
        sig = types.boolean(addr, parity)

        def codegen(context, builder, sig, args):
            a = context.cast(builder, args[0], sig.args[0], types.uint32)
            p = context.cast(builder, args[1], sig.args[1], types.uint32)
            fnty = ir.FunctionType(_I32, [_I32, _I32])
            text = ("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [$1], $2; "
                    "selp.u32 $0, 1, 0, p; }")
            r = builder.call(ir.InlineAsm(fnty, text, "=r,r,r,~{memory}", side_effect=True),
                             [a, p])
            return builder.icmp_unsigned("!=", r, ir.Constant(_I32, 0))
        return sig, codegen

    fence_mbar_init = bare_asm_intrinsic("fence.mbarrier_init.release.cluster;")

    # Named barriers (ids 1-15; 0 is __syncthreads) over ``count`` threads (a multiple of 32):
    # ``named_sync`` arrives and waits until ``count`` threads have arrived, ``named_arrive``
    # arrives without waiting (a producer's half of the barrier).
    named_sync = u32_asm_intrinsic("bar.sync $0, $1;", 2)
    named_arrive = u32_asm_intrinsic("bar.arrive $0, $1;", 2)
    # Register reallocation between warpgroups (the whole warpgroup executes it): a producer
    # warpgroup gives registers back, two consumer warpgroups take them (counts multiples of
    # 8; 128 x 72 + 256 x 216 = 64,512 = 384 x 168, the registers at launch). ptxas then
    # allocates the code after each up to its count.
    regs_dec_72 = bare_asm_intrinsic("setmaxnreg.dec.sync.aligned.u32 72;")
    regs_inc_216 = bare_asm_intrinsic("setmaxnreg.inc.sync.aligned.u32 216;")
else:
    def _unavailable(*args):
        raise NotImplementedError("mbarriers need a compute-capability 9.0 GPU (not the simulator)")

    mbar_init = mbar_arrive = mbar_try_wait = fence_mbar_init = _unavailable
    named_sync = named_arrive = regs_dec_72 = regs_inc_216 = _unavailable
