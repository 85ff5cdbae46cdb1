"""On a GPU machine: registers, local memory and spill instructions of the forward kernels the
runtime actually launches (Numba's PTX linked by this machine's ptxas / nvJitLink, which may
allocate differently from the wheels' ptxas used offline by scripts/sass_snapshot.py).

    python scripts/experiments/forward_runtime_resources.py [--tag TAG]
"""
from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
import kernel_resources as kr  # noqa: E402
from runtime_sass_check import sass_of_cubin  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    import cupy as cp
    import numpy as np

    import numba_flash
    from numba_flash.cuda.launch import attention as la

    rng = np.random.default_rng(0)
    for d in (64, 96, 128, 256):
        for dtype in (np.float16,):
            q, k, v = (cp.asarray(rng.standard_normal((1, 300, 2, d)).astype(dtype))
                       for _ in range(3))
            for kw in (dict(), dict(causal=True), dict(window_size=(64, 0))):
                numba_flash.attention(q, k, v, **kw)
    cp.cuda.runtime.deviceSynchronize()
    for key, entry in la._KERNELS.items():
        family = ("ws" if entry.threads == la.WS_THREADS else "wgmma" if key.wgmma
                  else "mma.sync")
        for compiled in getattr(entry.kernel, "overloads", {}).values():
            sass = sass_of_cubin(compiled._codelibrary.get_cubin())
            regs = getattr(compiled, "regs_per_thread", "?")
            local = getattr(compiled, "local_mem_per_thread", "?")
            print(f"{args.tag} {family} d{key.head_dim} left={key.has_left} "
                  f"right={key.has_right}: regs {regs} "
                  f"local {local} LDL {len(re.findall(r'LDL', sass))} STL "
                  f"{len(re.findall(r'STL', sass))} HGMMA {sass.count('HGMMA')} "
                  f"A-overwrites {kr.a_operand_overwrites(sass)}", flush=True)


if __name__ == "__main__":
    main()
