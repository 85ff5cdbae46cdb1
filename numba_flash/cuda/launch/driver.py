"""Launching compiled kernels through the CUDA driver API, with the host work done once.

A ``LaunchPlan`` is one kernel configuration ready to go: the driver handle of the compiled
kernel, grid, block, dynamic shared memory, and Numba's flattened parameter block (an array
argument is meminfo, parent, size, itemsize, data pointer, shape..., strides...; scalars follow
as int64 / float32 / float64). The parameters sit in one packed buffer at the offsets the driver
reports for the kernel (cuFuncGetParamInfo, read once per kernel; natural alignment on drivers
older than 12.4, which lack it), handed to ``cuLaunchKernel`` as its ``extra``
(CU_LAUNCH_PARAM_BUFFER_POINTER): one copy, where an array of one pointer per parameter has the
driver copy ~130 parameters one by one. A call writes only the data pointers of the caller's
arrays into their places and calls ``cuLaunchKernel`` through ctypes: no argument typing, no
Numba device-array wrappers, no allocation. The driver copies the parameters at launch, so the
buffer is free again when the call returns. The library's plan caches are per process, so threads share
plans: a plan's lock spans writing the pointers and the driver call (ctypes releases the
interpreter lock during the call, when another thread could otherwise overwrite them).

Kernels are compiled (or loaded: from their image on disk, images.py, else from Numba's
on-disk cache) by ``compile_kernel`` for an explicit signature. Numba and cuda.core load them
as CUkernels (context-independent handles); a plan launches the CUfunction the driver resolves
for the current (primary) context once, at the plan's creation, instead of the CUkernel, which
the driver resolves again at every launch. So the callers check that the arrays' device is the
current one; CuPy, PyTorch and Numba all work in primary contexts. A CUfunction belongs to its
context: after a device reset (a new primary context) the recorded plans and their functions
are stale, as Numba's own compiled kernels are. Together the two cut a launch
on the lent H200's host from ~8.7 to ~6.9 us (an empty kernel: ~7.1; 2026-11-27,
scripts/experiments/launch_cost.py).
"""
from __future__ import annotations

import ctypes
import functools
import threading

from numba.cuda import types

from ..primitives import SIMULATOR

__all__ = ["ArrayParam", "ScalarParam", "LaunchPlan", "LaunchError", "compile_kernel",
           "raise_dynamic_smem_limit", "current_device", "stream_is_capturing", "memset32_async",
           "output_clearer"]

_CU_LAUNCH_PARAM_END, _CU_LAUNCH_PARAM_BUFFER_POINTER, _CU_LAUNCH_PARAM_BUFFER_SIZE = 0, 1, 2
_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


class LaunchError(RuntimeError):
    """A driver call of the launch path failed (its CUresult is in the message)."""


class ArrayParam:
    """A kernel array argument: ``numba_type`` (a ``types.Array``), shape and byte strides as
    the kernel indexes it, itemsize, and ``ptr``: a fixed data pointer (library-owned arrays:
    placeholders, mask tables, counters) or None when each call supplies it."""

    __slots__ = ("numba_type", "shape", "strides", "itemsize", "ptr")

    def __init__(self, elem_type, shape, strides, itemsize, ptr=None):
        shape, strides = tuple(int(n) for n in shape), tuple(int(s) for s in strides)
        size, expect, contiguous = 1, itemsize, True
        for n, st in zip(reversed(shape), reversed(strides)):
            size *= n
            if n != 1:               # size-1 axes do not break contiguity (as Numba reads it)
                contiguous = contiguous and st == expect
                expect *= n
        self.numba_type = types.Array(elem_type, len(shape), "C" if contiguous else "A")
        self.shape, self.strides, self.itemsize, self.ptr = shape, strides, itemsize, ptr

    def flat(self):
        """Numba's flattened parameters with the data pointer 0 when the call supplies it."""
        size = 1
        for n in self.shape:
            size *= n
        return [0, 0, size, self.itemsize, self.ptr or 0, *self.shape, *self.strides]


class ScalarParam:
    """A scalar kernel argument: a Numba type among int64, float32, float64, and its value."""

    __slots__ = ("numba_type", "value")

    def __init__(self, numba_type, value):
        self.numba_type, self.value = numba_type, value


_DRIVER = {}


def _driver():
    """libcuda's launch entry points through ctypes, loaded once. ``launch`` is a second
    handle of cuLaunchKernel without declared argument types: a plan passes it ready-made
    ctypes values, which ctypes forwards without converting."""
    if not _DRIVER:
        lib = ctypes.CDLL("libcuda.so.1")
        vp, u32 = ctypes.c_void_p, ctypes.c_uint
        lib.cuLaunchKernel.argtypes = [vp, u32, u32, u32, u32, u32, u32, u32, vp, vp, vp]
        lib.cuLaunchKernel.restype = ctypes.c_int
        lib.cuCtxGetDevice.argtypes = [ctypes.POINTER(ctypes.c_int)]
        lib.cuCtxGetDevice.restype = ctypes.c_int
        lib.cuStreamIsCapturing.argtypes = [vp, ctypes.POINTER(ctypes.c_int)]
        lib.cuStreamIsCapturing.restype = ctypes.c_int
        size = ctypes.c_size_t
        lib.cuMemsetD32Async.argtypes = [ctypes.c_uint64, u32, size, vp]
        lib.cuMemsetD32Async.restype = ctypes.c_int
        lib.cuMemsetD2D32Async.argtypes = [ctypes.c_uint64, size, u32, size, size, vp]
        lib.cuMemsetD2D32Async.restype = ctypes.c_int
        untyped = ctypes.CDLL("libcuda.so.1")
        launch = untyped.cuLaunchKernel
        launch.restype = ctypes.c_int
        _DRIVER.update(lib=lib, device=ctypes.c_int(), capturing=ctypes.c_int(), launch=launch,
                       memset32=lib.cuMemsetD32Async,
                       memset2d32=lib.cuMemsetD2D32Async, function=_context_function,
                       param_layout=_param_layout)
    return _DRIVER


_FUNCTIONS: dict = {}       # (CUkernel handle, device) -> CUfunction of its primary context
_LAYOUTS: dict = {}         # CUfunction -> [(offset, size)] of its parameters


def _context_function(kernel_handle) -> int:
    """The CUfunction of a CUkernel in the current context (cuKernelGetFunction, once per
    kernel and device: the backward builds its plans at every call); a CUfunction handle is
    returned as it is."""
    from cuda.bindings import driver as cu

    if isinstance(kernel_handle, cu.CUfunction):
        return int(kernel_handle)
    key = (int(kernel_handle), current_device())
    function = _FUNCTIONS.get(key)
    if function is None:
        err, handle = cu.cuKernelGetFunction(cu.CUkernel(key[0]))
        if err != cu.CUresult.CUDA_SUCCESS:
            raise LaunchError(f"cuKernelGetFunction failed: {err!r}")
        function = _FUNCTIONS[key] = int(handle)
    return function


def _param_layout(function: int, sizes: list) -> list:
    """[(offset, size)] in bytes of a CUfunction's parameters, whose sizes the plan holds as
    ``sizes``: as the driver lays them out (cuFuncGetParamInfo, CUDA 12.4 and later; read once
    per kernel), else each at its natural alignment (how NVVM lays out kernel parameters).
    LaunchError when the driver reports another parameter count or a failure."""
    layout = _LAYOUTS.get(function)
    if layout is None:
        layout = _LAYOUTS[function] = _driver_layout(function, len(sizes))
    if layout is None:
        return natural_layout(sizes)
    if len(layout) != len(sizes):
        raise LaunchError(f"the kernel takes {len(layout)} parameters (cuFuncGetParamInfo), "
                          f"the plan holds {len(sizes)}")
    return layout


def _driver_layout(function: int, count: int):
    """The driver's [(offset, size)] of a CUfunction's parameters (up to ``count`` + 1 asked:
    a longer list reveals a mismatch), or None where the driver cannot tell (older than 12.4)."""
    from cuda.bindings import driver as cu

    query = getattr(cu, "cuFuncGetParamInfo", None)
    if query is None:
        return None
    handle, layout = cu.CUfunction(function), []
    for index in range(count + 1):
        err, offset, size = query(handle, index)
        if err != cu.CUresult.CUDA_SUCCESS:
            if index == 0 and err == cu.CUresult.CUDA_ERROR_NOT_SUPPORTED:
                return None
            if index == count or err == cu.CUresult.CUDA_ERROR_INVALID_VALUE:
                break                                   # past the last parameter
            raise LaunchError(f"cuFuncGetParamInfo failed for parameter {index}: {err!r}")
        layout.append((int(offset), int(size)))
    return layout


def natural_layout(sizes) -> list:
    """[(offset, size)] of parameters of ``sizes`` bytes, each at its natural alignment."""
    layout, offset = [], 0
    for size in sizes:
        offset = -(-offset // size) * size
        layout.append((offset, size))
        offset += size
    return layout


def current_device() -> int:
    """Ordinal of the calling thread's current device; -1 when no context is current."""
    if SIMULATOR:
        return 0
    d = _driver()
    if d["lib"].cuCtxGetDevice(ctypes.byref(d["device"])):
        return -1
    return d["device"].value


def stream_is_capturing(stream: int) -> bool:
    """Whether the stream of raw handle ``stream`` is being captured into a CUDA graph."""
    d = _driver()
    err = d["lib"].cuStreamIsCapturing(stream, ctypes.byref(d["capturing"]))
    if err:
        raise LaunchError(f"cuStreamIsCapturing failed: CUresult {err}")
    return d["capturing"].value != 0     # CU_STREAM_CAPTURE_STATUS_NONE is 0


def memset32_async(ptr: int, word: int, count: int, stream: int):
    """Set ``count`` 32-bit words from device address ``ptr`` (4-byte aligned) to ``word``,
    enqueued on the stream of raw handle ``stream`` (cuMemsetD32Async: ordered with the
    kernels launched there after it, and recorded as a memset node inside a graph capture)."""
    err = _driver()["memset32"](ptr, word, count, stream)
    if err:
        raise LaunchError(f"cuMemsetD32Async failed with CUresult {err} ({count} words of "
                          f"{word:#010x} at {ptr:#x})")


def _memset_strided32_async(ptr: int, pitch: int, word: int, count: int, stream: int):
    """Set one 32-bit word every ``pitch`` bytes, ``count`` times from ``ptr``, to ``word``
    (cuMemsetD2D32Async with rows of one word), on the stream of raw handle ``stream``."""
    err = _driver()["memset2d32"](ptr, pitch, word, 1, count, stream)
    if err:
        raise LaunchError(f"cuMemsetD2D32Async failed with CUresult {err} ({count} words of "
                          f"{word:#010x} every {pitch} bytes at {ptr:#x})")


NEG_INF_F32 = 0xFF800000            # float32 -inf's bits
NEG_INF_F64_HIGH = 0xFFF00000       # the high (second, little-endian) word of float64 -inf's


def output_clearer(out_nbytes: int, lse_nbytes: int = 0, lse_itemsize: int = 4):
    """``clear(out_ptr, lse_ptr, stream)``: enqueue on the stream of raw handle ``stream`` the
    memsets that set an output of ``out_nbytes`` to zeros and an lse of ``lse_nbytes`` (float32
    or, ``lse_itemsize`` 8, float64; 0: none) to -inf, for the rows no kernel block writes
    (packed varlen batches). On the launch's own stream, before the launch: no library fill
    kernel on the library's current stream. Sizes must be multiples of 4 bytes."""
    if out_nbytes % 4 or lse_nbytes % 4:
        raise ValueError(f"outputs of {out_nbytes} / {lse_nbytes} bytes are not 32-bit words")
    out_words, lse_words = out_nbytes // 4, lse_nbytes // 4
    f64 = lse_itemsize == 8     # float64 -inf: low words 0, high words 0xFFF00000

    def clear(out_ptr: int, lse_ptr: int, stream: int):
        if out_words:
            memset32_async(out_ptr, 0, out_words, stream)
        if lse_words:
            memset32_async(lse_ptr, 0 if f64 else NEG_INF_F32, lse_words, stream)
            if f64:
                _memset_strided32_async(lse_ptr + 4, 8, NEG_INF_F64_HIGH, lse_words // 2,
                                        stream)
    return clear


_LOADED: dict = {}       # (id(dispatcher), signature, cc) -> images.LoadedKernel


def compile_kernel(dispatcher, params):
    """Compile ``dispatcher`` for the types of ``params`` (ArrayParam / ScalarParam, in kernel
    order), or load it: from this process's earlier compilation, else from its image on disk
    (images.py: no Numba initialisation), else through Numba (its disk cache or a compilation,
    after which the image is written). Returns an object whose ``.handle`` is the driver
    handle and ``.kernel`` cuda.core's kernel."""
    sig = types.void(*(p.numba_type for p in params))
    compiled = dispatcher.overloads.get(sig.args)
    if compiled is not None:
        return compiled._codelibrary.get_cufunc()
    from . import images
    from .device import compute_capability, current_device_id

    cc = compute_capability(current_device_id())
    loaded = _LOADED.get((id(dispatcher), sig, cc))
    if loaded is not None:
        return loaded
    path = images.image_path(dispatcher, sig, cc)
    if path is not None:
        loaded = images.load_image(dispatcher, path)
        if loaded is not None:
            _LOADED[(id(dispatcher), sig, cc)] = loaded
            return loaded
    compiled = dispatcher.compile(sig)
    if path is not None:
        images.store_image(dispatcher, path, compiled)
    return compiled._codelibrary.get_cufunc()


def raise_dynamic_smem_limit(handle, nbytes: int, device_id: int):
    """Allow ``nbytes`` of dynamic shared memory per block for a kernel (a CUkernel or
    CUfunction handle) on one device (the default limit is 48 KB)."""
    from cuda.bindings import driver as cu

    attr = cu.CUfunction_attribute(_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES)
    if isinstance(handle, cu.CUfunction):
        err, = cu.cuFuncSetAttribute(handle, attr, int(nbytes))
    else:
        err, = cu.cuKernelSetAttribute(attr, int(nbytes), handle, cu.CUdevice(device_id))
    if err != cu.CUresult.CUDA_SUCCESS:
        raise LaunchError(f"setting the kernel's dynamic shared memory to {nbytes} bytes "
                          f"failed: {err!r}")


def kernel_registers(handle, device_id: int) -> int:
    """Registers per thread of a kernel (a CUkernel or CUfunction handle) as the driver loaded
    it; -1 where the driver does not say."""
    from cuda.bindings import driver as cu

    attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NUM_REGS
    if isinstance(handle, cu.CUfunction):
        err, n = cu.cuFuncGetAttribute(attr, handle)
    else:
        err, n = cu.cuKernelGetAttribute(attr, handle, cu.CUdevice(device_id))
    return int(n) if err == cu.CUresult.CUDA_SUCCESS else -1


class LaunchPlan:
    """One kernel configuration ready to launch (see the module docstring).

    ``cufunc``: ``compile_kernel``'s result; ``params``: ArrayParam / ScalarParam in kernel
    order (the ArrayParams with ``ptr`` None are the caller's, filled per call in their order);
    ``keep``: objects the fixed pointers belong to, kept alive with the plan.
    """

    def __init__(self, cufunc, params, grid, block, smem=0, keep=()):
        driver = _driver()
        sized_bits, pointer_params = _flat_values(params)
        self.func = driver["function"](cufunc.handle)
        layout = driver["param_layout"](self.func, [size for size, _ in sized_bits])
        self.values, self.slots, self._extra, self._size = _packed(sized_bits, layout,
                                                                   pointer_params)
        self.cufunc, self.keep = cufunc, keep
        grid = (grid,) if isinstance(grid, int) else grid
        self.grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
        self.block, self.smem = int(block), int(smem)
        self._lock = threading.Lock()
        # The call's constant arguments as ctypes values, bound once: per call only the
        # stream changes (cuLaunchKernel's argument conversion was a third of a call's time).
        self._stream = ctypes.c_void_p(0)       # the one argument a call changes
        dims = (ctypes.c_uint(n) for n in (*self.grid, self.block, 1, 1, self.smem))
        self._call = functools.partial(driver["launch"], ctypes.c_void_p(self.func), *dims,
                                       self._stream, None, self._extra)

    def launch(self, pointers, stream: int):
        """Launch on the stream of raw handle ``stream`` with the caller arrays' data
        ``pointers`` (ints, in the order of their ArrayParams)."""
        values = self.values
        with self._lock:
            for slot, ptr in zip(self.slots, pointers):
                values[slot] = ptr
            self._stream.value = stream
            err = self._call()
        if err:
            raise LaunchError(f"cuLaunchKernel failed with CUresult {err} (grid {self.grid}, "
                              f"block {self.block}, dynamic shared memory {self.smem} bytes)")


def _flat_values(params):
    """Numba's flattened kernel parameters as (size in bytes, unsigned bits) pairs, and the
    indices among them of the caller arrays' data pointers."""
    values, pointer_params = [], []
    for p in params:
        if isinstance(p, ArrayParam):
            if p.ptr is None:
                pointer_params.append(len(values) + 4)      # the data pointer's place
            values.extend((8, x & 0xFFFFFFFFFFFFFFFF) for x in p.flat())
        elif p.numba_type == types.float32:
            values.append((4, ctypes.c_uint32.from_buffer(ctypes.c_float(p.value)).value))
        elif p.numba_type == types.float64:
            values.append((8, ctypes.c_uint64.from_buffer(ctypes.c_double(p.value)).value))
        else:
            values.append((8, int(p.value) & 0xFFFFFFFFFFFFFFFF))
    return values, pointer_params


def _packed(sized_bits, layout, pointer_params):
    """(buffer, pointer slots, extra, size): the parameters written at the driver's ``layout``
    into a buffer of 8-byte words, the word index of each caller data pointer, cuLaunchKernel's
    ``extra`` array naming the buffer and the address of its ``size`` (a c_size_t the plan
    keeps alive); extra and size None for a kernel without parameters."""
    if len(layout) != len(sized_bits):
        raise LaunchError(f"{len(layout)} parameter offsets for {len(sized_bits)} parameters")
    total = max((offset + size for offset, size in layout), default=0)
    words = (ctypes.c_uint64 * max(-(-total // 8), 1))()
    for (size, bits), (offset, driver_size) in zip(sized_bits, layout):
        if size != driver_size or offset % size:
            raise LaunchError(f"parameter at byte {offset}: the driver expects {driver_size} "
                              f"bytes, the plan holds {size}")
        (ctypes.c_uint64 if size == 8 else ctypes.c_uint32).from_buffer(words, offset).value = bits
    slots = [layout[i][0] // 8 for i in pointer_params]
    if not total:
        return words, slots, None, None
    size = ctypes.c_size_t(total)
    extra = (ctypes.c_void_p * 5)(_CU_LAUNCH_PARAM_BUFFER_POINTER, ctypes.addressof(words),
                                  _CU_LAUNCH_PARAM_BUFFER_SIZE, ctypes.addressof(size),
                                  _CU_LAUNCH_PARAM_END)
    return words, slots, extra, size
