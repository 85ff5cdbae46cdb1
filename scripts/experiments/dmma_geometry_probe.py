"""GPU time of the float64 DMMA forward (kernels/forward_dmma.py) under several tilings
(``DmmaGeometry``: keys per tile, Q in shared memory, warps per block, K / V stages), in one
process, against the IEEE CUDA-core kernel (max difference) and SDPA's math backend (the peer
of issue 21). Each tiling replaces ``launch.attention.dmma_geometry`` (and the launch cache)
for its calls; the tilings alternate within each of ``--rounds`` rounds, medians printed. The
calls take the full launch path (``attention_cuda``: the plan built per call, 0.3-1.0 ms of
host time the GPU waits for, the same for every tiling), so times run above the public call's
(scripts/bench_exact.py) and ratios between tilings are diluted.

    PYTHONPATH=scripts python scripts/experiments/dmma_geometry_probe.py [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics

import cupy as cp

from bench_forward import flops, time_ms
from numba_flash.cuda.kernels.forward_dmma import DmmaGeometry as G, dmma_geometry
from numba_flash.cuda.launch import attention as launch

SHAPES = {32: (4, 16, 2048), 64: (4, 16, 2048), 96: (2, 16, 4096), 128: (2, 16, 4096)}
TILINGS = {       # keys per tile, Q in shared memory, warps, stages
    32: [G(32, False, 4, 1), G(32, False, 4, 2), G(32, False, 8, 2)],
    64: [G(32, True, 4, 1), G(32, True, 4, 2), G(16, True, 4, 2), G(16, True, 4, 1),
         G(32, True, 8, 2)],
    96: [G(16, True, 4, 1), G(16, True, 8, 1)],
    128: [G(16, True, 4, 1), G(16, True, 8, 1), G(16, True, 4, 2), G(32, True, 4, 1)],
}
# 2026-11-28 also tried (commits "experiment (lost ...)"): 16-byte Q / K fragment loads over
# permuted head dims (DmmaGeometry.vector), 0.84-1.05x the 8-byte loads' speed; three K / V
# stages with the next tile's S before this tile's softmax (stages=3), 0.87-1.0x.


def _time_tilings(q, k, v, causal, tilings, rounds, ieee):
    """Per tiling: the times of ``rounds`` rounds (tilings alternating within each) and the max
    difference from the IEEE kernel's ``ieee``; the launch module restored afterwards."""
    d = q.shape[-1]
    kernels = {geo: {} for geo in tilings}          # each tiling's launch cache
    times = {geo: [] for geo in tilings}
    diffs = {}
    default_kernels = launch._KERNELS
    try:
        for r in range(rounds):
            for geo in tilings:
                launch._KERNELS = kernels[geo]
                launch.dmma_geometry = lambda hd, hopper=True, geo=geo: geo

                def call():
                    return launch.attention_cuda(q, k, v, softmax_scale=d ** -0.5,
                                                 causal=causal, precision="tensor_cores")

                if r == 0:
                    diffs[geo] = float(cp.abs(call() - ieee).max())
                times[geo].append(time_ms(call, reps=10))
    finally:
        launch.dmma_geometry = dmma_geometry
        launch._KERNELS = default_kernels
    return times, diffs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--head-dims", default="32,64,96,128")
    ap.add_argument("--only", default=None, help="tilings by index within a head dim, e.g. 1,3")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rng = cp.random.default_rng(0)
    rows = []
    for d in (int(x) for x in args.head_dims.split(",")):
        b, h, n = SHAPES[d]
        q, k, v = (rng.standard_normal((b, n, h, d)) for _ in range(3))
        tq, tk, tv = (torch.as_tensor(x, device="cuda").transpose(1, 2) for x in (q, k, v))
        for causal in (False, True):
            fl = flops(b, h, n, d, causal)
            with sdpa_kernel(SDPBackend.MATH):
                stream = torch.cuda.current_stream()
                with cp.cuda.ExternalStream(stream.cuda_stream):
                    sdpa = time_ms(lambda: F.scaled_dot_product_attention(
                        tq, tk, tv, is_causal=causal), reps=5)
            ieee = launch.attention_cuda(q, k, v, softmax_scale=d ** -0.5, causal=causal,
                                         precision="ieee")
            tilings = TILINGS[d] if not args.only else [
                TILINGS[d][int(i)] for i in args.only.split(",") if int(i) < len(TILINGS[d])]
            times, diffs = _time_tilings(q, k, v, causal, tilings, args.rounds, ieee)
            for geo in tilings:
                ms = statistics.median(times[geo])
                row = dict(B=b, H=h, N=n, D=d, causal=causal, geometry=list(geo), ms=ms,
                           rounds_ms=times[geo], tflops=fl / ms / 1e9, sdpa_math_ms=sdpa,
                           x_sdpa=sdpa / ms, max_diff_vs_ieee=diffs[geo])
                rows.append(row)
                print(f"D {d:3d} {'causal' if causal else 'full  '} {str(tuple(geo)):30s} "
                      f"{ms:7.3f} ms ({min(times[geo]):.3f}-{max(times[geo]):.3f}) "
                      f"{row['tflops']:6.2f} TF/s  x SDPA math {row['x_sdpa']:5.2f}"
                      f"  |diff| {diffs[geo]:.1e}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                           rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
