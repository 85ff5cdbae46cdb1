"""The GPU backward kernels (numba_flash.cuda.backward) against a dense float64 gradient.

Without a GPU these run in Numba's CUDA simulator on NumPy inputs: tiny shapes, small tiles
(``tiles=`` overrides the geometry), each code path once. Larger sweeps are marked ``gpu``.

Error rules: float32 within 1e-5 and float64 within 1e-10 of the float64 gradient (relative to
its largest element); float16 / bfloat16 at most 2x the error of the same dense computation
with its intermediates rounded to the input dtype, plus a tiny atol (flash-attn's rule).
"""
from __future__ import annotations

import zlib
import numpy as np
import pytest

from numba_flash.cuda.launch.backward import backward_kernels as backward_cuda
from numba_flash.cuda.primitives import SIMULATOR
from numba_flash import masks
from numba_flash_reference import masks as M
from numba_flash_reference.masks import visible_matrix

from gpu_arrays import BF16, gpu, to_device, to_host

DTYPES = {"float16": np.dtype(np.float16), "bfloat16": BF16, "float32": np.dtype(np.float32),
          "float64": np.dtype(np.float64)}
ATOL = {"float16": 1e-4, "bfloat16": 5e-4}
RTOL = {"float32": 1e-5, "float64": 1e-10}
# A float32 lse bounds float64 gradients to ~1e-7 relative: the float64 path takes a float64 lse.
LSE_DTYPE = {"float64": np.float64}


def dense_grads(q, k, v, dout, scale, visible, softcap=None, rnd=lambda x: x, bias=None):
    """out, lse, dq, dk, dv of dense attention in float64; ``rnd`` rounds each intermediate
    (scores, P, dP, dS, outputs) to a working precision for the naive same-dtype error;
    ``bias``: added to the scores after the softcap (ALiBi), broadcast to (B, H, Sq, Sk)."""
    q, k, v, dout = (x.astype(np.float64) for x in (q, k, v, dout))
    ratio = q.shape[2] // k.shape[2]
    kk, vv = np.repeat(k, ratio, axis=2), np.repeat(v, ratio, axis=2)
    s = rnd(np.einsum("bqhd,bkhd->bhqk", q, kk) * scale)
    t = np.tanh(s / softcap) if softcap else None
    if softcap:
        s = rnd(softcap * t)
    if bias is not None:
        s = rnd(s + bias)
    s = np.where(visible, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    l = e.sum(axis=-1, keepdims=True)
    p = rnd(np.divide(e, l, out=np.zeros_like(e), where=l > 0))
    out = rnd(np.einsum("bhqk,bkhd->bqhd", p, vv))
    seen = l[..., 0] > 0
    lse = np.where(seen, m[..., 0] + np.log(np.where(seen, l[..., 0], 1.0)), -np.inf)
    dv = np.einsum("bhqk,bqhd->bkhd", p, dout)
    dp = rnd(np.einsum("bqhd,bkhd->bhqk", dout, vv))
    delta = np.einsum("bqhd,bqhd->bhq", dout, out)[..., None]
    ds = rnd(p * (dp - delta) * ((1 - t * t) if softcap else 1))
    dq = scale * np.einsum("bhqk,bkhd->bqhd", ds, kk)
    dk = scale * np.einsum("bhqk,bqhd->bkhd", ds, q)
    dk, dv = (x.reshape(x.shape[:2] + (k.shape[2], ratio, x.shape[3])).sum(axis=3)
              for x in (dk, dv))
    return out, lse, rnd(dq), rnd(dk), rnd(dv)


def _random(rng, shape, dtype_name):
    return rng.standard_normal(shape).astype(DTYPES[dtype_name])


def alibi_bias(slopes, b, hq, sq, sk):
    """The ALiBi scores' bias -slope * |i + Sk - Sq - j|, (B, Hq, Sq, Sk) float64, of float32
    slopes (Hq,) or (B, Hq)."""
    dist = np.abs(np.arange(sq)[:, None] + (sk - sq) - np.arange(sk)[None, :])
    per_head = np.broadcast_to(slopes.astype(np.float64), (b, hq))
    return -per_head[:, :, None, None] * dist


def run_case(rng, dtype_name, b, sq, sk, hq, hkv, d, causal=False, window=(-1, -1), sinks=0,
             softcap=None, mask=None, deterministic=False, tiles=None, alibi=None):
    """Run backward_cuda on random inputs (NaN-poisoned preallocated outputs) and check the
    error rule; returns the host gradients. ``alibi``: float32 slopes (Hq,) or (B, Hq)."""
    dt = DTYPES[dtype_name]
    q, dout = _random(rng, (b, sq, hq, d), dtype_name), _random(rng, (b, sq, hq, d), dtype_name)
    k, v = _random(rng, (b, sk, hkv, d), dtype_name), _random(rng, (b, sk, hkv, d), dtype_name)
    scale = d ** -0.5
    vis = visible_matrix(sq, sk, causal=causal, window_size=window, sinks=sinks, mask=mask)
    bias = None if alibi is None else alibi_bias(alibi, b, hq, sq, sk)
    out, lse, *ref = dense_grads(q, k, v, dout, scale, vis, softcap, bias=bias)
    outs = [to_device(np.full(x.shape, np.nan, dt)) for x in (q, k, v)]
    lse = lse.astype(LSE_DTYPE.get(dtype_name, np.float32))
    got = backward_cuda(*(to_device(x) for x in (dout, q, k, v, out.astype(dt), lse)),
                        softmax_scale=scale, causal=causal,
                        window_size=window, sinks=sinks, softcap=softcap, mask=mask,
                        deterministic=deterministic, dq=outs[0], dk=outs[1], dv=outs[2],
                        tiles=tiles, alibi_slopes=None if alibi is None else to_device(alibi))
    got = [to_host(x).astype(np.float64) for x in got]
    if dtype_name in RTOL:
        for name, g, r in zip("qkv", got, ref):
            err = np.abs(g - r).max()
            assert err <= RTOL[dtype_name] * max(1.0, np.abs(r).max()), (f"d{name}", err)
    else:
        work = np.float32
        rnd = lambda x: x.astype(dt).astype(work).astype(np.float64)  # noqa: E731
        naive = dense_grads(q, k, v, dout, scale, vis, softcap, rnd, bias)[2:]
        for name, g, r, n in zip("qkv", got, ref, naive):
            err, naive_err = np.abs(g - r).max(), np.abs(n - r).max()
            assert err <= 2 * naive_err + ATOL[dtype_name], (f"d{name}", err, naive_err)
    return got


# Simulator-sized cases: (dtype, b, sq, sk, hq, hkv, d, causal, window, sinks, softcap)
FMA_TILES = (2, 32, 16)        # 2 lanes per key / row, 32 owned, 16 streamed: 64 threads
FMA_CASES = [
    ("float32", 1, 17, 23, 2, 1, 16, False, (-1, -1), 0, None),     # GQA 2, odd sizes
    ("float64", 1, 23, 17, 1, 1, 16, True, (-1, -1), 0, None),      # causal, Sq > Sk
    ("float32", 1, 17, 40, 1, 1, 16, True, (-1, -1), 0, 2.0),       # 2 key tiles, softcap
    ("float64", 1, 40, 37, 1, 1, 16, False, (5, 2), 3, None),       # window + sinks
]


@pytest.mark.parametrize("case", FMA_CASES, ids=lambda c: "-".join(map(str, c)))
def test_fma_against_dense(case):
    dtype_name, b, sq, sk, hq, hkv, d, causal, window, sinks, softcap = case
    rng = np.random.default_rng(zlib.crc32(repr(case).encode()))
    run_case(rng, dtype_name, b, sq, sk, hq, hkv, d, causal, window, sinks, softcap,
             tiles=FMA_TILES)


MMA_TILES = (1, 16, 16)        # 1 warp owning 16 keys / rows, 16-row / -key streamed tiles
MMA_CASES = [
    ("float16", 1, 17, 23, 2, 1, 16, False, (-1, -1), 0, None, False),   # GQA 2, odd sizes
    ("bfloat16", 1, 23, 17, 1, 1, 32, True, (-1, -1), 0, 3.0, False),    # causal, softcap
    ("float16", 1, 17, 40, 1, 1, 16, False, (5, 2), 3, None, True),      # window + sinks, det.
]
# 2 warps, 64-row query tiles in four 16-row slices, both shared buffers, dQ units shared
# between the warps: the default layout's code paths at a simulator size.
WIDE_TILES = (2, 32, 64)


@pytest.mark.parametrize("case", MMA_CASES, ids=lambda c: "-".join(map(str, c)))
def test_mma_against_dense(case):
    dtype_name, b, sq, sk, hq, hkv, d, causal, window, sinks, softcap, det = case
    rng = np.random.default_rng(zlib.crc32(repr(case).encode()))
    run_case(rng, dtype_name, b, sq, sk, hq, hkv, d, causal, window, sinks, softcap,
             deterministic=det, tiles=MMA_TILES)


def test_mma_wide_tiles():
    # One head in the simulator (GQA on these tiles: test_alibi's bfloat16 case), two on a GPU.
    hq = 1 if SIMULATOR else 2
    run_case(np.random.default_rng(7), "float16", 1, 150, 45, hq, 1, 16, True, tiles=WIDE_TILES)


def test_mma_dq_units_tile_any_head_dim():
    """head_dim 80: the atomic dQ product's column units (16 wide here) cover every column
    (64-wide units once left columns 64-79 unwritten)."""
    run_case(np.random.default_rng(5), "bfloat16", 1, 19, 21, 1, 1, 80, False, tiles=MMA_TILES)


def test_mma_split_head_columns():
    """Two warps share 16 keys, each accumulating half of dK's and dV's columns (the layout of
    head_dim 160-256), GQA and a causal tail at a simulator size."""
    run_case(np.random.default_rng(11), "float16", 1, 37, 21, 2, 1, 32, True, tiles=(2, 16, 16))


# (dtype, tiles, deterministic, mask, causal, n): each reaches skipped, fully visible and
# partial (query tile, key tile) pairs of the kernels it runs.
INTERVAL_CASES = [
    ("float32", (2, 32, 8), False, M.CausalDocumentMask([9, 14, 17]), False, 40),
    ("float64", (2, 32, 16), True, M.DocumentMask([24, 40]), False, 64),
    ("bfloat16", (1, 16, 16), True, M.DocumentMask([16, 32]), True, 48),
    ("float16", WIDE_TILES, False, M.DocumentMask([64, 30, 36]), False, 130),
    # runs of several skipped query tiles before and after each document (the walk's jumps)
    ("float16", MMA_TILES, False, M.CausalDocumentMask([41, 6, 50, 33]), False, 130),
]


def test_intervals_with_window_and_sinks():
    """Interval mask intersected with a window and sinks on the tensor-core dK / dV kernel: the
    row masks of ``key_rows`` (window run, sinks' rows, the key's masked intervals) at once."""
    run_case(np.random.default_rng(12), "float16", 1, 40, 40, 1, 1, 16, window=(12, 0),
             sinks=4, mask=M.CausalDocumentMask([15, 10, 15]), tiles=MMA_TILES)


@pytest.mark.parametrize("case", INTERVAL_CASES, ids=lambda c: f"{c[0]}-{c[3]!r}-{c[4]}")
def test_intervals_mask(case):
    """FlashMask column intervals, alone and intersected with the causal flag."""
    dtype_name, tiles, det, mask, causal, n = case
    rng = np.random.default_rng(5)
    run_case(rng, dtype_name, 1, n, n, 1, 1, 16, causal, mask=mask, deterministic=det,
             tiles=tiles)


def _every_third_causal(b, h, q_idx, kv_idx):
    """A mask_mod (one function object: its kernels compile once per session)."""
    return kv_idx <= q_idx and (q_idx - kv_idx) % 3 != 1


# (dtype, tiles, deterministic, mask factory of n, n, query heads in the simulator): masks
# without column intervals: a draft tree in BFS order and a random matrix (packed bitmask), a
# mask_mod (compiled in). GQA 2 (one kv head) on a GPU; in the simulator where a case of the
# same kernel and encoding does not already reach it.
OTHER_MASK_CASES = [
    ("float32", FMA_TILES, False, lambda n: masks.tree([-1, 0, 1, 1, 2, 2, 3, 3, 4], n - 9), 41,
     2),
    ("float16", MMA_TILES, True, lambda n: masks.tree([-1, 0, 1, 1, 2, 2, 3, 3, 4], n - 9), 41,
     2),
    ("bfloat16", WIDE_TILES, False,
     lambda n: masks.from_dense(np.random.default_rng(n).random((n, n)) < 0.6), 70, 1),
    ("float64", FMA_TILES, True, lambda n: masks.mask_mod(_every_third_causal), 40, 1),
    ("float16", MMA_TILES, False, lambda n: masks.mask_mod(_every_third_causal), 33, 2),
]


@pytest.mark.parametrize("case", OTHER_MASK_CASES,
                         ids=lambda c: f"{c[0]}-{c[3](c[4]).__class__.__name__}-det{c[2]}")
def test_bitmask_and_mask_mod(case):
    """Class tables built for the backward's tiles; per-element bits or the user's function in
    partial tiles (each case reaches skipped, full and partial tiles)."""
    dtype_name, tiles, det, make, n, hq = case
    run_case(np.random.default_rng(8), dtype_name, 1, n, n, hq if SIMULATOR else 2, 1, 16,
             mask=make(n), deterministic=det, tiles=tiles)


# (dtype, tiles, deterministic, slopes shape, flags)
ALIBI_CASES = [
    ("float32", FMA_TILES, True, (2,), dict(causal=True)),
    # 9 (batch, head) rows: the dK / dV blocks' order takes a group of 8 rows, then one
    # (kernels/backward.py key_block); per-(b, h) slopes catch a wrong row
    ("float16", MMA_TILES, False, (3, 3), dict(window=(9, 4))),
    ("bfloat16", WIDE_TILES, True, (2, 2), dict(causal=True, softcap=4.0)),
]


@pytest.mark.parametrize("case", ALIBI_CASES, ids=lambda c: f"{c[0]}-{c[3]}-det{c[2]}")
def test_alibi(case):
    """Scores less slope * distance when P is recomputed; per-head (Hq,) and per-batch (B, Hq)
    slopes."""
    dtype_name, tiles, det, shape, flags = case
    rng = np.random.default_rng(9)
    slopes = rng.uniform(0.05, 0.5, shape).astype(np.float32)
    batch = shape[0] if len(shape) == 2 else 1      # per-batch slopes need two sequences
    # 2+ key blocks and query tiles of each layout, Sq != Sk (the distance's offset); larger
    # on a GPU
    sq, sk = (17, 33) if SIMULATOR else (37, 45)
    run_case(rng, dtype_name, batch, sq, sk, shape[-1], 1, 16, deterministic=det, tiles=tiles,
             alibi=slopes, **flags)


def _check_rule(dtype_name, got, ref, naive):
    """The error rule of the module docstring on lists of (dq, dk, dv)."""
    for name, g, r, n in zip("qkv", got, ref, naive):
        if dtype_name in RTOL:
            err = np.abs(g - r).max()
            assert err <= RTOL[dtype_name] * max(1.0, np.abs(r).max()), (f"d{name}", err)
        else:
            err, naive_err = np.abs(g - r).max(), np.abs(n - r).max()
            assert err <= 2 * naive_err + ATOL[dtype_name], (f"d{name}", err, naive_err)


def run_varlen_case(rng, dtype_name, lens_q, lens_k, hq, hkv, d, causal=False, window=(-1, -1),
                    mask=None, deterministic=False, tiles=None):
    """A packed batch (sequences of lens_q / lens_k rows) against per-sequence dense gradients
    (NaN-poisoned preallocated outputs)."""
    from numba_flash.varlen import Varlen

    dt = DTYPES[dtype_name]
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lens_q, lens_k))
    q, dout = (_random(rng, (cu_q[-1], hq, d), dtype_name) for _ in range(2))
    k, v = (_random(rng, (cu_k[-1], hkv, d), dtype_name) for _ in range(2))
    scale = d ** -0.5
    work = np.float32 if dtype_name in ATOL else np.float64
    rnd = lambda x: x.astype(dt).astype(work).astype(np.float64)  # noqa: E731
    out = np.zeros(q.shape)
    lse = np.full((hq, cu_q[-1]), -np.inf)
    ref = [np.zeros(x.shape) for x in (q, k, v)]
    naive = [np.zeros(x.shape) for x in (q, k, v)]
    for s in range(len(lens_q)):
        rq, rk = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        if lens_q[s] == 0 or lens_k[s] == 0:
            continue
        vis = visible_matrix(lens_q[s], lens_k[s], causal=causal, window_size=window, mask=mask)
        parts = [x[None, r] for x, r in ((q, rq), (k, rk), (v, rk), (dout, rq))]
        o, l, *grads = dense_grads(*parts, scale, vis)
        out[rq], lse[:, rq] = o[0], l[0]
        for acc, g, r in zip(ref, grads, (rq, rk, rk)):
            acc[r] = g[0]
        for acc, g, r in zip(naive, dense_grads(*parts, scale, vis, rnd=rnd)[2:], (rq, rk, rk)):
            acc[r] = g[0]
    packed = Varlen(len(lens_q), to_device(cu_q), to_device(cu_k), max(lens_q), max(lens_k),
                    None, None)
    outs = [to_device(np.full(x.shape, np.nan, dt)) for x in (q, k, v)]
    got = backward_cuda(*(to_device(x) for x in (dout, q, k, v, out.astype(dt))),
                        to_device(lse.astype(LSE_DTYPE.get(dtype_name, np.float32))),
                        softmax_scale=scale, causal=causal, window_size=window, mask=mask,
                        varlen=packed, deterministic=deterministic, dq=outs[0], dk=outs[1],
                        dv=outs[2], tiles=tiles)
    _check_rule(dtype_name, [to_host(x).astype(np.float64) for x in got], ref, naive)


# (dtype, tiles, deterministic, flags, query heads in the simulator): sequences of 17 / 21,
# 0 / 3 (keys nobody sees: dK = dV = 0), 9 / 9 and 23 / 19 (rows that see no key under causal)
# query / key rows, one kv head. GQA 2 on a GPU, and in the simulator once per kernel (CUDA
# cores, tensor cores): the others run one head (a packed batch always takes the partials).
VARLEN_CASES = [
    ("float32", FMA_TILES, False, dict(causal=True), 2),
    ("float64", FMA_TILES, True, dict(window=(5, 2)), 1),
    ("float16", MMA_TILES, True, dict(causal=True), 2),
    ("bfloat16", WIDE_TILES, False, dict(mask=masks.mask_mod(_every_third_causal)), 1),
]


@pytest.mark.parametrize("case", VARLEN_CASES, ids=lambda c: f"{c[0]}-det{c[2]}")
def test_varlen(case):
    """Packed batches: each block finds its sequence in cu_seqlens; rows outside every
    sequence's reach get zero gradients."""
    dtype_name, tiles, det, flags, hq = case
    run_varlen_case(np.random.default_rng(10), dtype_name, [17, 0, 9, 23], [21, 3, 9, 19],
                    hq if SIMULATOR else 2, 1, 16, deterministic=det, tiles=tiles, **flags)


@pytest.mark.parametrize("dtype_name,tiles", [("float32", FMA_TILES), ("float16", MMA_TILES)])
def test_deterministic_bitwise(dtype_name, tiles):
    kw = dict(window=(6, -1), sinks=2, deterministic=True, tiles=tiles)
    a = run_case(np.random.default_rng(6), dtype_name, 1, 17, 23, 2, 1, 16, True, **kw)
    b = run_case(np.random.default_rng(6), dtype_name, 1, 17, 23, 2, 1, 16, True, **kw)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))


@gpu
@pytest.mark.parametrize("dtype_name", ["float32", "float64", "float16", "bfloat16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal,window,sinks,softcap,det", [
    (False, (-1, -1), 0, None, False), (True, (-1, -1), 0, None, True),
    (False, (-1, -1), 0, None, True), (False, (100, 30), 4, None, False),
    (True, (-1, -1), 0, 5.0, False)])
def test_gpu_sweep(dtype_name, d, causal, window, sinks, softcap, det):
    rng = np.random.default_rng(d)
    run_case(rng, dtype_name, 2, 257, 300, 4, 2, d, causal, window, sinks, softcap,
             deterministic=det)


@gpu
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("d", [80, 96, 112, 160, 192, 256])
@pytest.mark.parametrize("causal,det", [(False, False), (True, False), (True, True)])
def test_gpu_wide_heads(dtype_name, d, causal, det):
    """head_dims other than 64 / 128 at the default tiles: 16-bit dQ units of 48 / 32 / 16
    columns, two warps per 16 keys above 128 (mma_dsplit); the CUDA-core layouts; GQA, odd
    lengths, deterministic dQ."""
    rng = np.random.default_rng(d + causal)
    run_case(rng, dtype_name, 1, 201, 333, 4, 2, d, causal, deterministic=det)


@gpu
@pytest.mark.parametrize("dtype_name", ["float32", "float64", "float16", "bfloat16"])
@pytest.mark.parametrize("option", ["bitmask", "mask_mod", "alibi", "varlen"])
def test_gpu_options(dtype_name, option):
    """ALiBi, bitmask / mask_mod masks and packed batches at the default tiles (head_dim 128)."""
    rng = np.random.default_rng(11)
    n, det = 300, dtype_name == "float64"
    if option == "varlen":
        run_varlen_case(rng, dtype_name, [257, 0, 64, 300], [300, 17, 64, 211], 4, 2, 128,
                        causal=True, deterministic=det)
    elif option == "alibi":
        slopes = rng.uniform(0.01, 0.2, 4).astype(np.float32)
        run_case(rng, dtype_name, 2, 257, n, 4, 2, 128, causal=True, alibi=slopes,
                 deterministic=det)
    else:
        mask = (masks.from_dense(np.random.default_rng(3).random((n, n)) < 0.5)
                if option == "bitmask" else masks.mask_mod(_every_third_causal))
        run_case(rng, dtype_name, 2, n, n, 4, 2, 128, mask=mask, deterministic=det)


@gpu
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("det", [False, True])
def test_gpu_interval_masks(dtype_name, d, det):
    """Interval masks at the default tiles (the wgmma dK / dV kernel on sm_90: each block's
    staged bounds, 300 keys = two full 128-key blocks and a clamped tail): skipped, full and
    partial tiles of document and shared-question masks, GQA."""
    rng = np.random.default_rng(d + det)
    for mask in (masks.causal_document([37, 150, 113]),
                 masks.shared_question([120, 180], [30, 50], [[40, 50], [60, 70]])):
        run_case(rng, dtype_name, 1, 300, 300, 4, 2, d, mask=mask, deterministic=det)


@pytest.mark.skipif(not SIMULATOR, reason="NumPy arrays reach the kernels only in the simulator")
def test_public_door_runs_the_kernels():
    """numba_flash.attention_backward(backend='cuda') reaches the kernels (simulator: NumPy
    arrays) and agrees with CPU mode (also with ALiBi and a bitmask mask, and on a packed
    batch)."""
    import numba_flash

    rng = np.random.default_rng(5)
    q, dout = (rng.standard_normal((1, 17, 2, 16)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((1, 23, 1, 16)).astype(np.float32) for _ in range(2))
    out, lse = numba_flash.attention(q, k, v, causal=True, return_lse=True)
    kernel = numba_flash.attention_backward(dout, q, k, v, out, lse, causal=True, backend="cuda")
    exact = numba_flash.attention_backward(dout, q, k, v, out, lse, causal=True, backend="cpu")
    for a, b in zip(kernel, exact):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(b).max())
    kw = dict(alibi_slopes=np.array([0.3, 0.1], np.float32),
              mask=numba_flash.masks.tree([-1, 0, 0, 1], 19))
    out, lse = numba_flash.attention(q, k, v, return_lse=True, **kw)
    kernel = numba_flash.attention_backward(dout, q, k, v, out, lse, backend="cuda", **kw)
    exact = numba_flash.attention_backward(dout, q, k, v, out, lse, backend="cpu", **kw)
    for a, b in zip(kernel, exact):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(b).max())
    cu_q, cu_k = np.array([0, 7, 17], np.int32), np.array([0, 10, 23], np.int32)
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=10, max_seqlen_k=13,
              causal=True)
    out, lse = numba_flash.attention(q[0], k[0], v[0], return_lse=True, **kw)
    kernel = numba_flash.attention_backward(dout[0], q[0], k[0], v[0], out, lse, backend="cuda",
                                            **kw)
    exact = numba_flash.attention_backward(dout[0], q[0], k[0], v[0], out, lse, backend="cpu",
                                           **kw)
    for a, b in zip(kernel, exact):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(b).max())


def test_row_alignment_check_takes_packed_arrays():
    """The 16-byte alignment check of the forward / backward / decode launches looks at the
    axes before head_dim: a packed batch's contiguous (total, heads, head_dim) array passes, a
    view whose rows sit 8 bytes apart does not, nor one 8 bytes past a 16-byte boundary; the
    strides of length-1 axes do not count."""
    from numba_flash.cuda.launch.arrays import check_rows_aligned

    base = np.zeros((64 + 16,), np.float16)
    offset = (-base.ctypes.data % 16) // 2            # an element on a 16-byte boundary
    packed = base[offset:offset + 64].reshape(4, 1, 16)
    check_rows_aligned("the test", q=packed, k=packed.reshape(1, 4, 1, 16))
    odd = np.zeros((8, 1, 32), np.float16)[:, :, :4]  # rows 64 bytes apart: fine
    check_rows_aligned("the test", q=odd)
    with pytest.raises(ValueError, match=r"q must be 16-byte aligned .*strides \(8, 8, 2\)"):
        check_rows_aligned("the test", q=base[offset:offset + 64].reshape(16, 1, 4))
    with pytest.raises(ValueError, match="k must be .* a pointer 8 bytes past"):
        check_rows_aligned("the test", k=base[offset + 4:offset + 68].reshape(4, 1, 16))
    # A length-1 axis may carry any stride (as torch reports after some views): exempt.
    ones = np.lib.stride_tricks.as_strided(packed, (1, 4, 1, 16), (2, 32, 6, 2))
    check_rows_aligned("the test", q=ones)


def test_wgmma_dkdv_compiles_offline():
    """The sm_90 dK / dV kernel (kernels/backward_wgmma.py; the simulator cannot run wgmma)
    assembles with every product on warpgroup instructions and no local memory: per query tile
    S^T and dP^T (head_dim / 16 k-steps each), dV and dK (4 each), dQ (one per 16 of the
    block's keys: 8 at head_dim 64 / 128, 4 at 256), and none of them serialised by ptxas, and
    no register that an in-flight product reads as its A operand written before the wait that
    retires it. Three configurations (~10 s of compiling each: CI runs this where the NVIDIA
    wheels bring NVVM and ptxas; skipped where they are missing);
    scripts/sass_snapshot_backward.py has the wider set. The register allocation depends on the
    ptxas release: what the GPU runs is checked by test_runtime_wgmma_kernels_keep_a_operands."""
    from offline_sass import run_offline

    lines = run_offline(
        "import sys; sys.path.insert(0, 'scripts'); sys.path.insert(0, 'tests')\n"
        "import kernel_resources as kr\n"
        "import sass_snapshot_backward as sb\n"
        "from numba_flash.cuda.kernels import backward_wgmma as bwg\n"
        "for d, bf16, causal, atomic, kind in ((128, False, False, True, 0),\n"
        "                                      (64, False, False, True, 0),\n"
        "                                      (256, True, True, True, 0)):\n"
        "    kern = bwg.make_wgmma_dkdv_kernel(d, bf16, False, causal, False, False, atomic, kind)\n"
        "    sig = sb._signature(kern.py_func, True, True, False)\n"
        "    r = kr.report(kern.py_func, sig, cc=(9, 0, 'a'))\n"
        "    print(r['sass'].count('HGMMA'), r['n_ldl'], r['spill_stores'],\n"
        "          'serialized' in r['ptxas_info'], r['a_overwrites'])\n")
    assert lines == ["32 0 0 False 0", "24 0 0 False 0", "44 0 0 False 0"], lines


def _runtime_cubins(dispatcher):
    """The cubins the runtime launches for ``dispatcher``: compiled in this process (Numba's,
    linked by this machine's nvJitLink or driver) or loaded from their image on disk."""
    from numba_flash.cuda.launch import driver

    cubins = [c._codelibrary.get_cubin() for c in dispatcher.overloads.values()]
    cubins += [loaded.module for (owner, _, _), loaded in driver._LOADED.items()
               if owner == id(dispatcher)]
    return [getattr(c, "code", c) for c in cubins]


@gpu
def test_runtime_wgmma_kernels_keep_a_operands():
    """The sm_90 dK / dV kernels as the GPU runs them never write a register that an in-flight
    product reads as its A operand (kernel_resources.a_operand_overwrites on the launched
    cubin). The offline test cannot stand for this: the lent H200s link with ptxas 13.0,
    whose allocation reused such registers in a loop where ptxas 13.5's did not (the pipelined
    head_dim 64 loop, removed 2026-11-27: 81-84 writes, wrong dK in deterministic mode)."""
    import os
    import subprocess
    import sys
    import tempfile

    from offline_sass import ROOT

    cp = pytest.importorskip("cupy")
    import numba_flash
    from numba_flash.cuda.launch import attention as runtime, backward as lb

    if not runtime.wgmma_device():
        pytest.skip("needs a compute-capability 9.0 GPU (wgmma)")
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        import kernel_resources as kr
    finally:
        sys.path.pop(0)

    try:
        cuobjdump = kr._tool("cuobjdump")
    except SystemExit:
        pytest.skip("cuobjdump not available")
    rng = np.random.default_rng(3)
    for d in (64, 128, 256):
        for causal, det in ((False, False), (True, False), (False, True), (True, True)):
            q, k, v, do = (cp.asarray(rng.standard_normal((1, 200, 2, d)).astype(np.float16))
                           for _ in range(4))
            out, lse = numba_flash.attention(q, k, v, causal=causal, return_lse=True)
            numba_flash.attention_backward(do, q, k, v, out, lse, causal=causal,
                                           deterministic=det)
    scanned = {}
    for key, kern in lb._KERNELS.items():
        for cubin in _runtime_cubins(kern):
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(cubin)
                f.flush()
                sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True,
                                      text=True, check=True).stdout
            if "HGMMA" in sass:
                scanned[str(key)] = kr.a_operand_overwrites(sass)
    assert len(scanned) >= 12, scanned          # 3 head dims x (atomic, deterministic) x causal
    assert all(n == 0 for n in scanned.values()), scanned
