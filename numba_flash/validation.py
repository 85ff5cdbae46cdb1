"""Argument checks for ``numba_flash.attention``.

Every failure is a TypeError (wrong kind of value) or ValueError (right kind, wrong value) whose
message names the argument, what it got and what was expected.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np

from numba_flash_reference.attention import (check_alibi_slopes, check_score_mod, check_softcap,
                                             check_softmax_scale)
from numba_flash_reference.masks import (CausalMask, Mask, SlidingWindowMask, check_window_size,
                                         mask_from_flags)

from .arrays import as_dtype, describe, describe_all, dtype_name

__all__ = ["Problem", "validate", "SUPPORTED_DTYPES", "BACKENDS", "cuda_simulator_enabled",
           "check_bool", "check_sinks", "check_mask", "check_backend_value", "resolve_backend",
           "Options", "check_options", "check_dtypes", "check_sinks_window"]

SUPPORTED_DTYPES = ("float16", "bfloat16", "float32", "float64")
BACKENDS = ("auto", "cpu", "cuda")

_Q_AXES = "(batch, seqlen_q, heads_q, head_dim)"
_KV_AXES = "(batch, seqlen_k, heads_kv, head_dim)"


@dataclass(frozen=True)
class Problem:
    """A validated attention call: sizes, dtype, normalised options and the chosen backend.

    ``backend`` is "cpu" or "cuda" (never "auto"); ``softmax_scale`` is a float (the default
    1/sqrt(head_dim) filled in); ``window_size`` is a pair of ints; ``mask`` is the user's mask
    object or None. ``infos`` holds the ArrayInfo of q, k and v.
    """

    kind: str
    backend: str
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    dtype: np.dtype
    softmax_scale: float
    causal: bool
    window_size: tuple
    sinks: int
    mask: Mask | None
    softcap: float | None
    return_lse: bool
    infos: dict
    alibi_slopes: object = None   # None, or the caller's (heads_q,) / (batch, heads_q) array
    varlen: object = None         # None, or a numba_flash.varlen.Varlen
    score_mod: object = None      # None, or the caller's fn(score, b, h, q_idx, kv_idx)
    precision: str = "auto"       # "auto", "ieee" or "tensor_cores" (check_precision)


def cuda_simulator_enabled() -> bool:
    """True when Numba's CUDA simulator is on (``NUMBA_ENABLE_CUDASIM=1``), read without numba.cuda."""
    try:
        if int(os.environ.get("NUMBA_ENABLE_CUDASIM", "0") or 0):
            return True
    except ValueError:
        pass
    config = sys.modules.get("numba.core.config")
    return bool(getattr(config, "ENABLE_CUDASIM", False))


def _is_bool(value) -> bool:
    return isinstance(value, (bool, np.bool_))


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not _is_bool(value)


def check_bool(name, value) -> bool:
    """``value`` as a bool; TypeError naming ``name`` unless it is a Python or NumPy bool."""
    if not _is_bool(value):
        raise TypeError(f"{name} must be a bool (True or False), got {type(value).__name__} "
                        f"{value!r}")
    return bool(value)


def check_sinks(value) -> int:
    """``sinks`` (number of always-visible leading keys) as an int >= 0."""
    if not _is_int(value):
        raise TypeError(f"sinks must be an integer >= 0, got {type(value).__name__} {value!r}")
    if value < 0:
        raise ValueError(f"sinks must be >= 0, got {value}")
    return int(value)


def check_mask(value) -> Mask | None:
    """``mask``: None or a ``numba_flash.masks`` object (TypeError otherwise)."""
    if value is None or isinstance(value, Mask):
        return value
    raise TypeError(f"mask must be None or a mask object from numba_flash.masks (a subclass of "
                    f"numba_flash_reference.masks.Mask), got {type(value).__name__}; a boolean "
                    f"matrix must be wrapped in a mask object first")


def check_backend_value(value) -> str:
    """``backend``: one of "auto", "cpu", "cuda" (ValueError otherwise)."""
    if not isinstance(value, str) or value not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(repr(b) for b in BACKENDS)}, "
                         f"got {value!r}")
    return value


class Options(NamedTuple):
    """The options ``attention`` and ``decode`` share, checked and normalised."""
    backend: str
    causal: bool
    return_lse: bool
    window_size: tuple
    sinks: int
    mask: Mask | None
    softcap: float | None


def check_sinks_window(sinks: int, window_size: tuple) -> None:
    """ValueError when ``sinks > 0`` meets an unbounded left window, where sinks would be
    silently ignored: every earlier key, the sinks included, is visible already."""
    if sinks > 0 and window_size[0] < 0:
        raise ValueError(f"sinks={sinks} has no effect with an unbounded left window "
                         f"(window_size={window_size}): every earlier key, the first {sinks} "
                         f"included, is visible already. Attention sinks go with a sliding "
                         f"window: pass window_size=(left, right) with left >= 0, or sinks=0")


def check_options(*, backend, causal, return_lse, window_size, sinks, mask, softcap) -> Options:
    """Check the shared options (TypeError/ValueError naming the argument); return them
    normalised: window_size as two ints, softcap None for "off" (None or 0.0). ``sinks > 0``
    needs a bounded left window (``check_sinks_window``)."""
    options = Options(check_backend_value(backend), check_bool("causal", causal),
                      check_bool("return_lse", return_lse), check_window_size(window_size),
                      check_sinks(sinks), check_mask(mask), check_softcap(softcap))
    check_sinks_window(options.sinks, options.window_size)
    return options


def lower_window_mask(causal: bool, window_size: tuple, sinks: int, mask):
    """A ``mask`` that is exactly ``masks.causal()`` or ``masks.sliding_window(...)`` folded into
    the flags (checked ``causal``, ``window_size``, ``sinks``), when the result means the same
    pairs; returns (causal, window_size, sinks, mask), mask None when folded. The flag kernels
    test a window with two integer comparisons per tile, without the interval mask's per-column
    bounds; other masks, and combinations whose sinks would not survive the fold, stay as
    they are.

    Why exact: every flag combination means ``SlidingWindowMask(left, right, sinks)`` with
    ``right`` clamped to 0 by ``causal`` (``mask_from_flags``). ``W(l, r, s) & causal()`` is
    ``W(l, min(r, 0), s)`` since sink keys are visible only causally; two windows without sinks
    intersect to ``W(min(l1, l2), min(r1, r2))`` over their bounded sides."""
    left, right = window_size
    if type(mask) is CausalMask:
        return True, window_size, sinks, None
    if type(mask) is not SlidingWindowMask:
        return causal, window_size, sinks, mask
    flags_windowed = causal or left >= 0 or right >= 0
    if not flags_windowed:
        return False, (mask.left, mask.right), mask.sinks, None
    flag_sinks = sinks if left >= 0 else 0
    if mask.sinks and mask.left >= 0 or flag_sinks:
        return causal, window_size, sinks, mask     # sinks of either side: keep the mask

    def tighter(a, b):
        return b if a < 0 else a if b < 0 else min(a, b)

    return causal, (tighter(left, mask.left), tighter(right, mask.right)), 0, None


def resolve_backend(backend: str, kind: str, stream) -> str:
    """The backend that runs: "cpu" or "cuda", from the requested ``backend``, the arrays' ``kind``
    ("numpy" or "cuda") and ``stream`` (CPU mode needs None); ValueError for impossible pairs."""
    if backend == "auto":
        chosen = "cpu" if kind == "numpy" else "cuda"
    elif backend == "cpu":
        if kind != "numpy":
            raise ValueError("backend='cpu' runs on NumPy arrays, got GPU arrays; copy them to the "
                             "host first (e.g. cupy.asnumpy) or use backend='auto' or 'cuda'")
        chosen = "cpu"
    else:
        if kind == "numpy" and not cuda_simulator_enabled():
            raise ValueError("backend='cuda' needs GPU arrays (CuPy, PyTorch CUDA tensors, ...), "
                             "got NumPy arrays; NumPy inputs reach the CUDA kernels only under "
                             "Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1). Move the arrays "
                             "to the GPU (cupy.asarray) or use backend='auto' or 'cpu'")
        chosen = "cuda"
    if chosen == "cpu" and stream is not None:
        raise ValueError(f"stream applies to the CUDA backend only; CPU mode (NumPy inputs) needs "
                         f"stream=None, got {stream!r}")
    return chosen


def _check_shapes(infos: dict) -> tuple:
    q, k, v = infos["q"], infos["k"], infos["v"]
    for name, info, axes in (("q", q, _Q_AXES), ("k", k, _KV_AXES), ("v", v, _KV_AXES)):
        if len(info.shape) != 4:
            raise ValueError(f"{name} must have 4 dimensions {axes}, got shape {info.shape}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must have the same (batch, seqlen_k, heads_kv), got k "
                         f"{k.shape} and v {v.shape} (v's head_dim may differ from k's)")
    batch, seqlen_q, heads_q, head_dim = q.shape
    batch_k, seqlen_k, heads_kv, head_dim_k = k.shape
    for name, info, axes in (("q", q, _Q_AXES), ("k", k, _KV_AXES), ("v", v, _KV_AXES)):
        labels = axes.strip("()").split(", ")
        for label, size in zip(labels, info.shape):
            if size < 1:
                raise ValueError(f"{name} must have {label} >= 1, got shape {info.shape} "
                                 f"{axes}")
    if batch_k != batch:
        raise ValueError(f"q and k must have the same batch size, got q.shape[0]={batch} and "
                         f"k.shape[0]={batch_k}")
    if head_dim_k != head_dim:
        raise ValueError(f"q and k must have the same head_dim, got q.shape[3]={head_dim} and "
                         f"k.shape[3]={head_dim_k}")
    if heads_q % heads_kv:
        raise ValueError(f"heads_q must be a multiple of heads_kv (grouped-query attention), got "
                         f"q.shape[2]={heads_q} and k.shape[2]={heads_kv}")
    return batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim


def check_dtypes(infos: dict, names=("q", "k", "v")) -> np.dtype:
    """The one dtype of the arrays ``names`` (keys of ``infos``, ArrayInfo values); TypeError
    naming each array's dtype when they differ or when it is not a supported dtype."""
    dtypes = {name: dtype_name(infos[name].dtype) for name in names}
    listed = ", ".join(names[:-1]) + " and " + names[-1]
    if len(set(dtypes.values())) > 1:
        got = ", ".join(f"{n} {d}" for n, d in dtypes.items())
        raise TypeError(f"{listed} must have the same dtype, got {got}")
    if dtypes[names[0]] not in SUPPORTED_DTYPES:
        raise TypeError(f"{listed} have dtype {dtypes[names[0]]}; expected one of "
                        f"{', '.join(SUPPORTED_DTYPES)} (bfloat16 is ml_dtypes.bfloat16 for NumPy)")
    return infos[names[0]].dtype


def check_gpu_strides(infos: dict) -> None:
    """GPU arrays (any rank) need a contiguous last axis and strides in whole elements: the
    kernels read head_dim in 16-byte chunks or 32-bit pairs (a stride-0 head_dim, as in an
    expanded autograd gradient, would be read as contiguous)."""
    for name, info in infos.items():
        itemsize = info.dtype.itemsize
        if info.shape[-1] > 1 and info.strides[-1] != itemsize:
            raise ValueError(f"{name} must have a contiguous head_dim (last axis stride "
                             f"{itemsize} bytes), got strides {info.strides}; make a copy with "
                             f"contiguous last axis (e.g. cupy.ascontiguousarray)")
        if any(s % itemsize for s in info.strides):
            raise ValueError(f"{name} strides must be multiples of the itemsize {itemsize}, got "
                             f"{info.strides}")


def _packed_as_batch(infos: dict) -> dict:
    """Varlen q (total_q, Hq, D) and k, v (total_k, Hkv, D) seen as batch-1 4-D arrays, so that
    the shape checks apply unchanged."""
    out = {}
    for name, info in infos.items():
        if len(info.shape) != 3:
            axes = "(total_q, heads_q, head_dim)" if name == "q" else "(total_k, heads_kv, head_dim)"
            raise ValueError(f"with cu_seqlens, {name} must have 3 dimensions {axes}, got shape "
                             f"{info.shape}")
        out[name] = replace(info, shape=(1,) + info.shape, strides=(0,) + info.strides)
    return out


def _check_alibi(alibi_slopes, kind: str, batch: int, heads_q: int):
    """alibi_slopes as float32 (heads_q,) or (batch, heads_q), of q's kind: float64 (NumPy's
    default) is converted once by the array's own library, float32 passes untouched."""
    if alibi_slopes is None:
        return None
    info = describe(alibi_slopes, "alibi_slopes")
    if info.kind != kind:
        raise TypeError(f"alibi_slopes must live where q does, got {info.type_name}")
    if info.dtype not in (np.float32, np.float64):
        raise TypeError(f"alibi_slopes must be float32 (flash-attn's convention; float64 is "
                        f"converted), got {info.dtype}")
    if info.shape not in ((heads_q,), (batch, heads_q)):
        raise ValueError(f"alibi_slopes must have shape (heads_q,) = ({heads_q},) or (batch, "
                         f"heads_q) = ({batch}, {heads_q}), got {info.shape}")
    with np.errstate(over="ignore"):   # a float64 slope beyond float32 becomes inf: refused below
        alibi_slopes = as_dtype(alibi_slopes, np.float32, info)
    if kind == "numpy":
        check_alibi_slopes(alibi_slopes, batch, heads_q)
    return alibi_slopes


PRECISIONS = ("auto", "ieee", "tensor_cores")
# Head dims (after the GPU's zero padding to 32 / 64 / 96 / 128) of the exact tensor-core kernels:
# kernels/forward_dmma.dmma_supported and forward_tf32x3.tf32x3_supported, restated here so that
# validation imports nothing of numba.cuda (launch/attention.tensor_core_kernel asks them).
_TENSOR_CORE_MAX_HEAD_DIM = {"float32": 128, "float64": 128}


def check_precision(precision, dtype, head_dim: int, mask, alibi_slopes, varlen,
                    score_mod) -> str:
    """``precision`` of ``numba_flash.attention``: "auto" (the default kernels), "ieee"
    (float32 / float64 products on CUDA cores) or "tensor_cores" (float64 on DMMA, float32 by
    3xTF32: head_dim up to 128, flags only: no mask object, ALiBi or score_mod, and for
    float32 no packed batch). 16-bit inputs always run on tensor cores ("ieee" is refused for
    them)."""
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(map(repr, PRECISIONS))}, got "
                         f"{precision!r}")
    name = np.dtype(dtype).name
    if precision == "ieee" and name not in _TENSOR_CORE_MAX_HEAD_DIM:
        raise ValueError(f"precision='ieee' applies to float32 / float64 inputs; {name} always "
                         f"runs on tensor cores (leave precision='auto')")
    if precision != "tensor_cores" or name not in _TENSOR_CORE_MAX_HEAD_DIM:
        return precision
    packed = None if name == "float64" else varlen       # DMMA takes packed batches
    extras = [label for label, value in (("a mask object", mask), ("alibi_slopes", alibi_slopes),
                                         ("cu_seqlens", packed), ("score_mod", score_mod))
              if value is not None]
    limit = _TENSOR_CORE_MAX_HEAD_DIM[name]
    if extras or head_dim > limit:
        got = ", ".join(extras + ([f"head_dim {head_dim}"] if head_dim > limit else []))
        takes = "" if name == "float32" else " and cu_seqlens"
        raise NotImplementedError(f"precision='tensor_cores' for {name} takes head_dim up to "
                                  f"{limit} and the flags (causal, window_size, sinks, softcap)"
                                  f"{takes} only, got {got}; use precision='auto'")
    return precision


def validate(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), sinks=0,
             mask=None, softcap=None, return_lse=False, backend="auto", stream=None,
             alibi_slopes=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
             max_seqlen_k=None, score_mod=None, check_inputs=False,
             precision="auto") -> Problem:
    """Check every argument of ``numba_flash.attention`` and return the normalised Problem.

    q: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim); one
    dtype among float16, bfloat16, float32, float64; all NumPy arrays or all GPU arrays.
    With cu_seqlens_q / cu_seqlens_k (varlen): q (total_q, heads_q, head_dim), k, v (total_k,
    heads_kv, head_dim); then batch is the number of sequences and seqlen_q / seqlen_k are
    max_seqlen_q / max_seqlen_k. ``check_inputs``: also check GPU cu_seqlens on a host copy
    (one synchronisation), as NumPy ones always are. Raises TypeError / ValueError naming the
    offending argument.
    """
    infos = describe_all(q=q, k=k, v=v)
    check_inputs = check_bool("check_inputs", check_inputs)
    varlen = None
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        from .varlen import check_varlen

        packed = _packed_as_batch(infos)
        varlen = check_varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              infos["q"].shape[0], infos["k"].shape[0], infos["q"].kind,
                              check_inputs)
        infos = packed
    elif max_seqlen_q is not None or max_seqlen_k is not None:
        raise ValueError("max_seqlen_q / max_seqlen_k apply to packed batches only; pass "
                         "cu_seqlens_q and cu_seqlens_k too, or leave them None")
    kind = infos["q"].kind
    backend, causal, return_lse, window_size, sinks, mask, softcap = check_options(
        backend=backend, causal=causal, return_lse=return_lse, window_size=window_size,
        sinks=sinks, mask=mask, softcap=softcap)
    causal, window_size, sinks, mask = lower_window_mask(causal, window_size, sinks, mask)
    batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim = _check_shapes(infos)
    dtype = check_dtypes(infos)
    softmax_scale = check_softmax_scale(softmax_scale, head_dim)
    chosen = resolve_backend(backend, kind, stream)
    if kind == "cuda":
        check_gpu_strides(infos)
    combined = mask_from_flags(causal, window_size, sinks, mask)
    if varlen is not None:
        batch, seqlen_q, seqlen_k = varlen.batch, varlen.max_seqlen_q, varlen.max_seqlen_k
    elif combined is not None:
        combined._check_sizes(seqlen_q, seqlen_k)
    alibi_slopes = _check_alibi(alibi_slopes, kind, batch, heads_q)
    score_mod = check_score_mod(score_mod)
    precision = check_precision(precision, dtype, head_dim, mask, alibi_slopes, varlen, score_mod)
    return Problem(kind, chosen, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype,
                   softmax_scale, causal, window_size, sinks, mask, softcap, return_lse, infos,
                   alibi_slopes, varlen, score_mod, precision)
