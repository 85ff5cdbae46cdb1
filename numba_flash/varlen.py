"""Packed variable-length batches (flash-attn's ``cu_seqlens`` convention).

Sequence ``s`` of a batch of B sequences owns query rows ``cu_seqlens_q[s] : cu_seqlens_q[s+1]``
of q (total_q, heads_q, head_dim) and key rows ``cu_seqlens_k[s] : cu_seqlens_k[s+1]`` of k and v
(total_k, heads_kv, head_dim); ``cu_seqlens_*`` are int32 (B + 1,) cumulative offsets starting at
0. Each sequence is its own attention problem (bottom-right alignment inside the sequence); empty
sequences are allowed. The output is (total_q, heads_q, head_dim) and the lse (heads_q, total_q),
as in flash-attn's varlen functions.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from numba_flash_reference.masks import MaskModMask

from .arrays import describe, int32_indices, to_host

__all__ = ["Varlen", "check_varlen", "attention_varlen_cpu"]


@dataclass(frozen=True)
class Varlen:
    """Validated varlen arguments. ``cu_q`` / ``cu_k`` are the caller's arrays (host int64 copies
    in ``host_q`` / ``host_k`` for NumPy inputs, None for GPU ones, whose contents are trusted and
    never read back: no synchronisation)."""

    batch: int
    cu_q: object
    cu_k: object
    max_seqlen_q: int
    max_seqlen_k: int
    host_q: np.ndarray | None
    host_k: np.ndarray | None


def _check_max(name, value, total):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer >= 0, got {type(value).__name__} {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return int(value)


def _host_offsets(name, arr, total):
    """Check the host offsets ``arr`` (argument ``name``, any integer dtype) of a packed length
    ``total``: start at 0, non-decreasing, end at ``total``, fit int32. Returns them as int64."""
    arr = np.asarray(int32_indices(np.asarray(arr), name)).astype(np.int64)
    packed = "q" if name.endswith("_q") else "k"
    if arr[0] != 0:
        raise ValueError(f"{name} must start at 0, got {name}[0] = {arr[0]}")
    steps = np.diff(arr)
    if (steps < 0).any():
        s = int(np.argmax(steps < 0))
        raise ValueError(f"{name} must be non-decreasing, got {name}[{s}] = {arr[s]} > "
                         f"{name}[{s + 1}] = {arr[s + 1]}")
    if arr[-1] != total:
        raise ValueError(f"{name}[-1] must equal the packed length {total} ({packed}.shape[0]), "
                         f"got {name}[-1] = {arr[-1]}")
    return arr


def _offset_infos(cu_seqlens_q, cu_seqlens_k, kind: str) -> dict:
    """ArrayInfo of both offset arrays: 1-D integer arrays of q's kind, of one length."""
    if cu_seqlens_q is None or cu_seqlens_k is None:
        missing = "cu_seqlens_k" if cu_seqlens_k is None else "cu_seqlens_q"
        raise ValueError(f"varlen attention needs both cu_seqlens_q and cu_seqlens_k; "
                         f"{missing} is None")
    infos = {}
    for name, arr in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        info = describe(arr, name)
        if info.kind != kind:
            raise TypeError(f"{name} must live where q does ({'host' if kind == 'numpy' else 'GPU'}"
                            f" memory), got a {'NumPy' if info.kind == 'numpy' else 'GPU'} array")
        if info.dtype.kind not in "iu":
            raise TypeError(f"{name} must be int32 (flash-attn's convention; int64 is converted), "
                            f"got {info.dtype}")
        if len(info.shape) != 1 or info.shape[0] < 1:
            raise ValueError(f"{name} must be 1-D (batch + 1,), got shape {info.shape}")
        infos[name] = info
    if infos["cu_seqlens_k"].shape != infos["cu_seqlens_q"].shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), "
                         f"got {infos['cu_seqlens_q'].shape[0]} and "
                         f"{infos['cu_seqlens_k'].shape[0]}")
    return infos


def _checked_max(host_q, host_k, max_seqlen_q, max_seqlen_k):
    """max_seqlen_q / max_seqlen_k checked against the host offsets (None: the longest)."""
    checked = []
    for name, value, host in (("max_seqlen_q", max_seqlen_q, host_q),
                              ("max_seqlen_k", max_seqlen_k, host_k)):
        longest = int(np.diff(host).max(initial=0))
        value = longest if value is None else _check_max(name, value, None)
        if value < longest:
            raise ValueError(f"{name} ({value}) is smaller than the longest sequence "
                             f"({longest}); expected a value >= {longest}")
        checked.append(value)
    return checked


def check_varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, total_q: int,
                 total_k: int, kind: str, check_inputs: bool = False) -> Varlen:
    """Validate the varlen arguments for q with total_q rows and k with total_k rows.

    cu_seqlens_q / cu_seqlens_k: integer (B + 1,) arrays (int32; int64 is converted once, by
    the array's library), both given, same kind as q ("numpy" or "cuda"). NumPy offsets are
    checked (start 0, non-decreasing, end at the total, fit int32) and max_seqlen_q/k default
    to the longest sequence. GPU offsets need max_seqlen_q and max_seqlen_k (ints bounding every
    sequence: the grid is sized by them) and are not read back, unless ``check_inputs``: then
    they are copied to the host once (one synchronisation) and checked as NumPy ones are.
    """
    infos = _offset_infos(cu_seqlens_q, cu_seqlens_k, kind)
    batch = infos["cu_seqlens_q"].shape[0] - 1
    host_q = host_k = None
    if kind == "numpy" or check_inputs:
        host_q = _host_offsets("cu_seqlens_q", to_host(cu_seqlens_q), total_q)
        host_k = _host_offsets("cu_seqlens_k", to_host(cu_seqlens_k), total_k)
        max_seqlen_q, max_seqlen_k = _checked_max(host_q, host_k, max_seqlen_q, max_seqlen_k)
    if kind != "numpy":
        for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
            if value is None:
                raise ValueError(f"{name} is required with GPU cu_seqlens (they are not read "
                                 f"back to the host): pass the longest sequence length")
        host_q = host_k = None   # GPU launches never read host offsets
    cu_q = int32_indices(cu_seqlens_q, "cu_seqlens_q", infos["cu_seqlens_q"])
    cu_k = int32_indices(cu_seqlens_k, "cu_seqlens_k", infos["cu_seqlens_k"])
    return Varlen(batch, cu_q, cu_k, _check_max("max_seqlen_q", max_seqlen_q, 0),
                  _check_max("max_seqlen_k", max_seqlen_k, 0), host_q, host_k)


def _score_mod_in_sequence(score_mod, seq: int):
    """``score_mod`` seen from one sequence of a packed batch run as batch 1: b is ``seq``, as
    in the GPU kernel."""
    if score_mod is None:
        return None

    def per_sequence(score, b, h, q_idx, kv_idx):
        return score_mod(score, seq, h, q_idx, kv_idx)

    return per_sequence


def _mask_in_sequence(mask, seq: int):
    """A (b, h)-dependent ``masks.mask_mod`` seen from one sequence run as batch 1: b is
    ``seq``, as in the GPU kernel; other masks as they are."""
    if not (isinstance(mask, MaskModMask) and mask.batch_head):
        return mask
    fn = mask.fn
    return MaskModMask(lambda b, h, q_idx, kv_idx: fn(seq, h, q_idx, kv_idx), batch_head=True)


def attention_varlen_cpu(q, k, v, varlen: Varlen, *, alibi_slopes=None, score_mod=None,
                         mask=None, return_lse=False, **options):
    """CPU mode for a packed batch: the reference per sequence, rounded once to the input dtype.

    q (total_q, Hq, D), k / v (total_k, Hkv, D) NumPy arrays of one float dtype; ``options`` are
    ``attention_cpu``'s (softmax_scale, causal, window_size, sinks, mask, softcap); a mask must
    fit every sequence's lengths. alibi_slopes: (Hq,) or (B, Hq). score_mod and a (b, h)-
    dependent mask_mod: called with b = the sequence's index in the batch. Returns out
    (total_q, Hq, D) in q's dtype, and lse (Hq, total_q) with ``return_lse``
    (float32; float64 for float64 inputs).
    """
    from .cpu import attention_cpu, lse_dtype

    total_q, heads_q, _ = q.shape
    out = np.zeros((total_q, heads_q, v.shape[-1]), dtype=q.dtype)
    lse = np.full((heads_q, total_q), -np.inf, dtype=lse_dtype(q.dtype))
    slopes = None if alibi_slopes is None else np.asarray(alibi_slopes, dtype=np.float64)
    for s in range(varlen.batch):
        q0, q1 = int(varlen.host_q[s]), int(varlen.host_q[s + 1])
        k0, k1 = int(varlen.host_k[s]), int(varlen.host_k[s + 1])
        if q1 == q0 or k1 == k0:
            continue  # no query row, or no key: rows stay 0 with lse -inf
        per_seq = None if slopes is None else (slopes if slopes.ndim == 1 else slopes[s])
        o, l = attention_cpu(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], return_lse=True,
                             alibi_slopes=per_seq, score_mod=_score_mod_in_sequence(score_mod, s),
                             mask=_mask_in_sequence(mask, s), **options)
        out[q0:q1] = o[0]
        lse[:, q0:q1] = l[0]
    return (out, lse) if return_lse else out
