"""The launch plan's parameter block and driver calls, checked without a GPU.

``LaunchPlan`` (numba_flash/cuda/launch/driver.py) lays out Numba's flattened kernel
arguments (an array: meminfo, parent, size, itemsize, data, shape..., strides...; scalars as
int64 / float32 / float64 bits) in one 8-byte slot each and writes only the caller arrays' data
pointers per call. Here libcuda is replaced by a recorder, so the block and the launch
arguments are compared with the layout written out by hand.
"""
from __future__ import annotations

import ctypes
import struct

import pytest
from numba.cuda import types

from numba_flash.cuda.launch import driver
from numba_flash.cuda.launch.driver import ArrayParam, LaunchPlan, ScalarParam


class _Recorder:
    """Stands for libcuda: records cuLaunchKernel / cuLaunchKernelEx calls."""

    def __init__(self):
        self.calls = []

    def cuLaunchKernel(self, func, gx, gy, gz, bx, by, bz, smem, stream, argv, extra):  # noqa: N802
        gx, gy, gz, bx, by, bz, smem = (_value(x) for x in (gx, gy, gz, bx, by, bz, smem))
        self.calls.append(("plain", _value(func), (gx, gy, gz), (bx, by, bz), smem,
                           _value(stream), argv))
        return 0

    def cuLaunchKernelEx(self, config, func, argv, extra):  # noqa: N802
        func = _value(func)
        cfg = ctypes.cast(config, ctypes.POINTER(driver._LaunchConfig)).contents \
            if isinstance(config, int) else config._obj
        self.calls.append(("ex", func, (cfg.grid_x, cfg.grid_y, cfg.grid_z), cfg.block_x,
                           cfg.smem, cfg.stream, cfg.num_attrs, cfg.attrs[0].id,
                           cfg.attrs[0].value, argv))
        return 0


def _value(x):
    """The number a ctypes argument carries (plans pass ready-made ctypes values)."""
    return getattr(x, "value", x)


class _Func:
    handle = 0xABC


@pytest.fixture
def recorder(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(driver, "_DRIVER", {
        "lib": rec, "launch": lambda *args: rec.cuLaunchKernel(*args),
        "launch_ex": lambda *args: rec.cuLaunchKernelEx(*args)})
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
                            2 ** 64 - 1, f32, f64,
                            0, 0, 15, 4, 0x7000, 3, 5, 20, 4]
    assert plan.slots == [4]
    assert q.numba_type == types.Array(types.uint32, 4, "C")
    assert ArrayParam(types.uint32, (2, 3), (4, 32), 4).numba_type.layout == "A"   # transposed
    assert ArrayParam(types.float32, (1, 3), (999, 4), 4).numba_type.layout == "C"  # size-1 axis


def test_launch_writes_pointers_and_pads_the_grid(recorder):
    params = [ArrayParam(types.float32, (4,), (4,), 4), ArrayParam(types.float32, (4,), (4,), 4),
              ScalarParam(types.int64, 3)]
    plan = LaunchPlan(_Func(), params, (5,), 64)
    plan.launch([0x1000, 0x2000], stream=77)
    plan.launch([0x3000, 0x4000], stream=78)
    assert _words(plan)[4] == 0x3000 and _words(plan)[4 + 7] == 0x4000
    kind, func, grid, block, smem, stream, argv = recorder.calls[-1]
    assert (kind, func, grid, block, smem, stream) == ("plain", 0xABC, (5, 1, 1), (64, 1, 1), 0,
                                                       78)
    base = ctypes.addressof(plan.values)
    assert [argv[i] for i in range(len(plan.values))] == \
        [base + 8 * i for i in range(len(plan.values))]


def test_programmatic_dependent_launch_sets_the_attribute(recorder):
    plan = LaunchPlan(_Func(), [ScalarParam(types.int64, 1)], (3, 2, 1), 32, smem=4096, pdl=True)
    plan.launch([], stream=5)
    kind, func, grid, block, smem, stream, n_attrs, attr_id, value, _ = recorder.calls[-1]
    assert (kind, func, grid, block, smem, stream) == ("ex", 0xABC, (3, 2, 1), 32, 4096, 5)
    assert (n_attrs, attr_id, value) == (1, 6, 1)   # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


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
