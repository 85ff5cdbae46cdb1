"""Exact reference attention: against a loop-level formula for every mask, GQA, alignment, empty
rows, input dtypes, chunking / memory, and argument validation."""
import importlib
import math
import tracemalloc

import ml_dtypes
import numpy as np
import pytest

import numba_flash_reference as R
from numba_flash_reference import masks as M
from mask_examples import example_masks

# The package exports the function ``attention``; the module of the same name:
attention_module = importlib.import_module("numba_flash_reference.attention")


def loop_attention(q, k, v, visible, scale, softcap=None):
    """Attention from its definition, one (b, h, i) at a time with Python floats and math.exp.

    visible: dense bool (Sq, Sk). Returns out (B, Sq, Hq, D) and lse (B, Hq, Sq)."""
    b_, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    out = np.zeros((b_, sq, hq, d))
    lse = np.full((b_, hq, sq), -math.inf)
    for b in range(b_):
        for h in range(hq):
            kh = h // group
            for i in range(sq):
                scores = {}
                for j in range(sk):
                    if not visible[i, j]:
                        continue
                    s = scale * sum(float(q[b, i, h, t]) * float(k[b, j, kh, t]) for t in range(d))
                    if softcap is not None:
                        s = softcap * math.tanh(s / softcap)
                    scores[j] = s
                if not scores:
                    continue
                top = max(scores.values())
                weights = {j: math.exp(s - top) for j, s in scores.items()}
                total = sum(weights.values())
                for t in range(d):
                    out[b, i, h, t] = sum(w * float(v[b, j, kh, t]) for j, w in weights.items()) / total
                lse[b, h, i] = top + math.log(total)
    return out, lse


def random_qkv(rng, b, sq, sk, hq, hkv, d, dtype=np.float64, spread=1.0):
    q = (rng.standard_normal((b, sq, hq, d)) * spread).astype(dtype)
    k = (rng.standard_normal((b, sk, hkv, d)) * spread).astype(dtype)
    v = rng.standard_normal((b, sk, hkv, d)).astype(dtype)
    return q, k, v


def assert_lse_close(lse, expected, atol=1e-12):
    assert np.array_equal(np.isneginf(lse), np.isneginf(expected))
    finite = np.isfinite(expected)
    np.testing.assert_allclose(lse[finite], expected[finite], rtol=0, atol=atol)


@pytest.mark.parametrize("sq,sk", [(7, 7), (5, 9), (9, 5), (1, 6)])
def test_every_mask_matches_loop_formula(sq, sk):
    rng = np.random.default_rng([sq, sk])
    q, k, v = random_qkv(rng, 2, sq, sk, 4, 2, 3)
    masks = example_masks(sq, sk)
    assert len(masks) >= 15
    for name, mask in masks:
        visible = mask.to_dense(sq, sk)
        out, lse = R.attention(q, k, v, mask=mask, return_lse=True)
        ref_out, ref_lse = loop_attention(q, k, v, visible, 1 / math.sqrt(3))
        np.testing.assert_allclose(out, ref_out, rtol=0, atol=1e-12, err_msg=name)
        assert_lse_close(lse, ref_lse)


@pytest.mark.parametrize("flags", [dict(causal=True), dict(window_size=(2, 1)),
                                   dict(window_size=(1, 0), sinks=2),
                                   dict(causal=True, window_size=(3, -1), sinks=1)])
def test_flags_softcap_and_scale_match_loop_formula(flags):
    rng = np.random.default_rng(7)
    q, k, v = random_qkv(rng, 1, 6, 8, 3, 1, 5, spread=2.0)
    visible = M.visible_matrix(6, 8, **flags)
    out, lse = R.attention(q, k, v, softmax_scale=0.7, softcap=1.5, return_lse=True, **flags)
    ref_out, ref_lse = loop_attention(q, k, v, visible, 0.7, softcap=1.5)
    np.testing.assert_allclose(out, ref_out, rtol=0, atol=1e-12)
    assert_lse_close(lse, ref_lse)
    # Flags combined with a mask object: the intersection.
    mask = M.DenseMask(rng.random((6, 8)) < 0.7)
    out = R.attention(q, k, v, mask=mask, **flags)
    ref_out, _ = loop_attention(q, k, v, visible & mask.to_dense(6, 8), 1 / math.sqrt(5))
    np.testing.assert_allclose(out, ref_out, rtol=0, atol=1e-12)


def test_softcap_zero_means_off_and_softcap_changes_result():
    rng = np.random.default_rng(3)
    q, k, v = random_qkv(rng, 1, 5, 5, 2, 2, 4, spread=3.0)
    plain = R.attention(q, k, v)
    np.testing.assert_array_equal(R.attention(q, k, v, softcap=0.0), plain)
    capped = R.attention(q, k, v, softcap=0.5)
    assert np.abs(capped - plain).max() > 1e-3


def test_gqa_equals_repeated_kv_heads():
    rng = np.random.default_rng(11)
    q, k, v = random_qkv(rng, 2, 9, 13, 6, 2, 5)
    out, lse = R.attention(q, k, v, causal=True, return_lse=True)
    k_rep, v_rep = np.repeat(k, 3, axis=2), np.repeat(v, 3, axis=2)
    out_rep, lse_rep = R.attention(q, k_rep, v_rep, causal=True, return_lse=True)
    np.testing.assert_allclose(out, out_rep, rtol=0, atol=1e-14)
    np.testing.assert_allclose(lse, lse_rep, rtol=0, atol=1e-14)
    # MQA: one kv head for every query head.
    out_mqa = R.attention(q, k[:, :, :1], v[:, :, :1])
    out_rep = R.attention(q, np.repeat(k[:, :, :1], 6, axis=2), np.repeat(v[:, :, :1], 6, axis=2))
    np.testing.assert_allclose(out_mqa, out_rep, rtol=0, atol=1e-14)


def test_bottom_right_alignment_fewer_queries():
    """Sq < Sk: the queries are the last Sq rows of the square causal problem (a KV cache)."""
    rng = np.random.default_rng(5)
    q, k, v = random_qkv(rng, 1, 11, 11, 2, 1, 4)
    full, full_lse = R.attention(q, k, v, causal=True, return_lse=True)
    tail, tail_lse = R.attention(q[:, 7:], k, v, causal=True, return_lse=True)
    np.testing.assert_allclose(tail, full[:, 7:], rtol=0, atol=1e-14)
    np.testing.assert_allclose(tail_lse, full_lse[:, :, 7:], rtol=0, atol=1e-14)
    # The last query sees every key: plain softmax over all of them.
    last = R.attention(q[:, 10:], k, v)
    np.testing.assert_allclose(tail[:, -1:], last, rtol=0, atol=1e-14)


def test_bottom_right_alignment_more_queries_gives_empty_rows():
    """Sq > Sk: the first Sq - Sk rows see no key (out 0, lse -inf); row Sq-Sk sees key 0 only."""
    rng = np.random.default_rng(6)
    q, k, v = random_qkv(rng, 2, 9, 4, 2, 2, 3)
    out, lse = R.attention(q, k, v, causal=True, return_lse=True)
    assert np.all(out[:, :5] == 0) and np.all(np.isneginf(lse[:, :, :5]))
    np.testing.assert_allclose(out[:, 5], v[:, 0], rtol=0, atol=1e-15)
    expected_lse = np.einsum("bhd,bhd->bh", q[:, 5], k[:, 0]) / math.sqrt(3)
    np.testing.assert_allclose(lse[:, :, 5], expected_lse, rtol=0, atol=1e-14)
    np.testing.assert_allclose(out[:, 5:], R.attention(q[:, 5:], k, v, causal=True), atol=1e-14)


def test_empty_rows_from_a_mask_and_from_no_keys():
    rng = np.random.default_rng(8)
    q, k, v = random_qkv(rng, 1, 5, 6, 1, 1, 3)
    visible = rng.random((5, 6)) < 0.5
    visible[[1, 3]] = False
    visible[0, 2] = True
    out, lse = R.attention(q, k, v, mask=M.DenseMask(visible), return_lse=True)
    assert np.all(out[0, [1, 3]] == 0) and np.all(np.isneginf(lse[0, 0, [1, 3]]))
    assert np.all(np.isfinite(out)) and np.all(np.abs(out[0, 0]) > 0)
    out, lse = R.attention(q, k[:, :0], v[:, :0], return_lse=True)
    assert out.shape == (1, 5, 1, 3) and np.all(out == 0) and np.all(np.isneginf(lse))
    out, lse = R.attention(q[:, :0], k, v, return_lse=True)
    assert out.shape == (1, 0, 1, 3) and lse.shape == (1, 1, 0)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32])
def test_low_precision_inputs_are_taken_exactly(dtype):
    rng = np.random.default_rng(9)
    q, k, v = random_qkv(rng, 1, 7, 7, 2, 1, 8, dtype=dtype)
    out, lse = R.attention(q, k, v, causal=True, return_lse=True)
    assert out.dtype == np.float64 and lse.dtype == np.float64
    as64 = [x.astype(np.float64) for x in (q, k, v)]
    ref, ref_lse = R.attention(*as64, causal=True, return_lse=True)
    np.testing.assert_array_equal(out, ref)
    np.testing.assert_array_equal(lse, ref_lse)


def test_row_chunking_does_not_change_results(monkeypatch):
    rng = np.random.default_rng(10)
    q, k, v = random_qkv(rng, 2, 37, 29, 4, 2, 6)
    mask = example_masks(37, 29)[5][1]
    whole, whole_lse = R.attention(q, k, v, mask=mask, return_lse=True)
    monkeypatch.setattr(attention_module, "_CHUNK_ELEMENTS", 2 * 4 * 29 * 3)  # 3 rows per chunk
    chunked, chunked_lse = R.attention(q, k, v, mask=mask, return_lse=True)
    np.testing.assert_allclose(chunked, whole, rtol=0, atol=1e-15)
    np.testing.assert_allclose(chunked_lse, whole_lse, rtol=0, atol=1e-15)


def test_memory_is_bounded_by_row_chunks():
    """2048 x 2048 scores x 4 heads would be 134 MB in float64; chunks keep far below that."""
    rng = np.random.default_rng(12)
    q, k, v = random_qkv(rng, 1, 2048, 2048, 4, 4, 16, dtype=np.float32)
    tracemalloc.start()
    try:
        out = R.attention(q, k, v, causal=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 100e6, peak
    row = 1000  # spot-check one row against a direct computation
    s = np.einsum("hd,khd->hk", q[0, row].astype(np.float64), k[0, :row + 1].astype(np.float64)) / 4
    p = np.exp(s - s.max(axis=1, keepdims=True))
    expected = np.einsum("hk,khd->hd", p / p.sum(axis=1, keepdims=True), v[0, :row + 1])
    np.testing.assert_allclose(out[0, row], expected, rtol=0, atol=1e-12)


def test_visible_block_matches_dense_for_every_mask():
    for name, mask in example_masks(13, 17):
        dense = mask.to_dense(13, 17)
        rows = np.array([[0], [4], [12]])
        cols = np.array([[1, 5, 16]])
        np.testing.assert_array_equal(R.visible_block(mask, 13, 17, rows, cols),
                                      dense[rows, cols], err_msg=name)
        rows3 = np.arange(12).reshape(3, 4, 1)
        cols3 = np.arange(15).reshape(3, 1, 5)
        np.testing.assert_array_equal(R.visible_block(mask, 13, 17, rows3, cols3),
                                      dense[rows3, cols3], err_msg=name)
    assert R.visible_block(None, 3, 4, np.arange(3)[:, None], np.arange(4)[None]).all()


# ----------------------------------------------------------------------------- validation

def _qkv(b=1, sq=4, sk=5, hq=2, hkv=1, d=3):
    rng = np.random.default_rng(0)
    return random_qkv(rng, b, sq, sk, hq, hkv, d)


@pytest.mark.parametrize("shapes,match", [
    (((4, 2, 3), (1, 5, 1, 3), (1, 5, 1, 3)), r"q must have rank 4"),
    (((1, 4, 2, 3), (1, 5, 1, 3, 1), (1, 5, 1, 3)), r"k must have rank 4"),
    (((1, 4, 2, 3), (2, 5, 1, 3), (1, 5, 1, 3)), r"batch sizes differ"),
    (((1, 4, 2, 3), (1, 5, 1, 3), (1, 6, 1, 3)), r"same seqlen_k"),
    (((1, 4, 2, 3), (1, 5, 1, 3), (1, 5, 2, 3)), r"same heads_kv"),
    (((1, 4, 2, 3), (1, 5, 1, 4), (1, 5, 1, 4)), r"q and k must have the same head_dim"),
    (((1, 4, 3, 3), (1, 5, 2, 3), (1, 5, 2, 3)), r"heads_q \(3\) must be a positive multiple"),
    (((1, 4, 2, 0), (1, 5, 1, 0), (1, 5, 1, 0)), r"head dims must be >= 1"),
])
def test_shape_errors(shapes, match):
    arrays = [np.ones(s) for s in shapes]
    with pytest.raises(ValueError, match=match):
        R.attention(*arrays)
    with pytest.raises(ValueError, match=match):
        R.check_shapes(*shapes)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(softmax_scale=0.0), ValueError, "softmax_scale must be finite and non-zero"),
    (dict(softmax_scale=float("nan")), ValueError, "softmax_scale"),
    (dict(softmax_scale=float("inf")), ValueError, "softmax_scale"),
    (dict(softmax_scale="0.5"), TypeError, "softmax_scale must be a real number"),
    (dict(softcap=-1.0), ValueError, "softcap must be a finite number > 0"),
    (dict(softcap=float("inf")), ValueError, "softcap"),
    (dict(softcap="1"), TypeError, "softcap must be a positive real number"),
    (dict(causal=1), TypeError, "causal must be a bool"),
    (dict(window_size=(-2, 0)), ValueError, "window_size"),
    (dict(window_size=3), TypeError, "window_size must be a pair"),
    (dict(sinks=-1), ValueError, "sinks"),
    (dict(mask=np.ones((4, 5), bool)), TypeError, "mask must be"),
    (dict(mask=M.DenseMask(np.ones((5, 5), bool))), ValueError, r"built for \(seqlen_q, seqlen_k\)"),
])
def test_argument_errors(kwargs, error, match):
    q, k, v = _qkv()
    with pytest.raises(error, match=match):
        R.attention(q, k, v, **kwargs)


def test_dtype_errors_and_accepted_scales():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="k must hold real floating-point values"):
        R.attention(q, k.astype(np.int32), v)
    with pytest.raises(TypeError, match="q must hold real floating-point values"):
        R.attention(q.astype(np.complex128), k, v)
    # A negative scale is a legal (if unusual) choice: it flips the scores.
    flipped = R.attention(q, k, v, softmax_scale=-0.5)
    np.testing.assert_allclose(flipped, R.attention(-q, k, v, softmax_scale=0.5), atol=1e-15)
    assert R.check_softmax_scale(None, 16) == 0.25
    problem = R.check_problem(q.shape, k.shape, v.shape, causal=True, softcap=2)
    assert problem.group == 2 and problem.softcap == 2.0 and isinstance(problem.mask, M.CausalMask)
