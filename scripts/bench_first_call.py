"""First-call wall time of each operation in a fresh process, cold and warm (issue 23).

    python scripts/bench_first_call.py --json first_call.json [--ops decode,merge_states]
        [--cache-dir DIR] [--budget 470] [--op-timeout 150] [--simulator]

Every operation runs alone in a fresh Python subprocess (this script with ``--child OP``), as a
user's script would: CuPy is imported and the inputs are uploaded (host NumPy arrays, so no CuPy
kernel is compiled for them) and the device synchronised; then ``import numba_flash`` is timed;
then the operation's first call is timed up to a device synchronisation (Numba's CUDA
initialisation, the kernel's compilation or cache load, the launch and the kernel itself), and
its second call the same way, for reference. The backward's subprocess first runs the forward
with ``return_lse=True`` (untimed for the row, recorded as ``setup_s``).

Two passes over the operations share one fresh temporary cache directory made by this script:
``NUMBA_CACHE_DIR`` (Numba's kernel cache), and with it ``CUDA_CACHE_PATH`` (the driver's JIT
cache) and ``CUPY_CACHE_DIR``, so that the first pass is a fresh machine's (cold: every kernel
compiled) and the second a later process on the same machine (warm: the disk cache serves).
Whether it did is read from the library's own record, not from the times: each subprocess
prints ``numba_flash.cuda.launch.cache.kernel_cache_stats()`` (per kernel family, the
specialisations loaded from the disk cache ("hits") and compiled ("misses")); a warm row is a
hit when the subprocess compiled nothing and loaded at least one kernel (the backward's
subprocess counts its forward too).

Operations (float16 unless said; shapes (batch, seqlen, heads, head_dim)):
  import             import numba_flash alone (also recorded in every other subprocess)
  cuda_context       numba.cuda imported and its context made, no kernel (a floor for the rest)
  attention          q, k, v (2, 1024, 16, 128), causal
  attention_mask     the same shape, mask=masks.causal_document([256, 512, 256]) (interval mask)
  varlen             cu_seqlens: 3 packed sequences of 512, 300, 212 rows, 16 heads, 128, causal
  decode             q (4, 1, 32, 128) over a contiguous (4, 4096, 8, 128) cache
  decode_paged       the same cache in 16-row pages (1024 pages, a shuffled block_table)
  merge_states       4 float32 states (8, 1, 32, 128), lse (8, 32, 1)
  attention_backward the attention row's shape and mask: dq, dk, dv (16-bit tensor-core kernels)

Each operation is isolated (a subprocess with a timeout): a failure gives an error row and the
rest still runs. The whole run stops starting subprocesses at ``--budget`` seconds (the second
pass gets what the first left, at least ``--budget`` / 3); the JSON is rewritten after every
subprocess, so a run stopped from outside keeps what it measured. ``--simulator`` runs tiny
shapes under Numba's CUDA simulator on NumPy arrays (a check of this script's calls on a machine
without a GPU; its times mean nothing and its cache record is empty).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARK = "FIRST_CALL_JSON "

# op -> (description, kernel family in kernel_cache_stats or None)
OPS = {
    "import": ("import numba_flash", None),
    "cuda_context": ("numba.cuda context, no kernel", None),
    "attention": ("attention fp16 (2, 1024, 16, 128) causal", "attention"),
    "attention_mask": ("attention fp16 (2, 1024, 16, 128), causal_document mask", "attention"),
    "varlen": ("varlen attention fp16, 3 seqs (512, 300, 212), 16 x 128, causal", "attention"),
    "decode": ("decode fp16 (4, 1, 32, 128) over (4, 4096, 8, 128)", "decode"),
    "decode_paged": ("decode fp16, same cache in 16-row pages", "decode"),
    "merge_states": ("merge_states fp32, 4 states (8, 1, 32, 128)", "merge"),
    "attention_backward": ("attention_backward fp16 (2, 1024, 16, 128) causal", "backward"),
}

# Shapes: the GPU's, and tiny ones for the simulator.
GPU = dict(b=2, n=1024, h=16, d=128, docs=[256, 512, 256], var=[512, 300, 212],
           dec_b=4, dec_hq=32, dec_hkv=8, dec_l=4096, page=16, m_states=4, m_b=8)
SIM = dict(b=1, n=32, h=2, d=64, docs=[8, 16, 8], var=[16, 10, 6],
           dec_b=2, dec_hq=4, dec_hkv=2, dec_l=64, page=16, m_states=2, m_b=2)


# ----------------------------------------------------------------------------- child process
def child(op: str, simulator: bool, rec: dict) -> dict:
    """Run one operation as this process's first call, filling ``rec`` (printed as JSON, also
    after an exception: what was measured before it stays)."""
    t_proc = time.perf_counter()
    import numpy as np

    s = SIM if simulator else GPU
    if simulator:
        dev = lambda x: x                                            # noqa: E731
        sync = lambda: None                                          # noqa: E731
        extra = {"backend": "cuda"}
        rec["device"] = "Numba CUDA simulator"
    else:
        import cupy as cp

        dev = cp.asarray
        sync = cp.cuda.runtime.deviceSynchronize
        extra = {}
        dev(np.zeros(1, np.float32))                 # the CUDA context, before any timing
        sync()
        rec["device"] = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    rng = np.random.default_rng(0)

    def randn(shape, dtype=np.float16):
        return dev(rng.standard_normal(shape, dtype=np.float32).astype(dtype))

    t0 = time.perf_counter()
    import numba_flash
    rec["import_s"] = time.perf_counter() - t0
    rec["numba_cuda_loaded_by_import"] = "numba.cuda" in sys.modules
    if op == "import":
        rec["process_s"] = time.perf_counter() - t_proc
        return rec

    b, n, h, d = s["b"], s["n"], s["h"], s["d"]
    setup = None
    if op == "cuda_context":
        def call():
            from numba import cuda
            cuda.current_context()
    elif op in ("attention", "attention_mask", "attention_backward"):
        q, k, v = (randn((b, n, h, d)) for _ in range(3))
        kw = dict(causal=True)
        if op == "attention_mask":
            kw = dict(mask=numba_flash.masks.causal_document(s["docs"]))
        if op == "attention_backward":
            dout = randn((b, n, h, d))
            state = {}

            def forward():
                state["out"], state["lse"] = numba_flash.attention(q, k, v, return_lse=True,
                                                                   **kw, **extra)
            setup = forward

            def call():
                return numba_flash.attention_backward(dout, q, k, v, state["out"], state["lse"],
                                                      **kw, **extra)
        else:
            def call():
                return numba_flash.attention(q, k, v, **kw, **extra)
    elif op == "varlen":
        lens = s["var"]
        total = sum(lens)
        cu = dev(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
        q, k, v = (randn((total, h, d)) for _ in range(3))

        def call():
            return numba_flash.attention(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                         max_seqlen_q=max(lens), max_seqlen_k=max(lens), **extra)
    elif op in ("decode", "decode_paged"):
        bb, hq, hkv, length = s["dec_b"], s["dec_hq"], s["dec_hkv"], s["dec_l"]
        q = randn((bb, 1, hq, d))
        table = None
        if op == "decode":
            k, v = (randn((bb, length, hkv, d)) for _ in range(2))
        else:
            per = length // s["page"]
            k, v = (randn((bb * per, s["page"], hkv, d)) for _ in range(2))
            table = dev(rng.permutation(bb * per).reshape(bb, per).astype(np.int32))

        def call():
            return numba_flash.decode(q, k, v, block_table=table, **extra)
    elif op == "merge_states":
        o = randn((s["m_states"], s["m_b"], 1, h if simulator else 32, d), np.float32)
        lse = randn((s["m_states"], s["m_b"], h if simulator else 32, 1), np.float32)

        def call():
            return numba_flash.merge_states(o, lse)
    else:
        raise ValueError(f"unknown operation {op!r}; one of {', '.join(OPS)}")
    sync()

    if setup is not None:
        t0 = time.perf_counter()
        setup()
        sync()
        rec["setup_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    result = call()
    sync()
    rec["first_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    call()
    sync()
    rec["second_s"] = time.perf_counter() - t0
    if result is not None:
        outs = result if isinstance(result, tuple) else (result,)
        rec["finite"] = all(bool(np.isfinite(_host(x).astype(np.float32)).all()) for x in outs)
    from numba_flash.cuda.launch.cache import kernel_cache_stats
    rec["cache"] = kernel_cache_stats()
    rec["process_s"] = time.perf_counter() - t_proc
    return rec


def _host(x):
    import numpy as np

    get = getattr(x, "get", None)                    # CuPy
    return get() if callable(get) else np.asarray(x)


# ----------------------------------------------------------------------------- parent process
def run_child(op: str, env: dict, timeout: float, simulator: bool) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", op]
    if simulator:
        cmd.append("--simulator")
    t0 = time.perf_counter()
    try:
        res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=max(timeout, 1.0))
    except subprocess.TimeoutExpired:
        return {"op": op, "error": f"timed out after {timeout:.0f} s",
                "wall_s": time.perf_counter() - t0}
    wall = time.perf_counter() - t0
    for line in reversed(res.stdout.splitlines()):
        if line.startswith(MARK):
            rec = json.loads(line[len(MARK):])
            rec["wall_s"] = wall
            return rec
    tail = (res.stderr or res.stdout).strip().splitlines()[-3:]
    return {"op": op, "error": f"exit {res.returncode}: " + " | ".join(tail), "wall_s": wall}


def cache_verdict(rec: dict) -> str:
    """'hit (n loaded)' / 'miss (family n compiled, ...)' / 'no record' from a subprocess's
    kernel_cache_stats, over every kernel family it used ('-': no kernel run)."""
    stats = rec.get("cache")
    if not stats:
        return "-"
    misses = {fam: e["misses"] for fam, e in stats.items() if e["misses"]}
    hits = sum(e["hits"] for e in stats.values())
    if misses:
        return "miss (" + ", ".join(f"{fam} {m} compiled" for fam, m in misses.items()) + \
            f"; {hits} loaded)"
    return f"hit ({hits} loaded)" if hits else "no record"


def seconds(rec: dict, key: str) -> str:
    value = rec.get(key)
    if value is None:
        return "error" if "error" in rec else "-"
    return f"{value:.2f}"


def git(*args) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=30).stdout.strip()
    except Exception:  # noqa: BLE001 - no git: the record says so
        return ""


def table(rows) -> str:
    lines = [f"{'operation':66} {'cold s':>8} {'warm s':>8} {'2nd call s':>10}  warm cache",
             "-" * 112]
    for row in rows:
        cold, warm = row.get("cold", {}), row.get("warm", {})
        key = "import_s" if row["op"] == "import" else "first_s"
        second = warm if "second_s" in warm else cold
        lines.append(f"{row['desc']:66} {seconds(cold, key):>8} {seconds(warm, key):>8} "
                     f"{seconds(second, 'second_s'):>10}  {cache_verdict(warm)}")
    for row in rows:
        for pas in ("cold", "warm"):
            rec = row.get(pas, {})
            if "error" in rec:
                lines.append(f"  {row['op']} ({pas}): {rec['error']}")
            elif rec.get("finite") is False:
                lines.append(f"  {row['op']} ({pas}): output not finite")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[2:]))
    ap.add_argument("--json", default=None, metavar="PATH", help="write every record here")
    ap.add_argument("--ops", default=",".join(OPS),
                    help="comma-separated operations (default: all, in the order listed)")
    ap.add_argument("--cache-dir", default=None,
                    help="use (and keep) this cache directory instead of a fresh temporary one")
    ap.add_argument("--budget", type=float, default=470.0,
                    help="seconds after which no subprocess is started (default 470)")
    ap.add_argument("--op-timeout", type=float, default=150.0,
                    help="seconds one subprocess may take (default 150)")
    ap.add_argument("--simulator", action="store_true",
                    help="tiny shapes under Numba's CUDA simulator (no GPU; times meaningless)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.child:
        if args.simulator:
            os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
        sys.path.insert(0, ROOT)
        rec = {"op": args.child}
        try:
            child(args.child, args.simulator, rec)
        except Exception as exc:  # noqa: BLE001 - reported in the row, traceback on stderr
            import traceback

            traceback.print_exc()
            rec["error"] = f"{type(exc).__name__}: {exc}"[:500]
        print(MARK + json.dumps(rec), flush=True)
        return 0

    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    unknown = [o for o in ops if o not in OPS]
    if unknown:
        ap.error(f"unknown operations {unknown}; choose from {', '.join(OPS)}")
    start = time.perf_counter()
    cache = args.cache_dir or tempfile.mkdtemp(prefix="numba_flash_first_call_")
    env = dict(os.environ, NUMBA_CACHE_DIR=os.path.join(cache, "numba"),
               CUDA_CACHE_PATH=os.path.join(cache, "cuda"),
               CUPY_CACHE_DIR=os.path.join(cache, "cupy"), PYTHONUNBUFFERED="1")
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    record = dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                  commit=git("rev-parse", "HEAD"),
                  dirty=bool(git("status", "--porcelain", "--untracked-files=no")),
                  python=sys.version.split()[0], cache_dir=cache, simulator=args.simulator,
                  method=" ".join(__doc__.split("\n\n")[2:4]).replace("\n", " "), rows=[])
    rows = [dict(op=o, desc=OPS[o][0], family=OPS[o][1]) for o in ops]
    record["rows"] = rows

    def save():
        if args.json:
            with open(args.json, "w") as f:
                json.dump(record, f, indent=1)

    print(f"numba_flash first calls, cache {cache}, commit {record['commit'][:10]}"
          f"{' (uncommitted changes)' if record['dirty'] else ''}", flush=True)
    try:
        for pas, deadline in (("cold", args.budget * 2 / 3), ("warm", args.budget)):
            for row in rows:
                left = deadline - (time.perf_counter() - start)
                if left < 5:
                    row[pas] = {"op": row["op"], "error": "not run: time budget spent"}
                    continue
                row[pas] = rec = run_child(row["op"], env, min(args.op_timeout, left),
                                           args.simulator)
                if "device" in rec:
                    record.setdefault("device", rec["device"])
                shown = seconds(rec, "import_s" if row["op"] == "import" else "first_s")
                print(f"  {pas:4} {row['op']:20} {shown:>8} s"
                      f"  (subprocess {rec['wall_s']:.1f} s)"
                      + (f"  {rec['error']}" if "error" in rec else ""), flush=True)
                save()
    finally:
        record["total_s"] = time.perf_counter() - start
        save()
        if args.cache_dir is None:
            shutil.rmtree(cache, ignore_errors=True)
    print(f"\ndevice: {record.get('device', '?')}, {record['date']}, "
          f"total {record['total_s']:.0f} s")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
