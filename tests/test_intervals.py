"""Column intervals: analytic forms against dense masks, canonical form, from_dense round trips,
non-representable masks, intersections, and O(N) construction at long lengths."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import numba_flash.masks as nfm
from numba_flash_reference import masks as M
from numba_flash_reference.intervals import (ColumnIntervals, NotRepresentableError,
                                             intervals_from_dense, intervals_from_runs)
from mask_examples import NO_INTERVALS, example_masks

SEED_TREE = [-1, 0, 1, 1, 2, 2, 3, 3, 4]          # seed 001, nodes A..I in BFS order


@settings(max_examples=50, deadline=None)
@given(seqlen_q=st.integers(0, 23), seqlen_k=st.integers(0, 23), seed=st.integers(0, 2**16))
def test_intervals_decode_to_the_dense_mask(seqlen_q, seqlen_k, seed):
    for name, mask in example_masks(seqlen_q, seqlen_k, seed):
        dense = mask.to_dense(seqlen_q, seqlen_k)
        try:
            iv = mask.column_intervals(seqlen_q, seqlen_k)
        except NotRepresentableError:
            assert name in NO_INTERVALS, name
            with pytest.raises(NotRepresentableError):
                intervals_from_dense(dense)
            continue
        assert (iv.seqlen_q, iv.seqlen_k) == (seqlen_q, seqlen_k)
        assert all(v.dtype == np.int32 and v.shape == (seqlen_k,)
                   for v in (iv.lts, iv.lte, iv.uts, iv.ute))
        np.testing.assert_array_equal(iv.to_dense(), dense, err_msg=name)
        # The analytic form is the canonical one.
        assert iv == intervals_from_dense(dense), name


@settings(max_examples=40, deadline=None)
@given(seqlen_q=st.integers(0, 17), seqlen_k=st.integers(0, 17), seed=st.integers(0, 2**16),
       density=st.floats(0.0, 1.0))
def test_from_dense_round_trips(seqlen_q, seqlen_k, seed, density):
    rng = np.random.default_rng(seed)
    dense = rng.random((seqlen_q, seqlen_k)) < density
    mask = nfm.from_dense(dense)
    np.testing.assert_array_equal(mask.to_dense(seqlen_q, seqlen_k), dense)
    masked = np.diff(np.pad(~dense, ((1, 1), (0, 0))).astype(np.int8), axis=0)
    runs = (masked == 1).sum(axis=0)
    if (runs <= 2).all():
        iv = intervals_from_dense(dense)
        np.testing.assert_array_equal(iv.to_dense(), dense)
        assert mask.column_intervals(seqlen_q, seqlen_k) == iv
        again = nfm.column_intervals(iv.lts, iv.lte, iv.uts, iv.ute, seqlen_q)
        np.testing.assert_array_equal(again.to_dense(seqlen_q, seqlen_k), dense)
    else:
        first = int(np.argmax(runs > 2))
        with pytest.raises(NotRepresentableError, match=f"key column {first} masks "
                                                        f"{runs[first]} separate runs"):
            intervals_from_dense(dense)
        with pytest.raises(NotRepresentableError, match="bitmask"):
            mask.column_intervals(seqlen_q, seqlen_k)


def test_not_representable_names_column_and_runs():
    dense = np.ones((6, 3), dtype=bool)
    dense[[0, 2, 4], 1] = False
    with pytest.raises(NotRepresentableError,
                       match=r"key column 1 masks 3 separate runs of query rows "
                             r"\(\[0, 1\), \[2, 3\), \[4, 5\)\).*from_dense"):
        intervals_from_dense(dense)
    assert issubclass(NotRepresentableError, ValueError)


def test_seed_tree_in_bfs_order_has_no_intervals():
    mask = nfm.tree(SEED_TREE)
    assert not mask.is_preorder
    with pytest.raises(NotRepresentableError, match="subtree of node 2"):
        mask.column_intervals(9, 9)
    # Not an artefact of the tree code: node C's column masks rows A, B | D | G, H.
    with pytest.raises(NotRepresentableError,
                       match=r"key column 2 masks 3 separate runs.*\[0, 2\), \[3, 4\), \[6, 8\)"):
        intervals_from_dense(mask.to_dense(9, 9))
    # The same tree renumbered in DFS preorder (A B C E I F D G H) has intervals.
    order = [0, 1, 2, 4, 8, 5, 3, 6, 7]
    pre = nfm.tree([-1, 0, 1, 2, 3, 2, 1, 6, 6])
    assert pre.is_preorder
    np.testing.assert_array_equal(pre.to_dense(9, 9),
                                  mask.to_dense(9, 9)[np.ix_(order, order)])
    iv = pre.column_intervals(9, 9)
    np.testing.assert_array_equal(iv.to_dense(), pre.to_dense(9, 9))
    # Column C (node 2) is visible at C, E, I, F = rows 2..5 of the preorder.
    assert (iv.uts[2], iv.ute[2], iv.lts[2], iv.lte[2]) == (0, 2, 6, 9)


def test_tree_not_in_preorder_but_representable_dense():
    mask = nfm.tree([-1, 0, 0, 1])
    with pytest.raises(NotRepresentableError, match="DFS preorder"):
        mask.column_intervals(4, 4)
    iv = nfm.from_dense(mask.to_dense(4, 4)).column_intervals(4, 4)
    np.testing.assert_array_equal(iv.to_dense(), mask.to_dense(4, 4))


def test_literal_intervals():
    iv = nfm.causal_document([2, 3]).column_intervals(5, 5)
    assert iv.uts.tolist() == [0, 0, 0, 0, 0] and iv.ute.tolist() == [0, 1, 2, 3, 4]
    assert iv.lts.tolist() == [2, 2, 5, 5, 5] and iv.lte.tolist() == [5, 5, 5, 5, 5]
    iv = nfm.global_sliding_window(1, 2).column_intervals(5, 5)
    assert iv.uts.tolist() == [0, 0, 0, 1, 1] and iv.ute.tolist() == [0, 0, 0, 2, 3]
    assert iv.lts.tolist() == [5, 3, 4, 5, 5] and iv.lte.tolist() == [5, 5, 5, 5, 5]
    # Decode, 2 queries over 5 keys: rows are positions 3 and 4.
    iv = nfm.causal_document([2, 3]).column_intervals(2, 5)
    assert iv.uts.tolist() == [0, 0, 0, 0, 0] and iv.ute.tolist() == [0, 0, 0, 0, 1]
    assert iv.lts.tolist() == [0, 0, 2, 2, 2] and iv.lte.tolist() == [2, 2, 2, 2, 2]
    assert iv.stacked().shape == (4, 5) and iv.stacked().dtype == np.int32


def test_canonical_single_run_rule():
    # Diagonal row of column j is j (square). Column 3: run [3, 5) starts on the diagonal -> UT;
    # column 2: run [4, 6) starts below it -> LT; column 0: two runs; column 5: none.
    dense = np.ones((6, 6), dtype=bool)
    dense[3:5, 3] = False
    dense[4:6, 2] = False
    dense[0:1, 0] = False
    dense[2:4, 0] = False
    iv = intervals_from_dense(dense)
    assert (iv.uts[3], iv.ute[3], iv.lts[3], iv.lte[3]) == (3, 5, 6, 6)
    assert (iv.uts[2], iv.ute[2], iv.lts[2], iv.lte[2]) == (0, 0, 4, 6)
    assert (iv.uts[0], iv.ute[0], iv.lts[0], iv.lte[0]) == (0, 1, 2, 4)
    assert (iv.uts[5], iv.ute[5], iv.lts[5], iv.lte[5]) == (0, 0, 6, 6)
    # seqlen_q < seqlen_k: column 0's diagonal row is 0 - (5 - 2) = -3, so a run at row 0 is LT.
    dense = np.ones((2, 5), dtype=bool)
    dense[:, 0] = False
    dense[0, 4] = False
    iv = intervals_from_dense(dense)
    assert (iv.uts[0], iv.ute[0], iv.lts[0], iv.lte[0]) == (0, 0, 0, 2)
    assert (iv.uts[4], iv.ute[4], iv.lts[4], iv.lte[4]) == (0, 1, 2, 2)


def test_user_intervals_overlapping_are_canonicalised():
    mask = nfm.column_intervals([1, 0, 4], [3, 0, 4], [2, 0, 0], [4, 2, 0], seqlen_q=4)
    expected = np.array([[1, 0, 1], [0, 0, 1], [0, 1, 1], [0, 1, 1]], dtype=bool)
    np.testing.assert_array_equal(mask.to_dense(4, 3), expected)
    iv = mask.column_intervals(4, 3)
    # Column 0's runs merge into [1, 4); with 4 queries over 3 keys its diagonal row is 1, so
    # the run starts on the diagonal: UT.
    assert (iv.uts.tolist(), iv.ute.tolist()) == ([1, 0, 0], [4, 2, 0])
    assert (iv.lts.tolist(), iv.lte.tolist()) == ([4, 4, 4], [4, 4, 4])


def test_intersection_union_and_its_limit():
    both = nfm.sliding_window(2, 0) & nfm.causal_document([4, 5])
    iv = both.column_intervals(9, 9)
    np.testing.assert_array_equal(iv.to_dense(), both.to_dense(9, 9))
    # Column 1 would mask rows [0, 1), [3, 4) and [7, 8): three runs.
    bad = nfm.random_eviction([7] * 8) & nfm.qk_sparse([], (3, 4))
    np.testing.assert_array_equal(bad.to_dense(8, 8)[:, 1],
                                  [False, True, True, False, True, True, True, False])
    with pytest.raises(NotRepresentableError, match=r"key column 1 masks 3 separate runs "
                                                    r"of query rows \(\[0, 1\), \[3, 4\), "
                                                    r"\[7, 8\)\)"):
        bad.column_intervals(8, 8)
    a, b = (nfm.causal().column_intervals(3, 3), nfm.causal().column_intervals(3, 4))
    with pytest.raises(ValueError, match="cannot combine"):
        a.union(b)
    with pytest.raises(TypeError, match="ColumnIntervals"):
        a.union("causal")


def test_column_intervals_container():
    iv = ColumnIntervals([3, 3], [3, 3], [0, 1], [2, 2], seqlen_q=3)
    assert iv.seqlen_k == 2
    np.testing.assert_array_equal(iv.masked_dense(), [[True, False], [True, True],
                                                      [False, False]])
    np.testing.assert_array_equal(iv.to_dense(), ~iv.masked_dense())
    assert iv == iv.canonical() and iv != ColumnIntervals([3, 3], [3, 3], [0, 0], [2, 2], 3)
    assert "seqlen_q=3" in repr(iv)
    with pytest.raises(ValueError, match=r"column 1 has uts=2, ute=1"):
        ColumnIntervals([3, 3], [3, 3], [0, 2], [2, 1], seqlen_q=3)
    with pytest.raises(ValueError, match=r"lte <= seqlen_q \(3\); column 0"):
        ColumnIntervals([0], [4], [0], [0], seqlen_q=3)
    with pytest.raises(TypeError, match="seqlen_q"):
        ColumnIntervals([0], [0], [0], [0], seqlen_q=3.0)
    with pytest.raises(ValueError, match="lts must be a 1-D"):
        ColumnIntervals([[0]], [0], [0], [0], seqlen_q=3)
    with pytest.raises(TypeError, match="intervals_from_dense|bool"):
        intervals_from_dense(np.ones((2, 2), dtype=np.int8))
    with pytest.raises(ValueError, match="2-D"):
        intervals_from_dense(np.ones(2, dtype=bool))
    with pytest.raises(ValueError, match="2-D of one shape"):
        intervals_from_runs(np.zeros(3), np.zeros(3), 3)


def _column(mask, seqlen_q, seqlen_k, j):
    qpos = np.arange(seqlen_q, dtype=np.int64)[:, None] + (seqlen_k - seqlen_q)
    return np.broadcast_to(mask._visible(qpos, np.array([[j]]), seqlen_k), (seqlen_q, 1))[:, 0]


@pytest.mark.parametrize("seqlen_q", [1 << 17, 777])
def test_intervals_at_long_lengths_are_linear(seqlen_q):
    """At N = 131072 a dense matrix would take 17 GB: these must come from the parameters."""
    n = 1 << 17
    rng = np.random.default_rng(11)
    docs = np.diff(np.concatenate([[0], np.sort(rng.integers(0, n, 40)), [n]]))
    answers = [[int(d) // 4, int(d) // 4] for d in docs]
    questions = [int(d) - 2 * (int(d) // 4) for d in docs]
    masks = [
        nfm.causal(), nfm.sliding_window(1000, 0), M.SlidingWindowMask(500, 3, sinks=4),
        nfm.causal_document(docs), nfm.document(docs),
        nfm.shared_question(docs, questions, answers), nfm.global_sliding_window(64, 512),
        nfm.causal_blockwise(docs[:-1], int(docs[-1])), nfm.prefix_lm_causal(5000),
        nfm.prefix_lm_document(docs, docs // 3),
        nfm.qk_sparse(rng.choice(n, 300, replace=False), (n // 3, n // 2)),
        nfm.random_eviction(np.minimum(np.arange(n) + rng.integers(1, 9000, n), n)),
        nfm.tree([-1] + list(range(300 - 1)), prefix_length=n - 300),
        nfm.sliding_window(4000, 0) & nfm.causal_document(docs),
    ]
    columns = np.concatenate([[0, n - 1], rng.integers(0, n, 3)])
    for mask in masks:
        iv = mask.column_intervals(seqlen_q, n)
        rows = np.arange(seqlen_q)[:, None]
        for j in columns:
            masked = ((iv.lts[j] <= rows) & (rows < iv.lte[j])) | ((iv.uts[j] <= rows)
                                                                   & (rows < iv.ute[j]))
            np.testing.assert_array_equal(~masked[:, 0], _column(mask, seqlen_q, n, j),
                                          err_msg=f"{mask!r} column {j}")
