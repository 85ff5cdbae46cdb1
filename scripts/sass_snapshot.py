"""SASS of a fixed set of forward-kernel configurations, offline, to prove a refactor changes no
machine code.

    python scripts/sass_snapshot.py DIR              # write DIR/<config>.sass and DIR/summary.txt
    python scripts/sass_snapshot.py DIR --compare OLD  # ... and diff every kernel against OLD/

Needs what scripts/kernel_resources.py needs (NVVM, ptxas and cuobjdump / nvdisasm from the
NVIDIA wheels; no GPU). The configurations cover every code path of forward.py's three kernels:
the mma.sync kernel (both m-tile counts, register and shared-memory Q, window, sinks, softcap,
each mask kind, varlen, ALiBi), the wgmma kernel (sm_90a: plain, causal, interval mask), the
exact float32 / float64 kernel (the same options) and the exact tensor-core kernels (DMMA,
3xTF32: causal, window + sinks, softcap; DMMA also at head_dim 32 / 128 and packed at 96). Identical SASS means identical behaviour and
speed, so a change that passes ``--compare`` needs no new GPU run.
"""
from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(__file__))
import kernel_resources as kr  # noqa: E402  (sets NUMBA_ENABLE_CUDASIM=0)

from numba_flash.cuda.kernels import forward_dmma, forward_fma, forward_mma, forward_tf32x3  # noqa: E402,E501
from numba_flash.cuda.kernels import forward_ws  # noqa: E402
from numba_flash.cuda.kernels import forward_geometry as geometry  # noqa: E402
from numba_flash.cuda.kernels.masking import BITMASK, INTERVALS, NONE  # noqa: E402

# name: (dtype, head_dim, (has_left, has_right, has_sinks, has_softcap, write_lse), extra)
_FLAGS = {"plain": (False, False, False, False, True),
          "causal": (False, True, False, False, True),
          "window_sinks": (True, True, True, False, True),
          "softcap": (False, False, False, True, False)}
CONFIGS = []
for _dt, _d in (("float16", 64), ("bfloat16", 128), ("float16", 256), ("float32", 64),
                ("float64", 128)):
    for _flag in _FLAGS:
        CONFIGS.append((f"{_dt}_d{_d}_{_flag}", _dt, _d, _FLAGS[_flag], {}, False))
    for _kind, _kname in ((INTERVALS, "intervals"), (BITMASK, "bitmask")):
        CONFIGS.append((f"{_dt}_d{_d}_{_kname}_causal", _dt, _d, _FLAGS["causal"],
                        {"mask_kind": _kind}, False))
    CONFIGS.append((f"{_dt}_d{_d}_varlen_alibi", _dt, _d, _FLAGS["causal"],
                    {"varlen": True, "has_alibi": True}, False))
for _d in (64, 128):
    for _flag in ("plain", "causal", "window_sinks"):
        CONFIGS.append((f"wgmma_float16_d{_d}_{_flag}", "float16", _d, _FLAGS[_flag], {}, True))
    CONFIGS.append((f"wgmma_bfloat16_d{_d}_intervals", "bfloat16", _d, _FLAGS["causal"],
                    {"mask_kind": INTERVALS}, True))
CONFIGS.append(("wgmma_float16_d128_bitmask", "float16", 128, _FLAGS["plain"],
                {"mask_kind": BITMASK}, True))
for _flag in ("plain", "causal", "window_sinks", "softcap"):
    CONFIGS.append((f"wgmma_bfloat16_d256_{_flag}", "bfloat16", 256, _FLAGS[_flag], {}, True))
for _flag in ("plain", "causal", "window_sinks"):
    CONFIGS.append((f"wgmma_float16_d96_{_flag}", "float16", 96, _FLAGS[_flag], {}, True))
CONFIGS.append(("wgmma_bfloat16_d96_intervals", "bfloat16", 96, _FLAGS["causal"],
                {"mask_kind": INTERVALS}, True))
CONFIGS.append(("wgmma_float16_d256_intervals", "float16", 256, _FLAGS["causal"],
                {"mask_kind": INTERVALS}, True))
CONFIGS.append(("wgmma_float16_d256_varlen_alibi", "float16", 256, _FLAGS["causal"],
                {"varlen": True, "has_alibi": True}, True))
# The exact tensor-core kernels (off by default): DMMA float64 and 3xTF32 float32.
for _exact, _d in (("dmma", 64), ("tf32x3", 64)):
    for _flag in ("causal", "window_sinks", "softcap"):
        CONFIGS.append((f"{_exact}_d{_d}_{_flag}", _exact, _d, _FLAGS[_flag], {}, False))
for _d in (32, 128):        # DMMA: Q's fragments in registers (32); 8 warps, one stage (128)
    for _flag in ("plain", "window_sinks"):
        CONFIGS.append((f"dmma_d{_d}_{_flag}", "dmma", _d, _FLAGS[_flag], {}, False))
CONFIGS.append(("dmma_d96_varlen_causal", "dmma", 96, _FLAGS["causal"], {"varlen": True}, False))

# The warp-specialised wgmma kernel (plain / causal, head_dim 96 / 128 / 256; interval masks at
# 64 / 96 / 128).
WS_CONFIGS = [("ws_float16_d96_plain", False, 96, False, NONE),
              ("ws_float16_d128_plain", False, 128, False, NONE),
              ("ws_bfloat16_d128_causal", True, 128, True, NONE),
              ("ws_float16_d256_causal", False, 256, True, NONE),
              ("ws_bfloat16_d96_intervals_causal", True, 96, True, INTERVALS),
              ("ws_bfloat16_d128_intervals", True, 128, False, INTERVALS),
              ("ws_float16_d128_intervals_causal", False, 128, True, INTERVALS),
              ("ws_bfloat16_d64_intervals", True, 64, False, INTERVALS)]


def build_ws(is_bf16: bool, head_dim: int, causal: bool, mask_kind: int = NONE):
    """(py_func, signature, cc, maxntid) of one warp-specialised configuration."""
    kern = forward_ws.make_ws_kernel(head_dim, is_bf16, causal, True, mask_kind)
    return kern.py_func, kr.forward_signature(True), (9, 0, "a"), forward_ws.WS_THREADS


def build(dtype: str, head_dim: int, flags, extra: dict, wgmma: bool):
    """(py_func, signature, cc) of one configuration (``dtype`` "dmma" / "tf32x3": the exact
    tensor-core kernels)."""
    if dtype in ("dmma", "tf32x3"):
        factory = (forward_dmma.make_dmma_kernel if dtype == "dmma"
                   else forward_tf32x3.make_tf32x3_kernel)
        kern = factory(head_dim, *flags, **extra)
        return kern.py_func, kr.forward_signature(False, dtype == "dmma"), (9, 0)
    if dtype in ("float16", "bfloat16"):
        kern = forward_mma.make_mma_kernel(head_dim, dtype == "bfloat16", *flags,
                                           geometry.mma_block_n(head_dim, wgmma),
                                           m_tiles=geometry.mma_m_tiles(head_dim, wgmma),
                                           wgmma=wgmma, **extra)
        sig = kr.forward_signature(True)
    else:
        itemsize = 8 if dtype == "float64" else 4
        kern = forward_fma.make_fma_kernel(head_dim, dtype == "float64", *flags,
                                           geometry.fma_block_n(head_dim, itemsize), **extra)
        sig = kr.forward_signature(False, dtype == "float64")
    return kern.py_func, sig, ((9, 0, "a") if wgmma else (9, 0))


def _strip(sass: str) -> str:
    """The instructions alone (cuobjdump's header names the temporary file): every line with an
    address, 4 hex digits or more (a kernel past 0xffff bytes has 5)."""
    return "\n".join(line for line in sass.splitlines() if re.match(r"\s*/\*[0-9a-f]{4,}\*/", line))


def _ptx_body(ptx: str) -> str:
    """The PTX without its comment lines (the compiler's version banner) and with the mangled
    names of the kernel and its helpers (they carry module paths and unique ids) numbered in
    order of appearance: identical text means the same program, whatever ptxas links it."""
    names: dict = {}

    def number(m):
        return names.setdefault(m.group(0), f"_F{len(names)}")

    body = "\n".join(line for line in ptx.splitlines() if not line.lstrip().startswith("//"))
    return re.sub(r"_Z[A-Za-z0-9_$]+", number, body)


def parse_args(description: str):
    """The snapshot scripts' command line: an output folder, ``--compare``, ``--only``."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("out")
    ap.add_argument("--compare", default=None, help="a previous snapshot's folder")
    ap.add_argument("--only", default=None, help="substring of the configuration names to run")
    return ap.parse_args()


def snapshot(builds, out: str, compare=None, width: int = 34) -> int:
    """Compile each ``(name, build)`` of ``builds`` (``build()`` -> py_func, signature, cc and
    optionally the launch bound in threads)
    offline, write ``out/<name>.sass``, ``out/<name>.ptx`` (``_ptx_body``) and
    ``out/summary.txt``, and with ``compare`` (a previous snapshot's folder) print each kernel's
    verdict on its SASS and, where the old snapshot has it, its PTX (identical PTX: identical
    machine code from any ptxas, the GPU driver's included); the exit status: 1 if any kernel's
    SASS differs."""
    os.makedirs(out, exist_ok=True)
    rows, differ = [], []
    for name, build_one in builds:
        py_func, sig, cc, *maxntid = build_one()
        r = kr.report(py_func, sig, cc=cc, maxntid=maxntid[0] if maxntid else None)
        sass, ptx = _strip(r["sass"]), _ptx_body(r["ptx"])
        for ext, text in ((".sass", sass), (".ptx", ptx)):
            with open(os.path.join(out, name + ext), "w") as f:
                f.write(text + "\n")
        verdict = ""
        if compare:
            old = [open(p).read().rstrip("\n") if os.path.exists(p) else None
                   for p in (os.path.join(compare, name + ext) for ext in (".sass", ".ptx"))]
            verdict = ("missing" if old[0] is None else "same" if old[0] == sass else "DIFFERENT")
            if old[1] is not None:
                verdict += ", PTX " + ("same" if old[1] == ptx else "different")
            if not verdict.startswith("same"):
                differ.append(name)
        # LDL counts local-memory loads of any kind: spills, and local arrays ptxas could not
        # keep in registers (indices not constant: a loop left rolled), which "spills" misses.
        row = (f"{name:{width}} regs {r['regs']:3} spills {r['spill_stores']}/{r['spill_loads']} "
               f"LDL {r['n_ldl']:3} instructions {sass.count(chr(10)) + 1:5} {verdict}")
        rows.append(row)
        print(row, flush=True)
    with open(os.path.join(out, "summary.txt"), "w") as f:
        f.write("\n".join(rows) + "\n")
    if compare:
        print(f"{len(rows) - len(differ)} of {len(rows)} kernels have identical SASS"
              + (f"; different: {', '.join(differ)}" if differ else ""))
    return 1 if differ else 0


def main():
    args = parse_args(__doc__.splitlines()[0])
    builds = [(name, lambda c=(dtype, d, flags, extra, wg): build(*c))
              for name, dtype, d, flags, extra, wg in CONFIGS
              if not args.only or args.only in name]
    builds += [(name, lambda c=(bf16, d, causal, kind): build_ws(*c))
               for name, bf16, d, causal, kind in WS_CONFIGS if not args.only or args.only in name]
    sys.exit(snapshot(builds, args.out, args.compare))


if __name__ == "__main__":
    main()
