"""Host time and loop wall time per call: numba_flash against PyTorch SDPA in the same process.

    python scripts/bench_overhead.py [--calls 200] [--rounds 7] [--json out.json]

For each of issue 17's six shapes (three decode calls, three causal prefills, fp16), and for
varlen attention, paged decode, merge_states and a causal backward (peer: SDPA's backward
through autograd), with torch and CuPy inputs:

* host us/call: wall time of ``calls`` back-to-back calls before synchronising, per call (what
  the Python side costs while the GPU queue absorbs the kernels; the queue is drained first);
  median of ``rounds`` rounds, each running one loop of every library in turn (ours with torch,
  ours with CuPy, SDPA), so that the host's changing speed falls on all of them alike;
* loop us/call: wall time of the same loop plus the final synchronisation, per call (what a
  user's loop pays: the larger of host and GPU time per call).

SDPA gets the same loop on the same data as (B, H, S, D) views (decode with ``enable_gqa``);
"ratio" is our loop time over SDPA's. Varlen, paged decode and merge_states have no SDPA
equivalent: their peer columns time a torch call of like host work in the same rounds
(``extra_cases``), so that a slow spell of the host shows there too. Decode shapes are
(B, Hq, Hkv, L, D), prefill shapes (B, H, N, D).
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

DECODE = [(1, 32, 32, 8192, 128), (1, 64, 8, 32768, 64), (32, 32, 8, 2048, 128)]
PREFILL = [(1, 16, 128, 64), (1, 16, 512, 128), (4, 16, 1024, 128)]


def one_loop(fn, sync, calls):
    """(host us/call, loop us/call) of ``calls`` back-to-back calls after a drained queue."""
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    sync()
    t2 = time.perf_counter()
    return (t1 - t0) / calls * 1e6, (t2 - t0) / calls * 1e6


def interleaved_times(fns, sync, calls, rounds=7):
    """{library: (host us/call, loop us/call)}, each the median over ``rounds`` rounds; every
    round runs one loop of each library in turn, so that a slow spell of the host (its speed
    varies by tens of percent between minutes on the lent machines) falls on all of them."""
    for fn in fns.values():
        for _ in range(3):
            fn()
    samples = {lib: [] for lib in fns}
    for _ in range(rounds):
        for lib, fn in fns.items():
            samples[lib].append(one_loop(fn, sync, calls))
    return {lib: (float(np.median([h for h, _ in got])), float(np.median([w for _, w in got])))
            for lib, got in samples.items()}


def cases(torch, cp):
    """(name, {library: (ours, sdpa or None)}) for every case."""
    import numba_flash
    import torch.nn.functional as F

    out = []
    half = torch.float16
    for b, hq, hkv, n, d in DECODE:
        q = torch.randn(b, 1, hq, d, device="cuda", dtype=half)
        k = torch.randn(b, n, hkv, d, device="cuda", dtype=half)
        v = torch.randn_like(k)
        qc, kc, vc = (cp.asarray(x) for x in (q, k, v))
        qs, ks, vs = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        fns = {"torch": lambda q=q, k=k, v=v: numba_flash.decode(q, k, v),
               "cupy": lambda q=qc, k=kc, v=vc: numba_flash.decode(q, k, v),
               "sdpa": lambda q=qs, k=ks, v=vs: F.scaled_dot_product_attention(
                   q, k, v, enable_gqa=True)}
        out.append((f"decode {(b, hq, hkv, n, d)}", fns))
    for b, h, n, d in PREFILL:
        q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=half) for _ in range(3))
        qc, kc, vc = (cp.asarray(x) for x in (q, k, v))
        qs, ks, vs = (x.transpose(1, 2) for x in (q, k, v))
        fns = {"torch": lambda q=q, k=k, v=v: numba_flash.attention(q, k, v, causal=True),
               "cupy": lambda q=qc, k=kc, v=vc: numba_flash.attention(q, k, v, causal=True),
               "sdpa": lambda q=qs, k=ks, v=vs: F.scaled_dot_product_attention(
                   q, k, v, is_causal=True)}
        out.append((f"prefill causal {(b, h, n, d)}", fns))
    out += extra_cases(torch, cp, numba_flash)
    return out


def extra_cases(torch, cp, numba_flash):
    """Varlen attention, paged decode and merge_states, each with a same-round torch
    counterpart of like host work (no SDPA call does the same thing): SDPA on the sequences
    padded to one batch, SDPA decode on a contiguous cache of the same shape, and merge_states
    written as four torch operations. Their times are not the same computation as ours; they
    show whether a round ran in a slow spell of the host."""
    import torch.nn.functional as F

    half = torch.float16
    lens = [100, 200, 212]
    cu = torch.tensor([0, 100, 300, 512], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(512, 16, 128, device="cuda", dtype=half) for _ in range(3))
    qc, kc, vc, cuc = (cp.asarray(x) for x in (q, k, v, cu))
    var = {"torch": lambda: numba_flash.attention(q, k, v, causal=True, cu_seqlens_q=cu,
                                                   cu_seqlens_k=cu, max_seqlen_q=max(lens),
                                                   max_seqlen_k=max(lens)),
           "cupy": lambda: numba_flash.attention(qc, kc, vc, causal=True, cu_seqlens_q=cuc,
                                                 cu_seqlens_k=cuc, max_seqlen_q=max(lens),
                                                 max_seqlen_k=max(lens))}
    qp, kp_, vp_ = (torch.randn(3, 16, max(lens), 128, device="cuda", dtype=half)
                    for _ in range(3))
    var["sdpa"] = lambda: F.scaled_dot_product_attention(qp, kp_, vp_, is_causal=True)
    pages, page = 512, 16
    kp = torch.randn(pages, page, 8, 128, device="cuda", dtype=half)
    vp = torch.randn_like(kp)
    table = torch.randperm(pages, device="cuda").to(torch.int32).reshape(4, 128)
    seqlens = torch.full((4,), 2000, dtype=torch.int32, device="cuda")
    qd = torch.randn(4, 1, 32, 128, device="cuda", dtype=half)
    kpc, vpc, tc, sc, qdc = (cp.asarray(x) for x in (kp, vp, table, seqlens, qd))
    paged = {"torch": lambda: numba_flash.decode(qd, kp, vp, cache_seqlens=seqlens,
                                                 block_table=table),
             "cupy": lambda: numba_flash.decode(qdc, kpc, vpc, cache_seqlens=sc,
                                                block_table=tc)}
    kc_ = torch.randn(4, 8, 2000, 128, device="cuda", dtype=half)
    vc_ = torch.randn_like(kc_)
    qs_ = qd.transpose(1, 2)
    paged["sdpa"] = lambda: F.scaled_dot_product_attention(qs_, kc_, vc_, enable_gqa=True)
    o = torch.randn(4, 8, 1, 32, 128, device="cuda")
    lse = torch.randn(4, 8, 32, 1, device="cuda")
    oc, lc = cp.asarray(o), cp.asarray(lse)
    merge = {"torch": lambda: numba_flash.merge_states(o, lse),
             "cupy": lambda: numba_flash.merge_states(oc, lc)}

    def torch_merge():
        weights = torch.softmax(lse, dim=0)                    # (4, 8, 32, 1)
        return (o * weights.unsqueeze(2)).sum(0), torch.logsumexp(lse, dim=0)

    merge["sdpa"] = torch_merge
    return [("varlen causal 3 seqs (512, 16, 128)", var),
            ("paged decode (4, 32, 8, 2000, 128), 16-row pages", paged),
            ("merge_states 4 states (8, 1, 32, 128)", merge),
            ("backward causal (1, 16, 512, 128)", backward_case(torch, cp, numba_flash))]


def backward_case(torch, cp, numba_flash):
    """attention_backward of a causal call (from the forward's out and lse), and SDPA's
    backward of the same call through autograd (its graph kept, so each call runs only the
    backward)."""
    import torch.nn.functional as F

    q, k, v, dout = (torch.randn(1, 512, 16, 128, device="cuda", dtype=torch.float16)
                     for _ in range(4))
    out, lse = numba_flash.attention(q, k, v, causal=True, return_lse=True)
    qc, kc, vc, dc, oc, lc = (cp.asarray(x) for x in (q, k, v, dout, out, lse))
    leaves = [x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v)]
    sdpa_out = F.scaled_dot_product_attention(*leaves, is_causal=True)
    grad_out = dout.transpose(1, 2)
    return {"torch": lambda: numba_flash.attention_backward(dout, q, k, v, out, lse, causal=True),
            "cupy": lambda: numba_flash.attention_backward(dc, qc, kc, vc, oc, lc, causal=True),
            "sdpa": lambda: torch.autograd.grad(sdpa_out, leaves, grad_out, retain_graph=True)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import cupy as cp
    import torch

    sync = torch.cuda.synchronize
    rows = []
    print(f"device: {torch.cuda.get_device_name()}  date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"{'case':52s} {'lib':6s} {'host us':>8s} {'loop us':>8s} {'peer host':>9s} "
          f"{'peer loop':>9s} {'ratio':>6s}")
    for name, fns in cases(torch, cp):
        times = interleaved_times(fns, sync, args.calls, args.rounds)
        peer = times["sdpa"]
        same_work = name.startswith(("decode", "prefill", "backward"))   # else a like-sized peer
        for lib in ("torch", "cupy"):
            host, wall = times[lib]
            ratio = f"{wall / peer[1]:6.2f}" if same_work else "     -"
            print(f"{name:52s} {lib:6s} {host:8.1f} {wall:8.1f} {peer[0]:9.1f} {peer[1]:9.1f} "
                  f"{ratio}")
            rows.append(dict(case=name, lib=lib, host_us=host, loop_us=wall,
                             sdpa_host_us=peer[0] if same_work else None,
                             sdpa_loop_us=peer[1] if same_work else None,
                             peer_host_us=peer[0], peer_loop_us=peer[1]))
        if args.json:       # after every case: a run stopped at a time limit keeps its rows
            with open(args.json, "w") as f:
                json.dump(dict(device=torch.cuda.get_device_name(),
                               date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                               rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
