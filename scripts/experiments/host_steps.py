"""Host cost of each step of a repeated call (issue 17), on a GPU machine: the pieces the
repeated-call path is made of (geometry reads, signature hash and lookup, allocation, device /
stream / capture queries, the launch itself) timed one by one, torch and CuPy, against whole
calls.

    python scripts/experiments/host_steps.py

Each figure: median over 7 rounds of the mean ns of 20,000 back-to-back executions (the launch
rounds drain the GPU queue in between).
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
    return statistics.median(out)


def main():
    import cupy as cp
    import torch

    import numba_flash
    from numba_flash.cuda.launch import attention as att

    sync = torch.cuda.synchronize
    q, k, v = (torch.randn(1, 128, 16, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    qc, kc, vc = (cp.asarray(x) for x in (q, k, v))
    rows = []

    def row(name, fn, n=20000, gpu=False):
        rows.append((name, ns(fn, n, sync=sync if gpu else None)))
        print(f"{name:55s} {rows[-1][1]:9.0f} ns", flush=True)

    row("python: empty function call", lambda: None)
    row("torch: q.shape, q.stride(), q.dtype, q.get_device()",
        lambda: (q.shape, q.stride(), q.dtype, q.get_device()))
    row("torch: Tensor.data_ptr(q)", lambda: torch.Tensor.data_ptr(q))
    row("torch: torch.empty(shape, dtype, device)",
        lambda: torch.empty((1, 128, 16, 64), dtype=torch.float16, device=q.device))
    row("torch: q.new_empty(shape)", lambda: q.new_empty((1, 128, 16, 64)))
    row("torch: _cuda_getDevice()", torch._C._cuda_getDevice)
    row("torch: _cuda_getCurrentRawStream(0)", lambda: torch._C._cuda_getCurrentRawStream(0))
    row("torch: _cuda_isCurrentStreamCapturing()", torch._C._cuda_isCurrentStreamCapturing)
    row("cupy: x.shape, x.strides, x.dtype, x.data.device_id",
        lambda: (qc.shape, qc.strides, qc.dtype, qc.data.device_id))
    row("cupy: x.data.ptr", lambda: qc.data.ptr)
    row("cupy: cupy.ndarray(shape, dtype)", lambda: cp.ndarray((1, 128, 16, 64), cp.float16))
    row("cupy: runtime.getDevice()", cp.cuda.runtime.getDevice)
    row("cupy: get_current_stream().ptr", lambda: cp.cuda.get_current_stream().ptr)
    row("cupy: runtime.streamIsCapturing(0)", lambda: cp.cuda.runtime.streamIsCapturing(0))
    for lib, (a, b, c) in (("torch", (q, k, v)), ("cupy", (qc, kc, vc))):
        numba_flash.attention(a, b, c, causal=True)
        numba_flash.attention(a, b, c, causal=True)
        print(f"{lib}: {len(att._FAST_CALLS)} recorded calls", flush=True)
        call = list(att._FAST_CALLS.values())[-1]      # the plan this call just recorded
        options = (None, True, (-1, -1), 0, None, None, True, False, "auto", True, True, None,
                   None, None, "auto")
        geometry = att.geometry_reader(type(a))
        row(f"{lib}: signature (3 geometries + key tuple)", lambda: (
            "attention", type(a), geometry(a), geometry(b), geometry(c), options))
        row(f"{lib}: table lookup of an equal key", lambda: att._FAST_CALLS.get(
            ("attention", type(a), geometry(a), geometry(b), geometry(c), options)))
        row(f"{lib}: FastCall.run (alloc + launch)", lambda: call.run((a, b, c), (), (None, None),
                                                                     None), 5000, True)
        ptrs = [call.pointer(x) for x in (a, b, c, a)]
        stream = call.stream()
        row(f"{lib}: LaunchPlan.launch", lambda: call.plan.launch(ptrs, stream), 5000, True)
        row(f"{lib}: attention_fast (signature, lookup, run)", lambda: att.attention_fast(
            a, b, c, options, (), (None, None), None), 5000, True)
        row(f"{lib}: numba_flash.attention, whole call",
            lambda: numba_flash.attention(a, b, c, causal=True), 5000, True)
    sync()


if __name__ == "__main__":
    main()
