"""Diagnostic of the warp-specialised dK / dV kernel (kernels/backward_ws.py, experiment):
GPU time of the dK / dV kernel alone (torch.profiler) for the wgmma kernel with and without its
dQ product, and the warp-specialised kernel with / without ping-pong and with dQ atomic, product
only, or none. fp16 (4, 16, 4096, 128), full and causal.

    python scripts/experiments/backward_ws_variants.py [--json out.json]
"""
from __future__ import annotations

import argparse
import functools
import json

VARIANTS = [("wgmma atomic", None, False), ("wgmma no dQ (det dkdv)", None, True),
            ("ws pingpong atomic", dict(pingpong=True, dq_mode="atomic"), False),
            ("ws free atomic", dict(pingpong=False, dq_mode="atomic"), False),
            ("ws pingpong product only", dict(pingpong=True, dq_mode="product"), False),
            ("ws pingpong no dQ", dict(pingpong=True, dq_mode="none"), False),
            ("ws free no dQ", dict(pingpong=False, dq_mode="none"), False)]


def dkdv_us(fn, torch, reps=5):
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    tot = sum(ev.device_time for ev in prof.events()
              if ev.device_type.name == "CUDA" and "dkdv" in ev.name)
    return tot / reps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch

    import numba_flash
    from numba_flash.cuda.kernels import backward_ws as bws
    from numba_flash.cuda.launch import backward as lb
    from numba_flash.cuda.launch import backward_fast as bf

    real = bws.make_ws_dkdv_kernel
    rows = {}
    for case in ("128f", "128c"):
        d, causal = int(case[:-1]), case[-1] == "c"
        q, k, v = (torch.randn(4, 4096, 16, d, device="cuda", dtype=torch.float16)
                   for _ in range(3))
        dout = torch.randn_like(q)
        out, lse = numba_flash.attention(q, k, v, causal=causal, return_lse=True)
        for name, kw, det in VARIANTS:
            lb._KERNELS.clear()
            bf._FAST_CALLS.clear()
            bws.WS_BWD_HEAD_DIMS = (64, 128) if kw else ()
            bws.make_ws_dkdv_kernel = functools.partial(real, **(kw or {}))
            us = dkdv_us(lambda: numba_flash.attention_backward(
                dout, q, k, v, out, lse, causal=causal, deterministic=det), torch)
            rows[f"{case} {name}"] = us
            print(f"{case} {name:28s} {us:9.1f} us", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
