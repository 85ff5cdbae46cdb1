"""Loop of decode calls against the kernel's pre-filled-queue GPU time (issue 17): per-call GPU
time with the queue pre-filled (a spin kernel first), wall time per call of a plain loop, host
time per call, and the kernels' timeline in both modes from torch.profiler (each kernel's
duration and the idle gap before it: negative when kernels overlap).

    PYTHONPATH=scripts python scripts/experiments/decode_loop_gap.py [--shape B,Hq,Hkv,L,D] \
        [--page N]

``--page N``: a paged cache of N-row pages. It found (H200, 2026-11-29,
``docs/data/decode_pdl_loops_h200_2026-11-29.txt``) that programmatic dependent launch, then on
for several grids, cost up to 7 us per call in loops whose launches arrive while the previous
call runs ((1, 64, 8, 32768, 64): 40.6 us against 33.9 with plain launches; pre-filled queue
31.2 / 32.0), so decode launches plainly since (docs/decode.md "Plain launches").
"""
from __future__ import annotations

import argparse
import statistics
import time


def _timeline(torch, fn, calls, spin):
    """(kernel name, duration us, idle us before it) of the kernels of ``calls`` calls, the
    queue pre-filled by a spin kernel or not."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        if spin:
            torch.cuda._sleep(50_000_000)
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type.name == "CUDA"
                     and "sleep" not in e.name), key=lambda e: e.time_range.start)
    rows, last_end = [], None
    for e in events:
        start, end = e.time_range.start, e.time_range.end
        rows.append((e.name[:40], end - start, 0.0 if last_end is None else start - last_end))
        last_end = end
    return rows


def _summary(rows, skip):
    """Per kernel name: median duration and median idle gap before it (first ``skip`` rows
    dropped: the loop's start)."""
    by_name = {}
    for name, dur, gap in rows[skip:]:
        by_name.setdefault(name, []).append((dur, gap))
    return {name: (statistics.median(d for d, _ in v), statistics.median(g for _, g in v),
                   len(v)) for name, v in by_name.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="1,64,8,32768,64", help="B,Hq,Hkv,L,D")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--page", type=int, default=None, help="rows per page: a paged cache")
    args = ap.parse_args()
    import torch

    import bench_decode
    import numba_flash
    from bench_decode import gpu_time_ms, make_inputs

    bench_decode.torch, bench_decode.numba_flash = torch, numba_flash   # its main's imports

    b, hq, hkv, L, d = (int(x) for x in args.shape.split(","))
    q, k, v, lens, table = make_inputs(b, hq, hkv, L, d, "float16", args.page)

    def fn():                       # the whole cache, as bench_overhead.py's decode rows
        if table is None:
            return numba_flash.decode(q, k, v)
        return numba_flash.decode(q, k, v, cache_seqlens=lens, block_table=table)

    gpu_us = gpu_time_ms(fn) * 1e3
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.calls):
        fn()
    torch.cuda.synchronize()
    loop_us = (time.perf_counter() - t0) / args.calls * 1e6
    torch.cuda._sleep(400_000_000)              # the GPU busy: calls return at host speed
    t0 = time.perf_counter()
    for _ in range(args.calls):
        fn()
    host_us = (time.perf_counter() - t0) / args.calls * 1e6
    torch.cuda.synchronize()
    from numba_flash.cuda.launch.decode import LAST_PLAN

    print(f"decode {args.shape} page {args.page} plan {LAST_PLAN}")
    print(f"decode {args.shape}: gpu (queue pre-filled) {gpu_us:.1f} us, loop {loop_us:.1f} us, "
          f"host {host_us:.1f} us per call")
    for spin in (True, False):
        rows = _timeline(torch, fn, 60, spin)
        for name, (dur, gap, n) in _summary(rows, 10).items():
            print(f"  {'spin' if spin else 'loop'} {name:40s} x{n:3d} kernel {dur:7.1f} us, "
                  f"idle before {gap:6.1f} us")


if __name__ == "__main__":
    main()
