"""Small cases of each forward kernel, for compute-sanitizer (memcheck, racecheck) on a GPU.

    python scripts/sanitize_case.py [--head-dims 64,128,256]

Default: every dtype (float16, bfloat16, float32, float64) at head_dim 64 with full, causal and
window (9, 5) + 3 sinks masks (Sq=77, Sk=93, GQA 2). With --head-dims, the half-precision kernels
at those head_dims (128 and 256 keep Q in shared memory; 256 uses 16-key tiles): float16 causal
and bfloat16 window + sinks, float16 full and causal at Sq=300, Sk=700 (more key tiles than the
warp-specialised kernel's ring has stages), and the exact kernels: float32 causal, float64
window + sinks. With --tensor-cores, the kernels of ``precision="tensor_cores"`` instead: DMMA
(float64, head_dim 32 / 64 / 96 / 128) and 3xTF32 (float32, 32 / 64 / 96 / 128), full, causal,
window (9, 5) + 3 sinks, and causal at Sq=300, Sk=700 (several tiles through both K / V
stages); packed float64 batches with valid and poisoned cu_seqlens.
"""
import argparse

import cupy as cp
import numpy as np
import torch

from numba_flash.cuda.launch.attention import attention_cuda


def run(dtype, d, causal, window, sinks, rng, seqlens=(77, 93), precision="auto"):
    shape_q, shape_k = (1, seqlens[0], 2, d), (1, seqlens[1], 1, d)
    if dtype == "bfloat16":
        q = torch.randn(shape_q, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(shape_k, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    else:
        q = rng.standard_normal(shape_q, dtype=cp.float32).astype(dtype)
        k, v = (rng.standard_normal(shape_k, dtype=cp.float32).astype(dtype) for _ in range(2))
    attention_cuda(q, k, v, softmax_scale=0.125, causal=causal, window_size=window, sinks=sinks,
                   return_lse=True, precision=precision)


def run_packed(rng):
    """Packed float64 batches through the DMMA kernel: valid offsets (empty, one-row and long
    sequences) and poisoned ones (past the end, decreasing, negative), which the kernel clamps."""
    from numba_flash.varlen import Varlen, check_varlen

    for d in (64, 128):
        lens = [70, 0, 1, 300]
        cu = cp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
        q, k, v = (rng.standard_normal((int(cu[-1]), 2, d)) for _ in range(3))
        vl = check_varlen(cu, cu, 300, 300, len(q), len(k), "cuda")
        attention_cuda(q, k, v, softmax_scale=0.125, causal=True, return_lse=True, varlen=vl,
                       precision="tensor_cores")
        bad = cp.asarray(np.array([0, 10, 400, 300, -5, int(cu[-1])], np.int32))
        attention_cuda(q, k, v, softmax_scale=0.125, causal=True, return_lse=True,
                       varlen=Varlen(5, bad, bad, 120, 120, None, None), precision="tensor_cores")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--head-dims", default=None)
    ap.add_argument("--tensor-cores", action="store_true")
    args = ap.parse_args()
    rng = cp.random.default_rng(3)
    if args.tensor_cores:
        for dtype, dims in (("float64", (32, 64, 96, 128)), ("float32", (32, 64, 96, 128))):
            for d in dims:
                for causal, window, sinks in ((False, (-1, -1), 0), (True, (-1, -1), 0),
                                              (False, (9, 5), 3)):
                    run(dtype, d, causal, window, sinks, rng, precision="tensor_cores")
                run(dtype, d, True, (-1, -1), 0, rng, (300, 700), "tensor_cores")
        run_packed(rng)
    elif args.head_dims:
        for d in (int(x) for x in args.head_dims.split(",")):
            run("float16", d, True, (-1, -1), 0, rng)
            run("float16", d, False, (-1, -1), 0, rng, (300, 700))   # more key tiles than
            run("float16", d, True, (-1, -1), 0, rng, (300, 700))    # the ring has stages
            run("bfloat16", d, False, (9, 5), 3, rng)
            run("float32", d, True, (-1, -1), 0, rng)
            run("float64", d, False, (9, 5), 3, rng)
    else:
        for dtype in ("float16", "bfloat16", "float32", "float64"):
            for causal, window, sinks in ((False, (-1, -1), 0), (True, (-1, -1), 0),
                                          (False, (9, 5), 3)):
                run(dtype, 64, causal, window, sinks, rng)
    cp.cuda.runtime.deviceSynchronize()
    print("sanitize cases ran")


if __name__ == "__main__":
    main()
