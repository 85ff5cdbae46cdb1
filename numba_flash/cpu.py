"""CPU mode: exact attention on NumPy arrays through the float64 reference.

The reference (``numba_flash_reference.attention``) is the specification, so CPU mode gives the
answer every backend is measured against, rounded once to the input dtype. The reference works
through query rows in chunks, so its temporaries stay small whatever the sequence lengths.
"""
from __future__ import annotations

import numpy as np

__all__ = ["attention_cpu", "lse_dtype"]


def lse_dtype(dtype) -> np.dtype:
    """The lse's dtype for inputs of ``dtype``: float64 for float64 inputs (a float32 lse would
    limit their gradients to ~1e-7 relative), float32 otherwise."""
    return np.dtype(np.float64 if np.dtype(dtype) == np.float64 else np.float32)


def attention_cpu(q, k, v, *, softmax_scale, causal=False, window_size=(-1, -1), sinks=0,
                  mask=None, softcap=None, alibi_slopes=None, score_mod=None, return_lse=False):
    """Exact attention on validated NumPy arrays.

    q: (B, Sq, Hq, D), k, v: (B, Sk, Hkv, D), all one dtype among float16, bfloat16
    (ml_dtypes), float32, float64; any strides. softmax_scale must be a float (already resolved).
    Returns out (B, Sq, Hq, D) in the input dtype, and with return_lse also lse (B, Hq, Sq)
    float32, float64 for float64 inputs (natural log; -inf for a query row that sees no key, whose output is 0).
    alibi_slopes: None or float (Hq,) / (B, Hq); score_mod: None or fn(score, b, h, q_idx,
    kv_idx); see the reference.
    """
    from numba_flash_reference.attention import attention as reference_attention
    from numba_flash_reference.precision import round_to

    out64, lse64 = reference_attention(q, k, v, softmax_scale=softmax_scale, causal=causal,
                                       window_size=window_size, sinks=sinks, mask=mask,
                                       softcap=softcap, alibi_slopes=alibi_slopes,
                                       score_mod=score_mod, return_lse=True)
    # One correct rounding to the input dtype (ml_dtypes alone rounds bfloat16 twice, via float32).
    out = round_to(out64, q.dtype).astype(q.dtype)
    return (out, lse64.astype(lse_dtype(q.dtype))) if return_lse else out
