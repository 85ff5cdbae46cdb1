"""The exact-precision tensor-core primitives (numba_flash/cuda/primitives/mma_exact.py): one
warp's DMMA (m8n8k4 float64) and TF32 (m16n8k8) products against NumPy with the documented
fragment layouts, and the 3xTF32 split recovering float32 accuracy. Kernels run on the GPU or in
the simulator; the offline test checks the instructions ptxas emits for sm_90."""
from __future__ import annotations


import numpy as np
import pytest
from numba import cuda

from numba_flash.cuda.primitives import (SIMULATOR, mma_f64, mma_f64_k16, mma_f64_k16_884,
                                         mma_tf32, split_tf32, split_tf32_fast)
from numba_flash.cuda.primitives.mma_exact import tensor_core_rounding
from numba_flash.studies.tf32 import truncate_tf32
from offline_sass import run_offline
from gpu_arrays import to_device, to_host


@cuda.jit
def _dmma(a, b, c, d):
    lane = cuda.threadIdx.x
    g, t = lane >> 2, lane & 3
    d0, d1 = mma_f64(a[g, t], b[t, g], c[g, 2 * t], c[g, 2 * t + 1])
    d[g, 2 * t] = d0
    d[g, 2 * t + 1] = d1


def _dmma_k16_kernel(product):
    """A one-warp kernel D = A B + C through ``product`` (m16n8k16 fragments)."""
    @cuda.jit
    def kernel(a, b, c, d):
        lane = cuda.threadIdx.x
        g, t = lane >> 2, lane & 3
        af = cuda.local.array(8, np.float64)
        bf = cuda.local.array(4, np.float64)
        for j in range(4):
            af[2 * j], af[2 * j + 1] = a[g, t + 4 * j], a[g + 8, t + 4 * j]
            bf[j] = b[t + 4 * j, g]
        acc = product(af[0], af[1], af[2], af[3], af[4], af[5], af[6], af[7],
                      bf[0], bf[1], bf[2], bf[3],
                      c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t], c[g + 8, 2 * t + 1])
        d[g, 2 * t], d[g, 2 * t + 1], d[g + 8, 2 * t], d[g + 8, 2 * t + 1] = acc

    return kernel


@cuda.jit
def _tf32(a, b, c, d, three, fast):
    lane = cuda.threadIdx.x
    g, t = lane >> 2, lane & 3
    ah, al = cuda.local.array(4, np.float32), cuda.local.array(4, np.float32)
    bh, bl = cuda.local.array(2, np.float32), cuda.local.array(2, np.float32)
    for i, (r, k) in enumerate(((g, t), (g + 8, t), (g, t + 4), (g + 8, t + 4))):
        ah[i], al[i] = split_tf32_fast(a[r, k]) if fast else split_tf32(a[r, k])
    for i, k in enumerate((t, t + 4)):
        bh[i], bl[i] = split_tf32_fast(b[k, g]) if fast else split_tf32(b[k, g])
    acc = (c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t], c[g + 8, 2 * t + 1])
    if three:   # small terms first: a_lo b_hi + a_hi b_lo, then a_hi b_hi
        acc = mma_tf32(al[0], al[1], al[2], al[3], bh[0], bh[1], *acc)
        acc = mma_tf32(ah[0], ah[1], ah[2], ah[3], bl[0], bl[1], *acc)
    acc = mma_tf32(ah[0], ah[1], ah[2], ah[3], bh[0], bh[1], *acc)
    d[g, 2 * t], d[g, 2 * t + 1], d[g + 8, 2 * t], d[g + 8, 2 * t + 1] = acc


def test_dmma_matches_numpy():
    rng = np.random.default_rng(0)
    a, b, c = rng.standard_normal((8, 4)), rng.standard_normal((4, 8)), rng.standard_normal((8, 8))
    d = to_device(np.full((8, 8), np.nan))
    _dmma[1, 32](to_device(a), to_device(b), to_device(c), d)
    np.testing.assert_allclose(to_host(d), a @ b + c, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("native", [True, False])
def test_dmma_k16_matches_numpy(native):
    """The m16n8k16 float64 product (sm_90's DMMA.16x8x16) and its eight-m8n8k4 form agree with
    NumPy under the documented fragment layout."""
    if native and not SIMULATOR and cuda.get_current_device().compute_capability < (9, 0):
        pytest.skip("mma.sync m16n8k16 float64 needs sm_90")
    rng = np.random.default_rng(2)
    a, b, c = (rng.standard_normal(s) for s in ((16, 16), (16, 8), (16, 8)))
    d = to_device(np.full((16, 8), np.nan))
    kernel = _dmma_k16_kernel(mma_f64_k16 if native else mma_f64_k16_884)
    kernel[1, 32](to_device(a), to_device(b), to_device(c), d)
    np.testing.assert_allclose(to_host(d), a @ b + c, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("fast", [False, True])
def test_three_tf32_products_reach_float32_accuracy(fast):
    """One TF32 product keeps ~10 mantissa bits; the 3xTF32 sum (hi*hi + hi*lo + lo*hi) comes
    within a few float32 roundings of the float64 product, with lo rounded to TF32
    (``split_tf32``) or left for the tensor core to truncate (``split_tf32_fast``)."""
    rng = np.random.default_rng(1)
    a = rng.standard_normal((16, 8)).astype(np.float32)
    b = rng.standard_normal((8, 8)).astype(np.float32)
    c = rng.standard_normal((16, 8)).astype(np.float32)
    exact = a.astype(np.float64) @ b.astype(np.float64) + c
    errors = []
    for three in (False, True):
        d = to_device(np.full((16, 8), np.nan, np.float32))
        _tf32[1, 32](to_device(a), to_device(b), to_device(c), d, three, fast)
        errors.append(np.abs(to_host(d) - exact).max() / np.abs(exact).max())
    plain, compensated = errors
    assert 1e-5 < plain < 1e-2, plain                  # TF32: 10 mantissa bits
    assert compensated < 4 * 2.0 ** -24 * 8, compensated   # ~fp32 rounding of an 8-term sum
    assert compensated < plain / 100


def _one_tf32_product(a, b, c):
    d = to_device(np.full((16, 8), np.nan, np.float32))
    _tf32[1, 32](to_device(a), to_device(b), to_device(c), d, False, False)
    return to_host(d)


def test_tf32_mma_rounds_toward_zero():
    """The tensor cores round each D = A B + C toward zero (mma_exact's docstring); the
    simulator models that under ``tensor_core_rounding("truncate")`` and rounds to nearest by
    default. Rows: C = 1 plus a product of 1.75 float32 ulps of 1 (nearest: 1 + 2 ulps, toward
    zero: 1 + 1 ulp), the same negated, and C = 1 minus a product of 2^-60, whose float64 sum is
    exactly 1.0 (the model sums exactly: 1 - 2^-24 toward zero; checked in the simulator only,
    hardware may drop so small an addend while aligning)."""
    a, b, c = (np.zeros(s, np.float32) for s in ((16, 8), (8, 8), (16, 8)))
    a[0, 0], a[1, 0], b[0, 0] = 7 * 2.0 ** -13, -7 * 2.0 ** -13, 2.0 ** -12
    a[2, 1], b[1, 0] = 2.0 ** -30, -(2.0 ** -30)
    c[0, 0], c[1, 0], c[2, 0] = 1.0, -1.0, 1.0
    ulp = 2.0 ** -23
    truncated = [1 + ulp, -(1 + ulp), 1 - ulp / 2]
    if not SIMULATOR:       # the hardware itself
        assert _one_tf32_product(a, b, c)[:2, 0].tolist() == truncated[:2]
        return
    assert _one_tf32_product(a, b, c)[:3, 0].tolist() == [1 + 2 * ulp, -(1 + 2 * ulp), 1.0]
    with tensor_core_rounding("truncate"):
        d = _one_tf32_product(a, b, c)
    assert d[:3, 0].tolist() == truncated
    d[:3, 0] = 0
    assert not d.any()
    with pytest.raises(ValueError):
        with tensor_core_rounding("up"):
            pass


def test_split_tf32_is_exact_in_two_parts():
    """hi holds x to 11 significant bits, hi + lo to ~22: their sum is within 2^-21 |x|."""
    for x in np.random.default_rng(2).standard_normal(200).astype(np.float32):
        hi, lo = split_tf32(x) if SIMULATOR else (None, None)
        if hi is None:
            pytest.skip("split_tf32 is a device function on a GPU (covered by the kernel test)")
        assert abs(float(hi) - float(x)) <= 2 ** -11 * abs(x)
        assert abs(float(hi) + float(lo) - float(x)) <= 2 ** -21 * abs(x)


@cuda.jit
def _split_fast(x, hi, lo):
    i = cuda.grid(1)
    if i < x.size:
        hi[i], lo[i] = split_tf32_fast(x[i])


def test_split_tf32_fast_rounds_like_cvt_rna():
    """``split_tf32_fast``: hi is x rounded to nearest TF32 (ties away from zero, cvt.rna's
    rule), lo = x - hi exactly, and hi + lo truncated to TF32 (what the tensor core reads) is
    within 2^-21 |x|; an infinity keeps its hi and a NaN has a NaN lo (so a NaN product), the
    payload 0x7FFFFFFF included (its hi carries into the sign)."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(256) * np.exp2(rng.integers(-60, 60, 256))).astype(np.float32)
    ties = np.array([1 + 2.0 ** -11, -(1 + 3 * 2.0 ** -11), 1 + 2.0 ** -11 - 2.0 ** -23],
                    np.float32)
    special = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0], np.float32)
    canonical_nan = np.array([0x7FFFFFFF], np.uint32).view(np.float32)
    x = np.concatenate([x, ties, special, canonical_nan])
    hi, lo = (to_device(np.full(x.size, 7, np.float32)) for _ in range(2))
    _split_fast[(x.size + 127) // 128, 128](to_device(x), hi, lo)
    hi, lo = to_host(hi), to_host(lo)
    n = x.size - special.size - 1
    fin = slice(0, n)
    half_ulp = np.abs(x[fin].astype(np.float64) - truncate_tf32(x[fin]).astype(np.float64))
    assert np.array_equal(truncate_tf32(hi[fin]), hi[fin])         # hi is a TF32 number
    err = np.abs(hi[fin].astype(np.float64) - x[fin])
    ulp = np.exp2(np.floor(np.log2(np.abs(x[fin].astype(np.float64)))) - 10)
    assert np.all(err <= ulp / 2)                                # nearest ...
    tie = np.isclose(half_ulp, ulp / 2, rtol=0, atol=0)
    assert np.all(np.abs(hi[fin][tie]) > np.abs(x[fin][tie]))    # ... ties away from zero
    assert hi[n - 3:n].tolist() == [1 + 2.0 ** -10, -(1 + 2.0 ** -9), 1.0]
    assert np.array_equal(lo[fin], x[fin] - hi[fin])             # the exact remainder
    kept = hi[fin].astype(np.float64) + truncate_tf32(lo[fin])
    assert np.all(np.abs(kept - x[fin]) <= 2.0 ** -21 * np.abs(x[fin].astype(np.float64)))
    assert hi[n:n + 2].tolist() == [np.inf, -np.inf]
    assert np.isnan(truncate_tf32(lo[n:n + 3])).all() and np.isnan(truncate_tf32(lo[-1:])).all()
    assert hi[n + 3:n + 5].tolist() == [0.0, 0.0] and not lo[n + 3:n + 5].any()


_OFFLINE = r"""
import os, sys
os.environ["NUMBA_ENABLE_CUDASIM"] = "0"
sys.path.insert(0, "scripts"); sys.path.insert(0, "tests")
import kernel_resources as kr
from numba.cuda import types
import test_mma_exact as t
f64, f32 = types.float64, types.float32
A = lambda ty: types.Array(ty, 2, "C")
d = kr.report(t._dmma.py_func, types.void(A(f64), A(f64), A(f64), A(f64)))
s = kr.report(t._tf32.py_func, types.void(A(f32), A(f32), A(f32), A(f32), types.boolean,
                                         types.boolean))
print(d["sass"].count("DMMA"), s["sass"].count("HMMA.1688.F32.TF32"), d["n_ldl"], s["n_ldl"])
"""


def test_offline_sass_has_dmma_and_tf32_instructions():
    """ptxas turns the intrinsics into DMMA.884 and HMMA.1688.F32.TF32 for sm_90, with no local
    memory. Needs NVVM, NVRTC and ptxas (skipped where they are missing, as in CI)."""
    lines = run_offline(_OFFLINE)
    n_dmma, n_tf32, ldl_d, ldl_t = (int(x) for x in lines[-1].split())
    assert n_dmma == 1 and n_tf32 == 3 and ldl_d == 0 and ldl_t == 0, lines
