"""Mask meanings: every reference mask against a direct, loop-based reading of its formula, the
seed-001 draft tree, the public constructors, bitmask packing, and parameter validation."""
import doctest

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import numba_flash.masks as nfm
from numba_flash_reference import masks as M
from mask_examples import example_masks, random_preorder_parents


# ----------------------------------------------------------------------------- brute force

def _segment(pos, lengths):
    """Index of the segment of ``lengths`` (packed from 0) holding pos, or None."""
    start = 0
    for idx, length in enumerate(lengths):
        if start <= pos < start + length:
            return idx
        start += length
    return None


def _brute_visible(mask, i, j, seqlen_q, seqlen_k):
    """Whether aligned query position i sees key j, straight from the mask's definition."""
    if isinstance(mask, M.IntersectionMask):
        return all(_brute_visible(p, i, j, seqlen_q, seqlen_k) for p in mask.parts)
    if isinstance(mask, M.CausalMask):
        return j <= i
    if isinstance(mask, M.SlidingWindowMask):
        ok = (mask.left < 0 or i - mask.left <= j) and (mask.right < 0 or j <= i + mask.right)
        return ok or (j < mask.sinks and j <= i)
    if isinstance(mask, M.CausalDocumentMask):
        return j <= i and _segment(i, mask.doc_lengths) == _segment(j, mask.doc_lengths)
    if isinstance(mask, M.DocumentMask):
        d = _segment(i, mask.doc_lengths)
        return d is not None and d == _segment(j, mask.doc_lengths)
    if isinstance(mask, M.SharedQuestionMask):
        d = _segment(j, mask.doc_lengths)
        if j > i or d != _segment(i, mask.doc_lengths):
            return False
        start = sum(mask.doc_lengths[:d])
        q_end = start + mask.question_lengths[d]
        if j < q_end:
            return True
        answers = mask.answer_lengths[d]
        return _segment(i - q_end, answers) == _segment(j - q_end, answers)
    if isinstance(mask, M.GlobalSlidingWindowMask):
        g = mask.num_global
        return i < g or j < g or abs(i - j) < mask.window
    if isinstance(mask, M.CausalBlockwiseMask):
        test_start = sum(mask.block_lengths)
        same = (_segment(i, mask.block_lengths) is not None
                and _segment(i, mask.block_lengths) == _segment(j, mask.block_lengths))
        return j <= i and (same or i >= test_start or (j >= test_start and i >= test_start))
    if isinstance(mask, M.PrefixLMCausalMask):
        return j < mask.prefix_length or j <= i
    if isinstance(mask, M.PrefixLMDocumentMask):
        d = _segment(j, mask.doc_lengths)
        if d is None or d != _segment(i, mask.doc_lengths):
            return False
        return j < sum(mask.doc_lengths[:d]) + mask.prefix_lengths[d] or j <= i
    if isinstance(mask, M.QKSparseMask):
        start, end = mask.dropped_rows
        return j <= i and j not in set(mask.dropped_keys.tolist()) and not start <= i < end
    if isinstance(mask, M.RandomEvictionMask):
        return j <= i < mask.evict_rows[j]
    if isinstance(mask, M.TreeMask):
        p = mask.prefix_length
        if j < p:
            return j <= i
        node = i - p if 0 <= i - p < len(mask.parents) else None
        while node is not None and node >= 0:
            if node == j - p:
                return True
            node = mask.parents[node]
        return False
    if isinstance(mask, M.DenseMask):
        return bool(mask.matrix()[i - (seqlen_k - seqlen_q), j])
    if isinstance(mask, M.ColumnIntervalMask):
        iv, r = mask.intervals, i - (seqlen_k - seqlen_q)
        return not (iv.lts[j] <= r < iv.lte[j] or iv.uts[j] <= r < iv.ute[j])
    raise AssertionError(f"no brute force for {mask!r}")


def _brute_dense(mask, seqlen_q, seqlen_k):
    off = seqlen_k - seqlen_q
    return np.array([[_brute_visible(mask, r + off, j, seqlen_q, seqlen_k)
                      for j in range(seqlen_k)] for r in range(seqlen_q)],
                    dtype=bool).reshape(seqlen_q, seqlen_k)


@settings(max_examples=50, deadline=None)
@given(seqlen_q=st.integers(1, 19), seqlen_k=st.integers(1, 19), seed=st.integers(0, 2**16))
def test_every_mask_matches_its_formula(seqlen_q, seqlen_k, seed):
    for name, mask in example_masks(seqlen_q, seqlen_k, seed):
        dense = mask.to_dense(seqlen_q, seqlen_k)
        assert dense.shape == (seqlen_q, seqlen_k) and dense.dtype == bool
        np.testing.assert_array_equal(dense, _brute_dense(mask, seqlen_q, seqlen_k), err_msg=name)


def test_examples_are_not_trivial():
    """At a moderate size every kind, for some of a few seeds, masks some pair and shows some."""
    nontrivial = {}
    for seed in range(4):
        for name, mask in example_masks(23, 31, seed):
            dense = mask.to_dense(23, 31)
            nontrivial[name] = nontrivial.get(name, False) or 0 < dense.sum() < dense.size
    assert len(nontrivial) == 16 and all(nontrivial.values()), nontrivial


# ----------------------------------------------------------------------------- literal cases

SEED_001_TREE = """
A  [ 1  0  0  0  0  0  0  0  0 ]
B  [ 1  1  0  0  0  0  0  0  0 ]
C  [ 1  1  1  0  0  0  0  0  0 ]
D  [ 1  1  0  1  0  0  0  0  0 ]
E  [ 1  1  1  0  1  0  0  0  0 ]
F  [ 1  1  1  0  0  1  0  0  0 ]
G  [ 1  1  0  1  0  0  1  0  0 ]
H  [ 1  1  0  1  0  0  0  1  0 ]
I  [ 1  1  1  0  1  0  0  0  1 ]
"""


def test_seed_001_draft_tree_table():
    expected = np.array([[int(c) for c in line.split("[")[1].split("]")[0].split()]
                         for line in SEED_001_TREE.strip().splitlines()], dtype=bool)
    mask = nfm.tree([-1, 0, 1, 1, 2, 2, 3, 3, 4])
    np.testing.assert_array_equal(mask.to_dense(9, 9), expected)
    assert mask.to_dense(9, 9).sum() == 30   # 1 + 2 + 3 + 3 + 4 + 4 + 4 + 4 + 5
    assert not mask.is_preorder


def test_tree_with_prefix_and_decode_rows():
    mask = nfm.tree([-1, 0, 0], prefix_length=2)
    expected = np.array([[1, 0, 0, 0, 0],
                         [1, 1, 0, 0, 0],
                         [1, 1, 1, 0, 0],
                         [1, 1, 1, 1, 0],
                         [1, 1, 1, 0, 1]], dtype=bool)
    np.testing.assert_array_equal(mask.to_dense(5, 5), expected)
    # Verification step of a KV cache: only the tree rows are queries.
    np.testing.assert_array_equal(mask.to_dense(3, 5), expected[2:])


def test_known_small_masks():
    cases = [
        (nfm.causal_document([2, 3]), 5, 5,
         ["10000", "11000", "00100", "00110", "00111"]),
        (nfm.document([2, 0, 3]), 5, 5,
         ["11000", "11000", "00111", "00111", "00111"]),
        (nfm.shared_question([5], [2], [[2, 1]]), 5, 5,
         ["10000", "11000", "11100", "11110", "11001"]),
        (nfm.global_sliding_window(1, 2), 5, 5,
         ["11111", "11100", "11110", "10111", "10011"]),
        (nfm.causal_blockwise([2, 1], 2), 5, 5,
         ["10000", "11000", "00100", "11110", "11111"]),
        (nfm.prefix_lm_causal(2), 4, 4, ["1100", "1100", "1110", "1111"]),
        (nfm.prefix_lm_document([3, 2], [2, 1]), 5, 5,
         ["11000", "11000", "11100", "00010", "00011"]),
        (nfm.qk_sparse([2], (3, 4)), 5, 5,
         ["10000", "11000", "11000", "00000", "11011"]),
        (nfm.random_eviction([2, 5, 3, 5, 5]), 5, 5,
         ["10000", "11000", "01100", "01010", "01011"]),
        (nfm.sliding_window(1, 1), 4, 4, ["1100", "1110", "0111", "0011"]),
        (M.SlidingWindowMask(1, 0, sinks=1), 4, 4, ["1000", "1100", "1110", "1011"]),
        # seqlen_q != seqlen_k: bottom-right aligned rows.
        (nfm.causal_document([2, 3]), 2, 5, ["00110", "00111"]),
        (nfm.document([2, 1]), 4, 3, ["000", "110", "110", "001"]),
        (nfm.causal(), 3, 2, ["00", "10", "11"]),
    ]
    for mask, sq, sk, rows in cases:
        expected = np.array([[c == "1" for c in row] for row in rows], dtype=bool)
        np.testing.assert_array_equal(mask.to_dense(sq, sk), expected, err_msg=repr(mask))


def test_intersection_and_flags():
    docs = nfm.causal_document([3, 4])
    window = nfm.sliding_window(1, 0)
    both = window & docs
    np.testing.assert_array_equal(both.to_dense(7, 7),
                                  window.to_dense(7, 7) & docs.to_dense(7, 7))
    assert repr(both) == "sliding_window(1, 0) & causal_document([3, 4])"
    assert len((both & nfm.causal()).parts) == 3
    flagged = M.visible_matrix(7, 7, causal=True, mask=nfm.document([3, 4]))
    np.testing.assert_array_equal(flagged, docs.to_dense(7, 7))
    with pytest.raises(TypeError):
        _ = docs & np.ones((7, 7), dtype=bool)


def test_public_constructors_use_the_reference_classes():
    assert isinstance(nfm.causal(), M.CausalMask)
    assert isinstance(nfm.tree([-1]), M.TreeMask)
    assert isinstance(nfm.from_dense(np.ones((2, 3), dtype=bool)), M.DenseMask)
    failures, tried = doctest.testmod(nfm, verbose=False)
    assert tried >= 14 and failures == 0


# ----------------------------------------------------------------------------- bitmask

def test_bitmask_layout_and_round_trip():
    rng = np.random.default_rng(3)
    visible = rng.random((5, 37)) < 0.5
    bits = M.pack_bitmask(visible)
    assert bits.dtype == np.uint8 and bits.shape == (5, 8)   # 37 columns -> 2 words
    np.testing.assert_array_equal(M.unpack_bitmask(bits, 37), visible)
    one = np.zeros((2, 40), dtype=bool)
    one[1, 33] = True
    words = M.pack_bitmask(one).view("<u4")
    assert words.shape == (2, 2)
    assert words[1, 1] == 1 << 1 and words[0].sum() == 0 and words[1, 0] == 0
    mask = nfm.from_dense(visible)
    np.testing.assert_array_equal(mask.to_bitmask(5, 37), bits)
    np.testing.assert_array_equal(mask.to_dense(5, 37), visible)
    np.testing.assert_array_equal(nfm.causal().to_bitmask(5, 37),
                                  M.pack_bitmask(nfm.causal().to_dense(5, 37)))
    assert M.pack_bitmask(np.zeros((3, 0), dtype=bool)).shape == (3, 0)
    with pytest.raises(TypeError, match="visible must be a 2-D bool array"):
        M.pack_bitmask(np.ones((2, 2), dtype=np.uint8))
    with pytest.raises(TypeError, match="bits must be a 2-D uint8 array"):
        M.unpack_bitmask(bits.astype(np.int16), 37)
    with pytest.raises(ValueError, match="fewer than seqlen_k"):
        M.unpack_bitmask(bits, 65)


def test_shared_question_accepts_an_answer_array():
    mask = nfm.shared_question([4, 4], [2, 2], np.array([[1, 1], [1, 1]]))
    assert mask.answer_lengths == [[1, 1], [1, 1]]
    np.testing.assert_array_equal(mask.to_dense(8, 8)[:4, :4],
                                  nfm.shared_question([4], [2], [[1, 1]]).to_dense(4, 4))


# ----------------------------------------------------------------------------- validation

BAD_CONSTRUCTORS = [
    (lambda: nfm.sliding_window(-2, 0), ValueError, "window_size"),
    (lambda: nfm.sliding_window(1.5, 0), TypeError, "left"),
    (lambda: nfm.causal_document([3, -1]), ValueError, r"doc_lengths\[1\] = -1"),
    (lambda: nfm.causal_document([3.0, 2.0]), TypeError, "doc_lengths must hold integers"),
    (lambda: nfm.causal_document("abc"), TypeError, "doc_lengths"),
    (lambda: nfm.causal_document([[1, 2], [3, 4]]), ValueError, "doc_lengths must be 1-D"),
    (lambda: nfm.causal_document(5), TypeError, "doc_lengths must be a sequence"),
    (lambda: nfm.document([True, False]), TypeError, "doc_lengths"),
    (lambda: nfm.shared_question([4], [1, 2], [[3]]), ValueError, "one entry per document"),
    (lambda: nfm.shared_question([4], [1], [[2]]), ValueError,
     r"doc_lengths\[0\] = 4 but question_lengths\[0\] \+ sum\(answer_lengths\[0\]\) = 3"),
    (lambda: nfm.shared_question([4], [1], [[4, -1]]), ValueError, r"answer_lengths\[0\]"),
    (lambda: nfm.shared_question([4], [1], 3), TypeError, "answer_lengths"),
    (lambda: nfm.shared_question([4, 4], [1, 2], [3, 2]), TypeError,
     r"answer_lengths\[0\] must be a sequence"),
    (lambda: nfm.causal_document([[1], [2, 3]]), TypeError, "flat sequence"),
    (lambda: nfm.global_sliding_window(-1, 2), ValueError, "num_global"),
    (lambda: nfm.global_sliding_window(1, "2"), TypeError, "window"),
    (lambda: nfm.causal_blockwise([2, -2], 1), ValueError, "block_lengths"),
    (lambda: nfm.causal_blockwise([2], -1), ValueError, "test_length"),
    (lambda: nfm.prefix_lm_causal(-3), ValueError, "prefix_length"),
    (lambda: nfm.prefix_lm_causal(None), TypeError, "prefix_length"),
    (lambda: nfm.prefix_lm_document([3, 2], [1]), ValueError, "one entry per document"),
    (lambda: nfm.prefix_lm_document([3, 2], [1, 3]), ValueError,
     r"prefix_lengths\[1\] = 3 exceeds doc_lengths\[1\] = 2"),
    (lambda: nfm.qk_sparse([-1]), ValueError, "dropped_keys"),
    (lambda: nfm.qk_sparse([1], (3, 2)), ValueError, "start <= end"),
    (lambda: nfm.qk_sparse([1], 3), TypeError, "dropped_rows must be a pair"),
    (lambda: nfm.qk_sparse([1], (-1, 2)), ValueError, "dropped_rows start"),
    (lambda: nfm.random_eviction([1, -1]), ValueError, "evict_rows"),
    (lambda: nfm.random_eviction([1.5]), TypeError, "evict_rows"),
    (lambda: nfm.tree([]), ValueError, "at least one node"),
    (lambda: nfm.tree([0, 0]), ValueError, r"parents\[0\] must be -1"),
    (lambda: nfm.tree([-1, 0, 2]), ValueError, r"parents\[2\] = 2"),
    (lambda: nfm.tree([-1, -1]), ValueError, r"parents\[1\] = -1"),
    (lambda: nfm.tree([-1, -2]), ValueError, "parents"),
    (lambda: nfm.tree([-1], prefix_length=-1), ValueError, "prefix_length"),
    (lambda: nfm.from_dense(np.ones((3, 3), dtype=np.int32)), TypeError, "bool"),
    (lambda: nfm.from_dense(np.ones(3, dtype=bool)), ValueError, "2-D"),
    (lambda: nfm.column_intervals([0], [1], [0], [0], seqlen_q=0), ValueError, "lte"),
    (lambda: nfm.column_intervals([2], [1], [0], [0]), ValueError, "lts"),
    (lambda: nfm.column_intervals([0, 0], [1], [0], [0]), ValueError, "one length"),
    (lambda: nfm.column_intervals([0.5], [1], [0], [0]), TypeError, "lts"),
    (lambda: nfm.column_intervals([0], [1], [0], [0], seqlen_q=-2), ValueError, "seqlen_q"),
]


@pytest.mark.parametrize("make, exc, pattern", BAD_CONSTRUCTORS)
def test_bad_parameters_raise(make, exc, pattern):
    with pytest.raises(exc, match=pattern):
        make()


BAD_SIZES = [
    (nfm.causal_document([3, 4]), 8, 8, r"doc_lengths must sum to seqlen_k \(8\).*sum to 7"),
    (nfm.document([3, 4]), 7, 6, "sum to 7"),
    (nfm.shared_question([4], [1], [[3]]), 5, 5, "sum to 4"),
    (nfm.causal_blockwise([2, 2], 1), 4, 4, "sum to 5"),
    (nfm.prefix_lm_causal(5), 4, 4, r"prefix_length \(5\) exceeds seqlen_k \(4\)"),
    (nfm.prefix_lm_document([2, 2], [1, 1]), 3, 3, "sum to 4"),
    (nfm.qk_sparse([4]), 4, 4, "dropped_keys must lie in"),
    (nfm.qk_sparse([], (1, 6)), 4, 4, "dropped_rows"),
    (nfm.random_eviction([1, 2, 3]), 4, 4, "one entry per key"),
    (nfm.random_eviction([1, 9, 3]), 3, 3, r"evict_rows\[1\] = 9"),
    (nfm.tree([-1, 0], prefix_length=1), 4, 4,
     r"seqlen_k \(4\) must equal prefix_length \(1\) \+ len\(parents\) \(2\)"),
    (nfm.from_dense(np.ones((2, 3), dtype=bool)), 3, 3, r"built for .* = \(2, 3\)"),
    (nfm.column_intervals([1, 1], [1, 1], [0, 0], [0, 0]), 2, 3, r"built for .* = \(2, 2\)"),
]


@pytest.mark.parametrize("mask, sq, sk, pattern", BAD_SIZES)
def test_parameters_that_do_not_fit_the_lengths_raise(mask, sq, sk, pattern):
    with pytest.raises(ValueError, match=pattern):
        mask.to_dense(sq, sk)
    with pytest.raises(ValueError, match=pattern):
        mask.column_intervals(sq, sk)


@pytest.mark.parametrize("sq, sk, exc", [(-1, 3, ValueError), (3, 2.0, TypeError),
                                         (True, 3, TypeError)])
def test_bad_seqlens_raise(sq, sk, exc):
    with pytest.raises(exc, match="seqlen"):
        nfm.causal().to_dense(sq, sk)
    with pytest.raises(exc, match="seqlen"):
        nfm.causal().column_intervals(sq, sk)


def test_random_preorder_helper_gives_preorder_trees():
    rng = np.random.default_rng(5)
    for n in (1, 2, 7, 30):
        assert M.TreeMask(random_preorder_parents(rng, n)).is_preorder
