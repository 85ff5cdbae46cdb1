"""Where the host time goes, on a GPU: cProfile of repeated calls and of a warm first call.

    PYTHONPATH=scripts python scripts/experiments/host_profile.py calls [--calls 2000] [--top 18]
    PYTHONPATH=scripts python scripts/experiments/host_profile.py first [--ops attention,decode]

``calls``: every case of bench_overhead.py with CuPy inputs (torch too with ``--torch``), warmed
up, then ``calls`` back-to-back calls under cProfile; prints us per call and the functions by
own time. ``first``: each operation of bench_first_call.py once in a fresh process to fill a
fresh cache, then again in a new process under cProfile (the warm first call; the profile
covers the whole child, CUDA initialisation included), sorted by cumulative time.
"""
import argparse
import cProfile
import io
import os
import pstats
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.dirname(HERE)


def profile_calls(calls: int, top: int, libs):
    import cupy as cp
    import torch

    import bench_overhead

    sync = torch.cuda.synchronize
    for name, fns in bench_overhead.cases(torch, cp):
        for lib in libs:
            fn = fns[lib]
            for _ in range(20):
                fn()
            sync()
            prof = cProfile.Profile()
            t0 = time.perf_counter()
            prof.enable()
            for _ in range(calls):
                fn()
            prof.disable()
            per = (time.perf_counter() - t0) / calls * 1e6
            sync()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
            print(f"=== {name} [{lib}] {per:.1f} us/call under the profiler")
            print("\n".join(out.getvalue().splitlines()[6:]))


def profile_first(ops, top: int):
    cache = tempfile.mkdtemp(prefix="nf_first_profile_")
    env = dict(os.environ, NUMBA_CACHE_DIR=cache, CUDA_CACHE_PATH=os.path.join(cache, "cuda"),
               CUPY_CACHE_DIR=os.path.join(cache, "cupy"),
               PYTHONPATH=SCRIPTS + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = ("import cProfile, pstats, sys, bench_first_call as b; rec = {}; "
            "p = cProfile.Profile(); p.enable(); b.child(sys.argv[1], False, rec); p.disable(); "
            "print('RESULT', rec.get('first_s'), rec.get('cache')); "
            "pstats.Stats(p).sort_stats(sys.argv[2]).print_stats(int(sys.argv[3]))")
    for op in ops:
        for label in ("cold", "warm"):
            t0 = time.perf_counter()
            res = subprocess.run([sys.executable, "-c", code, op, "cumulative", str(top)],
                                 env=env, capture_output=True, text=True, timeout=200)
            print(f"=== {op} {label}: process {time.perf_counter() - t0:.2f} s, rc {res.returncode}")
            lines = res.stdout.splitlines()
            result = [x for x in lines if x.startswith("RESULT")]
            print(result[0] if result else res.stderr[-2000:])
            if label == "warm":
                print("\n".join(x[:160] for x in lines if not x.startswith("RESULT")))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("calls", "first"))
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--top", type=int, default=18)
    ap.add_argument("--torch", action="store_true", help="profile torch inputs too")
    ap.add_argument("--ops", default="attention,decode,merge_states")
    args = ap.parse_args()
    if args.mode == "calls":
        profile_calls(args.calls, args.top, ("cupy", "torch") if args.torch else ("cupy",))
    else:
        profile_first(args.ops.split(","), args.top)


if __name__ == "__main__":
    main()
