"""Masks on the device: tile min/max vectors and class tables (numba_flash.cuda.tiles) equal the
reference's, for intervals, packed bitmasks and compiled mask_mods. Small shapes under the
simulator, larger ones on a GPU."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from numba_flash import masks
from numba_flash.cuda import tiles
from numba_flash.cuda.warp import SIMULATOR
from numba_flash_reference import tiles as rtiles
from numba_flash_reference.intervals import NotRepresentableError
from mask_examples import example_masks

gpu = pytest.mark.skipif(SIMULATOR, reason="needs a real CUDA GPU")
if not SIMULATOR:
    cp = pytest.importorskip("cupy")


def _dev(x):
    return np.ascontiguousarray(x) if SIMULATOR else cp.asarray(np.ascontiguousarray(x))


def _host(x):
    return x if isinstance(x, np.ndarray) else (cp.asnumpy(x) if not SIMULATOR else
                                                 x.copy_to_host())


def _check_intervals(mask, sq, sk, block_m, block_n):
    try:
        iv = mask.column_intervals(sq, sk)
    except NotRepresentableError:
        return False
    mm = tiles.tile_minmax(_dev(iv.stacked().astype(np.int32)), sq, block_n)
    ref = rtiles.tile_minmax(iv, block_n)
    got = _host(mm)
    for row, field in enumerate(tiles.MINMAX_FIELDS):
        np.testing.assert_array_equal(got[row], ref[field], err_msg=f"{mask!r} {field}")
    classes = _host(tiles.classify_intervals(mm, sq, block_m))
    np.testing.assert_array_equal(classes, rtiles.classify_tiles(iv, block_m, block_n),
                                  err_msg=repr(mask))
    return True


def _check_bitmask(dense, block_m, block_n):
    sq, sk = dense.shape
    words = masks.from_dense(dense).to_bitmask(sq, sk).view(np.uint32)
    got = _host(tiles.classify_bitmask(_dev(words), sq, sk, block_m, block_n))
    np.testing.assert_array_equal(got, rtiles.classify_tiles_dense(dense, block_m, block_n))


@settings(max_examples=12 if SIMULATOR else 40, deadline=None)
@given(sq=st.integers(1, 40), sk=st.integers(1, 40), seed=st.integers(0, 999),
       block_m=st.integers(1, 9), block_n=st.integers(1, 9))
def test_interval_tables_equal_reference_for_every_mask(sq, sk, seed, block_m, block_n):
    checked = 0
    for _, mask in example_masks(sq, sk, seed):
        checked += _check_intervals(mask, sq, sk, block_m, block_n)
    assert checked >= 8


@settings(max_examples=15 if SIMULATOR else 40, deadline=None)
@given(sq=st.integers(1, 70), sk=st.integers(1, 100), density=st.floats(0, 1),
       seed=st.integers(0, 999), block_m=st.sampled_from([1, 5, 16, 64]),
       block_n=st.sampled_from([3, 8, 32, 40, 64]))
def test_bitmask_tables_equal_exact_classes(sq, sk, density, seed, block_m, block_n):
    rng = np.random.default_rng(seed)
    dense = rng.random((sq, sk)) < density
    # Whole visible / masked tiles so that FULL and SKIP both occur, not only PARTIAL.
    dense[: sq // 2, : sk // 2] = True
    dense[sq // 2:, sk // 2:] = False
    _check_bitmask(dense, block_m, block_n)


def test_seed001_tree_bitmask_tiles():
    parents = [-1, 0, 1, 1, 2, 2, 3, 3, 4]
    m = masks.tree(parents, prefix_length=23)
    _check_bitmask(m.to_dense(32, 32), 4, 8)


def test_mask_mod_tables_with_captured_document_ids():
    lengths = [6, 3, 8]
    doc = np.repeat(np.arange(3), lengths).astype(np.int32)

    def same_doc_causal(b, h, q, kv):
        return doc[q] == doc[kv] and kv <= q

    got = _host(tiles.classify_mask_mod(same_doc_causal, 1, 1, 17, 17, 6, 5))
    want = rtiles.classify_tiles_dense(masks.causal_document(lengths).to_dense(17, 17), 6, 5)
    np.testing.assert_array_equal(got[0], want)


def test_mask_mod_tables_per_batch_head():
    def per_head(b, h, q, kv):
        return kv <= q - h or b == 1

    got = _host(tiles.classify_mask_mod(per_head, 2, 2, 9, 9, 4, 4))
    m = masks.mask_mod(per_head, batch_head=True)
    for bh in range(4):
        dense = m.to_dense_bh(bh // 2, bh % 2, 9, 9)
        np.testing.assert_array_equal(got[bh], rtiles.classify_tiles_dense(dense, 4, 4))


@gpu
@pytest.mark.parametrize("n", [1000, 4099])
def test_gpu_large_tables(n):
    rng = np.random.default_rng(n)
    for _, mask in example_masks(n, n, 3):
        _check_intervals(mask, n, n, 64, 64)
    dense = masks.causal_document([n // 3, n // 5, n - n // 3 - n // 5]).to_dense(n, n)
    dense &= rng.random((n, n)) < 0.999
    _check_bitmask(dense, 64, 64)
