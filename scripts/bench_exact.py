"""Benchmark of the exact float32 / float64 forward paths on one GPU, in one process:
numba-flash's CUDA-core kernels against PyTorch SDPA's memory-efficient backend (float32; no
fused float64 attention exists in PyTorch, its math backend is timed instead) and naive CuPy
(matmul, softmax, matmul in the same dtype). Prints a table, writes JSON.

With ``--tensor-cores`` each row also times ``precision="ieee"`` (the CUDA-core kernels) and
``precision="tensor_cores"`` (float64 on DMMA, float32 in 3xTF32; kernels/forward_dmma.py,
forward_tf32x3.py), both through the public call, and reports both paths' max error against a
float64 computation of the same inputs (the oracle: naive float64 attention on the GPU). Head
dims the tensor-core kernels do not take run the CUDA-core kernel in both columns ("tc kernel"
says which ran). "ours" is the default (``precision="auto"``: DMMA for float64 flag calls on
compute capability 9.0+, the CUDA-core kernels otherwise).

    python scripts/bench_exact.py --out bench_exact.json [--shape B,H,N,D ...]

TFLOP/s counts 4 * B * H * N^2 * D (half for causal), as scripts/bench_forward.py.
"""
from __future__ import annotations

import argparse
import datetime
import json

import cupy as cp

from bench_forward import flops, naive_attention, time_ms

SHAPES = [(2, 16, 2048, 64), (2, 16, 2048, 128)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_exact.json")
    ap.add_argument("--shape", action="append", default=None, metavar="B,H,N,D")
    ap.add_argument("--tensor-cores", action="store_true",
                    help="also time the DMMA / 3xTF32 kernels and compare errors")
    args = ap.parse_args()
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from numba_flash import attention

    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shape] if args.shape else SHAPES
    dev = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    rng = cp.random.default_rng(0)
    rows = []
    print(f"device: {dev}, {datetime.date.today()}")
    print(f"{'shape (B,H,N,D)':20} {'dtype':8} {'mask':7} {'ours ms':>8} {'TF/s':>6} "
          f"{'sdpa ms':>8} {'x sdpa':>7} {'naive ms':>9} {'x naive':>8}")
    for (b, h, n, d) in shapes:
        for dtype in ("float32", "float64"):
            q, k, v = (rng.standard_normal((b, n, h, d), dtype=dtype) for _ in range(3))
            tq, tk, tv = (torch.as_tensor(x, device="cuda").transpose(1, 2) for x in (q, k, v))
            for causal in (False, True):
                fl = flops(b, h, n, d, causal)
                row = dict(B=b, H=h, N=n, D=d, dtype=dtype, causal=causal)
                ms = time_ms(lambda: attention(q, k, v, causal=causal), reps=10)
                row.update(ours_ms=ms, ours_tflops=fl / ms / 1e9)
                backend = SDPBackend.EFFICIENT_ATTENTION if dtype == "float32" else SDPBackend.MATH
                try:
                    with sdpa_kernel(backend):
                        stream = torch.cuda.current_stream()
                        with cp.cuda.ExternalStream(stream.cuda_stream):
                            t = time_ms(lambda: F.scaled_dot_product_attention(
                                tq, tk, tv, is_causal=causal), reps=10)
                    row.update(sdpa_backend=backend.name, sdpa_ms=t, ratio_vs_sdpa=t / ms)
                except Exception as exc:
                    row["sdpa_error"] = repr(exc)[:120]
                naive = naive_attention(q, k, v, causal)
                t = time_ms(naive, reps=5, warmup=1)
                row.update(naive_ms=t, speedup_vs_naive=t / ms)
                if args.tensor_cores:
                    row.update(tensor_core_row(q, k, v, causal, fl))
                cp.get_default_memory_pool().free_all_blocks()
                rows.append(row)
                print(f"{str((b, h, n, d)):20} {dtype:8} {'causal' if causal else 'full':7} "
                      f"{ms:8.3f} {row['ours_tflops']:6.2f} {row.get('sdpa_ms', float('nan')):8.3f} "
                      f"{row.get('ratio_vs_sdpa', float('nan')):7.2f} {row['naive_ms']:9.3f} "
                      f"{row['speedup_vs_naive']:8.2f}"
                      + (f"   tc {row['tc_kernel']:6s} {row['tc_ms']:8.3f} ms "
                         f"x ieee {row['tc_speedup']:5.2f}  err ieee {row['err_ieee']:.1e} "
                         f"tc {row['err_tc']:.1e}" if args.tensor_cores else ""), flush=True)
    with open(args.out, "w") as f:
        json.dump(dict(device=dev, date=datetime.date.today().isoformat(), rows=rows), f, indent=1)


def tensor_core_row(q, k, v, causal, fl):
    """Timing and max error of the IEEE kernel and of the tensor-core kernel for one row."""
    from numba_flash import attention
    from numba_flash.cuda.launch import attention as runtime

    d = q.shape[-1]
    exact = naive_attention(*(x.astype(cp.float64) for x in (q, k, v)), causal)()
    exact = exact.transpose(0, 2, 1, 3)       # the naive peer's (B, H, N, D) -> (B, N, H, D)

    def run(precision="ieee"):      # the public call: repeated calls take the fast path
        return attention(q, k, v, softmax_scale=d ** -0.5, causal=causal, precision=precision)

    try:
        tc_kind = runtime.tensor_core_kernel(str(q.dtype), d, "tensor_cores")
    except NotImplementedError:      # a head_dim the tensor-core kernel does not take
        tc_kind = "ieee"

    def run_tc():
        return run("tensor_cores" if tc_kind != "ieee" else "ieee")

    err_ieee = float(cp.abs(run().astype(cp.float64) - exact).max())
    err_tc = float(cp.abs(run_tc().astype(cp.float64) - exact).max())
    ms_tc = time_ms(run_tc, reps=10)
    ms = time_ms(run, reps=10)
    return dict(tc_kernel=tc_kind, tc_ms=ms_tc, tc_tflops=fl / ms_tc / 1e9, ieee_ms=ms,
                tc_speedup=ms / ms_tc, err_ieee=err_ieee, err_tc=err_tc)


if __name__ == "__main__":
    main()
