"""GPU check of the float32 3xTF32 forward kernel (kernels/forward_tf32x3.py) against the IEEE
CUDA-core kernel: max error of each against the float64 reference (numba_flash_reference), their
ratio and issue 21's rule (3xTF32 <= 2 x IEEE + 2e-7), and the time of each (median of CUDA
events after a warm-up). The tensor cores round every mma toward zero, which made the kernel's
error grow with the number of keys while it kept S and O in long-lived tensor-core accumulators
(docs/perf-notes.md, 2026-11-25).

    python scripts/experiments/tf32x3_check.py

The first four cases are tests/test_forward_tf32x3.py's with the test's data (seed sq + d; the
H100 failed the first two with the earlier kernel), the others benchmark sizes; docs/perf-notes.md
has the errors the simulator's truncating model gives, to compare. The 3xTF32 kernel runs through
``precision="tensor_cores"``, the IEEE one through ``precision="ieee"``. Exits 1
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
    (2, 2048, 2048, 16, 16, 64, {}),
    (2, 2048, 2048, 16, 16, 64, dict(causal=True)),
    (1, 4096, 4096, 4, 4, 64, {}),
]


def call(q, k, v, kw, tf32: bool):
    """One forward call, on the 3xTF32 kernel when ``tf32`` else on the IEEE kernel."""
    return runtime.attention_cuda(q, k, v, softmax_scale=q.shape[-1] ** -0.5,
                                  precision="tensor_cores" if tf32 else "ieee", **kw)


def main() -> int:
    dev = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"device: {dev}, {datetime.date.today()}")
    print(f"{'B, Sq, Sk, Hq, Hkv, D':26} {'options':36} {'err ieee':>9} {'err 3xtf32':>10} "
          f"{'ratio':>6} {'rule':>5} {'ms ieee':>8} {'ms 3xtf32':>9} {'x ieee':>7}")
    failed = 0
    for b, sq, sk, hq, hkv, d, kw in CASES:
        rng = np.random.default_rng(sq + d)
        q = rng.standard_normal((b, sq, hq, d)).astype(np.float32)
        k, v = (rng.standard_normal((b, sk, hkv, d)).astype(np.float32) for _ in range(2))
        ref = reference(q, k, v, softmax_scale=d ** -0.5, **kw)
        qd, kd, vd = (cp.asarray(x) for x in (q, k, v))
        err = {}
        ms = {}
        for tf32 in (False, True):
            out = call(qd, kd, vd, kw, tf32)
            err[tf32] = float(np.abs(cp.asnumpy(out).astype(np.float64) - ref).max())
            ms[tf32] = time_ms(lambda t=tf32: call(qd, kd, vd, kw, t), reps=10)
        ok = err[True] <= 2 * err[False] + 2e-7
        failed += not ok
        print(f"{str((b, sq, sk, hq, hkv, d)):26} {str(kw):36} {err[False]:9.2e} {err[True]:10.2e} "
              f"{err[True] / err[False]:6.2f} {'ok' if ok else 'FAIL':>5} {ms[False]:8.3f} "
              f"{ms[True]:9.3f} {ms[False] / ms[True]:7.2f}", flush=True)
        cp.get_default_memory_pool().free_all_blocks()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
