"""``arrays.describe`` reads PyTorch CUDA tensors and CuPy arrays from their attributes (the fast
path) instead of their ``__cuda_array_interface__``; both routes must give the same ArrayInfo.

No GPU and no torch needed: stand-ins with the same attributes, whose classes claim the
``torch`` / ``cupy`` modules, also carry the interface the general path reads.
"""
from __future__ import annotations

import numpy as np
import pytest

from numba_flash import arrays
from numba_flash.arrays import ArrayInfo, bfloat16_dtype, describe


class _TorchDtype:
    def __init__(self, name):
        self.name = name

    def __str__(self):
        return f"torch.{self.name}"


class _TorchDevice:
    def __init__(self, index):
        self.index = index
        self.type = "cuda"


class FakeTensor:
    """What ``describe`` reads of a torch.Tensor: dtype, shape, stride() in elements, device,
    is_cuda / is_sparse / requires_grad, and the interface (torch's own format)."""

    def __init__(self, shape, dtype_name, strides=None, device=1, requires_grad=False,
                 is_cuda=True, ptr=0x7000):
        self.shape = tuple(shape)
        self.dtype = _TorchDtype(dtype_name)
        self.itemsize = 2 if dtype_name in ("float16", "bfloat16") else np.dtype(dtype_name).itemsize
        if strides is None:
            strides, step = [], 1
            for n in reversed(self.shape):
                strides.insert(0, step)
                step *= n
        self._strides = tuple(strides)
        self.device = _TorchDevice(device)
        self.is_cuda, self.is_sparse, self.requires_grad = is_cuda, False, requires_grad
        self.ptr = ptr

    def stride(self):
        return self._strides

    @property
    def __cuda_array_interface__(self):
        if not self.is_cuda:
            raise AttributeError("not a CUDA tensor")
        typestr = "<V2" if self.dtype.name == "bfloat16" else np.dtype(self.dtype.name).str
        return {"shape": self.shape, "typestr": typestr, "version": 2, "data": (self.ptr, False),
                "strides": tuple(s * self.itemsize for s in self._strides)}


FakeTensor.__module__ = "torch"


class _CupyDevice:
    def __init__(self, index):
        self.id = index


class FakeCupyArray:
    def __init__(self, shape, dtype, strides=None, device=0):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        if strides is None:
            strides, step = [], self.dtype.itemsize
            for n in reversed(self.shape):
                strides.insert(0, step)
                step *= n
        self.strides = tuple(strides)
        self.device = _CupyDevice(device)

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": self.dtype.str, "version": 3,
                "data": (0x9000, False), "strides": self.strides}


FakeCupyArray.__module__ = "cupy"


def _general(obj, name="q") -> ArrayInfo:
    """The interface route, with the fast path switched off."""
    saved = arrays._fast_info
    arrays._fast_info = lambda obj, name: None
    try:
        return describe(obj, name)
    finally:
        arrays._fast_info = saved


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16", "float32", "float64", "int32"])
def test_torch_fast_path_matches_interface(dtype_name):
    # a transposed (B, H, S, D) -> (B, S, H, D) view: non-C strides
    t = FakeTensor((2, 7, 3, 16), dtype_name, strides=(3 * 7 * 16, 16, 7 * 16, 1), device=1)
    fast = describe(t, "q")
    assert fast == _general(t)
    expected_dtype = bfloat16_dtype() if dtype_name == "bfloat16" else np.dtype(dtype_name)
    assert fast.dtype == expected_dtype and fast.kind == "cuda" and fast.device == 1
    assert fast.strides == tuple(s * expected_dtype.itemsize for s in (336, 16, 112, 1))
    assert fast.type_name == "torch.FakeTensor"


def test_torch_cpu_tensor_still_refused_with_hint():
    t = FakeTensor((1, 4, 2, 8), "float32", is_cuda=False)
    with pytest.raises(TypeError, match=r"k must be .*tensor.cuda\(\)"):
        describe(t, "k")


def test_torch_tensor_requiring_grad_is_refused_by_name():
    t = FakeTensor((1, 4, 2, 8), "float16", requires_grad=True)
    with pytest.raises(TypeError, match=r"v is a PyTorch tensor that requires grad.*v\.detach\(\)"):
        describe(t, "v")


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int32"])
def test_cupy_fast_path_matches_interface(dtype):
    a = FakeCupyArray((3, 5, 4, 32), dtype, device=0)
    assert describe(a, "q") == _general(a)
    bf = FakeCupyArray((3, 5, 4, 32), bfloat16_dtype())
    info = describe(bf, "q")
    assert info.dtype == bfloat16_dtype() and info == _general(bf)
