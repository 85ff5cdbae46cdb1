"""Shared helpers of the kernel test files: moving arrays to the device and back (NumPy in the
CUDA simulator; CuPy on a GPU, PyTorch tensors for bfloat16) and NaN-poisoning every output the
launchers allocate, so that an element a kernel forgets to write fails the test."""
from __future__ import annotations

import sys

import ml_dtypes
import numpy as np
import pytest

import numba_flash.api
from numba_flash.cuda.launch import attention as _attention, decode as _decode, merge as _merge
from numba_flash.cuda.primitives import SIMULATOR

BF16 = np.dtype(ml_dtypes.bfloat16)
gpu = pytest.mark.gpu  # skipped under the simulator (tests/conftest.py)


def to_device(x):
    """NumPy (simulator) stays NumPy; on a GPU: CuPy, or a torch tensor for bfloat16."""
    if SIMULATOR:
        return x
    if x.dtype == BF16:
        import torch

        return torch.from_numpy(x.view(np.uint16).astype(np.int16)).view(torch.bfloat16).cuda()
    import cupy as cp

    return cp.asarray(x)


def to_host(x):
    """A NumPy copy of a NumPy, CuPy or torch array (bfloat16 as ml_dtypes.bfloat16)."""
    if isinstance(x, np.ndarray):
        return x
    if type(x).__module__.startswith("torch"):
        import torch

        if x.dtype == torch.bfloat16:
            return x.view(torch.int16).cpu().numpy().view(BF16)
        return x.cpu().numpy()
    import cupy as cp

    return cp.asnumpy(x)


def poison_outputs(monkeypatch):
    """Make the runtime's output allocation return NaN-filled arrays for the rest of the test
    (and switch the repeated-call path off, whose allocations are the caller library's own)."""
    original = _attention.empty_like_kind

    def poisoned(kind, like, shape, dtype_name, zero=False, fill=None):
        arr = original(kind, like, shape, dtype_name, zero=zero, fill=fill)
        if zero or fill is not None:
            return arr
        if kind == "torch":
            arr.fill_(float("nan"))
        elif kind == "numpy" or dtype_name != "bfloat16":
            arr[...] = np.nan
        return arr

    for module in (_attention, _decode, _merge):
        monkeypatch.setattr(module, "empty_like_kind", poisoned)
    no_repeat_path(monkeypatch)


def no_repeat_path(monkeypatch):
    """Every call takes the full path (no plan recorded or reused by call signature) for the
    rest of the test."""
    def miss(*args, **kwargs):
        return None, None

    monkeypatch.setattr(_attention, "attention_fast", miss)
    monkeypatch.setattr(_decode, "decode_fast", miss)
    monkeypatch.setattr(_merge, "merge_states_fast", miss)
    monkeypatch.setattr(numba_flash.api, "_FAST", [None])
    monkeypatch.setattr(sys.modules["numba_flash.decode"], "_FAST", [None])
