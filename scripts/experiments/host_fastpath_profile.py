"""Host cost of numba_flash.attention's repeated-call path without a GPU: torch CPU tensors, the
driver replaced by a no-op (no libcuda needed), a recorded plan injected under the call's
signature. Prints microseconds per call of the whole door and of its pieces.

    python scripts/experiments/host_fastpath_profile.py      # needs torch (a CPU build will do)

What it leaves out, so add on a GPU machine: the real cuLaunchKernel (~2-3 us), CUDA instead of
CPU tensor allocation, the current-stream query. scripts/bench_overhead.py measures all of it.
"""
import ctypes
import os
import time

os.environ["NUMBA_ENABLE_CUDASIM"] = "0"

import torch  # noqa: E402
from numba.cuda import types  # noqa: E402

import numba_flash  # noqa: E402
from numba_flash import api  # noqa: E402
from numba_flash.cuda.launch import attention as runtime, driver, fastpath  # noqa: E402


class _NoDriver:
    def cuLaunchKernel(self, *args):  # noqa: N802
        return 0


class _Function:
    handle = 1


def per_call(fn, n=20000):
    for _ in range(1000):
        fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


def main():
    driver._DRIVER.update(lib=_NoDriver(), device=ctypes.c_int(-1), capturing=ctypes.c_int(),
                          launch=lambda *args: 0, function=lambda handle: handle,
                          param_layout=lambda function, sizes: driver.natural_layout(sizes))
    fastpath.current_device = lambda: -1          # CPU tensors report device -1
    words = driver.ArrayParam(types.uint32, (1, 128, 16, 32), (65536, 512, 32, 4), 4)
    plan = driver.LaunchPlan(_Function(), [words] * 4 + [driver.ScalarParam(types.int64, 1)] * 8,
                             (2, 16), 128)
    q, k, v = (torch.randn(1, 128, 16, 64, dtype=torch.float16) for _ in range(3))
    api._FAST[0] = runtime.attention_fast
    # numba_flash.attention's signature options (api.py), for attention(q, k, v, causal=True)
    opts = (None, True, (-1, -1), 0, None, None, True, False, "auto", True, True, None, None, None,
            "auto")
    _, (key, _) = runtime.attention_fast(q, k, v, opts, (), (None, None), None)
    call = fastpath.FastCall(plan, "torch", q, -1, (1, 128, 16, 64), "float16", None, (),
                             guards=(None, None), align=15)
    call.stream = lambda: 0
    fastpath.register_fast(runtime._FAST_CALLS, key, call)
    rows = [("numba_flash.attention (whole door)",
             lambda: numba_flash.attention(q, k, v, causal=True)),
            ("attention_fast", lambda: runtime.attention_fast(q, k, v, opts, (), (None, None),
                                                              None)),
            ("FastCall.run", lambda: call.run((q, k, v), (), (None, None), None)),
            ("torch.empty (CPU)", lambda: torch.empty((1, 128, 16, 64), dtype=torch.float16)),
            ("LaunchPlan.launch (no-op driver)", lambda: plan.launch([1, 2, 3, 4], 0))]
    for name, fn in rows:
        print(f"{name:36s} {per_call(fn):6.2f} us")


if __name__ == "__main__":
    main()
