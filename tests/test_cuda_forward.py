"""The GPU forward kernels (numba_flash.cuda) against the float64 reference.

Without a GPU these run in Numba's CUDA simulator on NumPy inputs (small shapes: every simulated
mma is a Python-level warp exchange); with a GPU the same checks run on CuPy / PyTorch arrays,
plus larger shapes, stream, interop and memory tests marked ``gpu``.

Error rule (DESIGN.md): max |out - ref64| <= 2 x the max error of a naive implementation in the
same dtype (scores, probabilities and output each rounded to it) + a tiny atol.
"""
from __future__ import annotations

import zlib
import itertools

import numpy as np
import pytest

from numba_flash.cuda.launch import attention as launch
from numba_flash.cuda.primitives import SIMULATOR
import numba_flash
from numba_flash_reference.attention import attention as reference
from numba_flash_reference.masks import CausalMask, visible_matrix

from gpu_arrays import BF16, poison_outputs, to_device as _to_device, to_host as _to_host
from offline_sass import run_offline

DTYPES = {"float16": np.dtype(np.float16), "bfloat16": BF16, "float32": np.dtype(np.float32),
          "float64": np.dtype(np.float64)}
ATOL = {"float16": 1e-4, "bfloat16": 5e-4, "float32": 1e-6, "float64": 1e-12}

gpu = pytest.mark.gpu  # skipped under the simulator (tests/conftest.py)
if not SIMULATOR:
    cp = pytest.importorskip("cupy")


@pytest.fixture(autouse=True)
def _nan_poisoned_outputs(monkeypatch):
    poison_outputs(monkeypatch)


def _random(rng, shape, dtype_name):
    return rng.standard_normal(shape).astype(DTYPES[dtype_name])


def naive_same_dtype(q, k, v, scale, visible, softcap=None, bias=None):
    """Dense attention in the inputs' precision: float32/float64 computed in that dtype;
    float16/bfloat16 with float32 arithmetic and scores, probabilities and output rounded to it.
    ``bias``: float64 added to the scores after the softcap, broadcast to (B, Hq, Sq, Sk)."""
    dt = q.dtype
    work = np.float64 if dt == np.float64 else np.float32
    b, sq, hq, d = q.shape
    hkv = k.shape[2]
    kk = np.repeat(k.astype(work), hq // hkv, axis=2)
    vv = np.repeat(v.astype(work), hq // hkv, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q.astype(work), kk) * work(scale)
    if softcap:
        s = work(softcap) * np.tanh(s / work(softcap))
    if bias is not None:
        s = s + bias.astype(work)
    s = s.astype(dt).astype(work)
    s = np.where(visible, s, work(-np.inf))
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, work(0))
    p = np.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    p = np.divide(p, l, out=np.zeros_like(p), where=l > 0).astype(dt).astype(work)
    return np.einsum("bhqk,bkhd->bqhd", p, vv).astype(dt).astype(np.float64)


def check_case(rng, dtype_name, b, sq, sk, hq, hkv, d, causal=False, window=(-1, -1), sinks=0,
               softcap=None, transpose=False, scale=None):
    shape_q, shape_k = (b, sq, hq, d), (b, sk, hkv, d)
    if transpose:  # (B, H, S, D) storage, passed as strided (B, S, H, D) views
        q = _random(rng, (b, hq, sq, d), dtype_name).transpose(0, 2, 1, 3)
        k = _random(rng, (b, hkv, sk, d), dtype_name).transpose(0, 2, 1, 3)
        v = _random(rng, (b, hkv, sk, d), dtype_name).transpose(0, 2, 1, 3)
    else:
        q, k, v = (_random(rng, s, dtype_name) for s in (shape_q, shape_k, shape_k))
    scale = d ** -0.5 if scale is None else scale
    kw = dict(causal=causal, window_size=window, sinks=sinks, softcap=softcap)
    dq, dk, dv = (_to_device(x) for x in (q, k, v))
    if transpose and not SIMULATOR and dtype_name != "bfloat16":
        dq, dk, dv = (cp.asarray(np.ascontiguousarray(x.transpose(0, 2, 1, 3))).transpose(0, 2, 1, 3)
                      for x in (q, k, v))
    out, lse = launch.attention_cuda(dq, dk, dv, softmax_scale=scale, return_lse=True, **kw)
    out, lse = _to_host(out), _to_host(lse)
    assert out.shape == shape_q and out.dtype == q.dtype
    assert lse.shape == (b, hq, sq)
    assert lse.dtype == (np.float64 if q.dtype == np.float64 else np.float32)
    ref, ref_lse = reference(q, k, v, softmax_scale=scale, return_lse=True, **kw)
    vis = visible_matrix(sq, sk, causal=causal, window_size=window, sinks=sinks)
    naive = naive_same_dtype(q, k, v, scale, vis, softcap)
    err = np.abs(out.astype(np.float64) - ref).max()
    naive_err = np.abs(naive - ref).max()
    assert not np.isnan(out).any()
    assert err <= 2 * naive_err + ATOL[dtype_name], (err, naive_err)
    empty = ~vis.any(axis=1)
    assert np.all(out[:, empty] == 0)
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    assert np.abs(lse[fin] - ref_lse[fin]).max(initial=0) <= 1e-5 * max(1, np.abs(ref_lse[fin]).max(initial=0))
    return out


# Simulator-sized cases: (dtype, b, sq, sk, hq, hkv, d, causal, window, sinks, softcap).
# Tensor-core kernel (float16 / bfloat16): every head_dim, both dtypes, every mask flag.
HALF_CASES = [
    ("float16", 1, 17, 17, 2, 1, 32, False, (-1, -1), 0, None),      # GQA 2
    ("bfloat16", 1, 17, 129, 1, 1, 32, True, (-1, -1), 0, None),     # 3 key tiles, bottom-right
    ("float16", 1, 70, 150, 1, 1, 32, False, (6, 3), 2, None),       # window + sinks, skipped tiles
    ("bfloat16", 1, 1, 17, 1, 1, 64, True, (-1, -1), 0, 5.0),        # one query, softcap
    ("float16", 1, 20, 5, 1, 1, 96, True, (-1, -1), 0, None),        # rows that see no key
    ("bfloat16", 2, 9, 33, 2, 1, 32, False, (4, -1), 0, None),       # batch 2, MQA, left window only
    ("float16", 1, 20, 40, 1, 1, 128, True, (-1, -1), 0, None),      # Q in smem, swizzled rows, 2 key tiles
    ("bfloat16", 1, 9, 40, 1, 1, 256, False, (20, 3), 1, None),      # 16-key tiles, Q in smem
]
# CUDA-core kernel (float32 / float64): one case per lane geometry (lanes per row x rows per
# lane x key tile, which (dtype, head_dim) picks), every mask flag in each dtype.
FULL_CASES = [
    ("float32", 1, 17, 17, 2, 1, 32, False, (-1, -1), 0, None),      # 2 lanes per row, GQA
    ("float64", 1, 17, 17, 2, 1, 32, False, (-1, -1), 0, None),      # fp64 4 lanes per row, 2 key tiles
    ("float32", 1, 70, 45, 1, 1, 32, True, (-1, -1), 0, None),       # rows past the keys; second rows
    # two 128-row query tiles, window + sinks over 5 key tiles, skipped middle tiles
    ("float32", 1, 129, 129, 1, 1, 32, False, (8, 8), 3, None),
    ("float64", 1, 1, 33, 4, 2, 64, True, (-1, -1), 0, None),        # one query, GQA over 2 kv heads
    ("float32", 1, 33, 20, 1, 1, 96, False, (2, 0), 0, None),        # 4 lanes per row
    ("float32", 1, 17, 40, 1, 1, 256, True, (-1, -1), 0, 3.0),       # 1 row per lane, 16-key tiles
    ("float64", 2, 5, 9, 2, 1, 128, False, (-1, -1), 0, None),       # batch 2
    # 8 lanes per row, 8-key tiles: window + sinks over 5 tiles, skipped middle tiles
    ("float64", 1, 19, 37, 1, 1, 256, False, (9, 2), 3, None),
    ("float64", 1, 17, 20, 1, 1, 32, True, (-1, -1), 0, 2.5),        # causal with softcap, fp64
    # 4 lanes x 2 rows: rows 64-76 are the second rows; query rows past the keys
    ("float32", 1, 77, 13, 1, 1, 96, True, (-1, -1), 0, None),
    # 8 lanes x 2 rows of 64-row tiles: rows 32-44 are every lane group's second row
    ("float64", 1, 45, 17, 1, 1, 128, True, (-1, -1), 0, None),
]
# The larger shapes and the rest of the dtype product of the cases above (marked full_matrix:
# on a GPU, or in the simulator with --full-matrix); each path they take is reached above.
MATRIX_CASES = [
    ("bfloat16", 2, 9, 33, 3, 1, 32, False, (4, -1), 0, None),       # MQA over 3 heads
    ("float16", 1, 20, 70, 1, 1, 128, True, (-1, -1), 0, None),      # 3 key tiles at d 128
] + [
    (dt, 1, sq, sk, hq, hkv, d, causal, window, sinks, None)
    for dt, (sq, sk, hq, hkv, d, causal, window, sinks) in [
        ("float32", (1, 129, 4, 2, 64, True, (-1, -1), 0)),
        ("float64", (1, 129, 4, 2, 64, True, (-1, -1), 0)),
        ("float64", (70, 45, 1, 1, 32, True, (-1, -1), 0)),
        ("float64", (129, 129, 1, 1, 32, False, (8, 8), 3)),
        ("float64", (33, 20, 2, 2, 96, False, (2, 0), 0)),
    ]
] + [("float64", 1, 67, 71, 1, 1, 32, True, (-1, -1), 0, 2.5),
     ("float32", 1, 77, 13, 2, 1, 96, True, (-1, -1), 0, None),
     ("float64", 1, 45, 50, 1, 1, 128, True, (-1, -1), 0, None)] + [
    # cases above at one head in the simulator (GQA and hkv 2 are reached by other cases of
    # the same kernel), here with their heads
    ("bfloat16", 1, 1, 17, 2, 2, 64, True, (-1, -1), 0, 5.0),
    ("float32", 1, 33, 20, 2, 2, 96, False, (2, 0), 0, None),
    ("float32", 1, 17, 40, 2, 1, 256, True, (-1, -1), 0, 3.0),
    ("float64", 1, 19, 37, 2, 1, 256, False, (9, 2), 3, None),
]


@pytest.mark.parametrize("case", HALF_CASES + FULL_CASES + [
    pytest.param(c, marks=pytest.mark.full_matrix) for c in MATRIX_CASES],
    ids=lambda c: "-".join(map(str, c)))
def test_against_reference(case):
    dtype_name, b, sq, sk, hq, hkv, d, causal, window, sinks, softcap = case
    rng = np.random.default_rng(zlib.crc32(repr(case).encode()))
    check_case(rng, dtype_name, b, sq, sk, hq, hkv, d, causal, window, sinks, softcap)


@pytest.mark.parametrize("dtype_name", ["float16", "float32"])
def test_strided_head_major_view(dtype_name):
    rng = np.random.default_rng(7)
    check_case(rng, dtype_name, 1, 17, 20, 2, 1, 32, causal=True, transpose=True)


# One head in the simulator (each head is a block); two, as before, on a GPU.
@pytest.mark.parametrize("heads", [1, pytest.param(2, marks=pytest.mark.full_matrix)])
def test_bitwise_identical_across_runs(heads):
    rng = np.random.default_rng(11)
    q, k, v = (_to_device(_random(rng, (1, 17, heads, 32), "float16")) for _ in range(3))
    a = _to_host(launch.attention_cuda(q, k, v, softmax_scale=0.2, causal=True))
    b = _to_host(launch.attention_cuda(q, k, v, softmax_scale=0.2, causal=True))
    assert np.array_equal(a.view(np.uint16), b.view(np.uint16))


@pytest.mark.parametrize("itemsize", [4, 8])
def test_fma_geometry_fits(itemsize):
    """The FMA kernel's layout: key tiles split into whole rounds of lanes and 4-key P V steps,
    rows per block = groups x rows per lane, shared memory within the 48 KB static limit."""
    from numba_flash.cuda.kernels import forward_geometry as forward

    for d in launch.SUPPORTED_HEAD_DIMS:
        tpr, rpr = forward.fma_lanes_per_row(d, itemsize), forward.fma_rows_per_lane(d, itemsize)
        threads, bm = forward.fma_threads(d, itemsize), forward.fma_block_m(d, itemsize)
        bn = forward.fma_block_n(d, itemsize)
        assert 32 % tpr == 0 and d % (tpr * 16 // itemsize) == 0
        assert bm == threads // tpr * rpr and bn % tpr == 0 and bn % 4 == 0
        smem = (2 * bn * d + bm * (bn + 16 // itemsize)) * itemsize
        assert smem <= 45056, (d, smem)
    dtype = "float64" if itemsize == 8 else "float32"
    assert launch.tile_shape(dtype, 128) == (forward.fma_block_m(128, itemsize),
                                             forward.fma_block_n(128, itemsize))
    with pytest.raises(ValueError, match="head_dim must be one of .* got 48"):
        forward.fma_block_m(48, itemsize)


def test_second_call_compiles_nothing():
    rng = np.random.default_rng(12)
    q, k, v = (_to_device(_random(rng, (1, 5, 1, 64), "float32")) for _ in range(3))
    launch.attention_cuda(q, k, v, softmax_scale=0.1)
    before = launch.compiled_kernel_count()
    launch.attention_cuda(q, k, v, softmax_scale=0.3)
    assert launch.compiled_kernel_count() == before


def _bad_inputs(rng, shapes=((1, 5, 2, 32),) * 3, dtypes=("float32",) * 3):
    return [_to_device(_random(rng, s, dt)) for s, dt in zip(shapes, dtypes)]


def test_unsupported_head_dim_raises():
    q, k, v = _bad_inputs(np.random.default_rng(0), shapes=((1, 5, 2, 44),) * 3)
    with pytest.raises(ValueError, match="head_dim must be one of .* got 44"):
        launch.attention_cuda(q, k, v, softmax_scale=0.1)


def test_dtype_mismatch_raises():
    q, k, v = _bad_inputs(np.random.default_rng(0), dtypes=("float32", "float16", "float32"))
    with pytest.raises(TypeError, match="q float32, k float16"):
        launch.attention_cuda(q, k, v, softmax_scale=0.1)


def test_non_contiguous_head_dim_raises():
    rng = np.random.default_rng(0)
    q, k, v = _bad_inputs(rng, shapes=((1, 5, 2, 64),) * 3)
    with pytest.raises(ValueError, match="q must have a contiguous head_dim"):
        launch.attention_cuda(q[..., ::2], k[..., :32], v[..., :32], softmax_scale=0.1)


def test_mask_mod_intersection_not_implemented():
    """A mask_mod cannot be intersected with other mask objects on the GPU (the message says
    so); a plain mask object runs (tests/test_cuda_masks.py checks its numbers)."""
    from numba_flash import masks

    q, k, v = _bad_inputs(np.random.default_rng(0))
    both = masks.mask_mod(lambda b, h, qi, kv: kv != qi) & CausalMask()
    with pytest.raises(NotImplementedError, match="mask_mod cannot be intersected"):
        launch.attention_cuda(q, k, v, softmax_scale=0.1, mask=both)


def test_arrays_on_different_devices_raise(monkeypatch):
    q, k, v = _bad_inputs(np.random.default_rng(0))
    from numba_flash.cuda.launch import arrays

    original = arrays.interface
    calls = itertools.count()

    def fake(x, kind):
        ptr, shape, strides, itemsize, _ = original(x, kind)
        return ptr, shape, strides, itemsize, next(calls) % 2   # q on 0, k on 1, ...

    monkeypatch.setattr(arrays, "interface", fake)
    with pytest.raises(ValueError, match="one device"):
        launch.attention_cuda(q, k, v, softmax_scale=0.1)


@pytest.mark.parametrize("dtype_name, d, causal, window, sinks, hq", [
    ("float16", 64, True, (-1, -1), 0, 1),
    ("bfloat16", 32, False, (5, 2), 2, 1),
    # GQA 2 as well: on a GPU, or in the simulator with --full-matrix
    pytest.param("float16", 64, True, (-1, -1), 0, 2, marks=pytest.mark.full_matrix),
    pytest.param("bfloat16", 32, False, (5, 2), 2, 2, marks=pytest.mark.full_matrix),
])
def test_negative_scale(dtype_name, d, causal, window, sinks, hq):
    """A negative softmax_scale (legal: it flips the scores) on the tensor-core kernels: the row
    maximum of the logits is then the row's smallest product (an optimisation that takes the
    maximum on unscaled products must take the minimum here), and hidden pairs (causal,
    window, keys past the sequence) still get weight 0."""
    check_case(np.random.default_rng(d + 3), dtype_name, 1, 20, 37, hq, 1, d, causal, window,
               sinks, scale=-0.3)


# ---------------------------------------------------------------- real GPU only
GPU_SHAPES = [(1, 1, 1), (1, 17, 17), (2, 129, 129), (1, 129, 300), (1, 300, 129), (1, 513, 1000)]
GPU_MASKS = [(False, (-1, -1), 0), (True, (-1, -1), 0), (False, (100, 30), 0),
             (False, (64, 0), 4)]


@gpu
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("d", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("ratio", [1, 4])
def test_gpu_grid(dtype_name, d, ratio):
    rng = np.random.default_rng(d * 7 + ratio)
    for (b, sq, sk), (causal, window, sinks) in itertools.product(GPU_SHAPES, GPU_MASKS):
        check_case(rng, dtype_name, b, sq, sk, 4, 4 // ratio, d, causal, window, sinks)


@gpu
def test_gpu_softcap_and_bitwise_large():
    rng = np.random.default_rng(5)
    check_case(rng, "bfloat16", 2, 700, 900, 8, 2, 128, True, (-1, -1), 0, 20.0)
    q, k, v = (cp.asarray(_random(rng, (2, 1000, 4, 128), "float16")) for _ in range(3))
    a = launch.attention_cuda(q, k, v, softmax_scale=0.1, causal=True)
    b = launch.attention_cuda(q, k, v, softmax_scale=0.1, causal=True)
    assert bool((a.view(cp.uint16) == b.view(cp.uint16)).all())


@gpu
def test_gpu_kinds_zero_copy_and_stream():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(6)
    q = torch.randn(2, 8, 300, 64, device="cuda", dtype=torch.float16).transpose(1, 2)  # strided
    k = torch.randn(2, 300, 2, 64, device="cuda", dtype=torch.float16)
    out = launch.attention_cuda(q, k, k, softmax_scale=0.125, causal=True)
    assert isinstance(out, torch.Tensor) and out.device == q.device and out.shape == q.shape
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2).float(), k.repeat_interleave(4, 2).transpose(1, 2).float(),
        k.repeat_interleave(4, 2).transpose(1, 2).float(), is_causal=True)
    assert (out.float() - ref.transpose(1, 2)).abs().max().item() < 5e-3
    x = cp.asarray(_random(rng, (1, 4000, 4, 128), "float16"))
    # The upload ran on the null stream, which a non-blocking stream does not wait for: wait
    # here, or a launch quick enough to start before the copy lands reads part of it.
    cp.cuda.get_current_stream().synchronize()
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        out = launch.attention_cuda(x, x, x, softmax_scale=0.1)
    s.synchronize()
    assert isinstance(out, cp.ndarray)
    ref = launch.attention_cuda(x, x, x, softmax_scale=0.1, stream=s)
    s.synchronize()
    assert bool((out == ref).all())


@gpu
def test_gpu_cupy_bfloat16_in_and_out():
    """A CuPy bfloat16 array in gives a CuPy bfloat16 array out, with correct values."""
    try:
        cp.asarray(np.ones(4, BF16))
    except Exception as exc:  # CuPy without bfloat16
        pytest.skip(f"this CuPy has no bfloat16 arrays: {exc}")
    rng = np.random.default_rng(9)
    q, k, v = (_random(rng, s, "bfloat16") for s in ((2, 77, 4, 64), (2, 93, 2, 64), (2, 93, 2, 64)))
    dq, dk, dv = (cp.asarray(x) for x in (q, k, v))
    assert dq.dtype == BF16
    out, lse = launch.attention_cuda(dq, dk, dv, softmax_scale=0.125, causal=True, return_lse=True)
    assert isinstance(out, cp.ndarray) and out.dtype == BF16 and out.shape == q.shape
    host = cp.asnumpy(out.view(cp.uint16)).view(BF16).astype(np.float64)
    ref, ref_lse = reference(q, k, v, softmax_scale=0.125, causal=True, return_lse=True)
    naive = naive_same_dtype(q, k, v, 0.125, visible_matrix(77, 93, causal=True))
    err, naive_err = np.abs(host - ref).max(), np.abs(naive - ref).max()
    assert err <= 2 * naive_err + ATOL["bfloat16"], (err, naive_err)
    assert np.abs(cp.asnumpy(lse) - ref_lse).max() <= 1e-5 * np.abs(ref_lse).max()


class _BareBFloat16:
    """A GPU buffer exposing bfloat16 only as a "<V2" __cuda_array_interface__ (as ml_dtypes/JAX do)."""

    def __init__(self, words):
        self.storage, self.shape, self.dtype = words, tuple(words.shape), np.dtype("V2")
        self.__cuda_array_interface__ = dict(words.__cuda_array_interface__, typestr="<V2")


@gpu
def test_gpu_bare_interface_bfloat16():
    """bfloat16 reached only through a "<V2" interface runs as bfloat16 and comes back as such."""
    rng = np.random.default_rng(11)
    q, k, v = (_random(rng, s, "bfloat16") for s in ((1, 40, 2, 64), (1, 50, 1, 64), (1, 50, 1, 64)))
    args = [_BareBFloat16(cp.asarray(x.view(np.uint16))) for x in (q, k, v)]
    out = launch.attention_cuda(*args, softmax_scale=0.125, causal=True)
    assert out.__cuda_array_interface__["typestr"] == "<V2" and tuple(out.shape) == q.shape
    host = cp.asnumpy(cp.asarray(out.storage)).view(np.uint16).view(BF16).astype(np.float64)
    ref = reference(q, k, v, softmax_scale=0.125, causal=True)
    naive = naive_same_dtype(q, k, v, 0.125, visible_matrix(40, 50, causal=True))
    assert np.abs(host - ref).max() <= 2 * np.abs(naive - ref).max() + ATOL["bfloat16"]


@gpu
def test_gpu_strided_inputs_same_bits_as_contiguous():
    """A transposed (B, H, S, D) view runs without a copy (a plan of layout 'A') and gives the
    bits of its contiguous copy."""
    rng = np.random.default_rng(10)
    for dtype_name, d in (("float16", 128), ("float16", 256), ("float32", 64)):
        q = cp.asarray(_random(rng, (2, 4, 150, d), dtype_name)).transpose(0, 2, 1, 3)  # strided
        k = cp.asarray(_random(rng, (2, 170, 2, d), dtype_name))
        kw = dict(softmax_scale=0.1, window_size=(40, 7), sinks=2, return_lse=True)
        strided = launch.attention_cuda(q, k, k, **kw)
        contiguous = launch.attention_cuda(cp.ascontiguousarray(q), k, k, **kw)
        for a, b in zip(strided, contiguous):
            assert bool(cp.all(a.view(cp.uint8) == b.view(cp.uint8)))


@gpu
def test_gpu_no_quadratic_memory():
    pool = cp.get_default_memory_pool()
    rng = cp.random.default_rng(0)
    b, n, h, d = 1, 16384, 16, 128
    q, k, v = (rng.standard_normal((b, n, h, d), dtype=cp.float32).astype(cp.float16)
               for _ in range(3))
    cp.cuda.runtime.deviceSynchronize()
    pool.free_all_blocks()
    base = pool.used_bytes()
    out, lse = launch.attention_cuda(q, k, v, softmax_scale=d ** -0.5, causal=True, return_lse=True)
    cp.cuda.runtime.deviceSynchronize()
    extra = pool.used_bytes() - base
    expected = out.nbytes + lse.nbytes
    assert extra <= expected + (1 << 20), (extra, expected)
    assert not bool(cp.isnan(out).any())


# ------------------------------------------------------------------ the wgmma path (Hopper)
def test_wgmma_geometry():
    """Two warpgroups, 128-row query tiles, 128-key tiles (64 at head_dim 256); dynamic shared
    memory for the Q, K and V tiles, the interval bounds and the 1 KB alignment slack; the
    mma.sync geometry is unchanged when the path is off (and the simulator never takes it)."""
    from numba_flash.cuda.kernels import forward_geometry as forward

    assert forward.mma_threads(True) == 256 and forward.mma_threads(False) == 128
    assert forward.mma_block_m(128, True) == 128 and forward.mma_m_tiles(128, True) == 1
    assert forward.mma_block_m(128) == 128 and forward.mma_block_m(256) == 64
    assert forward.mma_block_n(128, True) == 128 and forward.mma_block_n(256, True) == 64
    assert forward.mma_block_m(256, True) == 128
    assert forward.wgmma_smem_bytes(256, 64) == (128 + 2 * 64) * 256 * 2 + 4 * 64 * 4 + 1024
    assert forward.wgmma_smem_bytes(128, 128) == 3 * 128 * 128 * 2 + 4 * 128 * 4 + 1024
    assert forward.wgmma_smem_bytes(64, 128) == 3 * 128 * 64 * 2 + 4 * 128 * 4 + 1024
    if SIMULATOR:
        assert not launch.wgmma_device()
        assert launch.dynamic_smem_bytes("float16", 128) == 0
        assert launch.tile_shape("float16", 128) == (forward.mma_block_m(128),
                                                     forward.mma_block_n(128))


@gpu
@pytest.mark.parametrize("case", [
    ("float16", 2, 333, 517, 4, 2, 128, False, (-1, -1), 0, None),
    ("bfloat16", 1, 300, 300, 2, 1, 128, True, (-1, -1), 0, None),
    ("float16", 1, 129, 300, 2, 2, 128, False, (64, 0), 4, None),
    ("bfloat16", 2, 257, 257, 2, 2, 64, False, (-1, -1), 0, 20.0),
    ("float16", 1, 500, 700, 3, 1, 64, True, (-1, -1), 0, None),
    ("bfloat16", 2, 333, 517, 4, 2, 256, False, (-1, -1), 0, None),
    ("float16", 1, 300, 300, 2, 1, 256, True, (-1, -1), 0, None),
    ("float16", 1, 129, 300, 2, 2, 256, False, (64, 0), 4, 30.0),
], ids=lambda c: "-".join(map(str, c)))
def test_gpu_wgmma_and_mma_sync_paths(case, monkeypatch):
    """On a compute-capability 9.0 GPU the half-precision kernels at head_dim 64 / 128 / 256
    take the wgmma path; it and the mma.sync path (WGMMA_ENABLED False, as NUMBA_FLASH_WGMMA=0
    sets at import) both meet the 2x rule on the same random inputs (odd sizes, several
    128-row query tiles, GQA, window + sinks, softcap)."""
    for enabled in (True, False):
        monkeypatch.setattr(launch, "WGMMA_ENABLED", enabled)
        assert launch.dynamic_smem_bytes(case[0], case[6]) > 0 or not launch.wgmma_device()
        check_case(np.random.default_rng(31), *case)


def test_wgmma_kernel_compiles_offline():
    """The wgmma kernels (plain, causal, interval mask, head_dim 96 and 256) assemble for sm_90a
    with warpgroup matrix instructions and no local memory. Needs NVVM and ptxas (the NVIDIA
    pip wheels named in scripts/kernel_resources.py); skipped where they are missing (CI)."""
    code = (
        "import sys; sys.path.insert(0, 'scripts')\n"
        "import kernel_resources as kr\n"
        "from numba_flash.cuda.kernels import forward_mma as forward\n"
        "for d, causal, kind in ((128, False, 0), (64, True, 0), (128, False, 1), (256, True, 0),\n"
        "                         (96, False, 0)):\n"
        "    kern = forward.make_mma_kernel(d, d == 64, False, causal, False, False, True,\n"
        "                                   64 if d == 256 else 128,\n"
        "                                   mask_kind=kind, m_tiles=1, wgmma=True)\n"
        "    r = kr.report(kern.py_func, kr.forward_signature(True), cc=(9, 0, 'a'))\n"
        "    print(d, causal, kind, r['sass'].count('HGMMA'), r['n_ldl'], r['spill_stores'])\n")
    lines = run_offline(code)
    rows = [line.split() for line in lines]
    assert len(rows) == 5
    for d, _, _, n_hgmma, n_ldl, spills in rows:
        # one HGMMA per k-step of Q K^T (d / 16) and of P V (128 / 16 keys; 64 at d 256)
        keys = 64 if d == "256" else 128
        assert int(n_hgmma) == int(d) // 16 + keys // 16, rows
        assert int(n_ldl) == 0 and int(spills) == 0, rows


@gpu
@pytest.mark.parametrize("dtype_name, d, sq, sk, causal, scale", [
    ("float16", 128, 300, 700, False, None),     # more key tiles than the ring's 3 stages
    ("bfloat16", 128, 300, 700, True, None),
    ("float16", 96, 257, 1000, True, None),
    ("float16", 256, 200, 500, False, None),     # 2 stages, 64-key tiles
    ("bfloat16", 256, 130, 300, True, -0.07),    # a negative scale (row minimum)
    ("float16", 128, 500, 200, True, None),      # Sk < Sq, causal: leading rows see no key
    ("float16", 96, 64, 100, False, None),       # one key tile
])
def test_warp_specialised_kernel(dtype_name, d, sq, sk, causal, scale):
    """The warp-specialised kernel (plain / causal at head_dim 96 / 128 / 256 on a
    compute-capability 9.0 GPU) against the float64 reference, GQA 2, two batches: the ring's
    wrap, one tile, query tiles without keys, a negative scale."""
    if not launch.wgmma_device():
        pytest.skip("the warp-specialised kernel runs on compute capability 9.0 only")
    entry = launch.kernel_for(dtype_name, d, False, causal, False, False, True)
    assert entry.threads == 384 and entry.smem_bytes > 48 * 1024
    assert entry.registers == (168 if d == 256 else 0)   # the setmaxnreg hand-over's count
    check_case(np.random.default_rng(d + sq), dtype_name, 2, sq, sk, 4, 2, d, causal=causal,
               scale=scale)


@pytest.mark.parametrize("d, causal", [(128, False), (96, True)])
def test_warp_specialised_kernel_strided_inputs(d, causal):
    """The warp-specialised producer steps through whole key tiles by the arrays' own row
    strides: (B, H, S, D) storage passed as (B, S, H, D) views (rows D elements apart, not
    H D), GQA 2, a partial last tile, against the float64 reference."""
    if not launch.wgmma_device():
        pytest.skip("the warp-specialised kernel runs on compute capability 9.0 only")
    check_case(np.random.default_rng(d), "float16", 2, 200, 333, 4, 2, d, causal=causal,
               transpose=True)


@gpu
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_misaligned_inputs_raise_and_leave_the_context_usable(dtype):
    """The forward kernels copy rows in 16-byte pieces: a q view 8 bytes past a 16-byte
    boundary (4-byte aligned, which the 32-bit-word view once accepted) raises ValueError
    naming q, on the first call and on a repeated one (the fast path checks the pointers),
    and the next aligned call still gives the right answer (no fault poisoned the context)."""
    cp = pytest.importorskip("cupy")
    rng = np.random.default_rng(8)
    wide = cp.asarray(_random(rng, (1, 70, 2, 128 + 8), "float16").astype(dtype))
    k, v = (cp.asarray(_random(rng, (1, 90, 2, 128), "float16").astype(dtype))
            for _ in range(2))
    shift = 8 // wide.itemsize
    for _ in range(2):
        numba_flash.attention(wide[..., :128], k, v, causal=True)   # aligned: the fast path
        with pytest.raises(ValueError, match="q must be 16-byte aligned .* 8 bytes past"):
            numba_flash.attention(wide[..., shift:shift + 128], k, v, causal=True)
    q = wide[..., shift:shift + 128].copy()
    got = cp.asnumpy(numba_flash.attention(q, k, v, causal=True)).astype(np.float64)
    want = reference(*(cp.asnumpy(x).astype(np.float64) for x in (q, k, v)), causal=True)
    assert np.abs(got - want).max() < (2e-3 if dtype == np.float16 else 1e-5)


@gpu
def test_length_one_axes_may_carry_any_stride():
    """torch reports arbitrary strides on length-1 axes of some views; they never move an
    address, so q, k, v, dout and out views whose batch and head axes (length 1) carry strides
    that are not multiples of 16 (or even 4) bytes are accepted, on the first call and the fast
    path's repeated one, by the forward and the (deterministic) backward, with the contiguous
    arrays' answer bit for bit."""
    torch = pytest.importorskip("torch")
    gen = torch.Generator(device="cuda").manual_seed(5)
    base = [torch.randn(1, 77, 1, 64, device="cuda", dtype=torch.float16, generator=gen)
            for _ in range(4)]
    odd = [x.as_strided(x.shape, (999, 64, 7, 1)) for x in base]
    want = numba_flash.attention(*base[:3], causal=True)
    for _ in range(2):
        got = numba_flash.attention(*odd[:3], causal=True)
        assert torch.equal(got, want)
    out, lse = numba_flash.attention(*base[:3], causal=True, return_lse=True)
    odd_out = out.as_strided(out.shape, (999, 64, 7, 1))
    grads = numba_flash.attention_backward(odd[3], *odd[:3], odd_out, lse, causal=True,
                                           deterministic=True)
    plain = numba_flash.attention_backward(base[3], *base[:3], out, lse, causal=True,
                                           deterministic=True)
    for g, p in zip(grads, plain):
        assert torch.equal(g, p)


def test_warp_specialised_kernel_compiles_offline():
    """The warp-specialised wgmma kernel (kernels/forward_ws.py) at head_dim 96 / 128 / 256,
    plain and causal, float16 and bfloat16, with an interval mask at 64 / 96 / 128 (kind 1),
    compiled with its launch bound (384 threads): one
    HGMMA per k-step of Q K^T and of P V, 168 registers at launch (exactly, where the producer
    hands registers to the consumers), no local memory, no serialised wgmma, no write to the
    registers of a running P V's A operand. Needs NVVM and ptxas (skipped in CI)."""
    code = (
        "import sys; sys.path.insert(0, 'scripts')\n"
        "import kernel_resources as kr\n"
        "from numba_flash.cuda.kernels import forward_ws as ws\n"
        "for d, causal, bf16, kind in ((128, False, False, 0), (128, True, True, 0),\n"
        "                              (96, False, False, 0), (96, True, True, 0),\n"
        "                              (256, True, False, 0), (128, False, True, 1),\n"
        "                              (96, True, False, 1), (64, False, True, 1)):\n"
        "    kern = ws.make_ws_kernel(d, bf16, causal, True, kind)\n"
        "    r = kr.report(kern.py_func, kr.forward_signature(True), cc=(9, 0, 'a'),\n"
        "                  maxntid=ws.WS_THREADS)\n"
        "    print(d, r['sass'].count('HGMMA'), r['regs'], r['n_ldl'], r['spill_stores'],\n"
        "          int('serializ' in r['ptxas_info']), r['a_overwrites'])\n")
    rows = [line.split() for line in run_offline(code)]
    assert len(rows) == 8
    for d, n_hgmma, regs, n_ldl, spills, serialised, a_overwrites in rows:
        assert int(n_hgmma) == int(d) // 16 + (64 if d == "256" else 128) // 16, rows
        # exactly 168 where the producer hands registers over (else the consumers' setmaxnreg
        # waits forever), at most 168 otherwise
        assert int(regs) == 168 or (int(regs) < 168 and d != "256"), rows
        assert int(n_ldl) == 0 and int(spills) == 0, rows
        assert serialised == "0" and a_overwrites == "0", rows


@pytest.mark.parametrize("dtype_name, d, hq", [
    ("float32", 40, 2), ("float16", 72, 1),
    pytest.param("float16", 72, 2, marks=pytest.mark.full_matrix)])   # GQA on the GPU
def test_other_head_dims_are_padded(dtype_name, d, hq):
    """A head dim no kernel takes as it is (a multiple of 8 up to 256) runs on the next kernel
    size with zero columns; out has the caller's head dim, lse is unchanged, and the default
    scale is 1/sqrt of the real head dim."""
    rng = np.random.default_rng(d)
    q, k, v = (_random(rng, s, dtype_name) for s in ((1, 9, hq, d), (1, 13, 1, d), (1, 13, 1, d)))
    out, lse = numba_flash.attention(*(_to_device(x) for x in (q, k, v)), causal=True,
                                     return_lse=True, backend="cuda")
    out, lse = _to_host(out), _to_host(lse)
    ref, ref_lse = reference(q, k, v, causal=True, return_lse=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    naive = naive_same_dtype(q, k, v, d ** -0.5, visible_matrix(9, 13, causal=True))
    atol = ATOL.get(dtype_name, 1e-6)
    assert np.abs(out.astype(np.float64) - ref).max() <= 2 * np.abs(naive - ref).max() + atol
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)
