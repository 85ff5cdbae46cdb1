"""Host time of one numba_flash.decode call on a GPU, and where it goes (cProfile).

The decode kernels of the benchmark shapes take 50-360 us; the Python path before the launch
(validation, array interfaces, output allocation, parameter packing) is timed here on its own:
a small cache so the GPU never limits the call rate, PyTorch and CuPy inputs, no
synchronisation between calls.

    python scripts/decode_host_profile.py [--calls 300] [--top 25]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import cupy as cp
import torch

import numba_flash


def per_call_us(fn, calls):
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
        torch.cuda.synchronize()
    return 1e6 * best


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    b, hq, hkv, L, d = 1, 32, 8, 1024, 128
    q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.float16)
    k = torch.randn(b, L, hkv, d, device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)
    lens = torch.full((b,), L, dtype=torch.int32, device="cuda")
    qc, kc, vc, lc = (cp.asarray(x) for x in (q, k, v, lens))
    torch_call = lambda: numba_flash.decode(q, k, v, cache_seqlens=lens)
    cupy_call = lambda: numba_flash.decode(qc, kc, vc, cache_seqlens=lc)
    print(f"host per call, torch tensors: {per_call_us(torch_call, args.calls):.0f} us; "
          f"cupy arrays: {per_call_us(cupy_call, args.calls):.0f} us (best of 3 x "
          f"{args.calls} calls, no sync)")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        torch_call()
    prof.disable()
    torch.cuda.synchronize()
    for key in ("tottime", "cumtime"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(args.top)
        text = out.getvalue()
        print(f"--- torch calls, sorted by {key}")
        print(text[text.find("ncalls"):])


if __name__ == "__main__":
    main()
