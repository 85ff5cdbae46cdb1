"""What every primitive module shares: whether Numba's CUDA simulator is on, the LLVM helpers
that inline-PTX intrinsics use to address array elements, and (in the simulator) the per-warp
exchange that stands in for warp-collective instructions.

Under ``NUMBA_ENABLE_CUDASIM=1`` the simulator has neither inline PTX nor warp shuffles, so each
primitive module defines its names twice: an ``@intrinsic`` (or a Numba built-in) on the GPU, a
plain Python function in the simulator. Collective stand-ins call ``collective``: each simulated
lane posts its operand to a per-warp exchange (the last of the 32 combines them), and every lane
computes its own share of the combined result. Kernel source is therefore identical on both.
"""
from __future__ import annotations

import threading

from numba import cuda
from numba.cuda import config

SIMULATOR = bool(config.ENABLE_CUDASIM)

__all__ = ["SIMULATOR", "inlined", "item_pointer_i64", "offset_pointer_i64", "shared_address_i32",
           "TO_SHARED", "bare_asm_intrinsic", "u32_asm_intrinsic", "collective"]


def inlined(func):
    """``func`` as a device function that NVVM inlines into every caller (LLVM's
    ``alwaysinline``), so the kernel keeps its tiles in registers. Not Numba's IR-level
    ``inline="always"``, which types the callee again at every call site: on the backward's
    wgmma kernel that took ~100 s of a ~108 s compile, this way ~8 s, with the same machine
    code. Keep ``inline="always"`` only where a constant argument must prune a branch before
    typing (the branches give different types)."""
    if SIMULATOR:           # the simulator's jit has no forceinline
        return cuda.jit(device=True)(func)
    return cuda.jit(device=True, forceinline=True)(func)


if not SIMULATOR:
    from llvmlite import ir
    from numba.cuda import cgutils, types
    from numba.cuda.extending import intrinsic

    def item_pointer_i64(context, builder, aryty, aryval, idx_types, idx_vals):
        """Address (i64) of ``ary[idx...]`` for a Numba array value inside an intrinsic."""
        ary = context.make_array(aryty)(context, builder, aryval)
        inds = [context.cast(builder, v, t, types.intp) for v, t in zip(idx_vals, idx_types)]
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, inds)
        return builder.ptrtoint(ptr, ir.IntType(64))

    def offset_pointer_i64(context, builder, aryty, aryval, offty, offval):
        """Address (i64) of ``ary``'s first element + ``off`` elements (any strides: the
        caller computed the offset)."""
        ary = context.make_array(aryty)(context, builder, aryval)
        off = context.cast(builder, offval, offty, types.int64)
        size = context.get_constant(types.int64, aryty.dtype.bitwidth // 8)
        return builder.add(builder.ptrtoint(ary.data, ir.IntType(64)), builder.mul(off, size))

    def shared_address_i32(context, builder, aryty, aryval, idx_types, idx_vals,
                           last_apart=False):
        """32-bit shared-window address of ``ary[idx...]`` (a shared array): the array's base
        converted once (a pure asm that LLVM hoists and shares between accesses) plus the
        element's byte offset in 32-bit arithmetic, so a constant offset folds into the
        instruction's immediate. ``last_apart``: the last index (a contiguous axis) is added
        as index x itemsize after the others' offset, so that a compile-time part of it
        (a k-step's column) lands in the immediate even when the rows vary at run time."""
        i64, i32 = ir.IntType(64), ir.IntType(32)
        data = builder.ptrtoint(context.make_array(aryty)(context, builder, aryval).data, i64)
        last = None
        if last_apart:
            last = context.cast(builder, idx_vals[-1], idx_types[-1], types.int32)
            idx_vals = list(idx_vals[:-1]) + [context.get_constant(idx_types[-1], 0)]
        elem = item_pointer_i64(context, builder, aryty, aryval, idx_types, idx_vals)
        off = builder.trunc(builder.sub(elem, data), i32)
        if last_apart:
            size = ir.Constant(i32, aryty.dtype.bitwidth // 8)
            off = builder.add(off, builder.mul(last, size))
        base = builder.call(ir.InlineAsm(ir.FunctionType(i32, [i64]),
                                         "{ .reg .u64 t; cvta.to.shared.u64 t, $1; "
                                         "cvt.u32.u64 $0, t; }", "=r,l"), [data])
        return builder.add(base, off)

    # Shared arrays reach an intrinsic as generic pointers: cvta.to.shared makes the 32-bit
    # shared-window address that ldmatrix and cp.async take.
    TO_SHARED = "{ .reg .u64 t; .reg .u32 s; cvta.to.shared.u64 t, $%d; cvt.u32.u64 s, t; %s }"

    def bare_asm_intrinsic(text):
        @intrinsic
        def op(typingctx):
            sig = types.void()

            def codegen(context, builder, sig, args):
                fnty = ir.FunctionType(ir.VoidType(), [])
                builder.call(ir.InlineAsm(fnty, text, "~{memory}", side_effect=True), [])
                return context.get_dummy_value()

            return sig, codegen

        return op

    def u32_asm_intrinsic(text, n_operands):
        """An intrinsic taking one or two integers, passed as 32-bit registers $0, $1 to the
        inline PTX ``text`` (no result; a memory clobber keeps it in program order)."""
        if n_operands not in (1, 2):
            raise ValueError(f"n_operands must be 1 or 2, got {n_operands}")
        i32 = ir.IntType(32)

        def codegen(context, builder, sig, args):
            vals = [context.cast(builder, a, t, types.uint32) for a, t in zip(args, sig.args)]
            fnty = ir.FunctionType(ir.VoidType(), [i32] * len(vals))
            constraint = ",".join(["r"] * len(vals) + ["~{memory}"])
            builder.call(ir.InlineAsm(fnty, text, constraint, side_effect=True), vals)
            return context.get_dummy_value()

        if n_operands == 1:
            @intrinsic
            def op1(typingctx, a):
                return types.void(a), codegen
            return op1

        @intrinsic
        def op2(typingctx, a, b):
            return types.void(a, b), codegen
        return op2

    collective = None

else:
    item_pointer_i64 = offset_pointer_i64 = shared_address_i32 = bare_asm_intrinsic = None
    u32_asm_intrinsic = None
    TO_SHARED = None
    _exchange_lock = threading.Lock()

    class _WarpExchange:
        """Per-warp meeting point: 32 slots in, one combined result per lane out. The last
        lane to post combines; the others wait for the next generation, checking the
        simulator's abort flag (set when another thread of the block raised) so that a failing
        kernel ends at once instead of leaving its lanes waiting."""

        def __init__(self):
            self.slots = [None] * 32
            self.results = None
            self.posted = 0
            self.generation = 0
            self.cond = threading.Condition()

        def meet(self, lane, value, combine):
            thread = threading.current_thread()
            with self.cond:
                generation = self.generation
                self.slots[lane] = value
                self.posted += 1
                if self.posted == 32:
                    self.results = combine(self.slots)
                    self.posted = 0
                    self.generation += 1
                    self.cond.notify_all()
                while self.generation == generation:
                    self.cond.wait(0.05)
                    if getattr(thread, "abort", False):
                        raise RuntimeError("a simulated thread of this block raised")
                # The next generation's combine needs this lane's next post, so the results
                # read here cannot be replaced before this lane has read them.
                return self.results[lane]

    def _install_thread_safe_shared_array():
        """Numba's simulator gives every thread of a block the array that the block's first
        ``cuda.shared.array`` call at a source line created, but checks and fills its table
        without a lock: two threads arriving together can each make an array, and the thread
        whose array lost then computes alone on a private copy (seen as a rare wrong result
        under load; tests/test_simulator.py provokes it). This version holds a lock around the
        check and the fill; it keys allocations by the caller's (file, line) as Numba does."""
        import sys

        import numpy as np
        from numba.cuda import types
        from numba.cuda.np import numpy_support
        from numba.cuda.simulator import kernelapi

        cls = kernelapi.FakeCUDAShared
        if getattr(cls.array, "thread_safe", False):
            return
        unsafe_array = cls.array
        lock = threading.Lock()

        def array(self, shape, dtype, alignment=None):
            if alignment is not None or shape == 0:    # Numba's error / dynamic shared memory
                return unsafe_array(self, shape, dtype, alignment)
            frame = sys._getframe(1)
            key = (frame.f_code.co_filename, frame.f_lineno)
            with lock:
                res = self._allocations.get(key)
                if res is None:
                    if isinstance(dtype, types.Type):
                        dtype = numpy_support.as_dtype(dtype)
                    res = self._allocations[key] = np.empty(shape, dtype)
            return res

        array.thread_safe = True
        cls.array = array

    _install_thread_safe_shared_array()

    def _install_yielding_block_runner():
        """Numba's simulator runs a block's threads while its own thread polls them in a loop
        that never waits: it holds the interpreter lock for whole switch intervals doing
        nothing, most of all when few threads are still running (at a barrier, at a block's
        end). Profiled on a 2-core machine, 60 % of a kernel test's time went to that polling
        (``is_alive``, 3 million calls in one 20 s test). This version does the same
        bookkeeping (release a barrier once every live thread waits at it; on an exception,
        abort the block's threads and raise it) and sleeps 0.5 ms between passes, so the
        running threads get the interpreter."""
        import time

        import numpy as np
        from numba.cuda.simulator import kernel as sim

        cls = sim.BlockManager
        if getattr(cls.run, "yields", False):
            return

        def raise_from(thread, threads):
            for other in threads:
                other.abort = True
                other.syncthreads_blocked = False
                other.syncthreads_event.set()
            raise thread.exception[0].with_traceback(thread.exception[1])

        def run(self, grid_point, *args):
            def body():
                self._f(*args)

            threads = [sim.BlockThread(body, self, grid_point, point, self._debug)
                       for point in np.ndindex(*self._block_dim)]
            for thread in threads:
                thread.start()
            live = threads
            while live:
                waiting = 0
                for thread in live:
                    if thread.syncthreads_blocked:
                        waiting += 1
                    elif thread.exception:
                        raise_from(thread, threads)
                if waiting == len(live):
                    for thread in live:
                        thread.syncthreads_blocked = False
                        thread.syncthreads_event.set()
                live = [thread for thread in live if thread.is_alive()]
                if live:
                    time.sleep(5e-4)
            for thread in threads:
                if thread.exception:
                    raise thread.exception[0].with_traceback(thread.exception[1])

        run.yields = True
        cls.run = run

    _install_yielding_block_runner()

    def collective(value, combine):
        """Post ``value`` for this simulated lane; ``combine(values_by_lane)`` returns 32 results."""
        thread = threading.current_thread()
        tid = thread.thread_id
        with _exchange_lock:     # the block's exchanges live (and die) with its manager
            exchanges = thread._manager.__dict__.setdefault("_nf_exchanges", {})
            key = (tuple(thread.blockIdx), tid // 32)
            ex = exchanges.get(key)
            if ex is None:
                ex = exchanges[key] = _WarpExchange()
        return ex.meet(tid % 32, value, combine)
