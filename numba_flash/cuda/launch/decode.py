"""Split-KV decode's runtime (FlashDecoding): kernel choice, split heuristics, the folded
merge's counters, and launch plans (driver.py) for the two decode kernels.

float16 / bfloat16 with head_dim a multiple of 16 up to 128 run the tensor-core kernel
(kernels/decode_mma.py, merge folded in: the last warp of each row chunk merges the splits);
other head_dims (256) run the CUDA-core kernel (kernels/decode_fma.py), whose splits the merge
kernel (kernels/merge.py) combines in a second launch. docs/decode.md describes both and the
measurements behind every constant here.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda
from numba.cuda import types

from ..kernels.decode_fma import DECODE_WARPS, MAX_ROWS, decode_kernel
from ..kernels.decode_mma import MMA_ROWS, make_mma_decode_kernel, mma_decode_supported
from ..kernels.merge import OUT_BF16, OUT_F16
from ..primitives import SIMULATOR
from .arrays import (BFloat16Array, caller_param, check_rows_aligned, empty_like_kind,
                     fixed_param, gpu_inputs, interface, kernel_array, placeholder)
from .attention import window_flags
from .device import current_device_id, sm_count
from .driver import ArrayParam, LaunchPlan, ScalarParam, compile_kernel, stream_is_capturing
from .fastpath import (FastCall, capture_reader, current_stream_of, fast_table, geometry_of,
                       geometry_reader, register_fast)
from .merge import merge_plan, merge_simulated
from .streams import raw_stream_handle

__all__ = ["decode_cuda", "decode_fast", "auto_num_splits", "auto_num_splits_mma", "mma_tile",
           "tree_row_bits", "GraphCaptureError", "LAST_PLAN"]

MIN_KEYS_PER_SPLIT = 256
WAVES = 2            # "auto" aims at this many blocks per multiprocessor (resident at ~240 regs)
MAX_SPLITS = 128
# (keys per tile, cp.async stages, warps per block) and the warps per multiprocessor "auto"
# aims at, from the H100 and H200 sweeps in docs/decode.md. Paged caches with power-of-two
# pages take the same fast copies as contiguous ones plus one block_table load per page of a
# tile, and one more warp per multiprocessor to cover that load; other page sizes look every
# key's page up per copy (instruction-bound): 16-key tiles, three stages, more warps.
MMA_TILE = (32, 2, 1)
MMA_WARPS_PER_SM = 3
MMA_WARPS_PER_SM_PAGED = 4
MMA_TILE_PAGED_ANY = (16, 3, 1)
MMA_WARPS_PER_SM_PAGED_ANY = 8
SHORT_SPLIT_KEYS = 1024      # fewer keys per split than this: one more warp per SM
LAST_PLAN: dict = {}         # splits and tile of the last decode_cuda call (benchmarks read it)
_MMA_KERNELS: dict = {}
_TREES: dict = {}
_COUNTERS: dict = {}


def mma_tile(head_dim: int, paged: bool = False, pow2_pages: bool = True):
    """(block_n, stages, warps) of the tensor-core kernel (``pow2_pages``: the page size of a
    paged cache is a power of two)."""
    return MMA_TILE_PAGED_ANY if paged and not pow2_pages else MMA_TILE


def auto_num_splits(blocks: int, keys: int, sm_count: int) -> int:
    """Splits of the key range so that the grid fills the device in one wave.

    ``blocks``: blocks without splitting (B * heads_kv * row_chunks); ``keys``: an upper bound
    of the keys one block visits (the cache capacity, or the window's extent). The most splits
    whose grid still fits ``WAVES * sm_count`` resident blocks (rounding down: a partial second
    wave costs nearly a whole one), at least MIN_KEYS_PER_SPLIT keys per split, at most
    MAX_SPLITS. Returns 1 (no merge) when the grid is already full.
    """
    want = (WAVES * sm_count) // max(blocks, 1)
    by_len = max(1, keys // MIN_KEYS_PER_SPLIT)
    return int(max(1, min(want, by_len, MAX_SPLITS)))


def auto_num_splits_mma(units: int, keys: int, sm_count: int,
                        warps_per_sm: int = MMA_WARPS_PER_SM, short_keys: int = SHORT_SPLIT_KEYS
                        ) -> int:
    """Splits for the tensor-core kernel, whose unit of work is one warp.

    ``units``: warps without splitting (B * heads_kv * row_chunks); ``keys``: an upper bound of
    the keys a unit visits. The split count whose warps come nearest ``warps_per_sm *
    sm_count`` (rounding to nearest: (32, 32, 8, 2048, 128) has 256 units, 1.94 warps per
    multiprocessor without splitting, and on the H200 ran 75.9 us at 1 split, 67.2 at 2,
    docs/data/gpu_bound_shapes_h200_2026-11-27.json); if a split would then hold fewer than
    ``short_keys`` keys (a short call, where the per-warp start and the merge weigh more), one
    more warp per multiprocessor, rounding down. At least MIN_KEYS_PER_SPLIT keys per split, at
    most MAX_SPLITS; 1 when the units alone come near the target. The H100 sweep
    (docs/decode.md) peaks at about 3 warps per multiprocessor for contiguous caches (~400
    warps; one warp keeps 16-32 KB of copies in flight).
    """
    units = max(units, 1)
    want = (2 * warps_per_sm * sm_count + units) // (2 * units)    # the nearest count
    if want > 1 and short_keys and keys // want < short_keys:
        want = ((warps_per_sm + 1) * sm_count) // units
    by_len = max(1, keys // MIN_KEYS_PER_SPLIT)
    return int(max(1, min(want, by_len, MAX_SPLITS)))


class GraphCaptureError(RuntimeError):
    """A decode call inside a CUDA graph capture needs a buffer that cannot be made there."""


# Folded-merge counters of calls made while a stream is being captured into a CUDA graph: one
# buffer per capture (the graph may be replayed on any stream, any time, so it shares its
# counters with nothing else), kept for the life of the process. Memory cannot be allocated
# during a capture, so each comes from a reserve of zeroed buffers made outside captures.
_SPARE_COUNTERS: dict = {}
SPARE_COUNTERS = 2


def _capture_id(handle):
    """The id of the CUDA graph capture in progress on the stream of int ``handle``
    (a raw handle), or None when it is not capturing (or cannot be asked)."""
    if handle is None:
        return None
    try:
        from cuda.bindings import driver
    except ImportError:         # without the bindings, no capture can be detected
        return None
    res = driver.cuStreamGetCaptureInfo(driver.CUstream(handle))
    if res[0] != driver.CUresult.CUDA_SUCCESS or \
            res[1] != driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE:
        return None
    return int(res[2])


def _top_up_spares(device, n):
    """Keep SPARE_COUNTERS zeroed buffers of at least n entries ready for captures."""
    spares = _SPARE_COUNTERS.setdefault(device, [])
    spares[:] = [b for b in spares if b.shape[0] >= n]
    while len(spares) < SPARE_COUNTERS:
        spares.append(cuda.to_device(np.zeros(max(n, 1024), dtype=np.int32)))


def _counters(kind, device, n, stream):
    """int32 zeros (>= n) for the folded merge's arrival counters, one buffer per (device,
    stream): every launch leaves them at zero again, and launches on one stream are ordered.
    Launches on different streams get different buffers; a call inside a CUDA graph capture
    gets its capture's own buffer (from the reserve: see ``_SPARE_COUNTERS``)."""
    if kind == "numpy" or SIMULATOR:
        return np.zeros(max(n, 1), dtype=np.int32)
    handle = stream
    capture = _capture_id(handle)
    if capture is not None:
        key = (device, "capture", capture)
        buf = _COUNTERS.get(key)
        if buf is None or buf.shape[0] < n:
            spares = [b for b in _SPARE_COUNTERS.get(device, []) if b.shape[0] >= n]
            if not spares:
                raise GraphCaptureError(
                    f"numba_flash.decode inside a CUDA graph capture needs {n} merge counters "
                    f"and none were set aside: make one decode call of this size (or larger) "
                    f"outside the capture first, e.g. the usual warm-up before capturing")
            buf = spares[0]
            _SPARE_COUNTERS[device].remove(buf)
            _COUNTERS.setdefault(("old",), []).append(_COUNTERS.get(key))
            _COUNTERS[key] = buf
        return buf
    key = (device, handle)
    if handle is None:       # a stream we cannot identify: fresh zeros, never shared
        return cuda.to_device(np.zeros(max(n, 1), dtype=np.int32))
    buf = _COUNTERS.get(key)
    if buf is None or buf.shape[0] < n:
        size = max(n, 1024, 2 * (buf.shape[0] if buf is not None else 0))
        buf = cuda.to_device(np.zeros(size, dtype=np.int32))     # synchronous: zeros first
        _COUNTERS.setdefault(("old",), []).append(_COUNTERS.get(key))   # never freed mid-flight
        _COUNTERS[key] = buf
    spares = _SPARE_COUNTERS.get(device)
    if spares is None or len(spares) < SPARE_COUNTERS or min(b.shape[0] for b in spares) < n:
        _top_up_spares(device, n)
    return buf



def tree_row_bits(parents: np.ndarray, seqlen_q: int) -> np.ndarray:
    """uint32 (seqlen_q, 2): bit t of row s set iff tree node t is query s's node or an ancestor.

    Query s is node ``s - seqlen_q + len(parents)`` (the queries are the last nodes); a query
    outside the tree sees no node. At most 64 nodes.
    """
    n = len(parents)
    anc = np.zeros((n, n), dtype=bool)
    for node in range(n):
        if node:
            anc[node] = anc[parents[node]]
        anc[node, node] = True
    bits = np.zeros((seqlen_q, 2), dtype=np.uint32)
    for s in range(seqlen_q):
        tq = s - seqlen_q + n
        if 0 <= tq < n:
            word = sum(1 << t for t in range(n) if anc[tq, t])
            bits[s, 0] = word & 0xFFFFFFFF
            bits[s, 1] = word >> 32
    return bits


def _tree_array(device, parents, seqlen_q):
    bits = tree_row_bits(parents, seqlen_q)
    if SIMULATOR:
        return bits
    key = (device, bits.tobytes(), seqlen_q)
    if key not in _TREES:
        _TREES[key] = cuda.to_device(bits)
    return _TREES[key]


def mma_decode_kernel(*config):
    """The cached tensor-core decode kernel for one ``make_mma_decode_kernel`` configuration."""
    if config not in _MMA_KERNELS:
        _MMA_KERNELS[config] = make_mma_decode_kernel(*config)
    return _MMA_KERNELS[config]


class _Decode:
    """One decode call's geometry and choices (kernel, tile, splits, merge)."""

    def __init__(self, q, k_cache, v_cache, block_table, cache_seqlens, options, device, kernel,
                 tile, stream_hint):
        self.batch, self.seqlen_q, self.heads_q, self.head_dim = q.shape
        self.heads_kv = k_cache.shape[2]
        self.paged = block_table is not None
        self.ratio = self.heads_q // self.heads_kv
        m_rows = self.ratio * self.seqlen_q
        self.pow2_pages = not self.paged or k_cache.shape[1] & (k_cache.shape[1] - 1) == 0
        self.use_mma = mma_decode_supported(self.head_dim) and kernel != "fma"
        if self.use_mma:
            self.tile = tile or mma_tile(self.head_dim, self.paged, self.pow2_pages)
            self.chunks, self.rows = -(-m_rows // MMA_ROWS), MMA_ROWS
        else:
            self.tile = None
            self.chunks = -(-m_rows // MAX_ROWS)
            self.rows = -(-m_rows // self.chunks)
        self.page_size = k_cache.shape[1] if self.paged else 1
        self.capacity = block_table.shape[1] * self.page_size if self.paged else k_cache.shape[1]
        pow2 = self.page_size & (self.page_size - 1) == 0
        self.page_shift = self.page_size.bit_length() - 1 if pow2 else -1
        self.page_pow2 = self.page_size if self.paged and pow2 else 0
        self.full_lens = cache_seqlens is None
        o = options
        (self.left, self.right, self.has_left, self.has_right, self.has_sinks,
         self.has_softcap) = window_flags(o["causal"], o["window_size"], o["sinks"], o["softcap"])
        self.sinks = int(o["sinks"])
        self.tree = o["tree_parents"]
        self.tree_len = len(self.tree) if self.tree is not None else 0
        self.return_lse = bool(o["return_lse"])
        self.splits = self._splits(o["num_splits"], device)
        self.direct = self.splits == 1
        self.stream_hint = (self.chunks == 1) if stream_hint is None else bool(stream_hint)
        scale, cap = float(o["softmax_scale"]), float(o["softcap"]) if self.has_softcap else 1.0
        log2e = 1.0 / math.log(2.0)
        self.floats = (scale * log2e, scale / cap, cap * log2e)

    def _splits(self, num_splits, device) -> int:
        if num_splits != "auto":
            return int(num_splits)
        keys = self.capacity
        if self.has_left:
            keys = min(keys, self.left + self.seqlen_q + max(self.right, 0) + self.sinks)
        units = self.batch * self.heads_kv * self.chunks
        if not self.use_mma:
            return auto_num_splits(units, keys, sm_count(device))
        if self.paged:
            wps = MMA_WARPS_PER_SM_PAGED if self.pow2_pages else MMA_WARPS_PER_SM_PAGED_ANY
            return auto_num_splits_mma(units, keys, sm_count(device), wps, 0)
        return auto_num_splits_mma(units, keys, sm_count(device))

    @property
    def ints2(self):
        return (self.left, self.right, self.sinks, self.tree_len, self.page_size,
                self.page_shift)


def decode_cuda(q, k_cache, v_cache, *, cache_seqlens, block_table, softmax_scale: float,
                causal=True, window_size=(-1, -1), sinks=0, tree_parents=None, softcap=None,
                num_splits="auto", return_lse=False, stream=None, kernel="auto", tile=None,
                stream_hint=None, fast=None):
    """Split-KV decode on the GPU (arguments already validated by ``numba_flash.decode``).

    q (B, Sq, Hq, D) float16/bfloat16; k_cache, v_cache (B, S_max, Hkv, D) or paged
    (num_pages, page_size, Hkv, D) with block_table int32 (B, max_pages); cache_seqlens int32
    (B,) or None (every sequence fills the cache); all of one array kind. tree_parents: int
    array of a draft tree (<= 64 nodes, the last keys of each sequence) or None. Returns out
    (B, Sq, Hq, D) in q's dtype, and lse float32 (B, Hq, Sq) with ``return_lse``. Launches on
    ``stream`` or the current stream. For tests and tuning: ``kernel="fma"`` takes the CUDA-core
    kernel at any head_dim, ``tile`` (block_n, stages, warps) overrides the tensor-core tile,
    ``stream_hint`` forces the evict-first L2 hint on or off. ``fast``: (signature, guards) from
    ``decode_fast``'s miss, under which the plan is recorded for repeated calls.
    """
    kind, dtype_name, device, interfaces = gpu_inputs(q, k_cache, v_cache)
    if dtype_name not in ("float16", "bfloat16"):
        raise TypeError(f"decode on the GPU takes float16 or bfloat16 q / k_cache / v_cache, got "
                        f"{dtype_name}; use NumPy arrays (CPU mode) for float32 / float64")
    check_rows_aligned("the decode kernels' vector loads", k_cache=k_cache, v_cache=v_cache)
    options = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                   sinks=sinks, tree_parents=tree_parents, softcap=softcap,
                   num_splits=num_splits, return_lse=return_lse)
    d = _Decode(q, k_cache, v_cache, block_table, cache_seqlens, options, device, kernel, tile,
                stream_hint)
    if d.full_lens and not d.use_mma:       # the CUDA-core kernel always reads lengths
        cache_seqlens = _full_lengths(kind, q, d.batch, d.capacity)
        d.full_lens = False
    out = empty_like_kind(kind, q, (d.batch, d.seqlen_q, d.heads_q, d.head_dim), dtype_name)
    lse = empty_like_kind(kind, q, (d.batch, d.heads_q, d.seqlen_q), "float32") \
        if d.return_lse else None
    LAST_PLAN.update(splits=d.splits, tile=d.tile, merge="direct" if d.direct else
                     "fold" if d.use_mma else "kernel")
    if d.batch * d.seqlen_q * d.heads_q:
        is_bf16 = dtype_name == "bfloat16"
        if SIMULATOR:
            _decode_simulated(kind, d, is_bf16, q, k_cache, v_cache, block_table, cache_seqlens,
                              out, lse, device)
        else:
            handle = raw_stream_handle(stream, kind, q)
            plan = _decode_gpu(kind, d, is_bf16, q, k_cache, v_cache, block_table,
                               cache_seqlens, out, lse, device, handle)
            if plan is not None and fast is not None and fast[0][-1] == handle:
                _register_fast(fast, plan, kind, q, d, block_table, cache_seqlens)
    if kind == "cai" and dtype_name == "bfloat16":
        out = BFloat16Array(out)
    return (out, lse) if d.return_lse else out


_FAST_CALLS = fast_table("decode")
_CAPTURE_READERS: dict = {}     # array type -> capture test of its library's current stream


def decode_fast(q, k_cache, v_cache, cache_seqlens, block_table, options, guards, stream):
    """A repeated decode call: the plan recorded under this call's signature (the arrays'
    geometry, every keyword, the stream) launched on its arrays. ``options``: the keyword
    values; ``guards``: the mask object. Returns (result, None) on a hit, else (None,
    (signature, guards)) for ``decode_cuda``; calls on a capturing stream always miss."""
    geometry = geometry_reader(type(q))
    if geometry is None:
        return None, None
    try:
        handle = current_stream_of(q) if stream is None else raw_stream_handle(stream, None, None)
    except TypeError:
        return None, None
    capturing = stream_is_capturing if stream is not None else _CAPTURE_READERS.get(type(q))
    if capturing is None:
        capturing = _CAPTURE_READERS[type(q)] = capture_reader(type(q))
    key = ("decode", type(q), geometry(q), geometry(k_cache), geometry(v_cache),
           None if cache_seqlens is None else geometry_of(cache_seqlens),
           None if block_table is None else geometry_of(block_table), options, handle)
    try:
        call = _FAST_CALLS.get(key)
    except TypeError:           # an unhashable keyword value (a list window_size, ...)
        return None, None
    if call is not None and not capturing(handle):
        extras = tuple(x for x in (block_table, cache_seqlens) if x is not None)
        result = call.run((q, k_cache, v_cache), extras, guards, handle)
        if result is not None:
            return result, None
    return None, (key, guards)


def _register_fast(fast, plan, kind, q, d, block_table, cache_seqlens):
    """Record a tensor-core decode plan under the call's signature (torch / CuPy arrays)."""
    if kind not in ("torch", "cupy"):
        return
    (key, guards) = fast
    # FastCall's pointers: q, k, v, out, [lse], [block_table], [cache_seqlens]; the plan's
    # caller slots: q, k, v, [block_table], [cache_seqlens], out, [lse].
    n_extra = int(d.paged) + int(not d.full_lens)
    out_at, lse_at = 3, 4
    extra_at = 4 + int(d.return_lse)
    order = [0, 1, 2] + list(range(extra_at, extra_at + n_extra)) + [out_at] + \
        ([lse_at] if d.return_lse else [])
    extras = tuple(x for x in (block_table if d.paged else None,
                               None if d.full_lens else cache_seqlens) if x is not None)
    register_fast(_FAST_CALLS, key, FastCall(
        plan, kind, q, current_device_id(), (d.batch, d.seqlen_q, d.heads_q, d.head_dim),
        None, (d.batch, d.heads_q, d.seqlen_q) if d.return_lse else None, extras,
        guards=guards, order=order, align=15))


def _full_lengths(kind, like, batch, capacity):
    """int32 (batch,) device array of ``capacity``: every sequence fills the cache."""
    return empty_like_kind(kind, like, (batch,), "int32", fill=capacity)


_PLANS: dict = {}
_CALL_PLANS: dict = {}      # a call's choices, caller-array geometry, device, stream -> plan
_PLANS_MAX = 256


def _choices(d, is_bf16):
    """Everything of a decode call that shapes its plan besides the arrays' geometry."""
    tree = None if d.tree is None else np.asarray(d.tree).tobytes()
    return (is_bf16, d.use_mma, d.tile, d.chunks, d.rows, d.splits, d.paged, d.page_size,
            d.full_lens, d.left, d.right, d.has_left, d.has_right, d.has_sinks, d.sinks,
            d.has_softcap, d.floats, tree, d.return_lse, d.stream_hint, d.ratio)


def _caller(x, kind, words=False):
    """(ArrayParam, data pointer) of a caller array."""
    return caller_param(x, kind, words), interface(x, kind)[0]


def _decode_arrays(kind, d, q, k, v, block_table, cache_seqlens, out, lse, o_part, lse_part,
                   device, workspace=False):
    """(params, caller pointers, fixed arrays) of the ten leading kernel arrays; ``workspace``:
    o_part / lse_part are the stream's Numba arrays (fixed pointers), else the call's."""
    entries = [_caller(x, kind, True) for x in (q, k, v)]
    entries.append(_caller(block_table, kind) if d.paged else
                   (fixed_param(placeholder(device, (1, 1), np.int32)), None))
    entries.append((fixed_param(placeholder(device, (1,), np.int32)), None) if d.full_lens
                   else _caller(cache_seqlens, kind))
    tree = _tree_array(device, np.asarray(d.tree), d.seqlen_q) if d.tree is not None else \
        placeholder(device, (1, 2), np.uint32)
    entries.append((fixed_param(tree), None))
    entries.append(_caller(out, kind, True))
    entries.append(_caller(lse, kind) if lse is not None else
                   (fixed_param(placeholder(device, (1, 1, 1), np.float32)), None))
    if o_part is None:
        entries.append((fixed_param(placeholder(device, (1, 1, 1, 1, 1), np.float32)), None))
        entries.append((fixed_param(placeholder(device, (1, 1, 1, 1), np.float32)), None))
    elif workspace:
        entries += [(fixed_param(o_part), None), (fixed_param(lse_part), None)]
    else:
        entries += [_caller(o_part, kind), _caller(lse_part, kind)]
    params = [p for p, _ in entries]
    ptrs = [ptr for _, ptr in entries if ptr is not None]
    return params, ptrs, (tree, o_part, lse_part) if workspace else (tree,)


def _decode_gpu(kind, d, is_bf16, q, k, v, block_table, cache_seqlens, out, lse, device, stream):
    """Launch one GPU decode call; returns the tensor-core kernel's plan when a later call of the
    same signature may reuse it as it is (not inside a graph capture), else None."""
    dev = current_device_id()
    if device is not None and device != dev:
        with cuda.gpus[device]:
            return _decode_gpu(kind, d, is_bf16, q, k, v, block_table, cache_seqlens, out, lse,
                               device, stream)
    capturing = stream_is_capturing(stream)
    o_part = lse_part = None
    workspace = d.use_mma and not d.direct and not capturing
    if workspace:       # the stream's own buffers: its launches are ordered
        o_part, lse_part = _workspace(dev, stream, d)
    elif not d.direct:  # a capture (or the CUDA-core path): buffers of this call
        shape = (d.splits, d.batch, d.seqlen_q, d.heads_q, d.head_dim)
        o_part = empty_like_kind(kind, q, shape, "float32")
        lse_part = empty_like_kind(kind, q, (d.splits, d.batch, d.heads_q, d.seqlen_q), "float32")
    callers = [x for x in (q, k, v, block_table if d.paged else None,
                           None if d.full_lens else cache_seqlens, out, lse) if x is not None]
    if not d.direct and not workspace:
        callers += [o_part, lse_part]
    infos = [interface(x, kind) for x in callers]
    key = (_choices(d, is_bf16), tuple((tuple(i[1]), tuple(i[2]), i[3]) for i in infos), dev,
           stream if d.use_mma and not d.direct else None, capturing)
    plan = _CALL_PLANS.get(key)
    if plan is None:
        params, _, keep = _decode_arrays(kind, d, q, k, v, block_table, cache_seqlens, out, lse,
                                         o_part, lse_part, dev, workspace)
        if d.use_mma:
            plan = _mma_plan(d, is_bf16, params, keep, dev, stream)
        else:
            plan = _fma_plan(d, is_bf16, params, keep, dev)
        if not capturing:       # a capture's counters belong to that capture only
            if len(_CALL_PLANS) >= _PLANS_MAX:
                _CALL_PLANS.clear()
            _CALL_PLANS[key] = plan
    plan.launch([i[0] for i in infos], stream)
    if not d.direct and not d.use_mma:
        merge = merge_plan(o_part, lse_part, out, lse, kind, OUT_BF16 if is_bf16 else OUT_F16,
                           dev)
        merge.launch([interface(x, kind)[0] for x in (o_part, lse_part, out)] +
                     ([interface(lse, kind)[0]] if lse is not None else []), stream)
        return None
    return None if capturing else plan


_WORKSPACES: dict = {}


def _workspace(device, stream, d):
    """The partial states (o float32 (splits, B, Sq, Hq, D), lse float32 (splits, B, Hq, Sq)) of
    one stream's folded decode calls of this shape, allocated once (Numba device arrays)."""
    key = (device, stream, d.splits, d.batch, d.seqlen_q, d.heads_q, d.head_dim)
    entry = _WORKSPACES.get(key)
    if entry is None:
        if len(_WORKSPACES) >= _PLANS_MAX:
            _WORKSPACES.clear()     # plans keep the arrays they point to alive
        entry = _WORKSPACES[key] = (
            cuda.device_array(key[2:], np.float32),
            cuda.device_array((d.splits, d.batch, d.heads_q, d.seqlen_q), np.float32))
    return entry


def _plan_key(params, extra):
    geo = tuple((p.numba_type, p.shape, p.strides, p.ptr) if isinstance(p, ArrayParam) else
                (p.numba_type, p.value) for p in params)
    return geo + tuple(extra)


def _cached_plan(key, build):
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= _PLANS_MAX:
            _PLANS.clear()
        plan = _PLANS[key] = build()
    return plan


def _mma_plan(d, is_bf16, params, keep, dev, stream):
    """The tensor-core kernel's plan: folded merge with per-stream counters; plain launches
    (docs/decode.md "Plain launches": programmatic dependent launch lost in loops of
    calls)."""
    fold = not d.direct
    counters = _counters("cuda", dev, d.batch * d.heads_kv * d.chunks, stream) if fold else \
        placeholder(dev, (1,), np.int32)
    block_n, stages, warps = d.tile
    config = (d.head_dim, is_bf16, d.paged, d.has_left, d.has_right, d.has_sinks,
              d.has_softcap, d.tree is not None, d.direct, d.return_lse, block_n, stages, warps,
              fold, d.page_pow2, d.full_lens, d.stream_hint)
    params = params + [fixed_param(counters)]
    params += [ScalarParam(types.int64, n) for n in (d.ratio, d.chunks, d.splits)]
    params += [ScalarParam(types.float32, x) for x in d.floats]
    params += [ScalarParam(types.int64, n) for n in d.ints2]
    grid = (-(-d.splits // warps), d.batch, d.heads_kv * d.chunks)

    def build():
        cufunc = compile_kernel(mma_decode_kernel(*config), params)
        return LaunchPlan(cufunc, params, grid, 32 * warps, keep=keep + (counters,))

    return _cached_plan(_plan_key(params, ("mma", config, dev)), build)


def _fma_plan(d, is_bf16, params, keep, dev):
    """The CUDA-core kernel's plan (its splits merge in a second launch)."""
    config = (d.head_dim, is_bf16, d.rows, d.paged, d.has_left, d.has_right, d.has_sinks,
              d.has_softcap, d.tree is not None, d.direct, d.return_lse)
    params = params + [ScalarParam(types.int64, n) for n in (d.ratio, d.chunks)]
    params += [ScalarParam(types.float32, x) for x in d.floats]
    params += [ScalarParam(types.int64, n) for n in d.ints2]
    grid = (d.splits, d.batch, d.heads_kv * d.chunks)

    def build():
        cufunc = compile_kernel(decode_kernel(*config), params)
        return LaunchPlan(cufunc, params, grid, DECODE_WARPS * 32, keep=keep)

    return _cached_plan(_plan_key(params, ("fma", config, dev)), build)


def _decode_simulated(kind, d, is_bf16, q, k, v, block_table, cache_seqlens, out, lse, device):
    """Numba's dispatcher on NumPy arrays (the simulator's path)."""
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    f32 = np.float32
    wrap = lambda x, words=False: kernel_array(x, kind, words)  # noqa: E731
    bt = wrap(block_table) if d.paged else FakeCUDAArray(np.zeros((1, 1), np.int32))
    sl = FakeCUDAArray(np.zeros(1, np.int32)) if d.full_lens else wrap(cache_seqlens)
    tree = FakeCUDAArray(_tree_array(device, np.asarray(d.tree), d.seqlen_q) if d.tree is not None
                         else np.zeros((1, 2), np.uint32))
    lse_arg = wrap(lse) if lse is not None else FakeCUDAArray(np.zeros((1, 1, 1), np.float32))
    if d.direct:
        o_part = FakeCUDAArray(np.zeros((1, 1, 1, 1, 1), np.float32))
        lse_part = FakeCUDAArray(np.zeros((1, 1, 1, 1), np.float32))
    else:
        o_part = FakeCUDAArray(np.empty((d.splits, d.batch, d.seqlen_q, d.heads_q, d.head_dim),
                                        np.float32))
        lse_part = FakeCUDAArray(np.empty((d.splits, d.batch, d.heads_q, d.seqlen_q), np.float32))
    arrays = (wrap(q, True), wrap(k, True), wrap(v, True), bt, sl, tree, wrap(out, True), lse_arg,
              o_part, lse_part)
    floats = tuple(f32(x) for x in d.floats)
    if d.use_mma:
        block_n, stages, warps = d.tile
        fold = not d.direct
        counters = np.zeros(max(d.batch * d.heads_kv * d.chunks, 1), np.int32)
        kern = mma_decode_kernel(d.head_dim, is_bf16, d.paged, d.has_left, d.has_right,
                                 d.has_sinks, d.has_softcap, d.tree is not None, d.direct,
                                 d.return_lse, block_n, stages, warps, fold, d.page_pow2,
                                 d.full_lens, d.stream_hint)
        kern[(-(-d.splits // warps), d.batch, d.heads_kv * d.chunks), 32 * warps, 0](
            *arrays, counters, d.ratio, d.chunks, d.splits, *floats, *d.ints2)
        return
    kern = decode_kernel(d.head_dim, is_bf16, d.rows, d.paged, d.has_left, d.has_right,
                         d.has_sinks, d.has_softcap, d.tree is not None, d.direct, d.return_lse)
    kern[(d.splits, d.batch, d.heads_kv * d.chunks), DECODE_WARPS * 32, 0](
        *arrays, d.ratio, d.chunks, *floats, *d.ints2)
    if not d.direct:
        merge_simulated(o_part, lse_part, arrays[6], lse_arg, OUT_BF16 if is_bf16 else OUT_F16,
                        d.return_lse)
