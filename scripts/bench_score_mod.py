"""score_mod on the GPU: numba-flash against FlexAttention and SDPA with the same functions.

One process, every column of a row measured in it.

    python scripts/bench_score_mod.py [--n 8192 --batch 4 --heads 16 --dim 128]
        [--dtypes float16,bfloat16] [--reps 5] [--json bench_score_mod.json]
    python scripts/bench_score_mod.py --check-cpu      # no GPU: the three forms agree

Each case is one score function written three ways: a Python function for numba-flash
(compiled into our kernel by Numba), a torch ``score_mod`` for ``torch.compile``d
``flex_attention`` (with a causal block mask built outside the timing), and a dense float bias
for SDPA's ``attn_mask`` (tanh_cap, which no additive bias expresses, runs materialised:
matmul, softmax, matmul). All
calls are causal; FLOPs count the visible pairs, as in bench_masks.py, whose single-call CUDA
event timing this script uses. ``--check-cpu`` runs the three forms at a small size on the CPU
(ours in CPU mode, flex_attention eagerly, SDPA with the dense bias) and asserts they agree.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time

import numpy as np

# Per-head slopes of the relative-position bias (ALiBi's geometric sequence, 16 heads), and a
# document id per position for the document bias (set by ``set_documents``).
SLOPES = (2.0 ** (-8.0 * (np.arange(16) + 1) / 16)).astype(np.float32)
DOCS = np.zeros(1, dtype=np.int32)
CAP = 20.0


def relative_bias(score, b, h, q_idx, kv_idx):
    """ALiBi written as a score_mod: a captured per-head slope times the distance."""
    return score - SLOPES[h] * (q_idx - kv_idx)


def tanh_cap(score, b, h, q_idx, kv_idx):
    """Gemma-2's logit softcap written as a score_mod."""
    return CAP * math.tanh(score / CAP)


def document_bias(score, b, h, q_idx, kv_idx):
    """A penalty of 1 for attending across packed documents (read from a captured array)."""
    return score - 1.0 * (DOCS[q_idx] != DOCS[kv_idx])


def set_documents(n: int) -> None:
    """Four packed documents of unequal lengths over ``n`` positions."""
    global DOCS
    cuts = np.array([0, n // 5, n // 2, (4 * n) // 5, n])
    DOCS = np.repeat(np.arange(4), np.diff(cuts)).astype(np.int32)


def torch_forms(torch, device):
    """{case: (flex score_mod, dense bias builder (n, heads) -> float64 tensor or None,
    dense transform of the scores or None)}."""
    slopes = torch.as_tensor(SLOPES, device=device)
    docs = torch.as_tensor(DOCS, device=device)

    def flex_relative(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx)

    def flex_tanh(score, b, h, q_idx, kv_idx):
        return CAP * torch.tanh(score / CAP)

    def flex_document(score, b, h, q_idx, kv_idx):
        return score - 1.0 * (docs[q_idx] != docs[kv_idx])

    def dense_relative(n, heads):
        pos = torch.arange(n, device=device)
        return -(slopes[:heads, None, None] * (pos[:, None] - pos[None, :]))

    def dense_document(n, heads):
        return -1.0 * (docs[:, None] != docs[None, :]).float()[None]

    return {"relative_bias": (flex_relative, dense_relative),
            "tanh_cap": (flex_tanh, None),
            "document_bias": (flex_document, dense_document)}


OURS = {"relative_bias": relative_bias, "tanh_cap": tanh_cap, "document_bias": document_bias}


def sdpa_call(torch, F, q, k, v, case, bias_fn, scale):
    """A function running the case's attention through PyTorch on (B, H, N, D) tensors: SDPA
    with a dense float mask (the bias, -inf above the diagonal; built here, once), or for
    tanh_cap, which no additive mask expresses, the capped scores materialised (matmul,
    softmax, matmul)."""
    n, heads = q.shape[2], q.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    if case == "none":
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    if bias_fn is not None:
        bias = bias_fn(n, heads).masked_fill(~causal, -math.inf).to(q.dtype)[None]
        return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)

    def capped():
        s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
        s = (CAP * torch.tanh(s / CAP)).masked_fill(~causal, -math.inf)
        return torch.matmul(torch.softmax(s, dim=-1).to(q.dtype), v)

    return capped


def check_cpu() -> int:
    """The three forms of every case agree on the CPU (small shapes, float32)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import flex_attention

    import numba_flash

    b, n, h, d = 2, 96, 4, 32
    set_documents(n)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((b, n, h, d)).astype(np.float32) for _ in range(3))
    tq, tk, tv = (torch.from_numpy(x).transpose(1, 2).contiguous() for x in (q, k, v))
    scale = d ** -0.5
    worst = 0.0
    for case, (flex_mod, bias_fn) in torch_forms(torch, "cpu").items():
        ours = numba_flash.attention(q, k, v, causal=True, score_mod=OURS[case])

        def causal_mod(score, bb, hh, q_idx, kv_idx, mod=flex_mod):
            return torch.where(kv_idx <= q_idx, mod(score, bb, hh, q_idx, kv_idx), -math.inf)

        flex = flex_attention(tq, tk, tv, score_mod=causal_mod, scale=scale)
        sdpa = sdpa_call(torch, F, tq, tk, tv, case, bias_fn, scale)()
        for name, other in (("flex", flex), ("sdpa", sdpa)):
            err = float(np.abs(other.transpose(1, 2).numpy() - ours).max())
            worst = max(worst, err)
            print(f"{case:14} ours vs {name}: max |diff| {err:.2e}")
            assert err < 1e-4, (case, name, err)
    print(f"check-cpu: every case agrees (worst {worst:.1e})")
    return 0


def bench(args) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    import numba_flash
    from bench_masks import timed

    n, b, h, d = args.n, args.batch, args.heads, args.dim
    set_documents(n)
    scale = d ** -0.5
    flops = 4.0 * d * b * h * n * (n + 1) / 2          # visible pairs of a causal mask
    results = {"device": torch.cuda.get_device_name(),
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "torch": torch.__version__, "args": vars(args), "rows": []}
    forms = torch_forms(torch, "cuda")
    block_mask = create_block_mask(lambda bb, hh, qi, kv: kv <= qi, None, None, n, n,
                                   device="cuda")
    flex = torch.compile(flex_attention)
    for dtype_name in args.dtypes.split(","):
        dt = getattr(torch, dtype_name)
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn((b, h, n, d), device="cuda", dtype=dt, generator=g)
                   for _ in range(3))
        qs, ks, vs = (x.transpose(1, 2) for x in (q, k, v))      # (B, S, H, D) views
        for case in ["none"] + list(OURS):
            row = {"dtype": dtype_name, "case": case, "n": n, "batch": b, "heads": h, "dim": d}
            fn = OURS.get(case)
            t0 = time.time()
            ours = lambda: numba_flash.attention(qs, ks, vs, causal=True, score_mod=fn)  # noqa: E731
            row["ours_ms"] = timed(ours, args.reps)
            row["ours_first_call_s"] = time.time() - t0
            flex_mod, bias_fn = forms.get(case, (None, None))
            fx = lambda: flex(q, k, v, score_mod=flex_mod, block_mask=block_mask)  # noqa: E731
            row["flex_ms"] = timed(fx, args.reps)
            row["max_abs_diff_vs_flex"] = float(
                (fx().transpose(1, 2).float() - ours().float()).abs().max())
            if not args.no_sdpa:   # its dense bias is built outside the timing
                row["sdpa_ms"] = timed(sdpa_call(torch, F, q, k, v, case, bias_fn, scale),
                                       max(2, args.reps // 2), 1)
            for key in ("ours", "flex", "sdpa"):
                if f"{key}_ms" in row:
                    row[f"{key}_tflops"] = flops / (row[f"{key}_ms"] * 1e-3) / 1e12
            for key in ("flex", "sdpa"):
                if f"{key}_ms" in row:
                    row[f"speedup_vs_{key}"] = row[f"{key}_ms"] / row["ours_ms"]
            results["rows"].append(row)
            print(json.dumps(row), flush=True)
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
            torch.cuda.empty_cache()
    print(f"{'dtype':9}{'case':15}{'ours TF/s':>10}{'flex TF/s':>10}{'SDPA TF/s':>10}"
          f"{'x flex':>8}{'x SDPA':>8}{'|ours-flex|':>12}")
    for r in results["rows"]:
        print(f"{r['dtype']:9}{r['case']:15}{r['ours_tflops']:10.1f}{r['flex_tflops']:10.1f}"
              f"{r.get('sdpa_tflops', float('nan')):10.1f}{r['speedup_vs_flex']:8.2f}"
              f"{r.get('speedup_vs_sdpa', float('nan')):8.2f}{r['max_abs_diff_vs_flex']:12.2e}")
    return results


def main(argv=None):
    from bench_masks import add_problem_args

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_problem_args(p)
    p.add_argument("--no-sdpa", action="store_true")
    p.add_argument("--json", default="bench_score_mod.json")
    p.add_argument("--check-cpu", action="store_true",
                   help="no GPU: check that the three forms of every case agree, then stop")
    args = p.parse_args(argv)
    if args.heads > len(SLOPES):
        p.error(f"--heads must be at most {len(SLOPES)} (the relative bias's slopes)")
    if args.check_cpu:
        return check_cpu()
    bench(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
