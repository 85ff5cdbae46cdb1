"""A/B of source trees in one process, calls alternating: the installed numba_flash (the
working tree, "new") against another commit's package imported under the name ``nf_base``,
and any further variants copied to ab/ under other names (``--trees``):

    rm -rf ab && mkdir ab && git archive BASE numba_flash | tar -x -C ab
    mv ab/numba_flash ab/nf_base
    python scripts/experiments/ab_inprocess.py --cases f128f,f128c@1024,b64c --rounds 8

api.py and backward.py load the CUDA runtime of their own package (``__package__``; before
2026-11-28 11:35 UTC by the absolute name ``numba_flash.cuda...``, so a copy of an older commit
ran the working tree's kernels: ``_own_runtime`` points such a copy at its own runtime and
checks it); kernel images are keyed by module name. Alternating processes (forward_ab.py,
backward_ab.py) leave the spread
between processes on the lent GPUs (5-25 %) in every comparison; here both trees share the
process, its clocks and its memory, and each round times base and new back to back (the order
rotated every round). Case ``<f|b><head_dim><f|c>[@N]``: forward, or backward alone, fp16
(4, N, 16, D) (N 4096 unless given; B 2 at head_dim 256), full or causal;
``x<head_dim><f|c|w|s>[@N]``: the float64 forward on the DMMA kernel
(``precision="tensor_cores"``, (4, N, 16, D), N 2048 unless given), full, causal, a causal
512-key window (``w``) or that window with 4 sinks (``s``). Prints per case and
tree the median over rounds of tree / base (the medians of ``--reps`` calls between CUDA
events, bench_masks.timed) and its range.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.getcwd(), "ab"))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_masks import timed  # noqa: E402


def _case(spec, pkg, torch):
    """The call of case ``spec`` on package ``pkg``."""
    spec, _, n = spec.partition("@")
    kind, d, causal = spec[0], int(spec[1:-1]), spec[-1] == "c"
    if kind == "x" and spec[-1] in "fcws":
        return _exact_case(spec[-1], d, int(n or 2048), pkg, torch)
    if kind not in "fb" or spec[-1] not in "fc":
        raise ValueError(f"case must be <f|b><head_dim><f|c>[@N] or x<head_dim><f|c|w|s>[@N], "
                         f"got {spec!r}")
    b = 2 if d == 256 else 4
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, int(n or 4096), 16, d, device="cuda", dtype=torch.float16,
                           generator=g)
               for _ in range(3))
    if kind == "f":
        return lambda: pkg.attention(q, k, v, causal=causal)
    dout = torch.randn_like(q)
    out, lse = pkg.attention(q, k, v, causal=causal, return_lse=True)
    return lambda: pkg.attention_backward(dout, q, k, v, out, lse, causal=causal)


def _exact_case(mask, d, n, pkg, torch):
    """The float64 DMMA forward of case letter ``mask`` (f, c, w, s) at (4, n, 16, d)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(4, n, 16, d, device="cuda", dtype=torch.float64, generator=g)
               for _ in range(3))
    kw = dict(causal=mask != "f", precision="tensor_cores")
    if mask in "ws":
        kw["window_size"] = (512, 0)
    if mask == "s":
        kw["sinks"] = 4
    return lambda: pkg.attention(q, k, v, **kw)


def _own_runtime(name, pkg):
    """Point the copy ``name``'s attention and backward loaders at its own launch modules, and
    check that they resolve there."""
    attention = importlib.import_module(f"{name}.cuda.launch.attention")
    backward = importlib.import_module(f"{name}.cuda.launch.backward")
    pkg.api._ATTENTION_RUNTIME = attention.__name__
    pkg.backward._load_backward_cuda = lambda fn=backward.backward_cuda: fn
    entry = pkg.api._load_attention_cuda()
    assert sys.modules[entry.__module__].__file__ == attention.__file__, entry.__module__
    assert os.sep + name + os.sep in attention.__file__, attention.__file__


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="f128f,f128c")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--trees", default="nf_base", help="packages in ab/; the first is the base")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch

    import numba_flash

    pkgs = {name: importlib.import_module(name) for name in args.trees.split(",")}
    for name, pkg in pkgs.items():
        _own_runtime(name, pkg)
    assert "new" not in pkgs, "the working tree is 'new'"
    pkgs["new"] = numba_flash
    base = args.trees.split(",")[0]
    results = {}
    for spec in args.cases.split(","):
        calls = {tag: _case(spec, pkg, torch) for tag, pkg in pkgs.items()}
        for fn in calls.values():
            for _ in range(3):
                fn()
        tags = list(calls)
        times = {tag: [] for tag in tags}
        for r in range(args.rounds):
            for j in range(len(tags)):
                tag = tags[(j + r) % len(tags)]
                times[tag].append(timed(calls[tag], args.reps, warmup=0))
        results[spec] = dict(times=times)
        for tag in tags:
            ratios = [x / y for x, y in zip(times[tag], times[base])]
            results[spec][f"{tag}/{base}"] = ratios
            print(f"{spec:10s} {tag:8s} {statistics.median(times[tag]):7.3f} ms  /{base} "
                  f"median {statistics.median(ratios):.3f} (range {min(ratios):.3f}-"
                  f"{max(ratios):.3f})", flush=True)
        del calls
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rounds=args.rounds,
                           reps=args.reps, cases=results), f, indent=1)


if __name__ == "__main__":
    main()
