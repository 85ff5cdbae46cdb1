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
from .warp import pack_bf16, pack_f16

__all__ = ["make_merge_kernel", "MERGE_THREADS", "OUT_F32", "OUT_F16", "OUT_BF16"]

MERGE_THREADS = 128
OUT_F32, OUT_F16, OUT_BF16 = 0, 1, 2
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def _jit(fn, config):
    # On-disk caching, one cache index per configuration (jitcache.py).
    return jit_kernel(fn, config)


def make_merge_kernel(out_mode: int, write_lse: bool):
    """Build the merge kernel for one output kind (compile-time).

    Kernel signature ``(o_part, lse_part, out, lse)``: o_part float32 (n, B, S, H, D), lse_part
    float32 (n, B, H, S); out is float32 (B, S, H, D) for OUT_F32, or uint32 words
    (B, S, H, D/2) of float16 / bfloat16 pairs; lse float32 (B, H, S) (written when
    ``write_lse``). Launch with ``ceil(B*S*H*W / MERGE_THREADS)`` blocks of MERGE_THREADS, W =
    D (float32) or D/2 (16-bit) items per row.
    """
    pair = out_mode != OUT_F32
    pack = pack_bf16 if out_mode == OUT_BF16 else pack_f16
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
        if tot > 0:
            inv = np.float32(1.0) / tot
        if pair:
            out[b, s, h, w] = pack(o0 * inv, o1 * inv)
        else:
            out[b, s, h, w] = o0 * inv
        if write_lse and w == 0:
            lse[b, h, s] = mu + math.log(tot) if tot > 0 else NEG_INF

    return _jit(kernel, ("merge", out_mode, write_lse))


_KERNELS: dict = {}


def merge_kernel(out_mode: int, write_lse: bool):
    """The cached merge kernel for one output kind."""
    key = (out_mode, write_lse)
    if key not in _KERNELS:
        _KERNELS[key] = make_merge_kernel(out_mode, write_lse)
    return _KERNELS[key]


def launch_merge(o_part, lse_part, out, lse, *, out_mode: int, write_lse: bool, stream):
    """Launch the merge on kernel arrays (see ``make_merge_kernel`` for shapes)."""
    width = out.shape[3]
    items = out.shape[0] * out.shape[1] * out.shape[2] * width
    if items == 0:
        return
    blocks = (items + MERGE_THREADS - 1) // MERGE_THREADS
    merge_kernel(out_mode, write_lse)[blocks, MERGE_THREADS, stream](o_part, lse_part, out, lse)


def merge_states_cuda(o, lse, *, stream=None):
    """Merge n states held in GPU arrays (or NumPy arrays under the simulator).

    o: float32 (n, B, S, H, D), each state normalised; lse: float32 (n, B, H, S), natural log,
    -inf for empty states. Returns (o, lse): float32 (B, S, H, D) and float32 (B, H, S), arrays
    of the inputs' kind, on ``stream`` or the caller's current stream (no synchronisation).
    """
    from . import launch

    kind = launch._array_kind(o)
    if launch._array_kind(lse) != kind:
        raise TypeError(f"o and lse must be the same kind of array, got {type(o).__name__} and "
                        f"{type(lse).__name__}")
    for name, x in (("o", o), ("lse", lse)):
        if launch._dtype_name(x) != "float32":
            raise TypeError(f"{name} must be float32 on the GPU, got {launch._dtype_name(x)} (merge "
                            f"partial states in fp32; cast with .astype(float32))")
    n, b, s, h, d = o.shape
    out = launch._empty_like_kind(kind, o, (b, s, h, d), "float32")
    lse_out = launch._empty_like_kind(kind, o, (b, h, s), "float32")
    args = [launch._kernel_array(x, kind, False) for x in (o, lse, out, lse_out)]
    launch_stream = launch._resolve_stream(stream, kind, o)
    launch_merge(*args, out_mode=OUT_F32, write_lse=True, stream=launch_stream)
    return out, lse_out
