"""Why is the cluster merge slower? Times (1, 32, 32, 8192) decode with the last-warp fold and
with the cluster merge at several shared-memory pads (NUMBA_FLASH_DECODE_SMEM_PAD caps the
blocks per multiprocessor), in one process; then a placement probe: a kernel with the decode
kernel's geometry (512 one-warp blocks, 32 KB of shared memory, the same pads, with and
without 16-block clusters) records each block's multiprocessor (%smid) and start time
(%globaltimer), and prints how the blocks spread over the multiprocessors.

    python scripts/decode_cluster_probe.py [--out probe.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import copy_bandwidth_gbs, gpu_time_ms, make_inputs  # noqa: E402

import numba_flash  # noqa: E402

PADS = (0, 8192, 16384)


def timings(copy_bw):
    from numba_flash.cuda.decode import LAST_PLAN

    out = []
    for page in (None, 16):
        q, k, v, lens, table = make_inputs(1, 32, 32, 8192, 128, "float16", page)
        kv_bytes = 2 * 8192 * 32 * 128 * 2
        fn = lambda: numba_flash.decode(q, k, v, cache_seqlens=lens, block_table=table)
        for rep in range(2):
            for cluster in ("0", "1"):
                for pad in PADS:
                    os.environ["NUMBA_FLASH_DECODE_CLUSTER"] = cluster
                    os.environ["NUMBA_FLASH_DECODE_SMEM_PAD"] = str(pad)
                    t = gpu_time_ms(fn)
                    r = dict(layout="contiguous" if page is None else f"paged{page}", rep=rep,
                             merge=LAST_PLAN.get("merge"), pad=pad, us=t * 1e3,
                             pct_copy=100 * kv_bytes / t / 1e6 / copy_bw)
                    out.append(r)
                    print(f"{r['layout']:10s} rep {rep} {r['merge']:7s} pad {pad:5d}: "
                          f"{r['us']:.2f} us {r['pct_copy']:.1f}%", flush=True)
    os.environ.pop("NUMBA_FLASH_DECODE_CLUSTER")
    os.environ.pop("NUMBA_FLASH_DECODE_SMEM_PAD")
    return out


def placement():
    from llvmlite import ir
    from numba import cuda
    from numba.cuda import types
    from numba.cuda.extending import intrinsic

    from numba_flash.cuda import launch
    from numba_flash.cuda.decode import _allow_large_clusters, _cluster_config

    def _sreg(name, bits):
        @intrinsic
        def read(typingctx):
            ty = types.uint32 if bits == 32 else types.uint64
            sig = ty()

            def codegen(context, builder, sig, args):
                fnty = ir.FunctionType(ir.IntType(bits), [])
                c = "=r" if bits == 32 else "=l"
                return builder.call(ir.InlineAsm(fnty, f"mov.u{bits} $0, %{name};", c,
                                                 side_effect=True), [])
            return sig, codegen
        return read

    smid = _sreg("smid", 32)
    gtime = _sreg("globaltimer", 64)

    @cuda.jit
    def probe(sm_out, t_out, spin_ns):
        buf = cuda.shared.array(8192, types.uint32)       # 32 KB, as the decode kernel's rings
        t0 = gtime()
        buf[cuda.threadIdx.x] = np.uint32(t0)
        while gtime() - t0 < spin_ns:
            pass
        b = cuda.blockIdx.x + cuda.gridDim.x * cuda.blockIdx.z
        if cuda.threadIdx.x == 0:
            sm_out[b] = smid() + buf[0] * 0
            t_out[b] = t0

    nblk = 16 * 32
    sm = cuda.device_array(nblk, np.uint32)
    ts = cuda.device_array(nblk, np.uint64)
    kobj = probe.compile(types.void(types.uint32[::1], types.uint64[::1], types.uint64))
    cufunc = kobj._codelibrary.get_cufunc()
    _allow_large_clusters(cufunc, cuda.get_current_device().id)
    results = []
    import ctypes

    for cluster in (False, True):
        for pad in PADS:
            if pad:
                from cuda.bindings import driver as cu

                cu.cuKernelSetAttribute(
                    cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    pad, cufunc.handle, cu.CUdevice(cuda.get_current_device().id))
            grid = (16, 1, 32)
            cfg = _cluster_config(grid, 32, 16, pad) if cluster else \
                launch._launch_config(grid, 32, pad)
            params = []
            for arr in (sm, ts):
                lay, flat = launch._flat_array(arr.device_ctypes_pointer.value, arr.shape,
                                               arr.strides, arr.dtype.itemsize)
                params.extend(flat)
            params.append(ctypes.c_uint64(20000))
            stream = launch._core_stream(0)
            launch._core_launch(stream, cfg, cufunc.kernel, *params)
            cuda.synchronize()
            s = sm.copy_to_host()
            t = ts.copy_to_host().astype(np.int64)
            per_sm = np.bincount(s, minlength=132)
            clusters = [len(set(s[c * 16:(c + 1) * 16])) for c in range(32)] if cluster else []
            r = dict(cluster=cluster, pad=pad, sms_used=int((per_sm > 0).sum()),
                     max_per_sm=int(per_sm.max()), hist=np.bincount(per_sm).tolist(),
                     start_spread_us=float((t.max() - t.min()) / 1e3),
                     sms_per_cluster=clusters)
            results.append(r)
            print(f"placement cluster={cluster} pad={pad}: SMs used {r['sms_used']}, max blocks "
                  f"per SM {r['max_per_sm']}, histogram (SMs with 0,1,2.. blocks) {r['hist']}, "
                  f"start spread {r['start_spread_us']:.1f} us"
                  + (f", SMs per cluster {sorted(clusters)}" if cluster else ""), flush=True)
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="decode_cluster_probe.json")
    args = ap.parse_args()
    copy_bw = copy_bandwidth_gbs()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy_bw:.0f} GB/s", flush=True)
    res = dict(device=torch.cuda.get_device_name(), copy_gbs=copy_bw)
    try:
        res["placement"] = placement()
    except Exception as exc:  # noqa: BLE001 - the timings still matter
        print("placement probe failed:", repr(exc), flush=True)
    res["timings"] = timings(copy_bw)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    best = {}
    for r in res["timings"]:
        key = (r["layout"], r["merge"], r["pad"])
        best.setdefault(key, []).append(r["us"])
    for key, v in best.items():
        print(key, f"median {statistics.median(v):.2f} us")


if __name__ == "__main__":
    main()
