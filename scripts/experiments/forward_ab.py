"""GPU time of forward configurations whose machine code a kernel refactor changed, for an A/B
of two source trees in alternating processes (issue 17's tile-walk helpers):

    cp -r numba_flash nf_A; cp -r TREE_B/numba_flash nf_B    # then, per round and tree X:
    rm -rf numba_flash; cp -r nf_X numba_flash; python scripts/experiments/forward_ab.py --tag X --json x1.json

(swap the package folder: the GPU prelude installs this checkout editable, and that finder wins
over PYTHONPATH, so PYTHONPATH=TREE runs the working tree's code)

Each configuration: median ms of 20 calls between CUDA events after warm-up (bench_masks.timed), B4 H16 N4096
(fp32 / fp64: B2 N2048; masks: B2 N8192; and fp16 hd128 N1024 at B4 / B16, 50 calls), torch
inputs. ``--masks``: the mask set of bench_masks.py instead.
"""
from __future__ import annotations

import argparse
import json

from bench_masks import timed


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tag", default="")
    ap.add_argument("--json", default=None)
    ap.add_argument("--exact", action="store_true",
                    help="float64 on DMMA (precision='tensor_cores') and SDPA's math fp64 only")
    ap.add_argument("--masks", action="store_true",
                    help="bench_masks' FlashMask set only (bf16 (2, 16, 8192, 128) and "
                         "(2, 16, 8192, 64), and causal document at fp16 head_dim 96)")
    ap.add_argument("--only", default=None,
                    help="comma-separated substrings: time only the configurations named so")
    args = ap.parse_args()
    import torch

    import numba_flash
    from numba_flash import masks

    def inputs(b, n, h, d, dtype):
        return [torch.randn(b, n, h, d, device="cuda", dtype=dtype) for _ in range(3)]

    rows = {}

    def wanted(name):
        return not args.only or any(part in name for part in args.only.split(","))

    if args.masks:
        from bench_masks import mask_set

        for d, dtype, names in ((128, torch.bfloat16, None), (96, torch.float16,
                                                              ("causal_document",)),
                                (64, torch.bfloat16, None)):
            q, k, v = inputs(2, 8192, 16, d, dtype)
            for name, mask in mask_set(8192).items():
                row = f"{str(dtype)[6:]}_d{d}_{name}"
                if mask is None or (names and name not in names) or not wanted(row):
                    continue
                rows[row] = timed(lambda: numba_flash.attention(q, k, v, mask=mask), 20)
        _report(args, rows, torch)
        return
    if args.exact:
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        for d in (64, 128):
            q, k, v = inputs(2, 2048, 16, d, torch.float64)
            qs, ks, vs = (x.transpose(1, 2) for x in (q, k, v))
            for causal in (False, True):
                tag = f"float64_d{d}_{'causal' if causal else 'full'}"
                rows[f"dmma_{tag}"] = timed(lambda: numba_flash.attention(
                    q, k, v, causal=causal, precision="tensor_cores"), 20)
                with sdpa_kernel(SDPBackend.MATH):
                    rows[f"sdpa_math_{tag}"] = timed(lambda: F.scaled_dot_product_attention(
                        qs, ks, vs, is_causal=causal), 5)
        _report(args, rows, torch)
        return
    for name, (b, n, d, dtype) in {
            "float16_d64": (4, 4096, 64, torch.float16),
            "float16_d96": (4, 4096, 96, torch.float16),
            "float16_d128": (4, 4096, 128, torch.float16),
            "bfloat16_d128": (4, 4096, 128, torch.bfloat16),
            "float16_d256": (2, 4096, 256, torch.float16),
            "float32_d64": (2, 2048, 64, torch.float32),
            "float64_d128": (2, 2048, 128, torch.float64)}.items():
        if not wanted(name):
            continue
        q, k, v = inputs(b, n, 16, d, dtype)
        rows[f"{name}_causal"] = timed(lambda: numba_flash.attention(q, k, v, causal=True), 20)
        rows[f"{name}_full"] = timed(lambda: numba_flash.attention(q, k, v), 20)
        del q, k, v
    for b in (4, 16):       # short sequences: the grid's order decides the causal tail
        q, k, v = inputs(b, 1024, 16, 128, torch.float16)
        rows[f"float16_d128_n1024_b{b}_causal"] = timed(
            lambda: numba_flash.attention(q, k, v, causal=True), 50)
        rows[f"float16_d128_n1024_b{b}_full"] = timed(lambda: numba_flash.attention(q, k, v), 50)
        del q, k, v
    q, k, v = inputs(2, 8192, 16, 128, torch.bfloat16)
    docs = masks.document([1000, 3000, 192, 4000])
    rows["bfloat16_d128_document_causal"] = timed(
        lambda: numba_flash.attention(q, k, v, mask=docs, causal=True), 20)
    bits = masks.from_dense((torch.rand(8192, 8192, device="cuda") < 0.5).cpu().numpy())
    rows["bfloat16_d128_bitmask"] = timed(lambda: numba_flash.attention(q, k, v, mask=bits), 5)
    _report(args, rows, torch)


def _report(args, rows, torch):
    for key, ms in rows.items():
        print(f"{args.tag} {key:34s} {ms:8.3f} ms", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(tag=args.tag, device=torch.cuda.get_device_name(), rows=rows), f)


if __name__ == "__main__":
    main()
