"""User mask functions (``masks.mask_mod``): the reference's evaluation (vectorised and pair by
pair), (b, h)-dependent masks in the reference attention, a captured document-id array, and
ALiBi in the reference."""
from __future__ import annotations

import numpy as np
import pytest

import numba_flash
from numba_flash import masks
from numba_flash_reference.attention import attention as reference


def test_vectorised_and_scalar_bodies_agree_with_builtin_masks():
    causal_vec = masks.mask_mod(lambda b, h, q, kv: kv <= q)

    def causal_scalar(b, h, q, kv):
        if kv <= q:  # an `if` on arrays raises: the reference falls back to a loop
            return True
        return False

    for sq, sk in ((7, 7), (3, 9), (9, 4)):
        want = masks.causal().to_dense(sq, sk)
        np.testing.assert_array_equal(causal_vec.to_dense(sq, sk), want)
        np.testing.assert_array_equal(masks.mask_mod(causal_scalar).to_dense(sq, sk), want)


def test_captured_document_ids_equal_causal_document():
    lengths = [5, 1, 7, 4]
    doc = np.repeat(np.arange(len(lengths)), lengths).astype(np.int32)
    m = masks.mask_mod(lambda b, h, q, kv: (doc[q] == doc[kv]) & (kv <= q))
    np.testing.assert_array_equal(m.to_dense(17, 17), masks.causal_document(lengths).to_dense(17, 17))


def test_batch_head_dependent_mask_in_reference_attention():
    rng = np.random.default_rng(0)
    b, s, hq, hkv, d = 2, 11, 4, 2, 8
    q = rng.standard_normal((b, s, hq, d))
    k = rng.standard_normal((b, s, hkv, d))
    v = rng.standard_normal((b, s, hkv, d))
    # Head h sees a window of h + 1 keys back; batch 1 is also causal-only.
    m = masks.mask_mod(lambda bb, h, qi, kv: (kv <= qi) & ((qi - kv <= h) | (bb == 1)),
                       batch_head=True)
    assert m.depends_on_batch_head and (m & masks.causal()).depends_on_batch_head
    out = reference(q, k, v, mask=m)
    for bb in range(b):
        for h in range(hq):
            window = (-1, 0) if bb == 1 else (h, 0)
            want = reference(q[bb:bb + 1, :, h:h + 1], k[bb:bb + 1, :, h // 2:h // 2 + 1],
                             v[bb:bb + 1, :, h // 2:h // 2 + 1], window_size=window)
            np.testing.assert_allclose(out[bb, :, h], want[0, :, 0], atol=1e-13)
    with pytest.raises(ValueError, match="depends on"):
        m.to_dense(3, 3)
    # CPU mode takes it too.
    cpu = numba_flash.attention(q, k, v, mask=m)
    np.testing.assert_allclose(cpu, out, atol=1e-13)


def test_mask_mod_validation():
    with pytest.raises(TypeError, match="callable"):
        masks.mask_mod(3)
    with pytest.raises(TypeError, match="batch_head"):
        masks.mask_mod(lambda b, h, q, k: True, batch_head=1)


def test_alibi_in_reference_matches_dense_formula():
    rng = np.random.default_rng(4)
    b, sq, sk, h, d = 2, 5, 9, 3, 8
    q, k, v = (rng.standard_normal(s) for s in ((b, sq, h, d), (b, sk, h, d), (b, sk, h, d)))
    slopes = rng.random((b, h))
    out = reference(q, k, v, causal=True, alibi_slopes=slopes, softcap=3.0)
    i = np.arange(sq)[:, None] + sk - sq
    j = np.arange(sk)[None, :]
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d)
    s = 3.0 * np.tanh(s / 3.0) - slopes[:, :, None, None] * np.abs(i - j)
    s = np.where(j <= i, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), v)
    np.testing.assert_allclose(out, want, atol=1e-12)
    with pytest.raises(ValueError, match="alibi_slopes must have shape"):
        reference(q, k, v, alibi_slopes=slopes[:, :2])
    # float64 slopes (NumPy's default) are accepted: CPU mode computes in float64 either way
    np.testing.assert_array_equal(
        numba_flash.attention(q, k, v, causal=True, alibi_slopes=slopes, softcap=3.0),
        numba_flash.attention(q, k, v, causal=True, alibi_slopes=slopes.astype(np.float64),
                              softcap=3.0))
