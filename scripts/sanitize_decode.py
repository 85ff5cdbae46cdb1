"""Small decode and merge launches for compute-sanitizer (memcheck, racecheck) on a GPU.

    compute-sanitizer --tool memcheck --report-api-errors no python scripts/sanitize_decode.py
    compute-sanitizer --tool racecheck --report-api-errors no python scripts/sanitize_decode.py

Covers each decode kernel (tensor-core: direct and split with the merge folded in or launched
apart, contiguous and paged (sinks, a 6-row page), group 1, back-to-back launches with
programmatic dependent launch (NUMBA_FLASH_DECODE_PDL=1), ragged lengths 0 / 1, a draft tree,
a window with sinks; the CUDA-core kernel at
head_dim 256 and forced with NUMBA_FLASH_DECODE_KERNEL=fma) and the merge kernel
(merge_states on float32 GPU states), then checks every output against the CPU path.
"""
from __future__ import annotations

import os

import cupy as cp
import numpy as np

import numba_flash
from numba_flash import masks


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


def main():
    rng = np.random.default_rng(0)
    errs = []
    for kernel, fold in (("mma", "1"), ("mma", "0"), ("fma", "0")):
        os.environ["NUMBA_FLASH_DECODE_KERNEL"] = kernel
        os.environ["NUMBA_FLASH_DECODE_FOLD"] = fold
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
    os.environ.pop("NUMBA_FLASH_DECODE_KERNEL")
    os.environ.pop("NUMBA_FLASH_DECODE_FOLD")
    # Back-to-back launches on one stream with programmatic dependent launch (each waits for
    # the previous grid before touching counters and partial states).
    os.environ["NUMBA_FLASH_DECODE_PDL"] = "1"
    q = cp.asarray(rng.standard_normal((1, 1, 8, 128)).astype(np.float16))
    k = cp.asarray(rng.standard_normal((1, 3000, 8, 128)).astype(np.float16))
    outs = [numba_flash.decode(q, k, k, num_splits=s) for s in (12, 12, 1, 12, 7, 7)]
    for o in outs[1:]:
        errs.append(float(cp.abs(o.astype(cp.float32) - outs[0].astype(cp.float32)).max()))
        assert errs[-1] < 2e-3, errs[-1]
    os.environ.pop("NUMBA_FLASH_DECODE_PDL")
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
