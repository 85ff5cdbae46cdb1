"""Host time per call of masked forward and backward calls (issue 17 / 20): ``masks.causal()``
and ``masks.sliding_window`` (folded into the flags by validation), an interval mask, against
the same call through the flags; torch inputs, bf16 (1, 16, 512, 128), and SDPA's causal
forward / backward as the peer.

    PYTHONPATH=scripts python scripts/experiments/host_masked_calls.py [--calls 100]

Host us/call: ``calls`` back-to-back calls before synchronising; loop us/call: with the final
synchronisation (bench_overhead.interleaved_times: median of rounds, libraries in turn).
"""
from __future__ import annotations

import argparse

import bench_overhead as bo


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    import torch
    import torch.nn.functional as F

    import numba_flash
    from numba_flash import masks

    b, h, n, d = 1, 16, 512, 128
    q, k, v, dout = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16)
                     for _ in range(4))
    cases = {"causal=True": dict(causal=True), "masks.causal()": dict(mask=masks.causal()),
             "window_size=(128, 0)": dict(window_size=(128, 0)),
             "masks.sliding_window(128, 0)": dict(mask=masks.sliding_window(128, 0)),
             "masks.causal_document": dict(mask=masks.causal_document([100, 300, 112]))}
    qs, ks, vs = (x.transpose(1, 2) for x in (q, k, v))
    fns = {"sdpa fwd": lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)}
    saved = {}
    for name, kw in cases.items():
        out, lse = numba_flash.attention(q, k, v, return_lse=True, **kw)
        saved[name] = (out, lse)
        fns[f"fwd {name}"] = (lambda kw=kw: numba_flash.attention(q, k, v, return_lse=True, **kw))
        fns[f"bwd {name}"] = (lambda kw=kw, name=name: numba_flash.attention_backward(
            dout, q, k, v, *saved[name], **kw))
    times = bo.interleaved_times(fns, torch.cuda.synchronize, args.calls, args.rounds)
    print(f"{'call':40s} {'host us':>8s} {'loop us':>8s}")
    for name, (host, loop) in times.items():
        print(f"{name:40s} {host:8.1f} {loop:8.1f}")


if __name__ == "__main__":
    main()
