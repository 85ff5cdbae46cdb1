"""One fp16 forward + backward of numba_flash on the GPU, for a profiler (Nsight Compute):

    ncu -k regex:kernel_ --launch-skip 2 -c 1 --set full \
        python scripts/experiments/backward_profile.py --n 4096 --head-dim 128 [--causal]

(Numba names every kernel ``kernel_<digest>``: launches go forward, preprocess, dK / dV, then the
reduce passes, so skipping two launches profiles the dK / dV kernel;
docs/data/ncu_backward_mma_h200_2026-11-27_2d7229c_hd128.txt is that run.)

``--mask NAME``: a mask of bench_masks.mask_set(n) instead (e.g. ``--mask prefix_lm_causal``
against ``--mask causal``, both interval masks through the same kernel; run from the repository
root with ``PYTHONPATH=scripts``).

``--deterministic``: the deterministic mode (its dK / dV kernel has no dQ atomics; a separate
dQ kernel follows). Runs the call twice (the first compiles), synchronising after each.
"""
from __future__ import annotations

import argparse

import cupy as cp
import numpy as np

import numba_flash


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--mask", default=None, help="a name of bench_masks.mask_set")
    args = ap.parse_args()
    mask = None
    if args.mask:
        from bench_masks import mask_set

        mask = mask_set(args.n)[args.mask]
    shape = (args.batch, args.n, args.heads, args.head_dim)
    dtype = cp.float16
    rng = cp.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal(shape, dtype=cp.float32).astype(dtype)
                     for _ in range(4))
    for _ in range(2):
        out, lse = numba_flash.attention(q, k, v, causal=args.causal, mask=mask,
                                         return_lse=True)
        grads = numba_flash.attention_backward(dout, q, k, v, out, lse, causal=args.causal,
                                               mask=mask, deterministic=args.deterministic)
        cp.cuda.runtime.deviceSynchronize()
    print("dq max", float(np.abs(cp.asnumpy(grads[0]).astype(np.float32)).max()))


if __name__ == "__main__":
    main()
