"""Small decode and merge launches for compute-sanitizer (memcheck, racecheck) on a GPU.

    compute-sanitizer --tool memcheck --report-api-errors no python scripts/sanitize_decode.py
    compute-sanitizer --tool racecheck --report-api-errors no python scripts/sanitize_decode.py

Covers each decode kernel (tensor-core: direct and split with the merge folded in,
contiguous and paged (sinks, a 6-row page), group 1, back-to-back launches on one stream,
ragged lengths 0 / 1, a draft
tree, a window with sinks; the CUDA-core kernel at head_dim 256 and forced through the runtime's
``kernel="fma"``), the merge kernel (merge_states on float32 GPU states), and poisoned indices
that the kernels must clamp (cache_seqlens past the capacity or negative, block-table entries
outside the pool, decreasing / out-of-range cu_seqlens, for varlen attention and its backward),
then checks every output against the CPU path (the poisoned cases for finite outputs).
"""
from __future__ import annotations

import functools

import cupy as cp
import numpy as np

import numba_flash
from numba_flash import masks
from numba_flash.cuda.launch import decode as runtime
from numba_flash.cuda.launch.attention import attention_cuda
from numba_flash.cuda.launch.backward import backward_kernels
from numba_flash.varlen import Varlen


def case(rng, b, sq, hq, hkv, d, smax, lens, page=None, **kw):
    q = rng.standard_normal((b, sq, hq, d)).astype(np.float16)
    if page is None:
        k = rng.standard_normal((b, smax, hkv, d)).astype(np.float16)
        table = None
    else:
        per = -(-smax // page)
        k = rng.standard_normal((b * per + 2, page, hkv, d)).astype(np.float16)
        table = rng.permutation(b * per + 2)[:b * per].reshape(b, per).astype(np.int32)
    v = rng.standard_normal(k.shape).astype(np.float16)
    lens = None if lens is None else np.asarray(lens, np.int32)   # None: full caches
    args = dict(cache_seqlens=lens, block_table=table, **kw)
    out = numba_flash.decode(*(cp.asarray(x) for x in (q, k, v)),
                             **{n: (cp.asarray(x) if isinstance(x, np.ndarray) else x)
                                for n, x in args.items()}, backend="cuda")
    ref = numba_flash.decode(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32),
                             **args)
    err = float(np.abs(cp.asnumpy(out).astype(np.float32) - ref).max())
    assert err < 2e-2, err
    return err


def poisoned(rng, kernel):
    """Lengths past the capacity or negative, pages outside the pool: clamped in the kernel."""
    q = cp.asarray(rng.standard_normal((3, 1, 8, 128)).astype(np.float16))
    pool = cp.asarray(rng.standard_normal((20, 16, 2, 128)).astype(np.float16))
    table = cp.asarray(np.array([[0, 1, 2, 3], [4, 10_000, 6, 7], [-9, 8, 9, 10]], np.int32))
    lens = cp.asarray(np.array([60, 10_000, -4], np.int32))
    for splits in (1, 3):
        out = runtime.decode_cuda(q, pool, pool, cache_seqlens=lens, block_table=table,
                                  softmax_scale=128 ** -0.5, num_splits=splits, kernel=kernel)
        assert bool(cp.isfinite(out.astype(cp.float32)).all())


def poisoned_varlen(rng):
    """Decreasing, negative and past-the-end cu_seqlens (never read back on the GPU)."""
    for dtype in (cp.float16, cp.float32):
        q, k, v = (cp.asarray(rng.standard_normal((300, 4, 64))).astype(dtype) for _ in range(3))
        cu = cp.asarray(np.array([0, 100, 400, 250, -7, 300], np.int32))
        out = attention_cuda(q, k, v, softmax_scale=0.125, causal=True,
                             varlen=Varlen(5, cu, cu, 120, 120, None, None))
        assert bool(cp.isfinite(out.astype(cp.float32)).all())
        # The backward's packed-batch kernels (atomic and deterministic dQ) on the same offsets
        out, lse = attention_cuda(q, k, v, softmax_scale=0.125, causal=True, return_lse=True,
                                  varlen=Varlen(5, cu, cu, 120, 120, None, None))
        for det in (False, True):
            grads = backward_kernels(q, q, k, v, out, lse, softmax_scale=0.125, causal=True,
                                     varlen=Varlen(5, cu, cu, 120, 120, None, None),
                                     deterministic=det)
            assert all(bool(cp.isfinite(g.astype(cp.float32)).all()) for g in grads)


def main():
    rng = np.random.default_rng(0)
    errs = []
    original = runtime.decode_cuda
    for kernel in ("mma", "fma"):
        runtime.decode_cuda = functools.partial(original, kernel=kernel)
        errs.append(case(rng, 3, 1, 8, 2, 128, 300, [300, 0, 1], num_splits=1))
        errs.append(case(rng, 3, 1, 8, 2, 128, 300, [300, 0, 77], page=16, num_splits=5))
        errs.append(case(rng, 2, 4, 8, 2, 128, 200, [200, 9], page=64,
                         mask=masks.tree([-1, 0, 0, 1])))
        errs.append(case(rng, 2, 2, 4, 1, 64, 500, [500, 130], window_size=(50, -1), sinks=3,
                         num_splits=3))
        errs.append(case(rng, 1, 3, 6, 1, 128, 400, [400], num_splits=4))      # 18 rows: 2 chunks
        errs.append(case(rng, 2, 1, 4, 4, 128, 2048, [2048, 1500], num_splits=8))  # group 1
        errs.append(case(rng, 2, 1, 4, 2, 64, 600, [600, 301], page=6, num_splits=3,
                         window_size=(100, -1), sinks=5))      # 6-row pages, sinks
        errs.append(case(rng, 2, 1, 8, 2, 128, 256, None, page=16, num_splits=4))  # full_lens
        errs.append(case(rng, 2, 2, 4, 2, 128, 300, None, num_splits=3))
        poisoned(rng, kernel)
    runtime.decode_cuda = original
    # Back-to-back launches on one stream (each waits for the previous grid before touching
    # counters and partial states).
    q = cp.asarray(rng.standard_normal((1, 1, 8, 128)).astype(np.float16))
    k = cp.asarray(rng.standard_normal((1, 3000, 8, 128)).astype(np.float16))
    outs = [numba_flash.decode(q, k, k, num_splits=s) for s in (12, 12, 1, 12, 7, 7)]
    for o in outs[1:]:
        errs.append(float(cp.abs(o.astype(cp.float32) - outs[0].astype(cp.float32)).max()))
        assert errs[-1] < 2e-3, errs[-1]
    poisoned_varlen(rng)
    errs.append(case(rng, 2, 1, 4, 2, 256, 100, [100, 33], num_splits=2))     # CUDA-core kernel
    o = cp.asarray(rng.standard_normal((5, 2, 3, 4, 32)).astype(np.float32))
    lse = cp.asarray(rng.standard_normal((5, 2, 4, 3)).astype(np.float32))
    lse[1] = -np.inf
    mo, ml = numba_flash.merge_states(o, lse)
    ro, rl = numba_flash.merge_states(cp.asnumpy(o), cp.asnumpy(lse))
    errs.append(float(np.abs(cp.asnumpy(mo) - ro).max()))
    cp.cuda.runtime.deviceSynchronize()
    print("sanitize_decode done; max errors", ["%.1e" % e for e in errs])


if __name__ == "__main__":
    main()
