"""``numba_flash.decode``: attention of a few new query rows over a (paged) KV cache.

Semantics (the CPU path is the definition): for batch item b with ``n = cache_seqlens[b]`` valid
keys (rows ``0..n-1`` of ``k_cache[b]``, or gathered through ``block_table[b]`` when paged), the
output equals ``numba_flash_reference.attention(q[b:b+1], k_valid, v_valid, ...)`` with
bottom-right alignment: the seqlen_q queries are the last seqlen_q positions of the sequence.

Masks with a per-sequence length: a ``masks.tree(parents)`` mask is re-anchored at the end of
every sequence (its nodes are the last ``len(parents)`` keys, everything before is prefix, seen
causally; the ``prefix_length`` it was built with is ignored). Any other mask object is evaluated
as built, with seqlen_k = n for each sequence (CPU path only), and must fit every length.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from numba_flash_reference.attention import check_softmax_scale
from numba_flash_reference.masks import TreeMask

from .arrays import describe_all, int32_indices, to_host
from .cpu import lse_dtype
from .validation import check_bool, check_dtypes, check_options, resolve_backend

__all__ = ["decode", "decode_cpu", "gather_cache"]

_Q = "(batch, seqlen_q, heads_q, head_dim)"
_KV = "(batch, max_seqlen, heads_kv, head_dim)"
_PAGED = "(num_pages, page_size, heads_kv, head_dim)"
MAX_TREE_NODES_GPU = 64
MAX_SEQLEN_Q = 64      # query rows per sequence: the documented limit of every backend


def _check_int_array(info, name, ndim, expected_shape, layout):
    if len(info.shape) != ndim:
        raise ValueError(f"{name} must have shape {layout}, got {info.shape}")
    if info.dtype.kind not in "iu":
        raise TypeError(f"{name} must be int32 (int64 is converted), got {info.dtype}")
    if expected_shape is not None and tuple(info.shape[:len(expected_shape)]) != expected_shape:
        raise ValueError(f"{name} must have shape {layout} with batch {expected_shape[0]}, got "
                         f"{info.shape}")


def _check_num_splits(value):
    if isinstance(value, str):
        if value != "auto":
            raise ValueError(f"num_splits must be 'auto' or an integer >= 1, got {value!r}")
        return value
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"num_splits must be 'auto' or an integer >= 1, got "
                        f"{type(value).__name__} {value!r}")
    if not 1 <= int(value) <= 1024:
        raise ValueError(f"num_splits must be in [1, 1024], got {value}")
    return int(value)


def _check_values(cache_seqlens, block_table, capacity, num_pages, page_size, tree_len):
    """Host-side range checks of cache_seqlens and block_table (NumPy arrays)."""
    lens = np.asarray(cache_seqlens)
    bad = (lens < 0) | (lens > capacity)
    if bad.any():
        b = int(np.argmax(bad))
        raise ValueError(f"cache_seqlens[{b}] = {int(lens[b])} is outside [0, {capacity}] (the "
                         f"cache capacity)")
    if tree_len and (lens < tree_len).any():
        b = int(np.argmax(lens < tree_len))
        raise ValueError(f"cache_seqlens[{b}] = {int(lens[b])} is shorter than the tree mask's "
                         f"{tree_len} nodes (the tree sits at the end of each sequence)")
    if block_table is not None:
        table = np.asarray(block_table)
        for b, n in enumerate(lens):
            used = table[b, :-(-int(n) // page_size)]
            wrong = (used < 0) | (used >= num_pages)
            if wrong.any():
                j = int(np.argmax(wrong))
                raise ValueError(f"block_table[{b}, {j}] = {int(used[j])} is not a page index in "
                                 f"[0, {num_pages}) (needed for cache_seqlens[{b}] = {int(n)})")


def gather_cache(cache, b: int, n: int, block_table=None):
    """The n valid rows of sequence b: (n, heads_kv, head_dim) from a contiguous cache
    (B, S_max, Hkv, D), or through ``block_table`` (B, max_pages) from a paged one
    (num_pages, page_size, Hkv, D). NumPy arrays."""
    if block_table is None:
        return cache[b, :n]
    page_size = cache.shape[1]
    pages = np.asarray(block_table)[b, :-(-n // page_size)]
    return cache[pages].reshape(-1, *cache.shape[2:])[:n]


def decode_cpu(q, k_cache, v_cache, cache_seqlens, block_table, *, softmax_scale, causal,
               window_size, sinks, mask, softcap, return_lse):
    """Decode on NumPy arrays through the float64 reference, one sequence at a time.

    Shapes as ``decode``; returns out (B, Sq, Hq, Dv) in q's dtype (rounded once; Dv: v_cache's
    head dim) and, with return_lse, lse float32 (B, Hq, Sq).
    """
    from numba_flash_reference.attention import attention as reference
    from numba_flash_reference.precision import round_to

    batch, seqlen_q, heads_q, head_dim = q.shape
    out64 = np.zeros((batch, seqlen_q, heads_q, v_cache.shape[-1]))
    lse64 = np.full((batch, heads_q, seqlen_q), -np.inf)
    for b in range(batch):
        n = int(cache_seqlens[b])
        if n == 0:
            continue
        kb = gather_cache(k_cache, b, n, block_table)[None]
        vb = gather_cache(v_cache, b, n, block_table)[None]
        mb = mask
        if isinstance(mask, TreeMask):
            mb = TreeMask(mask.parents, prefix_length=n - len(mask.parents))
        o, l = reference(q[b:b + 1], kb, vb, softmax_scale=softmax_scale, causal=causal,
                         window_size=window_size, sinks=sinks, mask=mb, softcap=softcap,
                         return_lse=True)
        out64[b] = o[0]
        lse64[b] = l[0]
    out = round_to(out64, q.dtype).astype(q.dtype)
    return (out, lse64.astype(lse_dtype(q.dtype))) if return_lse else out


def decode(q, k_cache, v_cache, *, cache_seqlens=None, block_table=None, softmax_scale=None,
           causal=True, window_size=(-1, -1), sinks=0, mask=None, softcap=None,
           num_splits="auto", return_lse=False, backend="auto", stream=None,
           check_inputs=False, check_indices=None):
    """Attention of new query rows over a KV cache (FlashDecoding: split-KV, then merge).

    Parameters
    ----------
    q : array (batch, seqlen_q, heads_q, head_dim)
        The new queries: seqlen_q = 1 for plain decoding, at most 64 (speculative
        verification); more raises ValueError (use ``attention`` for a prefill).
    k_cache, v_cache : arrays (batch, max_seqlen, heads_kv, head_dim), or paged
        (num_pages, page_size, heads_kv, head_dim) together with ``block_table``. Same dtype as
        q: float16 / bfloat16 on the GPU; float16, bfloat16, float32, float64 on NumPy.
    cache_seqlens : int32 array (batch,), optional (int64 is converted once)
        Valid length n of each sequence, new tokens included (the queries are its last
        seqlen_q positions). Default: the full capacity (max_seqlen, or max_pages * page_size);
        then the GPU kernel reads no lengths (a full cache needs no length array). n = 0 gives
        output 0 and lse -inf.
    block_table : int32 array (batch, max_pages), optional (int64 is converted once)
        Page indices: key j of sequence b is row ``j % page_size`` of page
        ``block_table[b, j // page_size]``.
    softmax_scale, causal, window_size, sinks, softcap, return_lse :
        As in ``numba_flash.attention`` (causal defaults to True here), on absolute positions.
    mask : mask object, optional
        ``masks.tree(parents)`` (<= 64 nodes on the GPU) is re-anchored at the end of each
        sequence; any other mask runs in CPU mode only and must fit every sequence length.
    num_splits : "auto" or int >= 1
        Key-range splits per (sequence, kv head). "auto" fills the GPU's multiprocessors (see
        docs/decode.md); 1 skips the merge kernel. Results agree to rounding for any value.
    backend : {"auto", "cpu", "cuda"}
    stream : CUDA stream for GPU arrays (default: the current one).
    check_inputs : bool
        GPU cache_seqlens and block_table are not read back (no synchronisation; the kernel
        clamps indices for memory safety but then computes garbage). True copies them to the
        host once (one synchronisation, so not inside a CUDA-graph capture) and runs CPU mode's
        checks: every length in [0, capacity], every page a sequence uses in [0, num_pages),
        values that fit int32 (the same ValueError). NumPy inputs are always checked.
        ``check_indices`` is its former name, still accepted.

    Returns
    -------
    out : (batch, seqlen_q, heads_q, head_dim), q's kind and dtype
    lse : float32 (batch, heads_q, seqlen_q) (float64 for float64 inputs), natural log, with
        ``return_lse=True``
    """
    fast = _FAST[0]
    signature = None
    if fast is not None and backend != "cpu" and not check_inputs and check_indices is None:
        # Same signature as an earlier GPU call on this stream: its plan, without validating
        # again (validation depends on nothing else; index values are never read on the GPU).
        result, signature = fast(q, k_cache, v_cache, cache_seqlens, block_table,
                                 (softmax_scale, causal, window_size, sinks, mask, softcap,
                                  num_splits, return_lse, backend), (mask,), stream)
        if result is not None:
            return result
    arrays = dict(q=q, k_cache=k_cache, v_cache=v_cache)
    if cache_seqlens is not None:
        arrays["cache_seqlens"] = cache_seqlens
    if block_table is not None:
        arrays["block_table"] = block_table
    infos = describe_all(**arrays)
    kind = infos["q"].kind
    backend, causal, return_lse, window_size, sinks, mask, softcap = check_options(
        backend=backend, causal=causal, return_lse=return_lse, window_size=window_size,
        sinks=sinks, mask=mask, softcap=softcap)
    num_splits = _check_num_splits(num_splits)
    check_inputs = check_bool("check_inputs", check_inputs if check_indices is None
                              else check_indices)
    geometry = _check_geometry(infos, block_table is not None)
    softmax_scale = check_softmax_scale(softmax_scale, geometry.head_dim)
    chosen = resolve_backend(backend, kind, stream)
    tree = mask if isinstance(mask, TreeMask) else None
    if chosen == "cuda":
        _check_gpu_mask(mask, tree)
        if infos["v_cache"].shape[3] != geometry.head_dim:
            raise NotImplementedError(f"decode on the GPU takes v_cache with k_cache's head_dim "
                                      f"(padding a KV cache would copy it at every call), got "
                                      f"{geometry.head_dim} and {infos['v_cache'].shape[3]}; "
                                      f"CPU mode takes them unlike")
    if kind == "numpy" or check_inputs:
        _check_indices(infos, cache_seqlens, block_table, geometry, tree)
    if cache_seqlens is not None:
        cache_seqlens = int32_indices(cache_seqlens, "cache_seqlens", infos["cache_seqlens"])
    if block_table is not None:
        block_table = int32_indices(block_table, "block_table", infos["block_table"])
    options = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                   sinks=sinks, softcap=softcap, return_lse=return_lse)
    if chosen == "cpu":
        if cache_seqlens is None:
            cache_seqlens = np.full(geometry.batch, geometry.capacity, dtype=np.int32)
        if mask is not None and tree is None:
            for n in sorted(set(int(x) for x in cache_seqlens if x > 0)):
                mask._check_sizes(geometry.seqlen_q, n)
        return decode_cpu(q, k_cache, v_cache, np.asarray(cache_seqlens), block_table,
                          mask=mask, **options)
    from .cuda.launch import decode as runtime

    _FAST[0] = runtime.decode_fast
    return runtime.decode_cuda(q, k_cache, v_cache, cache_seqlens=cache_seqlens,
                               block_table=block_table,
                               tree_parents=tree.parents if tree is not None else None,
                               num_splits=num_splits, stream=stream, fast=signature, **options)


# The runtime's repeated-call path (numba_flash.cuda.launch.decode.decode_fast), set by the first
# GPU call: until then no call can repeat.
_FAST = [None]


class _Geometry(NamedTuple):
    batch: int
    seqlen_q: int
    head_dim: int
    capacity: int      # keys a sequence can hold
    num_pages: int     # pages of a paged cache (batch for a contiguous one)
    page_size: int


def _check_geometry(infos: dict, paged: bool) -> _Geometry:
    """Shapes and dtypes of q, k_cache, v_cache and the index arrays (ValueError / TypeError
    naming the argument); returns the sizes decode needs."""
    qi, ki, vi = infos["q"], infos["k_cache"], infos["v_cache"]
    for name, info, layout in (("q", qi, _Q), ("k_cache", ki, _PAGED if paged else _KV),
                               ("v_cache", vi, _PAGED if paged else _KV)):
        if len(info.shape) != 4:
            raise ValueError(f"{name} must have 4 dimensions {layout}, got shape {info.shape}")
    if ki.shape[:3] != vi.shape[:3]:
        raise ValueError(f"k_cache and v_cache must have the same shape but for head_dim, got "
                         f"{ki.shape} and {vi.shape}")
    batch, seqlen_q, heads_q, head_dim = qi.shape
    if min(qi.shape) < 1 or min(ki.shape) < 1:
        raise ValueError(f"q and k_cache must have every dimension >= 1, got q {qi.shape} and "
                         f"k_cache {ki.shape}")
    if seqlen_q > MAX_SEQLEN_Q:
        raise ValueError(f"q must have seqlen_q <= {MAX_SEQLEN_Q} (new tokens per sequence: 1 "
                         f"for decoding, up to {MAX_SEQLEN_Q} for speculative verification), "
                         f"got q.shape[1] = {seqlen_q}; use numba_flash.attention for longer "
                         f"query blocks")
    if ki.shape[3] != head_dim:
        raise ValueError(f"q and k_cache must have the same head_dim, got q.shape[3]={head_dim} "
                         f"and k_cache.shape[3]={ki.shape[3]}")
    if heads_q % ki.shape[2]:
        raise ValueError(f"heads_q must be a multiple of heads_kv, got q.shape[2]={heads_q} and "
                         f"k_cache.shape[2]={ki.shape[2]}")
    check_dtypes(infos, ("q", "k_cache", "v_cache"))
    if "cache_seqlens" in infos:
        _check_int_array(infos["cache_seqlens"], "cache_seqlens", 1, (batch,), "(batch,)")
    if not paged:
        if ki.shape[0] != batch:
            raise ValueError(f"k_cache must have shape {_KV} with batch {batch} (q.shape[0]), got "
                             f"{ki.shape}; pass block_table for a paged cache")
        return _Geometry(batch, seqlen_q, head_dim, ki.shape[1], batch, ki.shape[1])
    _check_int_array(infos["block_table"], "block_table", 2, (batch,), "(batch, max_pages)")
    return _Geometry(batch, seqlen_q, head_dim, infos["block_table"].shape[1] * ki.shape[1],
                     ki.shape[0], ki.shape[1])


def _check_gpu_mask(mask, tree) -> None:
    if mask is not None and tree is None:
        raise NotImplementedError(f"decode on the GPU supports masks.tree only, got {mask!r}; "
                                  f"use causal / window_size / sinks, or NumPy arrays (CPU "
                                  f"mode) for other masks")
    if tree is not None and len(tree.parents) > MAX_TREE_NODES_GPU:
        raise ValueError(f"mask: a tree of at most {MAX_TREE_NODES_GPU} nodes on the GPU, got "
                         f"{len(tree.parents)}")


def _check_indices(infos, cache_seqlens, block_table, geometry: _Geometry, tree) -> None:
    """CPU mode's value checks of cache_seqlens and block_table, on host copies (one copy of
    each GPU array, made by its own library: a synchronisation)."""
    if cache_seqlens is None:
        lens = np.full(geometry.batch, geometry.capacity, dtype=np.int32)
    else:
        lens = int32_indices(to_host(cache_seqlens), "cache_seqlens")
    table = None if block_table is None else int32_indices(to_host(block_table), "block_table")
    _check_values(lens, table, geometry.capacity, geometry.num_pages, geometry.page_size,
                  len(tree.parents) if tree is not None else 0)

