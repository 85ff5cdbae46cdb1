"""numba_flash.attention_backward: CPU mode, argument checks, the GPU plug-in spot."""
from __future__ import annotations

import sys
import types

import ml_dtypes
import numpy as np
import pytest

import numba_flash
from numba_flash import masks
from numba_flash_reference.backward import (attention_backward_reference,
                                            attention_backward_varlen)
from numba_flash_reference.precision import round_to

BF16 = np.dtype(ml_dtypes.bfloat16)


class FakeGpuArray:
    """Only ``__cuda_array_interface__``: enough for validation, never launched."""

    def __init__(self, shape, typestr="<f4"):
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": typestr,
                                         "strides": None, "data": (12345678, False),
                                         "version": 3}


def make_call(seed=0, batch=2, seqlen_q=7, seqlen_k=9, heads_q=4, heads_kv=2, head_dim=8,
              dtype=np.float32, **options):
    """(dout, q, k, v, out, lse) with the forward run in CPU mode with ``options``."""
    rng = np.random.default_rng(seed)
    q, dout = (rng.standard_normal((batch, seqlen_q, heads_q, head_dim)).astype(dtype)
               for _ in range(2))
    k, v = (rng.standard_normal((batch, seqlen_k, heads_kv, head_dim)).astype(dtype)
            for _ in range(2))
    out, lse = numba_flash.attention(q, k, v, return_lse=True, **options)
    return dout, q, k, v, out, lse


@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float32, np.float64])
def test_cpu_mode_is_the_reference_rounded_once(dtype):
    options = dict(causal=True, softcap=5.0, window_size=(4, 0), sinks=1)
    dout, q, k, v, out, lse = make_call(dtype=dtype, **options)
    grads = numba_flash.attention_backward(dout, q, k, v, out, lse, **options)
    exact = attention_backward_reference(dout, q, k, v, **options)
    for got, want, like in zip(grads, exact, (q, k, v)):
        assert got.dtype == like.dtype and got.shape == like.shape
        np.testing.assert_array_equal(got.astype(np.float64), round_to(want, dtype))


def test_cpu_mode_with_mask_objects_and_alibi():
    slopes = np.array([0.25, 0.5, 0.75, 1.0], dtype=np.float32)
    mask = masks.causal_document([4, 5])
    dout, q, k, v, out, lse = make_call(seqlen_q=9, mask=mask, alibi_slopes=slopes,
                                        dtype=np.float64)
    grads = numba_flash.attention_backward(dout, q, k, v, out, lse, mask=mask,
                                           alibi_slopes=slopes)
    exact = attention_backward_reference(dout, q, k, v, mask=mask, alibi_slopes=slopes)
    for got, want in zip(grads, exact):
        np.testing.assert_array_equal(got, want)
    as_flags = numba_flash.attention_backward(dout, q, k, v, out, lse, mask=masks.causal())
    np.testing.assert_array_equal(as_flags[0], numba_flash.attention_backward(
        dout, q, k, v, out, lse, causal=True)[0])


def test_cpu_mode_packed_batch():
    cu_q = np.array([0, 3, 3, 8], dtype=np.int32)
    cu_k = np.array([0, 5, 7, 11], dtype=np.int32)
    rng = np.random.default_rng(3)
    q, dout = (rng.standard_normal((8, 4, 8)) for _ in range(2))
    k, v = (rng.standard_normal((11, 2, 8)) for _ in range(2))
    varlen = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    out, lse = numba_flash.attention(q, k, v, causal=True, return_lse=True, **varlen)
    grads = numba_flash.attention_backward(dout, q, k, v, out, lse, causal=True, **varlen)
    exact = attention_backward_varlen(dout, q, k, v, cu_q, cu_k, causal=True)
    for got, want in zip(grads, exact):
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match=r"lse must have shape \(heads_q, total_q\)"):
        numba_flash.attention_backward(dout, q, k, v, out, lse[None], causal=True, **varlen)


def test_deterministic_flag_is_checked_and_cpu_is_reproducible():
    call = make_call()
    first = numba_flash.attention_backward(*call, deterministic=True)
    again = numba_flash.attention_backward(*call)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        numba_flash.attention_backward(*call, deterministic=1)


def _replace(call, index, value):
    call = list(call)
    call[index] = value
    return call


@pytest.mark.parametrize("index,value,error,pattern", [
    (0, np.ones((2, 6, 4, 8), np.float32), ValueError, r"dout must have the forward output's shape \(2, 7, 4, 8\)"),
    (0, np.ones((2, 7, 4, 8), np.float64), TypeError, "dout must have q's dtype float32, got float64"),
    (4, np.ones((2, 7, 4, 9), np.float32), ValueError, "out must have the forward output's shape"),
    (4, np.ones((2, 7, 4, 8), np.float16), TypeError, "out must have q's dtype"),
    (5, np.ones((2, 4, 6), np.float32), ValueError,
     r"lse must have shape \(batch, heads_q, seqlen_q\) = \(2, 4, 7\), got \(2, 4, 6\)"),
    (5, np.ones((4, 14), np.float32), ValueError, "pass cu_seqlens_q / cu_seqlens_k"),
    (5, np.ones((2, 4, 7), np.float16), TypeError, "lse must be float32"),
    (5, [[1.0]], TypeError, "^lse must be a NumPy ndarray"),
])
def test_saved_tensor_errors_name_the_argument(index, value, error, pattern):
    call = _replace(make_call(), index, value)
    with pytest.raises(error, match=pattern):
        numba_flash.attention_backward(*call)


def test_shared_keyword_errors_come_from_validate():
    call = make_call()
    with pytest.raises(ValueError, match="window_size"):
        numba_flash.attention_backward(*call, window_size=(-2, 0))
    with pytest.raises(ValueError, match="stream applies to the CUDA backend only"):
        numba_flash.attention_backward(*call, stream=object())
    with pytest.raises(TypeError, match="mask must be None or a mask object"):
        numba_flash.attention_backward(*call, mask=np.ones((7, 9), bool))
    with pytest.raises(NotImplementedError, match="score_mod"):
        numba_flash.attention_backward(*call, score_mod=lambda s, b, h, i, j: s)


def test_mixed_kinds_are_rejected():
    dout, q, k, v, out, lse = make_call()
    with pytest.raises(TypeError, match="q and dout must be arrays of the same kind"):
        numba_flash.attention_backward(FakeGpuArray(dout.shape), q, k, v, out, lse)


def _gpu_call():
    q_shape, kv_shape = (1, 4, 2, 8), (1, 6, 2, 8)
    return (FakeGpuArray(q_shape), FakeGpuArray(q_shape), FakeGpuArray(kv_shape),
            FakeGpuArray(kv_shape), FakeGpuArray(q_shape), FakeGpuArray((1, 2, 4)))


@pytest.mark.parametrize("index, name", [(0, "dout"), (4, "out")])
def test_gpu_dout_and_out_need_a_contiguous_head_dim(index, name):
    """An expanded gradient (autograd's for out.sum(): stride 0) would be read as contiguous by
    the 16-bit kernels; it is refused by name (numba_flash.torch makes dout contiguous)."""
    call = list(_gpu_call())
    call[index].__cuda_array_interface__["strides"] = (0, 0, 0, 0)
    with pytest.raises(ValueError, match=f"{name} must have a contiguous head_dim"):
        numba_flash.attention_backward(*call)


def test_gpu_arrays_reach_backward_cuda(monkeypatch):
    seen = {}

    def backward_cuda(dout, q, k, v, out, lse, *, problem, deterministic, stream, fast):
        seen.update(problem=problem, deterministic=deterministic, stream=stream, fast=fast)
        return "dq", "dk", "dv"

    fake = types.ModuleType("numba_flash.cuda.launch.backward")
    fake.backward_cuda = backward_cuda
    monkeypatch.setitem(sys.modules, "numba_flash.cuda.launch.backward", fake)
    got = numba_flash.attention_backward(*_gpu_call(), causal=True, deterministic=True,
                                         stream=7)
    assert got == ("dq", "dk", "dv")
    assert seen["deterministic"] is True and seen["stream"] == 7
    assert seen["fast"] is None         # an explicit stream: never recorded
    assert seen["problem"].causal and seen["problem"].backend == "cuda"
