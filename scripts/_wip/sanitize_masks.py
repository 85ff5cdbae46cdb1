import cupy as cp
import numpy as np
import numba_flash
from numba_flash import masks as M
rng = cp.random.default_rng(3)
q = rng.standard_normal((1, 77, 2, 64), dtype=cp.float32).astype(cp.float16)
k, v = (rng.standard_normal((1, 93, 1, 64), dtype=cp.float32).astype(cp.float16) for _ in range(2))
doc = np.repeat(np.arange(3), [30, 33, 30]).astype(np.int32)
for m in (M.causal_document([30, 33, 30]), M.tree([-1, 0, 1, 1, 2, 2, 3, 3, 4], 84),
          M.mask_mod(lambda b, h, qi, kv: doc[qi] == doc[kv])):
    for dt in (cp.float16, cp.float32):
        numba_flash.attention(q.astype(dt), k.astype(dt), v.astype(dt), mask=m, return_lse=True)
cp.cuda.runtime.deviceSynchronize()
print("mask sanitize cases ran")
