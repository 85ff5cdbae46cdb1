"""``score_mod(score, b, h, q_idx, kv_idx)``: the reference against dense formulas (vectorised
and scalar bodies, GQA head numbering, bottom-right positions, -inf as a mask), CPU mode and
packed batches (b is the sequence), argument errors, and the GPU kernels against the float64
reference with the 2x rule (small shapes under the simulator, larger ones on a GPU)."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import numba_flash
from numba_flash import masks
from numba_flash.cuda.launch import attention as launch
from numba_flash.cuda.primitives import SIMULATOR
from numba_flash_reference.attention import attention as reference
from numba_flash_reference.masks import mask_from_flags

from gpu_arrays import gpu, poison_outputs, to_device, to_host
from test_cuda_forward import ATOL, DTYPES, naive_same_dtype


@pytest.fixture(autouse=True)
def _nan_poisoned_outputs(monkeypatch):
    poison_outputs(monkeypatch)


def relative_bias(score, b, h, q_idx, kv_idx):
    """A (b, h)-dependent relative-position bias: vectorisable."""
    return score + 0.05 * (kv_idx - q_idx) * (h + 1) - 0.25 * b


def relative_bias_scalar(score, b, h, q_idx, kv_idx):
    """The same function written with an ``if`` (not vectorisable: scalar path)."""
    if kv_idx >= q_idx:
        return score + 0.05 * (kv_idx - q_idx) * (h + 1) - 0.25 * b
    return score - 0.05 * (q_idx - kv_idx) * (h + 1) - 0.25 * b


def causal_by_score(score, b, h, q_idx, kv_idx):
    """Hides future keys by returning -inf (what causal=True does)."""
    return score if kv_idx <= q_idx else -math.inf


def dense_bias(b, hq, sq, sk):
    """relative_bias's additive term as a float64 (B, Hq, Sq, Sk) array (aligned positions)."""
    qpos = np.arange(sq)[:, None] + (sk - sq)
    kpos = np.arange(sk)[None, :]
    h = np.arange(hq)[:, None, None]
    return (0.05 * (kpos - qpos) * (h + 1))[None] - 0.25 * np.arange(b)[:, None, None, None]


def dense_attention(q, k, v, scale, bias, visible):
    """Float64 softmax attention with an additive bias and a visibility matrix."""
    b, sq, hq, d = q.shape
    g = hq // k.shape[2]
    kk, vv = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, kk) * scale + bias
    s = np.where(visible, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    p = np.exp(s - np.where(np.isfinite(m), m, 0))
    l = p.sum(axis=-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", np.divide(p, l, out=np.zeros_like(p), where=l > 0), vv)


def _qkv(rng, b, sq, sk, hq, hkv, d, dtype=np.float64):
    return (rng.standard_normal((b, sq, hq, d)).astype(dtype),
            rng.standard_normal((b, sk, hkv, d)).astype(dtype),
            rng.standard_normal((b, sk, hkv, d)).astype(dtype))


# ------------------------------------------------------------------------------ reference
@pytest.mark.parametrize("sq,sk", [(9, 9), (5, 12), (12, 5)])
def test_reference_matches_a_dense_bias(sq, sk):
    rng = np.random.default_rng(sq * 100 + sk)
    q, k, v = _qkv(rng, 2, sq, sk, 4, 2, 8)
    scale = 8 ** -0.5
    want = dense_attention(q, k, v, scale, dense_bias(2, 4, sq, sk), True)
    for fn in (relative_bias, relative_bias_scalar):
        got = reference(q, k, v, score_mod=fn)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-13)
    # with a mask: the bias applies before it, masked pairs stay hidden
    vis = masks.causal().to_dense(sq, sk)
    want = dense_attention(q, k, v, scale, dense_bias(2, 4, sq, sk), vis)
    np.testing.assert_allclose(reference(q, k, v, causal=True, score_mod=relative_bias), want,
                               rtol=0, atol=1e-13)


@settings(max_examples=25, deadline=None)
@given(b=st.integers(1, 2), sq=st.integers(1, 9), sk=st.integers(1, 9),
       heads=st.sampled_from([(1, 1), (2, 1), (4, 2), (3, 3)]), causal=st.booleans(),
       seed=st.integers(0, 999))
def test_reference_bias_table_vectorised_and_scalar(b, sq, sk, heads, causal, seed):
    """A random (b, h, q, kv) bias table read by the function: the vectorised call, the
    per-score fallback and the dense formula agree (aligned q positions, GQA head numbers)."""
    hq, hkv = heads
    rng = np.random.default_rng(seed)
    q, k, v = _qkv(rng, b, sq, sk, hq, hkv, 8)
    table = rng.standard_normal((b, hq, sq, sk))
    offset = sk - sq

    def vectorised(score, bb, h, q_idx, kv_idx):
        return score + table[bb, h, q_idx - offset, kv_idx]

    def scalar(score, bb, h, q_idx, kv_idx):
        if q_idx - offset < 0:    # an `if` on a value: the reference calls it per score
            raise AssertionError("aligned position below the first row")
        return score + float(table[bb, h, q_idx - offset, kv_idx])

    vis = masks.causal().to_dense(sq, sk) if causal else True
    want = dense_attention(q, k, v, 8 ** -0.5, table, vis)
    for fn in (vectorised, scalar):
        got = reference(q, k, v, causal=causal, score_mod=fn)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


def test_reference_minus_infinity_acts_as_a_mask():
    rng = np.random.default_rng(3)
    q, k, v = _qkv(rng, 1, 7, 10, 2, 1, 8)
    out, lse = reference(q, k, v, score_mod=causal_by_score, return_lse=True)
    want, want_lse = reference(q, k, v, causal=True, return_lse=True)
    np.testing.assert_allclose(out, want, atol=1e-14)
    np.testing.assert_allclose(lse, want_lse, atol=1e-14)
    # every score -inf: output 0, lse -inf, no NaN
    out, lse = reference(q, k, v, score_mod=lambda s, b, h, qi, kv: s - np.inf, return_lse=True)
    assert (out == 0).all() and np.isneginf(lse).all()


def test_reference_identity_and_softcap_order():
    rng = np.random.default_rng(4)
    q, k, v = _qkv(rng, 1, 6, 6, 2, 2, 8)
    np.testing.assert_array_equal(reference(q, k, v, score_mod=lambda s, b, h, qi, kv: s),
                                  reference(q, k, v))
    # score_mod sees the soft-capped score: doubling it gives 2 * cap * tanh(s / cap), not
    # cap * tanh(2 s / cap) (what applying it before the softcap would give).
    got = reference(q, k, v, softcap=0.5, score_mod=lambda s, b, h, qi, kv: 2 * s)
    scale = 8 ** -0.5
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    want = dense_attention(q, k, v, 0.0, 2 * 0.5 * np.tanh(s / 0.5), True)
    np.testing.assert_allclose(got, want, atol=1e-13)


# ---------------------------------------------------------------------- front end, CPU mode
def test_cpu_mode_rounds_the_reference_once():
    rng = np.random.default_rng(5)
    q, k, v = _qkv(rng, 2, 9, 11, 4, 2, 16, np.float32)
    out, lse = numba_flash.attention(q, k, v, causal=True, score_mod=relative_bias,
                                     return_lse=True)
    ref, ref_lse = reference(q, k, v, causal=True, score_mod=relative_bias, return_lse=True)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, ref.astype(np.float32))
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-6)


def test_cpu_packed_batch_passes_the_sequence_as_b():
    rng = np.random.default_rng(6)
    lens_q, lens_k = [4, 0, 6], [5, 3, 6]
    seqs = [_qkv(rng, 1, lq, lk, 2, 1, 8) for lq, lk in zip(lens_q, lens_k)]
    q, k, v = (np.concatenate([s[i][0] for s in seqs]) for i in range(3))
    cu_q = np.cumsum([0] + lens_q).astype(np.int32)
    cu_k = np.cumsum([0] + lens_k).astype(np.int32)
    out = numba_flash.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                score_mod=relative_bias)
    for i, (qs, ks, vs) in enumerate(seqs):
        if lens_q[i] == 0:
            continue
        bias = dense_bias(i + 1, 2, lens_q[i], lens_k[i])[i:i + 1]   # b = i
        want = dense_attention(qs, ks, vs, 8 ** -0.5, bias, True)[0]
        np.testing.assert_allclose(out[cu_q[i]:cu_q[i + 1]], want, atol=1e-12)


def test_bad_score_mod_is_rejected_by_name():
    q = np.ones((1, 2, 1, 8))
    with pytest.raises(TypeError, match="score_mod must be None or a function"):
        numba_flash.attention(q, q, q, score_mod=3.0)
    with pytest.raises(TypeError, match="score_mod"):
        numba_flash.attention(to_device(q.astype(np.float32)), to_device(q.astype(np.float32)),
                              to_device(q.astype(np.float32)), score_mod="bias",
                              backend="cuda")


# --------------------------------------------------------------------------- GPU kernels
def _kernel_case(rng, dtype_name, b, sq, sk, hq, hkv, d, score_mod, dense_mod, **kw):
    """The kernel with ``score_mod`` against the float64 reference, with the 2x rule; the naive
    same-dtype run applies ``dense_mod(s, qpos, kpos)`` (float arrays) to its scores."""
    dt = DTYPES[dtype_name]
    q, k, v = _qkv(rng, b, sq, sk, hq, hkv, d, dt)
    scale = d ** -0.5
    out, lse = launch.attention_cuda(*(to_device(x) for x in (q, k, v)), softmax_scale=scale,
                                     score_mod=score_mod, return_lse=True, **kw)
    out, lse = to_host(out), to_host(lse)
    ref, ref_lse = reference(q, k, v, softmax_scale=scale, score_mod=score_mod,
                             return_lse=True, **kw)
    combined = mask_from_flags(**{key: kw[key] for key in ("causal", "window_size", "sinks",
                                                             "mask") if key in kw})
    vis = np.ones((sq, sk), bool) if combined is None else combined.to_dense(sq, sk)
    qpos = np.arange(sq)[:, None] + (sk - sq)
    kpos = np.arange(sk)[None, :]
    bias = dense_mod(np.zeros((b, hq, sq, sk)), qpos, kpos)
    naive = naive_same_dtype(q, k, v, scale, vis, kw.get("softcap"), bias)
    err = np.abs(out.astype(np.float64) - ref).max()
    bound = 2 * np.abs(naive - ref).max() + ATOL[dtype_name]
    assert not np.isnan(out).any()
    assert err <= bound, (dtype_name, err, bound)
    finite = np.isfinite(ref_lse)
    assert (np.isneginf(lse) == ~finite).all()
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=1e-4, atol=1e-4)


def _dense_relative_bias(s, qpos, kpos):
    b, hq = s.shape[:2]
    h = np.arange(hq)[None, :, None, None]
    return s + 0.05 * (kpos - qpos) * (h + 1) - 0.25 * np.arange(b)[:, None, None, None]


HEAD_SCALE = np.array([1.0, 0.5, -0.75, 0.25])


def head_scaled_distance(score, b, h, q_idx, kv_idx):
    """Reads a captured array (compiled in as a constant on the GPU)."""
    return score - HEAD_SCALE[h] * abs(q_idx - kv_idx) / 8.0


def _dense_head_scaled(s, qpos, kpos):
    return s - HEAD_SCALE[None, :s.shape[1], None, None] * np.abs(qpos - kpos) / 8.0


SIM_CASES = [
    # dtype, (b, sq, sk, hq, hkv, d), score_mod, dense form, flags
    ("float32", (2, 11, 13, 2, 1, 32), relative_bias, _dense_relative_bias, dict(causal=True)),
    ("float16", (1, 19, 23, 2, 1, 32), relative_bias, _dense_relative_bias,
     dict(mask=masks.causal_document([7, 16]))),
    ("float64", (1, 9, 14, 4, 2, 32), head_scaled_distance, _dense_head_scaled,
     dict(window_size=(6, 1), softcap=3.0)),
]


@pytest.mark.parametrize("case", SIM_CASES, ids=lambda c: c[0])
def test_kernels_apply_score_mod(case):
    dtype_name, shape, fn, dense, kw = case
    _kernel_case(np.random.default_rng(7), dtype_name, *shape, fn, dense, **kw)


def test_kernel_packed_batch_passes_the_sequence_as_b():
    from numba_flash.varlen import check_varlen

    rng = np.random.default_rng(8)
    lens_q, lens_k = [5, 1, 9], [7, 2, 9]
    q, k, v = (rng.standard_normal((sum(n), h, 32)).astype(np.float32)
               for n, h in ((lens_q, 2), (lens_k, 1), (lens_k, 1)))
    cu_q = np.cumsum([0] + lens_q).astype(np.int32)
    cu_k = np.cumsum([0] + lens_k).astype(np.int32)
    want = numba_flash.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True,
                                 score_mod=relative_bias)
    vl = check_varlen(to_device(cu_q), to_device(cu_k), None if SIMULATOR else max(lens_q),
                      None if SIMULATOR else max(lens_k), len(q), len(k),
                      "numpy" if SIMULATOR else "cuda")
    out = launch.attention_cuda(*(to_device(x) for x in (q, k, v)), softmax_scale=32 ** -0.5,
                                causal=True, score_mod=relative_bias, varlen=vl)
    np.testing.assert_allclose(to_host(out), want, atol=2e-5)


@gpu
@pytest.mark.parametrize("dtype_name,d", [("float16", 64), ("float16", 128), ("bfloat16", 128)])
def test_gpu_both_half_precision_paths(monkeypatch, dtype_name, d):
    """wgmma (Hopper) and mma.sync kernels with score_mod, a mask and GQA, odd sizes."""
    for enabled in (True, False):
        monkeypatch.setattr(launch, "WGMMA_ENABLED", enabled)
        _kernel_case(np.random.default_rng(9), dtype_name, 2, 333, 517, 4, 2, d, relative_bias,
                     _dense_relative_bias, causal=True)
        _kernel_case(np.random.default_rng(10), dtype_name, 1, 300, 300, 4, 1, d,
                     head_scaled_distance, _dense_head_scaled,
                     mask=masks.document([100, 77, 123]))


def test_slow_scalar_fallback_warns_once(monkeypatch):
    """A score_mod that cannot take arrays runs per score; from SLOW_CALLS scores on the
    reference says so (once per function), and the result is still exact."""
    from numba_flash_reference import elementwise

    monkeypatch.setattr(elementwise, "SLOW_CALLS", 100)
    rng = np.random.default_rng(11)
    q, k, v = _qkv(rng, 1, 9, 12, 2, 1, 8)

    def scalar_bias(score, b, h, q_idx, kv_idx):
        return score + math.sqrt(abs(q_idx - kv_idx))   # math on arrays raises: per score

    with pytest.warns(RuntimeWarning, match="called once per element"):
        got = reference(q, k, v, score_mod=scalar_bias)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reference(q, k, v, score_mod=scalar_bias)           # no second warning
    dist = np.sqrt(np.abs(np.arange(9)[:, None] + 3 - np.arange(12)[None, :]))
    want = dense_attention(q, k, v, 8 ** -0.5, np.broadcast_to(dist, (1, 2, 9, 12)), True)
    np.testing.assert_allclose(got, want, atol=1e-13)
