"""CPU mode: numba_flash.attention on NumPy arrays against a direct float64 formula."""
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import numba_flash
from numba_flash_reference.precision import round_to
from numba_flash_reference.masks import Mask, SlidingWindowMask, visible_matrix

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float16), BF16, np.dtype(np.float32), np.dtype(np.float64)]
# Unit roundoff of each output dtype: CPU mode rounds the float64 answer once.
UNIT = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24, "float64": 2.0**-53}
# Smallest positive subnormal: the absolute error floor of one rounding near zero.
TINY = {"float16": 2.0**-24, "bfloat16": 2.0**-133, "float32": 2.0**-149, "float64": 0.0}


def direct_attention(q, k, v, visible, scale, softcap=None):
    """Softmax attention written out for one (query, head) at a time in float64.

    Returns out (B, Sq, Hq, D) and lse (B, Hq, Sq); an empty row gives 0 and -inf.
    """
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    b, sq, hq, d = q.shape
    group = hq // k.shape[2]
    out = np.zeros((b, sq, hq, d))
    lse = np.full((b, hq, sq), -np.inf)
    for bi in range(b):
        for h in range(hq):
            kh, vh = k[bi, :, h // group], v[bi, :, h // group]
            for i in range(sq):
                s = scale * (kh @ q[bi, i, h])
                if softcap is not None:
                    s = softcap * np.tanh(s / softcap)
                cols = np.flatnonzero(visible[i])
                if cols.size == 0:
                    continue
                m = s[cols].max()
                w = np.exp(s[cols] - m)
                out[bi, i, h] = w @ vh[cols] / w.sum()
                lse[bi, h, i] = m + np.log(w.sum())
    return out, lse


def make_inputs(b, sq, sk, hq, hkv, d, dtype, seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, sq, hq, d)).astype(dtype)
    k = rng.standard_normal((b, sk, hkv, d)).astype(dtype)
    v = (rng.standard_normal((b, sk, hkv, d)) * 3 + 0.5).astype(dtype)
    return q, k, v


def assert_rounded_once(out, exact, dtype):
    """|out - exact| <= u |exact| + tiny elementwise: one rounding of the exact answer."""
    out64 = out.astype(np.float64)
    # (1 + 1e-9): the float64 references themselves differ in the last bits.
    bound = UNIT[dtype.name] * (1 + 1e-9) * np.abs(exact) + TINY[dtype.name]
    err = np.abs(out64 - exact)
    # float64 output: the reference and the direct formula differ by summation order only.
    if dtype.name == "float64":
        bound = 1e-13 * np.maximum(np.abs(exact), 1)
    assert np.all(err <= bound), f"worst excess {np.max(err - bound):.3e}"


class EvenKeysAfterFirstRow(Mask):
    """Row 0 (aligned position < 1 + offset) sees nothing; other rows see keys with even index."""

    def _visible(self, qpos, kpos, seqlen_k):
        offset = qpos - qpos.min() if qpos.size else qpos
        return (offset >= 1) & (kpos % 2 == 0)

    def __repr__(self):
        return "even_keys_after_first_row()"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("return_lse", [False, True])
def test_dtypes_shapes_and_values(dtype, return_lse):
    q, k, v = make_inputs(2, 7, 13, 6, 2, 17, dtype, seed=11)
    result = numba_flash.attention(q, k, v, causal=True, return_lse=return_lse)
    visible = visible_matrix(7, 13, causal=True)
    exact_out, exact_lse = direct_attention(q, k, v, visible, 1 / np.sqrt(17))
    if return_lse:
        out, lse = result
        assert lse.dtype == (np.float64 if dtype == np.float64 else np.float32)
        assert lse.shape == (2, 6, 7)
        np.testing.assert_allclose(lse, exact_lse, rtol=2**-23, atol=0)
    else:
        out = result
        assert isinstance(out, np.ndarray)
    assert out.dtype == dtype and out.shape == (2, 7, 6, 17)
    assert_rounded_once(out, exact_out, dtype)


def test_bfloat16_output_is_rounded_once_not_twice():
    # 1 + 2**-8 + 2**-30 lies just above the midpoint of two bfloat16 neighbours; going through
    # float32 first would land on the midpoint and round down to 1.
    x = np.array([1 + 2.0**-8 + 2.0**-30, -(1 + 2.0**-8 + 2.0**-30), 1 + 2.0**-8,
                  1 + 3 * 2.0**-8, 0.0, 3.0e-39])
    got = round_to(x, BF16)
    np.testing.assert_array_equal(got, [1 + 2.0**-7, -(1 + 2.0**-7), 1.0, 1 + 2.0**-6, 0.0,
                                        x[5].astype(BF16).astype(np.float64)])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-1e4, 1e4, allow_nan=False), min_size=1, max_size=40))
def test_bfloat16_rounding_picks_the_nearest_neighbour(values):
    x = np.array(values)
    got = round_to(x, BF16)
    bits = got.astype(BF16).view(np.uint16).astype(np.int32)
    for delta in (-1, 1):  # neighbours one bfloat16 ulp away (bits of 0 - 1 are a NaN: skipped)
        other = (bits + delta).astype(np.uint16).view(BF16).astype(np.float64)
        real = np.isfinite(other)
        assert np.all(np.abs(got - x)[real] <= np.abs(other - x)[real])


def test_gqa_matches_repeated_kv_heads():
    q, k, v = make_inputs(1, 9, 9, 8, 2, 5, np.float64, seed=3)
    out = numba_flash.attention(q, k, v)
    k_rep, v_rep = np.repeat(k, 4, axis=2), np.repeat(v, 4, axis=2)
    np.testing.assert_allclose(out, numba_flash.attention(q, k_rep, v_rep), rtol=1e-13, atol=1e-14)
    exact, _ = direct_attention(q, k, v, np.ones((9, 9), bool), 1 / np.sqrt(5))
    np.testing.assert_allclose(out, exact, rtol=1e-12, atol=1e-13)


def test_options_pass_through():
    q, k, v = make_inputs(2, 5, 12, 3, 3, 7, np.float32, seed=5)
    out, lse = numba_flash.attention(q, k, v, softmax_scale=0.7, window_size=(3, 1), sinks=2,
                                     softcap=1.5, return_lse=True)
    visible = visible_matrix(5, 12, window_size=(3, 1), sinks=2)
    exact_out, exact_lse = direct_attention(q, k, v, visible, 0.7, softcap=1.5)
    assert_rounded_once(out, exact_out, out.dtype)
    np.testing.assert_allclose(lse, exact_lse, rtol=2**-23)


def test_mask_objects_pass_through_and_empty_rows():
    q, k, v = make_inputs(1, 6, 11, 2, 1, 4, np.float32, seed=8)
    mask = EvenKeysAfterFirstRow() & SlidingWindowMask(4, 4)
    out, lse = numba_flash.attention(q, k, v, mask=mask, return_lse=True)
    visible = mask.to_dense(6, 11)
    assert not visible[0].any() and visible[1:].any(axis=1).all()
    exact_out, exact_lse = direct_attention(q, k, v, visible, 0.5)
    assert np.all(out[0, 0] == 0) and np.all(np.isneginf(lse[0, :, 0]))
    assert_rounded_once(out, exact_out, out.dtype)
    np.testing.assert_allclose(lse[..., 1:], exact_lse[..., 1:], rtol=2**-23)


def test_library_masks_pass_through():
    masks = pytest.importorskip("numba_flash.masks")
    q, k, v = make_inputs(2, 13, 13, 4, 2, 8, np.float16, seed=9)
    mask = masks.causal_document([5, 1, 7])
    out = numba_flash.attention(q, k, v, mask=mask)
    exact, _ = direct_attention(q, k, v, mask.to_dense(13, 13), 1 / np.sqrt(8))
    assert_rounded_once(out, exact, out.dtype)
    # A token may only see its own document: changing another document's values changes nothing.
    v2 = v.copy()
    v2[:, :5] += np.float16(1.0)
    out2 = numba_flash.attention(q, k, v2, mask=mask)
    np.testing.assert_array_equal(out2[:, 5:], out[:, 5:])
    assert not np.array_equal(out2[:, :5], out[:, :5])


def test_strided_views_need_no_copy():
    rng = np.random.default_rng(4)
    bhsd = rng.standard_normal((2, 3, 10, 6)).astype(np.float32)  # (B, H, S, D) storage
    q = bhsd.transpose(0, 2, 1, 3)  # (B, S, H, D) view
    kv = rng.standard_normal((2, 10, 3, 12)).astype(np.float32)[..., ::2]  # non-contiguous D
    out = numba_flash.attention(q, kv, kv, causal=True)
    expected = numba_flash.attention(*(np.ascontiguousarray(x) for x in (q, kv, kv)), causal=True)
    np.testing.assert_array_equal(out, expected)
    assert out.flags.c_contiguous


@settings(max_examples=25, deadline=None)
@given(b=st.integers(1, 2), sq=st.integers(1, 9), sk=st.integers(1, 9), hkv=st.integers(1, 2),
       group=st.integers(1, 3), d=st.integers(1, 9), causal=st.booleans(),
       left=st.integers(-1, 4), right=st.integers(-1, 4), seed=st.integers(0, 2**16),
       dtype=st.sampled_from(DTYPES))
def test_random_problems_match_the_direct_formula(b, sq, sk, hkv, group, d, causal, left, right,
                                                  seed, dtype):
    q, k, v = make_inputs(b, sq, sk, hkv * group, hkv, d, dtype, seed)
    out, lse = numba_flash.attention(q, k, v, causal=causal, window_size=(left, right),
                                     return_lse=True)
    visible = visible_matrix(sq, sk, causal=causal, window_size=(left, right))
    exact_out, exact_lse = direct_attention(q, k, v, visible, 1 / np.sqrt(d))
    assert out.dtype == dtype
    assert lse.dtype == (np.float64 if dtype == np.float64 else np.float32)
    assert_rounded_once(out, exact_out, dtype)
    assert np.array_equal(np.isneginf(lse), np.isneginf(exact_lse))
    finite = np.isfinite(exact_lse)
    np.testing.assert_allclose(lse[finite], exact_lse[finite], rtol=2**-23, atol=1e-6)
