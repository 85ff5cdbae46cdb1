"""Forward + backward GPU time of a few configurations, for an A/B of two source trees in
alternating processes (kernel changes whose effect is smaller than the spread between runs):

    cp -r numba_flash nf_A; cp -r TREE_B/numba_flash nf_B    # then, per round and tree X:
    rm -rf numba_flash; cp -r nf_X numba_flash; python scripts/experiments/backward_ab.py --tag X --json x1.json

(swap the package folder: the GPU prelude installs this checkout editable, and that finder wins
over PYTHONPATH, so PYTHONPATH=TREE runs the working tree's code)

fp16 (4, 16, 4096, D), torch tensors; median ms of --reps (7) forward + backward pairs (or
backward calls alone, --bwd-only) between CUDA events after 2 warm-ups. ``--masks``: the
backward alone of bf16 (2, 16, 8192, 128) with bench_masks' causal_document, prefix-LM and
causal (flag) instead (issue 19's masks).
"""
from __future__ import annotations

import argparse

from forward_ab import _report, timed


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tag", default="")
    ap.add_argument("--json", default=None)
    ap.add_argument("--cases", default="128c,128f,64c,256c",
                    help="head_dim then c (causal) or f (full), comma-separated")
    ap.add_argument("--bwd-only", action="store_true", help="time attention_backward alone")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--masks", action="store_true")
    args = ap.parse_args()
    import torch

    import numba_flash

    rows = {}
    if args.masks:
        _masks(args, rows, torch, numba_flash)
        return
    for case in args.cases.split(","):
        d, causal = int(case[:-1]), case[-1] == "c"
        q, k, v = (torch.randn(4, 4096, 16, d, device="cuda", dtype=torch.float16)
                   for _ in range(3))
        dout = torch.randn_like(q)

        out, lse = numba_flash.attention(q, k, v, causal=causal, return_lse=True)

        def step():
            if not args.bwd_only:
                numba_flash.attention(q, k, v, causal=causal, return_lse=True)
            numba_flash.attention_backward(dout, q, k, v, out, lse, causal=causal)

        rows[f"d{d}_{'causal' if causal else 'full'}"] = timed(step, reps=args.reps, warmup=2)
        del q, k, v, dout, out, lse
    _report(args, rows, torch)


def _masks(args, rows, torch, numba_flash):
    from bench_masks import mask_set

    q, k, v, dout = (torch.randn(2, 8192, 16, 128, device="cuda", dtype=torch.bfloat16)
                     for _ in range(4))
    sets = mask_set(8192)
    for name, mask, causal in (("causal_document", sets["causal_document"], False),
                               ("prefix_lm_causal", sets["prefix_lm_causal"], False),
                               ("causal_flag", None, True)):
        out, lse = numba_flash.attention(q, k, v, mask=mask, causal=causal, return_lse=True)
        rows[f"bf16_d128_{name}_bwd"] = timed(
            lambda: numba_flash.attention_backward(dout, q, k, v, out, lse, mask=mask,
                                                   causal=causal), reps=args.reps, warmup=2)
    _report(args, rows, torch)


if __name__ == "__main__":
    main()
