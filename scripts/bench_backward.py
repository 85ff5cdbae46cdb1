"""Backward benchmark on one GPU (issue 19): forward + backward TFLOP/s of numba_flash against
PyTorch SDPA (cuDNN and FlashAttention-2 backends) and FlexAttention, side by side in one process.

    python scripts/bench_backward.py [--quick] [--dtype bfloat16] [--masks | --only-masks]
        [--batch 4 --heads 16 --n 4096 --dims 64,128,256]     # the default cases' sizes
        [--mask-n 8192 --mask-batch 2]                         # the mask cases' sizes
        [--reps 10 --warmup 3] [--no-flex] [--no-deterministic] [--json bench_backward.json]

Cases: B4 H16 N4096 at head_dim 64, 128, 256, full and causal, float16 (``--dtype bfloat16``
instead); ``--quick``: head_dim 128 only. ``--masks`` adds, at N 8192 bfloat16 head_dim 128,
FlashMask's causal_document, document, sliding_window (1024 keys to the left), prefix_lm_causal,
shared_question and global_sliding_window masks, built as scripts/bench_masks.py builds them
(its ``mask_set``); ``--only-masks`` runs those alone.

Columns: ours (``numba_flash.attention(..., return_lse=True)`` then
``numba_flash.attention_backward(dout, q, k, v, out, lse)``, torch CUDA tensors (B, N, H, D)),
ours det (the same with ``deterministic=True``), cuDNN and FA2 (``F.scaled_dot_product_attention``
under ``sdpa_kernel(CUDNN_ATTENTION / FLASH_ATTENTION)`` on (B, H, N, D) transposed views of
leaves that require grad, then ``out.backward(dout)``; masks go in as a dense boolean
``attn_mask``, which FA2 refuses), Flex (``torch.compile(flex_attention, dynamic=False)`` on
contiguous (B, H, N, D) copies; causal as ``q >= kv``, masks as scripts/bench_masks.py's
``mask_mod`` over the mask's column intervals, ``create_block_mask`` outside the timing).
A library that raises gets the error's type in its cell and the reason printed under the row.

FLOPs: the forward counts 4 * B * H * D per visible (query, key) pair (N * N for full
attention, N (N + 1) / 2 causal, the mask's own count for masks); the backward counts 2.5 times
that, so TFLOP/s = 3.5 * forward FLOPs / time of forward + backward.
Timing: every rep is one forward + backward alone between two CUDA events (host time before the
launches included), median of ``--reps`` after ``--warmup`` reps (which also compile).
Memory: peak extra memory of one forward + backward beyond the inputs, as
``torch.cuda.max_memory_allocated`` sees it. Our backward's float32 workspaces (dQ accumulator,
dK / dV partials, delta) are allocated through Numba, which torch does not see: the "numba MiB"
column estimates them from the device's free memory around one call (Numba's frees deferred).
max|diff|: largest absolute difference of ours' dq, dk, dv from the first peer that ran
(FA2, else cuDNN, else Flex).
``--json`` writes every number with the device name and date, after every case.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

MASKS = ("causal_document", "document", "sliding_window", "prefix_lm_causal", "shared_question",
         "global_sliding_window")
LIBS = ("ours", "ours_det", "cudnn", "fa2", "flex")
PEERS = ("cudnn", "fa2", "flex")
BM = None       # scripts/bench_masks.py, imported by main (mask_set, visible_pairs, timed)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--quick", action="store_true", help="head_dim 128 full and causal only")
    p.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"),
                   help="dtype of the default cases (mask cases are bfloat16)")
    p.add_argument("--masks", action="store_true", help="add the mask cases")
    p.add_argument("--only-masks", action="store_true", help="the mask cases alone")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--dims", default="64,128,256")
    p.add_argument("--mask-n", type=int, default=8192)
    p.add_argument("--mask-batch", type=int, default=2)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-flex", action="store_true")
    p.add_argument("--no-deterministic", action="store_true", help="skip the ours det column")
    p.add_argument("--json", default="", help="write the raw numbers here")
    return p.parse_args(argv)


def make_cases(args):
    """Case dicts: name, sizes, dtype, pairs (visible), and ``mask``: "full", "causal" or a
    numba_flash.masks object."""
    cases = []
    if not args.only_masks:
        dims = [128] if args.quick else [int(d) for d in args.dims.split(",")]
        n = args.n
        for d in dims:
            for kind, pairs in (("full", n * n), ("causal", n * (n + 1) // 2)):
                cases.append(dict(name=kind, mask=kind, B=args.batch, H=args.heads, N=n, D=d,
                                  dtype=args.dtype, pairs=pairs))
    if args.masks or args.only_masks:
        n = args.mask_n
        for name, mask in BM.mask_set(n).items():
            if name in MASKS:
                cases.append(dict(name=name, mask=mask, B=args.mask_batch, H=args.heads, N=n,
                                  D=128, dtype="bfloat16", pairs=BM.visible_pairs(mask, n)))
    return cases


def make_inputs(case):
    """q, k, v, dout: torch CUDA tensors (B, N, H, D), random normal."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (case["B"], case["N"], case["H"], case["D"])
    dtype = getattr(torch, case["dtype"])
    return tuple(torch.randn(shape, device="cuda", dtype=dtype, generator=g) for _ in range(4))


def ours_step(case, x, deterministic):
    import numba_flash

    q, k, v, dout = x
    mask = case["mask"]
    kw = {} if mask == "full" else {"causal": True} if mask == "causal" else {"mask": mask}

    def step():
        out, lse = numba_flash.attention(q, k, v, return_lse=True, **kw)
        return numba_flash.attention_backward(dout, q, k, v, out, lse,
                                              deterministic=deterministic, **kw)
    return step


def sdpa_step(case, x, backend):
    """SDPA on (B, H, N, D) views of (B, N, H, D) leaves; returns grads as (B, N, H, D)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "fa2": SDPBackend.FLASH_ATTENTION}[backend]
    leaves = [t.detach().requires_grad_() for t in x[:3]]   # share storage with ours' inputs
    dout = x[3].transpose(1, 2)
    mask = case["mask"]
    kw = {} if mask == "full" else {"is_causal": True} if mask == "causal" else \
        {"attn_mask": torch.from_numpy(mask.to_dense(case["N"], case["N"])).cuda()[None, None]}

    def step():
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in leaves), **kw)
        out.backward(dout)
        grads = tuple(t.grad for t in leaves)
        for t in leaves:
            t.grad = None
        return grads
    return step


class Flex:
    """flex_attention compiled once per shape (dynamic=False); block masks built per case."""

    def __init__(self):
        import torch
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        raise_compile_limits(torch)
        self.torch, self.create_block_mask = torch, create_block_mask
        self.fn = torch.compile(flex_attention, dynamic=False)
        self.intervals = {}     # N -> (int32 (4, N) buffer, its mask_mod)

    def block_mask(self, case):
        mask, n = case["mask"], case["N"]
        if mask == "full":
            return None
        if mask == "causal":
            return self.create_block_mask(lambda b, h, q, kv: q >= kv, None, None, n, n,
                                          device="cuda")
        buf, mod = self._interval_mod(n)
        buf.copy_(self.torch.from_numpy(mask.column_intervals(n, n).stacked()))
        return self.create_block_mask(mod, None, None, n, n, device="cuda")

    def _interval_mod(self, n):
        """scripts/bench_masks.py's mask_mod: key kv is hidden from row q inside either of its
        column intervals [iv[0], iv[1]) and [iv[2], iv[3])."""
        if n not in self.intervals:
            iv = self.torch.zeros((4, n), dtype=self.torch.int32, device="cuda")

            def interval_mod(b, h, q, kv):
                lt = (iv[0][kv] <= q) & (q < iv[1][kv])
                ut = (iv[2][kv] <= q) & (q < iv[3][kv])
                return ~(lt | ut)
            self.intervals[n] = (iv, interval_mod)
        return self.intervals[n]

    def step(self, case, x):
        """Contiguous (B, H, N, D) leaves; returns grads as (B, N, H, D) views."""
        leaves = [t.transpose(1, 2).contiguous().requires_grad_() for t in x[:3]]
        dout = x[3].transpose(1, 2).contiguous()
        bm = self.block_mask(case)

        def step():
            out = self.fn(*leaves, block_mask=bm)
            out.backward(dout)
            grads = tuple(t.grad.transpose(1, 2) for t in leaves)
            for t in leaves:
                t.grad = None
            return grads
        return step


def raise_compile_limits(torch, limit=256):
    """torch.compile stops recompiling after its cache limit (8) and silently runs the unfused
    path (/work/shared/gpu/NOTES.md fact 7): raise every such limit this torch has."""
    cfg = torch._dynamo.config
    for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                 "accumulated_recompile_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), limit))


def active_libs(args, flex):
    return [lib for lib in LIBS if not (lib == "flex" and flex is None)
            and not (lib == "ours_det" and args.no_deterministic)]


def make_step(lib, case, x, flex):
    if lib in ("ours", "ours_det"):
        return ours_step(case, x, lib == "ours_det")
    if lib == "flex":
        return flex.step(case, x)
    return sdpa_step(case, x, lib)


def measure(lib, case, x, flex, args):
    """{ms, tflops, peak_mib[, numba_mib]} of one library on one case, or {error}; also the
    gradients of one more call (for the comparison), under key "_grads"."""
    flops = 3.5 * 4.0 * case["B"] * case["H"] * case["D"] * case["pairs"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            step = make_step(lib, case, x, flex)
            ms = BM.timed(step, args.reps, args.warmup)
            peak, numba = peak_memory(step, lib.startswith("ours"))
            grads = step()
        except Exception as exc:  # noqa: BLE001 - report the reason, go on
            return {"error": error_reason(exc, caught)}
    cell = {"ms": ms, "tflops": flops / ms / 1e9, "peak_mib": peak, "_grads": grads}
    if numba is not None:
        cell["numba_mib"] = numba
    return cell


def error_reason(exc, caught):
    """The exception's type and first line, and the warnings that explain it (SDPA says why a
    backend refused the inputs only through warnings)."""
    reason = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
    hints = [str(w.message).splitlines()[0] for w in caught
             if "kernel" in str(w.message).lower() or "support" in str(w.message).lower()]
    return reason + "".join(f" | {h}" for h in hints[-3:])


def peak_memory(step, numba_too):
    """(MiB of torch's peak allocation beyond what is live now, and with ``numba_too`` the MiB
    the device's free memory lost to allocations other than torch's, else None) over one call
    of ``step``."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    other = None
    try:
        if numba_too:
            other = _numba_bytes(step, torch, reserved)
    except Exception:  # noqa: BLE001 - no such Numba API here: torch's figure only
        other = None
    if other is None:
        step()
        torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return peak, None if other is None else max(other, 0) / 2**20


def _numba_bytes(step, torch, reserved):
    """Bytes of device memory one call of ``step`` holds outside torch's allocator at its end
    (Numba frees nothing inside ``defer_cleanup``, so its workspaces are all still held)."""
    from numba import cuda

    ctx = cuda.current_context()
    ctx.deallocations.clear()
    free0 = ctx.get_memory_info().free
    with cuda.defer_cleanup():
        step()
        torch.cuda.synchronize()
        free1 = ctx.get_memory_info().free
    return (free0 - free1) - (torch.cuda.memory_reserved() - reserved)


def max_diff(ours, ref):
    return max(float((a.float() - b.float()).abs().nan_to_num(0).max()) for a, b in zip(ours, ref))


def run_case(case, flex, args):
    """One table row: every library's cell, ratios ours / peer, max|diff| against a peer."""
    import torch

    x = make_inputs(case)
    row = {k: v for k, v in case.items() if k != "mask"}
    libs = active_libs(args, flex)
    for lib in libs:
        row[lib] = measure(lib, case, x, flex, args)
        torch.cuda.empty_cache()
    ours = row["ours"]
    for peer in PEERS:
        if "tflops" in ours and "tflops" in row.get(peer, {}):
            row[f"ours/{peer}"] = ours["tflops"] / row[peer]["tflops"]
    ref = next((p for p in ("fa2", "cudnn", "flex") if "_grads" in row.get(p, {})), None)
    if "_grads" in ours and ref is not None:
        row["max_diff"], row["max_diff_vs"] = max_diff(ours["_grads"], row[ref]["_grads"]), ref
    for lib in libs:
        row[lib].pop("_grads", None)
    del x
    torch.cuda.empty_cache()
    return row


def header(libs, memory=False):
    """The speed table's header (TFLOP/s, ratios ours / peer, max|diff|) or the memory
    table's (torch's peak MiB per library, then our Numba workspaces' estimate)."""
    head = f"{'case':<24}{'B H N D':<18}{'dtype':<10}"
    if memory:
        numba = "".join(f"{lib + ' numba':>15}" for lib in libs if lib.startswith("ours"))
        return head + "".join(f"{lib:>11}" for lib in libs) + numba
    ratios = "".join(f"{'ours/' + p:>11}" for p in PEERS if p in libs)
    return head + "".join(f"{lib:>11}" for lib in libs) + ratios + f"{'max|diff|':>11}"


def fmt_row(row, libs, memory=False):
    def cell(lib, key, fmt, width):
        c = row.get(lib, {})
        text = format(c[key], fmt) if key in c else \
            ("ERR " + c["error"].split(":")[0])[:width - 1] if "error" in c and not memory \
            else "-"
        return f"{text:>{width}}"
    size = f"{row['B']} {row['H']} {row['N']} {row['D']}"
    line = f"{row['name']:<24}{size:<18}{row['dtype']:<10}"
    if memory:
        return line + "".join(cell(lib, "peak_mib", ".0f", 11) for lib in libs) + \
            "".join(cell(lib, "numba_mib", ".0f", 15) for lib in libs if lib.startswith("ours"))
    ratios = "".join(f"{format(row[f'ours/{p}'], '.2f') if f'ours/{p}' in row else '-':>11}"
                     for p in PEERS if p in libs)
    diff = format(row["max_diff"], ".2e") if "max_diff" in row else "-"
    return line + "".join(cell(lib, "tflops", ".1f", 11) for lib in libs) + ratios + \
        f"{diff:>11}"


def fmt_errors(row, libs):
    return "".join(f"\n    {lib}: {row[lib]['error'][:300]}" for lib in libs
                   if "error" in row.get(lib, {}))


def main(argv=None):
    global BM
    args = parse_args(argv)
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_masks as BM

    flex = None if args.no_flex else Flex()
    libs = active_libs(args, flex)
    result = {"device": torch.cuda.get_device_name(),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "torch": torch.__version__, "args": vars(args), "rows": []}
    print(f"device {result['device']}, {result['date']}, torch {torch.__version__}; TFLOP/s of "
          f"forward + backward (backward = 2.5x forward FLOPs, visible pairs only)", flush=True)
    print(header(libs), flush=True)
    for case in make_cases(args):
        row = run_case(case, flex, args)
        result["rows"].append(row)
        print(fmt_row(row, libs) + fmt_errors(row, libs), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    for memory in (False, True):
        print(f"\n{header(libs, memory)}")
        for row in result["rows"]:
            print(fmt_row(row, libs, memory))
    print("TFLOP/s: forward + backward, 3.5x the forward's FLOPs over visible pairs. MiB: "
          "torch.cuda.max_memory_allocated beyond the inputs over one forward + backward; our "
          "Numba workspaces are not in it ('numba' columns: their estimate from free memory)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
