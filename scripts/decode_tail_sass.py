"""Offline SASS of the tensor-core decode kernel's folded-merge tail, old against new
(NUMBA_FLASH_DECODE_TAIL), without a GPU: registers, spills, and the instruction mix from the
first partial-state store to the kernel's last EXIT (the out-of-line shuffle fallbacks after
it excluded). Static counts: every path of the tail (both passes of 16-row chunks, every
reduction depth) is in them. Needs the wheels named in kernel_resources.py plus
nvidia-cuda-nvdisasm (cuobjdump 13.5 calls it).

    python scripts/decode_tail_sass.py [--paged] [--bf16] [--sass-dir /tmp]
"""
from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernel_resources import report  # noqa: E402  (sets NUMBA_ENABLE_CUDASIM=0)

from numba.cuda import types  # noqa: E402

CLASSES = ("MEMBAR", "ERRBAR", "CCTL", "ATOMG", "SHFL", "LDG", "STG", "LDS", "STS", "MUFU",
           "CALL", "BRA", "WARPSYNC", "BSSY", "FSEL", "SEL")


def decode_signature():
    """The direct launch's signature (decode.py's ``_launch_mma_fast``), C-contiguous arrays."""
    from numba_flash.cuda.decode import _elem_types

    dims = (4, 4, 4, 2, 1, 2, 4, 3, 5, 4, 1)
    arrays = [types.Array(e, nd, "C") for e, nd in zip(_elem_types(), dims)]
    return types.void(*arrays, types.int64, types.int64, types.int64, types.float32,
                      types.float32, types.float32, *([types.int64] * 6))


def tail_lines(sass: str):
    """SASS instructions from the first STG (the partial-state stores) to the last EXIT that
    precedes the out-of-line code (the final ``BRA`` to itself)."""
    ins = [re.sub(r"\s*/\*[0-9a-fx]+\*/\s*$", "", m.group(1)).strip()
           for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+([^;]*;)", sass)]
    first = next(i for i, t in enumerate(ins) if re.search(r"\bSTG\b", t))
    # the last EXIT before the first out-of-line WARPSYNC.COLLECTIVE (shuffle fallback) block
    coll = [i for i, t in enumerate(ins) if "WARPSYNC.COLLECTIVE" in t] or [len(ins)]
    end = max(i for i, t in enumerate(ins[:coll[0]]) if re.search(r"\bEXIT\b", t))
    return ins[first:end + 1]


def mix(lines):
    out = {"total": len(lines)}
    for c in CLASSES:
        out[c] = sum(bool(re.search(rf"\b{c}(\.|\b)", t)) for t in lines)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--paged", action="store_true")
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--sass-dir", default=None)
    args = ap.parse_args()
    from numba_flash.cuda.decode_mma import make_mma_decode_kernel

    sig = decode_signature()
    rows = {}
    for tail in ("old", "new"):
        kern = make_mma_decode_kernel(args.head_dim, args.bf16, args.paged, False, False, False,
                                      False, False, False, False, 32, 2, 1, True, True,
                                      64 if args.paged else 0, False, tail == "new")
        r = report(kern.py_func, sig)
        lines = tail_lines(r["sass"])
        rows[tail] = (r, mix(lines))
        if args.sass_dir:
            with open(os.path.join(args.sass_dir, f"decode_{tail}.sass"), "w") as f:
                f.write(r["sass"])
    print(f"D={args.head_dim} {'bf16' if args.bf16 else 'fp16'} "
          f"{'paged64' if args.paged else 'contiguous'}, 32x2x1 tile, fold, lse off")
    print(f"{'':6} {'regs':>4} {'spill':>5} {'LDL/STL loops':>13} " +
          " ".join(f"{c:>6}" for c in ("total",) + CLASSES))
    for tail, (r, m) in rows.items():
        print(f"{tail:6} {r['regs']:4d} {r['spill_stores'] + r['spill_loads']:5d} "
              f"{str(r['ldl_stl_in_loops']):>13} " +
              " ".join(f"{m[c]:6d}" for c in ("total",) + CLASSES))


if __name__ == "__main__":
    main()
