"""Merging partial states: algebra (associative, commutative, -inf identity), split-KV equals full
attention for every mask, emulated merge precision, and validation."""
import warnings

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import numba_flash_reference as R
from numba_flash_reference.merge import split_boundaries
from mask_examples import example_masks


def random_state(rng, shape=(2, 5, 3, 4), spread=3.0):
    """A random normalised output (B, S, H, D) and lse (B, H, S)."""
    b, s, h, d = shape
    return rng.standard_normal(shape), rng.standard_normal((b, h, s)) * spread


def close(x, y, atol=1e-13):
    np.testing.assert_allclose(x, y, rtol=0, atol=atol)


def test_merge_formula_on_numbers():
    o_a, o_b = np.array([[[[1.0, 2.0]]]]), np.array([[[[3.0, -1.0]]]])
    lse_a, lse_b = np.array([[[np.log(1.0)]]]), np.array([[[np.log(3.0)]]])
    o, lse = R.merge_states(o_a, lse_a, o_b, lse_b)
    close(lse, [[[np.log(4.0)]]])
    close(o, [[[[0.25 * 1 + 0.75 * 3, 0.25 * 2 - 0.75]]]])


def test_commutative_and_associative():
    rng = np.random.default_rng(0)
    a, b, c = (random_state(rng) for _ in range(3))
    ab = R.merge_states(*a, *b)
    ba = R.merge_states(*b, *a)
    close(ab[0], ba[0])
    close(ab[1], ba[1])
    left = R.merge_states(*ab, *c)
    right = R.merge_states(*a, *R.merge_states(*b, *c))
    close(left[0], right[0])
    close(left[1], right[1])


def test_neg_inf_is_the_identity_without_nan():
    rng = np.random.default_rng(1)
    o, lse = random_state(rng)
    garbage = np.full_like(o, np.nan)  # an empty state's o must not matter
    empty_lse = np.full_like(lse, -np.inf)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        merged = R.merge_states(o, lse, garbage, empty_lse)
        np.testing.assert_array_equal(merged[0], o)
        np.testing.assert_array_equal(merged[1], lse)
        merged = R.merge_states(garbage, empty_lse, o, lse)
        np.testing.assert_array_equal(merged[0], o)
        both = R.merge_states(garbage, empty_lse, np.zeros_like(o), empty_lse)
    assert np.all(both[0] == 0) and np.all(np.isneginf(both[1]))
    # Partly empty rows: only those rows take the other state.
    part = lse.copy()
    part[:, :, 2] = -np.inf
    o2, lse2 = random_state(rng)
    merged = R.merge_states(o, part, o2, lse2)
    close(merged[0][:, 2], o2[:, 2], 0)
    close(merged[1][:, :, 2], lse2[:, :, 2], 0)


def test_huge_lse_values_do_not_overflow():
    rng = np.random.default_rng(2)
    (o_a, lse_a), (o_b, lse_b) = random_state(rng), random_state(rng)
    lse_a, lse_b = lse_a + 1e4, lse_b + 1e4
    o, lse = R.merge_states(o_a, lse_a, o_b, lse_b)
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(lse))
    w_a = 1 / (1 + np.exp(lse_b - lse_a))
    # lse near 1e4 carries an absolute rounding error near 1e4 * 2**-53 ~ 1e-12 into the weights.
    close(o, np.swapaxes(w_a, -1, -2)[..., None] * o_a + np.swapaxes(1 - w_a, -1, -2)[..., None] * o_b,
          1e-10)
    for order in ("sequential", "tree", "flat"):
        o32, lse32 = R.merge_many([o_a, o_b], [lse_a, lse_b], order=order, dtype="float32")
        assert np.all(np.isfinite(o32)) and np.abs(o32 - o).max() < 1e-3


@pytest.mark.parametrize("sq,sk", [(9, 9), (4, 15), (13, 6)])
def test_split_and_merge_equals_attention_for_every_mask(sq, sk):
    rng = np.random.default_rng([sq, sk])
    q = rng.standard_normal((2, sq, 4, 3))
    k, v = rng.standard_normal((2, 2, sk, 2, 3))
    bounds = sorted(rng.integers(0, sk + 1, size=3).tolist())
    splits = [0] + bounds[:1] + bounds[:1] + bounds[1:] + [sk]  # includes an empty split
    for name, mask in example_masks(sq, sk):
        ref, ref_lse = R.attention(q, k, v, mask=mask, return_lse=True)
        outs, lses = R.split_attention(q, k, v, splits, mask=mask)
        assert len(outs) == len(splits) - 1
        assert np.all(np.isneginf(lses[1])) and np.all(outs[1] == 0)
        for order in ("sequential", "tree", "flat"):
            out, lse = R.merge_many(outs, lses, order=order)
            close(out, ref, 1e-12)
            assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse)), name
            finite = np.isfinite(ref_lse)
            close(lse[finite], ref_lse[finite], 1e-12)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 12), st.integers(1, 12), st.integers(1, 5), st.booleans(),
       st.integers(0, 2 ** 16))
def test_split_merge_property(sq, sk, n_splits, causal, seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, sq, 2, 4)) * 2
    k, v = rng.standard_normal((2, 1, sk, 1, 4)) * 2
    outs, lses = R.split_attention(q, k, v, n_splits, causal=causal, softcap=3.0)
    ref, ref_lse = R.attention(q, k, v, causal=causal, softcap=3.0, return_lse=True)
    order = rng.permutation(n_splits)  # any merge order: commutativity
    o, lse = outs[order[0]], lses[order[0]]
    for i in order[1:]:
        o, lse = R.merge_states(o, lse, outs[i], lses[i])
    close(o, ref, 1e-12)
    finite = np.isfinite(ref_lse)
    close(lse[finite], ref_lse[finite], 1e-12)
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))


def test_merge_many_precision_is_emulated():
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 8, 2, 16))
    k, v = rng.standard_normal((2, 1, 512, 2, 16))
    ref = R.attention(q, k, v)
    outs, lses = R.split_attention(q, k, v, 64)
    err = {}
    for dtype in ("float64", "float32", "float16", "bfloat16"):
        for order in ("sequential", "tree", "flat"):
            out, lse = R.merge_many(outs, lses, order=order, dtype=dtype)
            np.testing.assert_array_equal(out, R.round_to(out, dtype))
            err[dtype, order] = np.abs(out - ref).max()
    for order in ("sequential", "tree", "flat"):
        assert err["float64", order] < 1e-14
        assert 1e-9 < err["float32", order] < 1e-5
        assert 1e-5 < err["float16", order] < 2e-2
        assert err["float16", order] < err["bfloat16", order] < 1e-1
    # 63 sequential float16 merges accumulate more rounding than a depth-6 tree.
    assert err["float16", "tree"] < err["float16", "sequential"]


def test_merge_many_single_state_and_agreement_with_merge_states():
    rng = np.random.default_rng(4)
    states = [random_state(rng) for _ in range(5)]
    outs, lses = [s[0] for s in states], [s[1] for s in states]
    o, lse = R.merge_many(outs[:1], lses[:1])
    np.testing.assert_array_equal(o, outs[0])
    o, lse = R.merge_many(outs[:1], lses[:1], dtype="float16")  # inputs are stored in float16
    np.testing.assert_array_equal(o, R.round_to(outs[0], "float16"))
    np.testing.assert_array_equal(lse, R.round_to(lses[0], "float16"))
    folded = states[0]
    for s in states[1:]:
        folded = R.merge_states(*folded, *s)
    for order in ("sequential", "tree", "flat"):
        o, lse = R.merge_many(outs, lses, order=order)
        close(o, folded[0])
        close(lse, folded[1])


def test_split_boundaries():
    assert split_boundaries(10, 3) == [0, 3, 6, 10]
    assert split_boundaries(2, 4) == [0, 0, 1, 1, 2]
    assert split_boundaries(5, [0, 2, 2, 5]) == [0, 2, 2, 5]


@pytest.mark.parametrize("call,error,match", [
    (lambda o, l: R.merge_states(o, l, o[:, :4], l), ValueError, "lse_b must have shape"),
    (lambda o, l: R.merge_states(o, l[:, :, :4], o, l), ValueError, r"lse_a must have shape \(\.\.\., heads, seqlen\)"),
    (lambda o, l: R.merge_states(o[0, 0], l, o, l), ValueError, "o_a must have shape"),
    (lambda o, l: R.merge_states(o, l, o[:1], l[:1]), ValueError, "o_a and o_b must have the same shape"),
    (lambda o, l: R.merge_many([o, o], [l]), ValueError, "as many outs as lses"),
    (lambda o, l: R.merge_many([], []), ValueError, "at least one"),
    (lambda o, l: R.merge_many([o, o[:1]], [l, l[:1]]), ValueError, r"outs\[1\] has shape"),
    (lambda o, l: R.merge_many([o], [l], order="pairwise"), ValueError, "order must be"),
    (lambda o, l: R.merge_many([o], [l], dtype="int8"), ValueError, "dtype must be one of"),
    (lambda o, l: split_boundaries(5, 0), ValueError, "splits must be >= 1"),
    (lambda o, l: split_boundaries(5, [0, 3, 2, 5]), ValueError, "non-decreasing boundaries"),
    (lambda o, l: split_boundaries(5, [0, 3]), ValueError, "from 0 to seqlen_k=5"),
    (lambda o, l: split_boundaries(5, "ab"), TypeError, "splits must be a count or a sequence"),
])
def test_merge_errors(call, error, match):
    o, lse = random_state(np.random.default_rng(5))
    with pytest.raises(error, match=match):
        call(o, lse)
