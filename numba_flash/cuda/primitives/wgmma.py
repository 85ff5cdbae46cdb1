"""Hopper (sm_90a) primitives for the forward and backward kernels: warpgroup matrix products
(``wgmma``) and the shared-memory addressing they need.

Numba compiles for ``compute_90a`` on a compute-capability 9.0 device, so ``wgmma`` is
available through inline PTX. A warpgroup (4 consecutive warps, 128 threads, starting at a warp
index divisible by 4) issues ``wgmma.mma_async.m64nNk16``: D (64 x N, float32) += A (64 x 16) B
(16 x N), asynchronously; ``wgmma_commit`` closes a group and ``wgmma_wait`` waits for it.

Register layouts (PTX ISA, "Register fragment layout for wgmma .m64nNk16"): warp ``w`` of the
warpgroup owns rows ``16 w .. 16 w + 15``; within a warp, accumulator registers ``4 j .. 4 j + 3``
cover columns ``8 j .. 8 j + 7`` exactly as mma.sync m16n8's C fragment (mma.py's docstring), and
an A operand held in registers is mma.sync m16n8k16's A fragment. So the forward kernel's score,
probability and output fragments keep the layout of its mma.sync path.

Shared-memory operands are described by 64-bit descriptors (start address, leading and stride
byte offsets, swizzle mode). Every tile here uses the 128-byte swizzle: a tile of R rows and
64 16-bit columns is R rows of 128 bytes, 16-byte chunk ``c`` of row ``r`` stored at chunk
``c ^ (r & 7)``, the tile's base 1024-byte aligned (the hardware applies the XOR from address
bits 7-9); wider rows are split into such 64-column blocks placed one after the other.

* K-major operands (Q as A, K as B of Q K^T: the reduced dimension is contiguous): stride byte
  offset 1024 (8 rows of 128 bytes), leading offset unused; k-step ``kk`` starts at column
  block ``kk // 4`` plus ``32 (kk % 4)`` bytes.
* MN-major operand (V as B of P V, the output dimension contiguous, ``trans-b`` = 1; the
  backward's dS^T and K as A and B of dS K, ``wgmma_ss_mn``, both transpose bits set): leading
  byte offset = the distance between 64-column blocks, stride byte offset 1024 (8 key rows);
  k-step ``kb`` (16 keys) starts ``16 kb`` rows in.

Every shared-memory tile read by ``wgmma`` was written by ``cp.async`` (the generic proxy):
each writing thread runs ``fence_proxy_async`` after its copies complete and before the barrier
that precedes the ``wgmma``.

None of this runs in Numba's simulator (no inline PTX); the forward kernel takes its mma.sync
path there.
"""
from __future__ import annotations

from .base import SIMULATOR, inlined

__all__ = ["shared_addr", "sw128_desc", "cp_async16_to", "cp_async16_at_address",
           "global_address", "cp_async4_to", "lds_i32x2",
           "sts32", "fence_proxy_async", "wgmma_fence",
           "wgmma_commit", "wgmma_wait", "wgmma_ss", "wgmma_ss_mn", "wgmma_rs",
           "wgmma_hold"]

if not SIMULATOR:
    from llvmlite import ir
    from numba.cuda import types
    from numba.cuda.extending import intrinsic

    from .base import bare_asm_intrinsic, item_pointer_i64, u32_asm_intrinsic
    from .cp_async import emit_cp_async16

    _I32, _I64, _F32 = ir.IntType(32), ir.IntType(64), ir.FloatType()

    @intrinsic
    def shared_addr(typingctx, ary):
        """32-bit shared-window address (uint32) of a shared array's first element."""
        sig = types.uint32(ary)

        def codegen(context, builder, sig, args):
            data = context.make_array(sig.args[0])(context, builder, args[0]).data
            fnty = ir.FunctionType(_I32, [_I64])
            asm = ir.InlineAsm(fnty, "{ .reg .u64 t; cvta.to.shared.u64 t, $1; cvt.u32.u64 $0, t; }",
                               "=r,l", side_effect=False)
            return builder.call(asm, [builder.ptrtoint(data, _I64)])

        return sig, codegen

    @intrinsic
    def sw128_desc(typingctx, addr, lbo, sbo):
        """uint64 wgmma descriptor of a 128-byte-swizzled tile at shared address ``addr``
        (1024-byte aligned atoms) with leading / stride byte offsets ``lbo`` / ``sbo``."""
        sig = types.uint64(addr, lbo, sbo)

        def codegen(context, builder, sig, args):
            a, lb, sb = (context.cast(builder, v, t, types.uint64) for v, t in zip(args, sig.args))

            def field(v, shift):
                v = builder.and_(builder.lshr(v, ir.Constant(_I64, 4)), ir.Constant(_I64, 0x3FFF))
                return builder.shl(v, ir.Constant(_I64, shift))

            d = builder.or_(field(a, 0), field(lb, 16))
            d = builder.or_(d, field(sb, 32))
            return builder.or_(d, ir.Constant(_I64, 1 << 62))     # layout type 1: 128B swizzle

        return sig, codegen

    @intrinsic
    def cp_async16_to(typingctx, saddr, src, s0, s1, s2, s3, src_bytes):
        """16 bytes from ``&src[s0, s1, s2, s3]`` (global) to shared address ``saddr``
        (uint32); zero-filled when ``src_bytes`` is 0."""
        sig = types.void(saddr, src, s0, s1, s2, s3, src_bytes)

        def codegen(context, builder, sig, args):
            d = context.cast(builder, args[0], sig.args[0], types.uint32)
            g = item_pointer_i64(context, builder, sig.args[1], args[1], sig.args[2:6], args[2:6])
            emit_cp_async16(builder, d, g, context.cast(builder, args[6], sig.args[6], types.int32))
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def global_address(typingctx, src, s0, s1, s2, s3):
        """The global address (int64) of ``src[s0, s1, s2, s3]``, for copies that step
        through a tensor by byte strides instead of indexing it each time."""
        sig = types.int64(src, s0, s1, s2, s3)

        def codegen(context, builder, sig, args):
            return item_pointer_i64(context, builder, sig.args[0], args[0], sig.args[1:],
                                    args[1:])

        return sig, codegen

    @intrinsic
    def cp_async16_at_address(typingctx, saddr, gaddr):
        """16 bytes from global address ``gaddr`` (int64, from ``global_address``) to shared
        address ``saddr`` (uint32); no zero fill: the caller knows the bytes are in bounds."""
        sig = types.void(saddr, gaddr)

        def codegen(context, builder, sig, args):
            d = context.cast(builder, args[0], sig.args[0], types.uint32)
            g = context.cast(builder, args[1], sig.args[1], types.int64)
            fnty = ir.FunctionType(ir.VoidType(), [_I32, _I64])
            asm = ir.InlineAsm(fnty, "cp.async.cg.shared.global [$0], [$1], 16;",
                               "r,l,~{memory}", side_effect=True)
            builder.call(asm, [d, g])
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def cp_async4_to(typingctx, saddr, src, s0, s1, src_bytes):
        """4 bytes from ``&src[s0, s1]`` (global) to shared address ``saddr``; zero-filled
        when ``src_bytes`` is 0."""
        sig = types.void(saddr, src, s0, s1, src_bytes)

        def codegen(context, builder, sig, args):
            d = context.cast(builder, args[0], sig.args[0], types.uint32)
            g = item_pointer_i64(context, builder, sig.args[1], args[1], sig.args[2:4], args[2:4])
            n = context.cast(builder, args[4], sig.args[4], types.int32)
            fnty = ir.FunctionType(ir.VoidType(), [_I32, _I64, _I32])
            asm = ir.InlineAsm(fnty, "cp.async.ca.shared.global [$0], [$1], 4, $2;",
                               "r,l,r,~{memory}", side_effect=True)
            builder.call(asm, [d, g, n])
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def lds_i32x2(typingctx, saddr):
        """Two consecutive int32 at shared address ``saddr`` (8-byte aligned), one load."""
        sig = types.UniTuple(types.int32, 2)(saddr)

        def codegen(context, builder, sig, args):
            d = context.cast(builder, args[0], sig.args[0], types.uint32)
            fnty = ir.FunctionType(ir.LiteralStructType([_I32, _I32]), [_I32])
            asm = ir.InlineAsm(fnty, "ld.shared.v2.s32 {$0, $1}, [$2];", "=r,=r,r,~{memory}",
                               side_effect=True)
            res = builder.call(asm, [d])
            vals = [builder.extract_value(res, i) for i in range(2)]
            return context.make_tuple(builder, sig.return_type, vals)

        return sig, codegen

    # Store the 32-bit value $1 at shared address $0.
    sts32 = u32_asm_intrinsic("st.shared.u32 [$0], $1;", 2)

    fence_proxy_async = bare_asm_intrinsic("fence.proxy.async.shared::cta;")
    wgmma_fence = bare_asm_intrinsic("wgmma.fence.sync.aligned;")
    wgmma_commit = bare_asm_intrinsic("wgmma.commit_group.sync.aligned;")

    def _load_all(context, builder, aryty, aryval, n):
        ary = context.make_array(aryty)(context, builder, aryval)
        ptrs = [builder.gep(ary.data, [ir.Constant(_I64, i)]) for i in range(n)]
        return ptrs, [builder.load(p) for p in ptrs]

    def _store_all(builder, ptrs, res, n):
        for i in range(n):
            builder.store(builder.extract_value(res, i), ptrs[i])

    def _wait_intrinsic(nacc):
        """``wgmma.wait_group 0`` (every committed group complete) with the ``nacc``
        accumulators of a float32 array passed through it, so that no use of them is scheduled
        before the wait."""
        text = "wgmma.wait_group.sync.aligned 0;"

        @intrinsic
        def wait(typingctx, acc):
            sig = types.void(acc)

            def codegen(context, builder, sig, args):
                ptrs, vals = _load_all(context, builder, sig.args[0], args[0], nacc)
                fnty = ir.FunctionType(ir.LiteralStructType([_F32] * nacc), [_F32] * nacc)
                cons = ",".join(["=f"] * nacc + [str(i) for i in range(nacc)]) + ",~{memory}"
                res = builder.call(ir.InlineAsm(fnty, text, cons, side_effect=True), vals)
                _store_all(builder, ptrs, res, nacc)
                return context.get_dummy_value()

            return sig, codegen

        return wait

    def _ss_intrinsic(n, bf16, mn_major=False):
        """acc (float32 array of n / 2) = A B (+ acc if ``scale_d``): m64n{n}k16, A and B from
        shared memory (descriptors), both K-major, or both MN-major (``mn_major``: the
        transpose bits set)."""
        ab = "bf16" if bf16 else "f16"
        nacc = n // 2
        regs = ",".join(f"${i}" for i in range(nacc))
        trans = "1, 1" if mn_major else "0, 0"
        text = ("{ .reg .pred p; setp.ne.b32 p, $%d, 0; wgmma.mma_async.sync.aligned.m64n%dk16"
                ".f32.%s.%s {%s}, $%d, $%d, p, 1, 1, %s; }"
                % (nacc + 2, n, ab, ab, regs, nacc, nacc + 1, trans))
        cons = ",".join(["=f"] * nacc + ["l", "l", "r"] + [str(i) for i in range(nacc)])

        @intrinsic
        def ss(typingctx, acc, desc_a, desc_b, scale_d):
            sig = types.void(acc, desc_a, desc_b, scale_d)

            def codegen(context, builder, sig, args):
                ptrs, vals = _load_all(context, builder, sig.args[0], args[0], nacc)
                da = context.cast(builder, args[1], sig.args[1], types.uint64)
                db = context.cast(builder, args[2], sig.args[2], types.uint64)
                sc = context.cast(builder, args[3], sig.args[3], types.int32)
                fnty = ir.FunctionType(ir.LiteralStructType([_F32] * nacc),
                                       [_I64, _I64, _I32] + [_F32] * nacc)
                res = builder.call(ir.InlineAsm(fnty, text, cons, side_effect=True),
                                   [da, db, sc] + vals)
                _store_all(builder, ptrs, res, nacc)
                return context.get_dummy_value()

            return sig, codegen

        return ss

    def _rs_intrinsic(n, bf16):
        """acc (float32 array of n / 2) += A B: m64n{n}k16, A from registers (four uint32:
        the mma.sync A fragment of this warp's 16 rows), B from shared memory, MN-major."""
        ab = "bf16" if bf16 else "f16"
        nacc = n // 2
        regs = ",".join(f"${i}" for i in range(nacc))
        # scale-d must be a predicate: set from a register holding 1 (accumulate).
        text = ("{ .reg .pred p; setp.ne.b32 p, $%d, 0; wgmma.mma_async.sync.aligned.m64n%dk16"
                ".f32.%s.%s {%s}, {$%d, $%d, $%d, $%d}, $%d, p, 1, 1, 1; }"
                % (nacc + 5, n, ab, ab, regs, nacc, nacc + 1, nacc + 2, nacc + 3, nacc + 4))
        cons = ",".join(["=f"] * nacc + ["r", "r", "r", "r", "l", "r"]
                        + [str(i) for i in range(nacc)])

        @intrinsic
        def rs(typingctx, acc, a0, a1, a2, a3, desc_b):
            sig = types.void(acc, a0, a1, a2, a3, desc_b)

            def codegen(context, builder, sig, args):
                ptrs, vals = _load_all(context, builder, sig.args[0], args[0], nacc)
                a = [context.cast(builder, args[i], sig.args[i], types.uint32) for i in range(1, 5)]
                db = context.cast(builder, args[5], sig.args[5], types.uint64)
                fnty = ir.FunctionType(ir.LiteralStructType([_F32] * nacc),
                                       [_I32] * 4 + [_I64, _I32] + [_F32] * nacc)
                res = builder.call(ir.InlineAsm(fnty, text, cons, side_effect=True),
                                   a + [db, ir.Constant(_I32, 1)] + vals)
                _store_all(builder, ptrs, res, nacc)
                return context.get_dummy_value()

            return sig, codegen

        return rs

    @intrinsic
    def wgmma_hold(typingctx, frags):
        """An empty asm that reads and rewrites the 16 uint32 of ``frags`` (A fragments of
        ``wgmma_rs`` products), called after the ``wgmma_wait`` that retires those products.
        The hardware reads an A operand from its registers while the product runs, and the PTX
        ISA leaves writing them before the wait undefined; but to the register allocator the
        values die at the wgmma's issue. This asm only nudges the allocation: NVVM turns its
        tied operands into moves that ptxas may drop, and ptxas 13.0 (the lent machines' driver
        JIT) still reused such registers in the pipelined head_dim 64 loop (84 writes, removed
        2026-11-27). What proves a kernel is its SASS as the runtime links it
        (tests/test_cuda_backward.py, ``kernel_resources.a_operand_overwrites``)."""
        sig = types.void(frags)

        def codegen(context, builder, sig, args):
            ptrs, vals = _load_all(context, builder, sig.args[0], args[0], 16)
            fnty = ir.FunctionType(ir.LiteralStructType([_I32] * 16), [_I32] * 16)
            cons = ",".join(["=r"] * 16 + [str(i) for i in range(16)])
            res = builder.call(ir.InlineAsm(fnty, "// wgmma_hold", cons, side_effect=True), vals)
            _store_all(builder, ptrs, res, 16)
            return context.get_dummy_value()

        return sig, codegen

    _wait16, _wait32, _wait64 = _wait_intrinsic(16), _wait_intrinsic(32), _wait_intrinsic(64)
    _wait48, _wait128 = _wait_intrinsic(48), _wait_intrinsic(128)
    _ss_f16_64, _ss_f16_128 = _ss_intrinsic(64, False), _ss_intrinsic(128, False)
    _ss_bf16_64, _ss_bf16_128 = _ss_intrinsic(64, True), _ss_intrinsic(128, True)
    _ss_mn_f16_64, _ss_mn_bf16_64 = _ss_intrinsic(64, False, True), _ss_intrinsic(64, True, True)
    _ss_mn_f16_32, _ss_mn_bf16_32 = _ss_intrinsic(32, False, True), _ss_intrinsic(32, True, True)
    _ss_mn_f16_128 = _ss_intrinsic(128, False, True)
    _ss_mn_bf16_128 = _ss_intrinsic(128, True, True)
    _rs_f16_64, _rs_f16_128 = _rs_intrinsic(64, False), _rs_intrinsic(128, False)
    _rs_bf16_64, _rs_bf16_128 = _rs_intrinsic(64, True), _rs_intrinsic(128, True)
    _rs_f16_96, _rs_bf16_96 = _rs_intrinsic(96, False), _rs_intrinsic(96, True)
    _rs_f16_256, _rs_bf16_256 = _rs_intrinsic(256, False), _rs_intrinsic(256, True)

    # Dispatchers on compile-time constants (n, is_bf16) of the calling kernel, as warp.mma16.
    @inlined
    def wgmma_wait(n, acc):
        """Wait for every committed wgmma group; ``acc`` (n / 2 float32) passes through."""
        if n == 32:
            _wait16(acc)
        elif n == 64:
            _wait32(acc)
        elif n == 96:
            _wait48(acc)
        elif n == 128:
            _wait64(acc)
        else:
            _wait128(acc)

    @inlined
    def wgmma_ss(is_bf16, n, acc, desc_a, desc_b, scale_d):
        """m64n{n}k16 with A and B in shared memory; n is 64 or 128."""
        if is_bf16:
            if n == 64:
                _ss_bf16_64(acc, desc_a, desc_b, scale_d)
            else:
                _ss_bf16_128(acc, desc_a, desc_b, scale_d)
        else:
            if n == 64:
                _ss_f16_64(acc, desc_a, desc_b, scale_d)
            else:
                _ss_f16_128(acc, desc_a, desc_b, scale_d)

    @inlined
    def wgmma_ss_mn(is_bf16, n, acc, desc_a, desc_b, scale_d):
        """m64n{n}k16 with A and B in shared memory, both MN-major (A's rows, B's columns
        contiguous: the tiles hold A^T and B as [k][64-element blocks]); n is 32, 64 or 128
        (n 32: B may start 32 columns into a block, the swizzle is applied to the address)."""
        if is_bf16:
            if n == 32:
                _ss_mn_bf16_32(acc, desc_a, desc_b, scale_d)
            elif n == 64:
                _ss_mn_bf16_64(acc, desc_a, desc_b, scale_d)
            else:
                _ss_mn_bf16_128(acc, desc_a, desc_b, scale_d)
        else:
            if n == 32:
                _ss_mn_f16_32(acc, desc_a, desc_b, scale_d)
            elif n == 64:
                _ss_mn_f16_64(acc, desc_a, desc_b, scale_d)
            else:
                _ss_mn_f16_128(acc, desc_a, desc_b, scale_d)

    @inlined
    def wgmma_rs(is_bf16, n, acc, a0, a1, a2, a3, desc_b):
        """m64n{n}k16 accumulating, A in registers, B (MN-major) in shared memory; n is 64, 96,
        128 or 256 (n 96: the second 64-column block of B half used)."""
        if is_bf16:
            if n == 64:
                _rs_bf16_64(acc, a0, a1, a2, a3, desc_b)
            elif n == 96:
                _rs_bf16_96(acc, a0, a1, a2, a3, desc_b)
            elif n == 128:
                _rs_bf16_128(acc, a0, a1, a2, a3, desc_b)
            else:
                _rs_bf16_256(acc, a0, a1, a2, a3, desc_b)
        else:
            if n == 64:
                _rs_f16_64(acc, a0, a1, a2, a3, desc_b)
            elif n == 96:
                _rs_f16_96(acc, a0, a1, a2, a3, desc_b)
            elif n == 128:
                _rs_f16_128(acc, a0, a1, a2, a3, desc_b)
            else:
                _rs_f16_256(acc, a0, a1, a2, a3, desc_b)

else:
    def _unavailable(*args):
        raise NotImplementedError("wgmma needs a compute-capability 9.0 GPU (not the simulator)")

    shared_addr = sw128_desc = cp_async16_to = cp_async4_to = lds_i32x2 = sts32 = _unavailable
    global_address = cp_async16_at_address = _unavailable
    fence_proxy_async = _unavailable
    wgmma_fence = wgmma_commit = wgmma_wait = wgmma_ss = wgmma_ss_mn = wgmma_rs = _unavailable
    wgmma_hold = _unavailable
