"""Classify the arrays handed to ``numba_flash.attention``: host (NumPy) or GPU (CUDA array interface).

GPU arrays are read through ``__cuda_array_interface__`` alone, so CuPy arrays, PyTorch CUDA
tensors and Numba device arrays are all accepted without importing any of those libraries.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["ArrayInfo", "describe", "describe_all", "bfloat16_dtype", "dtype_name", "ACCEPTED",
           "to_host", "as_dtype", "int32_indices"]

ACCEPTED = ("a NumPy ndarray (CPU mode), or a GPU array exposing __cuda_array_interface__ "
            "(CuPy array, PyTorch CUDA tensor, Numba device array)")


@dataclass(frozen=True)
class ArrayInfo:
    """What the library needs to know about one input array.

    kind: "numpy" or "cuda"; shape: tuple of ints; dtype: a NumPy dtype (bfloat16 is
    ``ml_dtypes.bfloat16``'s dtype); strides: bytes per step along each axis; device: the CUDA
    device ordinal where the array says so, else None (always None for NumPy arrays).
    """

    kind: str
    shape: tuple
    dtype: np.dtype
    strides: tuple
    device: int | None
    type_name: str


def bfloat16_dtype() -> np.dtype:
    """The NumPy dtype used for bfloat16 (``ml_dtypes.bfloat16``)."""
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


_DTYPE_NAMES: dict = {}


def dtype_name(dtype) -> str:
    """``np.dtype(dtype).name``, cached: NumPy computes a dtype's name in Python on every access
    (a few microseconds), and one attention call asks for it a dozen times."""
    try:
        return _DTYPE_NAMES[dtype]
    except (KeyError, TypeError):
        pass
    name = np.dtype(dtype).name
    try:
        _DTYPE_NAMES[dtype] = name
    except TypeError:   # an unhashable dtype-like: answer without caching
        pass
    return name


def _type_name(obj) -> str:
    cls = type(obj)
    module = cls.__module__
    return cls.__name__ if module == "builtins" else f"{module}.{cls.__name__}"


def _names_bfloat16(obj) -> bool:
    # torch.bfloat16 prints as "torch.bfloat16"; NumPy/ml_dtypes dtypes have .name "bfloat16".
    dtype = getattr(obj, "dtype", None)
    if dtype is None:
        return False
    if isinstance(dtype, np.dtype):
        return dtype_name(dtype) == "bfloat16"
    name = getattr(dtype, "name", None)
    return (isinstance(name, str) and name == "bfloat16") or str(dtype).endswith("bfloat16")


def _cuda_interface(obj):
    """The object's ``__cuda_array_interface__`` dict, or None when it has none."""
    try:
        return obj.__cuda_array_interface__
    except AttributeError:
        # PyTorch CPU tensors raise AttributeError from the property: not a GPU array.
        return None


def _device_ordinal(obj) -> int | None:
    try:
        device = getattr(obj, "device", None)
    except Exception:  # noqa: BLE001 - a broken property must not hide the real error
        return None
    for attr in ("id", "index"):  # cupy.cuda.Device.id, torch.device.index
        value = getattr(device, attr, None)
        if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
            return int(value)
    return None


def _c_strides(shape, itemsize) -> tuple:
    strides, step = [], itemsize
    for size in reversed(shape):
        strides.append(step)
        step *= max(int(size), 1)
    return tuple(reversed(strides))


_TYPE_NAMES: dict = {}
_TORCH_DTYPES: dict = {}   # torch dtype -> NumPy dtype (None: read through the interface)


def _torch_dtype(torch_dtype):
    try:
        return _TORCH_DTYPES[torch_dtype]
    except KeyError:
        pass
    name = str(torch_dtype).replace("torch.", "")
    dtype = None
    if name == "bfloat16":
        dtype = bfloat16_dtype()
    elif name in ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8",
                  "bool"):
        dtype = np.dtype(name)
    _TORCH_DTYPES[torch_dtype] = dtype
    return dtype


def _fast_info(obj, name: str):
    """The ArrayInfo of a CUDA PyTorch tensor or a CuPy array read from its attributes (a few
    C-level lookups) instead of its ``__cuda_array_interface__`` (PyTorch builds that dict in
    Python, ~10 us); None when the object needs the general path (CPU tensors, unusual dtypes,
    other types). A tensor that requires grad raises TypeError: its interface refuses it too,
    and nothing here would carry gradients."""
    cls = type(obj)
    module = cls.__module__
    if module == "torch":
        if not obj.is_cuda or obj.is_sparse:
            return None
        if obj.requires_grad:
            raise TypeError(f"{name} is a PyTorch tensor that requires grad; "
                            f"numba_flash.attention is not tracked by autograd: use "
                            f"numba_flash.torch.attention for gradients, or pass {name}.detach()")
        dtype = _torch_dtype(obj.dtype)
        if dtype is None:
            return None
        size = dtype.itemsize
        strides = tuple(s * size for s in obj.stride())
        return ArrayInfo("cuda", tuple(obj.shape), dtype, strides, obj.device.index,
                         _cached_type_name(cls, obj))
    if module == "cupy":
        dtype = obj.dtype
        if not isinstance(dtype, np.dtype):
            return None
        return ArrayInfo("cuda", obj.shape, dtype, obj.strides, obj.device.id,
                         _cached_type_name(cls, obj))
    return None


def _cached_type_name(cls, obj) -> str:
    name = _TYPE_NAMES.get(cls)
    if name is None:
        name = _TYPE_NAMES[cls] = _type_name(obj)
    return name


def describe(obj, name: str) -> ArrayInfo:
    """Classify ``obj`` (the argument called ``name``) and read its shape, dtype, strides, device.

    NumPy ndarray -> kind "numpy"; anything with ``__cuda_array_interface__`` -> kind "cuda".
    Anything else raises TypeError naming the argument and listing what is accepted.
    """
    info = _fast_info(obj, name)
    if info is not None:
        return info
    if isinstance(obj, np.ndarray):
        if isinstance(obj, np.ma.MaskedArray):
            raise TypeError(f"{name} is a NumPy masked array; attention ignores no elements, so "
                            f"pass a plain ndarray (np.asarray({name})) and express visibility "
                            f"with mask=/causal=/window_size=")
        return ArrayInfo("numpy", tuple(int(s) for s in obj.shape), obj.dtype,
                         tuple(int(s) for s in obj.strides), None, _type_name(obj))
    interface = _cuda_interface(obj)
    if interface is None:
        hint = ""
        if type(obj).__module__.startswith("torch"):
            hint = "; a PyTorch tensor must live on the GPU (tensor.cuda()) or be converted " \
                   "with tensor.numpy()"
        elif isinstance(obj, (list, tuple)):
            hint = f"; convert it first, e.g. np.asarray({name}, dtype=np.float32)"
        raise TypeError(f"{name} must be {ACCEPTED}, got {_type_name(obj)}{hint}")
    if not isinstance(interface, dict) or "shape" not in interface or "typestr" not in interface:
        raise TypeError(f"{name} has a malformed __cuda_array_interface__ (expected a dict with "
                        f"'shape' and 'typestr'), got {interface!r}")
    if interface.get("mask") is not None:
        raise TypeError(f"{name} is a masked GPU array (its __cuda_array_interface__ has a "
                        f"'mask'); pass plain data and express visibility with mask=/causal=")
    shape = tuple(int(s) for s in interface["shape"])
    typestr = interface["typestr"]
    if _names_bfloat16(obj):
        dtype = bfloat16_dtype()
    else:
        try:
            dtype = np.dtype(typestr)
        except TypeError:
            raise TypeError(f"{name} has an unreadable __cuda_array_interface__ typestr "
                            f"{typestr!r}") from None
        if dtype.kind == "V" and dtype.itemsize == 2:
            # "<V2" is how ml_dtypes/JAX spell bfloat16 in array interfaces.
            dtype = bfloat16_dtype()
    strides = interface.get("strides")
    if strides is None:
        strides = _c_strides(shape, dtype.itemsize)
    return ArrayInfo("cuda", shape, dtype, tuple(int(s) for s in strides), _device_ordinal(obj),
                     _type_name(obj))


_KIND_WORDS = {"numpy": "a NumPy array (host memory)",
               "cuda": "a GPU array (__cuda_array_interface__)"}


def describe_all(**arrays) -> dict:
    """Classify several named arrays at once; all must be of one kind and (for GPUs) one device.

    Returns {name: ArrayInfo} in the order given. Mixed kinds raise TypeError naming both
    arguments; GPU arrays on different devices raise ValueError naming both.
    """
    infos = {name: describe(obj, name) for name, obj in arrays.items()}
    names = list(infos)
    first = names[0]
    for other in names[1:]:
        a, b = infos[first], infos[other]
        if a.kind != b.kind:
            raise TypeError(f"{first} and {other} must be arrays of the same kind, got {first} "
                            f"{_KIND_WORDS[a.kind]} ({a.type_name}) and {other} "
                            f"{_KIND_WORDS[b.kind]} ({b.type_name}); move both to the GPU "
                            f"(e.g. cupy.asarray) or both to the host (e.g. cupy.asnumpy)")
        if a.device is not None and b.device is not None and a.device != b.device:
            raise ValueError(f"{first} and {other} must be on the same GPU, got {first} on "
                             f"device {a.device} and {other} on device {b.device}")
    return infos


def _library(obj) -> str:
    return type(obj).__module__.split(".")[0]


def to_host(obj) -> np.ndarray:
    """A NumPy copy of the array ``obj``, made by its own library: NumPy arrays as they are,
    PyTorch tensors through ``.detach().cpu().numpy()``, CuPy arrays through ``cupy.asnumpy``,
    Numba device arrays through ``copy_to_host``, any other ``__cuda_array_interface__`` object
    through ``numba.cuda.as_cuda_array``. For GPU arrays this synchronises with the device."""
    if isinstance(obj, np.ndarray):
        return obj
    library = _library(obj)
    if library == "torch":
        return obj.detach().cpu().numpy()
    if library == "cupy":
        import cupy

        return cupy.asnumpy(obj)
    if hasattr(obj, "copy_to_host"):
        return obj.copy_to_host()
    from numba import cuda

    return cuda.as_cuda_array(obj).copy_to_host()


def as_dtype(obj, dtype, info: ArrayInfo | None = None):
    """``obj`` converted to ``dtype`` by its own library (``astype`` for NumPy and CuPy,
    ``.to`` for PyTorch), on its device and on the current stream; ``obj`` itself, at no cost,
    when it has that dtype already. ``info``: ``describe(obj)`` when the caller has it.
    Values are converted as the library does it (no range check: see ``int32_indices``)."""
    dtype = np.dtype(dtype)
    info = info or describe(obj, "array")
    if info.dtype == dtype:
        return obj
    if info.kind == "numpy":
        return obj.astype(dtype)
    library = _library(obj)
    if library == "torch":
        import torch

        return obj.to(getattr(torch, dtype.name))
    if library == "cupy":
        return obj.astype(dtype)
    try:
        import cupy
    except ImportError:
        from numba import cuda

        return cuda.to_device(np.ascontiguousarray(to_host(obj).astype(dtype)))
    return cupy.asarray(obj).astype(dtype)


_INT32 = np.iinfo(np.int32)


def int32_indices(obj, name: str, info: ArrayInfo | None = None):
    """The integer index array ``obj`` (argument ``name``) as int32, the kernels' index type.

    int32 passes through untouched; other integer dtypes (NumPy's default int64, PyTorch's
    int64...) are converted once by the array's own library. NumPy values that do not fit int32
    raise ValueError naming the first one; GPU values are not read back here (that would
    synchronise): ``check_inputs=True`` checks them on a host copy. Non-integer dtypes raise
    TypeError."""
    info = info or describe(obj, name)
    if info.dtype == np.int32:
        return obj
    if info.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers (int32, or int64 converted to int32), got "
                        f"dtype {info.dtype}")
    if info.kind == "numpy" and obj.size:
        bad = (obj < _INT32.min) | (obj > _INT32.max)
        if bad.any():
            where = tuple(int(i) for i in np.argwhere(bad)[0])
            raise ValueError(f"{name} must fit int32 (the kernels' index type), got "
                             f"{name}[{', '.join(map(str, where))}] = {int(obj[where])}; expected "
                             f"values in [{_INT32.min}, {_INT32.max}]")
    return as_dtype(obj, np.int32, info)
