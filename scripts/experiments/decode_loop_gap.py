"""Why a loop of decode calls runs slower than the kernels' GPU time (issue 17: at (1, 64, 8, 32768,
64) the loop pays ~8 us per call beyond the pre-filled-queue time, docs/benchmarks.md "Launch
overhead"): per-call GPU time with the queue pre-filled (a spin kernel first), wall time per call
of a plain loop, host time per call, and the kernels' timeline in both modes from torch.profiler
(each kernel's duration and the idle gap before it), so the gap shows up as kernel time (blocks
placed early by programmatic dependent launch waiting in ``griddepcontrol.wait``) or as idle time
between kernels (launches arriving late).

    PYTHONPATH=scripts python scripts/experiments/decode_loop_gap.py [--no-pdl] [--shape B,Hq,Hkv,L,D]

``--no-pdl``: the launch policy (launch/decode.py ``launch_policy``) replaced by plain launches for
this process, before the first call builds its plan.
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
    ap.add_argument("--no-pdl", action="store_true")
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    import torch

    import numba_flash
    from bench_decode import gpu_time_ms, make_inputs

    if args.no_pdl:
        from numba_flash.cuda.launch import decode as launch_decode

        launch_decode.launch_policy = lambda *a, **kw: (False, 0, False)
    b, hq, hkv, L, d = (int(x) for x in args.shape.split(","))
    q, k, v, _, _ = make_inputs(b, hq, hkv, L, d, "float16", None)

    def fn():                       # the whole cache, as bench_overhead.py's decode rows
        return numba_flash.decode(q, k, v)

    tag = "no_pdl" if args.no_pdl else "policy"
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
    print(f"{tag} {args.shape}: gpu (queue pre-filled) {gpu_us:.1f} us, loop {loop_us:.1f} us, "
          f"host {host_us:.1f} us per call")
    for spin in (True, False):
        rows = _timeline(torch, fn, 60, spin)
        for name, (dur, gap, n) in _summary(rows, 10).items():
            print(f"  {'spin' if spin else 'loop'} {name:40s} x{n:3d} kernel {dur:7.1f} us, "
                  f"idle before {gap:6.1f} us")


if __name__ == "__main__":
    main()
