"""Tile classification: soundness for every mask, known counts, the min/max vectors, ragged
tiles, where the rule is conservative, and validation."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import numba_flash.masks as nfm
from numba_flash_reference.intervals import ColumnIntervals, NotRepresentableError
from numba_flash_reference.tiles import (FULL, MINMAX_FIELDS, PARTIAL, SKIP, classify_tiles,
                                         classify_tiles_dense, tile_counts, tile_minmax)
from mask_examples import example_masks


@settings(max_examples=50, deadline=None)
@given(seqlen_q=st.integers(0, 29), seqlen_k=st.integers(0, 29), seed=st.integers(0, 2**16),
       block_m=st.integers(1, 9), block_n=st.integers(1, 9))
def test_classification_is_sound_for_every_mask(seqlen_q, seqlen_k, seed, block_m, block_n):
    shape = (-(-seqlen_q // block_m), -(-seqlen_k // block_n))
    for name, mask in example_masks(seqlen_q, seqlen_k, seed):
        dense = mask.to_dense(seqlen_q, seqlen_k)
        exact = classify_tiles_dense(dense, block_m, block_n)
        assert exact.shape == shape and exact.dtype == np.int8
        try:
            iv = mask.column_intervals(seqlen_q, seqlen_k)
        except NotRepresentableError:
            continue
        rule = classify_tiles(iv, block_m, block_n)
        assert rule.shape == shape and rule.dtype == np.int8
        # A skipped tile holds no visible pair, a full tile no masked pair.
        assert not ((rule == SKIP) & (exact != SKIP)).any(), name
        assert not ((rule == FULL) & (exact != FULL)).any(), name
        for qt, kt in zip(*np.nonzero(rule != PARTIAL)):
            tile = dense[qt * block_m:(qt + 1) * block_m, kt * block_n:(kt + 1) * block_n]
            assert tile.all() if rule[qt, kt] == FULL else not tile.any(), (name, qt, kt)


@pytest.mark.parametrize("k", [1, 2, 5, 8])
@pytest.mark.parametrize("block", [2, 3, 16])
def test_causal_counts_square_tiles(k, block):
    """N = k * B, B x B tiles: k(k-1)/2 above the diagonal (skip), k on it (partial), k(k-1)/2
    below (full)."""
    n = k * block
    mask = nfm.causal()
    expected = {"skip": k * (k - 1) // 2, "partial": k, "full": k * (k - 1) // 2}
    assert tile_counts(classify_tiles(mask.column_intervals(n, n), block, block)) == expected
    assert tile_counts(classify_tiles_dense(mask.to_dense(n, n), block, block)) == expected


@pytest.mark.parametrize("k", [1, 3, 6])
def test_causal_counts_tall_tiles(k):
    """BM = 2 BN = 2b, N = k BM: query tile r has 2k - 2r - 2 skipped and 2r full key tiles, so
    k(k-1) skip, k(k-1) full and 2k partial (two key tiles straddle each diagonal block)."""
    b = 4
    n = k * 2 * b
    expected = {"skip": k * (k - 1), "partial": 2 * k, "full": k * (k - 1)}
    iv = nfm.causal().column_intervals(n, n)
    assert tile_counts(classify_tiles(iv, 2 * b, b)) == expected
    assert tile_counts(classify_tiles_dense(nfm.causal().to_dense(n, n), 2 * b, b)) == expected


def test_causal_tiles_of_one_pair():
    # 1 x 1 tiles are exact pairs: the diagonal is visible, so nothing is partial.
    iv = nfm.causal().column_intervals(6, 6)
    assert tile_counts(classify_tiles(iv, 1, 1)) == {"skip": 15, "partial": 0, "full": 21}


def test_document_counts_with_aligned_documents():
    """Documents of 2B, 3B, B keys with B x B tiles: same-document tiles are full (4 + 9 + 1),
    the rest skip; causal documents keep only the 2 + 3 + 1 diagonal tiles partial and
    1 + 3 + 0 full. The rule is exact here."""
    b = 5
    docs = [2 * b, 3 * b, b]
    n = sum(docs)
    for mask, expected in ((nfm.document(docs), {"skip": 22, "partial": 0, "full": 14}),
                           (nfm.causal_document(docs), {"skip": 26, "partial": 6, "full": 4})):
        rule = classify_tiles(mask.column_intervals(n, n), b, b)
        exact = classify_tiles_dense(mask.to_dense(n, n), b, b)
        assert tile_counts(rule) == expected
        np.testing.assert_array_equal(rule, exact)


def test_decode_tiles_are_full():
    iv = nfm.causal().column_intervals(1, 100)
    classes = classify_tiles(iv, 64, 16)
    assert classes.shape == (1, 7) and (classes == FULL).all()


def test_rule_is_conservative_when_lt_and_ut_share_a_tile():
    # Decode of 2 queries over 4 keys, every key dropped: keys 0, 1 mask their rows through LT
    # (the run starts below their diagonal rows -2, -1), keys 2, 3 through UT. Every pair is
    # masked, yet no single interval kind covers the whole tile: the rule says partial.
    mask = nfm.qk_sparse([0, 1, 2, 3])
    iv = mask.column_intervals(2, 4)
    assert iv.lts.tolist() == [0, 0, 2, 2] and iv.ute.tolist() == [0, 0, 2, 2]
    assert classify_tiles(iv, 2, 4).tolist() == [[PARTIAL]]
    assert classify_tiles_dense(mask.to_dense(2, 4), 2, 4).tolist() == [[SKIP]]
    assert classify_tiles(iv, 2, 2).tolist() == [[SKIP, SKIP]]


def test_tile_minmax_literal():
    # Causal, 5 x 5, key tiles {0, 1}, {2, 3}, {4}: UT of column j is [0, j), LT empty.
    mm = tile_minmax(nfm.causal().column_intervals(5, 5), 2)
    assert tuple(mm) == MINMAX_FIELDS
    expected = {"lts_min": [5, 5, 5], "lts_max": [5, 5, 5], "lte_min": [5, 5, 5],
                "lte_max": [0, 0, 0], "uts_min": [0, 0, 0], "uts_max": [0, 0, 0],
                "ute_min": [0, 2, 4], "ute_max": [1, 3, 4]}
    assert {k: v.tolist() for k, v in mm.items()} == expected
    assert all(v.dtype == np.int32 for v in mm.values())


def test_empty_intervals_do_not_widen_the_bounds():
    # Column 0 masks rows [4, 6) by UT, column 1 masks nothing (UT stored as an empty [0, 0)).
    iv = ColumnIntervals([8, 8], [8, 8], [4, 0], [6, 0], seqlen_q=8)
    mm = tile_minmax(iv, 2)
    assert (mm["uts_min"][0], mm["ute_max"][0]) == (4, 6)
    assert (mm["uts_max"][0], mm["ute_min"][0]) == (4, 0)
    assert classify_tiles(iv, 2, 2)[:, 0].tolist() == [FULL, FULL, PARTIAL, FULL]
    np.testing.assert_array_equal(classify_tiles(iv, 2, 2),
                                  classify_tiles_dense(iv.to_dense(), 2, 2))


def test_ragged_tiles():
    mask = nfm.causal_document([3, 4])
    iv = mask.column_intervals(7, 7)
    rule = classify_tiles(iv, 3, 2)
    exact = classify_tiles_dense(mask.to_dense(7, 7), 3, 2)
    assert rule.shape == exact.shape == (3, 4)
    # The last query tile is row 6 alone and the last key tile column 6 alone: visible.
    assert rule[2, 3] == exact[2, 3] == FULL
    assert (rule[rule != PARTIAL] == exact[rule != PARTIAL]).all()
    assert classify_tiles(nfm.causal().column_intervals(0, 5), 4, 4).shape == (0, 2)
    assert classify_tiles_dense(np.ones((3, 0), dtype=bool), 4, 4).shape == (1, 0)


def test_tile_counts():
    classes = np.array([[0, 1, 2], [2, 2, 1]], dtype=np.int8)
    assert tile_counts(classes) == {"skip": 1, "partial": 2, "full": 3}


@pytest.mark.parametrize("call, exc, pattern", [
    (lambda iv: classify_tiles(iv, 0, 4), ValueError, "block_m must be >= 1, got 0"),
    (lambda iv: classify_tiles(iv, 4, 2.5), TypeError, "block_n must be an integer"),
    (lambda iv: tile_minmax(iv, -1), ValueError, "block_n"),
    (lambda iv: classify_tiles(iv.to_dense(), 4, 4), TypeError, "ColumnIntervals"),
    (lambda iv: classify_tiles_dense(iv.to_dense().astype(int), 4, 4), TypeError, "bool"),
    (lambda iv: classify_tiles_dense(iv.to_dense(), 4, True), TypeError, "block_n"),
])
def test_bad_arguments(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call(nfm.causal().column_intervals(8, 8))
