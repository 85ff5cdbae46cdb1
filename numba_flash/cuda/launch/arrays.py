"""What the runtime needs to know about the caller's arrays: their kind (NumPy under the
simulator, CuPy, PyTorch, any ``__cuda_array_interface__``), dtype, pointer, shape, strides and
device, read without copying; and outputs allocated as the same kind of array (CuPy's pool,
PyTorch's caching allocator). This is the only module of the package that knows array
libraries; kernels see flat Numba arrays.
"""
from __future__ import annotations

import numpy as np
from numba import cuda
from numba.cuda import types

from ...arrays import dtype_name as _cached_dtype_name
from ..primitives import SIMULATOR
from .driver import ArrayParam

__all__ = ["HALF_NAMES", "FULL_NAMES", "SUPPORTED_HEAD_DIMS", "padded_head_dim", "pad_head_dim",
           "array_library", "array_kind", "dtype_name",
           "interface", "gpu_inputs", "check_rows_aligned", "kernel_array", "flat_kernel_array",
           "as_words", "outer_strides", "empty_like_kind",
           "BFloat16Array", "caller_param", "fixed_param"]

SUPPORTED_HEAD_DIMS = (32, 64, 96, 128, 256)
HALF_NAMES = {"float16": False, "bfloat16": True}     # name -> is bfloat16
FULL_NAMES = {"float32": False, "float64": True}      # name -> is float64


def array_library(t) -> str:
    """The top-level package that defines array type ``t`` ("cupy", "torch", "numpy", ...)."""
    return t.__module__.split(".")[0]


def array_kind(x) -> str:
    """'numpy', 'cupy', 'torch' or 'cai' (anything else with __cuda_array_interface__)."""
    mod = array_library(type(x))
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


def dtype_name(x) -> str:
    if array_library(type(x)) == "torch":
        return str(x.dtype).replace("torch.", "")
    name = _cached_dtype_name(x.dtype) if hasattr(x, "dtype") else "void16"
    if name == "void16":  # a bare "<V2" interface: bfloat16, as numba_flash.arrays reads it
        from ...arrays import describe

        name = describe(x, "array").dtype.name
    return name


def interface(x, kind: str):
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
    return ptr, shape, tuple(strides), itemsize, pointer_device(ptr)


def pointer_device(ptr: int):
    try:
        import cupy

        return cupy.cuda.runtime.pointerGetAttributes(ptr).device
    except Exception:  # no CuPy: trust the caller's current device
        return None



def gpu_inputs(q, k, v, lead: bool = False):
    """GPU-specific checks of q, k, v (``lead``: packed varlen arrays, checked as batch 1):
    (kind, dtype name, device id, the arrays' interfaces ((pointer, shape, strides, itemsize,
    device) of q, k, v as given), which the direct launch reuses instead of reading them again."""
    kinds = [array_kind(x) for x in (q, k, v)]
    if len(set(kinds)) != 1:
        raise TypeError(f"q, k, v must be the same kind of array, got {kinds}")
    kind = kinds[0]
    if kind == "numpy" and not SIMULATOR:
        raise TypeError("NumPy inputs run on the CUDA backend only under Numba's simulator "
                        "(NUMBA_ENABLE_CUDASIM=1); use backend='cpu' or pass GPU arrays")
    names = [dtype_name(x) for x in (q, k, v)]
    if len(set(names)) != 1:
        raise TypeError(f"q, k, v must share one dtype, got q {names[0]}, k {names[1]}, v {names[2]}")
    if names[0] not in HALF_NAMES and names[0] not in FULL_NAMES:
        raise TypeError(f"q, k, v dtype must be float16, bfloat16, float32 or float64, got {names[0]}")
    devices, interfaces = [], []
    for name, x in (("q", q), ("k", k), ("v", v)):
        info = interface(x, kind)
        interfaces.append(info)
        ptr, shape, strides, itemsize, device = info
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
        raise ValueError(f"head_dim must be one of {SUPPORTED_HEAD_DIMS} on the GPU (attention "
                         f"pads other multiples of 8 up to 256 itself), got {head_dim}")
    return kind, names[0], (known.pop() if known else None), interfaces


def padded_head_dim(head_dim: int):
    """The kernel head dim that serves ``head_dim`` by zero padding (the next supported one),
    for multiples of 8 up to 256 that no kernel takes as they are; None otherwise."""
    if head_dim in SUPPORTED_HEAD_DIMS or head_dim % 8 or not 0 < head_dim <= 256:
        return None
    return min(d for d in SUPPORTED_HEAD_DIMS if d > head_dim)


def pad_head_dim(x, kind: str, width: int):
    """A contiguous copy of ``x`` (..., d) with zero columns up to ``width`` (same kind, dtype
    and device)."""
    out = empty_like_kind(kind, x, tuple(x.shape[:-1]) + (width,), dtype_name(x), zero=True)
    out[..., :x.shape[-1]] = x
    return out


def kernel_array(x, kind: str, words: bool, lead: bool = False):
    """The array the kernel reads: x itself, or a uint32 view of pairs along head_dim; with
    ``lead`` a leading axis of length 1 is added (packed varlen arrays seen as batch 1)."""
    if kind == "numpy":
        # The simulator copies plain ndarrays and insists on contiguity; its own array wrapper
        # shares the memory with any strides.
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        x = x[None] if lead else x
        return FakeCUDAArray(x.view(np.uint32) if words else x)
    ptr, shape, strides, itemsize, _ = interface(x, kind)
    if lead:
        shape, strides = (1,) + tuple(shape), (0,) + tuple(strides)
    if words:
        shape, strides = as_words(ptr, shape, strides)
    return _device_view(x, ptr, shape, strides, words)


def flat_kernel_array(x, kind: str, words: bool):
    """x as a 1-D kernel array of all its elements (uint32 words with ``words``), or None when x
    is not C-contiguous. Built from the pointer: Numba's reshape refuses the stride-0 leading
    axis that ``kernel_array(..., lead=True)`` adds."""
    if kind == "numpy":
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        if not x.flags.c_contiguous:
            return None
        flat = x.reshape(-1)
        return FakeCUDAArray(flat.view(np.uint32) if words else flat)
    ptr, shape, strides, itemsize, _ = interface(x, kind)
    expect = itemsize
    for n, st in zip(reversed(shape), reversed(strides)):
        if n != 1 and st != expect:
            return None
        expect *= n
    n = int(np.prod(shape))
    if words:
        if ptr % 4:
            return None
        n, itemsize = n // 2, 4
    return _device_view(x, ptr, (n,), (itemsize,), words)


def _device_view(x, ptr, shape, strides, words):
    """A Numba device array over x's memory at ``ptr`` with this shape and byte strides, of
    x's dtype or uint32 words; no copy, no synchronisation."""
    typestr = "<u4" if words else np.dtype(dtype_name(x)).str
    desc = {"shape": tuple(shape), "strides": tuple(strides), "typestr": typestr,
            "data": (ptr, False), "version": 3, "stream": None}
    return cuda.from_cuda_array_interface(desc, owner=x, sync=False)


def check_rows_aligned(reader: str, **arrays):
    """Raise ValueError unless each array's pointer and the strides of every axis but head_dim
    are multiples of 16 bytes: ``reader`` (the kernels, named in the message) copies rows in
    16-byte pieces (cp.async, vector loads, TMA). Axes of length 0 or 1 are exempt: their stride
    never moves an address (libraries report any value there). GPU arrays only."""
    for name, x in arrays.items():
        ptr, shape, strides, _, _ = interface(x, array_kind(x))
        if ptr % 16 or any(st % 16 for st in outer_strides(shape, strides)):
            raise ValueError(
                f"{name} must be 16-byte aligned (its pointer and the strides of the axes before "
                f"head_dim) for {reader}, got a pointer {ptr % 16} bytes past a 16-byte boundary "
                f"and strides {tuple(strides)} bytes; copy it into a new array (cupy.array(x), "
                f"x.clone())")


def outer_strides(shape, strides) -> tuple:
    """The byte strides of the axes before head_dim, 0 on axes of length 0 or 1: whatever
    stride their library reported there never moves an address."""
    return tuple(0 if n <= 1 else st for n, st in zip(shape[:-1], strides[:-1]))


def as_words(ptr, shape, strides):
    """Shape and byte strides of the uint32 view (pairs along head_dim) of a 16-bit (B, S, H,
    D) array (``outer_strides``: axes of length 0 or 1 get stride 0)."""
    outer = outer_strides(shape, strides)
    if ptr % 4 or any(st % 4 for st in outer):
        raise ValueError("16-bit inputs must be 4-byte aligned (pointer and strides) so that "
                         "pairs along head_dim form 32-bit words; make a contiguous copy")
    return tuple(shape[:-1]) + (shape[-1] // 2,), outer + (4,)


def empty_like_kind(kind: str, like, shape, name: str, zero: bool = False, fill=None):
    """A new array of ``like``'s kind and device, dtype ``name``, C-contiguous: uninitialised,
    or zeros (``zero``), or filled with ``fill``. CuPy bfloat16 inputs get CuPy bfloat16 (CuPy
    >= 14 stores ml_dtypes.bfloat16); other bfloat16 interfaces get uint16 storage."""
    out = _new_array(kind, like, shape, name, zero)
    if fill is not None and not zero:
        out[...] = fill
    return out


def _new_array(kind, like, shape, name, zero):
    if kind == "numpy":
        dt = like.dtype if name == dtype_name(like) else name
        return np.zeros(shape, dtype=dt) if zero else np.empty(shape, dtype=dt)
    if kind == "torch":
        import torch

        make = torch.zeros if zero else torch.empty
        return make(shape, dtype=getattr(torch, name), device=like.device)
    try:
        import cupy
    except ImportError:
        cupy = None
    if cupy is not None:
        make = cupy.zeros if zero else cupy.empty
        if name != "bfloat16":
            return make(shape, dtype=name)
        return make(shape, dtype=like.dtype if kind == "cupy" else np.uint16)
    out = cuda.device_array(shape, dtype=np.uint16 if name == "bfloat16" else name)
    if zero:
        out[...] = 0
    return out




class BFloat16Array:
    """bfloat16 output for generic ``__cuda_array_interface__`` inputs: the interface has no
    bfloat16 type string, so ``storage`` (uint16 bits) is exposed with typestr ``<V2``. CuPy
    bfloat16 inputs (CuPy >= 14) get a CuPy bfloat16 array instead, PyTorch ones a tensor."""

    def __init__(self, storage):
        self.storage = storage
        self.shape = tuple(storage.shape)
        cai = dict(storage.__cuda_array_interface__)
        cai["typestr"] = "<V2"
        self.__cuda_array_interface__ = cai


# Kernel arguments as launch plans describe them (driver.ArrayParam).
def caller_param(x, kind: str, words: bool = False, lead: bool = False):
    """ArrayParam of a caller array (pointer per call); ``words``: the uint32 view of a 16-bit
    array; ``lead``: a packed varlen array seen as batch 1."""
    ptr, shape, strides, itemsize, _ = interface(x, kind)
    if lead:
        shape, strides = (1,) + tuple(shape), (0,) + tuple(strides)
    if words:
        shape, strides = as_words(ptr, shape, strides)
        return ArrayParam(types.uint32, shape, strides, 4)
    return ArrayParam(_ELEMENTS[np.dtype(_elem_name(x, itemsize)).name], shape, strides, itemsize)


def _elem_name(x, itemsize):
    dt = getattr(x, "dtype", None)
    name = str(dt).replace("torch.", "")
    return name if name in _ELEMENTS else {2: "uint16", 4: "float32", 8: "float64"}[itemsize]


_ELEMENTS = {"float16": types.uint16, "bfloat16": types.uint16, "uint16": types.uint16,
         "float32": types.float32, "float64": types.float64, "int32": types.int32,
         "int64": types.int64, "uint32": types.uint32, "int8": types.int8}


def fixed_param(x):
    """ArrayParam of a library-owned device array (its pointer is part of the plan)."""
    cai = x.__cuda_array_interface__
    dtype = np.dtype(cai["typestr"])
    shape = tuple(cai["shape"])
    strides = cai.get("strides")
    if strides is None:
        strides, acc = [], dtype.itemsize
        for n in reversed(shape):
            strides.insert(0, acc)
            acc *= n
    return ArrayParam(_ELEMENTS[dtype.name], shape, strides, dtype.itemsize, ptr=cai["data"][0])


_PLACEHOLDERS: dict = {}


def placeholder(device: int, shape: tuple, dtype, fill=0):
    """A small library-owned device array (zeros, or ``fill``) for a kernel argument that a
    configuration never reads, made once per (device, shape, dtype, fill) and kept for the
    process (plans hold its fixed pointer). NumPy in the simulator."""
    if SIMULATOR:
        return np.full(shape, fill, dtype=dtype)
    key = (device, tuple(shape), np.dtype(dtype).str, fill)
    arr = _PLACEHOLDERS.get(key)
    if arr is None:
        arr = _PLACEHOLDERS[key] = cuda.to_device(np.full(shape, fill, dtype=dtype))
    return arr

