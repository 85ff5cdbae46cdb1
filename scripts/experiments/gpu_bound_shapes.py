"""GPU time of the bench_overhead shapes whose loops are bound by the GPU (issue 17): decode
(1, 64, 8, 32768, 64) and (32, 32, 8, 2048, 128), prefill causal (4, 16, 1024, 128); ours (auto
plan and a num_splits sweep for decode) against SDPA's backends, same process, fp16.

    PYTHONPATH=scripts python scripts/experiments/gpu_bound_shapes.py [--json out.json]

GPU time per call with the launch queue kept full (bench_decode.gpu_time_ms).
"""
from __future__ import annotations

import argparse
import json

import bench_decode as bd


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import numba_flash
    from numba_flash.cuda.launch.decode import LAST_PLAN

    bd.torch, bd.F = torch, F
    rows = []
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}

    def sdpa(name, fn):
        try:
            with sdpa_kernel(backends[name]):
                return bd.gpu_time_ms(fn) * 1e3
        except Exception as exc:  # noqa: BLE001 - backend unavailable for this shape
            return repr(exc)[:80]

    for b, hq, hkv, n, d in ((1, 64, 8, 32768, 64), (32, 32, 8, 2048, 128)):
        q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.float16)
        k = torch.randn(b, n, hkv, d, device="cuda", dtype=torch.float16)
        v = torch.randn_like(k)
        kv_bytes = 2 * k.numel() * 2
        row = dict(case=f"decode {(b, hq, hkv, n, d)}", kv_mb=kv_bytes / 1e6)
        row["ours_us"] = bd.gpu_time_ms(lambda: numba_flash.decode(q, k, v)) * 1e3
        row["plan"] = {key: str(val) for key, val in LAST_PLAN.items()}
        row["sweep_us"] = {s: bd.gpu_time_ms(lambda: numba_flash.decode(q, k, v, num_splits=s),
                                             rounds=3) * 1e3
                           for s in (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)}
        qs, ks, vs = (x.transpose(1, 2) for x in (q, k, v))
        for name in backends:
            row[f"sdpa_{name}_us"] = sdpa(name, lambda: F.scaled_dot_product_attention(
                qs, ks, vs, enable_gqa=True))
        row["sdpa_default_us"] = bd.gpu_time_ms(lambda: F.scaled_dot_product_attention(
            qs, ks, vs, enable_gqa=True)) * 1e3
        rows.append(row)
        print(json.dumps(row), flush=True)
    b, h, n, d = 4, 16, 1024, 128
    q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.float16) for _ in range(3))
    qs, ks, vs = (x.transpose(1, 2) for x in (q, k, v))
    row = dict(case=f"prefill causal {(b, h, n, d)}")
    row["ours_us"] = bd.gpu_time_ms(lambda: numba_flash.attention(q, k, v, causal=True)) * 1e3
    for name in backends:
        row[f"sdpa_{name}_us"] = sdpa(name, lambda: F.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True))
    row["tflops_ours"] = 4 * b * h * n * n * d / 2 / row["ours_us"] / 1e6
    rows.append(row)
    print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
