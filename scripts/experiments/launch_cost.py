"""What one cuLaunchKernel of a recorded plan costs on the host, and which way of calling it
is cheapest (issue 17): the CUkernel Numba loaded against the CUfunction the driver resolves
for the current context, and the parameters as an array of pointers (one per parameter, as
LaunchPlan passed them until 2026-11-27) against one packed buffer (``extra``,
CU_LAUNCH_PARAM_BUFFER_POINTER, as it passes them now).
An empty kernel gives the floor. On a GPU machine:

    python scripts/experiments/launch_cost.py

Each figure: median over 101 rounds of 50 back-to-back launches, the queue drained before
each round, ns per launch.
"""
from __future__ import annotations

import ctypes
import statistics
import time


def ns(fn, sync, n=50, rounds=101):
    out = []
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t0) / n * 1e9)
    sync()
    return statistics.median(out)


def layout_of(function):
    """[(offset, size)] of a CUfunction's parameters (cuFuncGetParamInfo)."""
    from cuda.bindings import driver as cu

    layout = []
    while True:
        err, offset, size = cu.cuFuncGetParamInfo(cu.CUfunction(function), len(layout))
        if err != cu.CUresult.CUDA_SUCCESS:
            return layout
        layout.append((offset, size))


def main():
    import torch
    from numba import cuda

    import numba_flash
    from numba_flash.cuda.launch import attention as att, driver

    sync = torch.cuda.synchronize
    q, k, v = (torch.randn(1, 512, 16, 128, device="cuda", dtype=torch.float16)
               for _ in range(3))
    numba_flash.attention(q, k, v, causal=True)
    numba_flash.attention(q, k, v, causal=True)
    plan = list(att._FAST_CALLS.values())[-1].plan
    stream = torch.cuda.current_stream().cuda_stream

    @cuda.jit
    def empty():
        pass

    empty_plan = driver.LaunchPlan(driver.compile_kernel(empty, []), [], (1,), 32)
    lib = ctypes.CDLL("libcuda.so.1")
    launch = lib.cuLaunchKernel
    launch.restype = ctypes.c_int
    kernel = int(plan.cufunc.handle)                # the CUkernel Numba / cuda.core loaded
    function = plan.func                            # the CUfunction the plan launches
    layout = layout_of(function)
    print("params", len(layout), "bytes", layout[-1][0] + layout[-1][1], "grid", plan.grid,
          "smem", plan.smem, flush=True)
    base = ctypes.addressof(plan.values)
    argv = (ctypes.c_void_p * len(layout))(*(base + offset for offset, _ in layout))
    dims = [ctypes.c_uint(n) for n in (*plan.grid, plan.block, 1, 1, plan.smem)]
    s = ctypes.c_void_p(stream)
    extra = plan._extra
    rows = {
        "empty kernel, LaunchPlan.launch": lambda: empty_plan.launch([], stream),
        "plan, LaunchPlan.launch (CUfunction, packed buffer)": lambda: plan.launch([], stream),
        "plan, CUkernel, pointer array": lambda: launch(
            ctypes.c_void_p(kernel), *dims, s, argv, None),
        "plan, CUfunction, pointer array": lambda: launch(
            ctypes.c_void_p(function), *dims, s, argv, None),
        "plan, CUkernel, packed buffer": lambda: launch(
            ctypes.c_void_p(kernel), *dims, s, None, extra),
        "plan, CUfunction, packed buffer": lambda: launch(
            ctypes.c_void_p(function), *dims, s, None, extra),
    }
    for _ in range(2):
        for name, fn_ in rows.items():
            assert fn_() in (None, 0), name
            print(f"{name:55s} {ns(fn_, sync):8.0f} ns", flush=True)


if __name__ == "__main__":
    main()
