"""Small masked cases of the forward kernels, for compute-sanitizer (memcheck, racecheck) on a GPU.

    compute-sanitizer --tool memcheck --report-api-errors no python scripts/sanitize_masks.py

Sq = 77, Sk = 93 (bottom-right aligned, ragged last tiles), GQA 2, head_dim 64, float16 and
float32 kernels, with each mask encoding: column intervals (causal document), packed bitmask
(a BFS-ordered tree), a compiled mask_mod reading a captured array; then ALiBi, a score_mod
reading captured arrays by q_idx and kv_idx (the kernel must clamp them on ragged tiles), a
packed (cu_seqlens) batch with an empty sequence (with and without the score_mod), and one
unmasked causal case for comparison; then
Sk = 2200 with 5 queries (window + sinks + mask), where the visible key tiles lie past the first 32;
then the warp-specialised kernel's interval walk at head_dim 96 / 128 (document masks, Sq 300 /
Sk 700 with and without causal, and 7 queries against 5000 keys).
"""
import cupy as cp
import numpy as np

import numba_flash
from numba_flash import masks


def main():
    rng = cp.random.default_rng(3)
    q = rng.standard_normal((1, 77, 2, 64), dtype=cp.float32)
    k, v = (rng.standard_normal((1, 93, 1, 64), dtype=cp.float32) for _ in range(2))
    doc = np.repeat(np.arange(3), [30, 33, 30]).astype(np.int32)
    weight = np.linspace(0.5, 1.5, 93).astype(np.float32)     # one entry per key position

    def doc_bias(score, b, h, q_idx, kv_idx):     # indexes arrays of exactly Sk entries
        return score * weight[kv_idx] + 0.5 * (doc[q_idx] == doc[kv_idx])
    cases = [("intervals", dict(mask=masks.causal_document([30, 33, 30]))),
             ("bitmask", dict(mask=masks.tree([-1, 0, 1, 1, 2, 2, 3, 3, 4], 84))),
             ("mask_mod", dict(mask=masks.mask_mod(lambda b, h, qi, kv: doc[qi] == doc[kv]))),
             ("alibi", dict(causal=True, alibi_slopes=cp.asarray([0.25, 0.0625], cp.float32))),
             ("score_mod", dict(score_mod=doc_bias)),
             ("none", dict(causal=True))]
    for dt in (cp.float16, cp.float32):
        for name, kw in cases:
            numba_flash.attention(q.astype(dt), k.astype(dt), v.astype(dt), return_lse=True, **kw)
            print("ran", name, np.dtype(dt).name, flush=True)
        cu_q = cp.asarray([0, 40, 40, 77], cp.int32)
        cu_k = cp.asarray([0, 50, 53, 93], cp.int32)
        for extra in ({}, {"score_mod": doc_bias}):
            numba_flash.attention(q[0].astype(dt), k[0].astype(dt), v[0].astype(dt),
                                  causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                  max_seqlen_q=40, max_seqlen_k=50, return_lse=True, **extra)
        print("ran varlen", np.dtype(dt).name, flush=True)
    # Visible key tiles beyond the first group of 32 (the walk's later warp votes).
    qf = rng.standard_normal((1, 5, 2, 64), dtype=cp.float32)
    kf, vf = (rng.standard_normal((1, 2200, 1, 64), dtype=cp.float32) for _ in range(2))
    for dt in (cp.float16, cp.float32):
        for m in (masks.global_sliding_window(16, 40), masks.causal_document([2100, 100])):
            numba_flash.attention(qf.astype(dt), kf.astype(dt), vf.astype(dt), mask=m,
                                  window_size=(60, 0), sinks=3, return_lse=True)
        print("ran far tiles", np.dtype(dt).name, flush=True)
    # The warp-specialised kernel's interval walk at head_dim 96 / 128 (64: the cases above):
    # more visible key tiles than its ring has stages, ragged last tiles, with and without
    # causal, 40 key tiles (visible ones past the first 32) with 7 query rows.
    for d in (96, 128):
        qw, kw, vw = (rng.standard_normal((1, n, h, d), dtype=cp.float32).astype(cp.float16)
                      for n, h in ((300, 2), (700, 1), (700, 1)))
        for causal in (False, True):
            numba_flash.attention(qw, kw, vw, mask=masks.document([290, 5, 405]),
                                  causal=causal, return_lse=True)
        kf2, vf2 = (rng.standard_normal((1, 5000, 1, d), dtype=cp.float32).astype(cp.float16)
                    for _ in range(2))
        numba_flash.attention(qw[:, :7], kf2, vf2, mask=masks.document([4900, 100]))
        print("ran warp-specialised intervals, head_dim", d, flush=True)
    cp.cuda.runtime.deviceSynchronize()
    print("mask sanitize cases ran")


if __name__ == "__main__":
    main()
