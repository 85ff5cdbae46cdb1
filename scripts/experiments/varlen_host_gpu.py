"""Host time and GPU time per call of varlen attention against the same tokens as one
sequence, on a GPU (issue 17): is varlen's ~26 us host time per call its Python or its
kernel? Host: 20 back-to-back calls (a short loop: nothing waits for the launch queue),
median of 30 rounds; GPU: events around each of 200 calls (cupyx.profiler.benchmark), median.
CuPy inputs.

    python scripts/experiments/varlen_host_gpu.py
"""
import statistics
import time

import cupy as cp
import numpy as np

import numba_flash


def host_us(fn, calls=20, rounds=30):
    times = []
    for _ in range(rounds):
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    cp.cuda.Device().synchronize()
    return statistics.median(times)


def gpu_us(fn, calls=200):
    """Median time between CUDA events recorded around each call (the GPU idle before each
    one: cupyx.profiler.benchmark synchronises per call), i.e. the kernel's own time."""
    from cupyx.profiler import benchmark

    return float(np.median(benchmark(fn, n_repeat=calls, n_warmup=10).gpu_times)) * 1e6


def main():
    rng = np.random.default_rng(0)
    q, k, v = (cp.asarray(rng.standard_normal((512, 16, 128)).astype(np.float16))
               for _ in range(3))
    cu = cp.asarray(np.array([0, 100, 300, 512], np.int32))
    cases = {
        "varlen 3 seqs (512, 16, 128)": lambda: numba_flash.attention(
            q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=212,
            max_seqlen_k=212),
        "one sequence (1, 512, 16, 128)": lambda: numba_flash.attention(
            q[None], k[None], v[None], causal=True),
    }
    for name, fn in cases.items():
        for _ in range(50):
            fn()
        print(f"{name:32} host {host_us(fn):6.1f} us/call   GPU {gpu_us(fn):6.1f} us/call",
              flush=True)


if __name__ == "__main__":
    main()
