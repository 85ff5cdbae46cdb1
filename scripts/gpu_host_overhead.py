"""Host time per call of the forward launcher on a GPU: 100 calls without synchronising, on a
small shape so that the GPU never limits the rate, for the direct cuda.core launch and (with
NUMBA_FLASH_SLOW_LAUNCH=1 in the environment) the plain Numba dispatcher launch.

    python scripts/gpu_host_overhead.py [--label NAME]
"""
from __future__ import annotations

import argparse
import os
import time

import cupy as cp


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", default="slow" if os.environ.get("NUMBA_FLASH_SLOW_LAUNCH") == "1"
                    else "fast")
    args = ap.parse_args()
    from numba_flash import attention
    from numba_flash.cuda.launch import attention_cuda

    q = cp.random.standard_normal((1, 512, 4, 128), dtype=cp.float32).astype(cp.float16)
    for name, fn in (("attention_cuda", lambda: attention_cuda(q, q, q, softmax_scale=0.1,
                                                              causal=True)),
                     ("numba_flash.attention", lambda: attention(q, q, q, causal=True))):
        fn()
        cp.cuda.runtime.deviceSynchronize()
        best = []
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(100):
                fn()
            best.append((time.perf_counter() - t0) / 100)
            cp.cuda.runtime.deviceSynchronize()
        print(f"host per call [{args.label}] {name}: {1e6 * min(best):.0f} us "
              f"(best of 3 x 100 calls, no sync)", flush=True)


if __name__ == "__main__":
    main()
