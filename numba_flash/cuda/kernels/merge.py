"""Merge kernel: n partial attention states (o, lse) -> one, on the GPU.

States follow ``numba_flash.merge_states``' layout: o float32 (n, B, S, H, D), normalised;
lse float32 (n, B, H, S), natural log, -inf for a state that saw no key (the identity).
One thread per output element (or per pair of elements for 16-bit outputs): it reads the n
lse values of its row (cached: every thread of the row reads the same ones), takes their max
m, weights w_i = exp(lse_i - m), and writes sum_i (w_i / sum w) o_i and m + log(sum w).
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda

from .jitcache import jit_kernel
from ..primitives import pack16

__all__ = ["make_merge_kernel", "merge_kernel", "MERGE_THREADS", "OUT_F32", "OUT_F16", "OUT_BF16"]

MERGE_THREADS = 128
OUT_F32, OUT_F16, OUT_BF16 = 0, 1, 2
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def make_merge_kernel(out_mode: int, write_lse: bool):
    """Build the merge kernel for one output kind (compile-time).

    Kernel signature ``(o_part, lse_part, out, lse)``: o_part float32 (n, B, S, H, D), lse_part
    float32 (n, B, H, S); out is float32 (B, S, H, D) for OUT_F32, or uint32 words
    (B, S, H, D/2) of float16 / bfloat16 pairs; lse float32 (B, H, S) (written when
    ``write_lse``). Launch with ``ceil(B*S*H*W / MERGE_THREADS)`` blocks of MERGE_THREADS, W =
    D (float32) or D/2 (16-bit) items per row.
    """
    pair = out_mode != OUT_F32
    BF16 = out_mode == OUT_BF16     # a constant, not an intrinsic in the closure (disk cache)
    NEG_INF = -math.inf

    def kernel(o_part, lse_part, out, lse):
        n_states, batch, seqlen, heads, head_dim = o_part.shape
        width = out.shape[3]
        idx = cuda.grid(1)
        if idx >= batch * seqlen * heads * width:
            return
        w = idx % width
        row = idx // width
        h = row % heads
        bs = row // heads
        s = bs % seqlen
        b = bs // seqlen
        mx = np.float32(NEG_INF)
        for i in range(n_states):
            mx = max(mx, lse_part[i, b, h, s])
        mu = mx if mx != NEG_INF else np.float32(0.0)
        tot = np.float32(0.0)
        o0 = np.float32(0.0)
        o1 = np.float32(0.0)
        d = 2 * w if pair else w
        for i in range(n_states):
            x = lse_part[i, b, h, s]
            if x != NEG_INF:       # an empty state's o may hold anything (even NaN): skip it
                wt = math.exp(x - mu)
                tot += wt
                o0 += wt * o_part[i, b, s, h, d]
                if pair:
                    o1 += wt * o_part[i, b, s, h, d + 1]
        inv = np.float32(0.0)
        if tot != 0:
            inv = np.float32(1.0) / tot
        if pair:
            out[b, s, h, w] = pack16(BF16, o0 * inv, o1 * inv)
        else:
            out[b, s, h, w] = o0 * inv
        if write_lse and w == 0:
            lse[b, h, s] = mu + math.log(tot) if tot != 0 else NEG_INF

    return jit_kernel(kernel, ("merge", out_mode, write_lse))


_KERNELS: dict = {}


def merge_kernel(out_mode: int, write_lse: bool):
    """The cached merge kernel for one output kind."""
    key = (out_mode, write_lse)
    if key not in _KERNELS:
        _KERNELS[key] = make_merge_kernel(out_mode, write_lse)
    return _KERNELS[key]
