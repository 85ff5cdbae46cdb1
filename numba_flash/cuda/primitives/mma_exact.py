"""Tensor-core products for the exact precisions (issue 21's building blocks).

* ``mma_f64(a0, b0, c0, c1)``: ``mma.sync.aligned.m8n8k4.row.col.f64`` (DMMA): D (8 x 8) =
  A (8 x 4) B (4 x 8) + C, every value float64. Fragments (PTX ISA, "Matrix Fragments for
  mma.m8n8k4 with .f64", ``g = lane >> 2``, ``t = lane & 3``): ``a0 = A[g, t]``,
  ``b0 = B[t, g]``, ``c0, c1 = C[g, 2t], C[g, 2t + 1]`` (D likewise).
* ``mma_f64_k16(a0, .., a7, b0, .., b3, c0, .., c3)``: ``mma.sync.aligned.m16n8k16.row.col.f64``
  (sm_90's DMMA.16x8x16, eight times the work of one m8n8k4 for one instruction): D (16 x 8) =
  A (16 x 16) B (16 x 8) + C, float64. Fragments: ``a[2j + h] = A[g + 8h, t + 4j]``,
  ``b[j] = B[t + 4j, g]`` (j = 0..3, h = 0, 1); C / D as in mma.py's m16n8 layout
  (``c0, c1 = C[g, 2t], C[g, 2t + 1]``, ``c2, c3`` the same in row g + 8).
  ``mma_f64_k16_884`` computes the same product as eight ``mma_f64`` (m8n8k4) for GPUs
  before sm_90: k-chunk j of rows g is ``mma_f64(a[2j], b[j])``, of rows g + 8
  ``mma_f64(a[2j + 1], b[j])``.
* ``mma_tf32(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)``: ``mma.sync.aligned.m16n8k8.row.col
  .f32.tf32.tf32.f32``: D (16 x 8, float32) = A (16 x 8) B (8 x 8) + C, operands TF32 (float32
  bit patterns, the low 13 mantissa bits ignored). Fragments: ``a0 = A[g, t]``,
  ``a1 = A[g + 8, t]``, ``a2 = A[g, t + 4]``, ``a3 = A[g + 8, t + 4]``; ``b0 = B[t, g]``,
  ``b1 = B[t + 4, g]``; C / D as in mma.py's m16n8 layout.
* ``split_tf32(x) -> (hi, lo)``: ``hi`` = x rounded to TF32 (``cvt.rna.tf32.f32``), ``lo`` =
  (x - hi) rounded to TF32, so that ``hi + lo`` carries about 21 significant bits of x: the
  operands of the 3xTF32 scheme (``a_hi b_hi + a_hi b_lo + a_lo b_hi``, fp32 accumulation).
* ``split_tf32_fast(x) -> (hi, lo)``: the same ``hi`` by integer operations on the bits
  (``(bits + 0x1000) & 0xFFFFE000``: round to nearest, ties away, as cvt.rna; two integer
  instructions where cvt.rna lowers to a compare-and-select sequence) and ``lo = x - hi``
  (exact) left unrounded: the tensor core reads an operand's top 19 bits, so it truncates lo to
  TF32 itself (``hi + trunc(lo)`` keeps about 22 significant bits of x: lo has at most 13, it
  loses at most 2 of them). Infinities stay infinite (0x7F800000 + 0x1000 keeps its exponent
  and loses the added bit to the mask); a NaN's ``hi`` may come out as an infinity or -0 (the
  add carries a full payload into the sign), but ``lo = x - hi`` is then the GPU's canonical NaN
  (0x7FFFFFFF, NaN after truncation), so ``a_lo b_hi`` / ``a_hi b_lo`` and the product are
  NaN. An infinite x gives ``lo = inf - inf = NaN`` and a NaN product, as ``split_tf32`` does.

In the simulator the products are computed exactly from the 32 lanes' gathered fragments and
rounded once (float64 for DMMA; float32 for TF32 after the operands' truncation to TF32: the low
13 mantissa bits dropped, as the hardware reads them). The TF32
stand-in rounds to nearest by default: an ideal tensor core. The hardware does not: it forms the
products exactly but rounds the sum toward zero (Fasi, Higham, Mikaitis, Pranesh, "Numerical
behavior of NVIDIA tensor cores", PeerJ CS 2021), so every mma into a long-lived accumulator adds
an error of up to one ulp of the accumulator, always toward zero. ``tensor_core_rounding
("truncate")`` makes the simulator model that (exact products, exact sum of the 8 products and C,
one truncation to float32 per mma); it reproduces the errors the 3xTF32 kernel showed on an H100
(docs/perf-notes.md, 2026-11-25).
"""
from __future__ import annotations

import contextlib
import math

import numpy as np

from .base import SIMULATOR, collective, inlined

__all__ = ["mma_f64", "mma_f64_k16", "mma_f64_k16_884", "mma_tf32", "split_tf32",
           "split_tf32_fast", "tensor_core_rounding"]

_TF32_HALF = 0x1000          # half a TF32 ulp in a float32's bits: + and mask round to nearest
_TF32_MASK = 0xFFFFE000      # sign, exponent and the 10 mantissa bits TF32 keeps

_G = np.arange(32) >> 2
_T = np.arange(32) & 3

if not SIMULATOR:
    from llvmlite import ir
    from numba.cuda import types
    from numba.cuda.extending import intrinsic

    _F64, _F32 = types.float64, types.float32

    @intrinsic
    def mma_f64(typingctx, a0, b0, c0, c1):
        """D = A B + C for one warp on the float64 tensor cores (fragments: module docstring)."""
        sig = types.UniTuple(_F64, 2)(_F64, _F64, _F64, _F64)

        def codegen(context, builder, sig, args):
            f64 = ir.DoubleType()
            fnty = ir.FunctionType(ir.LiteralStructType([f64] * 2), [f64] * 4)
            asm = ir.InlineAsm(fnty, "mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 "
                                     "{$0,$1}, {$2}, {$3}, {$4,$5};", "=d,=d,d,d,d,d")
            res = builder.call(asm, args)
            return context.make_tuple(builder, sig.return_type,
                                      [builder.extract_value(res, i) for i in range(2)])

        return sig, codegen

    @intrinsic
    def mma_f64_k16(typingctx, a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, c0, c1, c2, c3):
        """D = A B + C for one warp, m16n8k16 float64 (sm_90; fragments: module docstring)."""
        sig = types.UniTuple(_F64, 4)(*([_F64] * 16))

        def codegen(context, builder, sig, args):
            f64 = ir.DoubleType()
            fnty = ir.FunctionType(ir.LiteralStructType([f64] * 4), [f64] * 16)
            asm = ir.InlineAsm(fnty, "mma.sync.aligned.m16n8k16.row.col.f64.f64.f64.f64 "
                                     "{$0,$1,$2,$3}, {$4,$5,$6,$7,$8,$9,$10,$11}, "
                                     "{$12,$13,$14,$15}, {$16,$17,$18,$19};",
                               ",".join(["=d"] * 4 + ["d"] * 16))
            res = builder.call(asm, args)
            return context.make_tuple(builder, sig.return_type,
                                      [builder.extract_value(res, i) for i in range(4)])

        return sig, codegen

    @intrinsic
    def mma_tf32(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """D = A B + C for one warp, TF32 operands, float32 accumulation."""
        sig = types.UniTuple(_F32, 4)(*([_F32] * 10))

        def codegen(context, builder, sig, args):
            f32, i32 = ir.FloatType(), ir.IntType(32)
            bits = [builder.bitcast(a, i32) for a in args[:6]]
            fnty = ir.FunctionType(ir.LiteralStructType([f32] * 4), [i32] * 6 + [f32] * 4)
            asm = ir.InlineAsm(fnty, "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
                                     "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};",
                               "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
            res = builder.call(asm, bits + list(args[6:]))
            return context.make_tuple(builder, sig.return_type,
                                      [builder.extract_value(res, i) for i in range(4)])

        return sig, codegen

    @intrinsic
    def _to_tf32(typingctx, x):
        sig = _F32(_F32)

        def codegen(context, builder, sig, args):
            f32, i32 = ir.FloatType(), ir.IntType(32)
            asm = ir.InlineAsm(ir.FunctionType(i32, [f32]), "cvt.rna.tf32.f32 $0, $1;", "=r,f")
            return builder.bitcast(builder.call(asm, args), f32)

        return sig, codegen


    @intrinsic
    def _round_tf32_bits(typingctx, x):
        sig = _F32(_F32)

        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            bits = builder.add(builder.bitcast(args[0], i32), ir.Constant(i32, _TF32_HALF))
            bits = builder.and_(bits, ir.Constant(i32, _TF32_MASK - (1 << 32)))
            return builder.bitcast(bits, ir.FloatType())

        return sig, codegen

    @inlined
    def split_tf32(x):
        """(hi, lo): x rounded to TF32 and the rounded remainder (module docstring)."""
        hi = _to_tf32(x)
        return hi, _to_tf32(x - hi)

    @inlined
    def split_tf32_fast(x):
        """(hi, lo): x rounded to TF32 by integer operations and the exact remainder, left for
        the tensor core to truncate (module docstring)."""
        hi = _round_tf32_bits(x)
        return hi, x - hi

    def tensor_core_rounding(mode: str):
        """The simulator's TF32 rounding model: not available on a GPU, whose tensor cores round
        as they do."""
        raise RuntimeError("tensor_core_rounding selects the CUDA simulator's TF32 model; "
                           "a GPU's tensor cores round as they do")

else:
    _ROUNDINGS = ("nearest", "truncate")
    _rounding = ["nearest"]

    @contextlib.contextmanager
    def tensor_core_rounding(mode: str):
        """Within the block, the simulator's ``mma_tf32`` rounds each D = A B + C as ``mode``
        says: ``"nearest"`` (the default: the float64 sum rounded to nearest float32) or
        ``"truncate"`` (the exact result rounded toward zero, as the tensor cores do; module
        docstring). Process-wide: meant for tests, around a whole kernel launch."""
        if mode not in _ROUNDINGS:
            raise ValueError(f"rounding must be one of {_ROUNDINGS}, got {mode!r}")
        previous = _rounding[0]
        _rounding[0] = mode
        try:
            yield
        finally:
            _rounding[0] = previous

    def _tf32(x):
        """Round-to-nearest (ties away) to TF32's 10 mantissa bits, as cvt.rna does."""
        bits = np.array([x], dtype=np.float32).view(np.uint32)[0]
        if np.isfinite(np.float32(x)):
            bits = (int(bits) + 0x1000) & 0xFFFFE000
        return np.array([bits], dtype=np.uint32).view(np.float32)[0]

    def _tf32_truncate(x):
        """The TF32 number the tensor cores read from float32 ``x``: its low 13 bits dropped."""
        bits = np.array([x], dtype=np.float32).view(np.uint32) & np.uint32(_TF32_MASK)
        return bits.view(np.float32)[0]

    def split_tf32(x):
        """(hi, lo): x rounded to TF32 and the rounded remainder (module docstring)."""
        hi = _tf32(np.float32(x))
        return hi, _tf32(np.float32(np.float32(x) - hi))

    def split_tf32_fast(x):
        """(hi, lo): the GPU version's integer rounding (+ half an ulp, mask; a NaN's payload
        may carry into the sign, as there) and the exact float32 remainder (module
        docstring)."""
        bits = np.array([x], dtype=np.float32).view(np.uint32).astype(np.uint64)
        bits = ((bits + _TF32_HALF) & _TF32_MASK).astype(np.uint32)
        hi = bits.view(np.float32)[0]
        with np.errstate(invalid="ignore"):
            return hi, np.float32(np.float32(x) - hi)

    def _combine_f64(slots):
        a = np.zeros((8, 4))
        b = np.zeros((4, 8))
        c = np.zeros((8, 8))
        for lane, (a0, b0, c0, c1) in enumerate(slots):
            g, t = lane >> 2, lane & 3
            a[g, t], b[t, g] = a0, b0
            c[g, 2 * t], c[g, 2 * t + 1] = c0, c1
        d = a @ b + c
        return [(np.float64(d[lane >> 2, 2 * (lane & 3)]),
                 np.float64(d[lane >> 2, 2 * (lane & 3) + 1])) for lane in range(32)]

    def mma_f64(a0, b0, c0, c1):
        """D = A B + C for one warp (float64; fragments: module docstring)."""
        return collective((a0, b0, c0, c1), _combine_f64)

    def _combine_f64_k16(slots):
        a = np.zeros((16, 16))
        b = np.zeros((16, 8))
        c = np.zeros((16, 8))
        for lane, s in enumerate(slots):
            g, t = lane >> 2, lane & 3
            for j in range(4):
                a[g, t + 4 * j], a[g + 8, t + 4 * j] = s[2 * j], s[2 * j + 1]
                b[t + 4 * j, g] = s[8 + j]
            c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t], c[g + 8, 2 * t + 1] = s[12:]
        d = a @ b + c
        return [(d[g, 2 * t], d[g, 2 * t + 1], d[g + 8, 2 * t], d[g + 8, 2 * t + 1])
                for g, t in zip(_G, _T)]

    def mma_f64_k16(a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, c0, c1, c2, c3):
        """D = A B + C for one warp, m16n8k16 float64 (fragments: module docstring)."""
        return collective((a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, c0, c1, c2, c3),
                          _combine_f64_k16)

    def _sum_toward_zero(terms):
        """Each row of ``terms`` (float64) summed exactly and rounded toward zero to float32."""
        rows = terms.tolist()
        s = np.array([math.fsum(r) for r in rows])        # the exact sum rounded to nearest
        with np.errstate(over="ignore"):
            d = s.astype(np.float32)
        away = np.abs(d.astype(np.float64)) > np.abs(s)
        for i in np.flatnonzero((d == s) & (s != 0) & np.isfinite(s)):   # exact or not?
            away[i] = math.fsum(rows[i] + [-float(s[i])]) * s[i] < 0
        d[away] = np.nextafter(d[away], np.float32(0))
        return d

    def _combine_tf32(slots):
        a = np.zeros((16, 8))
        b = np.zeros((8, 8))
        c = np.zeros((16, 8), dtype=np.float32)
        for lane, s in enumerate(slots):
            g, t = lane >> 2, lane & 3
            a0, a1, a2, a3, b0, b1 = (float(_tf32_truncate(np.float32(x))) for x in s[:6])
            a[g, t], a[g + 8, t], a[g, t + 4], a[g + 8, t + 4] = a0, a1, a2, a3
            b[t, g], b[t + 4, g] = b0, b1
            c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t], c[g + 8, 2 * t + 1] = s[6:]
        if _rounding[0] == "truncate":    # products of TF32 numbers are exact in float64
            terms = np.concatenate([(a[:, None, :] * b.T[None, :, :]).reshape(128, 8),
                                    c.reshape(128, 1)], axis=1)
            d = _sum_toward_zero(terms).reshape(16, 8)
        else:
            d = (a @ b + c).astype(np.float32)
        return [(d[g, 2 * t], d[g, 2 * t + 1], d[g + 8, 2 * t], d[g + 8, 2 * t + 1])
                for g, t in zip(_G, _T)]

    def mma_tf32(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """D = A B + C for one warp, TF32 operands, float32 result."""
        return collective((a0, a1, a2, a3, b0, b1, c0, c1, c2, c3), _combine_tf32)


@inlined
def mma_f64_k16_884(a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, c0, c1, c2, c3):
    """``mma_f64_k16``'s product as eight m8n8k4 DMMAs (GPUs before sm_90; module docstring)."""
    c0, c1 = mma_f64(a0, b0, c0, c1)
    c2, c3 = mma_f64(a1, b0, c2, c3)
    c0, c1 = mma_f64(a2, b1, c0, c1)
    c2, c3 = mma_f64(a3, b1, c2, c3)
    c0, c1 = mma_f64(a4, b2, c0, c1)
    c2, c3 = mma_f64(a5, b2, c2, c3)
    c0, c1 = mma_f64(a6, b3, c0, c1)
    c2, c3 = mma_f64(a7, b3, c2, c3)
    return c0, c1, c2, c3
