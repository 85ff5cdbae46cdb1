"""Exact dense attention in float64, and the argument checks every front end shares.

Scores ``s = scale * q.k`` (scale defaults to 1/sqrt(head_dim)), then ``softcap * tanh(s /
softcap)`` when a softcap is given, then the ALiBi bias, then ``score_mod(s, b, h, q_idx, kv_idx)``
when one is given, then the mask (``masks.mask_from_flags``: causal / window / sinks flags
intersected with an optional ``Mask``). Softmax over the visible keys of each query row; a row
with no visible key (or whose visible scores are all -inf) gives output 0 and lse -inf. NaN and inf
in q, k, v reach exactly the rows that see them (``attention``'s docstring).

The checks (``check_shapes``, ``check_softmax_scale``, ``check_softcap``, ``check_problem``) work on
shapes and plain numbers, so a front end holding CuPy arrays can run them before dispatching.
"""
from __future__ import annotations

import inspect
import math
from typing import NamedTuple

import ml_dtypes
import numpy as np

from . import masks as _masks
from .elementwise import call_elementwise

__all__ = ["attention", "check_shapes", "check_input_dtype", "check_softmax_scale", "check_softcap",
           "check_problem", "check_alibi_slopes", "check_score_mod", "Problem", "visible_block",
           "visible_bh", "as_float_arrays", "apply_score_mod", "scores_block"]

# Score elements (batch * heads_q * rows * keys) per query-row chunk: 2**21 float64 = 16 MiB, so a
# chunk's temporaries stay small (16 MiB each) unless one row of scores is larger.
_CHUNK_ELEMENTS = 1 << 21


class Problem(NamedTuple):
    """A validated attention problem (sizes, scalars and the one combined mask)."""
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    softmax_scale: float
    softcap: float | None
    mask: _masks.Mask | None  # None: every pair visible
    alibi_slopes: np.ndarray | None = None  # float64 (batch, heads_q), or None
    score_mod: object = None                # fn(score, b, h, q_idx, kv_idx) -> float, or None

    @property
    def group(self) -> int:
        """Query heads per kv head (1 = MHA, heads_q = MQA)."""
        return self.heads_q // self.heads_kv


def check_shapes(q_shape, k_shape, v_shape) -> tuple[int, int, int, int, int, int]:
    """Validate q (B, Sq, Hq, D), k (B, Sk, Hkv, D) and v (B, Sk, Hkv, Dv) shapes (v's head dim
    may differ from q's and k's, as in DeepSeek MLA's 192 / 128 prefill; out takes Dv).

    Returns ``(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim)`` as ints (head_dim of q
    and k). Raises ValueError naming the argument for a wrong rank, mismatched batch / seqlen_k /
    heads_kv / q-k head_dim, an empty head dimension, or heads_q not a multiple of heads_kv.
    """
    shapes = {"q": tuple(q_shape), "k": tuple(k_shape), "v": tuple(v_shape)}
    for name, shape in shapes.items():
        if len(shape) != 4:
            layout = "(batch, seqlen_q, heads_q, head_dim)" if name == "q" else \
                "(batch, seqlen_k, heads_kv, head_dim)"
            raise ValueError(f"{name} must have rank 4 {layout}, got shape {shape}")
    (b, sq, hq, d), (bk, sk, hkv, dk), (bv, sv, hv, dv) = shapes["q"], shapes["k"], shapes["v"]
    if not (b == bk == bv):
        raise ValueError(f"batch sizes differ: q {shapes['q']}, k {shapes['k']}, v {shapes['v']}")
    if sk != sv:
        raise ValueError(f"k and v must have the same seqlen_k, got k {shapes['k']}, v {shapes['v']}")
    if hkv != hv:
        raise ValueError(f"k and v must have the same heads_kv, got k {shapes['k']}, v {shapes['v']}")
    if d != dk:
        raise ValueError(f"q and k must have the same head_dim, got q {shapes['q']}, k "
                         f"{shapes['k']} (v's head_dim may differ)")
    if d < 1 or dv < 1:
        raise ValueError(f"head dims must be >= 1, got q {shapes['q']}, v {shapes['v']}")
    if hkv < 1 or hq < 1 or hq % hkv:
        raise ValueError(f"heads_q ({hq}) must be a positive multiple of heads_kv ({hkv}) for "
                         f"GQA/MQA; got q {shapes['q']}, k {shapes['k']}")
    return int(b), int(sq), int(sk), int(hq), int(hkv), int(d)


def check_input_dtype(dtype, name: str) -> np.dtype:
    """Accept a real floating dtype (NumPy float16/32/64, ml_dtypes bfloat16 and other ml_dtypes
    floats); raise TypeError naming ``name`` otherwise. Returns the ``np.dtype``."""
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        return dtype
    if dtype.kind == "V":
        try:
            ml_dtypes.finfo(dtype)
            return dtype
        except (ValueError, TypeError):
            pass
    raise TypeError(f"{name} must hold real floating-point values (float16/bfloat16/float32/"
                    f"float64), got dtype {dtype}")


def check_softmax_scale(softmax_scale, head_dim: int) -> float:
    """The score scale: ``1/sqrt(head_dim)`` for None, else a finite non-zero real number."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, (bool, np.bool_)) or not isinstance(
            softmax_scale, (int, float, np.integer, np.floating)):
        raise TypeError(f"softmax_scale must be a real number or None, got "
                        f"{type(softmax_scale).__name__} {softmax_scale!r}")
    value = float(softmax_scale)
    if not math.isfinite(value) or value == 0.0:
        raise ValueError(f"softmax_scale must be finite and non-zero, got {softmax_scale!r}")
    return value


def check_softcap(softcap) -> float | None:
    """The softcap: None (or 0.0, flash-attn's spelling of "off") for none, else a finite float > 0."""
    if softcap is None:
        return None
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(
            softcap, (int, float, np.integer, np.floating)):
        raise TypeError(f"softcap must be a positive real number or None, got "
                        f"{type(softcap).__name__} {softcap!r}")
    value = float(softcap)
    if value == 0.0:
        return None
    if not math.isfinite(value) or value < 0.0:
        raise ValueError(f"softcap must be a finite number > 0 (or None / 0.0 for no softcap), "
                         f"got {softcap!r}")
    return value


def check_alibi_slopes(alibi_slopes, batch: int, heads_q: int) -> np.ndarray | None:
    """ALiBi slopes as float64 (batch, heads_q): None stays None; (heads_q,) is shared by the
    batch; (batch, heads_q) is per sequence (flash-attn's shapes). Finite reals only."""
    if alibi_slopes is None:
        return None
    try:
        arr = np.asarray(alibi_slopes)
    except Exception:
        raise TypeError(f"alibi_slopes must be an array of floats, got "
                        f"{type(alibi_slopes).__name__}") from None
    if arr.dtype.kind not in "fiu":
        raise TypeError(f"alibi_slopes must hold real numbers, got dtype {arr.dtype}")
    if arr.shape not in ((heads_q,), (batch, heads_q)):
        raise ValueError(f"alibi_slopes must have shape (heads_q,) = ({heads_q},) or (batch, "
                         f"heads_q) = ({batch}, {heads_q}), got {arr.shape}")
    arr = np.broadcast_to(arr.astype(np.float64), (batch, heads_q))
    if not np.isfinite(arr).all():
        raise ValueError("alibi_slopes must be finite")
    return arr


def check_score_mod(score_mod):
    """``score_mod``: None or a callable ``fn(score, b, h, q_idx, kv_idx) -> float`` that
    accepts those 5 positional arguments (checked with ``inspect.signature`` where Python can
    read one; builtins and other callables without a signature pass). TypeError naming
    score_mod otherwise."""
    if score_mod is None:
        return None
    if not callable(score_mod):
        raise TypeError(f"score_mod must be None or a function fn(score, b, h, q_idx, kv_idx) "
                        f"-> float, got {type(score_mod).__name__} {score_mod!r}")
    try:
        signature = inspect.signature(score_mod)
    except (TypeError, ValueError):   # no readable signature (builtins, some C callables)
        return score_mod
    try:
        signature.bind(*range(5))
    except TypeError as exc:
        name = getattr(score_mod, "__name__", type(score_mod).__name__)
        raise TypeError(f"score_mod must accept 5 positional arguments (score, b, h, q_idx, "
                        f"kv_idx), got {name}{signature} ({exc})") from None
    return score_mod


def apply_score_mod(score_mod, s: np.ndarray, b, h, q_idx, kv_idx) -> np.ndarray:
    """``score_mod`` applied to every score of ``s`` (float64, any shape); ``b``, ``h``,
    ``q_idx`` (aligned query positions), ``kv_idx`` (key positions) are integer arrays that
    broadcast to ``s``. One vectorised call when the function allows, else one call per score
    (``elementwise.call_elementwise``). Returns float64 of ``s``'s shape."""
    got = call_elementwise(score_mod, (s, b, h, q_idx, kv_idx), "fiu")
    return np.array(np.broadcast_to(got, s.shape), dtype=np.float64)


def check_problem(q_shape, k_shape, v_shape, *, softmax_scale=None, causal=False,
                  window_size=(-1, -1), sinks=0, mask=None, softcap=None,
                  alibi_slopes=None, score_mod=None) -> Problem:
    """Run every argument check of ``attention`` on shapes and scalars; return a ``Problem``.

    The mask fields are combined with ``masks.mask_from_flags`` and checked against the sequence
    lengths (a mask built for other sizes raises ValueError).
    """
    b, sq, sk, hq, hkv, d = check_shapes(q_shape, k_shape, v_shape)
    scale = check_softmax_scale(softmax_scale, d)
    cap = check_softcap(softcap)
    combined = _masks.mask_from_flags(causal, window_size, sinks, mask)
    if combined is not None:
        combined._check_sizes(sq, sk)
    slopes = check_alibi_slopes(alibi_slopes, b, hq)
    return Problem(b, sq, sk, hq, hkv, d, scale, cap, combined, slopes,
                   check_score_mod(score_mod))


def visible_block(mask: _masks.Mask | None, seqlen_q: int, seqlen_k: int, rows, cols) -> np.ndarray:
    """Visibility of (query row, key column) pairs, without building the dense matrix.

    ``rows`` and ``cols`` are integer arrays of row indices (0..seqlen_q-1) and column indices
    (0..seqlen_k-1) that broadcast against each other, e.g. (r, 1) and (1, c) for a block, or
    (t, r, 1) and (t, 1, c) for t tiles at once. Returns a bool array of the broadcast shape, equal
    to the matching entries of ``mask.to_dense(seqlen_q, seqlen_k)`` (all True for ``mask=None``).
    """
    rows = np.asarray(rows, dtype=np.int64)
    cols = np.asarray(cols, dtype=np.int64)
    shape = np.broadcast_shapes(rows.shape, cols.shape)
    if mask is None:
        return np.ones(shape, dtype=bool)
    qpos = rows + (seqlen_k - seqlen_q)
    return np.ascontiguousarray(np.broadcast_to(mask._visible(qpos, cols, seqlen_k), shape),
                                dtype=bool)


def visible_bh(mask: _masks.Mask, batch: int, heads_q: int, heads_kv: int, seqlen_q: int,
               seqlen_k: int, rows, cols) -> np.ndarray:
    """Visibility of a (b, h)-dependent mask: bool (batch, heads_kv, group, *block), query head
    h = kv head * group + index, for the row / column index arrays ``rows`` and ``cols``."""
    rows = np.asarray(rows, dtype=np.int64)
    cols = np.asarray(cols, dtype=np.int64)
    block = np.broadcast_shapes(rows.shape, cols.shape)
    g = heads_q // heads_kv
    out = np.empty((batch, heads_kv, g) + block, dtype=bool)
    qpos = rows + (seqlen_k - seqlen_q)
    for bi in range(batch):
        for h in range(heads_q):
            out[bi, h // g, h % g] = mask._visible_bh(bi, h, qpos, cols, seqlen_k)
    return out


def as_float_arrays(q, k, v) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q, k, v as NumPy arrays (no copy), each checked to hold a real floating dtype."""
    arrays = tuple(np.asarray(x) for x in (q, k, v))
    for name, x in zip("qkv", arrays):
        check_input_dtype(x.dtype, name)
    return arrays


def scores_block(q_rows: np.ndarray, k_cols_t: np.ndarray, problem: Problem, rows, cols, *,
                 apply_mask: bool = True, with_softcap_grad: bool = False):
    """Scores of a block of query rows against a block of key columns, as attention defines them.

    q_rows: float64 (B, Hkv, G, R, D), query head h = kv head * G + index; k_cols_t: float64
    (B, Hkv, 1, D, C) (keys transposed); rows: int64 (R, 1) query-row indices; cols: int64 (1, C)
    key-column indices (positions in the full key sequence). Returns s, float64
    (B, Hkv, G, R, C): ``scale * q.k``, then the softcap, ALiBi and score_mod, then -inf where
    the problem's mask hides the pair (skipped with ``apply_mask=False``, for tiles known to be
    fully visible). With ``with_softcap_grad`` returns (s, dcap): dcap float64 of s's shape, the
    derivative ``1 - tanh^2(scale*q.k / softcap)`` of the capped score, or None without softcap.
    """
    b, sq, sk, hq, hkv = problem[:5]
    g = problem.group
    s = np.matmul(q_rows, k_cols_t)
    s *= problem.softmax_scale
    dcap = None
    if problem.softcap is not None:
        capped = np.tanh(s / problem.softcap)
        if with_softcap_grad:
            dcap = 1.0 - capped * capped
        s = problem.softcap * capped
    if problem.alibi_slopes is not None:  # -slope * |i - j| on aligned positions
        dist = np.abs(rows + (sk - sq) - cols).astype(np.float64)
        s -= problem.alibi_slopes.reshape(b, hkv, g, 1, 1) * dist
    if problem.score_mod is not None:   # batch b, query head h = kv head * g + index
        s = apply_score_mod(problem.score_mod, s, np.arange(b).reshape(b, 1, 1, 1, 1),
                            np.arange(hq).reshape(1, hkv, g, 1, 1), rows + (sk - sq), cols)
    if apply_mask and problem.mask is not None:
        if problem.mask.depends_on_batch_head:
            s[~visible_bh(problem.mask, b, hq, hkv, sq, sk, rows, cols)] = -np.inf
        else:
            s[..., ~visible_block(problem.mask, sq, sk, rows, cols)] = -np.inf
    return (s, dcap) if with_softcap_grad else s


def _scores(qc: np.ndarray, kt: np.ndarray, problem: Problem, r0: int, r1: int,
            cols: np.ndarray) -> np.ndarray:
    """Scores of query rows [r0, r1) against the key columns ``cols`` (1, c): float64
    (B, Hkv, G, rows, c) after the scale, softcap, ALiBi, score_mod and the mask (invisible
    pairs -inf). ``qc``: the rows' queries (B, Hkv, G, rows, D); ``kt``: (B, Hkv, 1, D, c)."""
    b, sq, hq, hkv = problem.batch, problem.seqlen_q, problem.heads_q, problem.heads_kv
    g = problem.group
    with np.errstate(invalid="ignore", over="ignore"):   # inf / NaN inputs: IEEE results
        s = np.matmul(qc, kt)
        s *= problem.softmax_scale
        if problem.softcap is not None:
            s = problem.softcap * np.tanh(s / problem.softcap)
    rows_ = np.arange(r0, r1)[:, None]
    if problem.alibi_slopes is not None:  # -slope * |i - j| on aligned positions
        dist = np.abs(rows_ + (problem.seqlen_k - sq) - cols).astype(np.float64)
        s -= problem.alibi_slopes.reshape(b, hkv, g, 1, 1) * dist
    if problem.score_mod is not None:   # batch b, query head h = kv head * g + index
        s = apply_score_mod(problem.score_mod, s, np.arange(b).reshape(b, 1, 1, 1, 1),
                            np.arange(hq).reshape(1, hkv, g, 1, 1),
                            rows_ + (problem.seqlen_k - sq), cols)
    if problem.mask is not None and problem.mask.depends_on_batch_head:
        s[~visible_bh(problem.mask, b, hq, hkv, sq, problem.seqlen_k, rows_, cols)] = -np.inf
    else:
        s[..., ~visible_block(problem.mask, sq, problem.seqlen_k, rows_, cols)] = -np.inf
    return s


def _nonfinite_values(p: np.ndarray, reached: np.ndarray, vt: np.ndarray) -> np.ndarray:
    """What the non-finite entries of v add to ``sum_j p[..., j] * v[j, d]`` over the pairs
    that reach each row (``reached``: score not -inf): NaN where a NaN meets a reaching pair, or
    an inf meets a zero weight (0 * inf), or infs of both signs meet; else +-inf where an inf
    meets a positive weight; 0 elsewhere (no non-finite contribution). Shapes: p and reached
    (B, Hkv, G, rows, Sk), vt (B, Hkv, 1, Sk, D); returns (B, Hkv, G, rows, D)."""
    def hits(weight, cond):
        return np.matmul(weight.astype(np.float64), cond.astype(np.float64)) > 0

    positive = reached & (p > 0)
    nan = hits(reached, np.isnan(vt)) | hits(reached & (p == 0), np.isinf(vt))
    pos, neg = hits(positive, np.isposinf(vt)), hits(positive, np.isneginf(vt))
    nan |= pos & neg
    return np.where(nan, np.nan, np.where(pos, np.inf, np.where(neg, -np.inf, 0.0)))


def _softmax_rows(s: np.ndarray, vt: np.ndarray, v_finite: bool):
    """Softmax of the scores ``s`` (B, Hkv, G, rows, Sk; -inf = the pair does not reach the row)
    applied to ``vt`` (B, Hkv, 1, Sk, D). Returns o (B, Hkv, G, rows, D) and lse
    (B, Hkv, G, rows), with the rules of ``attention``'s docstring for empty and poisoned rows.
    ``v_finite``: whether vt is all finite (skips the non-finite pass)."""
    m = s.max(axis=-1, keepdims=True)         # NaN if a reaching score is NaN (np.max propagates)
    empty = np.isneginf(m)                    # no reaching pair: out 0, lse -inf
    poisoned = np.isnan(m) | np.isposinf(m)   # a NaN or +inf score: out NaN, lse NaN
    shift = np.where(empty | poisoned, 0.0, m)
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.exp(s - shift)
        l = p.sum(axis=-1, keepdims=True)
        o = np.matmul(p, vt if v_finite else np.where(np.isfinite(vt), vt, 0.0))
        o = np.divide(o, l, out=np.zeros_like(o), where=~(empty | poisoned))
        if not v_finite:
            extra = _nonfinite_values(p, ~np.isneginf(s), vt)
            o = np.where(extra != 0, extra, o)
        with np.errstate(divide="ignore"):
            lse = (shift + np.log(np.where(empty | poisoned, 1.0, l)))[..., 0]
    o = np.where(poisoned, np.nan, np.where(empty, 0.0, o))
    lse = np.where(poisoned[..., 0], np.nan, np.where(empty[..., 0], -np.inf, lse))
    return o, lse


def _attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, problem: Problem,
            col_start: int, col_stop: int) -> tuple[np.ndarray, np.ndarray]:
    """Attention of every query row over key columns [col_start, col_stop) of the problem.

    q (B, Sq, Hq, D), k / v (B, Sk, Hkv, D), any float dtypes (converted to float64 here, q one
    chunk at a time). The mask is evaluated at the columns' positions in the full key sequence.
    Returns out (B, Sq, Hq, D) and lse (B, Hq, Sq), float64.
    """
    b, sq, _, hq, hkv, d = problem[:6]
    dv = v.shape[-1]
    g = problem.group
    ncols = col_stop - col_start
    out = np.zeros((b, sq, hq, dv))
    lse = np.full((b, hq, sq), -np.inf)
    if sq == 0 or ncols == 0 or b == 0:
        return out, lse
    # (B, Hkv, 1, D, Sk) and (B, Hkv, 1, Sk, D): one kv head serves G query heads by broadcasting.
    kt = np.ascontiguousarray(k[:, col_start:col_stop].transpose(0, 2, 3, 1), np.float64)[:, :, None]
    vt = np.ascontiguousarray(v[:, col_start:col_stop].transpose(0, 2, 1, 3), np.float64)[:, :, None]
    v_finite = bool(np.isfinite(vt).all())
    cols = np.arange(col_start, col_stop)[None, :]
    chunk = max(1, _CHUNK_ELEMENTS // (b * hq * ncols))
    for r0 in range(0, sq, chunk):
        r1 = min(sq, r0 + chunk)
        rows = r1 - r0
        qc = q[:, r0:r1].astype(np.float64).reshape(b, rows, hkv, g, d).transpose(0, 2, 3, 1, 4)
        o, lc = _softmax_rows(_scores(qc, kt, problem, r0, r1, cols), vt, v_finite)
        out[:, r0:r1] = o.transpose(0, 3, 1, 2, 4).reshape(b, rows, hq, dv)
        lse[:, :, r0:r1] = lc.reshape(b, hq, rows)
    return out, lse


def attention(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), sinks=0,
              mask=None, softcap=None, alibi_slopes=None, score_mod=None, return_lse=False):
    """Exact attention, computed in float64.

    q: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim); any real
    float dtype (float16, ml_dtypes bfloat16, float32, float64), converted exactly to float64.
    heads_q must be a multiple of heads_kv; query head h reads kv head h // (heads_q // heads_kv).

    softmax_scale: score scale, default 1/sqrt(head_dim). softcap: None/0.0 (off) or > 0, giving
    ``softcap * tanh(s / softcap)``. alibi_slopes: None, or float (heads_q,) or (batch, heads_q):
    ``-slope * |i - j|`` (aligned positions) is added after the softcap. score_mod: None, or
    ``fn(score, b, h, q_idx, kv_idx) -> float`` (FlexAttention's), applied to every score after
    the softcap and ALiBi, before the mask: b the batch index, h the query head, q_idx the query's
    aligned position, kv_idx the key's. causal, window_size=(left, right) (-1 = unbounded),
    sinks and mask (a ``masks.Mask``) select the visible pairs, with bottom-right alignment when
    seqlen_q != seqlen_k (query row r sits at position r + seqlen_k - seqlen_q).

    Returns out, float64 (batch, seqlen_q, heads_q, head_dim); with ``return_lse`` the tuple
    (out, lse), lse float64 (batch, heads_q, seqlen_q), the natural-log log-sum-exp of each row's
    visible scores. A row with no visible key has out 0 and lse -inf.

    Non-finite values propagate to exactly the rows they reach (IEEE arithmetic on the visible
    pairs; invisible pairs are left out of every sum, never multiplied by 0). A pair (i, j)
    *reaches* row i when key j is visible to it and its final score s (after scale, softcap,
    ALiBi, score_mod) is not -inf; a -inf score acts like the mask. Per (batch, query head) row:
    a NaN or +inf among its reaching scores (NaN in q or k, or inf * 0, inf - inf, +inf from an
    inf in q or k) makes out[i, :] and lse[i] NaN; a row with no reaching pair keeps out 0 and
    lse -inf; otherwise lse is finite and out[i, d] is non-finite exactly when some reaching key
    j has a non-finite v[j, d] (NaN, or +-inf where a weight is positive and the infs share one
    sign). docs/api.md, "Non-finite inputs", states the rules with examples. Query rows are processed
    in chunks of about 2**21 scores (16 MiB per float64 temporary; at least one row per chunk),
    so memory beyond the inputs, the float64 copies of k and v, and the output stays bounded.
    """
    q, k, v = as_float_arrays(q, k, v)
    problem = check_problem(q.shape, k.shape, v.shape, softmax_scale=softmax_scale, causal=causal,
                            window_size=window_size, sinks=sinks, mask=mask, softcap=softcap,
                            alibi_slopes=alibi_slopes, score_mod=score_mod)
    out, lse = _attend(q, k, v, problem, 0, problem.seqlen_k)
    return (out, lse) if return_lse else out
