"""CPU mode: exact attention on NumPy arrays through the float64 reference.

The reference (``numba_flash_reference.attention``) is the specification, so CPU mode gives the
answer every backend is measured against, rounded once to the input dtype. The reference works
through query rows in chunks, so its temporaries stay small whatever the sequence lengths.
"""
from __future__ import annotations

import numpy as np

__all__ = ["attention_cpu", "round_from_float64"]


def round_from_float64(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Round float64 ``x`` to ``dtype`` once, to nearest (ties to even).

    NumPy rounds float64 to float16/float32 correctly, but ml_dtypes casts float64 to bfloat16
    through float32, which can round twice. Rounding to float32 *to odd* first (truncate, then
    set the last bit if anything was cut off) makes the second rounding exact, since float32
    keeps 16 more significand bits than bfloat16.
    """
    dtype = np.dtype(dtype)
    if dtype.name != "bfloat16":
        return x.astype(dtype)
    x = np.asarray(x, dtype=np.float64)
    near = x.astype(np.float32)
    overshot = np.abs(near.astype(np.float64)) > np.abs(x)
    trunc = np.where(overshot, np.nextafter(near, np.float32(0)), near)
    inexact = trunc.astype(np.float64) != x
    bits = trunc.view(np.uint32) | inexact.astype(np.uint32)
    return bits.view(np.float32).astype(dtype)


def attention_cpu(q, k, v, *, softmax_scale, causal=False, window_size=(-1, -1), sinks=0,
                  mask=None, softcap=None, return_lse=False):
    """Exact attention on validated NumPy arrays.

    q: (B, Sq, Hq, D), k, v: (B, Sk, Hkv, D), all one dtype among float16, bfloat16
    (ml_dtypes), float32, float64; any strides. softmax_scale must be a float (already resolved).
    Returns out (B, Sq, Hq, D) in the input dtype, and with return_lse also lse (B, Hq, Sq)
    float32 (natural log; -inf for a query row that sees no key, whose output is 0).
    """
    from numba_flash_reference.attention import attention as reference_attention

    out64, lse64 = reference_attention(q, k, v, softmax_scale=softmax_scale, causal=causal,
                                       window_size=window_size, sinks=sinks, mask=mask,
                                       softcap=softcap, return_lse=True)
    out = round_from_float64(out64, q.dtype)
    return (out, lse64.astype(np.float32)) if return_lse else out
