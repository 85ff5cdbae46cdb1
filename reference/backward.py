"""Exact attention gradients in float64: a dense oracle and the tiled walk the GPU kernel follows.

With scores ``S = scale * Q K^T``, the softcap ``T = c * tanh(S / c)`` (when given), ALiBi and the
mask (``attention.scores_block``, shared with the forward), ``P = softmax(T)`` over the visible keys
and ``O = P V``, the gradients of a loss with upstream gradient ``dO`` are

    dV = P^T dO                      dP = dO V^T
    D_i = rowsum(dO_i * O_i)         dS = P * (dP - D) * (1 - tanh^2(S / c))   (last factor: softcap)
    dQ = scale * dS K                dK = scale * dS^T Q

summed over the query heads of a group for dK and dV (GQA / MQA). A query row with no visible key
has P = 0, so it contributes nothing and its dQ row is 0. NaN and inf in the inputs propagate.

``attention_backward_reference`` computes this densely, a chunk of query rows at a time.
``attention_backward_tiled`` is the executable specification of the CUDA backward kernel
(FlashAttention-2 / FlashMask Algorithm 2): D preprocessed, then one pass per key tile that
walks the query tiles, recomputes ``P = exp(S - lse)`` from the forward's lse, accumulates dK, dV
of its key tile and adds into dQ; tiles are classified skip / full / partial first (FlashMask's
column-interval min/max rule), skip tiles cost nothing and full tiles evaluate no mask.
``attention_backward_varlen`` runs either on a packed batch (``cu_seqlens``).
"""
from __future__ import annotations

import numpy as np

from .attention import Problem, as_float_arrays, check_input_dtype, check_problem, scores_block
from .intervals import NotRepresentableError
from .masks import MaskModMask
from .online import dense_tile_classes
from .tiles import FULL, PARTIAL, SKIP, classify_tiles, tile_counts

__all__ = ["attention_backward_reference", "attention_backward_tiled", "attention_backward_varlen",
           "backward_tile_classes", "CLASSIFICATIONS"]

# Score elements (batch * heads_q * rows * keys) per query-row chunk of the dense gradient.
_CHUNK_ELEMENTS = 1 << 20
CLASSIFICATIONS = ("intervals", "exact", "none")


# ----------------------------------------------------------------------------- layouts

def _prepare(dout, q, k, v, options: dict):
    """Check the arguments; return the Problem and dO, q, k, v as float64 in the head-major
    layout the math uses: dO, q (B, Hkv, G, Sq, D) (query head h = kv head * G + index),
    k, v (B, Hkv, 1, Sk, D)."""
    q, k, v = as_float_arrays(q, k, v)
    dout = np.asarray(dout)
    check_input_dtype(dout.dtype, "dout")
    if dout.shape != q.shape:
        raise ValueError(f"dout must have q's shape {q.shape} (batch, seqlen_q, heads_q, "
                         f"head_dim), got {dout.shape}")
    problem = check_problem(q.shape, k.shape, v.shape, **options)
    return problem, _rows_layout(dout, problem), _rows_layout(q, problem), \
        _keys_layout(k), _keys_layout(v)


def _rows_layout(x: np.ndarray, problem: Problem) -> np.ndarray:
    """(B, Sq, Hq, D) -> float64 (B, Hkv, G, Sq, D)."""
    b, sq, _, _, hkv, d = problem[:6]
    return np.ascontiguousarray(x.astype(np.float64).reshape(b, sq, hkv, problem.group, d)
                                .transpose(0, 2, 3, 1, 4))


def _keys_layout(x: np.ndarray) -> np.ndarray:
    """(B, Sk, Hkv, D) -> float64 (B, Hkv, 1, Sk, D)."""
    return np.ascontiguousarray(x.astype(np.float64).transpose(0, 2, 1, 3))[:, :, None]


def _rows_to_caller(x5: np.ndarray) -> np.ndarray:
    """(B, Hkv, G, Sq, D) -> (B, Sq, Hq, D)."""
    b, hkv, g, sq, d = x5.shape
    return x5.transpose(0, 3, 1, 2, 4).reshape(b, sq, hkv * g, d)


def _keys_to_caller(x4: np.ndarray) -> np.ndarray:
    """(B, Hkv, Sk, D) -> (B, Sk, Hkv, D)."""
    return np.ascontiguousarray(x4.transpose(0, 2, 1, 3))


# ----------------------------------------------------------------------------- shared math

def _softmax_rows(s: np.ndarray):
    """Softmax of masked scores s (..., R, C) over the last axis, and the rows' lse (..., R).

    A row with no visible key (all -inf) gets P = 0 and lse = -inf; NaN propagates (a NaN score
    makes its row's P and lse NaN, it is never taken for an empty row)."""
    row_max = s.max(axis=-1, keepdims=True, initial=-np.inf)  # -inf also for zero keys
    row_max = np.where(np.isneginf(row_max), 0.0, row_max)
    p = np.exp(s - row_max)
    row_sum = p.sum(axis=-1, keepdims=True)
    empty = row_sum == 0
    p = np.divide(p, row_sum, out=np.zeros_like(p), where=~empty)
    lse = np.where(empty, -np.inf, row_max + np.log(np.where(empty, 1.0, row_sum)))
    return p, lse[..., 0]


def _probabilities_from_lse(s: np.ndarray, lse_rows: np.ndarray) -> np.ndarray:
    """P = exp(s - lse) for a tile (the kernel's recomputation); s (..., R, C), lse (..., R).
    A row with lse = -inf (no visible key) gets P = 0: -inf is replaced by +inf, so
    exp(s - inf) = 0 for every finite or -inf score."""
    lse_use = np.where(np.isneginf(lse_rows), np.inf, lse_rows)
    return np.exp(s - lse_use[..., None])


def _tile_gradients(p, dcap, do_rows, delta_rows, q_rows, k_cols, v_cols, scale: float):
    """Gradients of one block of P: p (B, Hkv, G, R, C) and dcap (same, or None without softcap);
    do_rows, q_rows (B, Hkv, G, R, D); delta_rows (B, Hkv, G, R); k_cols, v_cols (B, Hkv, 1, C, D).
    Returns dq (B, Hkv, G, R, D) and dk, dv (B, Hkv, C, D) summed over the G heads of a group."""
    dv = np.matmul(p.swapaxes(-1, -2), do_rows).sum(axis=2)
    dp = np.matmul(do_rows, v_cols.swapaxes(-1, -2))
    ds = p * (dp - delta_rows[..., None])
    if dcap is not None:
        ds *= dcap
    dq = scale * np.matmul(ds, k_cols)
    dk = scale * np.matmul(ds.swapaxes(-1, -2), q_rows).sum(axis=2)
    return dq, dk, dv


def _row_chunks(problem: Problem):
    """Consecutive query-row ranges (r0, r1) covering every row, about _CHUNK_ELEMENTS scores each."""
    per_row = max(1, problem.batch * problem.heads_q * problem.seqlen_k)
    chunk = max(1, _CHUNK_ELEMENTS // per_row)
    return [(r0, min(problem.seqlen_q, r0 + chunk)) for r0 in range(0, problem.seqlen_q, chunk)]


# ----------------------------------------------------------------------------- dense oracle

def attention_backward_reference(dout, q, k, v, *, softmax_scale=None, causal=False,
                                 window_size=(-1, -1), sinks=0, mask=None, softcap=None,
                                 alibi_slopes=None):
    """Exact gradients of ``attention.attention`` with respect to q, k and v, in float64.

    dout, q: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim);
    any real float dtypes (converted exactly to float64). The keywords are ``attention``'s (same
    mask, bottom-right alignment, softcap, ALiBi); score_mod has no gradient here. P and O are
    recomputed densely, a chunk of query rows at a time (bounded temporaries).

    Returns (dq, dk, dv), float64, shaped like q, k and v; dk and dv summed over the query heads
    of each kv head's group. Rows with no visible key contribute nothing; NaN / inf propagate.
    """
    options = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                   sinks=sinks, mask=mask, softcap=softcap, alibi_slopes=alibi_slopes)
    problem, do5, q5, k5, v5 = _prepare(dout, q, k, v, options)
    dq5 = np.zeros_like(q5)
    dk4 = np.zeros(k5.shape[:2] + k5.shape[3:])
    dv4 = np.zeros_like(dk4)
    kt = k5.swapaxes(-1, -2)
    cols = np.arange(problem.seqlen_k)[None, :]
    with np.errstate(invalid="ignore", over="ignore"):
        for r0, r1 in _row_chunks(problem):
            s, dcap = scores_block(q5[..., r0:r1, :], kt, problem, np.arange(r0, r1)[:, None],
                                   cols, with_softcap_grad=True)
            p, _ = _softmax_rows(s)
            delta = (do5[..., r0:r1, :] * np.matmul(p, v5)).sum(axis=-1)
            dq, dk, dv = _tile_gradients(p, dcap, do5[..., r0:r1, :], delta, q5[..., r0:r1, :],
                                         k5, v5, problem.softmax_scale)
            dq5[..., r0:r1, :] = dq
            dk4 += dk
            dv4 += dv
    return _rows_to_caller(dq5), _keys_to_caller(dk4), _keys_to_caller(dv4)


def _forward_stats(problem: Problem, q5, k5, v5):
    """out (B, Hkv, G, Sq, D) and lse (B, Hkv, G, Sq), float64, by the dense softmax (NaN kept)."""
    out5 = np.zeros_like(q5)
    lse4 = np.full(q5.shape[:-1], -np.inf)
    kt = k5.swapaxes(-1, -2)
    cols = np.arange(problem.seqlen_k)[None, :]
    with np.errstate(invalid="ignore", over="ignore"):
        for r0, r1 in _row_chunks(problem):
            s = scores_block(q5[..., r0:r1, :], kt, problem, np.arange(r0, r1)[:, None], cols)
            p, lse4[..., r0:r1] = _softmax_rows(s)
            out5[..., r0:r1, :] = np.matmul(p, v5)
    return out5, lse4


# ----------------------------------------------------------------------------- tiled walk

def backward_tile_classes(problem: Problem, block_m: int, block_n: int,
                          classification: str = "intervals") -> np.ndarray:
    """int8 (ceil(Sq / block_m), ceil(Sk / block_n)) of SKIP / PARTIAL / FULL (``tiles``).

    "intervals": FlashMask's min/max rule on the mask's column intervals (``tiles.classify_tiles``,
    what a kernel holding the per-key-tile bounds in registers decides: sound, conservative); a
    mask without column intervals falls back to "exact". "exact": ``online.dense_tile_classes``
    (skip iff no visible pair, full iff all visible). "none": nothing skipped, every tile
    masked element by element. No mask: every tile FULL. A mask depending on (batch, head) is
    classified PARTIAL everywhere (its tiles differ per head).
    """
    if classification not in CLASSIFICATIONS:
        raise ValueError(f"classification must be one of {CLASSIFICATIONS}, got "
                         f"{classification!r}")
    sq, sk = problem.seqlen_q, problem.seqlen_k
    shape = (-(-sq // block_m), -(-sk // block_n))
    if problem.mask is None:
        return np.full(shape, FULL, dtype=np.int8)
    if classification == "none" or problem.mask.depends_on_batch_head:
        return np.full(shape, PARTIAL, dtype=np.int8)
    if classification == "intervals":
        try:
            return classify_tiles(problem.mask.column_intervals(sq, sk), block_m, block_n)
        except NotRepresentableError:
            pass
    return dense_tile_classes(problem, block_m, block_n)


def _check_block(name: str, value) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be a positive integer, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value}")
    return int(value)


def _given_stats(out, lse, problem: Problem):
    """The caller's out (B, Sq, Hq, D) and lse (B, Hq, Sq) in the head-major float64 layout."""
    b, sq, _, hq, hkv, d = problem[:6]
    out = np.asarray(out)
    lse = np.asarray(lse, dtype=np.float64)
    if out.shape != (b, sq, hq, d):
        raise ValueError(f"out must have shape {(b, sq, hq, d)}, got {out.shape}")
    if lse.shape != (b, hq, sq):
        raise ValueError(f"lse must have shape {(b, hq, sq)}, got {lse.shape}")
    return _rows_layout(out, problem), lse.reshape(b, hkv, problem.group, sq)


def _key_tile_pass(j, classes, problem, tensors, dq5, block_m, block_n):
    """One key tile's block of work: walk the query tiles, skip SKIP tiles, recompute P from lse,
    accumulate this tile's dK, dV and add into dQ. ``tensors``: (dO, q, k, v, lse, D) in the
    head-major layout. Returns (dk, dv) of the tile, (B, Hkv, C, D), and the number skipped."""
    do5, q5, k5, v5, lse4, delta4 = tensors
    c0, c1 = j * block_n, min(problem.seqlen_k, (j + 1) * block_n)
    k_tile, v_tile = k5[..., c0:c1, :], v5[..., c0:c1, :]
    cols = np.arange(c0, c1)[None, :]
    dk_tile = np.zeros(k_tile.shape[:2] + k_tile.shape[3:])
    dv_tile = np.zeros_like(dk_tile)
    skipped = 0
    for i in range(classes.shape[0]):
        if classes[i, j] == SKIP:
            skipped += 1
            continue
        r0, r1 = i * block_m, min(problem.seqlen_q, (i + 1) * block_m)
        s, dcap = scores_block(q5[..., r0:r1, :], k_tile.swapaxes(-1, -2), problem,
                               np.arange(r0, r1)[:, None], cols,
                               apply_mask=classes[i, j] != FULL, with_softcap_grad=True)
        p = _probabilities_from_lse(s, lse4[..., r0:r1])
        dq, dk, dv = _tile_gradients(p, dcap, do5[..., r0:r1, :], delta4[..., r0:r1],
                                     q5[..., r0:r1, :], k_tile, v_tile, problem.softmax_scale)
        dq5[..., r0:r1, :] += dq
        dk_tile += dk
        dv_tile += dv
    return dk_tile, dv_tile, skipped


def attention_backward_tiled(dout, q, k, v, *, out=None, lse=None, softmax_scale=None,
                             causal=False, window_size=(-1, -1), sinks=0, mask=None, softcap=None,
                             alibi_slopes=None, block_m=64, block_n=64,
                             classification="intervals", return_stats=False):
    """The gradients by the CUDA backward kernel's algorithm (FlashMask Algorithm 2), in float64.

    Arrays and keywords as in ``attention_backward_reference``. ``out`` (B, Sq, Hq, D) and ``lse``
    (B, Hq, Sq) are the forward's saved results (float64 or any float; both or neither: None
    recomputes them densely in float64). Steps:

    1. preprocessing: D_i = rowsum(dO_i * O_i), float64 (B, Hq, Sq);
    2. tiles: query tiles of ``block_m`` rows, key tiles of ``block_n`` columns (last ones short),
       classified by ``backward_tile_classes(problem, block_m, block_n, classification)``;
    3. column-parallel main loop: for each key tile j (a GPU block; dK_j, dV_j in registers),
       for each query tile i: SKIP tiles are passed over (counted); else S is recomputed (the
       per-element mask only for PARTIAL tiles), P = exp(S - lse_i), dV_j += P^T dO_i,
       dS = P * (dO_i V_j^T - D_i) (* softcap derivative), dK_j += scale dS^T Q_i and
       dQ_i += scale dS K_j (the accumulation across key tiles a kernel does with atomics).

    Returns (dq, dk, dv) float64 shaped like q, k, v; with ``return_stats`` also a dict
    {"skip", "partial", "full": tiles per class, "skipped": SKIP tiles the loop passed over}.
    Agrees with ``attention_backward_reference`` to ~1e-12 relative.
    """
    options = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                   sinks=sinks, mask=mask, softcap=softcap, alibi_slopes=alibi_slopes)
    problem, do5, q5, k5, v5 = _prepare(dout, q, k, v, options)
    block_m, block_n = _check_block("block_m", block_m), _check_block("block_n", block_n)
    if (out is None) != (lse is None):
        raise ValueError("pass both out and lse (the forward's saved results) or neither")
    with np.errstate(invalid="ignore", over="ignore"):
        out5, lse4 = (_forward_stats(problem, q5, k5, v5) if out is None
                      else _given_stats(out, lse, problem))
        delta4 = (do5 * out5).sum(axis=-1)
        classes = backward_tile_classes(problem, block_m, block_n, classification)
        dq5 = np.zeros_like(q5)
        dk4 = np.zeros(k5.shape[:2] + k5.shape[3:])
        dv4 = np.zeros_like(dk4)
        skipped = 0
        tensors = (do5, q5, k5, v5, lse4, delta4)
        for j in range(classes.shape[1]):
            dk_tile, dv_tile, n_skipped = _key_tile_pass(j, classes, problem, tensors, dq5,
                                                         block_m, block_n)
            dk4[:, :, j * block_n:(j + 1) * block_n] = dk_tile
            dv4[:, :, j * block_n:(j + 1) * block_n] = dv_tile
            skipped += n_skipped
    grads = (_rows_to_caller(dq5), _keys_to_caller(dk4), _keys_to_caller(dv4))
    if return_stats:
        return grads + (dict(tile_counts(classes), skipped=skipped),)
    return grads


# ----------------------------------------------------------------------------- varlen

def _offsets(name: str, cu_seqlens, total: int) -> np.ndarray:
    arr = np.asarray(cu_seqlens)
    if arr.ndim != 1 or arr.size < 1 or arr.dtype.kind not in "iu":
        raise ValueError(f"{name} must be a 1-D integer array (batch + 1,), got {arr.dtype} "
                         f"{arr.shape}")
    arr = arr.astype(np.int64)
    if arr[0] != 0 or arr[-1] != total or (np.diff(arr) < 0).any():
        raise ValueError(f"{name} must rise from 0 to the packed length {total}, got "
                         f"{arr.tolist()}")
    return arr


def _mask_for_sequence(mask, seq: int):
    """A (b, h)-dependent mask_mod seen from sequence ``seq`` run as batch 1 (b = seq)."""
    if not (isinstance(mask, MaskModMask) and mask.batch_head):
        return mask
    fn = mask.fn
    return MaskModMask(lambda b, h, q_idx, kv_idx: fn(seq, h, q_idx, kv_idx), batch_head=True)


def attention_backward_varlen(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, *, tiled=False,
                              alibi_slopes=None, mask=None, **options):
    """Gradients for a packed batch: each sequence is its own problem.

    dout, q: (total_q, heads_q, head_dim); k, v: (total_k, heads_kv, head_dim); cu_seqlens_q / _k:
    integer (B + 1,) offsets (sequence s owns rows cu[s]:cu[s+1]). ``options``: the keywords of
    ``attention_backward_reference`` (a mask must fit every sequence; a (b, h) mask_mod sees
    b = the sequence index); alibi_slopes (Hq,) or (B, Hq). ``tiled`` picks
    ``attention_backward_tiled`` (its block / classification keywords then allowed) over the
    dense oracle. Returns (dq, dk, dv) float64 shaped like q, k, v; empty sequences give 0.
    """
    cu_q = _offsets("cu_seqlens_q", cu_seqlens_q, np.shape(q)[0])
    cu_k = _offsets("cu_seqlens_k", cu_seqlens_k, np.shape(k)[0])
    if len(cu_q) != len(cu_k):
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have one length, got {len(cu_q)} "
                         f"and {len(cu_k)}")
    grads = [np.zeros(np.shape(x)) for x in (q, k, v)]
    slopes = None if alibi_slopes is None else np.asarray(alibi_slopes, dtype=np.float64)
    backward = attention_backward_tiled if tiled else attention_backward_reference
    for seq in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[seq], cu_q[seq + 1]), slice(cu_k[seq], cu_k[seq + 1])
        if rows.start == rows.stop or keys.start == keys.stop:
            continue
        seq_slopes = None if slopes is None else (slopes if slopes.ndim == 1 else slopes[seq])
        dq, dk, dv = backward(*(np.asarray(x)[None, rows] for x in (dout, q)),
                              *(np.asarray(x)[None, keys] for x in (k, v)),
                              alibi_slopes=seq_slopes, mask=_mask_for_sequence(mask, seq),
                              **options)[:3]
        grads[0][rows] = dq[0]
        grads[1][keys] += dk[0]
        grads[2][keys] += dv[0]
    return tuple(grads)
