"""Merging partial attention states (o, lse): the algebra of split-KV, cascade and ring attention.

A state is a normalised output o over some set of keys and the natural-log log-sum-exp lse of the
visible scores over that set. Two states over disjoint key sets merge exactly into the state over
their union; lse = -inf (no visible key) is the identity.
"""
from __future__ import annotations

import numpy as np

from .attention import _attend, as_float_arrays, check_problem
from .precision import Arithmetic, resolve_precision

__all__ = ["merge_states", "merge_many", "split_attention", "split_boundaries"]


def _check_state(o, lse, name: str) -> tuple[np.ndarray, np.ndarray]:
    o = np.asarray(o, dtype=np.float64)
    lse = np.asarray(lse, dtype=np.float64)
    if o.ndim < 3:
        raise ValueError(f"o_{name} must have shape (..., seqlen, heads, head_dim), got {o.shape}")
    expected = o.shape[:-3] + (o.shape[-2], o.shape[-3])
    if lse.shape != expected:
        raise ValueError(f"lse_{name} must have shape (..., heads, seqlen) = {expected} to match "
                         f"o_{name} {o.shape}, got {lse.shape}")
    return o, lse


def _per_row(w: np.ndarray) -> np.ndarray:
    """Weights (..., H, S) arranged to scale o (..., S, H, D)."""
    return np.swapaxes(w, -1, -2)[..., None]


def merge_states(o_a, lse_a, o_b, lse_b) -> tuple[np.ndarray, np.ndarray]:
    """Merge two partial attention states, exactly, in float64.

    o_a, o_b: normalised outputs (..., S, H, D); lse_a, lse_b: their natural-log log-sum-exps
    (..., H, S); any real dtype, same shapes. Returns (o, lse) float64 with
    ``lse = logaddexp(lse_a, lse_b)`` and ``o = exp(lse_a - lse) o_a + exp(lse_b - lse) o_b``.
    A state with lse = -inf contributes nothing (whatever its o holds); both -inf gives o = 0,
    lse = -inf, never NaN. Non-finite values propagate (``_included``): a NaN or +inf lse makes
    the whole merged row NaN (o and lse); a non-finite o entry of a state with a finite lse makes
    that merged entry non-finite.
    """
    o_a, lse_a = _check_state(o_a, lse_a, "a")
    o_b, lse_b = _check_state(o_b, lse_b, "b")
    if o_a.shape != o_b.shape:
        raise ValueError(f"o_a and o_b must have the same shape, got {o_a.shape} and {o_b.shape}")
    with np.errstate(invalid="ignore"):
        lse = np.logaddexp(lse_a, lse_b)
        shift = np.where(np.isneginf(lse), 0.0, lse)
        w_a, w_b = _per_row(np.exp(lse_a - shift)), _per_row(np.exp(lse_b - shift))
        o = _included(lse_a, w_a * o_a) + _included(lse_b, w_b * o_b)
    return o, lse


def _included(lse, weighted):
    """A state's weighted output ``weighted`` (..., S, H, D), or 0 where the state is empty
    (its ``lse`` (..., H, S) is -inf: the merge's identity, whatever its o holds). Only emptiness
    is tested, not the weight, so a NaN or inf in a non-empty state's o propagates even where its
    weight underflows to 0 (0 * NaN = NaN), as the same product does in a kernel."""
    return np.where(_per_row(np.isneginf(lse)), 0, weighted)


def _merge_pair(ar: Arithmetic, o_a, lse_a, o_b, lse_b):
    """merge_states with every operation rounded to ``ar``'s precision (kernel formulation:
    shift by the larger lse, weights w = exp(lse - max), lse = max + log(w_a + w_b))."""
    big = np.maximum(lse_a, lse_b)
    empty = np.isneginf(big)
    big = np.where(empty, ar.store.type(0), big)
    w_a = ar.func(np.exp, ar.sub(lse_a, big))
    w_b = ar.func(np.exp, ar.sub(lse_b, big))
    total = ar.add(w_a, w_b)
    safe = np.where(empty, ar.store.type(1), total)
    lse = np.where(empty, -np.inf, ar.add(big, ar.func(np.log, safe))).astype(ar.store)
    f_a, f_b = _per_row(ar.div(w_a, safe)), _per_row(ar.div(w_b, safe))
    o = ar.add(_included(lse_a, ar.mul(f_a, o_a)), _included(lse_b, ar.mul(f_b, o_b)))
    return o.astype(ar.store), lse


def _merge_flat(ar: Arithmetic, outs, lses):
    """All states at once, as a split-KV combine kernel: one max, weights, one sum, one pass."""
    big = lses[0]
    for lse in lses[1:]:
        big = np.maximum(big, lse)
    empty = np.isneginf(big)
    big = np.where(empty, ar.store.type(0), big)
    weights = [ar.func(np.exp, ar.sub(lse, big)) for lse in lses]
    total = weights[0]
    for w in weights[1:]:
        total = ar.add(total, w)
    safe = np.where(empty, ar.store.type(1), total)
    lse = np.where(empty, -np.inf, ar.add(big, ar.func(np.log, safe))).astype(ar.store)
    o = np.zeros_like(outs[0])
    for w, part, lse_i in zip(weights, outs, lses):
        f = _per_row(ar.div(w, safe))
        o = ar.add(o, _included(lse_i, ar.mul(f, part))).astype(ar.store)
    return o, lse


def merge_many(outs, lses, order: str = "sequential", dtype="float64"):
    """Merge n partial states into one, in an emulated precision.

    outs: sequence of n >= 1 arrays (..., S, H, D); lses: n arrays (..., H, S); all of one shape
    pair. ``dtype`` ("float64", "float32", "float16", "bfloat16" or a dtype) is the precision the
    merge arithmetic runs in: inputs are first rounded to it, then every operation's result is
    rounded once (see ``precision.Arithmetic``). ``order``:
      * "sequential": ((s0 + s1) + s2) + ... pairwise merges, left to right;
      * "tree": pairwise merges of neighbours, level by level (an odd last state moves up as is);
      * "flat": one pass, as a combine kernel does it: m = max lse_i, w_i = exp(lse_i - m),
        W = sum w_i (left to right), lse = m + log W, o = sum (w_i / W) o_i.
    Pairwise merges compute m = max(lse_a, lse_b), w = exp(lse - m), lse = m + log(w_a + w_b),
    o = (w_a / (w_a + w_b)) o_a + (w_b / (w_a + w_b)) o_b. States with lse = -inf are
    identities; a NaN or +inf lse makes the row NaN, and non-finite o entries of non-empty
    states propagate (see ``merge_states``).
    Returns (o, lse) as float64 arrays holding values of that precision.
    """
    outs, lses = list(outs), list(lses)
    if not outs or len(outs) != len(lses):
        raise ValueError(f"merge_many needs as many outs as lses, at least one; got {len(outs)} "
                         f"outs and {len(lses)} lses")
    checked = [_check_state(o, lse, str(i)) for i, (o, lse) in enumerate(zip(outs, lses))]
    for i, (o, _) in enumerate(checked):
        if o.shape != checked[0][0].shape:
            raise ValueError(f"outs[{i}] has shape {o.shape}, outs[0] has {checked[0][0].shape}")
    if order not in ("sequential", "tree", "flat"):
        raise ValueError(f"order must be 'sequential', 'tree' or 'flat', got {order!r}")
    ar = Arithmetic(resolve_precision(dtype, argument="dtype"))
    states = [(ar.round(o), ar.round(lse)) for o, lse in checked]
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        if order == "flat":
            o, lse = _merge_flat(ar, [s[0] for s in states], [s[1] for s in states])
        elif order == "sequential":
            o, lse = states[0]
            for o_b, lse_b in states[1:]:
                o, lse = _merge_pair(ar, o, lse, o_b, lse_b)
        else:
            while len(states) > 1:
                paired = [_merge_pair(ar, *states[i], *states[i + 1])
                          for i in range(0, len(states) - 1, 2)]
                states = paired + ([states[-1]] if len(states) % 2 else [])
            o, lse = states[0]
    return np.asarray(o, dtype=np.float64), np.asarray(lse, dtype=np.float64)


def split_boundaries(seqlen_k: int, splits) -> list[int]:
    """Key-range boundaries [0, b1, ..., seqlen_k] from ``splits``: an int n >= 1 (n near-equal
    ranges) or an explicit non-decreasing sequence starting at 0 and ending at seqlen_k (empty
    ranges allowed)."""
    if isinstance(splits, (int, np.integer)) and not isinstance(splits, bool):
        if splits < 1:
            raise ValueError(f"splits must be >= 1 when given as a count, got {splits}")
        return [i * seqlen_k // int(splits) for i in range(int(splits) + 1)]
    try:
        bounds = [int(x) for x in splits]
    except (TypeError, ValueError):
        raise TypeError(f"splits must be a count or a sequence of integer boundaries, "
                        f"got {splits!r}") from None
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != seqlen_k or \
            any(b1 < b0 for b0, b1 in zip(bounds, bounds[1:])):
        raise ValueError(f"splits must be non-decreasing boundaries from 0 to seqlen_k={seqlen_k}, "
                         f"got {bounds}")
    return bounds


def split_attention(q, k, v, splits, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                    sinks=0, mask=None, softcap=None) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Exact attention state of each key range of a split of the keys.

    Arguments as ``attention`` (q (B, Sq, Hq, D), k / v (B, Sk, Hkv, D)), plus ``splits`` (see
    ``split_boundaries``). Split i covers keys [b_i, b_{i+1}); the mask keeps its meaning on the
    whole sequence (positions are not renumbered). Returns (outs, lses): lists with one float64
    out (B, Sq, Hq, D) and one float64 lse (B, Hq, Sq) per split (0 and -inf for rows seeing no
    key of the split), ready for ``merge_many``.
    """
    q, k, v = as_float_arrays(q, k, v)
    problem = check_problem(q.shape, k.shape, v.shape, softmax_scale=softmax_scale, causal=causal,
                            window_size=window_size, sinks=sinks, mask=mask, softcap=softcap)
    bounds = split_boundaries(problem.seqlen_k, splits)
    outs, lses = [], []
    for c0, c1 in zip(bounds, bounds[1:]):
        o, lse = _attend(q, k, v, problem, c0, c1)
        outs.append(o)
        lses.append(lse)
    return outs, lses
