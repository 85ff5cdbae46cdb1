"""What a dK / dV block's time is made of: the backward alone (bf16 (2, 16, 8192, 128)) on masks
chosen to separate a block's fixed cost (K / V loads, dK / dV stores, launch) from the cost
of a full and of a partial (128-key x 64-row) tile, fitted by least squares over
``time x 132 SMs / (B H) = blocks x P + full x t + partial x tp``.

    python scripts/experiments/backward_tile_costs.py [--json out.json] [--profile]

``--profile``: also each kernel's GPU time in one backward call of each case (torch.profiler,
CUPTI: our driver-API launches included).

Cases: the flags (full, causal) and document masks whose documents are multiples of 128 keys
(no partial tile; blocks of 4-32 tiles) or shifted by 32 (partial tiles at every boundary).
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

N, B, H, D, SMS = 8192, 2, 16, 128, 132


def tile_counts(mask, causal):
    """(blocks with a visible tile, full tiles, partial tiles) per (b, h)."""
    if mask is None:
        dense = np.tril(np.ones((N, N), bool)) if causal else np.ones((N, N), bool)
    else:
        dense = mask.to_dense(N, N)
    vis = dense.reshape(N // 64, 64, N // 128, 128).sum(axis=(1, 3))
    return int((vis.sum(0) > 0).sum()), int((vis == 64 * 128).sum()), \
        int(((vis > 0) & (vis < 64 * 128)).sum())


def kernel_times(fn):
    """{kernel name: GPU microseconds} of one call of fn (after a warm-up call), printed."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    times = {}
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            times[ev.name[:60]] = times.get(ev.name[:60], 0.0) + ev.device_time
    for name, us in sorted(times.items(), key=lambda x: -x[1]):
        print(f"    {us:9.1f} us  {name}")
    return times


def cases():
    from numba_flash import masks as M
    shifted = [1024 + 32, 1024 - 32] * 4
    return [("full", {}, None, False), ("causal", {"causal": True}, None, True),
            ("document 8 x 1024", None, M.document([1024] * 8), False),
            ("document 16 x 512", None, M.document([512] * 16), False),
            ("document 32 x 256", None, M.document([256] * 32), False),
            ("document 1056 / 992", None, M.document(shifted), False),
            ("causal_document 8 x 1024", None, M.causal_document([1024] * 8), False),
            ("causal_document 1056 / 992", None, M.causal_document(shifted), False)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    import torch

    import numba_flash

    case = dict(B=B, H=H, N=N, D=D, dtype="bfloat16")
    q, k, v, dout = BB.make_inputs(case)
    rows = []
    print(f"{'case':28s} {'blocks':>6s} {'full':>5s} {'part':>5s} {'bwd ms':>7s}")
    for name, kw, mask, causal in cases():
        kw = kw if mask is None else {"mask": mask}
        out, lse = numba_flash.attention(q, k, v, return_lse=True, **kw)
        ms = BM.timed(lambda: numba_flash.attention_backward(dout, q, k, v, out, lse, **kw), 10, 3)
        blocks, full, part = tile_counts(mask, causal)
        rows.append(dict(case=name, blocks=blocks, full=full, partial=part, bwd_ms=ms))
        print(f"{name:28s} {blocks:6d} {full:5d} {part:5d} {ms:7.3f}")
        if args.profile:
            rows[-1]["kernels_us"] = kernel_times(
                lambda: numba_flash.attention_backward(dout, q, k, v, out, lse, **kw))
        torch.cuda.synchronize()
    a = np.array([[r["blocks"], r["full"], r["partial"]] for r in rows], float)
    y = np.array([r["bwd_ms"] * 1e3 * SMS / (B * H) for r in rows])
    (p, t, tp), *_ = np.linalg.lstsq(a, y, rcond=None)
    print(f"fit (us on one SM): per block {p:.2f}, per full tile {t:.2f}, per partial tile {tp:.2f};"
          f" residuals % {np.round(100 * (a @ [p, t, tp] - y) / y, 1).tolist()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows,
                       "fit_us": dict(block=p, full=t, partial=tp)}, f, indent=1)


if __name__ == "__main__":
    main()
