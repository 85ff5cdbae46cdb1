"""``numba_flash.attention_backward``: validate the call, then hand it to CPU mode or the CUDA
backward kernels.

CPU mode (NumPy arrays) computes the exact gradients in float64 with the dense reference
(``numba_flash_reference.backward.attention_backward_reference``, chunked over query rows), which
recomputes P and O from q, k, v (the caller's out and lse are checked, not read: float16 out and
float32 lse would add their rounding to the answer every backend is measured against), then
rounds each gradient once to the input dtype. GPU arrays go to ``backward_cuda``
(launch/backward.py, loaded by ``_load_backward_cuda``); a later call of the same signature
replays the launches the first one recorded, without validating again
(launch/backward_fast.py).
"""
from __future__ import annotations

import numpy as np

from .api import load_cuda_entry
from .arrays import describe_all, dtype_name
from .validation import check_bool, check_gpu_strides, validate

__all__ = ["attention_backward"]

_CUDA_BACKWARD_MISSING = ("attention_backward on GPU arrays: the CUDA backward kernels are not "
                          "built yet; NumPy arrays run in CPU mode (exact float64 gradients)")
_LSE_DTYPES = ("float32", "float64")
_FAST = [None]          # the runtime's repeated-call path, once the runtime is loaded


def _load_backward_cuda():
    """The CUDA entry point ``<this package>.cuda.launch.backward.backward_cuda(dout, q, k, v,
    out, lse, *, problem, deterministic, stream, fast) -> (dq, dk, dv)``, imported on first
    use (with it the repeated-call path, launch/backward_fast.py); NotImplementedError while it
    is missing."""
    entry = load_cuda_entry(f"{__package__}.cuda.launch.backward", "backward_cuda",
                            _CUDA_BACKWARD_MISSING)
    if _FAST[0] is None:
        from .cuda.launch.backward_fast import backward_fast

        _FAST[0] = backward_fast
    return entry


def _check_saved(problem, infos: dict) -> None:
    """dout and out shaped like q but with v's head dim, typed like q (on the GPU with a
    contiguous head_dim); lse (batch, heads_q, seqlen_q), or (heads_q, total_q) for a packed
    batch, float32 or float64. Errors name the argument, what was given and what was
    expected."""
    q_info = problem.infos["q"]
    q_shape = q_info.shape[1:] if problem.varlen is not None else q_info.shape
    out_shape = q_shape[:-1] + (problem.infos["v"].shape[-1],)
    for name in ("dout", "out"):
        info = infos[name]
        if info.shape != out_shape:
            mixed = "" if out_shape == q_shape else " (q's with v's head_dim)"
            raise ValueError(f"{name} must have the forward output's shape {out_shape}{mixed}, "
                             f"got {info.shape}")
        if dtype_name(info.dtype) != dtype_name(problem.dtype):
            raise TypeError(f"{name} must have q's dtype {dtype_name(problem.dtype)}, got "
                            f"{dtype_name(info.dtype)}")
    if problem.kind == "cuda":
        check_gpu_strides({"dout": infos["dout"], "out": infos["out"]})
    lse = infos["lse"]
    if problem.varlen is not None:
        expected, layout = (problem.heads_q, q_shape[0]), "(heads_q, total_q) for a packed batch"
    else:
        expected, layout = (problem.batch, problem.heads_q, problem.seqlen_q), \
            "(batch, heads_q, seqlen_q)"
    if lse.shape != expected:
        hint = ""
        if len(lse.shape) != len(expected):
            hint = ("; a 2-D lse belongs to a packed batch: pass cu_seqlens_q / cu_seqlens_k"
                    if len(lse.shape) == 2 else "; with cu_seqlens the forward's lse is 2-D")
        raise ValueError(f"lse must have shape {layout} = {expected}, got {lse.shape}{hint}")
    if dtype_name(lse.dtype) not in _LSE_DTYPES:
        raise TypeError(f"lse must be float32 (as the forward returns it) or float64, got "
                        f"{dtype_name(lse.dtype)}")


def _pad_columns(x, width: int):
    """``x`` (..., d) with zero columns up to ``width``, of x's kind (NumPy, CuPy, torch)."""
    if x.shape[-1] == width:
        return x
    if isinstance(x, np.ndarray):
        return np.concatenate([x, np.zeros(x.shape[:-1] + (width - x.shape[-1],), x.dtype)],
                              axis=-1)
    from .cuda.launch.arrays import array_kind, pad_head_dim

    return pad_head_dim(x, array_kind(x), width)


def _first_columns(x, n: int):
    """A contiguous copy of ``x[..., :n]`` (x itself when it has n columns)."""
    if x.shape[-1] == n:
        return x
    part = x[..., :n]
    return part.copy() if hasattr(part, "copy") else part.contiguous()


def _backward_cpu(dout, q, k, v, problem) -> tuple:
    """Exact float64 gradients by the dense reference, each rounded once to q's dtype."""
    from numba_flash_reference.backward import (attention_backward_reference,
                                                attention_backward_varlen)
    from numba_flash_reference.precision import round_to

    options = dict(softmax_scale=problem.softmax_scale, causal=problem.causal,
                   window_size=problem.window_size, sinks=problem.sinks, mask=problem.mask,
                   softcap=problem.softcap, alibi_slopes=problem.alibi_slopes)
    if problem.varlen is not None:
        grads = attention_backward_varlen(dout, q, k, v, problem.varlen.host_q,
                                          problem.varlen.host_k, **options)
    else:
        grads = attention_backward_reference(dout, q, k, v, **options)
    return tuple(np.ascontiguousarray(round_to(g, problem.dtype).astype(problem.dtype))
                 for g in grads)


def attention_backward(dout, q, k, v, out, lse, *, softmax_scale=None, causal=False,
                       window_size=(-1, -1), sinks=0, mask=None, softcap=None, alibi_slopes=None,
                       cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                       max_seqlen_k=None, deterministic=False, backend="auto", stream=None,
                       score_mod=None):
    """Gradients of ``numba_flash.attention`` with respect to q, k and v.

    Parameters
    ----------
    dout : array (batch, seqlen_q, heads_q, head_dim_v)
        Upstream gradient of the loss with respect to ``out``; q's dtype and kind. (v's head
        dim may differ from q's, as in the forward; the call then pads every array with zero
        columns to the larger dim, copies, and returns gradients of the callers' shapes.)
    q, k, v : arrays as for ``numba_flash.attention`` (float16, bfloat16, float32 or float64;
        all NumPy (CPU mode) or all GPU arrays).
    out : array (batch, seqlen_q, heads_q, head_dim_v), q's dtype
        The forward's output.
    lse : array (batch, heads_q, seqlen_q), float32 (or float64)
        The forward's log-sum-exp (``return_lse=True``). With ``cu_seqlens``: dout, q, out are
        (total_q, heads_q, head_dim), k, v (total_k, heads_kv, head_dim), lse (heads_q, total_q).
    softmax_scale, causal, window_size, sinks, mask, softcap, alibi_slopes, cu_seqlens_q,
    cu_seqlens_k, max_seqlen_q, max_seqlen_k :
        Exactly the forward call's values (the gradient is that of the same function).
    deterministic : bool
        GPU: accumulate dQ in a fixed order (bitwise reproducible) instead of fp32 atomics. CPU
        mode is always deterministic.
    backend, stream : as for ``numba_flash.attention``.
    score_mod : must be None: score_mod has no backward yet (its derivative would need a second
        user function); NotImplementedError otherwise.

    Returns
    -------
    (dq, dk, dv) : arrays shaped like q, k and v, in q's dtype and kind; dk, dv summed over the
        query heads of each kv head's group (GQA / MQA). In CPU mode each is the exact float64
        gradient (recomputed from q, k, v by the dense reference; out and lse are checked but not
        read) rounded once to the input dtype. A query row that sees no key contributes nothing.

    Raises
    ------
    TypeError, ValueError : bad arguments, naming the argument, what it got and what was expected.
    NotImplementedError : score_mod; on GPU arrays, options the kernels do not take yet (the
        message names it; CPU mode takes every option).

    Examples
    --------
    >>> import numpy as np, numba_flash
    >>> rng = np.random.default_rng(0)
    >>> q, k, v, dout = (rng.standard_normal((1, 5, 2, 8)) for _ in range(4))
    >>> out, lse = numba_flash.attention(q, k, v, causal=True, return_lse=True)
    >>> dq, dk, dv = numba_flash.attention_backward(dout, q, k, v, out, lse, causal=True)
    >>> dq.shape, dk.dtype
    ((1, 5, 2, 8), dtype('float64'))
    """
    if score_mod is not None:
        raise NotImplementedError("attention_backward does not support score_mod yet: its "
                                  "gradient needs the derivative of the user's function; use "
                                  "softcap / alibi_slopes / masks, which have exact gradients")
    fast, signature = _FAST[0], None
    if fast is not None and backend != "cpu" and stream is None:
        # Same signature as an earlier GPU call (arrays' geometry, every keyword): its
        # recorded launches, without validating again (what validation reads is in the
        # signature; the replay checks the pointers' alignment itself).
        extras = (cu_seqlens_q, cu_seqlens_k, alibi_slopes)
        grads, signature = fast(dout, q, k, v, out, lse, (
            softmax_scale, causal, window_size, sinks, mask, softcap, alibi_slopes,
            cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, deterministic, backend),
            extras, (mask,))
        if grads is not None:
            return grads
    problem = validate(q, k, v, softmax_scale=softmax_scale, causal=causal,
                       window_size=window_size, sinks=sinks, mask=mask, softcap=softcap,
                       backend=backend, stream=stream, alibi_slopes=alibi_slopes,
                       cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                       max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    deterministic = check_bool("deterministic", deterministic)
    _check_saved(problem, describe_all(q=q, dout=dout, out=out, lse=lse))
    if problem.infos["v"].shape[-1] != problem.head_dim:
        width = max(problem.head_dim, problem.infos["v"].shape[-1])
        # v's head dim unlike q's: every array padded with zero columns to the larger dim
        # (zero columns add nothing to q.k, dO.v or dO.O, and their gradients are dropped).
        padded = [_pad_columns(x, width) for x in (dout, q, k, v, out)]
        grads = attention_backward(*padded, lse, softmax_scale=problem.softmax_scale,
                                   causal=causal, window_size=window_size, sinks=sinks,
                                   mask=mask, softcap=softcap, alibi_slopes=alibi_slopes,
                                   cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                   max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                                   deterministic=deterministic, backend=backend, stream=stream)
        return tuple(_first_columns(g, x.shape[-1]) for g, x in zip(grads, (q, k, v)))
    if problem.backend == "cpu":
        return _backward_cpu(dout, q, k, v, problem)
    backward_cuda = _load_backward_cuda()
    return backward_cuda(dout, q, k, v, out, lse, problem=problem, deterministic=deterministic,
                         stream=stream, fast=signature)
