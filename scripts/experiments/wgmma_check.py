"""Quick GPU check of the wgmma forward path against the mma.sync path and a float64 reference,
then an A/B timing, all in one process (``NUMBA_FLASH_WGMMA`` switched per call).

    python scripts/wgmma_check.py [--no-bench]

Correctness: random normal q, k, v (never zeros), odd sizes, float64 SDPA (math backend) as the
oracle; prints the max abs error of the wgmma path, of the mma.sync path and of a naive
same-dtype computation (the 2x rule: wgmma <= 2 x naive + 1e-5), and fails on any NaN.
Timing: TFLOP/s of both paths and SDPA flash on the benchmark shapes.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F

import numba_flash
from numba_flash import masks

CASES = [  # (B, Sq, Sk, Hq, Hkv, D, causal, window, dtype)
    (1, 200, 200, 2, 2, 128, False, (-1, -1), "float16"),
    (2, 333, 517, 4, 2, 128, False, (-1, -1), "bfloat16"),
    (1, 300, 300, 2, 1, 128, True, (-1, -1), "float16"),
    (1, 129, 300, 2, 2, 128, True, (-1, -1), "bfloat16"),
    (2, 257, 257, 2, 2, 64, False, (-1, -1), "float16"),
    (1, 500, 700, 3, 1, 64, True, (-1, -1), "bfloat16"),
    (1, 640, 640, 2, 2, 128, False, (100, 0), "float16"),
    (1, 1, 77, 2, 2, 128, False, (-1, -1), "float16"),
]


def reference(q, k, v, causal, window, mask_dense=None):
    qd, kd, vd = (x.double().transpose(1, 2) for x in (q, k, v))
    rep = qd.shape[1] // kd.shape[1]
    kd, vd = kd.repeat_interleave(rep, 1), vd.repeat_interleave(rep, 1)
    sq, sk = qd.shape[2], kd.shape[2]
    i = torch.arange(sq, device=q.device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=q.device)[None, :]
    vis = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if causal:
        vis &= j <= i
    if window[0] >= 0:
        vis &= j >= i - window[0]
    if window[1] >= 0:
        vis &= j <= i + window[1]
    if mask_dense is not None:
        vis &= mask_dense
    s = (qd @ kd.transpose(-1, -2)) * q.shape[-1] ** -0.5
    s = s.masked_fill(~vis, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    naive_s = ((q.transpose(1, 2) @ k.transpose(1, 2).repeat_interleave(rep, 1).transpose(-1, -2))
               * q.shape[-1] ** -0.5).masked_fill(~vis, float("-inf"))
    naive = (torch.softmax(naive_s.float(), -1).to(q.dtype).nan_to_num(0.0)
             @ v.transpose(1, 2).repeat_interleave(rep, 1))
    return (p @ vd).transpose(1, 2), naive.transpose(1, 2)


def run(flag, q, k, v, **kw):
    os.environ["NUMBA_FLASH_WGMMA"] = flag
    return numba_flash.attention(q, k, v, **kw)


def check():
    bad = 0
    torch.manual_seed(0)
    for b, sq, sk, hq, hkv, d, causal, window, dt in CASES:
        tdt = getattr(torch, dt)
        q = torch.randn(b, sq, hq, d, device="cuda", dtype=tdt)
        k = torch.randn(b, sk, hkv, d, device="cuda", dtype=tdt)
        v = torch.randn(b, sk, hkv, d, device="cuda", dtype=tdt)
        ref, naive = reference(q, k, v, causal, window)
        errs = {}
        for flag in ("1", "0"):
            out = run(flag, q, k, v, causal=causal, window_size=window)
            torch.cuda.synchronize()
            o = torch.as_tensor(out, device="cuda")
            errs[flag] = float((o.double() - ref).abs().max()) if not o.isnan().any() else float("nan")
        en = float((naive.double() - ref).abs().max())
        ok = errs["1"] <= 2 * en + 1e-5
        bad += not ok
        print(f"{(b, sq, sk, hq, hkv, d, causal, window, dt)}: wgmma {errs['1']:.2e} mma.sync "
              f"{errs['0']:.2e} naive {en:.2e} {'ok' if ok else 'FAIL'}", flush=True)
    # A causal-document mask object (intervals, tile skipping with 128-key tiles).
    n, d = 1000, 128
    q, k, v = (torch.randn(2, n, 4, d, device="cuda", dtype=torch.float16) for _ in range(3))
    docs = [300, 77, 500, 123]
    m = masks.causal_document(docs)
    ids = torch.repeat_interleave(torch.arange(len(docs), device="cuda"),
                                  torch.tensor(docs, device="cuda"))
    dense = (ids[:, None] == ids[None, :]) & (torch.arange(n, device="cuda")[None, :]
                                              <= torch.arange(n, device="cuda")[:, None])
    ref, naive = reference(q, k, v, False, (-1, -1), dense)
    for flag in ("1", "0"):
        o = torch.as_tensor(run(flag, q, k, v, mask=m), device="cuda")
        err = float((o.double() - ref).abs().max())
        en = float((naive.double() - ref).abs().max())
        ok = err <= 2 * en + 1e-5
        bad += not ok
        print(f"causal_document mask, WGMMA={flag}: {err:.2e} naive {en:.2e} "
              f"{'ok' if ok else 'FAIL'}", flush=True)
    return bad


def time_ms(fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        z.record()
        z.synchronize()
        ts.append(a.elapsed_time(z))
    return statistics.median(ts)


def bench():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    print(f"{'shape':24} {'dtype':8} {'causal':6} {'wgmma':>7} {'mma.sync':>8} {'flash':>7} "
          f"{'wg/flash':>8} {'wg/mma':>7}  (TFLOP/s)")
    for (b, h, n, d) in [(4, 16, 4096, 128), (1, 16, 16384, 128), (16, 16, 1024, 64),
                         (4, 16, 8192, 128), (4, 16, 4096, 64)]:
        for dt in ("float16", "bfloat16"):
            tdt = getattr(torch, dt)
            q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=tdt) for _ in range(3))
            for causal in (False, True):
                fl = 4 * b * h * n * n * d / (2 if causal else 1)
                t_wg = time_ms(lambda: run("1", q, k, v, causal=causal))
                t_mma = time_ms(lambda: run("0", q, k, v, causal=causal))
                qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    t_fl = time_ms(lambda: F.scaled_dot_product_attention(qt, kt, vt,
                                                                          is_causal=causal))
                tf = [fl / t / 1e9 for t in (t_wg, t_mma, t_fl)]
                print(f"{str((b, h, n, d)):24} {dt:8} {str(causal):6} {tf[0]:7.1f} {tf[1]:8.1f} "
                      f"{tf[2]:7.1f} {tf[0] / tf[2]:8.2f} {tf[0] / tf[1]:7.2f}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-bench", action="store_true")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), flush=True)
    bad = check()
    print(f"correctness: {bad} failing case(s)", flush=True)
    if not args.no_bench:
        bench()
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
