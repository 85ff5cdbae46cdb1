"""Where the time of a masked attention call goes: host time, device time, and the single-call
latency that bench_masks.py reports, for numba-flash and FlexAttention in one process.

    python scripts/mask_profile.py [--n 8192] [--dtype float16] [--profile]

For each case (B=4, H=16, D=128):
* ``single``: one call between CUDA events with the GPU idle before it (bench_masks.py's measure:
  host time before the launch is included);
* ``device``: 20 calls back to back behind a ~50 ms sleep kernel, between events (the queue stays
  full, so this is the GPU's time per call);
* ``host``: wall-clock microseconds per call over those 20 calls (Python and the launch).
``--profile`` adds a cProfile listing of 200 masked calls (causal_document).
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time

import torch

import numba_flash
from numba_flash import masks as M

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_masks import Flex, mask_set  # noqa: E402


def single_ms(fn, reps=7):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        z.record()
        z.synchronize()
        ts.append(a.elapsed_time(z))
    return statistics.median(ts)


def device_and_host(fn, calls=20, rounds=5):
    fn()
    torch.cuda.synchronize()
    dev, host = [], []
    for _ in range(rounds):
        a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(100_000_000)
        a.record()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        host.append((time.perf_counter() - t0) / calls * 1e6)
        z.record()
        z.synchronize()
        dev.append(a.elapsed_time(z) / calls)
    return statistics.median(dev), statistics.median(host)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    n, b, h, d = args.n, 4, 16, 128
    tdt = getattr(torch, args.dtype)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=tdt) for _ in range(3))
    qs, ks, vs = (x.transpose(1, 2) for x in (q, k, v))
    ms = mask_set(n)
    flex = Flex(n)
    cases = [
        ("full, no mask", dict(), None),
        ("full, mask object", dict(mask=M.prefix_lm_causal(n)), "full"),
        ("causal flag", dict(causal=True), "causal"),
        # masks.causal() and masks.sliding_window() run as the flags (lower_window_mask); a
        # single causal document is the same visibility through the interval-mask kernel
        ("causal mask object", dict(mask=M.causal_document([n])), "causal"),
        ("window flag (1024, 0)", dict(window_size=(1024, 0)), "sliding_window"),
        ("sliding_window mask", dict(mask=ms["sliding_window"]), "sliding_window"),
        ("causal_document", dict(mask=ms["causal_document"]), "causal_document"),
        ("document", dict(mask=ms["document"]), "document"),
    ]
    print(f"{torch.cuda.get_device_name()}, N={n}, {args.dtype}")
    print(f"{'case':26} {'single ms':>9} {'device ms':>9} {'host us':>8} | flex: {'single':>7} "
          f"{'device':>7} {'host us':>8}")
    for name, kw, flex_mask in cases:
        fn = lambda: numba_flash.attention(qs, ks, vs, **kw)  # noqa: E731
        s = single_ms(fn)
        dv, hs = device_and_host(fn)
        line = f"{name:26} {s:9.3f} {dv:9.3f} {hs:8.0f} |"
        if flex_mask is not None:
            bm = flex.block_mask(ms[flex_mask]) if flex_mask != "full" else flex.block_mask(None)
            ffn = lambda: flex(q, k, v, bm)  # noqa: E731
            fs = single_ms(ffn)
            fdv, fhs = device_and_host(ffn)
            line += f"       {fs:7.3f} {fdv:7.3f} {fhs:8.0f}"
        print(line, flush=True)
    if args.profile:
        mask = ms["causal_document"]
        fn = lambda: numba_flash.attention(qs, ks, vs, mask=mask)  # noqa: E731
        fn()
        torch.cuda.synchronize()
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(200):
            fn()
        pr.disable()
        torch.cuda.synchronize()
        pstats.Stats(pr).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
