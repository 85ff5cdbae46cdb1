"""From a mask object to what the attention kernel reads (see kernels/masking.py for the kinds).

* A ``masks.mask_mod`` becomes ``MASK_MOD``: the user's function is compiled into the kernel, and
  its class table (every pair of every tile evaluated on the device) is built once per
  (mask, lengths, tile shape) and kept.
* Any other mask with column intervals becomes ``INTERVALS``: the four int32 vectors (computed
  on the host in O(seqlen_k) from the mask's parameters, uploaded once and kept); their per-tile
  min/max vectors are computed on the device once per (mask, lengths, tile shape) (FlashMask's
  preprocessing) and the kernel classifies each (query tile, key tile) from them as it runs.
* The rest (trees not in DFS preorder, arbitrary matrices, intersections needing more than two
  intervals per column) become ``BITMASK``: seqlen_q * ceil(seqlen_k / 32) uint32 words, uploaded
  once, with an exact class table built on the device once.

Device buffers are cached on the mask object (``_nf_device``), keyed by lengths, tile shape and
device, so repeated calls upload nothing. Memory: intervals 16 * seqlen_k bytes plus 32 bytes
per key tile (O(N)); bitmask seqlen_q * seqlen_k / 8 bytes plus one byte per tile.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import cuda

from numba_flash_reference.intervals import NotRepresentableError
from numba_flash_reference.masks import IntersectionMask, MaskModMask

from ..kernels import tile_classes as tiles
from .arrays import placeholder
from .device import current_device_id
from ..kernels.masking import BITMASK, INTERVALS, MASK_MOD, NONE
from ..primitives import SIMULATOR

__all__ = ["MaskPlan", "plan_mask", "dummy_arrays", "mask_encoding"]


class MaskPlan(NamedTuple):
    """Kernel inputs for one mask: kind, intervals (4, Sk), min/max (8, n_k), class table
    (T, n_q, n_k), bitmask words, and the user's mask_mod (or None)."""
    kind: int
    iv: object
    mm: object
    table: object
    bits: object
    mask_mod: object


class _Dummies(NamedTuple):
    iv: object
    mm: object
    table: object
    bits: object
    cu: object
    alibi: object


_DUMMY_SETS: dict = {}


def _to_device(x):
    x = np.ascontiguousarray(x)
    return x if SIMULATOR else cuda.to_device(x)


def _device_key():
    return current_device_id()


def dummy_arrays() -> _Dummies:
    """The placeholders (arrays.placeholder) of the mask, cu_seqlens and ALiBi arguments that a
    configuration does not use, on the current device."""
    dev = current_device_id()
    entry = _DUMMY_SETS.get(dev)
    if entry is None:
        entry = _DUMMY_SETS[dev] = _Dummies(
            placeholder(dev, (4, 1), np.int32), placeholder(dev, (8, 1), np.int32),
            placeholder(dev, (1, 1, 1), np.int8, 1), placeholder(dev, (1, 1), np.uint32),
            placeholder(dev, (2,), np.int32), placeholder(dev, (1, 1), np.float32))
    return entry


def mask_encoding(mask, seqlen_q: int, seqlen_k: int) -> str:
    """"none", "mask_mod", "intervals" or "bitmask": what the GPU uses for this mask."""
    if mask is None:
        return "none"
    if isinstance(mask, MaskModMask):
        return "mask_mod"
    if isinstance(mask, IntersectionMask) and any(isinstance(p, MaskModMask) for p in mask.parts):
        raise NotImplementedError(f"{mask!r}: a mask_mod cannot be intersected with other mask "
                                  f"objects on the GPU; write the whole predicate in the function "
                                  f"(flags causal / window_size / sinks do combine)")
    try:
        mask.column_intervals(seqlen_q, seqlen_k)
        return "intervals"
    except NotRepresentableError:
        return "bitmask"


def _cache(mask) -> dict:
    store = mask.__dict__.get("_nf_device")
    if store is None:
        store = mask.__dict__["_nf_device"] = {}
    return store


def plan_mask(mask, batch: int, heads_q: int, seqlen_q: int, seqlen_k: int, block_m: int,
              block_n: int, varlen: bool, stream) -> MaskPlan:
    """Device inputs of the attention kernel for ``mask`` (None: flags only).

    batch, heads_q, seqlen_q, seqlen_k: the problem (max lengths for a packed batch); block_m,
    block_n: the kernel's tile shape. With ``varlen`` only a mask_mod is accepted (evaluated per
    element in every tile: sequences have their own lengths). ``stream``: where the first call
    builds the plan, or a function of no arguments returning it (called only then: resolving
    the caller's stream costs more host time than a cached plan's lookup).
    """
    d = dummy_arrays()
    if mask is None:
        return MaskPlan(NONE, d.iv, d.mm, d.table, d.bits, None)
    # The whole plan is kept per problem: deciding the encoding alone costs a host pass over
    # the columns (~1.4 ms at N = 8192), far more than the launch.
    store = _cache(mask)
    pkey = ("plan", seqlen_q, seqlen_k, block_m, block_n, batch, heads_q, varlen, _device_key())
    plan = store.get(pkey)
    if plan is None:
        # The per-key-tile min/max of the intervals (FlashMask's preprocessing) is computed
        # here, once: mask objects are immutable, so recomputing it at every call (a Numba
        # dispatcher launch, ~0.1 ms of host time) would give the same vectors.
        if callable(stream):
            stream = stream()
        plan = store[pkey] = _plan_mask(mask, d, batch, heads_q, seqlen_q, seqlen_k, block_m,
                                        block_n, varlen, stream)
        if not SIMULATOR:   # once: later calls may come on other streams
            cuda.synchronize()
    return plan


def _plan_mask(mask, d, batch, heads_q, seqlen_q, seqlen_k, block_m, block_n, varlen, stream):
    encoding = mask_encoding(mask, seqlen_q, seqlen_k)
    if varlen and encoding != "mask_mod":
        raise NotImplementedError(f"mask objects other than masks.mask_mod depend on the "
                                  f"sequence lengths and cannot serve a packed (cu_seqlens) batch; "
                                  f"got {mask!r}. Use causal / window_size, or a mask_mod")
    store = _cache(mask)
    key = (encoding, seqlen_q, seqlen_k, block_m, block_n, batch, heads_q, varlen, _device_key())
    if encoding == "mask_mod":
        table = store.get(key)
        if table is None:
            n_q, n_k = -(-seqlen_q // block_m), -(-seqlen_k // block_n)
            if varlen:  # no table: every tile partial
                table = _to_device(np.ones((1, n_q, n_k), np.int8))
            else:
                b, h = (batch, heads_q) if mask.batch_head else (1, 1)
                table = tiles.classify_mask_mod(mask.fn, b, h, seqlen_q, seqlen_k, block_m,
                                                block_n, stream)
            store[key] = table
        return MaskPlan(MASK_MOD, d.iv, d.mm, table, d.bits, mask.fn)
    if encoding == "intervals":
        entry = store.get(key)
        if entry is None:
            iv = mask.column_intervals(seqlen_q, seqlen_k).stacked().astype(np.int32)
            iv_dev = _to_device(iv)
            mm = tiles.tile_minmax(iv_dev, seqlen_q, block_n, stream)
            entry = store[key] = (iv_dev, mm)
        iv_dev, mm = entry
        return MaskPlan(INTERVALS, iv_dev, mm, d.table, d.bits, None)
    entry = store.get(key)
    if entry is None:
        words = mask.to_bitmask(seqlen_q, seqlen_k).view(np.uint32)
        bits = _to_device(words)
        table = tiles.classify_bitmask(bits, seqlen_q, seqlen_k, block_m, block_n, stream)
        entry = store[key] = (bits, table.reshape((1,) + tuple(table.shape)))
    bits, table = entry
    return MaskPlan(BITMASK, d.iv, d.mm, table, bits, None)
