"""Where the time of a short decode call goes: the (1, 32, 32, 8192, 128) shape (44 us of
K/V at 3 TB/s), ours (folded merge: default launch, without PDL, on 16- and 64-row pages; and
with the merge as a separate kernel) and SDPA's flash and cuDNN kernels, a few calls each.

    python scripts/decode_short_probe.py            # per-call GPU time back to back (queue full)
    ncu --clock-control none --metrics gpu__time_duration.sum --csv \
        python scripts/decode_short_probe.py --calls 3   # each kernel's own duration

The difference between the two is what the launch gaps between back-to-back kernels cost.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import numba_flash
from bench_decode import copy_bandwidth_gbs, gpu_time_ms, make_inputs


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=0, help="plain calls per variant (for ncu)")
    ap.add_argument("--shape", default="1,32,32,8192,128")
    args = ap.parse_args()
    b, hq, hkv, L, d = (int(x) for x in args.shape.split(","))
    q, k, v, lens, _ = make_inputs(b, hq, hkv, L, d, "float16", None)
    kv_bytes = 2 * b * L * hkv * d * 2
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

    def ours():
        return numba_flash.decode(q, k, v, cache_seqlens=lens)

    def with_env(var, value):
        """``ours`` with the environment variable ``var`` set to ``value`` for the call."""
        def run():
            os.environ[var] = value
            try:
                return ours()
            finally:
                os.environ.pop(var)
        return run

    def sdpa(backend):
        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
        return run

    paged = {}
    for page in (16, 64):
        paged[page] = make_inputs(b, hq, hkv, L, d, "float16", page)

    def ours_paged(page):
        def run():
            qp, kp, vp, lp, tp = paged[page]
            return numba_flash.decode(qp, kp, vp, cache_seqlens=lp, block_table=tp)
        return run

    variants = [("ours", ours), ("ours_pdl0", with_env("NUMBA_FLASH_DECODE_PDL", "0")),
                ("ours_paged16", ours_paged(16)), ("ours_paged64", ours_paged(64)),
                ("ours_nofold", with_env("NUMBA_FLASH_DECODE_FOLD", "0")),
                ("sdpa_flash", sdpa(SDPBackend.FLASH_ATTENTION)),
                ("sdpa_cudnn", sdpa(SDPBackend.CUDNN_ATTENTION))]
    if args.calls:
        for name, fn in variants:
            for _ in range(args.calls):
                fn()
            torch.cuda.synchronize()
        return
    bw = copy_bandwidth_gbs()
    print(f"shape {(b, hq, hkv, L, d)}; copy bandwidth {bw:.0f} GB/s; ideal "
          f"{kv_bytes / bw / 1e3:.1f} us")
    for name, fn in variants:
        ms = gpu_time_ms(fn)
        print(f"{name:12s} {1e3 * ms:7.1f} us per call back to back, "
              f"{100 * kv_bytes / ms / 1e6 / bw:5.1f} % of copy")


if __name__ == "__main__":
    main()
