"""On a GPU: compile the main forward-kernel configurations, check each against the float64
reference on random inputs, and report registers, shared memory, local memory and the SASS
instruction mix (HMMA present? LDL/STL absent?). Also times first calls (compile or disk-cache
load) so a second process shows the on-disk cache at work.

    python scripts/gpu_kernel_report.py [--sass-dir DIR] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import re
import time

import cupy as cp
import numpy as np

from numba_flash.cuda.launch import attention as launch
from kernel_resources import loop_spills
from numba_flash_reference.attention import attention as reference

CONFIGS = [  # dtype, head_dim, causal, window, sinks, softcap
    ("float16", 128, False, (-1, -1), 0, None),
    ("float16", 128, True, (-1, -1), 0, None),
    ("bfloat16", 128, False, (-1, -1), 0, None),
    ("bfloat16", 128, True, (-1, -1), 0, None),
    ("float16", 64, False, (-1, -1), 0, None),
    ("float16", 64, True, (-1, -1), 0, None),
    ("bfloat16", 64, False, (-1, -1), 0, None),
    ("bfloat16", 64, True, (-1, -1), 0, None),
    ("float16", 32, False, (-1, -1), 0, None),
    ("float16", 96, True, (-1, -1), 0, None),
    ("float16", 256, False, (-1, -1), 0, None),
    ("bfloat16", 256, True, (-1, -1), 0, None),
    ("float16", 128, False, (100, 20), 4, 30.0),
    ("float32", 64, False, (-1, -1), 0, None),
    ("float32", 128, True, (-1, -1), 0, None),
    ("float64", 64, True, (-1, -1), 0, None),
    ("float64", 256, False, (-1, -1), 0, None),
]


def _inputs(dtype, b, sq, sk, hq, hkv, d, rng):
    import torch

    shapes = [(b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, d)]
    host = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    if dtype == "bfloat16":
        dev = [torch.from_numpy(x).to("cuda", torch.bfloat16) for x in host]
        back = [x.float().cpu().numpy() for x in dev]
        return dev, back
    dev = [cp.asarray(x.astype(dtype)) for x in host]
    return dev, [cp.asnumpy(x).astype(np.float64) for x in dev]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sass-dir", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--only", default=None, help="comma-separated head_dims to report")
    args = ap.parse_args()
    rng = np.random.default_rng(1)
    report = []
    only = {int(x) for x in args.only.split(",")} if args.only else None
    for dtype, d, causal, window, sinks, softcap in CONFIGS:
        if only and d not in only:
            continue
        (q, k, v), (q64, k64, v64) = _inputs(dtype, 2, 200, 333, 4, 2, d, rng)
        kw = dict(softmax_scale=d ** -0.5, causal=causal, window_size=window, sinks=sinks,
                  softcap=softcap)
        t0 = time.perf_counter()
        out, lse = launch.attention_cuda(q, k, v, return_lse=True, **kw)
        cp.cuda.runtime.deviceSynchronize()
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        launch.attention_cuda(q, k, v, return_lse=True, **kw)
        cp.cuda.runtime.deviceSynchronize()
        second = time.perf_counter() - t0
        ref, ref_lse = reference(q64, k64, v64, return_lse=True, **kw)
        o = out.float().cpu().numpy() if dtype == "bfloat16" else cp.asnumpy(out).astype(np.float64)
        l = lse.cpu().numpy() if dtype == "bfloat16" else cp.asnumpy(lse)
        err = float(np.abs(o - ref).max())
        fin = np.isfinite(ref_lse)
        lse_err = float(np.abs(l[fin] - ref_lse[fin]).max()) if fin.any() else 0.0
        has_left, has_right = window[0] >= 0, (0 if causal else window[1]) >= 0
        kern = launch.kernel_for(dtype, d, has_left, has_right, has_left and sinks > 0,
                                 softcap is not None, True).kernel
        entry = dict(dtype=dtype, head_dim=d, causal=causal, window=window, sinks=sinks,
                     softcap=softcap, max_err=err, lse_err=lse_err, nan=bool(np.isnan(o).any()),
                     first_call_s=round(first, 3), second_call_s=round(second, 4))
        for sig in list(kern.overloads):
            ov = kern.overloads[sig]
            regs, smem, lmem = ov.regs_per_thread, ov.shared_mem_per_block, ov.local_mem_per_thread
            sass = ov.inspect_sass()
            ops = re.findall(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass, re.M)
            entry.update(regs=regs, smem=smem, local=lmem, n_hmma=sass.count("HMMA"),
                         n_ldl=len(re.findall(r"\bLDL\b", sass)), n_stl=len(re.findall(r"\bSTL\b", sass)),
                         ldl_stl_in_loops=loop_spills(sass), n_sass=len(ops))
            if args.sass_dir:
                name = f"{dtype}_d{d}_{'causal' if causal else 'full'}{'_win' if has_left else ''}"
                with open(f"{args.sass_dir}/{name}.sass", "w") as f:
                    f.write(sass)
            break
        report.append(entry)
        print(" ".join(f"{k}={v}" for k, v in entry.items()), flush=True)
    print("compiled specialisations:", launch.compiled_kernel_count())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
