"""Launch-variant A/B of numba_flash.decode in one process: programmatic dependent launch
(NUMBA_FLASH_DECODE_PDL), a shared-memory pad that caps the blocks per multiprocessor
(NUMBA_FLASH_DECODE_SMEM_PAD), the cluster merge (NUMBA_FLASH_DECODE_CLUSTER) and the
evict-first L2 hint of the K/V copies (NUMBA_FLASH_DECODE_HINT), on the
bench_decode shapes, float16, contiguous and paged caches. Every variant is timed twice,
interleaved with the others (drift shows in the pair), as bench_decode times (back to back
behind a spin kernel, CUDA events).

    python scripts/decode_launch_ab.py [--shapes 3,0] [--layouts none,16,64,16o,seqo] [--out ab.json]
        [--variants "base:;pdl:PDL=1;pdl_pad:PDL=1,SMEM_PAD=16384;s12:SPLITS=12"]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import SHAPES, copy_bandwidth_gbs, gpu_time_ms, make_inputs  # noqa: E402

import numba_flash  # noqa: E402

DEFAULT_VARIANTS = "base:;cap:SMEM_PAD=auto;pdl_cap:PDL=1,SMEM_PAD=auto;pdl2_cap:PDL=2,SMEM_PAD=auto"
KNOBS = ("PDL", "SMEM_PAD", "CLUSTER", "TAIL", "HINT")


def parse_variants(text):
    out = []
    for item in text.split(";"):
        name, _, sets = item.partition(":")
        env = dict(kv.split("=") for kv in sets.split(",") if kv)
        out.append((name, env))
    return out


def set_env(env):
    """Set the variant's NUMBA_FLASH_DECODE_* knobs (the others unset); returns its num_splits
    ("auto" unless the variant names SPLITS=n)."""
    for knob in KNOBS:
        os.environ.pop(f"NUMBA_FLASH_DECODE_{knob}", None)
    os.environ["NUMBA_FLASH_DECODE_CLUSTER"] = "0"
    for knob, value in env.items():
        if knob != "SPLITS":
            os.environ[f"NUMBA_FLASH_DECODE_{knob}"] = value
    return int(env["SPLITS"]) if "SPLITS" in env else "auto"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="3,0,1,2,4")
    ap.add_argument("--layouts", default="none,16,64")
    ap.add_argument("--variants", default=DEFAULT_VARIANTS)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--out", default="decode_launch_ab.json")
    args = ap.parse_args()
    from numba_flash.cuda.decode import LAST_PLAN

    variants = parse_variants(args.variants)
    copy_bw = copy_bandwidth_gbs()
    dev = torch.cuda.get_device_name()
    print(f"{dev}: copy bandwidth {copy_bw:.0f} GB/s", flush=True)
    rows = []
    for si in (int(i) for i in args.shapes.split(",")):
        b, hq, hkv, L, d = SHAPES[si]
        for lay in args.layouts.split(","):
            # "16o": 16-row pages in order (block table 0, 1, 2, ...), for diagnosis; "seqo":
            # one page per sequence (the cache copied into the paged layout, in order)
            page = None if lay == "none" else L if lay == "seqo" else int(lay.rstrip("o"))
            q, k, v, lens, table = make_inputs(b, hq, hkv, L, d, args.dtype, page,
                                               ordered=lay.endswith("o"))
            kv_bytes = 2 * b * L * hkv * d * q.element_size()
            splits = ["auto"]
            fn = lambda: numba_flash.decode(q, k, v, cache_seqlens=lens, block_table=table,
                                            num_splits=splits[0])
            ref = None
            times = {name: [] for name, _ in variants}
            plans = {}
            for _ in range(2):
                for name, env in variants:
                    splits[0] = set_env(env)
                    out = fn()
                    if ref is None:
                        ref = out.float()
                    err = (out.float() - ref).abs().max().item()
                    assert err < 2e-3, (name, err)
                    times[name].append(gpu_time_ms(fn) * 1e3)
                    plans[name] = (LAST_PLAN.get("splits"), LAST_PLAN.get("merge"),
                                   LAST_PLAN.get("smem_pad"))
            row = dict(shape=(b, hq, hkv, L, d), layout=lay, dtype=args.dtype)
            parts = []
            for name, _ in variants:
                us = statistics.median(times[name])
                pct = 100 * kv_bytes / (us * 1e-6) / 1e9 / copy_bw
                row[name] = dict(us=times[name], pct_copy=pct, splits=plans[name][0],
                                 merge=plans[name][1], smem_pad=plans[name][2])
                parts.append(f"{name} {us:.2f}us {pct:.1f}%")
            rows.append(row)
            pads = sorted({p[2] for p in plans.values() if p[2]})
            print(f"{str((b, hq, hkv, L)):22s} {lay:>5s} splits {plans[variants[0][0]][0]:>3} "
                  f"pad {pads}: " + " | ".join(parts), flush=True)
            del q, k, v, lens, table
            torch.cuda.empty_cache()
    set_env({})
    with open(args.out, "w") as f:
        json.dump(dict(device=dev, copy_gbs=copy_bw, variants=args.variants, rows=rows), f,
                  indent=1)


if __name__ == "__main__":
    main()
