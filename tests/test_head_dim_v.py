"""v's head dim unlike q's and k's (head_dim_v != head_dim_qk, DeepSeek MLA's 192 / 128): the
reference, CPU mode, packed batches, and the GPU path (zero padding to the larger dim, in the
simulator on NumPy arrays), forward and backward."""
from __future__ import annotations

import numpy as np
import pytest

import numba_flash
from numba_flash.cuda.primitives import SIMULATOR


def dense(q, k, v, scale, visible):
    """Float64 attention of (B, Sq, Hq, D) q, (B, Sk, Hkv, D) k and (B, Sk, Hkv, Dv) v."""
    g = q.shape[2] // k.shape[2]
    kk, vv = (np.repeat(x.astype(np.float64), g, axis=2) for x in (k, v))
    s = np.einsum("bqhd,bkhd->bhqk", q.astype(np.float64), kk) * scale
    s = np.where(visible, s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", p, vv)


def _inputs(rng, dqk, dv, dtype=np.float32, b=2, sq=9, sk=13, hq=4, hkv=2):
    q = rng.standard_normal((b, sq, hq, dqk)).astype(dtype)
    k = rng.standard_normal((b, sk, hkv, dqk)).astype(dtype)
    v = rng.standard_normal((b, sk, hkv, dv)).astype(dtype)
    return q, k, v


@pytest.mark.parametrize("dqk,dv", [(24, 16), (16, 40)])
def test_cpu_mode(dqk, dv):
    q, k, v = _inputs(np.random.default_rng(dqk + dv), dqk, dv)
    out, lse = numba_flash.attention(q, k, v, causal=True, return_lse=True)
    assert out.shape == (2, 9, 4, dv) and out.dtype == np.float32 and lse.shape == (2, 4, 9)
    visible = np.tril(np.ones((9, 13), bool), 13 - 9)
    np.testing.assert_allclose(out, dense(q, k, v, dqk ** -0.5, visible), rtol=0, atol=2e-6)
    # the scale's default is 1/sqrt(head_dim_qk): lse is v's business not at all
    _, lse_same = numba_flash.attention(q, k, k, causal=True, return_lse=True)
    np.testing.assert_array_equal(lse, lse_same)


def test_packed_batch_cpu_mode():
    rng = np.random.default_rng(3)
    q = rng.standard_normal((11, 2, 16)).astype(np.float32)
    k = rng.standard_normal((15, 1, 16)).astype(np.float32)
    v = rng.standard_normal((15, 1, 8)).astype(np.float32)
    cu_q, cu_k = np.array([0, 4, 11], np.int32), np.array([0, 6, 15], np.int32)
    out = numba_flash.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True)
    assert out.shape == (11, 2, 8)
    for s in range(2):
        rq, rk = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        nq, nk = rq.stop - rq.start, rk.stop - rk.start
        expect = dense(q[None, rq], k[None, rk], v[None, rk], 0.25,
                       np.tril(np.ones((nq, nk), bool), nk - nq))
        np.testing.assert_allclose(out[rq], expect[0], rtol=0, atol=2e-6)


@pytest.mark.skipif(not SIMULATOR, reason="NumPy arrays reach the kernels only in the simulator")
@pytest.mark.parametrize("dqk,dv", [(32, 16), (16, 32)])
def test_kernels_by_padding(dqk, dv):
    q, k, v = _inputs(np.random.default_rng(7), dqk, dv, b=1, sq=9, sk=11, hq=2, hkv=1)
    out, lse = numba_flash.attention(q, k, v, causal=True, return_lse=True, backend="cuda")
    ref, ref_lse = numba_flash.attention(q, k, v, causal=True, return_lse=True)
    assert out.shape == ref.shape == (1, 9, 2, dv)
    np.testing.assert_allclose(out, ref, rtol=0, atol=2e-6)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-6, atol=1e-6)


def test_mismatches_are_named():
    q, k, v = _inputs(np.random.default_rng(1), 16, 8)
    with pytest.raises(ValueError, match=r"k and v must have the same \(batch, seqlen_k, "
                                         r"heads_kv\).*v's head_dim may differ"):
        numba_flash.attention(q, k, v[:, :5])
    with pytest.raises(ValueError, match="q and k must have the same head_dim"):
        numba_flash.attention(q, k[..., :8], v)
    out, lse = numba_flash.attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match=r"dout must have the forward output's shape "
                                         r"\(2, 9, 4, 8\) \(q's with v's head_dim\)"):
        numba_flash.attention_backward(np.ones(q.shape, q.dtype), q, k, v, out, lse)


def dense_grads(q, k, v, dout, scale, visible):
    """dq, dk, dv of dense float64 attention (GQA: dk, dv summed over each group)."""
    g = q.shape[2] // k.shape[2]
    q, k, v, dout = (x.astype(np.float64) for x in (q, k, v, dout))
    kk, vv = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    s = np.where(visible, np.einsum("bqhd,bkhd->bhqk", q, kk) * scale, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    dp = np.einsum("bqhd,bkhd->bhqk", dout, vv)
    ds = p * (dp - (p * dp).sum(axis=-1, keepdims=True))
    dq = scale * np.einsum("bhqk,bkhd->bqhd", ds, kk)
    dk = scale * np.einsum("bhqk,bqhd->bkhd", ds, q)
    dv = np.einsum("bhqk,bqhd->bkhd", p, dout)
    fold = lambda x: x.reshape(x.shape[:2] + (k.shape[2], g, x.shape[3])).sum(axis=3)  # noqa
    return dq, fold(dk), fold(dv)


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
@pytest.mark.parametrize("dqk,dv", [(32, 16), (16, 32)])
def test_backward(backend, dqk, dv):
    """Gradients with v's head dim unlike q's (every array padded to the larger dim), in CPU
    mode and on the kernels (simulator), against a dense float64 computation."""
    if backend == "cuda" and not SIMULATOR:
        pytest.skip("NumPy arrays reach the kernels only in the simulator")
    rng = np.random.default_rng(dqk * 3 + dv)
    q, k, v = _inputs(rng, dqk, dv, b=1, sq=9, sk=11, hq=2, hkv=1)
    dout = rng.standard_normal(q.shape[:3] + (dv,)).astype(np.float32)
    out, lse = numba_flash.attention(q, k, v, causal=True, return_lse=True)
    grads = numba_flash.attention_backward(dout, q, k, v, out, lse, causal=True,
                                           backend=backend)
    expect = dense_grads(q, k, v, dout, dqk ** -0.5, np.tril(np.ones((9, 11), bool), 2))
    for g, e, like in zip(grads, expect, (q, k, v)):
        assert g.shape == like.shape and g.dtype == np.float32 and g.flags.c_contiguous
        np.testing.assert_allclose(g, e, rtol=0, atol=1e-5 * np.abs(e).max())


def test_decode_cpu_mode_and_gpu_refusal():
    """decode takes v_cache with its own head dim in CPU mode (the same answer as attention on
    the cache's filled rows); on the GPU it refuses (padding a cache would copy it per call)."""
    rng = np.random.default_rng(5)
    q = rng.standard_normal((2, 1, 4, 16)).astype(np.float32)
    k_cache = rng.standard_normal((2, 20, 2, 16)).astype(np.float32)
    v_cache = rng.standard_normal((2, 20, 2, 8)).astype(np.float32)
    lens = np.array([13, 20], np.int32)
    out = numba_flash.decode(q, k_cache, v_cache, cache_seqlens=lens)
    assert out.shape == (2, 1, 4, 8)
    for b in range(2):
        expect = numba_flash.attention(q[b:b + 1], k_cache[b:b + 1, :lens[b]],
                                       v_cache[b:b + 1, :lens[b]])
        np.testing.assert_allclose(out[b:b + 1], expect, rtol=0, atol=1e-6)
    if SIMULATOR:
        with pytest.raises(NotImplementedError, match="decode on the GPU takes v_cache with "
                                                      "k_cache's head_dim"):
            numba_flash.decode(q, k_cache, v_cache, cache_seqlens=lens, backend="cuda")
