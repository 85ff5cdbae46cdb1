"""What the wait for ``cache_seqlens`` costs the decode kernel: the issue's shapes with the
lengths given (every sequence full) against ``cache_seqlens=None`` (the kernel compiled with
``full_lens``: it reads no lengths, so its first copies wait for no load). Same process, same
caches, alternating, on the GPU.

    python scripts/decode_full_lens_ab.py [--rounds 3] [--json out.json]

Prints per shape and layout: microseconds per call (device time, back to back, as
bench_decode.py measures it) and % of the copy bandwidth, for both forms.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_decode import SHAPES, copy_bandwidth_gbs, gpu_time_ms, make_inputs  # noqa: E402

import numba_flash  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--json", default="decode_full_lens_ab.json")
    args = ap.parse_args()
    bw = copy_bandwidth_gbs()
    print(f"{torch.cuda.get_device_name()}; copy bandwidth {bw:.0f} GB/s; {args.dtype}")
    rows = []
    for b, hq, hkv, L, d in SHAPES:
        for page in (None, 16, 64):
            q, k, v, lens, table = make_inputs(b, hq, hkv, L, d, args.dtype, page)
            nbytes = 2 * b * L * hkv * d * q.element_size()
            given = lambda: numba_flash.decode(q, k, v, cache_seqlens=lens,  # noqa: E731
                                               block_table=table)
            full = lambda: numba_flash.decode(q, k, v, cache_seqlens=None,  # noqa: E731
                                              block_table=table)
            same = bool(torch.equal(given(), full()))
            t_given, t_full = [], []
            for _ in range(args.rounds):
                t_given.append(gpu_time_ms(given))
                t_full.append(gpu_time_ms(full))
            row = {"shape": [b, hq, hkv, L, d], "page": page, "dtype": args.dtype,
                   "bitwise_equal": same, "lens_us": min(t_given) * 1e3,
                   "none_us": min(t_full) * 1e3}
            for key in ("lens", "none"):
                row[f"{key}_pct_copy"] = nbytes / (row[f"{key}_us"] * 1e-6) / (bw * 1e9) * 100
            rows.append(row)
            print(f"{str((b, hq, hkv, L, d)):26} {str(page or 'contiguous'):10} lens "
                  f"{row['lens_us']:7.2f} us {row['lens_pct_copy']:5.1f} % | None "
                  f"{row['none_us']:7.2f} us {row['none_pct_copy']:5.1f} % | equal {same}",
                  flush=True)
            del q, k, v, lens, table
            torch.cuda.empty_cache()
    with open(args.json, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "copy_gbs": bw, "rows": rows}, f,
                  indent=1)


if __name__ == "__main__":
    main()
