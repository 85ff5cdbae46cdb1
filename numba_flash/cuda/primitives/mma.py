"""Tensor-core matrix products (``mma.sync.aligned.m16n8k16``, fp32 accumulation) and the
conversions that pack float32 pairs into their 16-bit operands.

Register conventions (PTX ISA, "Matrix Fragments for mma.m16n8k16", with ``g = lane >> 2`` and
``t = lane & 3``): a ``uint32`` holds two 16-bit values, the lower-indexed column in the low half.

* A (16 x 16, row-major): ``a0 = A[g, 2t:2t+2]``, ``a1 = A[g+8, 2t:2t+2]``,
  ``a2 = A[g, 2t+8:2t+10]``, ``a3 = A[g+8, 2t+8:2t+10]``.
* B (16 x 8, k x n), given as its transpose ``BT`` (n x k, row-major):
  ``b0 = BT[g, 2t:2t+2]``, ``b1 = BT[g, 2t+8:2t+10]``.
* C/D (16 x 8, float32): ``c0, c1 = C[g, 2t], C[g, 2t+1]``; ``c2, c3 = C[g+8, 2t], C[g+8, 2t+1]``.

In the simulator the product is computed exactly from the 32 lanes' gathered fragments and
rounded once to float32 (base.collective).
"""
from __future__ import annotations

import math

import numpy as np

from .base import SIMULATOR, collective, inlined

__all__ = ["mma_f16", "mma_bf16", "mma16", "pack_f16", "pack_bf16", "pack16"]

if not SIMULATOR:
    from llvmlite import ir
    from numba.cuda import types
    from numba.cuda.extending import intrinsic

    _U32 = types.uint32
    _F32 = types.float32

    def _mma_intrinsic(ptx_types: str):
        """An intrinsic for ``mma.sync.aligned.m16n8k16.row.col.f32.<ptx_types>.f32``."""

        @intrinsic
        def mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
            sig = types.UniTuple(_F32, 4)(_U32, _U32, _U32, _U32, _U32, _U32,
                                          _F32, _F32, _F32, _F32)

            def codegen(context, builder, sig, args):
                f32, i32 = ir.FloatType(), ir.IntType(32)
                fnty = ir.FunctionType(ir.LiteralStructType([f32] * 4), [i32] * 6 + [f32] * 4)
                asm = ir.InlineAsm(
                    fnty,
                    f"mma.sync.aligned.m16n8k16.row.col.f32.{ptx_types}.f32 "
                    "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};",
                    "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
                res = builder.call(asm, args)
                vals = [builder.extract_value(res, i) for i in range(4)]
                return context.make_tuple(builder, sig.return_type, vals)

            return sig, codegen

        return mma

    mma_f16 = _mma_intrinsic("f16.f16")
    mma_bf16 = _mma_intrinsic("bf16.bf16")

    def _pack_intrinsic(ptx_type: str):
        """Two float32 -> one uint32 of two ``ptx_type`` values (round to nearest even)."""

        @intrinsic
        def pack(typingctx, lo, hi):
            sig = _U32(_F32, _F32)

            def codegen(context, builder, sig, args):
                fnty = ir.FunctionType(ir.IntType(32), [ir.FloatType()] * 2)
                # cvt.rn.f16x2.f32 d, a, b puts a in the upper half and b in the lower half.
                asm = ir.InlineAsm(fnty, f"cvt.rn.{ptx_type}x2.f32 $0, $2, $1;", "=r,f,f")
                return builder.call(asm, args)

            return sig, codegen

        return pack

    pack_f16 = _pack_intrinsic("f16")
    pack_bf16 = _pack_intrinsic("bf16")

    @inlined
    def mma16(is_bf16, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """``mma_bf16`` if ``is_bf16`` (a compile-time constant at the call site) else ``mma_f16``."""
        if is_bf16:
            return mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)
        return mma_f16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)

    @inlined
    def pack16(is_bf16, lo, hi):
        """``pack_bf16`` if ``is_bf16`` else ``pack_f16``."""
        if is_bf16:
            return pack_bf16(lo, hi)
        return pack_f16(lo, hi)

else:
    _G = np.arange(32) >> 2
    _T = np.arange(32) & 3

    def _halves_f16(words):
        return np.ascontiguousarray(words, dtype=np.uint32).view(np.float16).astype(np.float64)

    def _halves_bf16(words):
        w = np.ascontiguousarray(words, dtype=np.uint32)
        pair = np.stack([(w & 0xFFFF) << 16, w & 0xFFFF0000], axis=-1).astype(np.uint32)
        return pair.view(np.float32).reshape(w.shape[:-1] + (2 * w.shape[-1],)).astype(np.float64)

    def _mma_combine(halves):
        def combine(slots):
            frags = np.array([[int(x) & 0xFFFFFFFF for x in f[:6]] for f in slots], dtype=np.uint32)
            h = halves(frags)                               # (32 lanes, 12 values)
            A = np.zeros((16, 16))
            BT = np.zeros((8, 16))
            for r, (dr, dc) in enumerate(((0, 0), (8, 0), (0, 8), (8, 8))):
                for e in range(2):
                    A[_G + dr, 2 * _T + dc + e] = h[:, 2 * r + e]
            for r, dc in enumerate((0, 8)):
                for e in range(2):
                    BT[_G, 2 * _T + dc + e] = h[:, 8 + 2 * r + e]
            C = np.array([f[6:] for f in slots], dtype=np.float32)
            D = (A @ BT.T).astype(np.float32)                # exact products, one rounding
            prod = np.stack([D[_G, 2 * _T], D[_G, 2 * _T + 1], D[_G + 8, 2 * _T],
                             D[_G + 8, 2 * _T + 1]], axis=1)
            out = (C + prod).astype(np.float32)
            return [tuple(np.float32(x) for x in row) for row in out]
        return combine

    _combine_f16 = _mma_combine(_halves_f16)
    _combine_bf16 = _mma_combine(_halves_bf16)

    def mma_f16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """D = A @ B + C for one warp; fragments as in the module docstring (float16 inputs)."""
        return collective((a0, a1, a2, a3, b0, b1, c0, c1, c2, c3), _combine_f16)

    def mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """D = A @ B + C for one warp; fragments as in the module docstring (bfloat16 inputs)."""
        return collective((a0, a1, a2, a3, b0, b1, c0, c1, c2, c3), _combine_bf16)

    def mma16(is_bf16, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """``mma_bf16`` if ``is_bf16`` else ``mma_f16``."""
        return (mma_bf16 if is_bf16 else mma_f16)(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)

    def pack16(is_bf16, lo, hi):
        """``pack_bf16`` if ``is_bf16`` else ``pack_f16``."""
        return (pack_bf16 if is_bf16 else pack_f16)(lo, hi)

    def pack_f16(lo, hi):
        """Two float32 -> uint32 holding float16(lo) in the low half, float16(hi) in the high."""
        h = np.array([lo, hi], dtype=np.float32).astype(np.float16)
        return np.uint32(h.view(np.uint32)[0])

    def _bf16_bits(x):
        bits = int(np.array([x], dtype=np.float32).view(np.uint32)[0])
        if math.isnan(float(x)):
            return 0x7FC0
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF

    def pack_bf16(lo, hi):
        """Two float32 -> uint32 holding bfloat16(lo) low, bfloat16(hi) high (nearest even)."""
        return np.uint32(_bf16_bits(lo) | (_bf16_bits(hi) << 16))
