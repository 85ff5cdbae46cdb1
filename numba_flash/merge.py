"""``numba_flash.merge_states``: combine partial attention states (split-KV, cascades, prefixes).

Layout (the reference's, with a leading state axis):

* ``o``: (n_states, batch, seqlen, heads, head_dim), each state normalised over its own keys, or a
  list / tuple of n_states arrays (batch, seqlen, heads, head_dim);
* ``lse``: (n_states, batch, heads, seqlen), natural-log log-sum-exp of each state's visible
  scores (-inf for a state that saw no key: the identity), or a list of (batch, heads, seqlen).

The result is the state over the union of the key sets: ``lse = log(sum_i exp(lse_i))`` and
``o = sum_i exp(lse_i - lse) o_i`` (0 and -inf when every state is empty).
"""
from __future__ import annotations

import numpy as np

from .arrays import describe

__all__ = ["merge_states"]

_FAST = [None]      # the GPU runtime's repeated-call path, once the runtime is loaded


def _stack(parts, name, kind):
    if kind == "numpy":
        return np.stack([np.asarray(p) for p in parts])
    mod = type(parts[0]).__module__.split(".")[0]
    if mod == "torch":
        import torch

        return torch.stack(list(parts))
    import cupy

    return cupy.stack([cupy.asarray(p) for p in parts])


def merge_states(o, lse, *, stream=None):
    """Merge n partial attention states into one.

    Parameters
    ----------
    o : array (n_states, batch, seqlen, heads, head_dim), or a list of n arrays
        (batch, seqlen, heads, head_dim). NumPy (any float dtype, bfloat16 from ml_dtypes) or a
        GPU array (float32 on the GPU).
    lse : array (n_states, batch, heads, seqlen), or a list of n arrays (batch, heads, seqlen);
        float32 (or float64 on NumPy). ``-inf`` marks an empty state, whose ``o`` is ignored.
    stream : optional
        CUDA stream for GPU arrays (default: the current stream); must be None for NumPy.

    Returns
    -------
    (o, lse) : o (batch, seqlen, heads, head_dim) in o's dtype, lse (batch, heads, seqlen) in
        lse's dtype. NumPy inputs are merged exactly in float64 by the reference
        (``numba_flash_reference.merge.merge_many``, order "flat") and rounded once; GPU inputs
        by ``numba_flash.cuda.launch.merge`` in fp32 on the caller's stream.
    """
    fast = _FAST[0]
    signature = None
    if fast is not None and not isinstance(o, (list, tuple)):
        # Same signature as an earlier GPU call (arrays' geometry): its plan, without
        # validating again (validation depends on nothing else).
        result, signature = fast(o, lse, stream)
        if result is not None:
            return result
    if isinstance(o, (list, tuple)) or isinstance(lse, (list, tuple)):
        if not isinstance(o, (list, tuple)) or not isinstance(lse, (list, tuple)):
            raise TypeError(f"o and lse must both be arrays or both be lists, got "
                            f"{type(o).__name__} and {type(lse).__name__}")
        if len(o) == 0 or len(o) != len(lse):
            raise ValueError(f"o and lse must list the same number (>= 1) of states, got {len(o)} "
                             f"and {len(lse)}")
        kind = describe(o[0], "o[0]").kind
        o, lse = _stack(o, "o", kind), _stack(lse, "lse", kind)
    io, il = describe(o, "o"), describe(lse, "lse")
    if io.kind != il.kind:
        raise TypeError(f"o and lse must be of the same kind (both NumPy or both GPU arrays), got "
                        f"{io.type_name} and {il.type_name}")
    if len(io.shape) != 5:
        raise ValueError(f"o must have shape (n_states, batch, seqlen, heads, head_dim), got "
                         f"{io.shape}")
    n, b, s, h, _ = io.shape
    if tuple(il.shape) != (n, b, h, s):
        raise ValueError(f"lse must have shape (n_states, batch, heads, seqlen) = {(n, b, h, s)} "
                         f"to match o {io.shape}, got {il.shape}")
    if n < 1:
        raise ValueError(f"merge_states needs at least one state, got o with shape {io.shape}")
    for name, info in (("o", io), ("lse", il)):
        if info.dtype.kind not in "fV" or (info.dtype.kind == "V" and info.dtype.itemsize != 2):
            raise TypeError(f"{name} must hold floating-point values, got dtype {info.dtype}")
    if io.kind == "numpy":
        if stream is not None:
            raise ValueError(f"stream applies to GPU arrays only; NumPy inputs need stream=None, "
                             f"got {stream!r}")
        from numba_flash_reference.merge import merge_many
        from numba_flash_reference.precision import round_to

        with np.errstate(invalid="ignore"):
            out64, lse64 = merge_many(list(o), list(lse), order="flat", dtype="float64")
        out = round_to(out64, o.dtype).astype(o.dtype)
        return out, lse64.astype(lse.dtype)
    from .cuda.launch.merge import merge_states_cuda, merge_states_fast

    _FAST[0] = merge_states_fast
    if signature is None:       # not looked up yet (first call, or states given as lists)
        result, signature = merge_states_fast(o, lse, stream)
        if result is not None:
            return result
    return merge_states_cuda(o, lse, stream=stream, fast=signature)
