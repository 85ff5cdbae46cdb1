"""numba-flash: exact FlashAttention in Python, with numba.cuda kernels and a NumPy CPU mode.

Public API:

- ``numba_flash.attention(q, k, v, ...)``: exact attention on GPU arrays (CuPy, PyTorch CUDA
  tensors, anything with ``__cuda_array_interface__``) or NumPy arrays (CPU mode).
- ``numba_flash.attention_backward(dout, q, k, v, out, lse, ...)``: gradients of ``attention``
  (CPU mode now; ``numba_flash.torch.attention`` wraps both as a torch.autograd.Function).
- ``numba_flash.decode(q, k_cache, v_cache, ...)``: split-KV decoding over a contiguous or paged
  KV cache (FlashDecoding), GPU or NumPy.
- ``numba_flash.merge_states(o, lse)``: merge partial attention states (NumPy or GPU arrays).
- ``numba_flash.warmup(...)``: compile a set of GPU kernel configurations into the disk cache.
- ``numba_flash.masks``: mask constructors (causal documents, prefix-LM, trees, ...).
- ``numba_flash.__version__``.

Importing this package compiles nothing and needs no GPU: numba.cuda and CuPy are imported only
when a GPU call is made, and ``masks`` is loaded on first access.
"""
from __future__ import annotations

import importlib

from .api import attention
from .backward import attention_backward
from .decode import decode
from .merge import merge_states
from .warmup import warmup

__all__ = ["attention", "attention_backward", "decode", "merge_states", "warmup", "masks",
           "__version__"]
__version__ = "0.1.0"


def __getattr__(name):
    if name == "masks":
        module = importlib.import_module(".masks", __name__)
        globals()["masks"] = module
        return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | {"masks"})
