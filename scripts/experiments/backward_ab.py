"""Forward + backward GPU time of a few configurations, for an A/B of two source trees in
alternating processes (kernel changes whose effect is smaller than the spread between runs):

    cp -r numba_flash nf_A; cp -r TREE_B/numba_flash nf_B    # then, per round and tree X:
    rm -rf numba_flash; cp -r nf_X numba_flash; python scripts/experiments/backward_ab.py --tag X --json x1.json

(swap the package folder: the GPU prelude installs this checkout editable, and that finder wins
over PYTHONPATH, so PYTHONPATH=TREE runs the working tree's code)

fp16 (4, 16, 4096, D), torch tensors; median ms of 7 forward + backward pairs between CUDA
events after 2 warm-ups.
"""
from __future__ import annotations

import argparse

from forward_ab import _report, timed


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tag", default="")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch

    import numba_flash

    rows = {}
    for d, causal in ((128, True), (128, False), (64, True), (256, True)):
        q, k, v = (torch.randn(4, 4096, 16, d, device="cuda", dtype=torch.float16)
                   for _ in range(3))
        dout = torch.randn_like(q)

        def step():
            out, lse = numba_flash.attention(q, k, v, causal=causal, return_lse=True)
            numba_flash.attention_backward(dout, q, k, v, out, lse, causal=causal)

        rows[f"d{d}_{'causal' if causal else 'full'}"] = timed(step, reps=7, warmup=2)
        del q, k, v, dout
    _report(args, rows, torch)


if __name__ == "__main__":
    main()
