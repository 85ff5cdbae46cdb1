"""GPU time of the wgmma forward at one head dim with another key-tile width, in one process
per width (the kernel cache keys on the configuration, not on block_n):

    PYTHONPATH=scripts python scripts/experiments/forward_block_n_ab.py --head-dim 96 --block-n 64

Replaces forward_geometry.mma_block_n for that head dim on the wgmma path before the first
call, then times fp16 / bf16 (4, 16, 4096, D) full and causal (median of 30 calls between CUDA
events) and a bf16 (2, 16, 8192, D) causal document mask (the interval-mask kernel), with the
largest difference to SDPA. docs/perf-notes.md, "Forward at head_dim 96 and 256 on wgmma".
"""
from __future__ import annotations

import argparse


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--head-dim", type=int, default=96)
    ap.add_argument("--block-n", type=int, required=True)
    args = ap.parse_args()
    import torch
    import torch.nn.functional as F
    from bench_masks import timed

    import numba_flash
    from numba_flash import masks
    from numba_flash.cuda.kernels import forward_geometry as geometry

    d, bn, default = args.head_dim, args.block_n, geometry.mma_block_n
    geometry.mma_block_n = lambda hd, wg=False: bn if (wg and hd == d) else default(hd, wg)
    for dtype in (torch.float16, torch.bfloat16):
        q, k, v = (torch.randn(4, 4096, 16, d, device="cuda", dtype=dtype) for _ in range(3))
        for causal in (False, True):
            ms = timed(lambda: numba_flash.attention(q, k, v, causal=causal), 30)
            ref = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)),
                                                 is_causal=causal).transpose(1, 2)
            ours = numba_flash.attention(q, k, v, causal=causal)
            err = (ours.float() - ref.float()).abs().max().item()
            flops = 4 * 4 * 16 * 4096 ** 2 * d / (2 if causal else 1)
            print(f"bn{bn} {dtype} causal={causal} {ms:.3f} ms {flops / ms / 1e9:.1f} TFLOP/s "
                  f"maxdiff {err:.2e}")
    q, k, v = (torch.randn(2, 8192, 16, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    docs = masks.document([1000, 3000, 192, 4000])
    ms = timed(lambda: numba_flash.attention(q, k, v, mask=docs, causal=True), 20)
    print(f"bn{bn} bf16 causal_document {ms:.3f} ms")


if __name__ == "__main__":
    main()
