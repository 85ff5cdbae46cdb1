"""numba_flash.decode (split-KV decode over contiguous and paged KV caches) against the reference.

Without a GPU the CUDA path runs in Numba's simulator on NumPy arrays (tiny shapes); with a GPU the
same cases run on CuPy / PyTorch arrays, plus larger ones. Error rule (DESIGN.md): max |out -
ref64| <= 2 x the max error of a naive same-dtype implementation + a tiny atol. Outputs start
as NaN so an unwritten element fails.
"""
from __future__ import annotations

import numpy as np
import pytest

import numba_flash
from numba_flash import masks
from numba_flash.cuda.kernels.decode_fma import decode_geometry
from numba_flash.cuda.launch import decode as dec
from numba_flash.cuda.launch.decode import (auto_num_splits, auto_num_splits_mma, mma_tile,
                                            tree_row_bits)
from numba_flash.cuda.primitives import SIMULATOR
from numba_flash.decode import gather_cache
from numba_flash_reference.attention import attention as reference
from numba_flash_reference.masks import TreeMask, visible_matrix

from gpu_arrays import BF16, poison_outputs, to_device as _dev, to_host as _host

DT = {"float16": np.dtype(np.float16), "bfloat16": BF16, "float32": np.dtype(np.float32)}
ATOL = {"float16": 1e-4, "bfloat16": 5e-4, "float32": 1e-6}
gpu = pytest.mark.gpu  # skipped under the simulator (tests/conftest.py)
if not SIMULATOR:
    cp = pytest.importorskip("cupy")


@pytest.fixture(autouse=True)
def _nan_poisoned_outputs(monkeypatch):
    poison_outputs(monkeypatch)


_DECODE_CUDA = dec.decode_cuda


def decode_options(monkeypatch, kernel="auto", tile=None, stream_hint=None):
    """Route numba_flash.decode's GPU calls through the runtime's test keywords: ``kernel``
    ("fma": the CUDA-core kernel at any head_dim), ``tile`` (block_n, stages, warps) of the
    tensor-core kernel, ``stream_hint`` (the evict-first L2 hint forced on / off)."""
    original = _DECODE_CUDA

    def with_options(*args, **kwargs):
        return original(*args, kernel=kernel, tile=tile, stream_hint=stream_hint, **kwargs)

    monkeypatch.setattr(dec, "decode_cuda", with_options)


def _dev_int(x, like):
    """int32 index arrays on the same kind of array as ``like``."""
    if SIMULATOR:
        return x
    if type(like).__module__.startswith("torch"):
        import torch

        return torch.from_numpy(x).cuda()
    return cp.asarray(x)


def _naive(q, k, v, scale, vis, softcap):
    """Dense attention of one sequence with scores, probabilities and output rounded to q.dtype."""
    dt, work = q.dtype, np.float32
    g = q.shape[2] // k.shape[2]
    kk = np.repeat(k.astype(work), g, axis=2)
    vv = np.repeat(v.astype(work), g, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q.astype(work), kk) * work(scale)
    if softcap:
        s = work(softcap) * np.tanh(s / work(softcap))
    s = np.where(vis, s.astype(dt).astype(work), -np.inf)
    m = s.max(axis=-1, keepdims=True)
    p = np.exp(s - np.where(np.isfinite(m), m, 0))
    l = p.sum(axis=-1, keepdims=True)
    p = np.divide(p, l, out=np.zeros_like(p), where=l > 0).astype(dt).astype(work)
    return np.einsum("bhqk,bkhd->bqhd", p, vv).astype(dt).astype(np.float64)


def make_cache(rng, dtype, b, smax, hkv, d, page_size=None):
    """Random caches: contiguous (B, Smax, Hkv, D), or paged with a shuffled block table."""
    if page_size is None:
        k = rng.standard_normal((b, smax, hkv, d)).astype(DT[dtype])
        v = rng.standard_normal((b, smax, hkv, d)).astype(DT[dtype])
        return k, v, None
    per = -(-smax // page_size)
    num_pages = b * per + 3                          # spare pages nobody uses
    table = rng.permutation(num_pages)[:b * per].reshape(b, per).astype(np.int32)
    k = rng.standard_normal((num_pages, page_size, hkv, d)).astype(DT[dtype])
    v = rng.standard_normal((num_pages, page_size, hkv, d)).astype(DT[dtype])
    return k, v, table


def check_decode(rng, dtype, b, sq, hq, hkv, d, smax, lens, *, page_size=None, causal=True,
                 window=(-1, -1), sinks=0, softcap=None, parents=None, num_splits="auto"):
    q = rng.standard_normal((b, sq, hq, d)).astype(DT[dtype])
    k, v, table = make_cache(rng, dtype, b, smax, hkv, d, page_size)
    lens = np.asarray(lens, dtype=np.int32)
    mask = masks.tree(parents) if parents is not None else None
    scale = d ** -0.5
    opts = dict(causal=causal, window_size=window, sinks=sinks, softcap=softcap)
    dq, dk, dv = _dev(q), _dev(k), _dev(v)
    out, lse = numba_flash.decode(dq, dk, dv, cache_seqlens=_dev_int(lens, dq),
                                  block_table=None if table is None else _dev_int(table, dq),
                                  mask=mask, num_splits=num_splits, return_lse=True,
                                  backend="cuda", **opts)
    out, lse = _host(out), _host(lse)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (b, hq, sq) and lse.dtype == np.float32
    assert not np.isnan(out.astype(np.float32)).any()
    worst, naive_worst = 0.0, 0.0
    for i in range(b):
        n = int(lens[i])
        if n == 0:
            assert np.all(out[i] == 0) and np.all(np.isneginf(lse[i]))
            continue
        kb = gather_cache(k, i, n, table)[None]
        vb = gather_cache(v, i, n, table)[None]
        mb = TreeMask(parents, n - len(parents)) if parents is not None else None
        ref, ref_lse = reference(q[i:i + 1], kb, vb, softmax_scale=scale, mask=mb,
                                 return_lse=True, **opts)
        vis = visible_matrix(sq, n, mask=mb, causal=causal, window_size=window, sinks=sinks)
        naive = _naive(q[i:i + 1], kb, vb, scale, vis, softcap)
        worst = max(worst, np.abs(out[i:i + 1].astype(np.float64) - ref).max())
        naive_worst = max(naive_worst, np.abs(naive - ref).max())
        assert np.array_equal(np.isneginf(lse[i]), np.isneginf(ref_lse[0]))
        fin = np.isfinite(ref_lse[0])
        assert np.allclose(lse[i][fin], ref_lse[0][fin], rtol=1e-5, atol=1e-5)
        assert np.all(out[i][~vis.any(axis=1)] == 0)
    assert worst <= 2 * naive_worst + ATOL[dtype], (worst, naive_worst)
    return out, lse


# Simulator-sized cases. (dtype, b, sq, hq, hkv, d, smax, lens, page_size, extra options)
CASES = [
    ("float16", 3, 1, 2, 1, 32, 40, [37, 0, 1], None, {}),                      # ragged, 0 and 1
    ("bfloat16", 2, 1, 4, 1, 32, 45, [45, 20], 8, {}),                          # paged (pow2 pages)
    ("float16", 2, 2, 2, 2, 32, 30, [30, 11], 6, {}),                           # paged, 6-row pages
    ("bfloat16", 1, 1, 8, 1, 32, 50, [50], None, {"num_splits": 2}),            # GQA 8, 8 rows
    ("float16", 2, 3, 3, 1, 64, 40, [33, 3], None, {"window": (9, -1), "sinks": 2}),
    ("bfloat16", 1, 1, 1, 1, 32, 70, [70], 16, {"softcap": 3.0, "num_splits": 3}),
    ("float16", 2, 5, 2, 1, 32, 24, [20, 9], 4, {"parents": [-1, 0, 0, 1, 1]}),  # draft tree
    ("float16", 1, 4, 2, 2, 32, 20, [19], None, {"causal": False, "window": (5, 1)}),
    # 32-row pages, wider than a tile; the window starts tiles mid-page (fast copies at offsets)
    ("float16", 2, 1, 4, 2, 64, 96, [96, 70], 32, {"window": (37, -1), "num_splits": 2}),
    # more than 32 pages per split: the block-table entries held in registers are reloaded
    ("float16", 1, 1, 2, 1, 32, 400, [390], 8, {"num_splits": 1}),
    ("bfloat16", 1, 2, 2, 1, 32, 600, [577], 8, {"window": (300, -1), "sinks": 3,
                                                 "num_splits": 1}),
]


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_decode_against_reference(case):
    dtype, b, sq, hq, hkv, d, smax, lens, page, extra = case
    check_decode(np.random.default_rng(hash(str(case)) % 2**32), dtype, b, sq, hq, hkv, d, smax,
                 lens, page_size=page, **extra)


# The CUDA-core kernel (head_dim > 128, or forced) and other tensor-core tiles on a few cases.
@pytest.mark.parametrize("kernel, tile, idx", [
    ("fma", None, 0), ("fma", None, 1), ("fma", None, 6),
    ("mma", (16, 3, 1), 1), ("mma", (16, 4, 2), 4), ("mma", (48, 2, 1), 6),
])
def test_decode_kernel_variants(monkeypatch, kernel, tile, idx):
    """The CUDA-core kernel (its splits merged by the merge kernel) and other tiles."""
    decode_options(monkeypatch, kernel=kernel, tile=tile)
    dtype, b, sq, hq, hkv, d, smax, lens, page, extra = CASES[idx]
    check_decode(np.random.default_rng(idx + 100), dtype, b, sq, hq, hkv, d, smax, lens,
                 page_size=page, **extra)


@pytest.mark.parametrize("d, hq, splits", [(32, 3, 5), (96, 1, 4)])
def test_merge_tail_reduction_depths(d, hq, splits):
    """The folded merge's group combination: head_dim 32 with 3 rows (2 lane groups per row,
    one scatter level) and head_dim 96 with 1 row (8 groups: two scatter levels, then an
    all-reduce level, since 96 / 8 = 12 pairs per lane split in halves only twice)."""
    check_decode(np.random.default_rng(d + splits), "float16", 1, 1, hq, 1, d, 60, [60],
                 num_splits=splits)


def test_merge_gathers_splits_in_batches():
    """8 rows (one lane group per row gathers every split) over 11 splits: the gather loads 8
    splits at head_dim 32, so a second, partial batch follows; the 3-key sequence leaves most
    of its splits empty (lse -inf) inside a batch."""
    check_decode(np.random.default_rng(13), "float16", 2, 1, 8, 1, 32, 90, [90, 3],
                 num_splits=11)


def test_splits_with_empty_and_one_key_sequences():
    """Every split of a length-0 sequence is empty (lse -inf); the merge must give 0 / -inf."""
    check_decode(np.random.default_rng(12), "float16", 3, 1, 2, 1, 32, 40, [37, 0, 1],
                 num_splits=3)


def test_mma_gqa_rows_past_one_tile():
    """18 packed rows (GQA 6 x 3 queries): two 16-row chunks, the second mostly padding."""
    check_decode(np.random.default_rng(11), "bfloat16", 1, 3, 6, 1, 32, 40, [38],
                 page_size=8, num_splits=2)


def test_num_splits_agree_to_rounding():
    rng = np.random.default_rng(7)
    outs = []
    for splits in (1, 2, 5):
        r = np.random.default_rng(7)
        out, lse = check_decode(r, "float16", 2, 1, 2, 1, 32, 70, [70, 33], num_splits=splits)
        outs.append((out.astype(np.float64), lse))
    for out, lse in outs[1:]:
        assert np.abs(out - outs[0][0]).max() <= 2e-3     # a few fp16 ulps of |o| < 1
        assert np.abs(lse - outs[0][1]).max() <= 1e-5
    del rng


def test_cpu_path_is_reference_per_sequence():
    rng = np.random.default_rng(3)
    q = rng.standard_normal((3, 2, 4, 16)).astype(np.float32)
    k, v, table = make_cache(rng, "float32", 3, 12, 2, 16, page_size=5)
    lens = np.array([12, 0, 7], dtype=np.int32)
    out, lse = numba_flash.decode(q, k, v, cache_seqlens=lens, block_table=table,
                                  window_size=(3, -1), sinks=1, return_lse=True)
    assert np.all(out[1] == 0) and np.all(np.isneginf(lse[1]))
    for i in (0, 2):
        n = int(lens[i])
        kb, vb = gather_cache(k, i, n, table)[None], gather_cache(v, i, n, table)[None]
        ref, ref_lse = reference(q[i:i + 1], kb, vb, causal=True, window_size=(3, -1), sinks=1,
                                 return_lse=True)
        assert np.allclose(out[i], ref[0], rtol=0, atol=1e-6)
        assert np.allclose(lse[i], ref_lse[0], atol=1e-6)
    # the same cache laid out contiguously gives the same answer
    kc = np.stack([gather_cache(k, i, 12, table) for i in range(3)])
    vc = np.stack([gather_cache(v, i, 12, table) for i in range(3)])
    out2 = numba_flash.decode(q, kc, vc, cache_seqlens=lens, window_size=(3, -1), sinks=1)
    assert np.array_equal(out, out2)


def test_cpu_tree_mask_sits_at_each_sequence_end():
    rng = np.random.default_rng(4)
    parents = [-1, 0, 1, 0]
    q = rng.standard_normal((2, 4, 2, 8))
    k = rng.standard_normal((2, 10, 1, 8))
    v = rng.standard_normal((2, 10, 1, 8))
    lens = np.array([10, 6], dtype=np.int32)
    out = numba_flash.decode(q, k, v, cache_seqlens=lens, mask=masks.tree(parents, 99))
    for i, n in enumerate(lens):
        ref = reference(q[i:i + 1], k[i:i + 1, :n], v[i:i + 1, :n], causal=True,
                        mask=TreeMask(parents, int(n) - 4))
        assert np.allclose(out[i], ref[0], atol=1e-12)
    # node 2's query (row 2) must not see node 3 nor ... but sees node 1 and the root
    vis = TreeMask(parents, 2).to_dense(4, 6)
    assert vis[2].tolist() == [True, True, True, True, True, False]


def test_tree_row_bits():
    bits = tree_row_bits(np.array([-1, 0, 0, 1]), 3)
    # query rows 0..2 are nodes 1..3: node1 -> {0,1}, node2 -> {0,2}, node3 -> {0,1,3}
    assert bits[:, 0].tolist() == [0b11, 0b101, 0b1011]
    assert bits[:, 1].tolist() == [0, 0, 0]


def test_geometry_and_split_heuristic():
    assert decode_geometry(128, 4) == (8, 16, 4)
    assert decode_geometry(128, 8) == (16, 8, 4)
    assert decode_geometry(128, 1) == (2, 64, 1)
    assert decode_geometry(256, 8) == (32, 8, 4)
    assert decode_geometry(96, 8) == (4, 24, 2)          # 12 chunks per row: LPK divides them
    for d, r in ((32, 8), (64, 3), (256, 1), (96, 1)):
        lpk, epl, u = decode_geometry(d, r)
        assert lpk * epl == d and epl % 8 == 0 and r * u <= 32 and u >= 1
        assert r * epl <= 64 or lpk == d // 8 or (d // 8) % (2 * lpk)
    assert auto_num_splits(blocks=32, keys=8192, sm_count=132) == 8
    assert auto_num_splits(blocks=64, keys=32768, sm_count=132) == 4    # one wave, no tail
    assert auto_num_splits(blocks=1024, keys=4096, sm_count=132) == 1
    assert auto_num_splits(blocks=1, keys=300, sm_count=132) == 1       # too few keys to split
    assert auto_num_splits(blocks=1, keys=10**6, sm_count=132) == 128
    # tensor-core kernel: one warp per unit, the count nearest 3 warps per SM, 4 for short splits
    assert auto_num_splits_mma(units=64, keys=32768, sm_count=132) == 6
    assert auto_num_splits_mma(units=8, keys=131072, sm_count=132) == 50    # 49.5 rounds up
    assert auto_num_splits_mma(units=256, keys=2048, sm_count=132) == 2     # 1.55 -> 2
    assert auto_num_splits_mma(units=32, keys=8192, sm_count=132) == 16    # 683 keys < 1024
    assert auto_num_splits_mma(units=32, keys=8192, sm_count=132, short_keys=0) == 12
    assert auto_num_splits_mma(units=8, keys=131072, sm_count=132, warps_per_sm=8,
                               short_keys=0) == 128                         # paged: capped
    assert auto_num_splits_mma(units=128, keys=16384, sm_count=132) == 3
    assert auto_num_splits_mma(units=64, keys=32768, sm_count=132, warps_per_sm=4,
                               short_keys=0) == 8                           # paged, pages 2^k
    assert auto_num_splits_mma(units=512, keys=4096, sm_count=132) == 1
    assert auto_num_splits_mma(units=1, keys=300, sm_count=132) == 1


def test_mma_tile_choice():
    """32-key tiles, 2 stages (paged caches too, unless the page size is not a power of two:
    16 x 3)."""
    assert mma_tile(128) == (32, 2, 1)
    assert mma_tile(128, paged=True) == (32, 2, 1)
    assert mma_tile(128, paged=True, pow2_pages=False) == (16, 3, 1)


def _paged_copy(rng, k, v, page):
    """The same cache scattered into shuffled pages of ``page`` rows (plus unused pages)."""
    b, smax, hkv, d = k.shape
    per = smax // page
    perm = rng.permutation(b * per + 2)
    table = perm[:b * per].reshape(b, per).astype(np.int32)
    kp = rng.standard_normal((b * per + 2, page, hkv, d)).astype(k.dtype)
    vp = rng.standard_normal((b * per + 2, page, hkv, d)).astype(k.dtype)
    kp[table.ravel()] = k.reshape(b * per, page, hkv, d)
    vp[table.ravel()] = v.reshape(b * per, page, hkv, d)
    return kp, vp, table


@pytest.mark.parametrize("page, opts", [
    (8, dict(num_splits=3)),
    (6, dict(num_splits=2, window_size=(17, -1), sinks=3)),      # sinks: the virtual axis jumps
    (16, dict(num_splits=2, window_size=(21, -1))),              # fast copies, unaligned tiles
])
def test_paged_same_bits_as_contiguous(monkeypatch, page, opts):
    """With one tile, paged and contiguous caches run the same arithmetic: identical bits
    (shuffled pages, a page size that is not a power of two, sinks, ragged ends, a power of
    two whose aligned tiles take the fast copy and unaligned ones the general one)."""
    decode_options(monkeypatch, tile=(16, 3, 1))
    rng = np.random.default_rng(page)
    b, hq, hkv, d, smax = 2, 4, 2, 32, 48 if SIMULATOR else 4800
    q = rng.standard_normal((b, 1, hq, d)).astype(np.float16)
    k = rng.standard_normal((b, smax, hkv, d)).astype(np.float16)
    v = rng.standard_normal((b, smax, hkv, d)).astype(np.float16)
    kp, vp, table = _paged_copy(rng, k, v, page)
    lens = np.array([smax - 5, smax // 3 + 1], dtype=np.int32)
    dq = _dev(q)
    outs = []
    for kk, vv, tb in ((k, v, None), (kp, vp, table)):
        outs.append(numba_flash.decode(dq, _dev(kk), _dev(vv), cache_seqlens=_dev_int(lens, dq),
                                       block_table=None if tb is None else _dev_int(tb, dq),
                                       return_lse=True, backend="cuda", **opts))
    (o1, l1), (o2, l2) = ((_host(o), _host(l)) for o, l in outs)
    assert not np.isnan(o1.astype(np.float32)).any()
    assert np.array_equal(o1, o2) and np.array_equal(l1, l2)


# ----------------------------------------------------------------------------- bad input

def _small(dtype=np.float16):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 1, 2, 32)).astype(dtype)
    k = rng.standard_normal((2, 9, 1, 32)).astype(dtype)
    return q, k, k.copy()


def test_cache_seqlens_beyond_capacity():
    q, k, v = _small()
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 10 is outside \[0, 9\]"):
        numba_flash.decode(q, k, v, cache_seqlens=np.array([3, 10], np.int32))
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\] = -1"):
        numba_flash.decode(q, k, v, cache_seqlens=np.array([-1, 1], np.int32))


def test_block_table_out_of_range():
    q, _, _ = _small()
    k = np.ones((4, 4, 1, 32), np.float16)
    table = np.array([[0, 1], [2, 4]], np.int32)
    with pytest.raises(ValueError, match=r"block_table\[1, 1\] = 4 is not a page index in \[0, 4\)"):
        numba_flash.decode(q, k, k, cache_seqlens=np.array([8, 8], np.int32), block_table=table)
    # pages beyond the sequence's length are never read, so they may hold anything
    numba_flash.decode(q, k, k, cache_seqlens=np.array([8, 4], np.int32), block_table=table)


@pytest.mark.parametrize("kwargs, exc, pattern", [
    (dict(cache_seqlens=np.array([1, 2], np.float32)), TypeError, "cache_seqlens must be int32"),
    (dict(cache_seqlens=np.array([1], np.int32)), ValueError, r"cache_seqlens must have shape"),
    (dict(block_table=np.zeros((2, 3), np.float32)), TypeError, "block_table must be int32"),
    (dict(block_table=np.zeros((3, 3), np.int32)), ValueError, "block_table must have shape"),
    (dict(num_splits=0), ValueError, "num_splits must be in"),
    (dict(num_splits="many"), ValueError, "num_splits must be 'auto'"),
    (dict(num_splits=2.0), TypeError, "num_splits must be 'auto'"),
    (dict(causal=1), TypeError, "causal must be a bool"),
])
def test_bad_arguments(kwargs, exc, pattern):
    q, k, v = _small()
    with pytest.raises(exc, match=pattern):
        numba_flash.decode(q, k, v, **kwargs)


def test_bad_shapes_and_dtypes():
    q, k, v = _small()
    with pytest.raises(TypeError, match="q, k_cache and v_cache must have the same dtype"):
        numba_flash.decode(q, k.astype(np.float32), v)
    with pytest.raises(TypeError, match="expected one of"):
        numba_flash.decode(q.astype(np.int16), k.astype(np.int16), v.astype(np.int16))
    with pytest.raises(ValueError, match="heads_q must be a multiple of heads_kv"):
        numba_flash.decode(q, np.ones((2, 9, 3, 32), np.float16), np.ones((2, 9, 3, 32), np.float16))
    with pytest.raises(ValueError, match="with batch 2"):
        numba_flash.decode(q, k[:1], v[:1])
    with pytest.raises(ValueError, match="same shape"):
        numba_flash.decode(q, k, v[:, :5])


def test_gpu_path_refusals():
    q, k, v = _small(np.float32)
    if SIMULATOR:
        with pytest.raises(TypeError, match="float16 or bfloat16"):
            numba_flash.decode(q, k, v, backend="cuda")
        q16, k16, v16 = _small()
        with pytest.raises(NotImplementedError, match="masks.tree only"):
            numba_flash.decode(q16, k16, v16, backend="cuda", mask=masks.causal())
        with pytest.raises(ValueError, match="at most 64"):
            numba_flash.decode(q16, k16, v16, backend="cuda",
                               mask=masks.tree([-1] + list(range(64))))


# ----------------------------------------------------------------------------- GPU only

@gpu
@pytest.mark.parametrize("ratio", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("page", [None, 16, 64])
def test_gpu_gqa_ratios_paged(ratio, dtype, page):
    rng = np.random.default_rng(ratio * 7 + (page or 0))
    check_decode(rng, dtype, 3, 1, 2 * ratio, 2, 128, 3000, [3000, 1, 1777], page_size=page)


@gpu
@pytest.mark.parametrize("splits", [1, 3, 16, 64])
def test_gpu_num_splits(splits):
    rng = np.random.default_rng(splits)
    check_decode(rng, "bfloat16", 2, 1, 8, 2, 128, 5000, [5000, 0], num_splits=splits)


@gpu
@pytest.mark.parametrize("d, ratio, splits", [(128, 1, 16), (128, 16, 7), (128, 32, 5),
                                              (64, 2, 5), (96, 4, 12), (32, 1, 9), (96, 3, 64)])
def test_gpu_merge_tails(d, ratio, splits):
    """The folded merge on every reduction depth: 1 to 16 rows per chunk (32: two chunks),
    head_dims whose reduce-scatter stops early, empty sequences."""
    rng = np.random.default_rng(d * 100 + ratio * 10 + splits)
    check_decode(rng, "float16", 2, 1, 2 * ratio, 2, d, 3000, [3000, 0], num_splits=splits)


@gpu
@pytest.mark.parametrize("d", [64, 96, 256])
def test_gpu_head_dims_and_options(d):
    rng = np.random.default_rng(d)
    check_decode(rng, "float16", 2, 3, 8, 2, d, 900, [900, 400], page_size=16,
                 window=(200, -1), sinks=4, softcap=20.0)


@gpu
def test_gpu_speculative_tree_64():
    rng = np.random.default_rng(5)
    parents = [-1] + [int(rng.integers(0, t)) for t in range(1, 64)]
    check_decode(rng, "bfloat16", 2, 64, 8, 2, 128, 2000, [2000, 100], page_size=64,
                 parents=parents)


@gpu
def test_gpu_check_indices():
    q, k, v = (cp.asarray(x) for x in _small())
    with pytest.raises(ValueError, match="outside"):
        numba_flash.decode(q, k, v, cache_seqlens=cp.asarray(np.array([3, 10], np.int32)),
                           check_indices=True)


@gpu
@pytest.mark.parametrize("kernel, tile", [("fma", None), ("mma", (16, 3, 1)), ("mma", (16, 2, 2))])
def test_gpu_kernel_variants(monkeypatch, kernel, tile):
    decode_options(monkeypatch, kernel=kernel, tile=tile)
    rng = np.random.default_rng(17)
    check_decode(rng, "float16", 3, 2, 8, 2, 128, 3000, [3000, 1, 1500], page_size=16,
                 window=(900, -1), sinks=4, num_splits=7)


@gpu
@pytest.mark.parametrize("splits", [1, 16])
def test_gpu_back_to_back_same_bits(splits):
    """Calls queued back to back on one stream (sharing the folded merge's counters and partial
    states) give identical bits."""
    rng = np.random.default_rng(29)
    q = cp.asarray(rng.standard_normal((1, 1, 32, 128)).astype(np.float16))
    k = cp.asarray(rng.standard_normal((1, 8192, 32, 128)).astype(np.float16))
    v = cp.asarray(rng.standard_normal((1, 8192, 32, 128)).astype(np.float16))
    lens = cp.asarray(np.array([8000], np.int32))
    runs = [numba_flash.decode(q, k, v, cache_seqlens=lens, num_splits=splits, return_lse=True)
            for _ in range(40)]
    for out, lse in runs:
        assert cp.array_equal(out, runs[0][0]) and cp.array_equal(lse, runs[0][1])


def test_stream_handles():
    """Streams reach the launch as raw handles: ints, Numba-like (a ctypes handle; None is the
    legacy default stream), CuPy / torch-like (``ptr`` / ``cuda_stream``); others raise."""
    import ctypes

    from numba_flash.cuda.launch.streams import raw_stream_handle

    class Numbaish:
        __module__ = "numba.cuda.cudadrv.driver"

        def __init__(self, value):
            self.handle = ctypes.c_void_p(value)

    class Cupyish:
        ptr = 99

    assert raw_stream_handle(7, None, None) == 7
    assert raw_stream_handle(Numbaish(1234), None, None) == 1234
    assert raw_stream_handle(Numbaish(None), None, None) == 0
    assert raw_stream_handle(Cupyish(), None, None) == 99
    with pytest.raises(TypeError, match="stream must be"):
        raw_stream_handle(object(), None, None)


@pytest.mark.parametrize("kernel, page, splits", [("mma", None, 3), ("mma", 8, 1),
                                                  ("fma", None, 3)])
def test_cache_seqlens_none_is_the_full_cache(monkeypatch, kernel, page, splits):
    """cache_seqlens=None (every sequence fills the cache): the tensor-core kernel reads no
    lengths (compiled with full_lens), the CUDA-core one gets a full-length array; both must
    give exactly what explicit full lengths give."""
    decode_options(monkeypatch, kernel=kernel)
    rng = np.random.default_rng(21)
    b, hq, hkv, d, smax = 2, 4, 2, 32, 48
    q = rng.standard_normal((b, 1, hq, d)).astype(np.float16)
    k, v, table = make_cache(rng, "float16", b, smax, hkv, d, page)
    dq, dk, dv = _dev(q), _dev(k), _dev(v)
    bt = None if table is None else _dev_int(table, dq)
    capacity = smax if table is None else table.shape[1] * page
    full = _dev_int(np.full(b, capacity, dtype=np.int32), dq)
    kw = dict(block_table=bt, num_splits=splits, return_lse=True, backend="cuda")
    out_none, lse_none = numba_flash.decode(dq, dk, dv, cache_seqlens=None, **kw)
    out_full, lse_full = numba_flash.decode(dq, dk, dv, cache_seqlens=full, **kw)
    assert np.array_equal(_host(out_none), _host(out_full))
    assert np.array_equal(_host(lse_none), _host(lse_full))
    ref = reference(q[:1].astype(np.float64), gather_cache(k, 0, capacity, table)[None].astype(
        np.float64), gather_cache(v, 0, capacity, table)[None].astype(np.float64), causal=True)
    assert np.abs(_host(out_none)[:1].astype(np.float64) - ref[:1]).max() < 2e-3


# The hint is on by default for one row chunk, so every layout runs with it in
# test_decode_against_reference; the hint-off side of the smallest layouts is in the full matrix.
@pytest.mark.parametrize("page, opts", [
    pytest.param(None, dict(num_splits=2), marks=pytest.mark.full_matrix),
    (8, dict(num_splits=2, window_size=(40, -1), sinks=3)),     # pages < tile, unaligned start
    pytest.param(64, dict(num_splits=1),                         # pages > tile, direct output
                 marks=pytest.mark.full_matrix),
])
def test_stream_hint_changes_no_bits(monkeypatch, page, opts):
    """The evict-first L2 hint of the fast copies only steers the cache: identical bits with it
    forced on and off."""
    rng = np.random.default_rng(37)
    b, hq, hkv, d = 2, 4, 2, 32
    smax = 100 if SIMULATOR else 3000
    q = rng.standard_normal((b, 1, hq, d)).astype(np.float16)
    k, v, table = make_cache(rng, "float16", b, smax, hkv, d, page)
    dq, dk, dv = _dev(q), _dev(k), _dev(v)
    lens = _dev_int(np.array([smax - 7, smax // 2 + 3], dtype=np.int32), dq)
    bt = None if table is None else _dev_int(table, dq)
    results = []
    for hint in (False, True):
        decode_options(monkeypatch, stream_hint=hint)
        out, lse = numba_flash.decode(dq, dk, dv, cache_seqlens=lens, block_table=bt,
                                      return_lse=True, backend="cuda", **opts)
        results.append((_host(out), _host(lse)))
    assert not np.isnan(results[0][0].astype(np.float32)).any()
    assert np.array_equal(results[0][0], results[1][0])
    assert np.array_equal(results[0][1], results[1][1])


@pytest.mark.parametrize("kernel", ["mma", "fma"])
def test_poisoned_indices_stay_in_bounds(monkeypatch, kernel):
    """GPU cache_seqlens / block_table are not read back, so the kernels clamp them: lengths
    past the capacity or negative, pages outside the pool. Nothing outside the arrays is
    touched (the simulator checks every index; compute-sanitizer on a GPU:
    scripts/sanitize_case.py), and the sequence with valid indices keeps its exact result."""
    rng = np.random.default_rng(41)
    q = rng.standard_normal((3, 1, 2, 32)).astype(np.float16)
    k, v, table = make_cache(rng, "float16", 3, 32, 1, 32, 8)
    table[1, 2] = 10_000                       # a page outside the pool
    table[2, 0] = -7
    lens = np.array([29, 10_000, -3], np.int32)
    out, lse = dec.decode_cuda(_dev(q), _dev(k), _dev(v), cache_seqlens=_dev_int(lens, q),
                               block_table=_dev_int(table, q), softmax_scale=32 ** -0.5,
                               num_splits=2, return_lse=True, kernel=kernel)
    out, lse = _host(out), _host(lse)
    kb, vb = (gather_cache(x, 0, 29, table)[None] for x in (k, v))
    ref = reference(q[:1], kb, vb, causal=True)
    assert np.abs(out[:1].astype(np.float64) - ref).max() < 2e-3
    assert np.isfinite(out.astype(np.float32)).all() and not np.isnan(lse).any()
