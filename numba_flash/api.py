"""``numba_flash.attention``: validate the call, then hand it to CPU mode or the CUDA kernels."""
from __future__ import annotations

import importlib

from .validation import validate

__all__ = ["attention"]

_CUDA_MISSING = ("the CUDA backend is not available yet: numba_flash.cuda.launch.attention "
                 "is missing from this installation; NumPy inputs run in CPU mode "
                 "(backend='auto' or 'cpu')")


def load_cuda_module(module_name: str, missing: str):
    """The CUDA runtime module ``module_name``, imported on first use so that ``import
    numba_flash`` stays light; NotImplementedError(``missing``) while it is absent from this
    installation."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name in (f"{__package__}.cuda", f"{__package__}.cuda.launch", module_name):
            raise NotImplementedError(missing) from exc
        raise


def load_cuda_entry(module_name: str, entry_name: str, missing: str):
    """``module_name.entry_name`` (a CUDA entry point); NotImplementedError(``missing``) while
    the module or the function is absent from this installation."""
    entry = getattr(load_cuda_module(module_name, missing), entry_name, None)
    if entry is None:
        raise NotImplementedError(missing)
    return entry


# The runtime's repeated-call path (numba_flash.cuda.launch.attention.attention_fast), set when
# the CUDA runtime is first loaded: until then no GPU call has been made and none can repeat.
_FAST = [None]
_ATTENTION_RUNTIME = f"{__package__}.cuda.launch.attention"     # this package's own runtime


def _load_attention_cuda():
    """The CUDA entry point of the forward (and, once loaded, its repeated-call path)."""
    module = load_cuda_module(_ATTENTION_RUNTIME, _CUDA_MISSING)
    entry = getattr(module, "attention_cuda", None)
    if entry is None:
        raise NotImplementedError(_CUDA_MISSING)
    _FAST[0] = getattr(module, "attention_fast", None)
    return entry


def attention(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), sinks=0,
              mask=None, softcap=None, alibi_slopes=None, return_lse=False, backend="auto",
              stream=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
              max_seqlen_k=None, score_mod=None, check_inputs=False, precision="auto"):
    """Exact scaled dot-product attention (FlashAttention), on the GPU or on the CPU.

    Parameters
    ----------
    q : array (batch, seqlen_q, heads_q, head_dim)
    k, v : arrays (batch, seqlen_k, heads_kv, head_dim); v may have its own head dim
        (batch, seqlen_k, heads_kv, head_dim_v), and out then takes it (DeepSeek MLA's 192 / 128;
        on the GPU the smaller side is zero-padded to the larger, a copy).
        One dtype for all three: float16, bfloat16, float32 or float64. Either all NumPy
        ndarrays (bfloat16 as ``ml_dtypes.bfloat16``), which run in CPU mode, or all GPU arrays
        exposing ``__cuda_array_interface__`` (CuPy arrays, PyTorch CUDA tensors, Numba device
        arrays), which run the CUDA kernels. GPU arrays may have any strides as long as head_dim
        is contiguous and the data pointer and the other axes' strides are multiples of 16
        bytes (axes of length 1 exempt; else ValueError): a transposed view of a (B, H, S, D)
        tensor works without a copy.
        ``heads_q`` must be a multiple of ``heads_kv`` (GQA/MQA): query head ``h`` reads kv head
        ``h // (heads_q // heads_kv)``.
    softmax_scale : float, optional
        Scores are ``softmax_scale * q . k``; default ``1 / sqrt(head_dim)``.
    causal : bool
        Query row ``i`` sees key ``j`` only if ``j <= i + seqlen_k - seqlen_q`` (bottom-right
        alignment, as with a KV cache).
    window_size : (int, int)
        Sliding window ``(left, right)`` on aligned positions: key ``j`` is visible from the
        query at position ``i`` iff ``i - left <= j <= i + right``; -1 leaves a side unbounded.
    sinks : int
        With a bounded left window (``window_size[0] >= 0``), the first ``sinks`` keys stay
        visible (causally) to every query (StreamingLLM attention sinks); ``sinks > 0`` with an
        unbounded left window raises ValueError (it would change nothing).
    mask : numba_flash.masks mask object, optional
        Any mask from :mod:`numba_flash.masks` (documents, prefix-LM, trees, dense boolean...).
        It is intersected with ``causal`` / ``window_size``.
    softcap : float > 0, optional
        Scores become ``softcap * tanh(score / softcap)`` before masking (Gemma-2, Grok).
    alibi_slopes : float32 array (heads_q,) or (batch, heads_q), optional
        ALiBi: ``-slope * |i - j|`` (aligned positions) is added to every score after the
        softcap (flash-attn's convention). Same kind of array as q; float64 is converted to
        float32 once (by the array's own library).
    score_mod : callable, optional
        ``score_mod(score, b, h, q_idx, kv_idx) -> float`` (FlexAttention's): a plain Python
        function applied to every score after the softcap and ALiBi, before the mask; ``b`` is
        the batch index (the sequence of a packed batch), ``h`` the query head, ``q_idx`` the
        query's aligned position (``row + seqlen_k - seqlen_q``), ``kv_idx`` the key's, all
        ints; ``score`` is the natural-log score (float32 in the float16 / bfloat16 / float32
        kernels, float64 in the float64 one and in CPU mode). On the GPU Numba compiles it into
        the kernel (it may read captured arrays: indices are always inside the sequences); CPU
        mode calls it on NumPy arrays when its body allows, else once per score. Returning -inf
        hides a pair like a mask, but only masks let tiles be skipped.
    return_lse : bool
        Also return the log-sum-exp of each query row.
    cu_seqlens_q, cu_seqlens_k : int32 arrays (batch + 1,), optional (int64 is converted)
        Packed variable-length batch (flash-attn's varlen layout): q is then (total_q, heads_q,
        head_dim) and k, v (total_k, heads_kv, head_dim); sequence s owns rows
        ``cu_seqlens_q[s]:cu_seqlens_q[s+1]`` of q and ``cu_seqlens_k[s]:cu_seqlens_k[s+1]`` of
        k and v, and is its own problem (bottom-right alignment, masks apply per sequence).
        out is (total_q, heads_q, head_dim), lse (heads_q, total_q). Same kind of array as q.
    max_seqlen_q, max_seqlen_k : int, optional
        Longest sequences of a packed batch; required with GPU cu_seqlens (not read back).
    backend : {"auto", "cpu", "cuda"}
        "auto" runs NumPy inputs in CPU mode and GPU arrays on the GPU. "cuda" with NumPy arrays
        is allowed only under Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``).
    stream : optional
        CUDA stream for the GPU backend (default: the current stream); must be None in CPU mode.
    check_inputs : bool
        GPU ``cu_seqlens`` are not read back (no synchronisation), so the kernels trust them.
        True copies them to the host once (one synchronisation) and runs CPU mode's checks:
        start at 0, non-decreasing, end at the packed length, fit int32, max_seqlen_q/k at
        least the longest sequence (the same ValueError). NumPy inputs are always checked.
    precision : {"auto", "ieee", "tensor_cores"}
        Which GPU kernel computes float32 / float64 inputs: "auto" (today the CUDA-core kernel,
        as "ieee") or "tensor_cores": float64 on DMMA (fp64 tensor cores, float64 products and
        sums), float32 by 3xTF32 (each operand split into two TF32 parts, three products: error
        within 2x the CUDA-core kernel's, docs/stability.md section 8); for head_dim up to 128
        (float64) / 96 (float32) with the flags only (NotImplementedError with a mask object,
        ALiBi, score_mod or cu_seqlens). float16 / bfloat16 always run on tensor cores ("ieee"
        is a ValueError for them). CPU mode computes in float64 whatever the setting.

    Returns
    -------
    out : array (batch, seqlen_q, heads_q, head_dim_v), same kind and dtype as q
    lse : array (batch, heads_q, seqlen_q), float32 (float64 for float64 inputs), only with ``return_lse=True``
        Natural-log log-sum-exp of the scaled, soft-capped visible scores of each query row.
        A query row that sees no key gets ``out = 0`` and ``lse = -inf``.

    Raises
    ------
    TypeError, ValueError
        For bad arguments; the message names the argument, what it got and what was expected.
    NotImplementedError
        For GPU inputs while the CUDA backend is not installed.

    Examples
    --------
    >>> import numpy as np, numba_flash
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((1, 5, 4, 16)).astype(np.float32)
    >>> k = rng.standard_normal((1, 7, 2, 16)).astype(np.float32)
    >>> v = rng.standard_normal((1, 7, 2, 16)).astype(np.float32)
    >>> out, lse = numba_flash.attention(q, k, v, causal=True, return_lse=True)
    >>> out.shape, out.dtype, lse.shape, lse.dtype
    ((1, 5, 4, 16), dtype('float32'), (1, 4, 5), dtype('float32'))
    """
    fast = _FAST[0]
    signature = None
    if fast is not None and backend != "cpu" and not check_inputs:
        # Same signature as an earlier GPU call (arrays' geometry, every keyword): its plan,
        # without validating again (validation depends on nothing else).
        extras = () if cu_seqlens_q is None and alibi_slopes is None else tuple(
            x for x in (cu_seqlens_q, cu_seqlens_k, alibi_slopes) if x is not None)
        result, signature = fast(q, k, v, (softmax_scale, causal, window_size, sinks, mask,
                                           softcap, alibi_slopes is None, return_lse, backend,
                                           cu_seqlens_q is None, cu_seqlens_k is None,
                                           max_seqlen_q, max_seqlen_k, score_mod, precision),
                                 extras, (mask, score_mod), stream)
        if result is not None:
            return result
    problem = validate(q, k, v, softmax_scale=softmax_scale, causal=causal,
                       window_size=window_size, sinks=sinks, mask=mask, softcap=softcap,
                       return_lse=return_lse, backend=backend, stream=stream,
                       alibi_slopes=alibi_slopes, cu_seqlens_q=cu_seqlens_q,
                       cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                       max_seqlen_k=max_seqlen_k, score_mod=score_mod,
                       check_inputs=check_inputs, precision=precision)
    options = dict(softmax_scale=problem.softmax_scale, causal=problem.causal,
                   window_size=problem.window_size, sinks=problem.sinks, mask=problem.mask,
                   softcap=problem.softcap, return_lse=problem.return_lse)
    if problem.alibi_slopes is not None:
        options["alibi_slopes"] = problem.alibi_slopes
    if problem.score_mod is not None:
        options["score_mod"] = problem.score_mod
    if problem.backend == "cpu":
        if problem.varlen is not None:
            from .varlen import attention_varlen_cpu

            return attention_varlen_cpu(q, k, v, problem.varlen, **options)
        from .cpu import attention_cpu

        return attention_cpu(q, k, v, **options)
    if problem.varlen is not None:
        options["varlen"] = problem.varlen
    if problem.precision != "auto":
        options["precision"] = problem.precision
    attention_cuda = _load_attention_cuda()
    return attention_cuda(q, k, v, stream=stream, fast=signature, **options)
