"""Per-gradient error of the 16-bit backward on a GPU, and an identity probe of its layouts.

    python scripts/experiments/backward_identity_probe.py [--dims 64,128]

1. dq, dk, dv of random (1, 256, 2, D) inputs, full and causal, atomic and deterministic dQ,
   each against the float64 CPU-mode gradients (relative max error): tells which product of
   a new kernel is wrong (deterministic dQ comes from another kernel).
2. dO = identity (row r has a 1 in column r mod D) on 64 query rows: dV = P^T dO is then P^T
   itself, so a wrong operand layout shows as a pattern. For each column of our dV the closest
   column of the exact P^T is printed: "0..7, 0..7, ..." means every 8-column (16-byte) chunk
   read the first one. That is how the wgmma kernel's first-tile dO copy bug was found
   (docs/backward.md, 2026-11-27).
"""
from __future__ import annotations

import argparse

import cupy as cp
import numpy as np

import numba_flash
from numba_flash.cuda.launch import backward as runtime


def gradient_errors(rng, d):
    f64 = lambda x: x.astype(np.float64)  # noqa: E731
    for causal in (False, True):
        for det in (False, True):
            q, k, v, do = (rng.standard_normal((1, 256, 2, d)).astype(np.float16)
                           for _ in range(4))
            out, lse = numba_flash.attention(f64(q), f64(k), f64(v), causal=causal,
                                             return_lse=True)
            ref = numba_flash.attention_backward(f64(do), f64(q), f64(k), f64(v), out, lse,
                                                 causal=causal)
            g = [cp.asarray(x) for x in (q, k, v, do)]
            o, lg = numba_flash.attention(*g[:3], causal=causal, return_lse=True)
            got = numba_flash.attention_backward(g[3], *g[:3], o, lg, causal=causal,
                                                 deterministic=det)
            errs = [float(np.abs(cp.asnumpy(x).astype(np.float64) - r).max() / np.abs(r).max())
                    for x, r in zip(got, ref)]
            path = runtime.backward_geometry("float16", d)["path"]
            print(f"D {d} causal {causal!s:5} det {det!s:5} path {path}: relative error "
                  f"dq {errs[0]:.1e} dk {errs[1]:.1e} dv {errs[2]:.1e}")


def identity_probe(rng, d):
    n = 64
    q, k = ((0.5 * rng.standard_normal((1, n, 1, d))).astype(np.float16) for _ in range(2))
    v = rng.standard_normal((1, n, 1, d)).astype(np.float16)
    do = np.zeros((1, n, 1, d), np.float16)
    do[0, np.arange(n), 0, np.arange(n) % d] = 1
    f64 = lambda x: x.astype(np.float64)  # noqa: E731
    _, lse = numba_flash.attention(f64(q), f64(k), f64(v), return_lse=True)
    p = np.exp(f64(q)[0, :, 0] @ f64(k)[0, :, 0].T / np.sqrt(d) - lse[0, 0][:, None])
    exact = p.T @ f64(do)[0, :, 0]
    g = [cp.asarray(x) for x in (q, k, v, do)]
    o, lg = numba_flash.attention(*g[:3], return_lse=True)
    dv = cp.asnumpy(numba_flash.attention_backward(g[3], *g[:3], o, lg)[2])
    dv = dv.astype(np.float64)[0, :, 0]
    closest = [int(np.argmin(np.abs(exact - dv[:, [c]]).sum(0))) for c in range(d)]
    print(f"D {d} identity dO: max |dV - P^T| {np.abs(dv - exact).max():.2e} "
          f"(max |P^T| {np.abs(exact).max():.2e}); closest exact column per column:")
    print("  ", closest)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", default="64,128")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    for d in (int(x) for x in args.dims.split(",")):
        gradient_errors(rng, d)
        identity_probe(rng, d)


if __name__ == "__main__":
    main()
