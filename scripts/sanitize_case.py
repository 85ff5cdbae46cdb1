"""A small case of each forward kernel, for compute-sanitizer (memcheck, racecheck) on a GPU."""
import cupy as cp
import torch

from numba_flash.cuda.launch import attention_cuda

rng = cp.random.default_rng(3)
for dtype in ("float16", "bfloat16", "float32", "float64"):
    for causal, window, sinks in ((False, (-1, -1), 0), (True, (-1, -1), 0), (False, (9, 5), 3)):
        shape_q, shape_k = (1, 77, 2, 64), (1, 93, 1, 64)
        if dtype == "bfloat16":
            q = torch.randn(shape_q, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(shape_k, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        else:
            q = rng.standard_normal(shape_q, dtype=cp.float32).astype(dtype)
            k, v = (rng.standard_normal(shape_k, dtype=cp.float32).astype(dtype) for _ in range(2))
        attention_cuda(q, k, v, softmax_scale=0.125, causal=causal, window_size=window,
                       sinks=sinks, return_lse=True)
cp.cuda.runtime.deviceSynchronize()
print("sanitize cases ran")
