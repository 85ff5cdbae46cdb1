"""Decode benchmark on one GPU: numba_flash.decode against PyTorch SDPA (flash and cuDNN backends),
as bytes of K and V read per second, over the device's copy bandwidth measured in the same run.

Shapes (B, heads_q, heads_kv, L, D): (8, 32, 8, 32768, 128), (1, 32, 8, 131072, 128),
(64, 32, 8, 4096, 128), (1, 32, 32, 8192, 128), (16, 64, 8, 16384, 128); one query row; float16
and bfloat16; contiguous caches and paged ones (page sizes 16 and 64, shuffled block tables).

    python scripts/bench_decode.py --out bench_decode.json --plot bench_decode.png [--quick]
        [--sweep]   # also time num_splits = 1, 2, 4, ..., 128 on the contiguous float16 cases
        [--tiles "32,2,1;16,3,1;48,2,1,0"]   # tensor-core tiles (bn, stages, warps[, hint])
                    # x num_splits around each one's auto choice, float16, run before the table;
                    # hint 0/1 forces the evict-first L2 hint off/on (default: the runtime's)
        [--extra-shape 1,64,8,32768,64]   # appended to SHAPES (index 5, 6, ...)
        [--tile-shapes 3] [--tile-splits 8,12,16] [--tile-wps 2,3,4] [--tile-pages none,16]
                    # restrict the tile sweep; [--no-table] runs the tile sweep only
        [--shapes 3,0]      # table rows for these SHAPES indices only
        [--no-bf16-paged]   # skip the bfloat16 paged rows (shorter runs)
        [--sanitize-case]   # one small paged decode, then exit (for compute-sanitizer)

The tile sweep passes ``tile=`` / ``stream_hint=`` (test keywords of
numba_flash.cuda.launch.decode.decode_cuda) by wrapping that function for the sweep's duration;
numba_flash.decode calls it through the module, so the wrapper takes effect. The library reads
no environment switches.

Timing: each measurement enqueues a ~0.08 s spin kernel first (torch.cuda._sleep), then REPS calls
back to back between two CUDA events, so the GPU never waits for Python and the time is the
GPU's (median of 5 such rounds, divided by REPS). The per-call host overhead of each library is
reported separately ("call us": one call between events, GPU idle before it).
Copy bandwidth: a 2 GiB device-to-device copy, counting bytes read plus bytes written.
GB/s of K+V: 2 * B * L * heads_kv * D * itemsize / time (each K/V byte is read once).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import statistics

import numpy as np

torch = F = numba_flash = None      # imported by main (so that --help needs neither)

SHAPES = [(8, 32, 8, 32768, 128), (1, 32, 8, 131072, 128), (64, 32, 8, 4096, 128),
          (1, 32, 32, 8192, 128), (16, 64, 8, 16384, 128)]
DTYPES = ["float16", "bfloat16"]
LAYOUTS = [None, 16, 64]           # contiguous, then page sizes
REPS = 30
SPIN_CYCLES = 150_000_000   # ~0.08 s: longer than 30 calls take to enqueue (<= 1.6 ms each)


def gpu_time_ms(fn, reps=REPS, rounds=5, spin=SPIN_CYCLES):
    """Median GPU milliseconds per call of ``fn`` with the launch queue kept full."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(spin)
        start.record()
        for _ in range(reps):
            fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / reps)
    return statistics.median(times)


def call_time_us(fn, rounds=7):
    """Median microseconds of one call, GPU idle before it (host overhead included)."""
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3)
    return statistics.median(times)


def copy_bandwidth_gbs():
    src = torch.empty(1 << 30, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = gpu_time_ms(lambda: dst.copy_(src), reps=10)
    del src, dst
    return 2 * (2 << 30) / ms / 1e6


def make_inputs(b, hq, hkv, L, d, dtype, page, ordered=False):
    """q, k, v, cache_seqlens (full) and block_table (None, or pages shuffled unless
    ``ordered``: page i of the pool holds page i of the cache, for diagnosis)."""
    tdt = getattr(torch, dtype)
    q = torch.randn(b, 1, hq, d, device="cuda", dtype=tdt)
    k = torch.randn(b, L, hkv, d, device="cuda", dtype=tdt)
    v = torch.randn(b, L, hkv, d, device="cuda", dtype=tdt)
    lens = torch.full((b,), L, dtype=torch.int32, device="cuda")
    if page is None:
        return q, k, v, lens, None
    per = L // page
    perm = torch.arange(b * per, device="cuda") if ordered else \
        torch.randperm(b * per, device="cuda")
    table = perm.reshape(b, per).to(torch.int32)
    kp = torch.empty(b * per, page, hkv, d, device="cuda", dtype=tdt)
    vp = torch.empty_like(kp)
    kp[perm] = k.reshape(b * per, page, hkv, d)     # the same cache, scattered into pages
    vp[perm] = v.reshape(b * per, page, hkv, d)
    return q, kp, vp, lens, table


def sdpa_times(q, k, v, row):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))     # (B, H, S, D) views
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION),
                          ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                fn = lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
                fn()
                row[f"sdpa_{name}_ms"] = gpu_time_ms(fn)
                row[f"sdpa_{name}_call_us"] = call_time_us(fn)
        except Exception as exc:  # noqa: BLE001 - backend unavailable for this shape
            row[f"sdpa_{name}_error"] = repr(exc)[:160]


def main():
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--out", default="bench_decode.json")
    ap.add_argument("--plot", default="bench_decode.png")
    ap.add_argument("--quick", action="store_true", help="first shape only")
    ap.add_argument("--sweep", action="store_true", help="num_splits sweep (contiguous fp16)")
    ap.add_argument("--tiles", default="",
                    help="tensor-core tiles 'bn,stages,warps[,hint];...' to sweep (with "
                         "num_splits) on float16 cases; hint 0/1 forces the L2 evict-first hint")
    ap.add_argument("--tile-shapes", default="", help="indices into SHAPES for the tile sweep")
    ap.add_argument("--extra-shape", action="append", default=[],
                    help="B,Hq,Hkv,L,D appended to SHAPES (index 5, 6, ...), e.g. for "
                         "--tile-shapes 5")
    ap.add_argument("--tile-splits", default="", help="split counts for the tile sweep")
    ap.add_argument("--tile-wps", default="",
                    help="warps per multiprocessor for the tile sweep's split counts, e.g. 2,3,4,6")
    ap.add_argument("--tile-pages", default="none",
                    help="cache layouts of the tile sweep: none (contiguous) and/or page sizes")
    ap.add_argument("--no-table", action="store_true", help="tile sweep only")
    ap.add_argument("--shapes", default="", help="indices into SHAPES for the table, e.g. 3,0")
    ap.add_argument("--no-bf16-paged", action="store_true", help="skip bfloat16 paged rows")
    ap.add_argument("--sanitize-case", action="store_true",
                    help="run one small paged decode (splits, tree mask) and exit: for "
                         "compute-sanitizer")
    args = ap.parse_args()
    SHAPES.extend(tuple(int(x) for x in spec.split(",")) for spec in args.extra_shape)
    _imports()
    if args.sanitize_case:
        from numba_flash import masks

        q, k, v, lens, table = make_inputs(3, 8, 2, 1024, 128, "bfloat16", 16)
        lens[0] = 1000
        lens[1] = 0
        lens[2] = 77
        numba_flash.decode(q, k, v, cache_seqlens=lens, block_table=table, num_splits=5)
        q4 = torch.randn(3, 4, 8, 128, device="cuda", dtype=torch.bfloat16)
        numba_flash.decode(q4, k, v, cache_seqlens=lens + 4, block_table=table,
                           mask=masks.tree([-1, 0, 0, 1]), return_lse=True)
        torch.cuda.synchronize()
        print("sanitize case done")
        return
    dev = torch.cuda.get_device_name()
    copy_bw = copy_bandwidth_gbs()
    print(f"device {dev}; copy bandwidth {copy_bw:.0f} GB/s (read + write)", flush=True)
    rows, sweep = [], []
    result = dict(device=dev, date=datetime.date.today().isoformat(), copy_gbs=copy_bw,
                  rows=rows, sweep=sweep, tile_sweep=[])

    def save():
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    if args.tiles:
        tile_sweep(args, copy_bw, save, result["tile_sweep"])
        save()
    table_shapes = [SHAPES[int(i)] for i in args.shapes.split(",")] if args.shapes else SHAPES
    for (b, hq, hkv, L, d) in ([] if args.no_table else SHAPES[:1] if args.quick
                               else table_shapes):
        for dtype in DTYPES:
            for page in LAYOUTS:
                if args.no_bf16_paged and dtype == "bfloat16" and page is not None:
                    continue
                q, k, v, lens, table = make_inputs(b, hq, hkv, L, d, dtype, page)
                kv_bytes = 2 * b * L * hkv * d * q.element_size()
                fn = lambda: numba_flash.decode(q, k, v, cache_seqlens=lens, block_table=table)
                if page is None:       # correctness spot check against SDPA on this shape
                    ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                         v.transpose(1, 2), enable_gqa=True)
                    err = (fn().float() - ref.transpose(1, 2).float()).abs().max().item()
                row = dict(B=b, Hq=hq, Hkv=hkv, L=L, D=d, dtype=dtype,
                           layout="contiguous" if page is None else f"paged{page}",
                           max_abs_diff_vs_sdpa=err if page is None else None)
                ms = gpu_time_ms(fn)
                from numba_flash.cuda.launch.decode import LAST_PLAN

                row.update(ours_ms=ms, ours_call_us=call_time_us(fn),
                           ours_gbs=kv_bytes / ms / 1e6, splits=LAST_PLAN.get("splits"),
                           tile=LAST_PLAN.get("tile"), merge=LAST_PLAN.get("merge"))
                row["ours_pct_copy"] = 100 * row["ours_gbs"] / copy_bw
                if page is None:
                    sdpa_times(q, k, v, row)
                    for name in ("flash", "cudnn"):
                        if f"sdpa_{name}_ms" in row:
                            t = row[f"sdpa_{name}_ms"]
                            row[f"sdpa_{name}_gbs"] = kv_bytes / t / 1e6
                            row[f"sdpa_{name}_pct_copy"] = 100 * row[f"sdpa_{name}_gbs"] / copy_bw
                            row[f"speedup_vs_{name}"] = t / ms
                    if args.sweep and dtype == "float16":
                        for s in (1, 2, 4, 8, 16, 32, 64, 128):
                            t = gpu_time_ms(lambda: numba_flash.decode(
                                q, k, v, cache_seqlens=lens, num_splits=s), rounds=3)
                            sweep.append(dict(B=b, Hq=hq, Hkv=hkv, L=L, splits=s, ms=t,
                                              pct_copy=100 * kv_bytes / t / 1e6 / copy_bw))
                            print(f"  sweep {b, hq, hkv, L} splits {s:>3}: {t:.4f} ms "
                                  f"{sweep[-1]['pct_copy']:.1f}%", flush=True)
                rows.append(row)
                save()
                print(_fmt(row), flush=True)
                del q, k, v, lens, table
                torch.cuda.empty_cache()
    save()
    print(f"\ndevice: {dev}, {result['date']}, copy bandwidth {copy_bw:.0f} GB/s")
    print(_header())
    for row in rows:
        print(_fmt(row))
    _plot(rows, args.plot, dev)
    _kernel_report()


def _imports():
    global torch, F, numba_flash
    import torch
    import torch.nn.functional as F

    import numba_flash


def tile_sweep(args, copy_bw, save, out):
    """%copy of float16 cases for each tensor-core tile 'bn,stages,warps[,hint]' (decode_cuda's
    ``tile`` and ``stream_hint`` test keywords) and split count: ``--tile-splits``, or a few
    around what ``num_splits="auto"`` picks for that layout; ``--tile-pages`` picks the cache
    layouts (none = contiguous, or page sizes), ``--tile-shapes`` the shapes."""
    from numba_flash.cuda.launch import decode as dec

    shapes = [SHAPES[int(i)] for i in args.tile_shapes.split(",")] if args.tile_shapes else \
        (SHAPES[:1] if args.quick else SHAPES)
    pages = [None if p == "none" else int(p) for p in args.tile_pages.split(",")]
    for (b, hq, hkv, L, d) in shapes:
        for page in pages:
            q, k, v, lens, table = make_inputs(b, hq, hkv, L, d, "float16", page)
            kv_bytes = 2 * b * L * hkv * d * q.element_size()
            auto, splits = _tile_splits(args, dec, b * hkv * -(-(hq // hkv) // dec.MMA_ROWS),
                                        L, page)
            for spec in args.tiles.split(";"):
                with _decode_tile(dec, spec):
                    for s in splits:
                        fn = lambda: numba_flash.decode(q, k, v, cache_seqlens=lens,
                                                        block_table=table, num_splits=s)
                        t = gpu_time_ms(fn, rounds=3, spin=SPIN_CYCLES // 3)
                        out.append(dict(B=b, Hq=hq, Hkv=hkv, L=L, D=d, page=page, tile=spec,
                                        splits=s, auto=s == auto, ms=t,
                                        pct_copy=100 * kv_bytes / t / 1e6 / copy_bw,
                                        plan_tile=dec.LAST_PLAN.get("tile")))
                        print(f"  tile {spec:<12} {b, hq, hkv, L} page {page} splits {s:>3}"
                              f"{'*' if s == auto else ' '}: {t:.4f} ms "
                              f"{out[-1]['pct_copy']:.1f}%", flush=True)
                save()
            del q, k, v, lens, table
            torch.cuda.empty_cache()
    return out


def _tile_splits(args, dec, units, L, page):
    """(the split count "auto" picks for this layout, the split counts to sweep)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    contig = dec.auto_num_splits_mma(units, L, sms)
    auto = contig if page is None else \
        dec.auto_num_splits_mma(units, L, sms, dec.MMA_WARPS_PER_SM_PAGED, 0)
    if args.tile_splits:
        return auto, sorted({int(x) for x in args.tile_splits.split(",")})
    if args.tile_wps:       # the split counts that give these warps per multiprocessor
        return auto, sorted({dec.auto_num_splits_mma(units, L, sms, int(w), 0)
                             for w in args.tile_wps.split(",")})
    if page is None:
        return auto, sorted({auto, max(1, auto // 2), 2 * auto, max(1, auto * 3 // 4),
                             auto * 3 // 2})
    return auto, sorted({auto, max(1, auto // 2), contig, contig * 4 // 3})   # paged and contig


@contextlib.contextmanager
def _decode_tile(dec, spec):
    """While inside: numba_flash.decode runs the tensor-core tile of ``spec``
    'bn,stages,warps[,hint 0/1]', by ``dec.decode_cuda`` (which numba_flash.decode calls through
    the module) replaced with a partial of it. The wrapper also drops ``fast``: a plan recorded
    for repeated calls is keyed by the call's signature, not the tile, and would serve the next
    tile's calls; so every call takes the full path (more host time, the same GPU time)."""
    from numba_flash.cuda.launch import fastpath

    parts = [int(x) for x in spec.split(",")]
    hint = bool(parts[3]) if len(parts) > 3 else None
    original = dec.decode_cuda
    tiled = functools.partial(original, tile=tuple(parts[:3]), stream_hint=hint)

    def decode_cuda(*a, **kw):
        kw["fast"] = None
        return tiled(*a, **kw)

    fastpath.fast_table("decode").clear()       # no earlier plan may answer these calls
    dec.decode_cuda = decode_cuda
    try:
        yield
    finally:
        dec.decode_cuda = original
        fastpath.fast_table("decode").clear()


def _kernel_report():
    """Registers, local memory (spills) and shared memory of each decode kernel compiled here."""
    from numba_flash.cuda.kernels import decode_fma
    from numba_flash.cuda.launch import decode as dec

    names = ("D", "bf16", "rows", "paged", "left", "right", "sinks", "softcap", "tree", "direct",
             "lse")
    for config, kern in list(decode_fma._KERNELS.items()) + list(dec._MMA_KERNELS.items()):
        try:
            regs, local, shared = (next(iter(x.values()), "-") if isinstance(x, dict) else x
                                   for x in (kern.get_regs_per_thread(),
                                             kern.get_local_mem_per_thread(),
                                             kern.get_shared_mem_per_block()))
        except Exception as exc:  # noqa: BLE001 - API differences between numba-cuda versions
            regs = local = shared = repr(exc)[:60]
        if regs == "-":     # loaded from its image (launch/images.py): no dispatcher record
            regs = local = shared = "- (loaded image; scripts/kernel_resources.py)"
        desc = " ".join(f"{n}={int(c)}" for n, c in zip(names, config)) \
            if len(config) == len(names) else f"mma {config}"
        print(f"kernel {desc}: regs {regs} local {local} shared {shared}")


def _header():
    return (f"{'(B, Hq, Hkv, L, D)':<26}{'dtype':<10}{'layout':<11}{'ours ms':>9}{'GB/s':>7}"
            f"{'%copy':>7}{'call us':>9}{'flash%':>8}{'x flash':>8}{'cudnn%':>8}{'x cudnn':>8}")


def _fmt(r):
    def g(key, fmt):
        return format(r[key], fmt) if key in r else "-"
    return (f"{str((r['B'], r['Hq'], r['Hkv'], r['L'], r['D'])):<26}{r['dtype']:<10}"
            f"{r['layout']:<11}{r['ours_ms']:>9.4f}{r['ours_gbs']:>7.0f}{r['ours_pct_copy']:>7.1f}"
            f"{r['ours_call_us']:>9.1f}{g('sdpa_flash_pct_copy', '.1f'):>8}"
            f"{g('speedup_vs_flash', '.2f'):>8}{g('sdpa_cudnn_pct_copy', '.1f'):>8}"
            f"{g('speedup_vs_cudnn', '.2f'):>8}")


def _plot(rows, path, dev):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001
        return
    labels = [f"{r['dtype'][:4]} {r['layout']}\n{r['B']}x{r['Hq']}/{r['Hkv']}x{r['L']}"
              for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.6), 4.5))
    width = 0.28
    for i, (key, name) in enumerate((("ours_pct_copy", "numba-flash decode"),
                                     ("sdpa_flash_pct_copy", "SDPA flash"),
                                     ("sdpa_cudnn_pct_copy", "SDPA cuDNN"))):
        ax.bar(x + (i - 1) * width, [r.get(key, 0) for r in rows], width, label=name)
    ax.axhline(85, color="k", lw=0.8, ls="--")
    ax.set_xticks(x, labels, fontsize=5)
    ax.set_ylabel("% of copy bandwidth (K+V bytes read)")
    ax.set_title(f"decode, one query row, {dev}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
