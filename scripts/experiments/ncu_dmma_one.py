"""One float64 DMMA forward configuration (kernels/forward_dmma.py) for Nsight Compute: inputs
made on the host (no other kernel runs), three calls, so ``--launch-skip 2 --launch-count 1``
profiles a warm kernel. Arguments: head_dim, causal (0 / 1), and optionally a tiling
``block_n,q_smem,warps,stages`` (``DmmaGeometry``) in place of the default, e.g.

    ncu --launch-skip 2 --launch-count 1 --metrics "regex:smsp__average_warps_issue_stalled_\\
    .*_per_issue_active\\.ratio,regex:sm__pipe_.*cycles_active\\.avg\\.pct_of_peak_sustained_\\
    active,regex:sm__inst_executed_pipe_.*\\.sum$,smsp__issue_active.avg.pct_of_peak_sustained_\\
    active,gpu__time_duration.sum" python scripts/experiments/ncu_dmma_one.py 64 0 32,1,4,2

(docs/perf-notes.md, the DMMA forward; issue 21). B 4, H 16, N 2048 (B 2, N 4096 above 64).
"""
import sys

import cupy as cp
import numpy as np

from numba_flash.cuda.kernels.forward_dmma import DmmaGeometry
from numba_flash.cuda.launch import attention as launch


def main():
    d, causal = int(sys.argv[1]), sys.argv[2] == "1"
    if len(sys.argv) > 3:
        bn, qs, warps, stages = (int(x) for x in sys.argv[3].split(","))
        geo = DmmaGeometry(bn, bool(qs), warps, stages)
        launch.dmma_geometry = lambda hd, hopper=True: geo
    b, n = (4, 2048) if d <= 64 else (2, 4096)
    rng = np.random.default_rng(0)
    q, k, v = (cp.asarray(rng.standard_normal((b, n, 16, d))) for _ in range(3))
    for _ in range(3):
        launch.attention_cuda(q, k, v, softmax_scale=d ** -0.5, causal=causal,
                              precision="tensor_cores")
    cp.cuda.runtime.deviceSynchronize()


if __name__ == "__main__":
    main()
