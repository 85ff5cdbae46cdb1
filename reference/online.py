"""Online-softmax attention, tile by tile, as a FlashAttention kernel computes it.

``online_attention`` follows the kernel algorithm exactly (running max, running sum, rescaled
unnormalised accumulator, one normalisation at the end) and can emulate the precision each step
runs in. In float64 it equals ``attention`` to ~1e-12; in float32 / float16 / bfloat16 it shows the
rounding a kernel commits. See ``online_attention`` for the precise arithmetic model and
docs/theory.md for the math.
"""
from __future__ import annotations

import math
import operator

import numpy as np

from .attention import as_float_arrays, check_problem, visible_block
from .intervals import NotRepresentableError
from .precision import PRECISIONS, Arithmetic, precision_name, resolve_precision, round_to
from .tiles import FULL, PARTIAL, SKIP, classify_tiles

__all__ = ["online_attention", "dense_tile_classes"]


# Score-tile elements (batch * heads_q * rows * keys) handled per NumPy call.
_STEP_ELEMENTS = 1 << 17
_LOG2E = 1.0 / math.log(2.0)
_LN2 = math.log(2.0)


def _round_operand(p: np.ndarray, accum_name: str, p_name: str) -> np.ndarray:
    """p (held in the accumulator precision) rounded to the PV operand precision, as float64."""
    if p_name == accum_name:
        return p.astype(np.float64)
    if p.dtype == np.float32 and p_name in ("float16", "bfloat16"):
        # A float32 value rounds to float16 / bfloat16 in one correct cast (no double rounding).
        return p.astype(PRECISIONS[p_name]).astype(np.float64)
    return round_to(p, p_name)


def _check_block(value, name: str) -> int:
    try:
        if isinstance(value, (bool, np.bool_)):
            raise TypeError
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be a positive integer, got {value!r}") from None
    if value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value}")
    return value


def dense_tile_classes(problem, block_m: int, block_n: int) -> np.ndarray:
    """Exact classification of every (query tile, key tile) pair by its visible pairs.

    ``problem``: an ``attention.Problem``. Returns int8 (n_q_tiles, n_k_tiles): SKIP (0) where no
    pair of the tile is visible, FULL (2) where every in-range pair is, PARTIAL (1) otherwise. Only
    in-range rows and columns count (a short last tile is classified on its real pairs): the
    result equals ``tiles.classify_tiles_dense(mask.to_dense(...))`` without building the dense
    matrix. FlashMask's min/max rule (``tiles.classify_tiles``, sound but conservative) settles most
    tiles from the mask's column intervals; the tiles it leaves PARTIAL, or all tiles of a mask
    without column intervals, are then checked pair by pair.
    """
    sq, sk = problem.seqlen_q, problem.seqlen_k
    n_q, n_k = -(-sq // block_m), -(-sk // block_n)
    if problem.mask is None or n_q == 0 or n_k == 0:
        return np.full((n_q, n_k), FULL, dtype=np.int8)
    try:
        classes = classify_tiles(problem.mask.column_intervals(sq, sk), block_m, block_n)
    except NotRepresentableError:
        classes = np.full((n_q, n_k), PARTIAL, dtype=np.int8)
    undecided = np.argwhere(classes == PARTIAL)
    per_call = max(1, (1 << 21) // (block_m * block_n))
    for c0 in range(0, len(undecided), per_call):
        qi, kt = undecided[c0:c0 + per_call].T
        rows = qi[:, None, None] * block_m + np.arange(block_m)[None, :, None]
        cols = kt[:, None, None] * block_n + np.arange(block_n)[None, None, :]
        in_range = (rows < sq) & (cols < sk)
        vis = visible_block(problem.mask, sq, sk, np.minimum(rows, sq - 1), np.minimum(cols, sk - 1))
        any_visible = (vis & in_range).any(axis=(1, 2))
        all_visible = (vis | ~in_range).all(axis=(1, 2))
        classes[qi, kt] = np.where(all_visible, FULL, np.where(any_visible, PARTIAL, SKIP))
    return classes


def _check_tile_classes(tile_classes, n_q: int, n_k: int) -> np.ndarray:
    classes = np.asarray(tile_classes)
    if classes.shape != (n_q, n_k):
        raise ValueError(f"tile_classes must have shape (n_q_tiles, n_k_tiles) = ({n_q}, {n_k}), "
                         f"got {classes.shape}")
    if classes.dtype.kind not in "iub":
        raise TypeError(f"tile_classes must be an integer array, got dtype {classes.dtype}")
    if classes.size and not np.isin(classes, (SKIP, PARTIAL, FULL)).all():
        raise ValueError("tile_classes entries must be 0 (skip), 1 (partial) or 2 (full), got "
                         f"{np.unique(classes).tolist()}")
    return classes.astype(np.int8)


def _tile_lists(tile_order, classes: np.ndarray, skip_tiles: bool) -> list[np.ndarray]:
    """Key tiles each query tile processes, in processing order."""
    n_q, n_k = classes.shape
    lists = []
    for i in range(n_q):
        if tile_order is None:
            order = np.arange(n_k)
        elif isinstance(tile_order, str) and tile_order == "reverse":
            order = np.arange(n_k - 1, -1, -1)
        elif callable(tile_order):
            order = np.asarray(tile_order(i, n_k))
            if order.shape != (n_k,) or order.dtype.kind not in "iu" or \
                    not np.array_equal(np.sort(order), np.arange(n_k)):
                raise ValueError(f"tile_order({i}, {n_k}) must return a permutation of "
                                 f"range({n_k}), got {order.tolist()!r}")
        else:
            raise ValueError(f"tile_order must be None, 'reverse' or a callable "
                             f"(query_tile, n_key_tiles) -> permutation, got {tile_order!r}")
        if skip_tiles:
            order = order[classes[i, order] != SKIP]
        lists.append(order.astype(np.int64))
    return lists


def _schedule(tile_order, lists: list[np.ndarray], n_k: int):
    """Steps (query tiles, their key tiles): each query tile keeps its own order, and a step
    holds each query tile at most once, so steps can run one after another, vectorised inside.

    Natural and reverse orders go key tile by key tile (one K/V tile per step, big matmuls);
    other orders go position by position in the lists.
    """
    n_q = len(lists)
    if tile_order is None or isinstance(tile_order, str):
        member = np.zeros((n_q, n_k), dtype=bool)
        for i, order in enumerate(lists):
            member[i, order] = True
        key_order = range(n_k) if tile_order is None else range(n_k - 1, -1, -1)
        for j in key_order:
            qi = np.nonzero(member[:, j])[0]
            if qi.size:
                yield qi, np.full(qi.size, j)
        return
    lengths = np.array([len(order) for order in lists])
    for t in range(int(lengths.max(initial=0))):
        qi = np.nonzero(lengths > t)[0]
        yield qi, np.array([lists[i][t] for i in qi], dtype=np.int64)


def online_attention(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), sinks=0,
                     mask=None, softcap=None, block_m=64, block_n=64, skip_tiles=True,
                     tile_classes=None, use_exp2=False, accum_dtype="float64", p_dtype=None,
                     tile_order=None, return_lse=False, return_trace=False):
    """Attention by the FlashAttention online softmax, tile by tile, in an emulated precision.

    Shapes, dtypes and the mask arguments are those of ``attention``: q (B, Sq, Hq, D), k and v
    (B, Sk, Hkv, D), any real float dtype; Hq a multiple of Hkv (query head h reads kv head
    h // (Hq // Hkv)); ``causal``, ``window_size``, ``sinks`` and ``mask`` with bottom-right
    alignment. Query rows are cut into tiles of ``block_m`` rows, keys into tiles of ``block_n``
    (the last tile of each may be short). For every (batch, head, query tile) the state is a
    running max m (block_m,), a running sum l (block_m,) and an unnormalised accumulator
    acc (block_m, D), starting at m = -inf, l = 0, acc = 0. For each key tile, in order:

        s      = scores of the tile (below), -inf where masked
        m_new  = max(m, rowmax(s))
        alpha  = exp(m - m_new);  p = exp(s - m_new)
        l      = alpha * l + rowsum(p)
        acc    = alpha * acc + p @ v_tile
        m      = m_new

    and at the end out = acc / l, lse = m + log(l); rows with l == 0 give out 0, lse -inf. While a
    row has seen only masked keys, m_new = -inf and the subtraction uses 0 in its place, so alpha
    and p are exp(-inf) = 0 (never -inf - -inf = NaN) and the row keeps m = -inf, l = 0, acc = 0.

    Precision model (``accum_dtype`` A: "float64", "float32", "float16", "bfloat16" or a dtype;
    ``p_dtype`` P, default A). Inputs are taken exactly as given (converted to float64 without
    loss). Every operation below produces its exact or float64 result and rounds it once,
    round-to-nearest-even, to the named precision ("rd_A"), i.e. it behaves as an IEEE operation
    in A; m, l, acc and every intermediate hold A values:
      * raw scores: rd_A(q . k) with q . k summed in float64 (BLAS order) from the exact products
        of the inputs: a tensor-core MMA with a wide accumulator, written out in A;
      * scaling: s = rd_A(raw * c) with c = rd_A(softmax_scale), or rd_A(softmax_scale * log2(e))
        with ``use_exp2``; with a softcap: t = rd_A(raw * rd_A(softmax_scale / softcap)),
        s = rd_A(rd_A(tanh(t)) * c') with c' = rd_A(softcap), or rd_A(softcap * log2(e)) with
        ``use_exp2``;
      * masking sets s = -inf (exact); max is exact; subtractions, products and sums of two
        values are rd_A of the exact result; exp / exp2 / tanh are NumPy's float64 function of
        the A operand, rounded once to A;
      * rowsum(p): the row's p values (in A, before any rounding to P) summed in float64, rounded
        once to A (as kernels, l uses the A copy of p);
      * p @ v_tile: p rounded to P (the fp16/bf16 operand a tensor core consumes), the product
        summed in float64 from the P values and the exact v, rounded once to A, then added:
        acc = rd_A(rd_A(alpha * acc) + rd_A(p_P @ v));
      * final: out = rd_A(acc / l); lse = rd_A(m + log(l)), or rd_A((m + log2(l)) * ln 2) with
        ``use_exp2``, the inner expression in float64.
    For float32 the operations run natively in float32 (provably the same results, faster).

    use_exp2: work in base 2 as kernels do (log2(e) folded into the scale, exp2 instead of exp;
    m and the trace are then in log2 units); out and lse mean the same (lse in natural log).

    Tiles: with ``skip_tiles`` key tiles without a visible pair for a query tile are not
    processed. ``tile_classes`` (int8 (n_q_tiles, n_k_tiles), 0 = skip, 1 = partial, 2 = full, e.g.
    from reference/tiles.py) replaces the classification from dense visibility and is trusted:
    a "full" tile is processed without the mask (only columns past seqlen_k, in a short last key
    tile, are always masked), a "skip" tile is dropped (with ``skip_tiles=False`` it is processed
    with the mask). ``tile_order``: None (key tiles in increasing order), "reverse", or a callable
    ``(query_tile_index, n_key_tiles) -> sequence`` returning a permutation of range(n_key_tiles).

    Returns out, float64 (B, Sq, Hq, D) holding A values; then lse, float64 (B, Hq, Sq), if
    ``return_lse``; then the trace if ``return_trace``: a dict keyed by (b, h, query_tile) (every
    batch, query head and query tile) whose value lists, in processing order, one tuple
    ``(key_tile_index, m, l)`` per processed key tile, m and l float64 copies of the state after
    that tile, shape (rows of the query tile,) (the last query tile may be short).

    Work is vectorised over batch, heads and the query tiles sharing a step; natural / reverse
    orders use one K/V tile per step (seqlen 65536, D=64, causal, float32: about 30 s on 2 cores).
    """
    q, k, v = as_float_arrays(q, k, v)
    problem = check_problem(q.shape, k.shape, v.shape, softmax_scale=softmax_scale, causal=causal,
                            window_size=window_size, sinks=sinks, mask=mask, softcap=softcap)
    bm, bn = _check_block(block_m, "block_m"), _check_block(block_n, "block_n")
    for name, flag in (("skip_tiles", skip_tiles), ("use_exp2", use_exp2),
                       ("return_lse", return_lse), ("return_trace", return_trace)):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"{name} must be a bool, got {flag!r}")
    ar = Arithmetic(resolve_precision(accum_dtype, argument="accum_dtype"))
    p_name = ar.name if p_dtype is None else precision_name(
        resolve_precision(p_dtype, argument="p_dtype"))

    b, sq, sk, hq, hkv, d = problem[:6]
    g = problem.group
    n_q, n_k = -(-sq // bm), -(-sk // bn)
    if tile_classes is None:
        classes = dense_tile_classes(problem, bm, bn)
    else:
        classes = _check_tile_classes(tile_classes, n_q, n_k)
    lists = _tile_lists(tile_order, classes, bool(skip_tiles))

    sq_pad, sk_pad = n_q * bm, n_k * bn
    qp = np.zeros((b, hkv, g, sq_pad, d))
    qp[:, :, :, :sq] = q.astype(np.float64).reshape(b, sq, hkv, g, d).transpose(0, 2, 3, 1, 4)
    kp = np.zeros((b, hkv, sk_pad, d))
    kp[:, :, :sk] = k.astype(np.float64).transpose(0, 2, 1, 3)
    vp = np.zeros((b, hkv, sk_pad, d))
    vp[:, :, :sk] = v.astype(np.float64).transpose(0, 2, 1, 3)
    k_tiles, v_tiles = kp.reshape(b, hkv, n_k, bn, d), vp.reshape(b, hkv, n_k, bn, d)

    m = np.full((b, hkv, g, sq_pad), -np.inf, dtype=ar.store)
    l = np.zeros((b, hkv, g, sq_pad), dtype=ar.store)
    acc = np.zeros((b, hkv, g, sq_pad, d), dtype=ar.store)

    base = _LOG2E if use_exp2 else 1.0
    exp = np.exp2 if use_exp2 else np.exp
    if problem.softcap is None:
        pre, post = ar.const(problem.softmax_scale * base), None
    else:
        pre = ar.const(problem.softmax_scale / problem.softcap)
        post = ar.const(problem.softcap * base)

    ragged = sk % bn != 0
    trace_steps = []
    per_call = max(1, _STEP_ELEMENTS // (b * hq * bm * bn))
    with np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore"):
        for qi_all, kt_all in _schedule(tile_order, lists, n_k):
            for c0 in range(0, qi_all.size, per_call):
                qi, kt = qi_all[c0:c0 + per_call], kt_all[c0:c0 + per_call]
                na = qi.size
                if qi[-1] - qi[0] + 1 == na:  # consecutive query tiles: views, no gather
                    rows = slice(qi[0] * bm, (qi[-1] + 1) * bm)
                else:
                    rows = (qi[:, None] * bm + np.arange(bm)).ravel()
                qa = qp[:, :, :, rows].reshape(b, hkv, g, na, bm, d)
                if np.all(kt == kt[0]):
                    kq = k_tiles[:, :, kt[0]][:, :, None, None]  # (B, Hkv, 1, 1, bn, D)
                    vq = v_tiles[:, :, kt[0]][:, :, None, None]
                    raw = np.matmul(qa.reshape(b, hkv, g, na * bm, d),
                                    kq[:, :, :, 0].swapaxes(-1, -2)).reshape(b, hkv, g, na, bm, bn)
                else:
                    kq = k_tiles[:, :, kt][:, :, None]  # (B, Hkv, 1, nA, bn, D)
                    vq = v_tiles[:, :, kt][:, :, None]
                    raw = np.matmul(qa, kq.swapaxes(-1, -2))
                s = ar.round(raw)
                if post is None:
                    s = ar.mul(s, pre)
                else:
                    s = ar.mul(ar.func(np.tanh, ar.mul(s, pre)), post)
                _apply_mask(s, problem, classes, qi, kt, bm, bn, n_k, ragged)

                m_old = m[:, :, :, rows].reshape(b, hkv, g, na, bm)
                l_old = l[:, :, :, rows].reshape(b, hkv, g, na, bm)
                acc_old = acc[:, :, :, rows].reshape(b, hkv, g, na, bm, d)
                m_new = np.maximum(m_old, s.max(axis=-1))
                m_use = np.where(np.isneginf(m_new), ar.store.type(0), m_new)
                alpha = ar.func(exp, ar.sub(m_old, m_use))
                p = ar.func(exp, ar.sub(s, m_use[..., None]))
                l_new = ar.add(ar.mul(alpha, l_old), ar.rowsum(p))
                p_op = _round_operand(p, ar.name, p_name)
                if kq.shape[3] == 1:
                    pv = np.matmul(p_op.reshape(b, hkv, g, na * bm, bn), vq[:, :, :, 0])
                else:
                    pv = np.matmul(p_op, vq)
                acc_new = ar.add(ar.mul(alpha[..., None], acc_old),
                                 ar.round(pv).reshape(b, hkv, g, na, bm, d))
                m[:, :, :, rows] = m_new.reshape(b, hkv, g, na * bm)
                l[:, :, :, rows] = l_new.reshape(b, hkv, g, na * bm)
                acc[:, :, :, rows] = acc_new.reshape(b, hkv, g, na * bm, d)
                if return_trace:
                    trace_steps.append((qi, kt, m_new.astype(np.float64), l_new.astype(np.float64)))

        nonempty = l > 0
        l_safe = np.where(nonempty, l, ar.store.type(1))
        out = np.where(nonempty[..., None], ar.div(acc, l_safe[..., None]), 0.0)
        m64, l64 = m.astype(np.float64), l_safe.astype(np.float64)
        lse_exact = (m64 + np.log2(l64)) * _LN2 if use_exp2 else m64 + np.log(l64)
        lse = np.where(nonempty, ar.round(lse_exact).astype(np.float64), -np.inf)

    out = out[:, :, :, :sq].astype(np.float64).transpose(0, 3, 1, 2, 4).reshape(b, sq, hq, d)
    results = [out]
    if return_lse:
        results.append(lse[:, :, :, :sq].reshape(b, hq, sq))
    if return_trace:
        results.append(_build_trace(trace_steps, b, hkv, g, n_q, bm, sq))
    return results[0] if len(results) == 1 else tuple(results)


def _apply_mask(s, problem, classes, qi, kt, bm, bn, n_k, ragged) -> None:
    """Set masked scores of the step's tiles to -inf in place (s: (B, Hkv, G, nA, bm, bn))."""
    cls = classes[qi, kt]
    boundary = ragged & (kt == n_k - 1)
    masked = (cls != FULL) | boundary
    if not masked.any():
        return
    idx = np.nonzero(masked)[0]
    sq, sk = problem.seqlen_q, problem.seqlen_k
    rows = qi[idx, None, None] * bm + np.arange(bm)[None, :, None]
    cols = kt[idx, None, None] * bn + np.arange(bn)[None, None, :]
    # Padding rows/columns are clipped into range before the mask sees them; padded columns are
    # then masked explicitly, padded rows are discarded at the end.
    in_range = cols < sk
    needs_predicate = cls[idx] != FULL
    vis = np.broadcast_to(in_range, (idx.size, bm, bn)).copy()
    if needs_predicate.any():
        sel = np.nonzero(needs_predicate)[0]
        vis[sel] &= visible_block(problem.mask, sq, sk, np.minimum(rows[sel], sq - 1),
                                  np.minimum(cols[sel], sk - 1))
    if idx.size == s.shape[3]:
        np.copyto(s, -np.inf, where=~vis)
    else:
        sub = s[:, :, :, idx]
        np.copyto(sub, -np.inf, where=~vis)
        s[:, :, :, idx] = sub


def _build_trace(steps, b, hkv, g, n_q, bm, sq) -> dict:
    trace = {(bi, h, t): [] for bi in range(b) for h in range(hkv * g) for t in range(n_q)}
    for qi, kt, m_new, l_new in steps:
        for a, (t, j) in enumerate(zip(qi.tolist(), kt.tolist())):
            nrows = min(bm, sq - t * bm)
            for bi in range(b):
                for hk in range(hkv):
                    for gi in range(g):
                        trace[(bi, hk * g + gi, t)].append(
                            (j, m_new[bi, hk, gi, a, :nrows].copy(), l_new[bi, hk, gi, a, :nrows].copy()))
    return trace
