"""Study 7: precision of P in the PV product.

A tensor-core kernel computes p = exp(s - m) in fp32, then rounds P to fp16 or bf16 to feed
the PV matrix product (the row sum l keeps the fp32 p). fp16 has 3 more significand bits than
bf16 but underflows below 2^-14 (subnormals down to 2^-24), where bf16 keeps fp32's range. The
online softmax emulation runs with fp32 accumulators and fp32 inputs, only P's precision
changing, against the spread of the scores and the sequence length, and in a worst case for
fp16's range: one dominant key g above all others, which are tied (so their P values, all
exp(-g), round the same way, and the values share a mean, so the errors add up), with the
dominant key first or last in the key order.
"""
from __future__ import annotations

import numpy as np

from numba_flash_reference import attention, online_attention, round_to

from ._numerics import error_stats, random_qkv, short
from ._output import new_figure, progress as _progress

TITLE = "Study 7: precision of P in the PV product"

P_DTYPES = ("float16", "bfloat16", "float32")
FP16_MIN_NORMAL = 2.0 ** -14

CONFIGS = {
    "full": {"spreads": [0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0], "seqlen": 4096,
             "seqlens": [256 << i for i in range(8)], "spread_for_seqlens": 1.0,
             "gaps": [float(g) for g in range(0, 26, 2)], "seqlen_gap": 32768, "rows": 256,
             "head_dim": 64, "block_n": 64, "seed": 7},
    "tiny": {"spreads": [0.5, 4.0, 16.0], "seqlen": 512, "seqlens": [256, 1024],
             "spread_for_seqlens": 1.0, "gaps": [4.0, 12.0, 16.0], "seqlen_gap": 4096, "rows": 16,
             "head_dim": 64, "block_n": 64, "seed": 7},
}


AXES = ("spread", "seqlen", "dominant-first", "dominant-last")


def dominant_inputs(rng, rows, seqlen, head_dim, gap, first):
    """Inputs whose scores (at scale 1/sqrt(head_dim)) are exactly 0 for every key but one,
    which scores ``gap``: q = e_last, keys random except their last coordinate (0, or
    gap * sqrt(head_dim) for the dominant key at position 0 or seqlen-1), values 1 + N(0, 1).
    float32 values, shapes (1, S, 1, D)."""
    q = np.zeros((1, rows, 1, head_dim))
    q[..., -1] = 1.0
    k = rng.standard_normal((1, seqlen, 1, head_dim))
    k[..., -1] = 0.0
    k[0, 0 if first else seqlen - 1, 0, -1] = gap * np.sqrt(head_dim)
    # values with a common mean: the tied keys' P errors add up instead of cancelling
    v = 1.0 + rng.standard_normal((1, seqlen, 1, head_dim))
    return tuple(round_to(x, "float32") for x in (q, k, v))


def _p_stats(q, k, spread_scale):
    """Fraction of the weights exp(s - rowmax) below fp16's smallest normal, and the share of
    the softmax mass they carry (means over rows)."""
    s = spread_scale * (q[0, :, 0] @ k[0, :, 0].T)
    w = np.exp(s - s.max(axis=1, keepdims=True))
    small = w < FP16_MIN_NORMAL
    return {"fp16_subnormal_frac": float(small.mean()),
            "fp16_subnormal_mass": float(((w * small).sum(axis=1) / w.sum(axis=1)).mean())}


def _run(q, k, v, scale, cfg, exact, gpu, gpu_failures):
    out = []
    for p in P_DTYPES:
        o = online_attention(q, k, v, softmax_scale=scale, accum_dtype="float32", p_dtype=p,
                             block_m=cfg["rows"], block_n=cfg["block_n"])
        out.append({"p_dtype": p, "method": "online", **error_stats(o, exact)})
    for dt in ("float16", "bfloat16"):
        floor = error_stats(round_to(exact, dt), exact)["max_rel"]
        out.append({"p_dtype": dt, "method": "store floor", "max_rel": floor,
                    "mean_rel": float("nan"), "nonfinite": 0.0})
    if gpu.enabled:
        for dt in ("float16", "bfloat16"):
            if dt in gpu_failures:
                continue
            try:
                qg, kg, vg = (round_to(x, dt) for x in (q, k, v))
                ex = attention(qg, kg, vg, softmax_scale=scale)
                o = gpu.attention(qg, kg, vg, dt, softmax_scale=scale)
                out.append({"p_dtype": dt, "method": "gpu kernel", **error_stats(o, ex)})
            except Exception as exc:
                gpu_failures[dt] = f"{type(exc).__name__}: {exc}"
    return out


def compute(cfg, *, gpu, progress=True):
    """Run the study; returns (rows, headline, summary lines). See module docstring."""
    rng = np.random.default_rng(cfg["seed"])
    d = cfg["head_dim"]
    rows, gpu_failures = [], {}
    jobs = [("spread", s, cfg["seqlen"]) for s in cfg["spreads"]] + \
        [("seqlen", cfg["spread_for_seqlens"], n) for n in cfg["seqlens"]] + \
        [(a, g, cfg["seqlen_gap"]) for a in AXES[2:] for g in cfg["gaps"]]
    for axis, x, n in _progress(jobs, desc="p_precision", enabled=progress):
        if axis.startswith("dominant"):
            q, k, v = dominant_inputs(rng, 8, n, d, x, axis == "dominant-first")
            scale = 1.0 / np.sqrt(d)
        else:
            q, k, v = random_qkv(rng, cfg["rows"], n, d, "float32")
            # q . k of standard-normal vectors has std sqrt(d): this scale gives scores of std x
            scale = x / np.sqrt(d)
        exact = attention(q, k, v, softmax_scale=scale)
        common = {"axis": axis, "spread": x, "seqlen": n, **_p_stats(q, k, scale)}
        for r in _run(q, k, v, scale, cfg, exact, gpu, gpu_failures):
            rows.append({**common, **r})
    return rows, _headline(rows, cfg), _summary(rows, cfg, gpu_failures)


def _series(rows, axis, p_dtype, method, key="max_rel"):
    xkey = "seqlen" if axis == "seqlen" else "spread"
    sel = sorted((r for r in rows if r["axis"] == axis and r["p_dtype"] == p_dtype
                  and r["method"] == method), key=lambda r: r[xkey])
    return np.array([r[xkey] for r in sel]), np.array([r[key] for r in sel])


def _headline(rows, cfg):
    h = {}
    for axis in AXES:
        x, e16 = _series(rows, axis, "float16", "online")
        _, ebf = _series(rows, axis, "bfloat16", "online")
        _, e32 = _series(rows, axis, "float32", "online")
        h[f"{axis}_bf16_over_fp16_min"] = float((ebf / e16).min())
        h[f"{axis}_bf16_over_fp16_max"] = float((ebf / e16).max())
        h[f"{axis}_fp16_worst"] = float(e16.max())
        h[f"{axis}_bf16_worst"] = float(ebf.max())
        h[f"{axis}_fp32_worst"] = float(e32.max())
        _, f16 = _series(rows, axis, "float16", "store floor")
        _, fbf = _series(rows, axis, "bfloat16", "store floor")
        h[f"{axis}_fp16_over_floor_max"] = float((e16 / f16).max())
        h[f"{axis}_bf16_over_floor_max"] = float((ebf / fbf).max())
    return h


def _summary(rows, cfg, gpu_failures):
    h = _headline(rows, cfg)
    lines = ["Question: how much accuracy does rounding P to fp16 or bf16 for the PV product "
             "cost, against fp32 P, and when does fp16's narrow range matter?",
             f"Method: {cfg['rows']} random query rows, D={cfg['head_dim']}, fp32 inputs, fp32 "
             "accumulators and output; only P's precision changes. Scores have standard "
             f"deviation 'spread' ({min(cfg['spreads']):g}..{max(cfg['spreads']):g} at "
             f"{cfg['seqlen']} keys), and the sequence length runs over "
             f"{min(cfg['seqlens'])}..{max(cfg['seqlens'])} at spread "
             f"{cfg['spread_for_seqlens']:g}. Error against exact float64; 'store floor' is the "
             "error of the exact output merely rounded to fp16 / bf16.", ""]
    for axis, xname in (("spread", "spread"), ("seqlen", "seqlen_k"), ("dominant-first", "gap g"),
                        ("dominant-last", "gap g")):
        if axis.startswith("dominant"):
            lines.append(f"One dominant key scoring g above {cfg['seqlen_gap'] - 1} tied keys, "
                         f"placed {axis.split('-')[1]} in the key order:")
        x, e16 = _series(rows, axis, "float16", "online")
        _, ebf = _series(rows, axis, "bfloat16", "online")
        _, e32 = _series(rows, axis, "float32", "online")
        _, sub = _series(rows, axis, "float16", "online", "fp16_subnormal_frac")
        _, mass = _series(rows, axis, "float16", "online", "fp16_subnormal_mass")
        lines.append(f"{xname:>9}{'fp16 P':>11}{'bf16 P':>11}{'fp32 P':>11}{'bf16/fp16':>11}"
                     f"{'P<2^-14 frac':>14}{'their mass':>12}")
        for i in range(x.size):
            lines.append(f"{x[i]:>9g}{e16[i]:>11.3g}{ebf[i]:>11.3g}{e32[i]:>11.3g}"
                         f"{ebf[i] / e16[i]:>11.2f}{sub[i]:>14.3f}{mass[i]:>12.2g}")
        lines.append("")
    _, f16 = _series(rows, "spread", "float16", "store floor")
    _, fbf = _series(rows, "spread", "bfloat16", "store floor")
    lines.append(f"Store floors (spread axis, max over rows): fp16 {f16.min():.3g}..{f16.max():.3g}"
                 f", bf16 {fbf.min():.3g}..{fbf.max():.3g}. The P error is at most "
                 f"{h['spread_fp16_over_floor_max']:.2f}x (fp16 P) and "
                 f"{h['spread_bf16_over_floor_max']:.2f}x (bf16 P) the floor of storing the output "
                 "in that dtype.")
    lines.append(f"Tied keys, dominant key first: worst error fp16 P "
                 f"{h['dominant-first_fp16_worst']:.3g}, bf16 P "
                 f"{h['dominant-first_bf16_worst']:.3g} "
                 f"(bf16/fp16 from {h['dominant-first_bf16_over_fp16_min']:.2f} to "
                 f"{h['dominant-first_bf16_over_fp16_max']:.2f}); dominant key last: fp16 P "
                 f"{h['dominant-last_fp16_worst']:.3g}, bf16 P "
                 f"{h['dominant-last_bf16_worst']:.3g}.")
    for dtype, why in gpu_failures.items():
        lines.append(f"GPU {short(dtype)} not measured: {why}")
    return lines


def plot(rows, cfg):
    """Max error against the score spread and against seqlen_k, per P precision, with the
    output-storage floors."""
    fig, axes = new_figure(3, width=4.2)
    colors = {"float16": "C0", "bfloat16": "C1", "float32": "C2"}
    for p in P_DTYPES:
        for axis, style in (("dominant-first", "-o"), ("dominant-last", "--s")):
            x, err = _series(rows, axis, p, "online")
            axes[2].semilogy(x, np.maximum(err, 1e-9), style, ms=3, color=colors[p],
                             label=f"{short(p)} P, dominant {axis.split('-')[1]}")
    x, err = _series(rows, "dominant-first", "float16", "store floor")
    axes[2].semilogy(x, err, ":", color=colors["float16"], label="output stored in fp16")
    axes[2].set_xlabel("gap g of the dominant key over the tied keys")
    axes[2].set_title(f"worst case: {cfg['seqlen_gap']} tied keys + 1 dominant", fontsize=10)
    axes[2].grid(True, alpha=0.3)
    axes[2].set_ylim(1e-12, 1e-2)  # room for the legend below the data
    axes[2].legend(fontsize=6.5, loc="lower left")
    for ax, axis in zip(axes, ("spread", "seqlen")):
        for p in P_DTYPES:
            x, err = _series(rows, axis, p, "online")
            ax.loglog(x, err, "-o", ms=3, color=colors[p], label=f"{short(p)} P")
        for p in ("float16", "bfloat16"):
            x, err = _series(rows, axis, p, "store floor")
            ax.loglog(x, err, ":", color=colors[p], label=f"output stored in {short(p)}")
            x, err = _series(rows, axis, p, "gpu kernel")
            if x.size:
                ax.loglog(x, err, "--^", ms=4, color=colors[p], label=f"GPU kernel, {short(p)}")
        ax.grid(True, alpha=0.3)
        ax.set_ylabel("max relative error")
    axes[0].set_xlabel("score standard deviation (spread)")
    axes[0].set_title(f"random scores, {cfg['seqlen']} keys", fontsize=10)
    axes[1].set_xscale("log", base=2)
    axes[1].set_xlabel("seqlen_k")
    axes[1].set_title(f"random scores, spread {cfg['spread_for_seqlens']:g}", fontsize=10)
    axes[0].legend(fontsize=7)
    return fig
