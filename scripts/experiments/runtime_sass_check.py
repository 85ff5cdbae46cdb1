"""On a GPU machine: the machine code the runtime actually launches for the backward's head_dim
64 wgmma kernel (Numba's cubin, linked by this machine's nvJitLink or driver), scanned for
writes to the A registers of in-flight wgmma products (kernel_resources.a_operand_overwrites),
against the offline compile of the same kernel with the ptxas of the NVIDIA wheels found here.
On 2026-11-27 the pipelined head_dim 64 loop (removed since) read 0 offline with ptxas 13.5
and 84 / 81 at runtime on the lent H200 (ptxas 13.0); tests/test_cuda_backward.py's
test_runtime_wgmma_kernels_keep_a_operands now asserts 0 for every wgmma kernel on the GPU.

    python scripts/experiments/runtime_sass_check.py [OUT_DIR]     # SASS files into OUT_DIR
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import kernel_resources as kr  # noqa: E402


def sass_of_cubin(cubin) -> str:
    """SASS of a cubin (bytes, or the cuda.core ObjectCode numba-cuda links to)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(getattr(cubin, "code", cubin))
        f.flush()
        return subprocess.run([kr._tool("cuobjdump"), "-sass", f.name], capture_output=True,
                              text=True, check=True).stdout


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else None
    import cupy as cp
    import numpy as np
    from cuda.bindings import driver as cu

    import numba_flash
    from numba_flash.cuda.launch import backward as lb

    print("ptxas:", subprocess.run([kr._tool("ptxas"), "--version"], capture_output=True,
                                   text=True).stdout.strip().splitlines()[-1])
    cu.cuInit(0)
    try:
        from cuda.bindings import nvjitlink
        linker = nvjitlink.version()
    except Exception as exc:  # noqa: BLE001 - report whatever is missing
        linker = repr(exc)
    print("driver:", cu.cuDriverGetVersion()[1], "nvJitLink:", linker)
    rng = np.random.default_rng(0)
    q, k, v, do = (cp.asarray(rng.standard_normal((1, 256, 2, 64)).astype(np.float16))
                   for _ in range(4))
    for det in (False, True):
        for causal in (False, True):
            out, lse = numba_flash.attention(q, k, v, causal=causal, return_lse=True)
            grads = numba_flash.attention_backward(do, q, k, v, out, lse, causal=causal,
                                                   deterministic=det)
            finite = all(bool(cp.isfinite(g).all()) for g in grads)
            print(f"deterministic={det} causal={causal}: gradients finite {finite}", flush=True)
    for key, kern in lb._KERNELS.items():
        for i, compiled in enumerate(getattr(kern, "overloads", {}).values()):
            sass = sass_of_cubin(compiled._codelibrary.get_cubin())
            if "HGMMA" not in sass:
                continue
            name = f"runtime_{abs(hash(key)) % 10 ** 6}_{i}"
            print(f"{name}: key {key}: HGMMA {sass.count('HGMMA')}, A overwrites "
                  f"{kr.a_operand_overwrites(sass)}", flush=True)
            if out_dir:
                with open(os.path.join(out_dir, name + ".sass"), "w") as f:
                    f.write(sass)
    import sass_snapshot_backward as sb
    from numba_flash.cuda.kernels import backward_wgmma as bwg

    for atomic in (True, False):
        kern = bwg.make_wgmma_dkdv_kernel(64, False, False, False, False, False, atomic, 0)
        sig = sb._signature(kern.py_func, True, True, False)     # the same in both dQ modes
        r = kr.report(kern.py_func, sig, cc=(9, 0, "a"))
        print(f"offline hd64 atomic={atomic}: HGMMA {r['sass'].count('HGMMA')}, A overwrites "
              f"{r['a_overwrites']}", flush=True)
        if out_dir:
            with open(os.path.join(out_dir, f"offline_hd64_atomic{atomic}.sass"), "w") as f:
                f.write(r["sass"])


if __name__ == "__main__":
    main()
