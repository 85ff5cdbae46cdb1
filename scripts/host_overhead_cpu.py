"""Host (Python) time of one ``numba_flash.attention`` / ``decode`` GPU call, without a GPU.

The GPU path of ``attention`` spends host time in two places: our Python (validation, the
kernel's key and geometry, packing the launch parameters) and the driver or the array library
(the launch itself, the output allocation, the current stream). This script measures the first
alone, on any machine: it imports the real launcher (not the simulator), stubs out every call
that needs a driver (device queries, the output allocation, the stream, the compiled-kernel
lookup, ``cuda.core.launch``; the parameters are still packed by cuda.core's ParamHolder) and
times complete calls on fake CuPy-like arrays, plain, with the causal flag and with a mask
object whose device plan is cached (as after a first call), and ``numba_flash.decode`` on a
contiguous and a paged cache (tensor-core kernel, merge folded in).

    python scripts/host_overhead_cpu.py [--profile] [--calls 3000]

What it prints is a lower bound of the host time on a GPU machine (the real driver and array
library add to it; scripts/mask_profile.py measures the whole on a GPU).
"""
from __future__ import annotations

import argparse
import cProfile
import ctypes
import os
import pstats
import time
import types

os.environ["NUMBA_ENABLE_CUDASIM"] = "0"   # the real launcher, compiled for nothing

import numpy as np  # noqa: E402

import numba_flash  # noqa: E402
from numba_flash import masks  # noqa: E402
from numba_flash.cuda import decode as decode_gpu  # noqa: E402
from numba_flash.cuda import device, forward, launch, maskplan  # noqa: E402


class _Device:
    id = 0


class _Memory:
    def __init__(self, ptr: int):
        self.ptr = ptr


class FakeGPUArray:
    """A C-contiguous array that looks like a CuPy array to numba_flash (no memory behind it;
    ``ptr`` is the address it claims)."""

    def __init__(self, shape, dtype, ptr: int = 1 << 20):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.itemsize = self.dtype.itemsize
        strides, step = [], self.itemsize
        for n in reversed(self.shape):
            strides.insert(0, step)
            step *= n
        self.strides = tuple(strides)
        self.size = int(np.prod(self.shape))
        self.device, self.data = _Device, _Memory(ptr)

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": self.dtype.str, "strides": self.strides,
                "data": (self.data.ptr, False), "version": 3}

    def __setitem__(self, index, value):
        """A fill (``out[...] = 0``) would be device work: nothing to do here."""


FakeGPUArray.__module__ = "cupy"   # launch.py picks its CuPy code path by module name


def stub_driver(cc=(9, 0)):
    """Replace every launcher call that needs a driver or a GPU by a stand-in."""
    from cuda.core._kernel_arg_handler import ParamHolder

    zero = lambda *a, **k: 0  # noqa: E731
    for module in (device, launch, maskplan, forward):
        if hasattr(module, "current_device_id"):
            module.current_device_id = zero
    forward.compute_capability = lambda dev: cc
    launch._launcher = lambda *a, **k: (None, ctypes.c_float)
    launch._core_launch = lambda stream, config, kernel, *params: ParamHolder(params)
    launch._core_stream = lambda handle: None
    launch._launch_config = lambda grid, threads, smem=0: (grid, threads, smem)
    launch._raw_stream_handle = zero
    launch._resolve_stream = zero
    launch._empty_like_kind = lambda kind, like, shape, dt: FakeGPUArray(
        shape, "uint16" if dt == "bfloat16" else dt)
    launch._DeviceNDArray = FakeGPUArray   # plan arrays keep their packed launch arguments
    plans = {}

    def plan_mask(mask, batch, heads_q, seqlen_q, seqlen_k, block_m, block_n, varlen, stream):
        key = (id(mask), seqlen_q, seqlen_k, block_m, block_n)
        if key not in plans:
            plans[key] = maskplan.MaskPlan(
                maskplan.INTERVALS, FakeGPUArray((4, seqlen_k), "int32"),
                FakeGPUArray((8, -(-seqlen_k // block_n)), "int32"),
                FakeGPUArray((1, 1, 1), "int8"), FakeGPUArray((1, 1), "uint32"), None)
        return plans[key]

    dummies = maskplan._Dummies(*(FakeGPUArray((2,), "int32") for _ in range(6)))
    launch.plan_mask = plan_mask
    launch.dummy_arrays = lambda: dummies

    # decode: device properties, its cached small buffers, the compiled-kernel table
    decode_gpu.current_device_id = zero
    decode_gpu._sm_count = lambda dev: 132
    decode_gpu._pdl_device = lambda dev: True
    buffers = {}

    def small_buffer(kind, dev, shape, dtype):
        key = (shape, np.dtype(dtype).str)
        if key not in buffers:
            buffers[key] = FakeGPUArray(shape, dtype)
        return buffers[key]

    decode_gpu._dummy = small_buffer
    decode_gpu._counters = lambda kind, dev, n, stream: small_buffer(kind, dev, (4096,), np.int32)

    class AnyKernel(dict):
        def get(self, key, default=None):
            return types.SimpleNamespace(kernel=object(), handle=None)

    decode_gpu._FAST_LAUNCHERS = AnyKernel()


def per_call_us(fn, calls: int, rounds: int = 5) -> float:
    """Best over rounds of the mean microseconds per call."""
    for _ in range(50):
        fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--profile", action="store_true", help="cProfile the masked call")
    args = ap.parse_args()
    stub_driver()
    b, n, h, d = 4, 8192, 16, 128
    q, k, v = (FakeGPUArray((b, n, h, d), "float16") for _ in range(3))
    document = masks.causal_document([2000, 3000, 3192])
    cases = {"plain": {}, "causal flag": {"causal": True},
             "causal_document mask": {"mask": document},
             "plain, return_lse": {"return_lse": True}}
    print(f"numba_flash.attention host time with the driver stubbed, (B, N, H, D) = "
          f"({b}, {n}, {h}, {d}) float16")
    for name, kw in cases.items():
        us = per_call_us(lambda: numba_flash.attention(q, k, v, **kw), args.calls)
        print(f"  {name:24} {us:7.1f} us per call")
    bq, hq, hkv, cap = 8, 32, 8, 32768
    dq = FakeGPUArray((bq, 1, hq, d), "float16")
    kc, vc = (FakeGPUArray((bq, cap, hkv, d), "float16", ptr=p) for p in (1 << 24, 1 << 28))
    lens = FakeGPUArray((bq,), "int32")
    kp, vp = (FakeGPUArray((bq * cap // 64, 64, hkv, d), "float16", ptr=p)
              for p in (1 << 24, 1 << 28))
    table = FakeGPUArray((bq, cap // 64), "int32")
    print(f"numba_flash.decode host time with the driver stubbed, (B, Hq, Hkv, L, D) = "
          f"({bq}, {hq}, {hkv}, {cap}, {d}) float16")
    for name, call in (
            ("contiguous cache", lambda: numba_flash.decode(dq, kc, vc, cache_seqlens=lens)),
            ("paged cache (64-row pages)", lambda: numba_flash.decode(
                dq, kp, vp, cache_seqlens=lens, block_table=table))):
        print(f"  {name:26} {per_call_us(call, args.calls):7.1f} us per call")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            numba_flash.attention(q, k, v, mask=document)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
