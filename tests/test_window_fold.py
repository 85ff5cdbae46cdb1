"""``validation.lower_window_mask``: a mask that is exactly ``masks.causal()`` or
``masks.sliding_window(...)`` runs as the flag kernels' window; the fold must keep every pair's
visibility, for every combination with the flags (including sinks on either side)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import numba_flash
from numba_flash import masks
from numba_flash.validation import lower_window_mask
from numba_flash_reference.masks import CausalMask, SlidingWindowMask, mask_from_flags

from gpu_arrays import to_device, to_host

side = st.integers(-1, 6)


@st.composite
def flags_and_mask(draw):
    causal = draw(st.booleans())
    window = (draw(side), draw(side))
    sinks = draw(st.integers(0, 3))
    mask = draw(st.one_of(
        st.just(CausalMask()),
        st.builds(SlidingWindowMask, side, side, st.integers(0, 3)),
        st.just(masks.causal_document([3, 4]))))
    return causal, window, sinks, mask


@settings(max_examples=300, deadline=None)
@given(flags_and_mask(), st.integers(1, 9), st.integers(1, 9))
def test_fold_keeps_every_pair(case, seqlen_q, seqlen_k):
    causal, window, sinks, mask = case
    if not isinstance(mask, (CausalMask, SlidingWindowMask)) and seqlen_k != 7:
        seqlen_k = 7                     # the document mask covers 7 keys
    before = mask_from_flags(causal, window, sinks, mask)
    c2, w2, s2, m2 = lower_window_mask(causal, window, sinks, mask)
    after = mask_from_flags(c2, w2, s2, m2)
    want = before.to_dense(seqlen_q, seqlen_k)
    got = np.ones_like(want) if after is None else after.to_dense(seqlen_q, seqlen_k)
    np.testing.assert_array_equal(got, want)


def test_fold_cases():
    # pure window masks become flags; the document mask stays
    assert lower_window_mask(False, (-1, -1), 0, masks.sliding_window(1024, 0)) == \
        (False, (1024, 0), 0, None)
    assert lower_window_mask(False, (-1, -1), 0, masks.causal()) == (True, (-1, -1), 0, None)
    kept = lower_window_mask(False, (8, -1), 2, SlidingWindowMask(4, 0, 0))
    assert kept[3] is not None                      # flag sinks: the mask stays
    assert lower_window_mask(True, (5, -1), 0, SlidingWindowMask(3, 2, 0)) == \
        (True, (3, 2), 0, None)                     # causal then clamps right to 0
    doc = masks.causal_document([3, 4])
    assert lower_window_mask(False, (-1, -1), 0, doc)[3] is doc


def test_folded_call_matches_the_reference_with_the_mask_object():
    """The folded call (flags) against the float64 reference given the mask object itself."""
    from numba_flash_reference.attention import attention as reference

    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 37, 4, 16)).astype(np.float32)
    k = rng.standard_normal((2, 41, 2, 16)).astype(np.float32)
    v = rng.standard_normal((2, 41, 2, 16)).astype(np.float32)
    for mask in (masks.sliding_window(9, 0), masks.causal(), SlidingWindowMask(6, 2, sinks=3)):
        got = numba_flash.attention(q, k, v, mask=mask)
        want = reference(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                         mask=mask)
        np.testing.assert_allclose(got, want, atol=2e-6, rtol=0)


def test_packed_batch_takes_a_window_mask_on_the_kernel():
    """A packed batch accepts masks.sliding_window() on the CUDA backend (the simulator on
    NumPy arrays without a GPU, device arrays on one): folded into the flags, it applies per
    sequence like them, and matches CPU mode with the mask object."""
    rng = np.random.default_rng(4)
    lens_q, lens_k = [5, 0, 1, 7], [6, 2, 1, 9]
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q = rng.standard_normal((cu_q[-1], 2, 32)).astype(np.float32)
    k = rng.standard_normal((cu_k[-1], 1, 32)).astype(np.float32)
    v = rng.standard_normal((cu_k[-1], 1, 32)).astype(np.float32)
    kw = dict(max_seqlen_q=7, max_seqlen_k=9, mask=masks.sliding_window(2, 0))
    got = numba_flash.attention(*(to_device(x) for x in (q, k, v)), backend="cuda",
                                cu_seqlens_q=to_device(cu_q), cu_seqlens_k=to_device(cu_k), **kw)
    want = numba_flash.attention(q, k, v, backend="cpu", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                 **kw)
    np.testing.assert_allclose(to_host(got), want, atol=2e-6, rtol=0)
