"""Host cost of each step of a repeated call (issue 17), on a GPU machine: the pieces the
repeated-call path is made of (geometry reads, signature hash and lookup, allocation, device /
stream / capture queries, the launch itself) timed one by one, torch and CuPy, against whole
calls; prefill (1, 512, 16, 128) against varlen attention on the same 512 tokens (3 sequences).

    python scripts/experiments/host_steps.py

Host-only steps: median over 7 rounds of the mean ns of 20,000 executions. Steps that launch:
median over 101 rounds of 50 back-to-back calls, the GPU queue drained before each round (a
longer loop fills the launch queue and then times the GPU).
"""
from __future__ import annotations

import statistics
import time


def ns(fn, n=20000, rounds=7, sync=None):
    out = []
    for _ in range(rounds):
        if sync:
            sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t0) / n * 1e9)
    if sync:
        sync()
    return statistics.median(out)


def main():
    import cupy as cp
    import torch

    import numba_flash
    from numba_flash.cuda.launch import attention as att

    sync = torch.cuda.synchronize
    q, k, v = (torch.randn(1, 512, 16, 128, device="cuda", dtype=torch.float16)
               for _ in range(3))
    cu = torch.tensor([0, 100, 300, 512], dtype=torch.int32, device="cuda")
    rows = []

    def row(name, fn, gpu=False):
        rows.append((name, ns(fn, 50, 101, sync) if gpu else ns(fn)))
        print(f"{name:62s} {rows[-1][1]:9.0f} ns", flush=True)

    row("python: empty function call", lambda: None)
    row("torch: q.shape, q.stride(), q.dtype, q.get_device()",
        lambda: (q.shape, q.stride(), q.dtype, q.get_device()))
    row("torch: Tensor.data_ptr(q)", lambda: torch.Tensor.data_ptr(q))
    row("torch: q.new_empty(shape)", lambda: q.new_empty((1, 512, 16, 128)))
    row("torch: _cuda_getDevice()", torch._C._cuda_getDevice)
    row("torch: _cuda_getCurrentRawStream(0)", lambda: torch._C._cuda_getCurrentRawStream(0))
    qc = cp.asarray(q)
    row("cupy: x.shape, x.strides, x.dtype, x.data.device_id",
        lambda: (qc.shape, qc.strides, qc.dtype, qc.data.device_id))
    row("cupy: cupy.ndarray(shape, dtype)", lambda: cp.ndarray((1, 512, 16, 128), cp.float16))
    for lib, conv in (("torch", lambda x: x), ("cupy", cp.asarray)):
        a, b, c, cuq = (conv(x) for x in (q, k, v, cu))
        a3, b3, c3 = a[0], b[0], c[0]
        calls = {
            "prefill": (lambda: numba_flash.attention(a, b, c, causal=True), (a, b, c), ()),
            "varlen": (lambda: numba_flash.attention(
                a3, b3, c3, causal=True, cu_seqlens_q=cuq, cu_seqlens_k=cuq, max_seqlen_q=212,
                max_seqlen_k=212), (a3, b3, c3), (cuq, cuq)),
        }
        for case, (whole, arrays, extras) in calls.items():
            whole()
            whole()
            call = list(att._FAST_CALLS.values())[-1]      # the plan this call just recorded
            varlen = bool(extras)
            options = (None, True, (-1, -1), 0, None, None, True, False, "auto", not varlen,
                       not varlen, 212 if varlen else None, 212 if varlen else None, None,
                       "auto")
            geometry = att.geometry_reader(type(a))
            x, y, z = arrays
            key = ("attention", type(x), geometry(x), geometry(y), geometry(z), options) + \
                tuple(geometry(e) for e in extras)
            assert att._FAST_CALLS.get(key) is call, "key does not reproduce the recorded one"
            tag = f"{lib} {case}"
            row(f"{tag}: signature", lambda: ("attention", type(x), geometry(x), geometry(y),
                                              geometry(z), options) +
                tuple(geometry(e) for e in extras))
            row(f"{tag}: table lookup of an equal key", lambda: att._FAST_CALLS.get(key))
            row(f"{tag}: allocation", call.new_out)
            ptrs = [call.pointer(t) for t in (x, y, z, x)] + [call.pointer(e) for e in extras]
            stream = call.stream()
            row(f"{tag}: LaunchPlan.launch", lambda: call.plan.launch(ptrs, stream), True)
            row(f"{tag}: FastCall.run", lambda: call.run(arrays, extras, (None, None), None),
                True)
            row(f"{tag}: attention_fast", lambda: att.attention_fast(
                x, y, z, options, extras, (None, None), None), True)
            row(f"{tag}: numba_flash.attention, whole call", whole, True)
            print(f"{tag}: plan grid {call.plan.grid} block {call.plan.block} smem "
                  f"{call.plan.smem} parameter words {len(call.plan.values)} "
                  f"order {call.order}", flush=True)
    sync()


if __name__ == "__main__":
    main()
