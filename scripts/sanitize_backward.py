"""Small cases of each backward kernel layout, for compute-sanitizer (memcheck, racecheck).

    python scripts/sanitize_backward.py [--wgmma]

numba_flash.attention_backward on torch tensors (Sq 77, Sk 93, GQA 2, causal and full): the
16-bit dK / dV kernel at head_dim 64 and 128 (on a compute-capability 9.0 GPU the wgmma
kernel, kernels/backward_wgmma.py; elsewhere one warp per 16 keys), 80 (16-column dQ units)
and 192 / 256 (two warps per 16 keys), atomic and deterministic dQ; float32 / float64 at 64
and 96 (CUDA-core kernels); interval masks (causal_document, shared_question: the staged
bounds) in bfloat16 at 64 / 128 / 256. ``--wgmma``: only the 16-bit head_dim 64 / 128 / 256
cases (the wgmma kernel on compute capability 9.0), for a sanitizer run that fits a short
time limit.
"""
import argparse

import torch

import numba_flash


def run(dtype, d, causal, deterministic, heads_kv=1, mask=None, seqlen_q=77):
    q = torch.randn(1, seqlen_q, 2, d, device="cuda", dtype=dtype)
    k, v = (torch.randn(1, 93, heads_kv, d, device="cuda", dtype=dtype) for _ in range(2))
    kw = dict(causal=causal) if mask is None else dict(mask=mask)
    out, lse = numba_flash.attention(q, k, v, return_lse=True, **kw)
    dout = torch.randn_like(out)
    numba_flash.attention_backward(dout, q, k, v, out, lse, deterministic=deterministic, **kw)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--wgmma", action="store_true", help="16-bit head_dim 64 / 128 / 256 only")
    wgmma_only = ap.parse_args().wgmma
    cases = ((torch.float16, (64, 80, 128, 192, 256)), (torch.bfloat16, (256,)),
             (torch.float32, (64, 96)), (torch.float64, (64, 96)))
    if wgmma_only:
        cases = ((torch.float16, (64, 128, 256)), (torch.bfloat16, (256,)))
    for dtype, dims in cases:
        for d in dims:
            for causal, det in ((False, False), (True, False), (True, True)):
                run(dtype, d, causal, det)
    for d in (64, 128, 256):        # one query head per kv head: dK / dV written directly
        run(torch.float16, d, True, False, heads_kv=2)
    # interval masks: the dK / dV block's staged copy of its 93 keys' bounds (Sq = Sk = 93)
    for mask in (numba_flash.masks.causal_document([40, 30, 23]),
                 numba_flash.masks.shared_question([93], [20], [[30, 43]])):
        for d, det in ((64, False), (128, False), (128, True), (256, False)):
            run(torch.bfloat16, d, False, det, mask=mask, seqlen_q=93)
    torch.cuda.synchronize()
    print("sanitize_backward: done")


if __name__ == "__main__":
    main()
