"""Index arrays, dtype conversions and option checks of attention / decode (issue 18), in CPU
mode, plus ``check_inputs=True`` on stand-in GPU arrays (objects exposing
``__cuda_array_interface__`` and ``copy_to_host``, like Numba device arrays): the checks run
on a host copy and raise the same ValueError as CPU mode, before any kernel is touched."""
import re

import numpy as np
import pytest

import numba_flash
from numba_flash import validation
from numba_flash.arrays import as_dtype, int32_indices, to_host


class FakeGpuArray:
    """Host data presented as a GPU array: the library reads only its interface, and
    ``to_host`` copies it through ``copy_to_host``."""

    def __init__(self, data):
        self.data = np.ascontiguousarray(data)
        self.shape, self.dtype = self.data.shape, self.data.dtype
        self.__cuda_array_interface__ = dict(shape=self.shape, typestr=self.dtype.str,
                                             strides=None, data=(0, False), version=3)

    def copy_to_host(self):
        return self.data.copy()


def _packed(rng, total_q=7, total_k=9):
    q = rng.standard_normal((total_q, 4, 16)).astype(np.float32)
    k = rng.standard_normal((total_k, 2, 16)).astype(np.float32)
    return q, k, k.copy()


BAD_OFFSETS = [
    ([0, 4, 3], "cu_seqlens_q", r"cu_seqlens_q must be non-decreasing, got cu_seqlens_q\[1\] = 4 "
                                r"> cu_seqlens_q\[2\] = 3"),
    ([1, 4, 7], "cu_seqlens_q", r"cu_seqlens_q must start at 0, got cu_seqlens_q\[0\] = 1"),
    ([0, 4, 6], "cu_seqlens_q", r"cu_seqlens_q\[-1\] must equal the packed length 7 "
                                r"\(q.shape\[0\]\), got cu_seqlens_q\[-1\] = 6"),
    ([0, 2**40, 7], "cu_seqlens_q", r"cu_seqlens_q must fit int32 .* got cu_seqlens_q\[1\] = "
                                    r"1099511627776"),
]


@pytest.mark.parametrize("offsets, name, message", BAD_OFFSETS)
def test_bad_cu_seqlens_cpu_and_checked_gpu_same_error(offsets, name, message):
    rng = np.random.default_rng(0)
    q, k, v = _packed(rng)
    cu_q, cu_k = np.array(offsets, np.int64), np.array([0, 5, 9], np.int32)
    with pytest.raises(ValueError, match=message) as cpu:
        numba_flash.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    fake = [FakeGpuArray(x) for x in (q, k, v, cu_q, cu_k)]
    with pytest.raises(ValueError) as gpu:
        numba_flash.attention(*fake[:3], cu_seqlens_q=fake[3], cu_seqlens_k=fake[4],
                              max_seqlen_q=8, max_seqlen_k=8, check_inputs=True)
    assert str(gpu.value) == str(cpu.value)


def test_decreasing_cu_seqlens_k_of_the_issue():
    rng = np.random.default_rng(1)
    q, k, v = _packed(rng, 7, 30)
    with pytest.raises(ValueError, match=r"cu_seqlens_k must be non-decreasing, got "
                                         r"cu_seqlens_k\[1\] = 40 > cu_seqlens_k\[2\] = 30"):
        numba_flash.attention(q, k, v, cu_seqlens_q=np.array([0, 4, 7]),
                              cu_seqlens_k=np.array([0, 40, 30]))


def test_checked_gpu_max_seqlen_and_unchecked_default():
    rng = np.random.default_rng(2)
    q, k, v = (FakeGpuArray(x) for x in _packed(rng))
    cu_q = FakeGpuArray(np.array([0, 4, 7], np.int32))
    cu_k = FakeGpuArray(np.array([0, 5, 9], np.int32))
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=3, max_seqlen_k=5)
    with pytest.raises(ValueError, match=r"max_seqlen_q \(3\) is smaller than the longest "
                                         r"sequence \(4\)"):
        validation.validate(q, k, v, check_inputs=True, **kw)
    problem = validation.validate(q, k, v, **kw)     # unchecked: trusted, never read back
    assert problem.varlen.max_seqlen_q == 3
    assert problem.varlen.cu_k.dtype == np.int32      # int64 offsets converted on the "device"
    with pytest.raises(TypeError, match="check_inputs must be a bool"):
        validation.validate(q, k, v, check_inputs=1, **kw)


def test_int64_offsets_give_the_int32_result():
    rng = np.random.default_rng(3)
    q, k, v = _packed(rng)
    kw = dict(causal=True, return_lse=True)
    a = numba_flash.attention(q, k, v, cu_seqlens_q=np.array([0, 4, 7], np.int32),
                              cu_seqlens_k=np.array([0, 5, 9], np.int32), **kw)
    b = numba_flash.attention(q, k, v, cu_seqlens_q=np.array([0, 4, 7]),
                              cu_seqlens_k=np.array([0, 5, 9]), **kw)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def test_float64_alibi_slopes_are_float32_slopes():
    rng = np.random.default_rng(4)
    q = rng.standard_normal((2, 5, 4, 16)).astype(np.float32)
    k = rng.standard_normal((2, 6, 2, 16)).astype(np.float32)
    slopes = rng.uniform(0.01, 1.0, (2, 4))
    a = numba_flash.attention(q, k, k, alibi_slopes=slopes.astype(np.float32))
    b = numba_flash.attention(q, k, k, alibi_slopes=slopes)
    np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="alibi_slopes must be finite"):
        numba_flash.attention(q, k, k, alibi_slopes=np.full(4, 1e300))
    with pytest.raises(TypeError, match="alibi_slopes must be float32 .* got int32"):
        numba_flash.attention(q, k, k, alibi_slopes=np.ones(4, np.int32))


def _cache(rng, batch=2, capacity=24, pages=None):
    q = rng.standard_normal((batch, 2, 4, 32)).astype(np.float16)
    shape = (pages, 8, 2, 32) if pages else (batch, capacity, 2, 32)
    k = rng.standard_normal(shape).astype(np.float16)
    return q, k, k.copy()


BAD_INDICES = [
    (dict(cache_seqlens=[5, 25]), r"cache_seqlens\[1\] = 25 is outside \[0, 24\]"),
    (dict(cache_seqlens=[-1, 3]), r"cache_seqlens\[0\] = -1 is outside \[0, 24\]"),
    (dict(cache_seqlens=[2**33, 3]), r"cache_seqlens must fit int32 .* cache_seqlens\[0\] = "
                                     r"8589934592"),
    (dict(cache_seqlens=[9, 3], block_table=[[0, 5, 1], [2, 3, 4]]),
     r"block_table\[0, 1\] = 5 is not a page index in \[0, 5\)"),
    (dict(cache_seqlens=[9, 3], block_table=[[0, -2, 1], [2, 3, 4]]),
     r"block_table\[0, 1\] = -2 is not a page index"),
]


@pytest.mark.parametrize("indices, message", BAD_INDICES)
def test_decode_bad_indices_cpu_and_checked_gpu_same_error(indices, message):
    rng = np.random.default_rng(5)
    paged = "block_table" in indices
    q, k, v = _cache(rng, pages=5 if paged else None)
    arrays = {name: np.array(value) for name, value in indices.items()}    # int64
    with pytest.raises(ValueError, match=message) as cpu:
        numba_flash.decode(q, k, v, **arrays)
    fake = {name: FakeGpuArray(value) for name, value in arrays.items()}
    with pytest.raises(ValueError) as gpu:
        numba_flash.decode(*(FakeGpuArray(x) for x in (q, k, v)), check_inputs=True, **fake)
    assert str(gpu.value) == str(cpu.value)
    with pytest.raises(ValueError, match=re.escape(str(cpu.value))):    # the former name
        numba_flash.decode(*(FakeGpuArray(x) for x in (q, k, v)), check_indices=True, **fake)


def test_decode_int64_indices_give_the_int32_result():
    rng = np.random.default_rng(6)
    q, k, v = _cache(rng, pages=5)
    table, lens = [[4, 0, 1], [2, 3, 3]], [20, 7]
    a = numba_flash.decode(q, k, v, cache_seqlens=np.array(lens, np.int32),
                           block_table=np.array(table, np.int32), return_lse=True)
    b = numba_flash.decode(q, k, v, cache_seqlens=np.array(lens), block_table=np.array(table),
                           return_lse=True)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def test_decode_seqlen_q_limit():
    rng = np.random.default_rng(7)
    k = rng.standard_normal((1, 80, 1, 32)).astype(np.float16)
    numba_flash.decode(rng.standard_normal((1, 64, 2, 32)).astype(np.float16), k, k)
    with pytest.raises(ValueError, match=r"q must have seqlen_q <= 64 .* got q.shape\[1\] = 65"):
        numba_flash.decode(rng.standard_normal((1, 65, 2, 32)).astype(np.float16), k, k)


@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (-1, 5)])
def test_sinks_need_a_bounded_left_window(window):
    rng = np.random.default_rng(8)
    q = rng.standard_normal((1, 4, 2, 16)).astype(np.float32)
    pattern = (r"sinks=2 has no effect with an unbounded left window \(window_size="
               + re.escape(str(window)) + r"\).*left >= 0, or sinks=0")
    with pytest.raises(ValueError, match=pattern):
        numba_flash.attention(q, q, q, causal=True, window_size=window, sinks=2)
    with pytest.raises(ValueError, match=pattern):
        numba_flash.decode(q.astype(np.float16), q.astype(np.float16), q.astype(np.float16),
                           window_size=window, sinks=2)
    numba_flash.attention(q, q, q, causal=True, window_size=(1, window[1]), sinks=2)


def _three(score, b, h):
    return score


def _five_defaults(score, b, h, q_idx, kv_idx, scale=1.0):
    return score * scale


def test_score_mod_signature():
    q = np.ones((1, 3, 1, 8), np.float32)
    with pytest.raises(TypeError, match=r"score_mod must accept 5 positional arguments \(score, "
                                        r"b, h, q_idx, kv_idx\), got _three\(score, b, h\)"):
        numba_flash.attention(q, q, q, score_mod=_three)
    with pytest.raises(TypeError, match="score_mod must accept 5 positional arguments"):
        numba_flash.attention(q, q, q, score_mod=lambda score, *, b: score)
    numba_flash.attention(q, q, q, score_mod=_five_defaults)
    numba_flash.attention(q, q, q, score_mod=lambda *args: args[0])


def test_array_helpers_on_numpy():
    x = np.arange(4)
    assert to_host(x) is x
    assert int32_indices(x.astype(np.int32), "x").dtype == np.int32
    y = np.arange(3, dtype=np.int32)
    assert as_dtype(y, np.int32) is y                   # no cost when the dtype is right
    with pytest.raises(TypeError, match="x must hold integers .* got dtype float64"):
        int32_indices(np.zeros(2), "x")
