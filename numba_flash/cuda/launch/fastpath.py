"""The repeated call: a table from a call's signature to what its first call planned.

A signature is everything validation and planning depend on: the array library, each array's
shape, strides, dtype and device, and every keyword (arrays among them by their geometry; mask
and score_mod objects by identity, guarded against a recycled id). A hit skips validation and
planning: the call allocates its outputs with the caller's allocator, reads the data pointers,
checks the current device and, where the call asks (``align``), the inputs' pointer alignment
(16 bytes for attention and decode), and launches the recorded plan
on the caller's stream. Only CuPy arrays and PyTorch tensors take this path (their geometry is
cheap to read); anything else, and any miss, goes through the full path, which records the
plan for next time. Tables are bounded (cleared when full).
"""
from __future__ import annotations

import functools

import numpy as np

from .arrays import array_library
from .driver import current_device, stream_is_capturing
from .streams import raw_stream_handle

__all__ = ["FastCall", "fast_table", "register_fast", "call_key", "geometry_of", "geometry_reader",
           "pointer_of", "current_stream_of", "device_reader", "capture_reader",
           "array_allocator", "current_stream_reader"]

_TABLES: dict = {}
_MAX_ENTRIES = 512


def fast_table(name: str) -> dict:
    """The (process-wide) table of one operation."""
    return _TABLES.setdefault(name, {})


def register_fast(table: dict, key, call):
    """Record ``call`` under ``key`` (a call signature from ``call_key``)."""
    if len(table) >= _MAX_ENTRIES:
        table.clear()
    table[key] = call


def _torch_geometry(x):
    # requires_grad too: validation refuses such tensors (nothing here carries gradients), so
    # a call with them must not match a call recorded without.
    return (x.shape, x.stride(), x.dtype, x.get_device(), x.requires_grad)


def _cupy_geometry(x):
    return (x.shape, x.strides, x.dtype, x.data.device_id)


_GEOMETRY: dict = {}
_POINTER: dict = {}


def _learn_type(t):
    """Register the geometry / pointer readers of a CuPy or torch array type."""
    root = array_library(t)
    if root == "torch":         # the tensor type's own data_ptr, called unbound: the cheapest
        _GEOMETRY[t], _POINTER[t] = _torch_geometry, t.data_ptr
    elif root == "cupy":
        _GEOMETRY[t], _POINTER[t] = _cupy_geometry, lambda x: x.data.ptr
    else:
        _GEOMETRY[t] = _POINTER[t] = None


def geometry_reader(t):
    """The geometry function of array type ``t`` (CuPy / torch), else None."""
    if t not in _GEOMETRY:
        _learn_type(t)
    return _GEOMETRY[t]


def geometry_of(x):
    """(shape, strides, dtype, device) of a CuPy array or torch tensor; None for other kinds
    (and for None)."""
    if x is None:
        return None
    t = type(x)
    if t not in _GEOMETRY:
        _learn_type(t)
    reader = _GEOMETRY[t]
    return None if reader is None else reader(x)


def pointer_of(x) -> int:
    """Data pointer of a CuPy array or torch tensor."""
    return _POINTER[type(x)](x)


def call_key(name, arrays, options):
    """The signature of a call: ``arrays`` (positional device arrays) by geometry, ``options``
    (a tuple of keyword values: numbers, bools, None, tuples, or device arrays, replaced by
    their geometry); None when some value has no cheap signature (the call then takes the
    full path)."""
    parts = [name, type(arrays[0])]
    for x in arrays:
        g = geometry_of(x)
        if g is None:
            return None
        parts.append(g)
    for value in options:
        if isinstance(value, np.generic):           # NumPy scalars by value, not by id
            value = value.item()
        if value is None or isinstance(value, (bool, int, float, str, tuple)):
            parts.append(value)
        elif type(value) is list:
            parts.append(tuple(value))
        elif isinstance(value, np.ndarray):
            if value.size > 16:                     # a large host array: no cheap signature
                return None
            parts.append(("host", value.dtype.str, value.shape, tuple(value.ravel().tolist())))
        else:
            # Device arrays by geometry; any other object (a mask, a score_mod) by identity:
            # the recorded call must hold it among its guards, so that its id is not reused.
            g = geometry_of(value)
            parts.append(("array", g) if g is not None else ("object", id(value)))
    return tuple(parts)


class FastCall:
    """What a repeated call needs: the plan, the outputs to allocate, the device, the
    alignment of the inputs' pointers, and the objects keyed by identity (``guards``)."""

    def __init__(self, plan, kind, like, device, out_shape, out_dtype, lse_shape, extras,
                 guards=(), order=None, align=0):
        self.plan, self.device, self.guards = plan, device, guards
        self.align = align            # the inputs' pointers must clear these bits (15: 16 bytes)
        self.order = order            # None: pointers in the order inputs, out, lse, extras
        self.n_extras = len(extras)
        self.pointer = _fast_pointer(like)
        self.current_device = device_reader(type(like))
        self.new_out, self.new_lse, self.stream = _allocators(kind, like, out_shape, out_dtype,
                                                              lse_shape)

    def run(self, arrays, extras, guards, stream):
        """Launch on ``arrays`` (the inputs: q, k, v; merge_states' o, lse) and ``extras`` (the
        caller's other device arrays, in plan order); None when this call cannot take the fast
        path after all."""
        for given, recorded in zip(guards, self.guards):
            if given is not recorded:
                return None
        if self.current_device() != self.device:
            return None
        pointer = self.pointer
        ptrs = [pointer(x) for x in arrays]
        if self.align and (ptrs[0] | ptrs[1] | ptrs[2]) & self.align:
            return None          # the full path raises the alignment error
        out = self.new_out()
        ptrs.append(pointer(out))
        lse = None
        if self.new_lse is not None:
            lse = self.new_lse()
            ptrs.append(pointer(lse))
        for x in extras:
            ptrs.append(pointer(x))
        if self.order is not None:
            ptrs = [ptrs[i] for i in self.order]
        self.plan.launch(ptrs, self.stream() if stream is None else stream_handle(stream))
        return out if lse is None else (out, lse)


def _fast_pointer(like):
    """The data-pointer reader for arrays of ``like``'s type."""
    t = type(like)
    if t not in _POINTER:
        _learn_type(t)
    return _POINTER[t]


def device_reader(t):
    """A function returning the calling thread's current device ordinal, through the array
    library of type ``t`` when it has a direct binding (CuPy's cudaGetDevice, torch's), else
    through the driver (launch/driver.py)."""
    root = array_library(t)
    if root == "cupy":
        import cupy

        return cupy.cuda.runtime.getDevice
    if root == "torch":
        import torch

        return getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
    return current_device


def capture_reader(t):
    """A function of a raw stream handle telling whether that stream, the current stream of
    array type ``t``'s library, is being captured into a CUDA graph (torch's and CuPy's own
    bindings; else the driver's)."""
    root = array_library(t)
    if root == "cupy":
        import cupy

        is_capturing = cupy.cuda.runtime.streamIsCapturing
        return lambda handle: is_capturing(handle) != 0
    if root == "torch":
        import torch

        current = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)
        if current is not None:
            return lambda handle: current()
    return stream_is_capturing


def current_stream_of(x) -> int:
    """Raw handle of the current stream of x's library on x's device (CuPy / torch)."""
    reader = _STREAM_READERS.get(type(x))
    if reader is None:
        reader = _STREAM_READERS[type(x)] = _stream_reader(type(x))
    return reader(x)


_STREAM_READERS: dict = {}


def _stream_reader(t):
    """The current-stream reader for arrays of type ``t`` (imports done once, not per call)."""
    if array_library(t) == "torch":
        from .streams import torch_current_stream

        return lambda x: torch_current_stream(x.get_device())
    import cupy

    current = cupy.cuda.get_current_stream
    return lambda x: current().ptr


def stream_handle(stream) -> int:
    """Raw handle of an explicit stream argument (see streams.raw_stream_handle)."""
    return raw_stream_handle(stream, None, None)


def _allocators(kind, like, out_shape, out_dtype, lse_shape):
    """(new_out, new_lse or None, current stream) callables for the caller's library (bound
    once: a call pays the allocator itself, no wrapper frames). The outputs are uninitialised
    (the varlen kernels write the rows no sequence owns themselves)."""
    wide = str(like.dtype).replace("torch.", "") == "float64"
    new_out = array_allocator(kind, like, out_shape, like.dtype)
    new_lse = array_allocator(kind, like, lse_shape, "float64" if wide else "float32") \
        if lse_shape is not None else None
    return new_out, new_lse, current_stream_reader(kind, like)


def array_allocator(kind, like, shape, dtype):
    """A no-argument function returning an uninitialised C-contiguous array of ``shape`` and
    ``dtype`` (a torch dtype, or anything NumPy reads as one) from the caller's allocator
    (``kind`` "torch" or "cupy"), on ``like``'s device."""
    if kind == "torch":
        import torch

        if not isinstance(dtype, torch.dtype):
            dtype = getattr(torch, np.dtype(dtype).name)
        # Tensor.new_empty on an empty template of the dtype and device: no keyword parsing
        # (2.8 us against torch.empty's 3.6 on the H200's host).
        template = torch.empty(0, dtype=dtype, device=like.device)
        return functools.partial(template.new_empty, shape)
    import cupy

    return functools.partial(cupy.ndarray, shape, dtype)


def current_stream_reader(kind, like):
    """A no-argument function returning the raw handle of the caller's current stream (torch:
    on ``like``'s device; CuPy: its current device's)."""
    if kind == "torch":
        import torch

        index = like.device.index
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        return functools.partial(raw, index) if raw is not None else \
            (lambda: torch.cuda.current_stream(index).cuda_stream)
    import cupy

    return lambda: cupy.cuda.get_current_stream().ptr
