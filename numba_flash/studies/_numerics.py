"""Numerical helpers shared by the studies: inputs, error measures and a naive softmax.

Everything here is float64 NumPy holding values of a named precision ("float16", "bfloat16",
"float32", "float64"), rounded with the reference's ``round_to``; arrays use the library layout
(batch, seqlen, heads, head_dim) with batch = heads = 1.
"""
from __future__ import annotations

import numpy as np

from numba_flash_reference import Arithmetic, round_to
from numba_flash_reference.precision import precision_name

__all__ = ["SHORT", "short", "random_qkv", "row_errors", "error_stats", "naive_attention",
           "rows_of"]

#: Short labels of the precisions, for plots and CSV columns.
SHORT = {"float64": "fp64", "float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def short(precision) -> str:
    """Short label ("fp16", "bf16", "fp32", "fp64") of a precision name or dtype."""
    return SHORT[precision_name(precision)]


def random_qkv(rng: np.random.Generator, seqlen_q: int, seqlen_k: int, head_dim: int,
               in_dtype="float64", *, q_scale: float = 1.0):
    """Random standard-normal q (1, seqlen_q, 1, D), k and v (1, seqlen_k, 1, D).

    ``q_scale`` multiplies q before rounding (it sets the spread of the scores). Returns three
    float64 arrays whose values are representable in ``in_dtype``, so an exact float64 reference
    and an emulated low-precision run see the very same inputs.
    """
    q = rng.standard_normal((1, seqlen_q, 1, head_dim)) * q_scale
    k = rng.standard_normal((1, seqlen_k, 1, head_dim))
    v = rng.standard_normal((1, seqlen_k, 1, head_dim))
    return tuple(round_to(x, in_dtype) for x in (q, k, v))


def rows_of(out) -> np.ndarray:
    """An output (B, S, H, D) (or already (rows, D)) as float64 (rows, D)."""
    out = np.asarray(out, dtype=np.float64)
    return out.reshape(-1, out.shape[-1]) if out.ndim != 2 else out


def row_errors(out, ref) -> np.ndarray:
    """Norm-wise relative error of each output row: ||out_r - ref_r||_2 / ||ref_r||_2.

    out, ref: arrays of equal shape (..., D). Returns float64 (rows,); +inf for a row of ``out``
    holding inf or NaN. Rows where ``ref`` is exactly zero use the absolute error.
    """
    o, r = rows_of(out), rows_of(ref)
    if o.shape != r.shape:
        raise ValueError(f"out and ref must have the same shape, got {o.shape} and {r.shape}")
    with np.errstate(invalid="ignore", over="ignore"):
        num = np.linalg.norm(o - r, axis=1)
    den = np.linalg.norm(r, axis=1)
    err = num / np.where(den > 0, den, 1.0)
    err[~np.isfinite(o).all(axis=1)] = np.inf
    return err


def error_stats(out, ref) -> dict:
    """Summary of ``row_errors``: dict with ``max_rel`` (inf if any row is not finite),
    ``mean_rel`` (mean over the finite rows, NaN if none) and ``nonfinite`` (fraction of rows
    holding inf or NaN)."""
    err = row_errors(out, ref)
    finite = np.isfinite(err)
    return {
        "max_rel": float(err.max()) if err.size else float("nan"),
        "mean_rel": float(err[finite].mean()) if finite.any() else float("nan"),
        "nonfinite": float(1.0 - finite.mean()) if err.size else 0.0,
    }


def naive_attention(q, k, v, *, dtype, softmax_scale=None, subtract_max=True, score_shift=0.0):
    """Materialised softmax attention with every operation's result rounded to ``dtype``.

    What one writes with array operations in a low precision: S = scale * (q @ k^T),
    P = exp(S - rowmax(S)) / rowsum(...), O = P @ V, each of S, the shifted S, exp(.), the row
    sum, P and O stored in ``dtype``. Products and sums run wide (float64, like a BLAS call or a
    library reduction with a float32 accumulator) and are rounded once at the end. With
    ``subtract_max=False`` the row max is not subtracted (the textbook softmax that overflows);
    ``score_shift`` is added to every score (softmax is invariant under it, the naive
    evaluation is not).

    q (1, Sq, 1, D), k and v (1, Sk, 1, D) float arrays; returns float64 (Sq, D) holding
    ``dtype`` values (inf/NaN where the evaluation overflows or divides 0 by 0).
    """
    ar = Arithmetic(dtype)
    qm, km, vm = rows_of(q), rows_of(k), rows_of(v)
    scale = 1.0 / np.sqrt(qm.shape[1]) if softmax_scale is None else softmax_scale
    with np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore"):
        s = ar.mul(ar.round(qm @ km.T), ar.const(scale))
        if score_shift:
            s = ar.add(s, ar.const(score_shift))
        if subtract_max:
            s = ar.sub(s, s.max(axis=1, keepdims=True))
        e = ar.func(np.exp, s)
        total = ar.rowsum(e)
        p = ar.div(e, total[:, None])
        out = ar.round(p.astype(np.float64) @ vm)
    return np.asarray(out, dtype=np.float64)
