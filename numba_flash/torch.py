"""PyTorch autograd for numba_flash: ``numba_flash.torch.attention(q, k, v, **options)``.

A ``torch.autograd.Function`` whose forward is ``numba_flash.attention`` (with ``return_lse``) and
whose backward is ``numba_flash.attention_backward``. Besides the inputs it saves only out and lse
(O(seqlen) memory, no attention matrix). CPU tensors run CPU mode through NumPy (shared memory,
no copies; bfloat16 through an int16 view, exact); CUDA tensors go to the GPU entry points as
they are. PyTorch is optional for numba_flash: it is imported on the first call.
"""
from __future__ import annotations

import numpy as np

__all__ = ["attention"]

# The keywords of numba_flash.attention that also define the gradient, plus deterministic.
_OPTIONS = ("softmax_scale", "causal", "window_size", "sinks", "mask", "softcap",
            "alibi_slopes", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")
_FUNCTION = []   # the autograd.Function class, built on first use


def _require_torch():
    try:
        import torch
    except ImportError as exc:
        raise ImportError("numba_flash.torch needs PyTorch, which is not installed: "
                          "pip install torch") from exc
    return torch


def _to_numpy(torch, tensor):
    """A CPU tensor (or a non-tensor option) as a NumPy array sharing its memory."""
    if not isinstance(tensor, torch.Tensor):
        return tensor
    tensor = tensor.detach()
    if tensor.dtype == torch.bfloat16:
        import ml_dtypes

        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def _from_numpy(torch, array):
    """A NumPy result as a CPU tensor (bfloat16 through an int16 view)."""
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(array))


def _call(torch, function, tensors, options: dict):
    """``function(*tensors, **options)`` on CPU tensors through NumPy, on CUDA tensors directly."""
    on_gpu = tensors[0].is_cuda
    if on_gpu:
        results = function(*(t.detach() for t in tensors), **options)
    else:
        options = {name: _to_numpy(torch, value) for name, value in options.items()}
        results = function(*(_to_numpy(torch, t) for t in tensors), **options)
    results = results if isinstance(results, tuple) else (results,)
    return tuple(r if on_gpu else _from_numpy(torch, r) for r in results)


def _function_class(torch):
    """The torch.autograd.Function, defined once torch is importable."""
    if _FUNCTION:
        return _FUNCTION[0]
    import numba_flash

    class FlashAttention(torch.autograd.Function):
        """out = attention(q, k, v); backward from the saved out and lse."""

        @staticmethod
        def forward(ctx, q, k, v, options, deterministic):
            out, lse = _call(torch, numba_flash.attention, (q, k, v),
                             dict(options, return_lse=True))
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.options, ctx.deterministic = options, deterministic
            return out

        @staticmethod
        def backward(ctx, dout):
            q, k, v, out, lse = ctx.saved_tensors
            # loss = out.sum() hands back an expanded (stride-0) gradient: the kernels need a
            # contiguous head_dim.
            dout = dout.contiguous()
            grads = _call(torch, numba_flash.attention_backward, (dout, q, k, v, out, lse),
                          dict(ctx.options, deterministic=ctx.deterministic))
            return tuple(g if need else None
                         for g, need in zip(grads, ctx.needs_input_grad)) + (None, None)

    _FUNCTION.append(FlashAttention)
    return FlashAttention


def attention(q, k, v, *, deterministic=False, **options):
    """Differentiable ``numba_flash.attention`` for PyTorch tensors.

    q: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim) torch
    tensors of one dtype (float16, bfloat16, float32, float64), all on the CPU or all on one
    CUDA device; with ``cu_seqlens_q`` / ``cu_seqlens_k`` the packed (total, heads, head_dim)
    layout. ``options``: softmax_scale, causal, window_size, sinks, mask, softcap, alibi_slopes,
    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, as for ``numba_flash.attention``
    (tensor options live where q does). ``deterministic``: reproducible dQ accumulation on the GPU.

    Returns out, a tensor shaped and typed like q that carries gradients to q, k and v
    (``numba_flash.attention_backward``; CPU mode: exact float64 gradients rounded once to the
    dtype). Raises ImportError without PyTorch, TypeError for an unknown or unsupported option
    (return_lse, score_mod, backend, stream), and what ``numba_flash.attention`` raises.
    """
    torch = _require_torch()
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise TypeError(f"numba_flash.torch.attention got unsupported option(s) {unknown}; "
                        f"accepted: {', '.join(_OPTIONS)}, deterministic (return_lse, "
                        f"score_mod, backend and stream are not differentiable options here)")
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}; "
                            f"NumPy and CuPy arrays go to numba_flash.attention directly")
    return _function_class(torch).apply(q, k, v, options, deterministic)
