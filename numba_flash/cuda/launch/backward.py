"""The backward's runtime: ``backward_cuda`` (numba_flash.attention_backward's GPU door) and
``backward_kernels`` (the kernels of kernels/backward.py on the caller's arrays: outputs, fp32 /
fp64 workspaces, kernel cache). The 16-bit dK / dV kernel (the main cost, 112 KB of dynamic
shared memory at head_dim 128) launches through a driver-API plan (launch/driver.py); the small
kernels and the CUDA-core paths through Numba's dispatcher on device-array wrappers of the
caller's memory (no copies).

Order of the launches on one stream:

1. preprocess: delta = rowsum(dO * O) and the base-2 lse, (B, Hq, SqP) in the accumulator
   dtype, rows padded to a multiple of ``ROW_PAD``;
2. dK / dV kernel (column-parallel); unless ``deterministic`` it also adds dQ by atomics into a
   zeroed accumulator (B, Sq, Hq, D);
3. ``deterministic``: the row-parallel dQ kernel writes the dQ accumulator (no atomics);
4. reduce kernels: dQ accumulator -> q's dtype; per-query-head dK / dV partials summed over each
   GQA group (fixed order) -> k's dtype. Float32 / float64 inputs with Hq == Hkv skip the dK /
   dV reduction (the kernel writes the outputs directly).
"""
from __future__ import annotations

import numpy as np
from numba import cuda
from numba.cuda import types

from ..kernels import backward as bw
from ..primitives import SIMULATOR
from .arrays import (array_kind, dtype_name as array_dtype, empty_like_kind, fixed_param, interface,
                     kernel_array)
from .attention import window_flags
from .driver import (LaunchPlan, ScalarParam, compile_kernel, current_device,
                     raise_dynamic_smem_limit)
from .maskplan import dummy_arrays, plan_mask
from .streams import numba_stream, raw_stream_handle

__all__ = ["backward_cuda", "backward_kernels", "backward_geometry"]

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
    (tests)."""
    if dtype_name in _HALF:
        warps, bn, bm = tiles or bw.mma_layout(head_dim)
        dq_warps, dq_bm, dq_bn = tiles or bw.mma_dq_layout(head_dim)
        return dict(path="mma", threads=32 * warps, block_n=bn, block_m=bm, warps=warps,
                    smem=bw.mma_dkdv_smem_bytes(head_dim, warps, bm), dq_warps=dq_warps,
                    dq_block_m=dq_bm, dq_block_n=dq_bn)
    itemsize = 8 if _FULL[dtype_name] else 4
    lanes, own, streamed = tiles or bw.fma_layout(head_dim, itemsize)
    return dict(path="fma", threads=lanes * own, block_n=own, block_m=streamed, lanes=lanes,
                dq_warps=0, dq_block_m=own, dq_block_n=streamed)


def _zeros(kind, shape, dtype, stream):
    if kind == "numpy":
        return np.zeros(shape, dtype)
    arr = cuda.device_array(shape, dtype=dtype, stream=stream)
    if arr.size:
        cuda.driver.device_memset(arr, 0, arr.nbytes, stream=stream)
    return arr


def _empty(kind, shape, dtype, stream):
    if kind == "numpy":
        return np.empty(shape, dtype)
    return cuda.device_array(shape, dtype=dtype, stream=stream)


def _mask_args(plan):
    """The kernels' mask arguments (intervals, min/max, class table, bitmask words) of a
    maskplan.MaskPlan."""
    return plan.iv, plan.mm, plan.table, plan.bits


def _alibi_arg(alibi_slopes):
    """ALiBi slopes as the kernels read them, float32 (1 or B, Hq) (a (Hq,) vector gets a
    leading axis), or the placeholder."""
    if alibi_slopes is None:
        return dummy_arrays().alibi
    kind = array_kind(alibi_slopes)
    return kernel_array(alibi_slopes, kind, False, lead=len(alibi_slopes.shape) == 1)


def backward_kernels(dout, q, k, v, out, lse, *, softmax_scale, causal=False, window_size=(-1, -1),
                  sinks=0, softcap=None, deterministic=False, mask=None, alibi_slopes=None,
                  stream=None, dq=None, dk=None, dv=None, tiles=None):
    """Gradients (dq, dk, dv) of FlashAttention from the forward's out and lse.

    q, out, dout: (B, Sq, Hq, D); k, v: (B, Sk, Hkv, D); one dtype among float16, bfloat16
    (tensor cores, fp32 accumulation), float32, float64 (exact CUDA-core paths); head_dim
    contiguous, a multiple of 16. lse: (B, Hq, Sq), natural log, -inf for rows that see no key
    (the forward's): float32, or float64 for float64 inputs (a float32 lse limits float64
    gradients to ~1e-7 relative; the forward's FMA kernel writes a float64 lse array as is).
    Flags as in ``attention_cuda``; ``mask``: a mask object (any kind but a packed batch's, as
    in the forward: column intervals, bitmask, mask_mod) or None; ``alibi_slopes``: float32
    (Hq,) or (B, Hq) on the device, or None. ``deterministic``: dQ by a row-parallel kernel
    instead of atomics, so results are bitwise reproducible. dq, dk, dv: optional preallocated
    outputs (same shapes / dtypes as q, k, v). ``tiles``: a geometry override (tests; see
    ``backward_geometry``). Launches on ``stream`` (or the caller's current one) and returns
    without synchronising.
    """
    kind = array_kind(q)
    names = {array_dtype(x) for x in (q, k, v, out, dout)}
    if len(names) != 1:
        raise TypeError(f"q, k, v, out, dout must share one dtype, got {sorted(names)}")
    dtype_name = names.pop()
    half = dtype_name in _HALF
    if not half and dtype_name not in _FULL:
        raise TypeError(f"dtype must be float16, bfloat16, float32 or float64, got {dtype_name}")
    batch, seqlen_q, heads_q, head_dim = q.shape
    _, seqlen_k, heads_kv, _ = k.shape
    if head_dim % 16 or heads_q % heads_kv:
        raise ValueError(f"head_dim must be a multiple of 16 and heads_q a multiple of heads_kv, "
                         f"got head_dim {head_dim}, heads {heads_q} / {heads_kv}")
    left, right, has_left, has_right, has_sinks, has_softcap = window_flags(
        causal, window_size, sinks, softcap)
    flags = (has_left, has_right, has_sinks, has_softcap)
    ratio = heads_q // heads_kv
    launch_stream = numba_stream(stream, kind, q)
    is_f64 = not half and _FULL[dtype_name]
    acc_dt = np.float64 if is_f64 else np.float32
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

    geo = backward_geometry(dtype_name, head_dim, tiles)
    bn, bm, threads = geo["block_n"], geo["block_m"], geo["threads"]
    # Mask inputs for each kernel's tiles (kept on the mask object: repeated calls upload
    # nothing); the kind and mask_mod are the same for both.
    plan_kv, plan_q = (plan_mask(mask, batch, heads_q, seqlen_q, seqlen_k, rows, keys, False,
                                 launch_stream)
                       for rows, keys in ((bm, bn), (geo["dq_block_m"], geo["dq_block_n"])))
    mask_kind, mask_mod = plan_kv.kind, plan_kv.mask_mod
    has_alibi = alibi_slopes is not None
    alibi = _alibi_arg(alibi_slopes)
    mask_kv, mask_q = _mask_args(plan_kv) + (alibi,), _mask_args(plan_q) + (alibi,)
    options = dict(mask_mod=mask_mod, has_alibi=has_alibi)
    opt_key = (mask_mod, has_alibi)
    # Each array by its own kind: a bfloat16 caller may hold torch tensors and a CuPy lse.
    wrap = lambda x: kernel_array(x, array_kind(x), half)           # noqa: E731
    if half:
        _check_rows_aligned(q=q, k=k, v=v, dout=dout)
    kq, kk, kv, ko, kdo = (wrap(x) for x in (q, k, v, out, dout))
    klse = kernel_array(lse, array_kind(lse), False)
    scale = float(softmax_scale)
    cap = float(softcap) if has_softcap else 1.0

    rows_padded = -(-seqlen_q // bw.ROW_PAD) * bw.ROW_PAD
    delta, lse2 = (_empty(kind, (batch, heads_q, rows_padded), acc_dt, launch_stream)
                   for _ in range(2))
    pre = _cached(("pre", half, _HALF.get(dtype_name, False), is_f64),
                  lambda: bw.make_preprocess_kernel(half, _HALF.get(dtype_name, False), is_f64))
    pre[((rows_padded + bw.PRE_THREADS - 1) // bw.PRE_THREADS, batch * heads_q), bw.PRE_THREADS,
        launch_stream](ko, kdo, klse, delta, lse2)

    dq_acc = (_empty if deterministic else _zeros)(kind, q.shape, acc_dt, launch_stream)
    direct = not half and ratio == 1
    if direct:
        dk_acc, dv_acc = (kernel_array(x, array_kind(x), False) for x in (dk, dv))
    else:
        part_shape = (batch, seqlen_k, heads_q, head_dim)
        dk_acc, dv_acc = (_empty(kind, part_shape, acc_dt, launch_stream) for _ in range(2))
    common = (seqlen_q, seqlen_k, ratio)
    windows = (left, right, int(sinks))
    n_k = (seqlen_k + bn - 1) // bn
    n_q = (seqlen_q + geo["dq_block_m"] - 1) // geo["dq_block_m"]
    if half:
        fdt = np.float32
        scalars = (fdt(scale), fdt(scale * bw.LOG2E), fdt(scale / cap), fdt(cap * bw.LOG2E))
        key = (head_dim, _HALF[dtype_name]) + flags + (mask_kind, geo["warps"], bn)
        dkdv = _cached(("mma_dkdv", not deterministic) + key + (bm,) + opt_key,
                       lambda: bw.make_mma_dkdv_kernel(*key[:6], not deterministic, *key[6:], bm,
                                                       **options))
        _launch_dynamic(dkdv, (n_k, batch * heads_q), threads, geo["smem"], stream, kind, q,
                        launch_stream, (kq, kk, kv, kdo, lse2, delta, dq_acc, dk_acc, dv_acc,
                                        *common, *scalars, *windows, *mask_kv))
        if deterministic:
            dq_key = key[:-2] + (geo["dq_warps"], geo["dq_block_m"], geo["dq_block_n"])
            dqk = _cached(("mma_dq",) + dq_key + opt_key,
                          lambda: bw.make_mma_dq_kernel(*dq_key, **options))
            dqk[(n_q, batch * heads_q), 32 * geo["dq_warps"], launch_stream](
                kq, kk, kv, kdo, lse2, delta, dq_acc, *common, *scalars, *windows, *mask_q)
    else:
        fdt = acc_dt
        scalars = (fdt(scale), fdt(scale / cap), fdt(cap))
        key = (head_dim, is_f64) + flags
        geo_args = (mask_kind, geo["lanes"], bn, bm)
        dkdv = _cached(("fma_dkdv", not deterministic) + key + geo_args + opt_key,
                       lambda: bw.make_fma_dkdv_kernel(*key, not deterministic, *geo_args,
                                                       **options))
        dkdv[(n_k, batch * heads_q), threads, launch_stream](
            kq, kk, kv, kdo, klse, delta, dq_acc, dk_acc, dv_acc, *common, *scalars, *windows,
            *mask_kv)
        if deterministic:
            dqk = _cached(("fma_dq",) + key + geo_args + opt_key,
                          lambda: bw.make_fma_dq_kernel(*key, *geo_args, **options))
            dqk[(n_q, batch * heads_q), threads, launch_stream](
                kq, kk, kv, kdo, klse, delta, dq_acc, *common, *scalars, *windows, *mask_q)

    reduce = _cached(("reduce", half, _HALF.get(dtype_name, False)),
                     lambda: bw.make_reduce_kernel(half, _HALF.get(dtype_name, False)))

    def _reduce(acc, dst, group):
        target = wrap(dst)
        n = int(np.prod(target.shape))
        reduce[(n + bw.REDUCE_THREADS - 1) // bw.REDUCE_THREADS, bw.REDUCE_THREADS,
               launch_stream](acc, target, group)

    _reduce(dq_acc, dq, 1)
    if not direct:
        _reduce(dk_acc, dk, ratio)
        _reduce(dv_acc, dv, ratio)
    return dq, dk, dv


def _check_rows_aligned(**arrays):
    """The 16-bit kernels copy rows in 16-byte pieces (cp.async): pointers and the strides of
    the first three axes must be multiples of 16 bytes."""
    if SIMULATOR:
        return
    for name, x in arrays.items():
        ptr, _, strides, _, _ = interface(x, array_kind(x))
        if ptr % 16 or any(st % 16 for st in strides[:3]):
            raise ValueError(f"{name} must be 16-byte aligned (pointer and the strides of its "
                             f"first three axes) for the 16-bit backward, got strides "
                             f"{tuple(strides)} bytes; make a contiguous copy")


_SMEM_RAISED: set = set()


def _launch_dynamic(kern, grid, threads, smem, stream, kind, like, launch_stream, args):
    """Launch ``kern`` with ``smem`` bytes of dynamic shared memory: in the simulator through
    the dispatcher, on a GPU through a driver-API plan (the per-kernel limit raised past the
    default 48 KB once per kernel and device)."""
    if SIMULATOR:
        kern[grid, threads, launch_stream, smem](*args)
        return
    params = [fixed_param(a) if hasattr(a, "__cuda_array_interface__") else
              ScalarParam(types.float32 if isinstance(a, np.float32) else types.int64, a)
              for a in args]
    cufunc = compile_kernel(kern, params)
    device = current_device()
    if (id(cufunc), device) not in _SMEM_RAISED:
        raise_dynamic_smem_limit(cufunc.handle, smem, device)
        _SMEM_RAISED.add((id(cufunc), device))
    plan = LaunchPlan(cufunc, params, grid, threads, smem, keep=(args,))
    plan.launch([], raw_stream_handle(stream, kind, like))


def backward_cuda(dout, q, k, v, out, lse, *, problem, deterministic=False, stream=None):
    """numba_flash.attention_backward on GPU arrays: ``problem`` is the validated call
    (validation.Problem). The kernels take the flags (causal, window, sinks, softcap), GQA,
    ALiBi and every mask object (column intervals, bitmask, mask_mod); packed batches
    (cu_seqlens) raise NotImplementedError."""
    if problem.varlen is not None:
        raise NotImplementedError("attention_backward on the GPU does not support cu_seqlens "
                                  "yet; NumPy arrays run it in CPU mode")
    return backward_kernels(dout, q, k, v, out, lse, softmax_scale=problem.softmax_scale,
                            causal=problem.causal, window_size=problem.window_size,
                            sinks=problem.sinks, softcap=problem.softcap,
                            deterministic=deterministic, mask=problem.mask,
                            alibi_slopes=problem.alibi_slopes, stream=stream)
