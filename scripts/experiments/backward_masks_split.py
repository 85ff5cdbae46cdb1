"""Where the masked forward + backward loses to FlexAttention: forward and backward timed apart,
ours and Flex, per mask of bench_masks.mask_set at N 8192 (bf16, B2 H16 D128), with the
backward's visited (key block 128 x query tile 64) tiles and the time per visited tile.

    python scripts/experiments/backward_masks_split.py [--n 8192] [--json out.json]

Extra rows: causal and sliding window through the flags (causal=True, window_size=(1024, 0))
instead of a mask object, to price the mask machinery itself. Times: median ms of 10 calls
between CUDA events after 3 warm-ups (bench_masks.timed); Flex's backward = its fwd+bwd minus
its forward.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import bench_backward as BB  # noqa: E402
import bench_masks as BM  # noqa: E402

NAMES = ("causal", "sliding_window", "causal_document", "document", "shared_question",
         "global_sliding_window", "prefix_lm_causal")


def visited_tiles(mask, n):
    """Backward tiles (key block 128 x query tile 64) with a visible pair, per (b, h)."""
    dense = mask.to_dense(n, n)
    return int((dense.reshape(n // 64, 64, n // 128, 128).sum(axis=(1, 3)) > 0).sum())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--json", default=None)
    ap.add_argument("--only", default=None,
                    help="comma-separated case names (e.g. prefix_lm_causal,causal (flag))")
    args = ap.parse_args()
    import torch

    import numba_flash

    BB.BM = BM
    n, masks = args.n, BM.mask_set(args.n)
    flex = BB.Flex()
    rows = []
    cases = [(name, {"mask": masks[name]}) for name in NAMES]
    cases += [("causal (flag)", {"causal": True}),
              ("sliding_window (window_size)", {"window_size": (1024, 0)})]
    if args.only:
        cases = [c for c in cases if c[0] in args.only.split(",")]
    print(f"{'case':30s} {'tiles':>6s} {'fwd':>7s} {'bwd':>7s} {'flex fwd':>8s} {'flex bwd':>8s}"
          f" {'fwd x':>6s} {'bwd x':>6s} {'us/tile':>8s}")
    for name, kw in cases:
        mask = masks[name.split(" ")[0]]
        case = dict(name=name, mask=mask, B=2, H=16, N=n, D=128, dtype="bfloat16")
        q, k, v, dout = BB.make_inputs(case)
        out, lse = numba_flash.attention(q, k, v, return_lse=True, **kw)
        fwd = BM.timed(lambda: numba_flash.attention(q, k, v, return_lse=True, **kw), 10, 3)
        bwd = BM.timed(lambda: numba_flash.attention_backward(dout, q, k, v, out, lse, **kw),
                       10, 3)
        fcase = dict(case, mask="causal" if name == "causal" else mask)
        bm = flex.block_mask(fcase)
        leaves = [t.transpose(1, 2).contiguous() for t in (q, k, v)]
        ffwd = BM.timed(lambda: flex.fn(*leaves, block_mask=bm), 10, 3)
        fboth = BM.timed(flex.step(fcase, (q, k, v, dout)), 10, 3)
        tiles = visited_tiles(mask, n) * 2 * 16
        row = dict(case=name, tiles=tiles, fwd_ms=fwd, bwd_ms=bwd, flex_fwd_ms=ffwd,
                   flex_bwd_ms=fboth - ffwd, us_per_tile=bwd * 1e3 / tiles * 132)
        rows.append(row)
        print(f"{name:30s} {tiles:6d} {fwd:7.3f} {bwd:7.3f} {ffwd:8.3f} {fboth - ffwd:8.3f}"
              f" {ffwd / fwd:6.2f} {(fboth - ffwd) / bwd:6.2f} {row['us_per_tile']:8.2f}")
        torch.cuda.synchronize()
    print("us/tile: backward ms x 132 SMs over visited tiles (one block per SM)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
