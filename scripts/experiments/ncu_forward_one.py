"""One forward configuration for Nsight Compute (``ncu`` is on the lent GPU machines): three
calls of fp16 attention at head_dim D (B4 H16 N4096; B2 at D 256), random inputs, so that
``--launch-skip 2 --launch-count 1`` profiles a warm kernel. Stall reasons and pipe use, e.g.:

    ncu --launch-skip 2 --launch-count 1 --metrics \\
      "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio,\\
    regex:sm__pipe_.*(tensor|shared|fma|alu|xu).*cycles_active\\.avg\\.pct_of_peak_sustained_active,\\
    regex:sm__inst_executed_pipe_.*(gmma|xu|fma|alu)\\.sum$,gpu__time_duration.sum" \\
      python scripts/experiments/ncu_forward_one.py 128 0

(docs/data/ncu_forward_d128_*_h200_2026-11-27.txt; docs/perf-notes.md). Arguments: head_dim,
causal (0 / 1).
"""
import sys

import cupy as cp
import numpy as np

import numba_flash


def main():
    d = int(sys.argv[1])
    causal = sys.argv[2] == "1"
    b, n = (2, 4096) if d == 256 else (4, 4096)
    rng = np.random.default_rng(0)
    q, k, v = (cp.asarray(rng.standard_normal((b, n, 16, d)).astype(np.float16))
               for _ in range(3))
    for _ in range(3):
        numba_flash.attention(q, k, v, causal=causal)
    cp.cuda.runtime.deviceSynchronize()


if __name__ == "__main__":
    main()
