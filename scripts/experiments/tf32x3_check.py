"""GPU check of the float32 3xTF32 forward kernel (kernels/forward_tf32x3.py) against the IEEE
CUDA-core kernel: max error of each against the float64 reference (numba_flash_reference), their
ratio and issue 21's rule (3xTF32 <= 2 x IEEE + 2e-7), and the time of each (a loop of
back-to-back calls between CUDA events after a warm-up; until 2026-11-29 an event pair around
each call, which counted the slow path's host work). The tensor cores round every mma toward
zero, which made the kernel's error grow with the number of keys while it kept S and O in
long-lived tensor-core accumulators (docs/perf-notes.md, 2026-11-25).

    PYTHONPATH=scripts python scripts/experiments/tf32x3_check.py

The first four cases are tests/test_forward_tf32x3.py's with the test's data (seed sq + d; the
H100 failed the first two with the earlier kernel), the others benchmark sizes (B, H, N, D) =
(4, 16, 2048, 64), (2, 16, 2048, 64), (2, 16, 4096, 128), full and causal, whose float64
reference is computed on the GPU (CuPy, one (batch, head) at a time); docs/perf-notes.md has the
errors the simulator's truncating model gives, to compare. The 3xTF32 kernel runs through
``precision="tensor_cores"``, the IEEE one through ``precision="ieee"``; with torch importable
also PyTorch SDPA's memory-efficient backend (float32) in the same process. TFLOP/s count
4 B H N^2 D (half that causal). A head dim the 3xTF32 kernel does not take prints "n/a". Exits 1
when a case breaks the rule.
"""
from __future__ import annotations

import datetime
import os
import sys

import cupy as cp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_forward import time_ms  # noqa: E402
from numba_flash.cuda.launch import attention as runtime  # noqa: E402
from numba_flash_reference.attention import attention as reference  # noqa: E402

CASES = [  # B, Sq, Sk, Hq, Hkv, D, options
    (1, 70, 40, 2, 2, 64, dict(window_size=(9, 3), sinks=2)),
    (1, 33, 20, 2, 1, 96, dict(causal=True)),
    (1, 17, 23, 2, 1, 32, dict(causal=True)),
    (1, 40, 17, 1, 1, 32, dict(causal=True, softcap=2.5)),
    (4, 2048, 2048, 16, 16, 64, {}),
    (4, 2048, 2048, 16, 16, 64, dict(causal=True)),
    (2, 2048, 2048, 16, 16, 64, {}),
    (2, 2048, 2048, 16, 16, 64, dict(causal=True)),
    (2, 4096, 4096, 16, 16, 128, {}),
    (2, 4096, 4096, 16, 16, 128, dict(causal=True)),
]
BIG = 1 << 24           # Sq * Sk * heads beyond which the reference runs on the GPU


def loop_ms(fn, reps=10):
    """GPU milliseconds per call of ``reps`` back-to-back calls between two CUDA events (after a
    warm-up): ``call`` goes through the slow launch path (~0.4 ms of host work), which a loop
    hides behind the kernels where an event pair around each call would count it."""
    fn()
    cp.cuda.get_current_stream().synchronize()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(reps):
        fn()
    stop.record()
    stop.synchronize()
    return cp.cuda.get_elapsed_time(start, stop) / reps


def call(q, k, v, kw, tf32: bool):
    """One forward call, on the 3xTF32 kernel when ``tf32`` else on the IEEE kernel."""
    return runtime.attention_cuda(q, k, v, softmax_scale=q.shape[-1] ** -0.5,
                                  precision="tensor_cores" if tf32 else "ieee", **kw)


def gpu_reference(q, k, v, causal: bool):
    """float64 attention of equal-length q / k / v (B, N, H, D) on the GPU, one (batch, head)
    at a time: the benchmark cases' reference (plain or causal, no GQA)."""
    out = cp.empty(q.shape, cp.float64)
    n, d = q.shape[1], q.shape[3]
    mask = cp.triu(cp.ones((n, n), bool), 1) if causal else None
    for b in range(q.shape[0]):
        for h in range(q.shape[2]):
            qh, kh, vh = (x[b, :, h, :].astype(cp.float64) for x in (q, k, v))
            s = qh @ kh.T * d ** -0.5
            if mask is not None:
                s[mask] = -cp.inf
            p = cp.exp(s - s.max(axis=1, keepdims=True))
            out[b, :, h, :] = (p @ vh) / p.sum(axis=1, keepdims=True)
    return out


def sdpa_ms(qd, kd, vd, kw):
    """Milliseconds of PyTorch SDPA's memory-efficient backend on the same (B, N, H, D) arrays
    (float32; plain or causal), or None without torch / for other options."""
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return None
    if set(kw) - {"causal"} or qd.shape[1] != kd.shape[1] or qd.shape[2] != kd.shape[2]:
        return None
    tq, tk, tv = (torch.as_tensor(x, device="cuda").transpose(1, 2) for x in (qd, kd, vd))
    causal = bool(kw.get("causal", False))
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        stream = torch.cuda.current_stream()
        with cp.cuda.ExternalStream(stream.cuda_stream):
            return time_ms(lambda: F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal),
                           reps=10)


def main() -> int:
    dev = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"device: {dev}, {datetime.date.today()}")
    print(f"{'B, Sq, Sk, Hq, Hkv, D':26} {'options':32} {'err ieee':>9} {'err 3xtf32':>10} "
          f"{'ratio':>6} {'rule':>5} {'ms ieee':>8} {'ms 3xtf32':>9} {'TF/s':>6} {'x ieee':>7} "
          f"{'ms sdpa':>8} {'x sdpa':>7}")
    failed = 0
    for b, sq, sk, hq, hkv, d, kw in CASES:
        rng = np.random.default_rng(sq + d)
        q = rng.standard_normal((b, sq, hq, d)).astype(np.float32)
        k, v = (rng.standard_normal((b, sk, hkv, d)).astype(np.float32) for _ in range(2))
        qd, kd, vd = (cp.asarray(x) for x in (q, k, v))
        if sq * sk * b * hq > BIG:
            ref = gpu_reference(qd, kd, vd, bool(kw.get("causal", False)))
        else:
            ref = cp.asarray(reference(q, k, v, softmax_scale=d ** -0.5, **kw))
        flop = 4 * b * hq * sq * sk * d * (0.5 if kw.get("causal") else 1.0)
        err, ms = {}, {}
        for tf32 in (False, True):
            try:
                out = call(qd, kd, vd, kw, tf32)
            except NotImplementedError:
                err[tf32] = ms[tf32] = None
                continue
            err[tf32] = float(cp.abs(out.astype(cp.float64) - ref).max())
            ms[tf32] = loop_ms(lambda t=tf32: call(qd, kd, vd, kw, t))
        t_sdpa = sdpa_ms(qd, kd, vd, kw)
        shape = f"{str((b, sq, sk, hq, hkv, d)):26} {str(kw):32} {err[False]:9.2e}"
        sdpa = f"{t_sdpa:8.3f}" if t_sdpa else f"{'-':>8}"
        if err[True] is None:
            print(f"{shape} {'n/a':>10} {'':6} {'':5} {ms[False]:8.3f} {'n/a':>9} {'':6} "
                  f"{'':7} {sdpa}", flush=True)
            continue
        ok = err[True] <= 2 * err[False] + 2e-7
        failed += not ok
        x_sdpa = f"{t_sdpa / ms[True]:7.2f}" if t_sdpa else f"{'-':>7}"
        print(f"{shape} {err[True]:10.2e} {err[True] / err[False]:6.2f} "
              f"{'ok' if ok else 'FAIL':>5} {ms[False]:8.3f} {ms[True]:9.3f} "
              f"{flop / ms[True] / 1e9:6.1f} {ms[False] / ms[True]:7.2f} {sdpa} {x_sdpa}",
              flush=True)
        del ref
        cp.get_default_memory_pool().free_all_blocks()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
