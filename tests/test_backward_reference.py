"""The float64 backward reference: finite differences, a direct per-head formula, and the tiled
column-parallel walk (the GPU kernel's specification) against the dense oracle."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mask_examples import example_masks
from numba_flash_reference import masks as M
from numba_flash_reference.attention import attention
from numba_flash_reference.backward import (attention_backward_reference, attention_backward_tiled,
                                            attention_backward_varlen, backward_tile_classes)
from numba_flash_reference.attention import check_problem
from numba_flash_reference.tiles import SKIP


def random_inputs(seed, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim):
    """dout, q, k, v: float64 standard normals (never zeros)."""
    rng = np.random.default_rng(seed)
    q_shape = (batch, seqlen_q, heads_q, head_dim)
    kv_shape = (batch, seqlen_k, heads_kv, head_dim)
    return (rng.standard_normal(q_shape), rng.standard_normal(q_shape),
            rng.standard_normal(kv_shape), rng.standard_normal(kv_shape))


def assert_grads_close(got, want, rtol=1e-12, atol=1e-12):
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert a.shape == b.shape, name
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=name)


def finite_difference(loss, x, step=1e-6):
    """Central differences of the scalar function ``loss`` at every element of x."""
    grad = np.empty_like(x)
    for idx in np.ndindex(x.shape):
        saved = x[idx]
        x[idx] = saved + step
        up = loss()
        x[idx] = saved - step
        down = loss()
        x[idx] = saved
        grad[idx] = (up - down) / (2 * step)
    return grad


FD_CASES = {
    "full": dict(),
    "causal_bottom_right": dict(causal=True),
    "window_sinks": dict(window_size=(1, 0), sinks=1),
    "softcap": dict(softcap=1.5, softmax_scale=0.9),
    "alibi_causal": dict(alibi_slopes=np.array([0.3, 0.7]), causal=True),
    "document_mask": dict(mask=M.CausalDocumentMask([2, 3])),
}


@pytest.mark.parametrize("name", FD_CASES)
def test_reference_matches_central_finite_differences(name):
    options = FD_CASES[name]
    dout, q, k, v = random_inputs(1, 1, 4, 5, 2, 1, 3)
    grads = attention_backward_reference(dout, q, k, v, **options)
    for x, grad in zip((q, k, v), grads):
        numeric = finite_difference(lambda: float((attention(q, k, v, **options) * dout).sum()), x)
        np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-8)


def direct_gradients(dout, q, k, v, visible, scale, softcap=None):
    """The textbook formulas, one (batch, query head) at a time, from a dense visibility matrix."""
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    group = q.shape[2] // k.shape[2]
    for b in range(q.shape[0]):
        for h in range(q.shape[2]):
            qh, kh, vh, doh = q[b, :, h], k[b, :, h // group], v[b, :, h // group], dout[b, :, h]
            raw = scale * qh @ kh.T
            capped = raw if softcap is None else softcap * np.tanh(raw / softcap)
            scores = np.where(visible, capped, -np.inf)
            probs = np.exp(scores - scores.max(axis=1, keepdims=True))
            probs /= probs.sum(axis=1, keepdims=True)
            dprobs = doh @ vh.T
            dscores = probs * (dprobs - (dprobs * probs).sum(axis=1, keepdims=True))
            if softcap is not None:
                dscores *= 1 - np.tanh(raw / softcap) ** 2
            dq[b, :, h] = scale * dscores @ kh
            dk[b, :, h // group] += scale * dscores.T @ qh
            dv[b, :, h // group] += probs.T @ doh
    return dq, dk, dv


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_reference_matches_direct_formula_with_gqa(softcap):
    dout, q, k, v = random_inputs(2, 2, 9, 11, 6, 2, 5)
    visible = np.ones((9, 11), dtype=bool)  # bidirectional: every row sees a key
    want = direct_gradients(dout, q, k, v, visible, 0.4, softcap)
    got = attention_backward_reference(dout, q, k, v, softmax_scale=0.4, softcap=softcap)
    assert_grads_close(got, want)


def test_gqa_gradients_are_sums_over_the_group():
    dout, q, k, v = random_inputs(3, 1, 7, 8, 4, 2, 3)
    grouped = attention_backward_reference(dout, q, k, v, causal=True)
    expanded = attention_backward_reference(dout, q, np.repeat(k, 2, axis=2),
                                            np.repeat(v, 2, axis=2), causal=True)
    np.testing.assert_allclose(grouped[0], expanded[0], rtol=1e-13, atol=1e-13)
    for got, per_head in zip(grouped[1:], expanded[1:]):
        np.testing.assert_allclose(got, per_head[:, :, 0::2] + per_head[:, :, 1::2],
                                   rtol=1e-13, atol=1e-13)


def test_rows_without_visible_keys_get_zero_gradient():
    dout, q, k, v = random_inputs(4, 1, 6, 3, 2, 2, 4)  # causal, seqlen_q > seqlen_k
    dq, dk, dv = attention_backward_reference(dout, q, k, v, causal=True)
    assert np.all(dq[:, :3] == 0) and np.all(np.isfinite(dq))
    tiled = attention_backward_tiled(dout, q, k, v, causal=True, block_m=2, block_n=2)
    assert_grads_close(tiled, (dq, dk, dv))


MASK_SIZES = [(17, 17), (9, 20), (20, 9), (1, 5)]


@pytest.mark.parametrize("seqlen_q,seqlen_k", MASK_SIZES)
def test_tiled_equals_dense_for_every_mask(seqlen_q, seqlen_k):
    dout, q, k, v = random_inputs(seqlen_q, 1, seqlen_q, seqlen_k, 2, 1, 4)
    masks = example_masks(seqlen_q, seqlen_k) + [
        ("mask_mod", M.MaskModMask(lambda b, h, i, j: (i + j) % 3 != 0)),
        ("mask_mod_bh", M.MaskModMask(lambda b, h, i, j: (i - j + h) % 2 == 0, batch_head=True))]
    for name, mask in masks:
        dense = attention_backward_reference(dout, q, k, v, mask=mask, softcap=4.0)
        tiled = attention_backward_tiled(dout, q, k, v, mask=mask, softcap=4.0, block_m=4,
                                         block_n=3)
        assert_grads_close(tiled, dense, rtol=1e-11, atol=1e-12)


def test_skipped_tiles_are_counted_and_sound():
    dout, q, k, v = random_inputs(5, 1, 64, 64, 1, 1, 4)
    *grads, stats = attention_backward_tiled(dout, q, k, v, causal=True, block_m=16, block_n=16,
                                             return_stats=True)
    assert stats == {"skip": 6, "partial": 4, "full": 6, "skipped": 6}
    assert_grads_close(grads, attention_backward_reference(dout, q, k, v, causal=True))
    mask = M.CausalDocumentMask([20, 30, 14])
    problem = check_problem(q.shape, k.shape, v.shape, mask=mask)
    classes = backward_tile_classes(problem, 8, 8)
    visible = mask.to_dense(64, 64)
    for i, j in np.argwhere(classes == SKIP):
        assert not visible[8 * i:8 * i + 8, 8 * j:8 * j + 8].any()
    *_, stats = attention_backward_tiled(dout, q, k, v, mask=mask, block_m=8, block_n=8,
                                         return_stats=True)
    assert stats["skipped"] == int((classes == SKIP).sum()) > 30


@pytest.mark.parametrize("classification", ["exact", "none"])
def test_classification_modes_agree(classification):
    dout, q, k, v = random_inputs(6, 1, 13, 13, 2, 2, 3)
    mask = M.PrefixLMDocumentMask([6, 7], [2, 3])
    want = attention_backward_reference(dout, q, k, v, mask=mask)
    *got, stats = attention_backward_tiled(dout, q, k, v, mask=mask, block_m=3, block_n=4,
                                           classification=classification, return_stats=True)
    assert_grads_close(got, want)
    assert (stats["skipped"] == 0) == (classification == "none")


def test_tiled_from_the_forwards_out_and_lse():
    dout, q, k, v = random_inputs(7, 2, 10, 12, 2, 1, 4)
    out, lse = attention(q, k, v, window_size=(3, 1), return_lse=True)
    got = attention_backward_tiled(dout, q, k, v, out=out, lse=lse, window_size=(3, 1),
                                   block_m=4, block_n=5)
    assert_grads_close(got, attention_backward_reference(dout, q, k, v, window_size=(3, 1)))
    with pytest.raises(ValueError, match="both out and lse"):
        attention_backward_tiled(dout, q, k, v, out=out)


def test_varlen_is_each_sequence_on_its_own():
    lengths_q, lengths_k = [3, 0, 5, 1], [4, 2, 5, 0]
    cu_q, cu_k = np.cumsum([0] + lengths_q), np.cumsum([0] + lengths_k)
    dout, q, k, v = (x[0] for x in random_inputs(8, 1, cu_q[-1], cu_k[-1], 2, 1, 3))
    slopes = np.array([[0.1, 0.2], [0.3, 0.4], [0.5, 0.6], [0.7, 0.8]])
    options = dict(causal=True, softcap=2.0, alibi_slopes=slopes)
    dense = attention_backward_varlen(dout, q, k, v, cu_q, cu_k, **options)
    tiled = attention_backward_varlen(dout, q, k, v, cu_q, cu_k, tiled=True, block_m=2,
                                      block_n=2, **options)
    assert_grads_close(tiled, dense)
    rows, keys = slice(3, 8), slice(6, 11)
    alone = attention_backward_reference(dout[None, rows], q[None, rows], k[None, keys],
                                         v[None, keys], causal=True, softcap=2.0,
                                         alibi_slopes=slopes[2])
    assert_grads_close((dense[0][rows], dense[1][keys], dense[2][keys]),
                       tuple(g[0] for g in alone))
    assert np.all(dense[1][4:6] == 0)  # sequence 1 has no query row
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        attention_backward_varlen(dout, q, k, v, cu_q[:-1], cu_k)


def test_nan_and_inf_propagate():
    dout, q, k, v = random_inputs(9, 1, 6, 6, 1, 1, 3)
    q[0, 2, 0, 1] = np.nan
    for backward in (attention_backward_reference, attention_backward_tiled):
        dq, dk, dv = backward(dout, q, k, v, causal=True)
        assert np.isnan(dq[0, 2]).all() and np.isnan(dk[0, :3]).all() and np.isnan(dv[0, :3]).all()
    q[0, 2, 0, 1] = 0.5
    v[0, 1, 0, 0] = np.inf
    dq, _, _ = attention_backward_reference(dout, q, k, v, causal=True)
    assert not np.isfinite(dq[0, 1:]).all()
    v[0, 1, 0, 0] = 0.5
    dout[0, 4, 0, 2] = np.nan
    dq, dk, dv = attention_backward_reference(dout, q, k, v, causal=True)
    assert np.isnan(dq[0, 4]).all() and np.isnan(dv[0, :5, 0, 2]).all()


def test_reference_argument_errors():
    dout, q, k, v = random_inputs(10, 1, 4, 4, 2, 2, 3)
    with pytest.raises(ValueError, match="dout must have q's shape"):
        attention_backward_reference(dout[:, :3], q, k, v)
    with pytest.raises(TypeError, match="dout"):
        attention_backward_reference(dout.astype(np.int32), q, k, v)
    with pytest.raises(ValueError, match="classification"):
        attention_backward_tiled(dout, q, k, v, classification="fast")
    with pytest.raises(ValueError, match="block_m"):
        attention_backward_tiled(dout, q, k, v, block_m=0)


@settings(deadline=None, max_examples=25)
@given(seqlen_q=st.integers(1, 12), seqlen_k=st.integers(1, 12), group=st.sampled_from([1, 2]),
       causal=st.booleans(), left=st.integers(-1, 5), sinks=st.integers(0, 2),
       softcap=st.sampled_from([None, 1.0, 5.0]), block_m=st.integers(1, 6),
       block_n=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_property_tiled_equals_dense(seqlen_q, seqlen_k, group, causal, left, sinks, softcap,
                                     block_m, block_n, seed):
    dout, q, k, v = random_inputs(seed, 1, seqlen_q, seqlen_k, 2 * group, 2, 3)
    options = dict(causal=causal, window_size=(left, -1), sinks=sinks, softcap=softcap)
    dense = attention_backward_reference(dout, q, k, v, **options)
    tiled = attention_backward_tiled(dout, q, k, v, block_m=block_m, block_n=block_n, **options)
    assert_grads_close(tiled, dense, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(0, 3), (3, 0)])
def test_empty_sequences_give_zero_gradients(seqlen_q, seqlen_k):
    dout, q, k, v = random_inputs(11, 1, seqlen_q, seqlen_k, 2, 1, 4)
    for backward in (attention_backward_reference, attention_backward_tiled):
        for grad, like in zip(backward(dout, q, k, v, causal=True), (q, k, v)):
            assert grad.shape == like.shape and not grad.any()
