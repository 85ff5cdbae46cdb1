"""FlashMask's mask set on the GPU: numba-flash against FlexAttention, SDPA and a naive CuPy
attention, in one process; then time against block sparsity (FlashMask's Figure 4a).

    python scripts/bench_masks.py [--n 8192 --batch 4 --heads 16 --dim 128]
        [--dtypes float16,bfloat16] [--sweep-n 32768] [--json out.json] [--png sweep.png]

FLOPs count visible pairs only (the paper's measure): 4 * head_dim * visible pairs * batch * heads.
FlexAttention gets the same mask as a ``mask_mod`` reading the mask's column intervals (one
compiled kernel for every mask), with ``create_block_mask`` built outside the timing; SDPA gets
the dense boolean mask; the naive CuPy attention materialises the scores (in the inputs' dtype,
or float32 where CuPy cannot compute in it: the row's ``naive_cupy_dtype``). Our kernel's
interval upload, per-key-tile min/max and tile table are cached on the mask object after the
first call. Timings: every call alone between CUDA events (host time before the launch
included), median of ``--reps`` after warm-up.
Results are written as JSON after every mask, so a run cut short keeps what it measured.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time

import numpy as np

from numba_flash import masks as M
from numba_flash_reference.tiles import SKIP, classify_tiles


def mask_set(n: int, seed: int = 0) -> dict:
    """FlashMask's twelve masks at length n (parameters in the spirit of the paper's Appendix)."""
    rng = np.random.default_rng(seed)

    def doc_lengths(count):
        cuts = np.sort(rng.choice(np.arange(1, n), size=count - 1, replace=False))
        return np.diff(np.concatenate([[0], cuts, [n]])).tolist()

    docs = doc_lengths(8)
    questions = [d // 4 for d in docs]
    answers = []
    for d, qn in zip(docs, questions):
        rest = d - qn
        a = [rest // 3, rest // 3]
        answers.append(a + [rest - sum(a)])
    blocks = doc_lengths(6)
    test = blocks.pop()
    evict = np.minimum(n, np.arange(n) + rng.integers(n // 8, n, size=n))
    dropped_keys = rng.choice(n, size=n // 10, replace=False)
    return {
        "full": None,
        "causal": M.causal(),
        "sliding_window": M.sliding_window(1024, 0),
        "causal_document": M.causal_document(docs),
        "document": M.document(docs),
        "shared_question": M.shared_question(docs, questions, answers),
        "global_sliding_window": M.global_sliding_window(64, 512),
        "causal_blockwise": M.causal_blockwise(blocks, test),
        "prefix_lm_causal": M.prefix_lm_causal(n // 4),
        "prefix_lm_document": M.prefix_lm_document(docs, [d // 3 for d in docs]),
        "qk_sparse": M.qk_sparse(dropped_keys, (n // 2, n // 2 + n // 16)),
        "random_eviction": M.random_eviction(evict),
    }


def visible_pairs(mask, n: int) -> int:
    if mask is None:
        return n * n
    iv = mask.column_intervals(n, n)
    masked = (iv.lte.astype(np.int64) - iv.lts) + (iv.ute.astype(np.int64) - iv.uts)
    return int(n * n - masked.sum())


def block_sparsity(mask, n: int, block: int = 64) -> float:
    if mask is None:
        return 0.0
    classes = classify_tiles(mask.column_intervals(n, n), block, block)
    return float((classes == SKIP).mean())


LAST_TIMES: dict = {}   # the last timed() call's every rep: "ms" (events), "host_us" (wall clock)


def timed(fn, reps: int, warmup: int = 3) -> float:
    """Median milliseconds of fn() over reps (CUDA events on torch's current stream). Every
    rep's time and the wall-clock time fn() took to return are kept in LAST_TIMES.

    As ``timeit`` does, Python's cyclic garbage collector is off while the reps run (after
    one collection), so that collections set off by earlier work (a compile, ours or
    FlexAttention's, leaves a large object graph) do not land in the reps, whichever library
    the call belongs to (docs/benchmarks.md, "Masks")."""
    import gc

    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    gc.collect()
    gc.disable()
    try:
        return _timed_reps(fn, reps)
    finally:
        gc.enable()


def _timed_reps(fn, reps: int) -> float:
    import torch

    times, host = [], []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e6)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    LAST_TIMES.update(ms=[round(t, 4) for t in times], host_us=[round(h, 1) for h in host])
    return float(np.median(times))


class Flex:
    """flex_attention compiled once; the mask is a mask_mod over interval buffers (copied in)."""

    def __init__(self, n: int):
        import torch
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        self.torch = torch
        self.create_block_mask = create_block_mask
        self.fn = torch.compile(flex_attention)
        self.iv = torch.zeros((4, n), dtype=torch.int32, device="cuda")
        self.n = n
        iv = self.iv

        def interval_mod(b, h, q, kv):
            lt = (iv[0][kv] <= q) & (q < iv[1][kv])
            ut = (iv[2][kv] <= q) & (q < iv[3][kv])
            return ~(lt | ut)

        self.mod = interval_mod

    def block_mask(self, mask):
        if mask is None:
            return None
        self.iv.copy_(self.torch.from_numpy(mask.column_intervals(self.n, self.n).stacked()))
        # Beyond N 32K the eager build materialises the N x N mask (128 GiB at 131072):
        # compiled, it works block by block.
        return self.create_block_mask(self.mod, None, None, self.n, self.n, device="cuda",
                                      _compile=self.n > 32768)

    def __call__(self, q, k, v, block_mask):
        return self.fn(q, k, v, block_mask=block_mask)


def naive_cupy(q, k, v, dense, scale):
    """Materialised attention in CuPy, one batch element at a time (q, k, v (B, H, S, D))."""
    import cupy as cp

    out = cp.empty_like(q)
    for b in range(q.shape[0]):
        s = cp.matmul(q[b], k[b].transpose(0, 2, 1)).astype(cp.float32) * scale
        if dense is not None:
            s = cp.where(dense[None], s, -cp.inf)
        s -= s.max(axis=-1, keepdims=True)
        p = cp.exp(s)
        p /= p.sum(axis=-1, keepdims=True)
        out[b] = cp.matmul(p.astype(q.dtype), v[b])
    return out


def naive_inputs(q, k, v):
    """CuPy views of torch's q, k, v for the naive peer, and the dtype it computes in: the
    inputs' own dtype when CuPy can multiply it (float16; bfloat16 through DLPack where this
    CuPy supports it), else float32 copies (named in the row as ``naive_cupy_dtype``)."""
    import cupy as cp

    try:
        arrays = tuple(cp.from_dlpack(x.contiguous()) for x in (q, k, v))
        naive_cupy(*(a[:1, :1, :16] for a in arrays), None, 1.0)   # every step, tiny
        cp.cuda.get_current_stream().synchronize()
        return (*arrays, str(arrays[0].dtype))
    except Exception:  # noqa: BLE001 - no such dtype in this CuPy: compute in float32
        return (*(cp.from_dlpack(x.float().contiguous()) for x in (q, k, v)), "float32")


def bench_set(args, results, save):
    import cupy as cp
    import torch
    import torch.nn.functional as F

    import numba_flash

    n, b, h, d = args.n, args.batch, args.heads, args.dim
    scale = d ** -0.5
    flex = None if args.no_flex else Flex(n)
    for dtype_name in args.dtypes.split(","):
        tdt = getattr(torch, dtype_name)
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn((b, h, n, d), device="cuda", dtype=tdt, generator=g)
                   for _ in range(3))
        qs, ks, vs = (x.transpose(1, 2) for x in (q, k, v))   # (B, S, H, D) views, no copy
        if not args.no_overhead:
            bench_overhead(args, qs, ks, vs, dtype_name, results, save)
        for name, mask in mask_set(n).items():
            row = {"dtype": dtype_name, "mask": name, "n": n, "batch": b, "heads": h, "dim": d}
            pairs = visible_pairs(mask, n)
            flops = 4.0 * d * pairs * b * h
            row["visible_fraction"] = pairs / (n * n)
            row["block_sparsity"] = block_sparsity(mask, n)
            t0 = time.time()
            ours = lambda: numba_flash.attention(qs, ks, vs, mask=mask)  # noqa: E731
            row["ours_ms"] = timed(ours, args.reps)
            row["ours_first_call_s"] = time.time() - t0
            row["ours_reps_ms"], row["ours_host_us"] = LAST_TIMES["ms"], LAST_TIMES["host_us"]
            dense_t = None
            if flex is not None:
                bm = flex.block_mask(mask)
                row["flex_ms"] = timed(lambda: flex(q, k, v, bm), args.reps)
                row["flex_reps_ms"], row["flex_host_us"] = LAST_TIMES["ms"], LAST_TIMES["host_us"]
                err = (flex(q, k, v, bm).transpose(1, 2).float() - ours().float()).abs()
                row["max_abs_diff_vs_flex"] = float(err.nan_to_num(0).max())
            if not args.no_sdpa:
                dense_t = (torch.ones((n, n), dtype=torch.bool, device="cuda") if mask is None
                           else torch.from_numpy(mask.to_dense(n, n)).cuda())
                row["sdpa_ms"] = timed(lambda: F.scaled_dot_product_attention(
                    q, k, v, attn_mask=dense_t[None, None]), max(2, args.reps // 2), 1)
            if not args.no_naive:
                cq, ck, cv, row["naive_cupy_dtype"] = naive_inputs(q, k, v)
                dense_c = None if dense_t is None else cp.asarray(dense_t)
                row["naive_cupy_ms"] = timed(lambda: naive_cupy(cq, ck, cv, dense_c, scale), 2, 1)
                del cq, ck, cv, dense_c
            del dense_t
            for key in ("ours", "flex", "sdpa", "naive_cupy"):
                if f"{key}_ms" in row:
                    row[f"{key}_tflops"] = flops / (row[f"{key}_ms"] * 1e-3) / 1e12
            for key in ("flex", "sdpa", "naive_cupy"):
                if f"{key}_ms" in row:
                    row[f"speedup_vs_{key}"] = row[f"{key}_ms"] / row["ours_ms"]
            results["set"].append(row)
            print(json.dumps(row), flush=True)
            save()
            torch.cuda.empty_cache()


def bench_overhead(args, qs, ks, vs, dtype_name, results, save):
    """What the mask machinery itself costs (ours only): a mask object whose every tile is full
    (prefix-LM with the whole sequence as prefix) against no mask, and a causal mask object
    against the causal flag (same visible pairs, same tiles). The causal object is
    ``causal_document([n])``: ``masks.causal()`` itself is folded into the flag (validation's
    ``lower_window_mask``), so it would time the flag kernel twice."""
    import numba_flash

    n, b, h, d = args.n, args.batch, args.heads, args.dim
    cases = [("full_no_mask", None, {}), ("full_as_mask_object", M.prefix_lm_causal(n), {}),
             ("causal_flag", None, {"causal": True}), ("causal_mask_object", M.causal_document([n]), {})]
    for name, mask, kw in cases:
        pairs = n * (n + 1) // 2 if (kw or name.startswith("causal")) else n * n
        ms = timed(lambda: numba_flash.attention(qs, ks, vs, mask=mask, **kw), args.reps)
        row = {"dtype": dtype_name, "overhead_case": name, "n": n, "ours_ms": ms,
               "ours_tflops": 4.0 * d * pairs * b * h / (ms * 1e-3) / 1e12}
        results.setdefault("overhead", []).append(row)
        print(json.dumps(row), flush=True)
        save()


def sweep_masks(n: int, docs: int, rng):
    cuts = np.sort(rng.choice(np.arange(1, n), size=docs - 1, replace=False)).astype(np.int64)
    lengths = np.diff(np.concatenate([[0], cuts, [n]])).tolist()
    questions = [x // 4 for x in lengths]
    answers = [[(x - qq) // 2, x - qq - (x - qq) // 2] for x, qq in zip(lengths, questions)]
    return {"causal_document": M.causal_document(lengths), "document": M.document(lengths),
            "shared_question": M.shared_question(lengths, questions, answers)}


def bench_sweep(args, results, save):
    import torch

    import numba_flash

    n, h, d = args.sweep_n, args.heads, args.dim
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn((1, n, h, d), device="cuda", dtype=torch.float16, generator=g)
               for _ in range(3))
    rng = np.random.default_rng(2)
    for docs in args.sweep_docs:
        for name, mask in sweep_masks(n, docs, rng).items():
            ms = timed(lambda: numba_flash.attention(q, k, v, mask=mask), args.reps)
            row = {"mask": name, "docs": docs, "n": n, "heads": h, "dim": d,
                   "block_sparsity": block_sparsity(mask, n), "ms": ms}
            results["sweep"].append(row)
            print(json.dumps(row), flush=True)
            save()


def fit_and_plot(results, png: str):
    """Least-squares line of time against (1 - block sparsity) per mask; R^2; one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fits = {}
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in sorted({r["mask"] for r in results["sweep"]}):
        rows = [r for r in results["sweep"] if r["mask"] == name]
        x = np.array([1 - r["block_sparsity"] for r in rows])
        y = np.array([r["ms"] for r in rows])
        slope, icept = np.polyfit(x, y, 1)
        pred = slope * x + icept
        r2 = 1 - ((y - pred) ** 2).sum() / max(((y - y.mean()) ** 2).sum(), 1e-30)
        fits[name] = {"slope_ms": float(slope), "intercept_ms": float(icept), "r2": float(r2)}
        line = ax.plot(x, y, "o", label=f"{name} (R$^2$ = {r2:.3f})")[0]
        xs = np.linspace(0, 1, 50)
        ax.plot(xs, slope * xs + icept, "-", color=line.get_color(), lw=1)
    ax.set_xlabel("1 - block sparsity (fraction of 64x64 tiles computed)")
    ax.set_ylabel("time (ms)")
    ax.set_title(f"numba-flash forward, N = {results['sweep'][0]['n']}, fp16")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    results["sweep_fit"] = fits
    return fits


def add_problem_args(p: argparse.ArgumentParser) -> None:
    """The problem-size options this script shares with bench_score_mod.py."""
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--dtypes", default="float16,bfloat16")
    p.add_argument("--reps", type=int, default=5)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_problem_args(p)
    p.add_argument("--sweep-n", type=int, default=32768)
    p.add_argument("--sweep-docs", type=lambda s: [int(x) for x in s.split(",")],
                   default=[1, 2, 3, 4, 6, 8, 12, 16, 24])
    p.add_argument("--no-flex", action="store_true")
    p.add_argument("--no-sdpa", action="store_true")
    p.add_argument("--no-naive", action="store_true")
    p.add_argument("--no-set", action="store_true")
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--no-overhead", action="store_true",
                   help="skip the machinery-cost rows (mask object vs flags, ours only)")
    p.add_argument("--json", default="bench_masks.json")
    p.add_argument("--png", default="bench_masks_sweep.png")
    args = p.parse_args(argv)

    import torch

    results = {"device": torch.cuda.get_device_name(),
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "torch": torch.__version__, "args": vars(args), "set": [], "sweep": []}

    def save():
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)

    if not args.no_set:
        bench_set(args, results, save)
    if not args.no_sweep:
        bench_sweep(args, results, save)
        print(json.dumps(fit_and_plot(results, args.png)), flush=True)
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
