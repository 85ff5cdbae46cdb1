"""The backward's runtime: ``backward_cuda`` (numba_flash.attention_backward's GPU door) and
``backward_kernels`` (the kernels of kernels/backward.py on the caller's arrays: outputs, fp32 /
fp64 workspaces, kernel cache). Every kernel launches through a driver-API plan
(launch/driver.py: compiled once, or loaded from its image on disk without initialising Numba's
compiler) on device-array wrappers of the caller's memory (no copies); the simulator takes
Numba's dispatcher.

Order of the launches on one stream:

1. preprocess: delta = rowsum(dO * O) and the base-2 lse, (B, Hq, SqP) in the accumulator
   dtype, rows padded to a multiple of ``ROW_PAD``;
2. dK / dV kernel (column-parallel); unless ``deterministic`` it also adds dQ by atomics into a
   zeroed accumulator (B, Sq, Hq, D);
3. ``deterministic``: the row-parallel dQ kernel writes the dQ accumulator (no atomics);
4. reduce kernels: dQ accumulator -> q's dtype; per-query-head dK / dV partials summed over each
   GQA group (fixed order) -> k's dtype. With Hq == Hkv and no packed batch the dK / dV kernel
   writes dk and dv themselves (``_Call.direct``): no partials, no dK / dV reduction.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import cuda
from numba.cuda import types

from ..kernels import backward as bw
from ..kernels import backward_wgmma as bwg
from ..primitives import SIMULATOR
from .arrays import (array_kind, check_rows_aligned, dtype_name as array_dtype, empty_like_kind,
                     fixed_param, flat_kernel_array, interface, kernel_array)
from .attention import wgmma_device, window_flags
from .backward_fast import Recording, record
from .driver import (LaunchPlan, ScalarParam, compile_kernel, current_device, memset32_async,
                     raise_dynamic_smem_limit)
from .maskplan import dummy_arrays, plan_mask
from .streams import numba_stream, raw_stream_handle

__all__ = ["backward_cuda", "backward_kernels", "backward_geometry", "dkdv_grid"]

_HALF = {"float16": False, "bfloat16": True}
_FULL = {"float32": False, "float64": True}
_KERNELS: dict = {}


def _cached(key, build):
    kern = _KERNELS.get(key)
    if kern is None:
        kern = _KERNELS[key] = build()
    return kern


def backward_geometry(dtype_name: str, head_dim: int, tiles=None) -> dict:
    """Launch geometry of the dK / dV and dQ kernels for one dtype and head_dim: threads per
    block, keys owned per dK / dV block (``block_n``), rows per streamed query tile
    (``block_m``); the deterministic dQ kernel's blocks own ``dq_block_m`` rows and stream
    ``dq_block_n``-key tiles. ``tiles``: an override (a, b, c) = (lanes, owned, streamed) for
    the CUDA-core path or (warps, owned, streamed) for tensor cores, the same for both kernels
    (tests). 16-bit head_dim 64 / 128 on a compute-capability 9.0 device: the wgmma dK / dV
    kernel (``path`` "wgmma"; kernels/backward_wgmma.py), unless ``tiles`` is given."""
    if dtype_name in _HALF:
        dq_warps, dq_bm, dq_bn = tiles or bw.mma_dq_layout(head_dim)
        if tiles is None and head_dim in bwg.WG_BWD_HEAD_DIMS and wgmma_device():
            return dict(path="wgmma", threads=bwg.WG_BWD_THREADS, block_n=bwg.wgmma_block_n(head_dim),
                        block_m=bwg.WG_BWD_BLOCK_M, warps=bwg.WG_BWD_THREADS // 32,
                        smem=bwg.wgmma_dkdv_smem_bytes(head_dim), dq_warps=dq_warps,
                        dq_block_m=dq_bm, dq_block_n=dq_bn)
        warps, bn, bm = tiles or bw.mma_layout(head_dim)
        return dict(path="mma", threads=32 * warps, block_n=bn, block_m=bm, warps=warps,
                    smem=bw.mma_dkdv_smem_bytes(head_dim, warps, bm, bn), dq_warps=dq_warps,
                    dq_block_m=dq_bm, dq_block_n=dq_bn)
    itemsize = 8 if _FULL[dtype_name] else 4
    lanes, own, streamed = tiles or bw.fma_layout(head_dim, itemsize)
    return dict(path="fma", threads=lanes * own, block_n=own, block_m=streamed, lanes=lanes,
                dq_warps=0, dq_block_m=own, dq_block_n=streamed)


def _workspace(call, shape, zero=False):
    """A float32 / float64 (``call.acc_dt``) workspace, zeroed when ``zero``. On the caller's
    current stream it comes from the caller's allocator (CuPy's pool, torch's caching
    allocator), cleared by a driver memset on that stream: Numba's allocations cost a
    cuMemAlloc per call and, every few calls, a deferred cuMemFree that waits for the device.
    With an explicit ``stream`` (the caller's allocator would hand the memory back to another
    stream's pool while the kernels still run) and in the simulator (NumPy): Numba / NumPy."""
    if call.kind == "numpy":
        return (np.zeros if zero else np.empty)(shape, call.acc_dt)
    if call.stream is None and call.kind in ("cupy", "torch"):
        name = np.dtype(call.acc_dt).name
        arr = empty_like_kind(call.kind, call.like, shape, name)
        if zero and arr.nbytes:
            memset32_async(interface(arr, call.kind)[0], 0, arr.nbytes // 4, call.handle)
        if call.recording is not None:
            call.recording.workspace(arr, shape, name, zero and arr.nbytes)
        return arr
    if call.recording is not None:
        call.recording.ok = False        # a workspace the replay could not allocate
    arr = cuda.device_array(shape, dtype=call.acc_dt, stream=call.launch_stream)
    if zero and arr.size:
        cuda.driver.device_memset(arr, 0, arr.nbytes, stream=call.launch_stream)
    return arr


def _mask_args(plan):
    """The kernels' mask arguments (intervals, min/max, class table, bitmask words) of a
    maskplan.MaskPlan."""
    return plan.iv, plan.mm, plan.table, plan.bits


def _cu_args(varlen):
    """(cu_q, cu_k) as the kernels read them: a packed batch's cu_seqlens, or placeholders."""
    if varlen is None:
        d = dummy_arrays()
        return d.cu, d.cu
    return tuple(kernel_array(x, array_kind(x), False) for x in (varlen.cu_q, varlen.cu_k))


def _alibi_arg(alibi_slopes):
    """ALiBi slopes as the kernels read them, float32 (1 or B, Hq) (a (Hq,) vector gets a
    leading axis), or the placeholder."""
    if alibi_slopes is None:
        return dummy_arrays().alibi
    kind = array_kind(alibi_slopes)
    return kernel_array(alibi_slopes, kind, False, lead=len(alibi_slopes.shape) == 1)


def backward_kernels(dout, q, k, v, out, lse, *, softmax_scale, causal=False, window_size=(-1, -1),
                  sinks=0, softcap=None, deterministic=False, mask=None, alibi_slopes=None,
                  varlen=None, stream=None, dq=None, dk=None, dv=None, tiles=None,
                  recording=None):
    """Gradients (dq, dk, dv) of FlashAttention from the forward's out and lse.

    q, out, dout: (B, Sq, Hq, D); k, v: (B, Sk, Hkv, D); one dtype among float16, bfloat16
    (tensor cores, fp32 accumulation), float32, float64 (exact CUDA-core paths); head_dim
    contiguous, a multiple of 16. lse: (B, Hq, Sq), natural log, -inf for rows that see no key
    (the forward's): float32, or float64 for float64 inputs (a float32 lse limits float64
    gradients to ~1e-7 relative; the forward's FMA kernel writes a float64 lse array as is).
    Flags as in ``attention_cuda``; ``mask``: a mask object (any kind but a packed batch's, as
    in the forward: column intervals, bitmask, mask_mod) or None; ``alibi_slopes``: float32
    (Hq,) or (B, Hq) on the device, or None; ``varlen``: a packed batch (numba_flash.varlen.Varlen:
    q, out, dout (total_q, Hq, D), k, v (total_k, Hkv, D), lse (Hq, total_q); sequences from
    its cu_seqlens, lengths at most its max_seqlen), or None. ``deterministic``: dQ by a row-parallel kernel
    instead of atomics, so results are bitwise reproducible. dq, dk, dv: optional preallocated
    outputs (same shapes / dtypes as q, k, v). ``tiles``: a geometry override (tests; see
    ``backward_geometry``). ``recording``: a backward_fast.Recording that notes the outputs,
    workspaces and launches for the repeated call. Launches on ``stream`` (or the caller's
    current one) and returns without synchronising.
    """
    kind = array_kind(q)
    dtype_name = _common_dtype(q, k, v, out, dout)
    half = dtype_name in _HALF
    lead = varlen is not None          # packed arrays are seen as batch 1 by the kernels
    batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim = _dims(q, k, varlen)
    for name, arr, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        if arr is not None and tuple(arr.shape) != tuple(like.shape):
            raise ValueError(f"{name} must have shape {tuple(like.shape)}, got {tuple(arr.shape)}")
    dq = empty_like_kind(kind, q, q.shape, dtype_name) if dq is None else dq
    dk = empty_like_kind(kind, k, k.shape, dtype_name) if dk is None else dk
    dv = empty_like_kind(kind, v, v.shape, dtype_name) if dv is None else dv
    if batch * heads_q * seqlen_q * seqlen_k == 0:
        for x in (dq, dk, dv):
            x[...] = 0
        return dq, dk, dv
    if recording is not None:
        recording.add_outputs(dq, dk, dv)

    left, right, *flags = window_flags(causal, window_size, sinks, softcap)
    is_f64 = not half and _FULL[dtype_name]
    geo = backward_geometry(dtype_name, head_dim, tiles)
    launch_stream = numba_stream(stream, kind, q)
    # Mask inputs for each kernel's tiles (kept on the mask object: repeated calls upload
    # nothing); the kind and mask_mod are the same for both.
    plan_kv, plan_q = (plan_mask(mask, batch, heads_q, seqlen_q, seqlen_k, rows, keys, lead,
                                 launch_stream)
                       for rows, keys in ((geo["block_m"], geo["block_n"]),
                                          (geo["dq_block_m"], geo["dq_block_n"])))
    cu = _cu_args(varlen)
    extra = (_alibi_arg(alibi_slopes),) + cu
    call = _Call(kind, dtype_name, half, is_f64, np.float64 if is_f64 else np.float32, lead,
                 batch, heads_q, seqlen_q, seqlen_k, heads_q // heads_kv, head_dim, geo,
                 tuple(flags), plan_kv.kind, (plan_kv.mask_mod, alibi_slopes is not None, lead),
                 launch_stream, 0 if SIMULATOR else raw_stream_handle(stream, kind, q), stream,
                 q, recording)
    # Each array by its own kind: a bfloat16 caller may hold torch tensors and a CuPy lse.
    if half and not SIMULATOR:
        check_rows_aligned("the 16-bit backward", q=q, k=k, v=v, dout=dout)
    kq, kk, kv, ko, kdo = (call.wrap(x) for x in (q, k, v, out, dout))
    delta, lse2 = _preprocess(call, ko, kdo, kernel_array(lse, array_kind(lse), False, lead),
                              cu[0])
    # The float32 / float64 kernels read the caller's lse, or for a packed batch each
    # sequence's copy from the preprocess (natural log there).
    klse = lse2 if half or lead else kernel_array(lse, array_kind(lse), False)
    dq_acc, dk_acc, dv_acc, direct = _accumulators(call, deterministic, dk, dv, k.shape[0])
    scale = float(softmax_scale)
    cap = float(softcap) if call.flags[3] else 1.0
    rest = (seqlen_q, seqlen_k, call.ratio) + _scalars(call, scale, cap) + (left, right,
                                                                            int(sinks))
    dkdv_args = (kq, kk, kv, kdo, klse, delta, dq_acc, dk_acc, dv_acc) + rest + \
        _mask_args(plan_kv) + extra
    dq_args = (kq, kk, kv, kdo, klse, delta, dq_acc) + rest + _mask_args(plan_q) + extra
    _main_kernels(call, deterministic, dkdv_args, dq_args)
    call.reduce(dq_acc, dq, 1)
    if not direct:
        call.reduce(dk_acc, dk, call.ratio)
        call.reduce(dv_acc, dv, call.ratio)
    return dq, dk, dv


class _Call(NamedTuple):
    """What the helpers of one backward_kernels call share."""
    kind: str
    dtype_name: str
    half: bool
    is_f64: bool
    acc_dt: type
    lead: bool               # a packed batch (arrays seen as batch 1)
    batch: int
    heads_q: int
    seqlen_q: int            # the maximum over sequences for a packed batch
    seqlen_k: int
    ratio: int               # heads_q // heads_kv
    head_dim: int
    geo: dict
    flags: tuple             # has_left, has_right, has_sinks, has_softcap
    mask_kind: int
    options: tuple           # mask_mod, has_alibi, varlen (factory keywords, kernel cache key)
    launch_stream: object
    handle: int              # the launch stream's raw handle (0 in the simulator)
    stream: object
    like: object
    recording: object        # backward_fast.Recording, or None

    def wrap(self, x):
        """x as the kernels read it (16-bit data as uint32 words; packed: batch axis 1)."""
        return kernel_array(x, array_kind(x), self.half, self.lead)

    @property
    def direct(self) -> bool:
        """Whether the dK / dV kernel writes dk and dv themselves (one query head per kv head,
        no packed batch): no float32 / float64 partials and no reduce pass for them."""
        return self.ratio == 1 and not self.lead

    def factory_options(self) -> dict:
        mask_mod, has_alibi, varlen = self.options
        return dict(mask_mod=mask_mod, has_alibi=has_alibi, varlen=varlen)

    def reduce(self, acc, dst, group):
        """dst = acc summed over groups of ``group`` heads, in dst's dtype (a group of one
        into a C-contiguous dst: the flat conversion kernel)."""
        bf16 = _HALF.get(self.dtype_name, False)
        flat = flat_kernel_array(dst, array_kind(dst), self.half) if group == 1 else None
        if flat is not None:
            kern = _cached(("convert", self.half, bf16),
                           lambda: bw.make_convert_kernel(self.half, bf16))
            blocks = (flat.shape[0] + bw.REDUCE_THREADS - 1) // bw.REDUCE_THREADS
            _launch(self, kern, blocks, bw.REDUCE_THREADS,
                    (acc.reshape(int(np.prod(acc.shape))), flat))
            return
        target = self.wrap(dst)
        blocks = (int(np.prod(target.shape)) + bw.REDUCE_THREADS - 1) // bw.REDUCE_THREADS
        kern = _cached(("reduce", self.half, bf16), lambda: bw.make_reduce_kernel(self.half, bf16))
        _launch(self, kern, blocks, bw.REDUCE_THREADS, (acc, target, group))


def _common_dtype(*arrays) -> str:
    names = {array_dtype(x) for x in arrays}
    if len(names) != 1:
        raise TypeError(f"q, k, v, out, dout must share one dtype, got {sorted(names)}")
    name = names.pop()
    if name not in _HALF and name not in _FULL:
        raise TypeError(f"dtype must be float16, bfloat16, float32 or float64, got {name}")
    return name


def _dims(q, k, varlen):
    """(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim); a packed batch's lengths are
    its maximum lengths."""
    if varlen is not None:
        _, heads_q, head_dim = q.shape
        dims = (varlen.batch, varlen.max_seqlen_q, varlen.max_seqlen_k, heads_q, k.shape[1],
                head_dim)
    else:
        batch, seqlen_q, heads_q, head_dim = q.shape
        dims = (batch, seqlen_q, k.shape[1], heads_q, k.shape[2], head_dim)
    heads_q, heads_kv, head_dim = dims[3:]
    if head_dim % 16 or heads_q % heads_kv:
        raise ValueError(f"head_dim must be a multiple of 16 and heads_q a multiple of heads_kv, "
                         f"got head_dim {head_dim}, heads {heads_q} / {heads_kv}")
    return dims


def _preprocess(call, ko, kdo, klse, cu_q):
    """delta and the kernels' lse, (B, Hq, SqP) in the accumulator dtype (rows padded to
    ``ROW_PAD``)."""
    rows_padded = -(-call.seqlen_q // bw.ROW_PAD) * bw.ROW_PAD
    delta, lse2 = (_workspace(call, (call.batch, call.heads_q, rows_padded)) for _ in range(2))
    bf16 = _HALF.get(call.dtype_name, False)
    pre = _cached(("pre", call.half, bf16, call.is_f64, call.lead),
                  lambda: bw.make_preprocess_kernel(call.half, bf16, call.is_f64, call.lead))
    _launch(call, pre, ((rows_padded + bw.PRE_ROWS - 1) // bw.PRE_ROWS,
                        call.batch * call.heads_q), bw.PRE_THREADS,
            (ko, kdo, klse, delta, lse2, cu_q, call.seqlen_q))
    return delta, lse2


def _accumulators(call, deterministic, dk, dv, k_rows):
    """(dq_acc, dk_acc, dv_acc, direct): the float32 / float64 accumulators (dq's zeroed for
    atomics; ``direct``: float32 / float64 dK, dV written into dk, dv themselves). A packed
    batch's rows outside every sequence get no kernel writes: zeroed, they reduce to 0."""
    lead = call.lead
    q_shape = tuple(call.like.shape)
    q_rows = (1,) + q_shape if lead else q_shape
    dq_acc = _workspace(call, q_rows, zero=lead or not deterministic)
    direct = call.direct
    if direct:
        dk_acc, dv_acc = (call.wrap(x) for x in (dk, dv))
    else:
        rows = (1, k_rows) if lead else (call.batch, call.seqlen_k)
        dk_acc, dv_acc = (_workspace(call, rows + (call.heads_q, call.head_dim), zero=lead)
                          for _ in range(2))
    return dq_acc, dk_acc, dv_acc, direct


def _scalars(call, scale, cap):
    """The kernels' scalars: 16-bit (scale, scale log2 e, scale / softcap, softcap log2 e) as
    float32; float32 / float64 (scale, scale / softcap, softcap) in the working dtype."""
    if call.half:
        f = np.float32
        return (f(scale), f(scale * bw.LOG2E), f(scale / cap), f(cap * bw.LOG2E))
    f = call.acc_dt
    return (f(scale), f(scale / cap), f(cap))


def dkdv_grid(n_keys: int, rows: int) -> tuple[int, int]:
    """The 16-bit dK / dV kernels' grid: ``n_keys`` key tiles x ``rows`` (batch, query head)
    rows. Their block order (kernels/schedule.py ``tile_order``) numbers the blocks in 32
    bits, so a grid of 2^32 blocks or more is refused rather than computed wrong."""
    if n_keys * rows >= 1 << 32:
        raise ValueError(f"attention_backward: {n_keys} key tiles x {rows} (batch, head) rows "
                         f"is {n_keys * rows} dK / dV blocks; the kernels take fewer than 2^32 "
                         f"(split the batch or the heads into several calls)")
    return n_keys, rows


def _main_kernels(call, deterministic, dkdv_args, dq_args):
    """The dK / dV kernel (with atomic dQ unless ``deterministic``), then in deterministic mode
    the row-parallel dQ kernel."""
    geo, heads = call.geo, call.batch * call.heads_q
    bn, bm = geo["block_n"], geo["block_m"]
    n_k = -(-call.seqlen_k // bn)
    n_q = -(-call.seqlen_q // geo["dq_block_m"])
    options = call.factory_options()
    if call.half:
        key = (call.head_dim, _HALF[call.dtype_name]) + call.flags + (call.mask_kind,
                                                                      geo["warps"], bn)
        dkdv_options = dict(options, direct=call.direct)
        if geo["path"] == "wgmma":
            dkdv = _cached(("wgmma_dkdv", not deterministic, call.direct) + key + call.options,
                           lambda: bwg.make_wgmma_dkdv_kernel(*key[:6], not deterministic,
                                                              call.mask_kind, **dkdv_options))
        else:
            dkdv = _cached(("mma_dkdv", not deterministic, call.direct) + key + (bm,)
                           + call.options,
                           lambda: bw.make_mma_dkdv_kernel(*key[:6], not deterministic,
                                                           *key[6:], bm, **dkdv_options))
        _launch(call, dkdv, dkdv_grid(n_k, heads), geo["threads"], dkdv_args, geo["smem"])
        if deterministic:
            dq_key = key[:-2] + (geo["dq_warps"], geo["dq_block_m"], geo["dq_block_n"])
            dqk = _cached(("mma_dq",) + dq_key + call.options,
                          lambda: bw.make_mma_dq_kernel(*dq_key, **options))
            _launch(call, dqk, (n_q, heads), 32 * geo["dq_warps"], dq_args)
        return
    key = (call.head_dim, call.is_f64) + call.flags
    geo_args = (call.mask_kind, geo["lanes"], bn, bm)
    dkdv = _cached(("fma_dkdv", not deterministic) + key + geo_args + call.options,
                   lambda: bw.make_fma_dkdv_kernel(*key, not deterministic, *geo_args, **options))
    _launch(call, dkdv, (n_k, heads), geo["threads"], dkdv_args)
    if deterministic:
        dqk = _cached(("fma_dq",) + key + geo_args + call.options,
                      lambda: bw.make_fma_dq_kernel(*key, *geo_args, **options))
        _launch(call, dqk, (n_q, heads), geo["threads"], dq_args)


_SMEM_RAISED: set = set()
_SCALAR_TYPES = {np.float32: types.float32, np.float64: types.float64}


def _launch(call, kern, grid, threads, args, smem=0):
    """Launch ``kern`` on the call's stream: in the simulator through Numba's dispatcher, on a
    GPU through a driver-API plan (compile_kernel: this process's compilation, else the
    kernel's image on disk, else Numba), with ``smem`` bytes of dynamic shared memory (the
    per-kernel limit raised past the default 48 KB once per kernel and device)."""
    if SIMULATOR:
        kern[grid, threads, call.launch_stream, smem](*args)
        return
    params, fixed, slots, sources = [], [], [], []
    recording = call.recording
    for a in args:
        if not hasattr(a, "__cuda_array_interface__"):
            params.append(ScalarParam(_SCALAR_TYPES.get(type(a), types.int64), a))
            continue
        param = fixed_param(a)
        source = recording.source_of(a) if recording is not None else None
        if source is None:
            fixed.append(a)
        else:       # a per-call array: its pointer is a slot the repeated call fills
            slots.append(param.ptr)
            sources.append(source)
            param.ptr = None
        params.append(param)
    cufunc = compile_kernel(kern, params)
    if smem > 48 * 1024:
        device = current_device()
        if (id(cufunc), device) not in _SMEM_RAISED:
            raise_dynamic_smem_limit(cufunc.handle, smem, device)
            _SMEM_RAISED.add((id(cufunc), device))
    plan = LaunchPlan(cufunc, params, grid, threads, smem, keep=(fixed,))
    plan.launch(slots, call.handle)
    if recording is not None:
        recording.launch(plan, sources)


def backward_cuda(dout, q, k, v, out, lse, *, problem, deterministic=False, stream=None,
                  fast=None):
    """numba_flash.attention_backward on GPU arrays: ``problem`` is the validated call
    (validation.Problem). The kernels take the flags (causal, window, sinks, softcap), GQA,
    ALiBi, packed batches (cu_seqlens) and every mask object (column intervals, bitmask,
    mask_mod; a packed batch takes a mask_mod only, as the forward). ``fast``: (signature,
    guards, extras) from ``backward_fast``'s miss: the call is recorded under the signature
    when the kernels read the caller's own cu_seqlens / ALiBi arrays (``extras``), not
    converted copies."""
    recording = None
    if fast is not None and not SIMULATOR and stream is None and \
            array_kind(q) in ("cupy", "torch"):
        varlen = problem.varlen
        used = (varlen.cu_q, varlen.cu_k) if varlen is not None else (None, None)
        if all(a is b for a, b in zip(fast[2], used + (problem.alibi_slopes,))):
            recording = Recording((dout, q, k, v, out, lse) + tuple(fast[2]))
    grads = backward_kernels(dout, q, k, v, out, lse, softmax_scale=problem.softmax_scale,
                             causal=problem.causal, window_size=problem.window_size,
                             sinks=problem.sinks, softcap=problem.softcap,
                             deterministic=deterministic, mask=problem.mask,
                             alibi_slopes=problem.alibi_slopes, varlen=problem.varlen,
                             stream=stream, recording=recording)
    if recording is not None:
        record(fast[:2], recording, array_kind(q), q, k, v, current_device(),
               15 if array_dtype(q) in _HALF else 0)
    return grads
