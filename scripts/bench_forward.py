"""Forward-pass benchmark on one GPU: numba-flash against PyTorch SDPA (flash and cuDNN backends)
and a naive CuPy implementation, all in one process.

Shapes (B, H, N, D): issue 20's table, (4, 16, 4096, 128), (4, 16, 4096, 64), (4, 16, 4096, 96),
(2, 16, 4096, 256), (16, 16, 1024, 128), then (1, 16, 16384, 128); float16 and bfloat16; full
and causal. Prints a table with TFLOP/s and ratios, writes JSON and a PNG plot.

    python scripts/bench_forward.py --out bench.json --plot bench.png [--quick]

TFLOP/s counts 4 * B * H * N * N * D operations for full attention and half that for causal
(the convention of the flash-attn benchmarks). Times are medians of CUDA-event timings after a
warm-up; inputs are random normal.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics

import cupy as cp
import numpy as np

SHAPES = [(4, 16, 4096, 128), (4, 16, 4096, 64), (4, 16, 4096, 96), (2, 16, 4096, 256),
          (16, 16, 1024, 128), (1, 16, 16384, 128)]
DTYPES = ["float16", "bfloat16"]


def _attention():
    try:
        from numba_flash import attention

        return lambda q, k, v, causal: attention(q, k, v, causal=causal)
    except Exception:  # the public API may be absent in a partial checkout
        from numba_flash.cuda.launch.attention import attention_cuda

        return lambda q, k, v, causal: attention_cuda(q, k, v, softmax_scale=q.shape[-1] ** -0.5,
                                                      causal=causal)


def time_ms(fn, reps=20, warmup=3):
    """Median milliseconds of ``fn()`` on the current CuPy stream (CUDA events)."""
    for _ in range(warmup):
        fn()
    cp.cuda.get_current_stream().synchronize()
    times = []
    for _ in range(reps):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop))
    return statistics.median(times)


def naive_attention(q, k, v, causal):
    """A no-argument function computing dense attention on CuPy (B, N, H, D) arrays in their own
    dtype: matmul, softmax, matmul, the full N x N scores in memory (the naive peer)."""
    n, d = q.shape[1], q.shape[3]
    qh, kh, vh = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    scale = d ** -0.5
    causal_mask = cp.triu(cp.ones((n, n), dtype=bool), 1) if causal else None

    def naive():
        s = cp.matmul(qh, kh.transpose(0, 1, 3, 2)) * scale
        if causal_mask is not None:
            s = cp.where(causal_mask, -cp.inf, s)
        s = s - s.max(axis=-1, keepdims=True)
        p = cp.exp(s)
        p /= p.sum(axis=-1, keepdims=True)
        return cp.matmul(p, vh)

    return naive


def flops(b, h, n, d, causal):
    return 4.0 * b * h * n * n * d / (2 if causal else 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_forward.json")
    ap.add_argument("--plot", default="bench_forward.png")
    ap.add_argument("--quick", action="store_true", help="first shape only")
    ap.add_argument("--no-naive", action="store_true")
    ap.add_argument("--shape", action="append", default=None, metavar="B,H,N,D",
                    help="benchmark this shape instead of the default list (repeatable)")
    ap.add_argument("--dtype", action="append", default=None, choices=DTYPES)
    args = ap.parse_args()

    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
        import torch.nn.functional as F
    except Exception:
        torch = None
    ours = _attention()
    dev = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    rows = []
    shapes = SHAPES[:1] if args.quick else SHAPES
    if args.shape:
        shapes = [tuple(int(x) for x in s.split(",")) for s in args.shape]
    rng = cp.random.default_rng(0)
    for (b, h, n, d) in shapes:
        for dtype in args.dtype or DTYPES:
            if torch is not None:
                tdt = getattr(torch, dtype)
                tq, tk, tv = (torch.randn(b, n, h, d, device="cuda", dtype=tdt) for _ in range(3))
            if dtype == "float16":
                q, k, v = (rng.standard_normal((b, n, h, d), dtype=cp.float32).astype(cp.float16)
                           for _ in range(3))
            elif torch is not None:
                q, k, v = tq, tk, tv       # CuPy has no bfloat16: run ours on torch tensors
            else:
                continue
            for causal in (False, True):
                row = dict(B=b, H=h, N=n, D=d, dtype=dtype, causal=causal)
                fl = flops(b, h, n, d, causal)
                ms = time_ms(lambda: ours(q, k, v, causal))
                row["ours_ms"], row["ours_tflops"] = ms, fl / ms / 1e9
                if torch is not None:
                    qt, kt, vt = (x.transpose(1, 2) for x in (tq, tk, tv))   # (B, H, N, D) views
                    stream = torch.cuda.current_stream()
                    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION),
                                          ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                        try:
                            with sdpa_kernel(backend):
                                fn = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                                with cp.cuda.ExternalStream(stream.cuda_stream):
                                    t = time_ms(fn)
                            row[f"sdpa_{name}_ms"], row[f"sdpa_{name}_tflops"] = t, fl / t / 1e9
                            row[f"ratio_vs_{name}"] = t / ms
                        except Exception as exc:  # backend unavailable for this shape
                            row[f"sdpa_{name}_error"] = repr(exc)[:120]
                if dtype == "float16" and not args.no_naive:
                    naive = naive_attention(q, k, v, causal)
                    try:
                        t = time_ms(naive, reps=5, warmup=1)
                        row["naive_cupy_ms"], row["naive_cupy_tflops"] = t, fl / t / 1e9
                        row["speedup_vs_naive"] = t / ms
                    except cp.cuda.memory.OutOfMemoryError:
                        row["naive_cupy_error"] = "out of memory"
                    cp.get_default_memory_pool().free_all_blocks()
                rows.append(row)
                print(_fmt(row), flush=True)
    result = dict(device=dev, date=datetime.date.today().isoformat(), rows=rows)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print()
    print(f"device: {dev}, {result['date']}")
    print(_header())
    for row in rows:
        print(_fmt(row))
    _plot(rows, args.plot, dev)


def _header():
    return (f"{'shape (B,H,N,D)':<22}{'dtype':<10}{'mask':<8}{'ours ms':>9}{'TFLOP/s':>9}"
            f"{'flash':>8}{'x flash':>9}{'cudnn':>8}{'x cudnn':>9}{'naive':>8}{'x naive':>9}")


def _fmt(r):
    def g(key, fmt):
        return format(r[key], fmt) if key in r else "-"
    return (f"{str((r['B'], r['H'], r['N'], r['D'])):<22}{r['dtype']:<10}"
            f"{'causal' if r['causal'] else 'full':<8}{r['ours_ms']:>9.3f}{r['ours_tflops']:>9.1f}"
            f"{g('sdpa_flash_tflops', '.1f'):>8}{g('ratio_vs_flash', '.2f'):>9}"
            f"{g('sdpa_cudnn_tflops', '.1f'):>8}{g('ratio_vs_cudnn', '.2f'):>9}"
            f"{g('naive_cupy_tflops', '.1f'):>8}{g('speedup_vs_naive', '.1f'):>9}")


def _plot(rows, path, dev):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return
    labels = [f"{r['dtype'][:4]} {r['B']}x{r['H']}x{r['N']}x{r['D']}\n{'causal' if r['causal'] else 'full'}"
              for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.9), 4.5))
    series = [("ours_tflops", "numba-flash"), ("sdpa_flash_tflops", "SDPA flash (FA2)"),
              ("sdpa_cudnn_tflops", "SDPA cuDNN"), ("naive_cupy_tflops", "naive CuPy")]
    width = 0.2
    for i, (key, name) in enumerate(series):
        ax.bar(x + (i - 1.5) * width, [r.get(key, 0) for r in rows], width, label=name)
    ax.set_xticks(x, labels, fontsize=6)
    ax.set_ylabel("TFLOP/s")
    ax.set_title(f"forward attention, {dev}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
