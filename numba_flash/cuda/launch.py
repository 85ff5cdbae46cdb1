"""Launching the forward kernels: GPU-specific checks, zero-copy array interop, streams, caching.

``attention_cuda`` takes CuPy arrays, PyTorch CUDA tensors or any object exposing
``__cuda_array_interface__`` (or NumPy arrays when Numba's CUDA simulator is on), wraps their
memory without copying (float16/bfloat16 as ``uint32`` words of two values), allocates the output
as the same kind of array, and launches on the caller's stream.

Compiled kernels are cached twice: in-process in ``_KERNELS`` (one dispatcher per configuration,
so a second call compiles nothing) and on disk by Numba (``cache=True``), so a new process loads
the machine code instead of compiling it.

Launch path on a GPU: the signature is built from the arrays' layouts (no argument typing), the
kernel is compiled (or loaded) once per (configuration, layouts, device) through
``Dispatcher.compile``, and every call packs the flattened Numba array arguments from raw
pointers and launches through ``cuda.core`` directly: no device-array wrappers, no dispatcher
typing, no allocation for an unused lse. ``NUMBA_FLASH_SLOW_LAUNCH=1`` restores the plain
dispatcher launch (for comparisons).
"""
from __future__ import annotations

import ctypes
import math
import os

import numpy as np
from numba import cuda
from numba.cuda import types
from numba.np.numpy_support import from_dtype as numba_from_dtype

from ..arrays import dtype_name as _cached_dtype_name
from . import forward, maskdev
from .device import current_device_id
from .maskplan import dummy_arrays, plan_mask
from .warp import SIMULATOR

if not SIMULATOR:
    from numba.cuda.cudadrv.devicearray import DeviceNDArray as _DeviceNDArray
else:
    class _DeviceNDArray:  # nothing is an instance: no caching in the simulator
        pass

if not SIMULATOR:  # already imported by numba.cuda's dispatcher on a real GPU
    from cuda.core import LaunchConfig as _CoreLaunchConfig
    from cuda.core import Stream as _CoreStream
    from cuda.core import launch as _core_launch

__all__ = ["attention_cuda", "window_flags", "SUPPORTED_HEAD_DIMS", "kernel_for",
           "compiled_kernel_count"]

SUPPORTED_HEAD_DIMS = (32, 64, 96, 128, 256)
_KERNELS: dict = {}
_LAUNCHERS: dict = {}     # (config key, layouts, device) -> (cuda.core kernel, scalar ctypes)
_CORE_STREAMS: dict = {}  # raw stream handle -> cuda.core Stream (non-owning)
_LAUNCH_CONFIGS: dict = {}
_FAST_LAUNCH = not SIMULATOR and os.environ.get("NUMBA_FLASH_SLOW_LAUNCH", "") != "1"
_HALF_NAMES = {"float16": False, "bfloat16": True}
_FULL_NAMES = {"float32": False, "float64": True}


def _array_kind(x) -> str:
    """'numpy', 'cupy', 'torch' or 'cai' (anything else with __cuda_array_interface__)."""
    mod = type(x).__module__.split(".")[0]
    if isinstance(x, np.ndarray):
        return "numpy"
    if mod == "cupy":
        return "cupy"
    if mod == "torch":
        return "torch"
    if hasattr(x, "__cuda_array_interface__"):
        return "cai"
    raise TypeError(f"q, k, v must be GPU arrays (CuPy, PyTorch CUDA tensors or objects with "
                    f"__cuda_array_interface__), got {type(x).__name__}")


def _dtype_name(x) -> str:
    if type(x).__module__.split(".")[0] == "torch":
        return str(x.dtype).replace("torch.", "")
    name = _cached_dtype_name(x.dtype) if hasattr(x, "dtype") else "void16"
    if name == "void16":  # a bare "<V2" interface: bfloat16, as numba_flash.arrays reads it
        from ..arrays import describe

        name = describe(x, "array").dtype.name
    return name


def _interface(x, kind: str):
    """(pointer, shape, strides in bytes, itemsize, device id) of an array, without copying."""
    if kind == "numpy":
        return x.ctypes.data, x.shape, x.strides, x.itemsize, 0
    if kind == "torch":  # torch has no __cuda_array_interface__ for bfloat16
        size = x.element_size()
        return (x.data_ptr(), tuple(x.shape), tuple(s * size for s in x.stride()), size,
                x.device.index)
    if kind == "cupy":
        return x.data.ptr, x.shape, x.strides, x.itemsize, x.device.id
    cai = x.__cuda_array_interface__
    shape = tuple(cai["shape"])
    itemsize = int(cai["typestr"][2:])
    strides = cai.get("strides")
    if strides is None:  # C-contiguous
        strides, acc = [], itemsize
        for n in reversed(shape):
            strides.insert(0, acc)
            acc *= n
    ptr = cai["data"][0]
    return ptr, shape, tuple(strides), itemsize, _pointer_device(ptr)


def _pointer_device(ptr: int):
    try:
        import cupy

        return cupy.cuda.runtime.pointerGetAttributes(ptr).device
    except Exception:  # no CuPy: trust the caller's current device
        return None


def _check_gpu_inputs(q, k, v, lead: bool = False):
    """GPU-specific checks (``lead``: packed varlen arrays, checked as batch 1); returns (kind,
    dtype name, device id)."""
    return _gpu_inputs(q, k, v, lead)[:3]


def _gpu_inputs(q, k, v, lead: bool = False):
    """``_check_gpu_inputs`` plus the arrays' interfaces ((pointer, shape, strides, itemsize,
    device) of q, k, v as given), which the direct launch reuses instead of reading them again."""
    kinds = [_array_kind(x) for x in (q, k, v)]
    if len(set(kinds)) != 1:
        raise TypeError(f"q, k, v must be the same kind of array, got {kinds}")
    kind = kinds[0]
    if kind == "numpy" and not SIMULATOR:
        raise TypeError("NumPy inputs run on the CUDA backend only under Numba's simulator "
                        "(NUMBA_ENABLE_CUDASIM=1); use backend='cpu' or pass GPU arrays")
    names = [_dtype_name(x) for x in (q, k, v)]
    if len(set(names)) != 1:
        raise TypeError(f"q, k, v must share one dtype, got q {names[0]}, k {names[1]}, v {names[2]}")
    if names[0] not in _HALF_NAMES and names[0] not in _FULL_NAMES:
        raise TypeError(f"q, k, v dtype must be float16, bfloat16, float32 or float64, got {names[0]}")
    devices, interfaces = [], []
    for name, x in (("q", q), ("k", k), ("v", v)):
        interface = _interface(x, kind)
        interfaces.append(interface)
        ptr, shape, strides, itemsize, device = interface
        if lead:
            shape, strides = (1,) + tuple(shape), (0,) + tuple(strides)
        if len(shape) != 4:
            raise ValueError(f"{name} must have 4 dimensions (batch, seqlen, heads, head_dim), "
                             f"got shape {shape}")
        if shape[3] > 1 and strides[3] != itemsize:
            raise ValueError(f"{name} must have a contiguous head_dim (last stride {itemsize} bytes), "
                             f"got strides {strides} bytes; call .contiguous() / ascontiguousarray")
        devices.append(device)
    known = {d for d in devices if d is not None}
    if len(known) > 1:
        raise ValueError(f"q, k, v must be on one device, got devices q {devices[0]}, "
                         f"k {devices[1]}, v {devices[2]}")
    head_dim = q.shape[-1]
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {SUPPORTED_HEAD_DIMS} on the GPU, got {head_dim} "
                         "(pad q, k, v with zeros to the next supported size: zero columns change "
                         "no score, then slice the output)")
    return kind, names[0], (known.pop() if known else None), interfaces


def _kernel_array(x, kind: str, as_words: bool, lead: bool = False):
    """The array the kernel reads: x itself, or a uint32 view of pairs along head_dim; with
    ``lead`` a leading axis of length 1 is added (packed varlen arrays seen as batch 1)."""
    if kind == "numpy":
        # The simulator copies plain ndarrays and insists on contiguity; its own array wrapper
        # shares the memory with any strides.
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        x = x[None] if lead else x
        return FakeCUDAArray(x.view(np.uint32) if as_words else x)
    ptr, shape, strides, itemsize, _ = _interface(x, kind)
    if lead:
        shape, strides = (1,) + tuple(shape), (0,) + tuple(strides)
    if as_words:
        shape, strides = _as_words(ptr, shape, strides)
        typestr = "<u4"
    else:
        typestr = np.dtype(_dtype_name(x)).str
    desc = {"shape": tuple(shape), "strides": tuple(strides), "typestr": typestr,
            "data": (ptr, False), "version": 3, "stream": None}
    return cuda.from_cuda_array_interface(desc, owner=x, sync=False)


def _as_words(ptr, shape, strides):
    """Shape and byte strides of the uint32 view (pairs along head_dim) of a 16-bit array."""
    if ptr % 4 or any(s % 4 for s in strides[:3]):
        raise ValueError("16-bit inputs must be 4-byte aligned (pointer and strides) so that "
                         "pairs along head_dim form 32-bit words; make a contiguous copy")
    return tuple(shape[:3]) + (shape[3] // 2,), tuple(strides[:3]) + (4,)


def _empty_like_kind(kind: str, like, shape, dtype_name: str):
    if kind == "numpy":
        return np.empty(shape, dtype=like.dtype if dtype_name == _dtype_name(like) else dtype_name)
    if kind == "torch":
        import torch

        return torch.empty(shape, dtype=getattr(torch, dtype_name), device=like.device)
    try:
        import cupy
    except ImportError:
        cupy = None
    if cupy is not None and dtype_name != "bfloat16":
        return cupy.empty(shape, dtype=dtype_name)
    if cupy is not None and kind == "cupy":
        # A CuPy bfloat16 input (CuPy >= 14 stores ml_dtypes.bfloat16): same dtype out.
        return cupy.empty(shape, dtype=like.dtype)
    if cupy is not None:
        return cupy.empty(shape, dtype=np.uint16)  # bf16 storage; see attention_cuda
    return cuda.device_array(shape, dtype=np.uint16 if dtype_name == "bfloat16" else dtype_name)


def _resolve_stream(stream, kind: str, like):
    """A Numba stream for the launch: the given one, else the caller's current stream."""
    if SIMULATOR:
        return 0
    if stream is not None:
        if isinstance(stream, int):
            return cuda.external_stream(stream) if stream else cuda.default_stream()
        for attr in ("ptr", "cuda_stream", "handle"):
            handle = getattr(stream, attr, None)
            if isinstance(handle, int):
                return cuda.external_stream(handle) if handle else cuda.default_stream()
        if hasattr(stream, "__cuda_stream__"):
            _, handle = stream.__cuda_stream__()
            return cuda.external_stream(handle) if handle else cuda.default_stream()
        if type(stream).__module__.startswith("numba"):
            return stream
        raise TypeError(f"stream must be a CuPy/PyTorch/Numba stream or a raw handle, got {stream!r}")
    handle = 0
    if kind == "torch":
        handle = _torch_current_stream(like.device.index)
    else:
        try:
            import cupy

            handle = cupy.cuda.get_current_stream().ptr
        except ImportError:
            handle = 0
    return cuda.external_stream(handle) if handle else cuda.default_stream()


def _wgmma(dtype_name: str, head_dim: int) -> bool:
    """Whether this call's kernel is the wgmma path (float16 / bfloat16 at head_dim 64 or 128 on
    a compute-capability 9.0 device)."""
    return dtype_name in _HALF_NAMES and forward.mma_wgmma(head_dim)


def dynamic_smem_bytes(dtype_name: str, head_dim: int) -> int:
    """Dynamic shared memory of this configuration's kernel (0: static shared memory only)."""
    if not _wgmma(dtype_name, head_dim):
        return 0
    return forward.wgmma_smem_bytes(head_dim, forward.mma_block_n(head_dim, True))


def tile_shape(dtype_name: str, head_dim: int) -> tuple[int, int]:
    """(block_m, block_n) of the kernel for this dtype and head_dim (what tile tables use)."""
    if dtype_name in _HALF_NAMES:
        wg = _wgmma(dtype_name, head_dim)
        return forward.mma_block_m(head_dim, wg), forward.mma_block_n(head_dim, wg)
    itemsize = 8 if _FULL_NAMES[dtype_name] else 4
    return forward.fma_block_m(head_dim, itemsize), forward.fma_block_n(head_dim, itemsize)


def _raw_stream_handle(stream, kind: str, like):
    """The caller's stream as an int handle (0: legacy default), or a Numba stream object."""
    if stream is not None:
        if isinstance(stream, int):
            return stream
        for attr in ("ptr", "cuda_stream"):
            handle = getattr(stream, attr, None)
            if isinstance(handle, int):
                return handle
        if hasattr(stream, "__cuda_stream__"):
            return int(stream.__cuda_stream__()[1])
        handle = getattr(stream, "handle", None)
        if isinstance(handle, int):
            return handle
        if type(stream).__module__.startswith("numba"):
            return stream
        raise TypeError(f"stream must be a CuPy/PyTorch/Numba stream or a raw handle, got {stream!r}")
    if kind == "torch":
        return _torch_current_stream(like.device.index)
    try:
        import cupy
    except ImportError:
        return 0
    return cupy.cuda.get_current_stream().ptr


def _torch_current_stream(device_index: int) -> int:
    """PyTorch's current stream on a device as a raw handle. ``torch._C._cuda_getCurrentRawStream``
    (what Triton's launcher calls) answers without building a ``torch.cuda.Stream`` object, a
    few microseconds less per call; the public route where it is missing."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


def _core_stream(handle):
    """A cached cuda.core stream wrapping a raw handle (or a Numba stream object)."""
    if not isinstance(handle, int):
        from numba.cuda.cudadrv import driver

        return driver._to_core_stream(handle)
    st = _CORE_STREAMS.get(handle)
    if st is None:
        st = _CORE_STREAMS[handle] = _CoreStream.from_handle(handle)
    return st


def _flat_array(ptr, shape, strides, itemsize):
    """(layout, parameters) of a Numba array argument: meminfo, parent, size, itemsize, data,
    shape..., strides... (all intptr). Layout 'C' when the strides are C-contiguous (size-1
    dimensions ignored, as Numba does), else 'A'."""
    size, expect, contiguous = 1, itemsize, True
    for n, st in zip(reversed(shape), reversed(strides)):
        size *= n
        if n != 1:
            contiguous = contiguous and st == expect
            expect *= n
    return ("C" if contiguous else "A"), [0, 0, size, itemsize, ptr, *shape, *strides]


# The mask, varlen and alibi arguments of a plain launch: never read (compile-time off), passed
# as null arrays; (Numba type, flattened parameters) each, in kernel order.
_UNUSED_MASK_ARGS = (
    (types.Array(types.int32, 2, "C"), [0, 0, 4, 4, 0, 4, 1, 4, 4]),            # mk_iv (4, 1)
    (types.Array(types.int32, 2, "C"), [0, 0, 8, 4, 0, 8, 1, 4, 4]),            # mk_mm (8, 1)
    (types.Array(types.int8, 3, "C"), [0, 0, 1, 1, 0, 1, 1, 1, 1, 1, 1]),       # mk_tab (1, 1, 1)
    (types.Array(types.uint32, 2, "C"), [0, 0, 1, 4, 0, 1, 1, 4, 4]),           # mk_bits (1, 1)
    (types.Array(types.int32, 1, "C"), [0, 0, 2, 4, 0, 2, 4]),                  # cu_q (2,)
    (types.Array(types.int32, 1, "C"), [0, 0, 2, 4, 0, 2, 4]),                  # cu_k (2,)
    (types.Array(types.float32, 2, "C"), [0, 0, 1, 4, 0, 1, 1, 4, 4]),          # alibi (1, 1)
)
_UNUSED_MASK_TYPES = tuple(t for t, _ in _UNUSED_MASK_ARGS) if not SIMULATOR else ()


def _launcher(key, kern, elem, fdt, layouts, device_id, extra_types=None, smem=0):
    """Compile (or load) the kernel for these array layouts once; (cuda.core kernel, scalar
    ctypes types) for direct launches. ``extra_types``: Numba types of the mask / varlen / alibi
    arguments (None: the unused placeholders of a plain call). ``smem``: dynamic shared memory
    per block, whose limit is raised for the kernel on this device."""
    extra_types = _UNUSED_MASK_TYPES if extra_types is None else tuple(extra_types)
    lkey = (key, layouts, device_id, extra_types, smem)
    entry = _LAUNCHERS.get(lkey)
    if entry is None:
        arrays = [types.Array(elem, 4, lay) for lay in layouts[:4]]
        arrays.append(types.Array(types.float32, 3, layouts[4]))
        fty = types.float64 if fdt is np.float64 else types.float32
        sig = types.void(*arrays, types.int64, types.int64, types.int64, fty, fty, fty,
                         types.int64, types.int64, types.int64, *extra_types)
        kobj = kern.compile(sig)
        if smem > 48 * 1024:
            _raise_smem_limit(kobj._codelibrary.get_cufunc().handle, smem, device_id)
        cfloat = ctypes.c_double if fdt is np.float64 else ctypes.c_float
        entry = _LAUNCHERS[lkey] = (kobj._codelibrary.get_cufunc().kernel, cfloat)
    return entry


def _raise_smem_limit(handle, nbytes: int, device_id: int):
    """Allow ``nbytes`` of dynamic shared memory per block (more than the default 48 KB) for a
    kernel (a CUkernel handle, as Numba loads it) on one device."""
    from cuda.bindings import driver as cu

    attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    if isinstance(handle, cu.CUfunction):
        err, = cu.cuFuncSetAttribute(handle, attr, int(nbytes))
    else:
        err, = cu.cuKernelSetAttribute(attr, int(nbytes), handle, device_id)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuKernelSetAttribute(max dynamic shared memory = {nbytes}) failed: "
                           f"{err!r}")


def _launch_config(grid, threads, smem=0):
    cfg = _LAUNCH_CONFIGS.get((grid, threads, smem))
    if cfg is None:
        cfg = _LAUNCH_CONFIGS[(grid, threads, smem)] = _CoreLaunchConfig(
            grid=grid, block=threads, shmem_size=smem)
    return cfg


def kernel_for(dtype_name: str, head_dim: int, has_left: bool, has_right: bool, has_sinks: bool,
               has_softcap: bool, write_lse: bool, mask_kind: int = maskdev.NONE,
               varlen: bool = False, has_alibi: bool = False, mask_mod=None, score_mod=None):
    """The (cached) kernel and its launch geometry (block_m, threads) for one configuration."""
    wg = _wgmma(dtype_name, head_dim)
    key = (dtype_name, head_dim, has_left, has_right, has_sinks, has_softcap, write_lse,
           mask_kind, varlen, has_alibi, mask_mod, wg, score_mod)
    entry = _KERNELS.get(key)
    if entry is None:
        extra = dict(mask_kind=mask_kind, varlen=varlen, has_alibi=has_alibi, mask_mod=mask_mod,
                     score_mod=score_mod)
        _, block_n = tile_shape(dtype_name, head_dim)
        if dtype_name in _HALF_NAMES:
            kern = forward.make_mma_kernel(head_dim, _HALF_NAMES[dtype_name], has_left, has_right,
                                           has_sinks, has_softcap, write_lse, block_n,
                                           m_tiles=forward.mma_m_tiles(head_dim, wg), wgmma=wg,
                                           **extra)
            entry = (kern, forward.mma_block_m(head_dim, wg), forward.mma_threads(wg))
        else:
            kern = forward.make_fma_kernel(head_dim, _FULL_NAMES[dtype_name], has_left, has_right,
                                           has_sinks, has_softcap, write_lse, block_n, **extra)
            itemsize = 8 if _FULL_NAMES[dtype_name] else 4
            entry = (kern, forward.fma_block_m(head_dim, itemsize),
                     forward.fma_threads(head_dim, itemsize))
        _KERNELS[key] = entry
    return entry


def compiled_kernel_count() -> int:
    """Number of machine-code specialisations held in this process (for cache tests)."""
    if SIMULATOR:
        return len(_KERNELS)
    return sum(len(k.overloads) for k, _, _ in _KERNELS.values())


def window_flags(causal: bool, window_size, sinks: int, softcap):
    """The compile-time mask switches of the kernels and the window bounds they read.

    Returns ``(left, right, has_left, has_right, has_sinks, has_softcap)``: causal is the window
    right bound 0 (bottom-right aligned); sinks only matter with a bounded left side; softcap
    None or 0 is off.
    """
    left, right = (int(w) for w in window_size)
    if causal:
        right = 0 if right < 0 else min(right, 0)
    has_left, has_right = left >= 0, right >= 0
    has_sinks = has_left and int(sinks) > 0
    has_softcap = softcap is not None and float(softcap) > 0
    return left, right, has_left, has_right, has_sinks, has_softcap


def attention_cuda(q, k, v, *, softmax_scale: float, causal: bool = False, window_size=(-1, -1),
                   sinks: int = 0, mask=None, softcap=None, return_lse: bool = False, stream=None,
                   alibi_slopes=None, varlen=None, score_mod=None):
    """FlashAttention forward on the GPU (or Numba's simulator for NumPy inputs).

    q: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim); one
    dtype among float16, bfloat16 (tensor cores, fp32 accumulation), float32, float64 (exact
    CUDA-core paths); any strides with a contiguous head_dim; head_dim in 32, 64, 96, 128, 256.
    Returns out of the inputs' kind and dtype (a CuPy bfloat16 input gives a CuPy bfloat16
    array), (batch, seqlen_q, heads_q, head_dim) contiguous,
    or (out, lse) with lse float32 (batch, heads_q, seqlen_q), natural-log, -inf for rows that
    see no key. Runs on ``stream`` or the caller's current stream (CuPy's, or PyTorch's for
    tensors); returns without synchronising.

    mask: a ``numba_flash.masks`` object, intersected with the flags: column intervals when it
    has them (tile classes from their min/max on the device), else the packed bitmask with a
    device-built class table; a ``masks.mask_mod`` is compiled into the kernel (see maskplan.py).
    alibi_slopes: float32 (Hq,) or (B, Hq) on the device. varlen: a ``numba_flash.varlen.Varlen``
    (q (total_q, Hq, D), k / v (total_k, Hkv, D); out the same, lse (Hq, total_q)).
    score_mod: the user's ``fn(score, b, h, q_idx, kv_idx)``, compiled into the kernel (one
    kernel per function object).
    """
    kind, dtype_name, device, interfaces = _gpu_inputs(q, k, v, lead=varlen is not None)
    if varlen is not None:
        total_q, heads_q, head_dim = q.shape
        heads_kv = k.shape[1]
        batch, seqlen_q, seqlen_k = varlen.batch, varlen.max_seqlen_q, varlen.max_seqlen_k
    else:
        batch, seqlen_q, heads_q, head_dim = q.shape
        _, seqlen_k, heads_kv, _ = k.shape
    left, right, has_left, has_right, has_sinks, has_softcap = window_flags(
        causal, window_size, sinks, softcap)
    half = dtype_name in _HALF_NAMES

    lead = varlen is not None
    out_shape = tuple(q.shape) if lead else (batch, seqlen_q, heads_q, head_dim)
    lse_shape = (heads_q, q.shape[0]) if lead else (batch, heads_q, seqlen_q)
    out = _empty_like_kind(kind, q, out_shape, dtype_name)
    lse = _empty_like_kind(kind, q, lse_shape, "float32") if return_lse else None
    if varlen is not None and (out.size if kind != "torch" else out.numel()):
        out[...] = 0  # rows of sequences without keys or with no visible key stay 0
        if return_lse:
            lse[...] = -np.inf
    plain = mask is None and alibi_slopes is None and varlen is None and score_mod is None
    if plain and _FAST_LAUNCH and batch * seqlen_q * heads_q > 0:
        _launch_fast(kind, dtype_name, device, (q, k, v, out), lse, seqlen_q, seqlen_k,
                     heads_q // heads_kv, softmax_scale, softcap if has_softcap else None,
                     (left, right, int(sinks)), (has_left, has_right, has_sinks), stream,
                     interfaces=interfaces)
    elif _FAST_LAUNCH and (out.size if kind != "torch" else out.numel()) and batch and seqlen_q:
        # Mask objects, ALiBi, varlen, score_mod: the same direct launch, their arrays appended.
        plan, extra = _mask_arguments(mask, alibi_slopes, varlen, kind, dtype_name, head_dim,
                                      batch, heads_q, seqlen_q, seqlen_k,
                                      lambda: _resolve_stream(stream, kind, q), wrap=False)
        has_alibi = alibi_slopes is not None
        _launch_fast(kind, dtype_name, device, (q, k, v, out), lse, seqlen_q, seqlen_k,
                     heads_q // heads_kv, softmax_scale, softcap if has_softcap else None,
                     (left, right, int(sinks)), (has_left, has_right, has_sinks), stream,
                     extra=extra, config=(plan.kind, lead, has_alibi, plan.mask_mod, score_mod),
                     batch_heads=batch * heads_q, lead=lead, interfaces=interfaces)
    elif (out.size if kind != "torch" else out.numel()) and batch and seqlen_q:
        if kind == "numpy" and not return_lse:
            lse_arg = np.empty((1, 1, 1), dtype=np.float32)
        elif not return_lse:
            lse_arg = cuda.device_array((1, 1, 1), dtype=np.float32) if not SIMULATOR else \
                np.empty((1, 1, 1), dtype=np.float32)
        else:
            lse_arg = _kernel_array(lse, kind, False, lead)
        launch_stream = _resolve_stream(stream, kind, q)
        plan, extra = _mask_arguments(mask, alibi_slopes, varlen, kind, dtype_name, head_dim,
                                      batch, heads_q, seqlen_q, seqlen_k, launch_stream)
        has_alibi = alibi_slopes is not None
        kern, block_m, threads = kernel_for(dtype_name, head_dim, has_left, has_right, has_sinks,
                                            has_softcap, return_lse, plan.kind, lead, has_alibi,
                                            plan.mask_mod, score_mod)
        scale = float(softmax_scale)
        log2e = 1.0 / math.log(2.0)
        cap = float(softcap) if has_softcap else 1.0
        if half:
            fdt = np.float32
            scalars = (fdt(scale * log2e), fdt(scale / cap), fdt(cap * log2e))
        else:
            fdt = np.float64 if _FULL_NAMES[dtype_name] else np.float32
            scalars = (fdt(scale), fdt(scale / cap), fdt(cap))
        args = [_kernel_array(x, kind, half, lead) for x in (q, k, v, out)]
        grid = ((seqlen_q + block_m - 1) // block_m, batch * heads_q)
        ctx = _nullcontext()
        if device is not None and not SIMULATOR and device != cuda.get_current_device().id:
            ctx = cuda.gpus[device]
        all_args = (*args, lse_arg, seqlen_q, seqlen_k, heads_q // heads_kv, *scalars, left,
                    right, int(sinks), *extra)
        smem = dynamic_smem_bytes(dtype_name, head_dim)
        with ctx:
            if smem > 48 * 1024:   # raise the kernel's limit before the dispatcher launches it
                kobj = kern.compile(tuple(kern.typeof_pyval(a) for a in all_args))
                _raise_smem_limit(kobj._codelibrary.get_cufunc().handle, smem,
                                  cuda.get_current_device().id)
            kern[grid, threads, launch_stream, smem](*all_args)
    if kind == "cai" and dtype_name == "bfloat16":
        out = _BFloat16Array(out)
    return (out, lse) if return_lse else out


def _mask_arguments(mask, alibi_slopes, varlen, kind, dtype_name, head_dim, batch, heads_q,
                    seqlen_q, seqlen_k, launch_stream, wrap=True):
    """The mask plan and the kernel's trailing array arguments, in kernel order: mask intervals,
    their min/max, class table, bitmask words, cu_seqlens q and k, ALiBi slopes (dummies for
    what the call does not use). ``launch_stream``: a stream, or a function returning it (see
    ``plan_mask``). ``wrap``: the caller's arrays as Numba device arrays (the dispatcher's
    launch), else as they are or as a bare interface view (the direct launch reads only their
    ``__cuda_array_interface__``; a Numba wrapper costs tens of microseconds of host time)."""
    block_m, block_n = tile_shape(dtype_name, head_dim)
    plan = plan_mask(mask, batch, heads_q, seqlen_q, seqlen_k, block_m, block_n,
                     varlen is not None, launch_stream)
    dummies = dummy_arrays()
    extra = [plan.iv, plan.mm, plan.table, plan.bits]
    if varlen is not None and wrap:
        extra += [_kernel_array(varlen.cu_q, kind, False), _kernel_array(varlen.cu_k, kind, False)]
    elif varlen is not None:
        extra += [varlen.cu_q, varlen.cu_k]
    else:
        extra += [dummies.cu, dummies.cu]
    extra.append(_alibi_array(alibi_slopes, kind, batch, heads_q, wrap)
                 if alibi_slopes is not None else dummies.alibi)
    return plan, extra


class _InterfaceView:
    """Device memory described by a ``__cuda_array_interface__`` dict alone (no copy, no Numba
    wrapper), keeping its ``owner`` alive: an array the direct launch reshapes (ALiBi slopes
    broadcast to (batch, heads_q))."""

    def __init__(self, interface: dict, owner):
        self.__cuda_array_interface__ = interface
        self.owner = owner


def _alibi_array(slopes, kind: str, batch: int, heads_q: int, wrap: bool = True):
    """ALiBi slopes as a (batch, heads_q) float32 kernel array (a (heads_q,) vector broadcast);
    ``wrap``: a Numba device array, else an interface view (see ``_mask_arguments``)."""
    if kind == "numpy":
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        return FakeCUDAArray(np.ascontiguousarray(np.broadcast_to(
            np.asarray(slopes, dtype=np.float32), (batch, heads_q))))
    ptr, shape, strides, _, _ = _interface(slopes, kind)
    if len(shape) == 1:
        shape, strides = (batch,) + tuple(shape), (0,) + tuple(strides)
    desc = {"shape": tuple(shape), "strides": tuple(strides), "typestr": "<f4",
            "data": (ptr, False), "version": 3, "stream": None}
    if not wrap:
        return _InterfaceView(desc, slopes)
    return cuda.from_cuda_array_interface(desc, owner=slopes, sync=False)


def _device_array_arg(x):
    """(Numba type, flattened parameters) of a device array argument (anything with
    ``__cuda_array_interface__``: Numba device arrays, CuPy, ...). Numba device arrays (the mask
    plans' and the placeholders, reused by every call) keep theirs: their pointer and shape
    never change."""
    numba_array = isinstance(x, _DeviceNDArray)
    if numba_array:
        cached = x.__dict__.get("_nf_launch_arg")
        if cached is not None:
            return cached
    cai = x.__cuda_array_interface__
    dtype = np.dtype(cai["typestr"])
    shape = tuple(cai["shape"])
    strides = cai.get("strides")
    if strides is None:
        strides, acc = [], dtype.itemsize
        for n in reversed(shape):
            strides.insert(0, acc)
            acc *= n
    lay, flat = _flat_array(cai["data"][0], shape, tuple(strides), dtype.itemsize)
    arg = (types.Array(numba_from_dtype(dtype), len(shape), lay), flat)
    if numba_array:
        x.__dict__["_nf_launch_arg"] = arg
    return arg


def _launch_fast(kind, dtype_name, device, arrays, lse, seqlen_q, seqlen_k, heads_ratio,
                 softmax_scale, softcap, window, flags, stream, extra=None, config=None,
                 batch_heads=None, lead=False, interfaces=None):
    """Direct launch (see the module docstring); arrays = (q, k, v, out). ``extra``: the mask,
    cu_seqlens and alibi device arrays in kernel order (None: a plain call, placeholders);
    ``config``: (mask kind, varlen, has_alibi, mask_mod, score_mod) of the kernel; ``lead``:
    packed varlen arrays, given a leading batch axis of 1 (then ``batch_heads`` = batch *
    heads_q); ``interfaces``: what ``_interface`` returned for the leading arrays, if known.

    Everything but the data pointers and the trailing arrays depends only on the call's
    configuration (shapes, strides, dtypes, scalars, flags, device): that part is built once
    per configuration (``_FAST_PLANS``) and a repeated call only fills in the pointers."""
    half = dtype_name in _HALF_NAMES
    ptrs, metas = [], []
    for i, x in enumerate(arrays):
        ptr, shape, strides, itemsize, _ = (interfaces[i] if interfaces is not None and
                                            i < len(interfaces) else _interface(x, kind))
        if half and ptr % 4:
            _as_words(ptr, shape, strides)     # raises: 16-bit data must be 4-byte aligned
        ptrs.append(ptr)
        metas.append((tuple(shape), tuple(strides), itemsize))
    if lse is not None:
        ptr, shape, strides, itemsize, _ = _interface(lse, kind)
        ptrs.append(ptr)
        metas.append((tuple(shape), tuple(strides), itemsize))
    extra_types, extra_params = None, []
    if extra is not None:
        extra_types = []
        for x in extra:
            ty, flat = _device_array_arg(x)
            extra_types.append(ty)
            extra_params.extend(flat)
        extra_types = tuple(extra_types)
    current = current_device_id()
    dev = current if device is None else device
    # Numba types are interned (one object per type) and hash slowly: keyed by identity, kept
    # alive by the plan that holds them.
    type_ids = None if extra_types is None else tuple(map(id, extra_types))
    pkey = (dtype_name, dev, tuple(metas), lse is not None, seqlen_q, seqlen_k, heads_ratio,
            float(softmax_scale), softcap, tuple(window), tuple(flags), config, batch_heads,
            lead, type_ids, _wgmma_switch())
    ctx = cuda.gpus[device] if dev != current else _nullcontext()
    plan = _FAST_PLANS.get(pkey)
    if plan is None:
        with ctx:
            plan = _fast_plan(dtype_name, dev, metas, lse is not None, seqlen_q, seqlen_k,
                              heads_ratio, softmax_scale, softcap, window, flags, config,
                              batch_heads, lead, extra_types)
        if len(_FAST_PLANS) >= _FAST_PLANS_MAX:
            _FAST_PLANS.clear()
        _FAST_PLANS[pkey] = plan
    core_kernel, launch_config, head, slots, tail, _ = plan
    params = list(head)
    for slot, ptr in zip(slots, ptrs):
        params[slot] = ptr
    params.extend(tail)
    params.extend(extra_params)
    with ctx:
        _core_launch(_core_stream(_raw_stream_handle(stream, kind, arrays[0])), launch_config,
                     core_kernel, *params)


def _wgmma_switch():
    """``NUMBA_FLASH_WGMMA`` as set now (it picks the kernel per call, so the plan cache keys on it)."""
    return os.environ.get("NUMBA_FLASH_WGMMA")


_FAST_PLANS: dict = {}
_FAST_PLANS_MAX = 256


def _fast_plan(dtype_name, dev, metas, has_lse, seqlen_q, seqlen_k, heads_ratio, softmax_scale,
               softcap, window, flags, config, batch_heads, lead, extra_types):
    """The configuration-only part of a direct launch: (cuda.core kernel, launch config,
    parameters of the array arguments with their data pointers left 0, the index of each
    pointer in that list, the scalar parameters that follow). ``metas``: (shape, strides,
    itemsize) of q, k, v, out (and lse when ``has_lse``) as given."""
    half = dtype_name in _HALF_NAMES
    head, slots, layouts = [], [], []
    for i, (shape, strides, itemsize) in enumerate(metas):
        if lead:
            shape, strides = (1,) + shape, (0,) + strides
        if half and i < 4:
            shape, strides = _as_words(0, shape, strides)
            itemsize = 4
        lay, flat = _flat_array(0, shape, strides, itemsize)
        layouts.append(lay)
        slots.append(len(head) + 4)            # the data pointer's place in the flattened array
        head.extend(flat)
    if not has_lse:  # never read: write_lse is a compile-time False
        layouts.append("C")
        head.extend([0, 0, 1, 4, 0, 1, 1, 1, 4, 4, 4])

    has_left, has_right, has_sinks = flags
    head_dim = metas[0][0][-1]
    key = (dtype_name, head_dim, has_left, has_right, has_sinks, softcap is not None,
           has_lse) + (tuple(config) if config is not None else ())
    kern, block_m, threads = kernel_for(*key)
    if half:
        elem, fdt = types.uint32, np.float32
    else:
        fdt = np.float64 if _FULL_NAMES[dtype_name] else np.float32
        elem = types.float64 if fdt is np.float64 else types.float32
    smem = dynamic_smem_bytes(dtype_name, head_dim)
    core_kernel, cfloat = _launcher(key, kern, elem, fdt, tuple(layouts), dev, extra_types, smem)
    scale = float(softmax_scale)
    cap = float(softcap) if softcap is not None else 1.0
    if half:
        log2e = 1.0 / math.log(2.0)
        scalars = (scale * log2e, scale / cap, cap * log2e)
    else:
        scalars = (scale, scale / cap, cap)
    c64 = ctypes.c_int64
    tail = [c64(seqlen_q), c64(seqlen_k), c64(heads_ratio)]
    tail.extend(cfloat(x) for x in scalars)
    tail.extend(c64(w) for w in window)
    if extra_types is None:
        for _, flat in _UNUSED_MASK_ARGS:
            tail.extend(flat)
    if batch_heads is None:
        shape = metas[0][0]
        batch_heads = shape[0] * shape[2]
    grid = ((seqlen_q + block_m - 1) // block_m, batch_heads)
    return (core_kernel, _launch_config(grid, threads, smem), tuple(head), tuple(slots),
            tuple(tail), extra_types)


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _BFloat16Array:
    """bfloat16 output for generic ``__cuda_array_interface__`` inputs: the interface has no
    bfloat16 type string, so ``storage`` (uint16 bits) is exposed with typestr ``<V2``. CuPy
    bfloat16 inputs (CuPy >= 14) get a CuPy bfloat16 array instead, PyTorch ones a tensor."""

    def __init__(self, storage):
        self.storage = storage
        self.shape = tuple(storage.shape)
        cai = dict(storage.__cuda_array_interface__)
        cai["typestr"] = "<V2"
        self.__cuda_array_interface__ = cai
