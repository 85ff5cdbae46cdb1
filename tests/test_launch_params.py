"""The launch plan's parameter block and driver calls, checked without a GPU.

``LaunchPlan`` (numba_flash/cuda/launch/driver.py) lays out Numba's flattened kernel
arguments (an array: meminfo, parent, size, itemsize, data, shape..., strides...; scalars as
int64 / float32 / float64 bits) in one packed buffer at the driver's offsets and writes only
the caller arrays' data pointers per call. Here libcuda is replaced by a recorder, so the block
and the launch arguments are compared with the layout written out by hand, and the memsets that
clear a packed
varlen batch's outputs are checked for their place (the launch's stream, before it) and values.
"""
from __future__ import annotations

import ctypes
import struct

import pytest
from numba.cuda import types

from numba_flash.cuda.launch import driver
from numba_flash.cuda.launch.driver import ArrayParam, LaunchPlan, ScalarParam


class _Recorder:
    """Stands for libcuda: records cuLaunchKernel / cuMemsetD32Async /
    cuMemsetD2D32Async calls, in order."""

    def __init__(self):
        self.calls = []

    def cuLaunchKernel(self, func, gx, gy, gz, bx, by, bz, smem, stream, argv, extra):  # noqa: N802
        gx, gy, gz, bx, by, bz, smem = (_value(x) for x in (gx, gy, gz, bx, by, bz, smem))
        assert argv is None
        self.calls.append(("plain", _value(func), (gx, gy, gz), (bx, by, bz), smem,
                           _value(stream), _buffer(extra)))
        return 0

    def cuMemsetD32Async(self, ptr, word, count, stream):  # noqa: N802
        self.calls.append(("memset32", ptr, word, count, stream))
        return 0

    def cuMemsetD2D32Async(self, ptr, pitch, word, width, height, stream):  # noqa: N802
        self.calls.append(("memset2d32", ptr, pitch, word, width, height, stream))
        return 0


def _value(x):
    """The number a ctypes argument carries (plans pass ready-made ctypes values)."""
    return getattr(x, "value", x)


def _buffer(extra):
    """The parameter bytes cuLaunchKernel's ``extra`` names (BUFFER_POINTER, pointer,
    BUFFER_SIZE, pointer to the size, END), as the driver reads them; None for no extra."""
    if extra is None:
        return None
    assert (extra[0], extra[2], extra[4]) == (1, 2, None)
    size = ctypes.c_size_t.from_address(extra[3]).value
    return ctypes.string_at(extra[1], size)




class _Func:
    handle = 0xABC


@pytest.fixture
def recorder(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(driver, "_DRIVER", {
        "lib": rec, "launch": lambda *args: rec.cuLaunchKernel(*args),
        "memset32": lambda *args: rec.cuMemsetD32Async(*args),
        "memset2d32": lambda *args: rec.cuMemsetD2D32Async(*args),
        "function": lambda handle: handle + 1,
        "param_layout": lambda function, sizes: driver.natural_layout(sizes)})
    return rec


def _words(plan):
    return list(plan.values)


def test_parameter_block_layout(recorder):
    q = ArrayParam(types.uint32, (2, 200, 4, 32), (102400, 512, 128, 4), 4)          # caller
    lse = ArrayParam(types.float32, (1, 1, 1), (4, 4, 4), 4, ptr=0)                  # unused
    table = ArrayParam(types.int32, (3, 5), (20, 4), 4, ptr=0x7000)                  # fixed
    params = [q, lse, ScalarParam(types.int64, -1), ScalarParam(types.float32, 0.5),
              ScalarParam(types.float64, -2.0), table]
    plan = LaunchPlan(_Func(), params, (7, 16), 128, smem=1024)
    f32 = struct.unpack("<I", struct.pack("<f", 0.5))[0]
    f64 = struct.unpack("<Q", struct.pack("<d", -2.0))[0]
    assert _words(plan) == [0, 0, 2 * 200 * 4 * 32, 4, 0, 2, 200, 4, 32, 102400, 512, 128, 4,
                            0, 0, 1, 4, 0, 1, 1, 1, 4, 4, 4,
                            2 ** 64 - 1, f32, f64,       # float32: 4 bytes, then 4 of padding
                            0, 0, 15, 4, 0x7000, 3, 5, 20, 4]
    assert plan.slots == [4]
    assert q.numba_type == types.Array(types.uint32, 4, "C")
    assert ArrayParam(types.uint32, (2, 3), (4, 32), 4).numba_type.layout == "A"   # transposed
    assert ArrayParam(types.float32, (1, 3), (999, 4), 4).numba_type.layout == "C"  # size-1 axis


def test_float32_parameters_pack_at_the_drivers_offsets(recorder):
    """Two float32 scalars share one 8-byte word; the array after them starts at the next word
    (the driver's layout, here natural alignment); the launch hands the driver exactly the
    parameter bytes."""
    params = [ScalarParam(types.float32, 1.0), ScalarParam(types.float32, -3.0),
              ArrayParam(types.float32, (4,), (4,), 4), ScalarParam(types.float32, 2.0)]
    plan = LaunchPlan(_Func(), params, (1,), 32)
    plan.launch([0x1234], stream=3)
    expected = struct.pack("<ff", 1.0, -3.0) + struct.pack("<7q", 0, 0, 4, 4, 0x1234, 4, 4) + \
        struct.pack("<f", 2.0)
    assert recorder.calls[-1][-1] == expected
    assert plan.slots == [1 + 4]


def test_a_layout_the_plan_does_not_match_raises(recorder, monkeypatch):
    monkeypatch.setitem(driver._DRIVER, "param_layout", lambda function, sizes: [(0, 4)])
    with pytest.raises(driver.LaunchError, match="driver expects 4 bytes, the plan holds 8"):
        LaunchPlan(_Func(), [ScalarParam(types.int64, 1)], (1,), 32)


def test_a_kernel_without_parameters_gets_no_buffer(recorder):
    plan = LaunchPlan(_Func(), [], (1,), 32)
    plan.launch([], stream=9)
    assert recorder.calls[-1][-1] is None          # extra is NULL


def test_param_layout_from_the_driver_once_else_natural(monkeypatch):
    """driver._param_layout: the driver's offsets, asked once per kernel; past the last
    parameter the driver answers CUDA_ERROR_INVALID_VALUE; another count is a LaunchError;
    a driver without cuFuncGetParamInfo (older than 12.4) gives natural alignment; any other
    error is raised."""
    import cuda.bindings.driver as cu

    asked = []

    def info(handle, index):
        asked.append(index)
        if index < 3:
            return cu.CUresult.CUDA_SUCCESS, (0, 4, 8)[index], (4, 4, 8)[index]
        return cu.CUresult.CUDA_ERROR_INVALID_VALUE, 0, 0

    monkeypatch.setattr(cu, "cuFuncGetParamInfo", info)
    monkeypatch.setattr(driver, "_LAYOUTS", {})
    assert driver._param_layout(77, [4, 4, 8]) == [(0, 4), (4, 4), (8, 8)]
    assert driver._param_layout(77, [4, 4, 8]) == [(0, 4), (4, 4), (8, 8)]
    assert asked == [0, 1, 2, 3]                    # once, one index past the last
    with pytest.raises(driver.LaunchError, match="takes 3 parameters.*holds 2"):
        driver._param_layout(77, [4, 4])
    monkeypatch.setattr(cu, "cuFuncGetParamInfo",
                        lambda handle, index: (cu.CUresult.CUDA_ERROR_NOT_SUPPORTED, 0, 0))
    assert driver._param_layout(78, [4, 8, 4]) == [(0, 4), (8, 8), (16, 4)]
    monkeypatch.setattr(cu, "cuFuncGetParamInfo",
                        lambda handle, index: (cu.CUresult.CUDA_ERROR_INVALID_CONTEXT, 0, 0))
    with pytest.raises(driver.LaunchError, match="cuFuncGetParamInfo failed for parameter 0"):
        driver._param_layout(79, [8])


def test_launch_writes_pointers_and_pads_the_grid(recorder):
    params = [ArrayParam(types.float32, (4,), (4,), 4), ArrayParam(types.float32, (4,), (4,), 4),
              ScalarParam(types.int64, 3)]
    plan = LaunchPlan(_Func(), params, (5,), 64)
    plan.launch([0x1000, 0x2000], stream=77)
    plan.launch([0x3000, 0x4000], stream=78)
    assert _words(plan)[4] == 0x3000 and _words(plan)[4 + 7] == 0x4000
    kind, func, grid, block, smem, stream, buffer = recorder.calls[-1]
    assert (kind, func, grid, block, smem, stream) == ("plain", 0xABD, (5, 1, 1), (64, 1, 1), 0,
                                                       78)     # the context's CUfunction
    assert buffer == bytes(plan.values)


def test_a_failed_launch_raises(recorder, monkeypatch):
    plan = LaunchPlan(_Func(), [ScalarParam(types.int64, 1)], (1,), 32)
    monkeypatch.setattr(recorder, "cuLaunchKernel", lambda *args: 701)
    with pytest.raises(driver.LaunchError, match="CUresult 701"):
        plan.launch([], stream=0)


class _CAI:
    """A device array seen only through ``__cuda_array_interface__`` (as Numba's are)."""

    def __init__(self, typestr, shape, strides=None, ptr=0x8000):
        self.__cuda_array_interface__ = {"typestr": typestr, "shape": shape, "strides": strides,
                                         "data": (ptr, False), "version": 3}


def test_caller_and_fixed_array_params():
    """The runtime's one description of kernel arrays (attention, decode, merge): a fixed
    (library-owned) array keeps its pointer, a caller array gets a slot; 16-bit data is seen as
    uint32 words; a packed varlen array gains a leading batch axis of stride 0."""
    from numba_flash.cuda.launch.arrays import caller_param, fixed_param

    table = fixed_param(_CAI("<i4", (3, 5)))
    assert (table.numba_type, table.shape, table.strides, table.ptr) == (
        types.Array(types.int32, 2, "C"), (3, 5), (20, 4), 0x8000)
    words = caller_param(_CAI("<u2", (2, 7, 4, 64), (3584, 512, 128, 2)), "cai", words=True)
    assert words.numba_type == types.Array(types.uint32, 4, "C") and words.ptr is None
    assert words.shape == (2, 7, 4, 32) and words.strides == (3584, 512, 128, 4)
    packed = caller_param(_CAI("<f4", (9, 2, 8)), "cai", lead=True)
    assert packed.shape == (1, 9, 2, 8) and packed.strides == (0, 64, 32, 4)
    assert packed.numba_type.dtype == types.float32


def _apply_memsets(calls, memory, base):
    """Carry out recorded memsets on ``memory`` (a uint32 NumPy array standing for device
    memory from address ``base``)."""
    for call in calls:
        if call[0] == "memset32":
            _, ptr, word, count, _ = call
            memory[(ptr - base) // 4:(ptr - base) // 4 + count] = word
        elif call[0] == "memset2d32":
            _, ptr, pitch, word, width, height, _ = call
            for row in range(height):
                at = (ptr + row * pitch - base) // 4
                memory[at:at + width] = word


@pytest.mark.parametrize("lse_dtype", ["float32", "float64", None])
def test_output_clearer_sets_zeros_and_minus_infinity(recorder, lse_dtype):
    """driver.output_clearer: out's bytes to 0 and lse to -inf (float32: one 32-bit pattern;
    float64: its low words 0, its high words 0xFFF00000) with 32-bit memsets on the given
    stream."""
    import numpy as np

    out_nbytes, lse_items = 48, 6
    lse_itemsize = np.dtype(lse_dtype).itemsize if lse_dtype else 4
    lse_nbytes = lse_items * lse_itemsize if lse_dtype else 0
    clear = driver.output_clearer(out_nbytes, lse_nbytes, lse_itemsize)
    base, lse_at = 0x10000, 0x10000 + 64
    clear(base, lse_at if lse_dtype else 0, 31)
    assert recorder.calls[0] == ("memset32", base, 0, out_nbytes // 4, 31)
    assert all(call[-1] == 31 for call in recorder.calls)          # the given stream
    memory = np.full(64, 0x7FC00001, np.uint32)                     # NaN bits everywhere
    _apply_memsets(recorder.calls, memory, base)
    assert (memory[:out_nbytes // 4] == 0).all()
    if lse_dtype:
        lse = memory[16:16 + lse_nbytes // 4].view(lse_dtype)
        assert np.isneginf(lse).all() and len(lse) == lse_items
    assert (memory[16 + lse_nbytes // 4:] == 0x7FC00001).all()     # nothing past the arrays
    with pytest.raises(ValueError, match="32-bit words"):
        driver.output_clearer(6)


def test_a_failed_memset_raises(recorder, monkeypatch):
    monkeypatch.setitem(driver._DRIVER, "memset32", lambda *args: 1)
    with pytest.raises(driver.LaunchError, match="cuMemsetD32Async failed with CUresult 1"):
        driver.output_clearer(16)(0x1000, 0, 0)


def test_varlen_outputs_need_no_fill_before_the_launch(recorder, monkeypatch):
    """A packed varlen call on the GPU (first call, then the repeated-call path) allocates out
    and lse uninitialised and only launches, on the given or current stream: the kernels clear
    the rows no sequence owns (test_varlen.py). A launch with no blocks (max_seqlen_q 0) clears
    the outputs with the driver's memsets on the launch stream instead: out to 0, float32 lse to
    -inf (0xFF800000), by the outputs' byte counts. (The library's own fill kernels once ran on
    the library's current stream, unordered with an explicit ``stream=``.)"""
    from test_fastpath import FakeTensor

    from numba_flash.cuda.launch import attention as runtime, fastpath
    from numba_flash.varlen import Varlen

    class Tensor(FakeTensor):
        """Also reads as a torch tensor to arrays.interface."""
        device = type("Device", (), {"index": 0})()

        def element_size(self):
            return 2 if self.dtype == "float16" else 4

    Tensor.__module__ = "torch.fake"
    total_q, heads, dim = 40, 2, 64              # 40 rows, the sequences end at 33
    addresses = iter(range(0x100000, 0x200000, 0x4000))
    allocated = []

    def new(shape, dtype):
        allocated.append(Tensor(shape, next(addresses), dtype))
        return allocated[-1]

    def empty_like_kind(kind, like, shape, name, zero=False, fill=None):
        assert not zero and fill is None         # no library fill on the GPU path
        return new(shape, name)

    def allocators(kind, like, out_shape, out_dtype, lse_shape):
        return (lambda: new(out_shape, "float16")), (lambda: new(lse_shape, "float32")), \
            (lambda: 77)

    def plan(kind, dtype_name, device, p, arrays, stream):
        params = [ArrayParam(types.float32, (4,), (4,), 4) for _ in range(7)]
        return LaunchPlan(_Func(), params, (1, 4), 128)

    monkeypatch.setattr(runtime, "SIMULATOR", False)
    monkeypatch.setattr(runtime, "gpu_inputs", lambda q, k, v, lead: ("torch", "float16", 0, ()))
    monkeypatch.setattr(runtime, "empty_like_kind", empty_like_kind)
    monkeypatch.setattr(runtime, "_plan", plan)
    monkeypatch.setattr(fastpath, "_allocators", allocators)
    monkeypatch.setattr(fastpath, "device_reader", lambda t: lambda: 0)
    q, k, v = (Tensor((total_q, heads, dim), 0x1000 * (i + 1)) for i in range(3))
    cu_q, cu_k = Tensor((3,), 0x8000, "int32"), Tensor((3,), 0x9000, "int32")
    varlen = Varlen(2, cu_q, cu_k, 20, 20, None, None)
    key = ("test-varlen-clear", object())

    def check(out, lse, stream):
        assert len(recorder.calls) == 1, recorder.calls
        launch = recorder.calls[0]
        assert launch[0] == "plain" and launch[5] == stream
        recorder.calls.clear()

    out, lse = runtime.attention_cuda(q, k, v, softmax_scale=0.125, causal=True,
                                      return_lse=True, stream=55, varlen=varlen,
                                      fast=(key, (cu_q, cu_k), (None, None)))
    check(out, lse, 55)
    call = runtime._FAST_CALLS.pop(key)
    out, lse = call.run((q, k, v), (cu_q, cu_k), (None, None), 66)     # an explicit stream
    check(out, lse, 66)
    out, lse = call.run((q, k, v), (cu_q, cu_k), (None, None), None)   # the current stream
    check(out, lse, 77)
    out, lse = runtime.attention_cuda(q, k, v, softmax_scale=0.125, causal=True,
                                      return_lse=True, stream=55,
                                      varlen=Varlen(2, cu_q, cu_k, 0, 20, None, None))
    out_words, lse_words = total_q * heads * dim * 2 // 4, heads * total_q
    assert recorder.calls == [("memset32", out.data_ptr(), 0, out_words, 55),
                              ("memset32", lse.data_ptr(), 0xFF800000, lse_words, 55)]


def test_word_view_zeroes_length_one_strides():
    """The uint32 view of a 16-bit (B, S, H, D) array: pairs along head_dim, and stride 0 on
    length-1 axes whatever their library reported (also the 4-byte check's exemption); any
    other stride that is not a multiple of 4 bytes is refused."""
    from numba_flash.cuda.launch.arrays import as_words

    assert as_words(16, (1, 5, 1, 8), (12345, 32, 999, 2)) == ((1, 5, 1, 4), (0, 32, 0, 4))
    with pytest.raises(ValueError, match="4-byte aligned"):
        as_words(16, (2, 5, 1, 8), (6, 32, 999, 2))


def test_threads_sharing_a_plan_launch_their_own_pointers(monkeypatch):
    """Two threads launch one plan (the plan caches are per process) with their own pointers.
    The stand-in driver call gives the interpreter lock away before it reads the parameters,
    as ctypes does around the real one: each launch must still see its own thread's pointer
    and stream."""
    import threading
    import time

    seen, holder, mine = [], [], threading.local()

    def launch(func, *args):
        time.sleep(0.001)
        plan = holder[0]
        seen.append((mine.ptr, plan.values[plan.slots[0]], plan._stream.value))
        return 0

    monkeypatch.setattr(driver, "_DRIVER", {
        "launch": launch, "function": lambda handle: handle + 1,
        "param_layout": lambda function, sizes: driver.natural_layout(sizes)})
    q = ArrayParam(types.uint32, (4, 8), (32, 4), 4)
    holder.append(LaunchPlan(_Func(), [q], (1,), 32))

    def worker(ptr):
        mine.ptr = ptr
        for _ in range(20):
            holder[0].launch([ptr], ptr + 1)

    threads = [threading.Thread(target=worker, args=(p,)) for p in (0x1000, 0x2000)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(seen) == 40
    assert all(got == own and stream == own + 1 for own, got, stream in seen)
