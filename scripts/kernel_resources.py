"""Registers, spills and the SASS instruction mix of the kernels, without a GPU.

Numba compiles a kernel to PTX with NVVM alone (no driver needed); ptxas and cuobjdump from the
NVIDIA pip wheels turn it into sm_90 machine code. With the same toolkit version as the GPU
machine's driver (CUDA 13.0 there: NVVM emits PTX 9.0, which newer ptxas builds also read, but
only 13.0's ptxas reproduces the driver's register allocation), the numbers match what
``inspect_sass()`` reports on the H100 exactly (checked: D=128 forward, 255 registers, 5 / 8
spill reloads in the key loop, full / causal). Install once:

    pip install "nvidia-nvvm==13.0.*" "nvidia-cuda-nvcc==13.0.*" nvidia-cuda-nvrtc nvidia-cuda-cuobjdump

Usage:

    python scripts/kernel_resources.py                       # the main forward configurations
    python scripts/kernel_resources.py --head-dim 128 --causal --sass-out /tmp/k.sass

From Python (any kernel, e.g. decode's): ``report(py_func, signature)`` returns a dict with
regs, spill_stores, spill_loads, ldl_stl_in_loops, n_hmma, smem and the SASS text.
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import types as types_ns

os.environ["NUMBA_ENABLE_CUDASIM"] = "0"   # compile for real even without a driver

from numba import cuda  # noqa: E402
from numba.cuda import types  # noqa: E402


def _tool(name: str) -> str:
    """The NVIDIA wheel's tool (the same release as the wheel's NVVM, whose PTX an older ptxas
    on PATH may refuse), else the one on PATH."""
    for site in sys.path:
        hits = glob.glob(os.path.join(site, "nvidia", "cu1*", "bin", name))
        if hits:
            return hits[0]
    found = shutil.which(name)
    if found:
        return found
    raise SystemExit(f"{name} not found: pip install the NVIDIA wheels named in this script's docstring")


def loop_spills(sass: str):
    """(LDL, STL) inside loops: instructions between a backward branch and its target."""
    addr_of, lines = {}, []
    label = None
    for line in sass.splitlines():
        m = re.match(r"\s*(\.L_x_\d+):", line)
        if m:
            label = m.group(1)
            continue
        m = re.match(r"\s*/\*([0-9a-f]+)\*/\s+(.*)", line)
        if m:
            addr = int(m.group(1), 16)
            if label:
                addr_of[label] = addr
                label = None
            lines.append((addr, m.group(2)))
    loops = []
    for addr, text in lines:
        m = re.search(r"\bBRA\b.*?(?:`\((\.L_x_\d+)\)|(0x[0-9a-f]+))", text)
        if m:
            target = addr_of.get(m.group(1)) if m.group(1) else int(m.group(2), 16)
            if target is not None and target < addr:
                loops.append((target, addr))
    inside = [text for addr, text in lines if any(lo <= addr <= hi for lo, hi in loops)]
    return (sum(bool(re.search(r"\bLDL\b", t)) for t in inside),
            sum(bool(re.search(r"\bSTL\b", t)) for t in inside))


def a_operand_overwrites(sass: str) -> int:
    """Instructions that write a register an in-flight wgmma still reads as its A operand: for
    each ``HGMMA ... Rd, Ra, gdesc...`` (A from registers Ra..Ra+3), the writes to those
    registers that follow it in address order before the next ``WARPGROUP.DEPBAR.LE gsb0,
    0x0`` (the wait retiring every group). The PTX ISA leaves such a write undefined and ptxas
    does not prevent it (docs/perf-notes.md, wgmma_hold); 0 expected."""
    held, count = set(), 0
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(.*?)\s*;", line)
        if not m:
            continue
        text = re.sub(r"^@!?U?P[0-9T]+\s+", "", m.group(1))
        if text.startswith("WARPGROUP.DEPBAR.LE") and text.endswith("0x0"):
            held.clear()
            continue
        a = re.match(r"HGMMA\S*\s+R\d+,\s+R(\d+),\s+gdesc", text)
        if a:
            held.update(range(int(a.group(1)), int(a.group(1)) + 4))
            continue
        dst = re.match(r"[A-Z][A-Z0-9.]*\s+R(\d+)\b", text)
        if dst and held and not text.startswith(("ST", "RED", "ATOM", "HGMMA")):
            width = 2 if re.match(r"\S*(\.64|\.WIDE)\b", text) else 4 if ".128" in text.split()[0] else 1
            if held & set(range(int(dst.group(1)), int(dst.group(1)) + width)):
                count += 1
    return count


@contextlib.contextmanager
def _offline_device(cc):
    """Numba compiles each device function a kernel calls for the current device's compute
    capability, which needs a driver; offline, that device is one of capability ``cc``."""
    import numba.cuda.dispatcher as dispatcher
    real = dispatcher.get_current_device
    dispatcher.get_current_device = lambda: types_ns.SimpleNamespace(compute_capability=cc)
    try:
        yield
    finally:
        dispatcher.get_current_device = real


def report(py_func, signature, cc=(9, 0), maxntid=None) -> dict:
    """Compile ``py_func`` (a kernel's Python function, e.g. ``dispatcher.py_func``) for
    ``signature`` and compute capability ``cc`` offline; resources and SASS as a dict.
    ``maxntid``: the kernel's launch bound in threads (what ``cuda.jit(launch_bounds=...)``
    puts in the PTX; ptxas keeps the registers within it)."""
    with _offline_device(cc):
        ptx, _ = cuda.compile_ptx(py_func, signature, cc=cc)
    if maxntid:
        body = ptx.index("{", ptx.index(".entry"))
        ptx = ptx[:body] + f".maxntid {int(maxntid)}, 1, 1\n" + ptx[body:]
    arch = f"sm_{cc[0]}{cc[1]}{cc[2] if len(cc) > 2 else ''}"
    with tempfile.TemporaryDirectory() as tmp:
        ptx_path, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(ptx_path, "w") as f:
            f.write(ptx)
        run = subprocess.run([_tool("ptxas"), f"-arch={arch}", "-v", "-o", cubin, ptx_path],
                             capture_output=True, text=True, check=True)
        sass = subprocess.run([_tool("cuobjdump"), "-sass", cubin], capture_output=True,
                              text=True, check=True).stdout
    info = run.stderr

    def grab(pattern):
        m = re.search(pattern, info)
        return int(m.group(1)) if m else 0

    return dict(regs=grab(r"Used (\d+) registers"), spill_stores=grab(r"(\d+) bytes spill stores"),
                spill_loads=grab(r"(\d+) bytes spill loads"), smem=grab(r"(\d+) bytes smem"),
                ldl_stl_in_loops=loop_spills(sass), n_hmma=sass.count("HMMA"),
                n_ldl=len(re.findall(r"\bLDL\b", sass)), sass=sass, ptx=ptx, ptxas_info=info,
                a_overwrites=a_operand_overwrites(sass))


def forward_signature(half: bool, f64: bool = False, layout: str = "C"):
    """The plain-launch signature of the forward kernels (launch/attention.py's plans: the
    mask, cu_seqlens and ALiBi arrays as the library's placeholders)."""
    unused = (types.Array(types.int32, 2, "C"), types.Array(types.int32, 2, "C"),
              types.Array(types.int8, 3, "C"), types.Array(types.uint32, 2, "C"),
              types.Array(types.int32, 1, "C"), types.Array(types.int32, 1, "C"),
              types.Array(types.float32, 2, "C"))
    elem = types.uint32 if half else (types.float64 if f64 else types.float32)
    fty = types.float64 if f64 else types.float32
    arrays = [types.Array(elem, 4, layout)] * 4 + [types.Array(fty, 3, "C")]   # lse: as launched
    return types.void(*arrays, types.int64, types.int64, types.int64, fty, fty, fty,
                      types.int64, types.int64, types.int64, *unused)


def forward_report(dtype: str, head_dim: int, causal: bool, lse: bool = True, **extra) -> dict:
    """Offline report of one tensor-core / FMA forward kernel configuration."""
    from numba_flash.cuda.kernels import forward_fma, forward_geometry, forward_mma

    if dtype in ("float16", "bfloat16"):
        kern = forward_mma.make_mma_kernel(head_dim, dtype == "bfloat16", False, causal, False,
                                           False, lse, forward_geometry.mma_block_n(head_dim),
                                           m_tiles=forward_geometry.mma_m_tiles(head_dim), **extra)
        sig = forward_signature(True)
    else:
        itemsize = 8 if dtype == "float64" else 4
        kern = forward_fma.make_fma_kernel(head_dim, dtype == "float64", False, causal, False,
                                           False, lse, forward_geometry.fma_block_n(head_dim,
                                                                                    itemsize),
                                           **extra)
        sig = forward_signature(False, dtype == "float64")
    return report(kern.py_func, sig)


def backward_signature(half: bool, atomic: bool = True, f64: bool = False):
    """The signature of the backward's dK / dV kernel (``atomic``) or deterministic dQ kernel
    (launch/backward.py: C-contiguous caller arrays, padded row statistics)."""
    elem = types.uint32 if half else (types.float64 if f64 else types.float32)
    acc = types.float64 if f64 else types.float32
    fty = types.float32 if half else acc
    four, stats = types.Array(elem, 4, "C"), types.Array(acc, 3, "C")
    outs = [types.Array(acc, 4, "C")] * (3 if atomic else 1)
    n_scalars = 4 if half else 3
    return types.void(*[four] * 4, stats, stats, *outs, types.int64, types.int64, types.int64,
                      *[fty] * n_scalars, types.int64, types.int64, types.int64,
                      types.Array(types.int32, 2, "C"), types.Array(types.int32, 2, "C"))


def backward_report(dtype: str, head_dim: int, causal: bool, kernel: str = "dkdv",
                    atomic: bool = True) -> dict:
    """Offline report of the 16-bit backward's dK / dV (``kernel="dkdv"``, with atomic dQ or
    not) or deterministic dQ kernel (``"dq"``) at its default layout."""
    from numba_flash.cuda.kernels import backward as bw

    bf16 = dtype == "bfloat16"
    if kernel == "dkdv":
        kern = bw.make_mma_dkdv_kernel(head_dim, bf16, False, causal, False, False, atomic)
        return report(kern.py_func, backward_signature(True, True))
    kern = bw.make_mma_dq_kernel(head_dim, bf16, False, causal, False, False)
    return report(kern.py_func, backward_signature(True, False))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--head-dim", type=int, default=None)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--sass-out", default=None)
    args = ap.parse_args()
    if args.head_dim:
        configs = [(args.dtype or "float16", args.head_dim, args.causal)]
    else:
        configs = [(dt, d, c) for dt in ("float16", "bfloat16") for d in (32, 64, 96, 128, 256)
                   for c in (False, True)] + [("float32", 128, False), ("float64", 128, False)]
    print(f"{'dtype':9} {'D':>4} {'causal':6} {'regs':>4} {'spill st/ld B':>13} "
          f"{'LDL,STL in loops':>16} {'HMMA':>5} {'smem':>6}")
    for dt, d, c in configs:
        r = forward_report(dt, d, c)
        print(f"{dt:9} {d:4d} {str(c):6} {r['regs']:4d} {r['spill_stores']:6d}/{r['spill_loads']:<6d} "
              f"{str(r['ldl_stl_in_loops']):>16} {r['n_hmma']:5d} {r['smem']:6d}", flush=True)
        if args.sass_out:
            with open(args.sass_out, "w") as f:
                f.write(r["sass"])


if __name__ == "__main__":
    main()
