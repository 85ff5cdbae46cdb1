"""Study 2: error against logit scale.

Scores are scaled so that the largest |score| is X, for X from 1 to 1e4, in two scenarios:
"centred" (scores in [-X, X]: a softmax without max subtraction overflows once exp(X) exceeds
the dtype's range) and "shifted" (every score lowered by 2X, through one extra coordinate of q
and k: softmax does not change, but a softmax without max subtraction underflows to 0 / 0). The
online softmax, a naive softmax (no max subtraction) and a safe naive softmax (max subtracted)
are compared with exact float64 attention.
"""
from __future__ import annotations

import math

import numpy as np

from numba_flash_reference import attention, online_attention, round_to

from ._numerics import error_stats, naive_attention, short
from ._output import new_figure, progress as _progress

TITLE = "Study 2: error against logit scale"

DTYPES = ("float16", "bfloat16", "float32")
SCENARIOS = ("centred", "shifted")
# method -> (plot label, line style)
METHODS = {"naive": ("naive (no max subtraction)", ":"),
           "safe": ("safe naive (max subtracted)", "--"),
           "online": ("online, same-dtype acc", "-"), "online_fp32": ("online, fp32 acc", "-."),
           "gpu": ("GPU kernel", (0, (1, 3)))}

CONFIGS = {
    "full": {"scales": [float(x) for x in np.logspace(0, 4, 17)], "seqlen": 2048, "rows": 256,
             "head_dim": 64, "block_n": 64, "seed": 2},
    "tiny": {"scales": [1.0, 30.0, 1000.0, 10000.0], "seqlen": 256, "rows": 16, "head_dim": 64,
             "block_n": 64, "seed": 2},
}


def _inputs(rng, cfg):
    """Standard-normal q (rows, D-1), k (N, D-1), v (N, D) and M = max |q . k|."""
    d, n, r = cfg["head_dim"], cfg["seqlen"], cfg["rows"]
    q, k, v = rng.standard_normal((r, d - 1)), rng.standard_normal((n, d - 1)), \
        rng.standard_normal((n, d))
    return q, k, v, float(np.abs(q @ k.T).max())


def _augment(q, k, v, shift_coord, dtype):
    """q, k with one extra coordinate (q: shift_coord, k: 1) adding shift_coord * scale to every
    score; all three rounded to ``dtype``, shaped (1, S, 1, D)."""
    qa = np.concatenate([q, np.full((q.shape[0], 1), shift_coord)], axis=1)
    ka = np.concatenate([k, np.ones((k.shape[0], 1))], axis=1)
    return tuple(round_to(x, dtype)[None, :, None, :] for x in (qa, ka, v))


def compute(cfg, *, gpu, progress=True):
    """Run the study; returns (rows, headline, summary lines). See module docstring."""
    rng = np.random.default_rng(cfg["seed"])
    q0, k0, v0, big = _inputs(rng, cfg)
    rows, gpu_failures = [], {}
    jobs = [(x, sc, dt) for x in cfg["scales"] for sc in SCENARIOS for dt in DTYPES]
    for x, scenario, dtype in _progress(jobs, desc="logit_scale", enabled=progress):
        scale = x / big
        coord = 0.0 if scenario == "centred" else -2.0 * big
        q, k, v = _augment(q0, k0, v0, coord, dtype)
        exact = attention(q, k, v, softmax_scale=scale)
        common = {"scenario": scenario, "max_score": x, "dtype": dtype}
        outs = {
            "naive": naive_attention(q, k, v, dtype=dtype, softmax_scale=scale, subtract_max=False),
            "safe": naive_attention(q, k, v, dtype=dtype, softmax_scale=scale),
            "online": online_attention(q, k, v, softmax_scale=scale, accum_dtype=dtype,
                                       block_m=cfg["rows"], block_n=cfg["block_n"]),
        }
        if dtype != "float32":
            outs["online_fp32"] = round_to(online_attention(
                q, k, v, softmax_scale=scale, accum_dtype="float32", p_dtype=dtype,
                block_m=cfg["rows"], block_n=cfg["block_n"]), dtype)
        if gpu.enabled and dtype not in gpu_failures:
            try:
                outs["gpu"] = gpu.attention(q, k, v, dtype, softmax_scale=scale)
            except Exception as exc:
                gpu_failures[dtype] = f"{type(exc).__name__}: {exc}"
        for method, out in outs.items():
            rows.append({**common, "method": method, **error_stats(out, exact)})
    return rows, _headline(rows, cfg), _summary(rows, cfg, gpu_failures)


def _pick(rows, **want):
    return [r for r in rows if all(r[k] == v for k, v in want.items())]


def _first_failure(rows, **want):
    """Smallest max_score with a non-finite row, or inf if none."""
    bad = [r["max_score"] for r in _pick(rows, **want) if r["nonfinite"] > 0]
    return min(bad) if bad else math.inf


def _worst(rows, **want):
    return max(r["max_rel"] for r in _pick(rows, **want))


def _headline(rows, cfg):
    h = {}
    for dt in DTYPES:
        s = short(dt)
        for sc in SCENARIOS:
            h[f"naive_{s}_{sc}_first_nonfinite"] = _first_failure(rows, dtype=dt, scenario=sc,
                                                                  method="naive")
            for m in ("online", "safe", "online_fp32"):
                if m == "online_fp32" and dt == "float32":
                    continue
                h[f"{m}_{s}_{sc}_worst"] = _worst(rows, dtype=dt, scenario=sc, method=m)
                h[f"{m}_{s}_{sc}_nonfinite"] = max(r["nonfinite"] for r in _pick(
                    rows, dtype=dt, scenario=sc, method=m))
    return h


def _summary(rows, cfg, gpu_failures):
    h = _headline(rows, cfg)
    lines = ["Question: where does a naive softmax overflow or underflow as the logits grow, and "
             "does the online softmax stay finite and accurate there?",
             f"Method: {cfg['rows']} random query rows, {cfg['seqlen']} keys, D={cfg['head_dim']}; "
             "the scale is set so the largest |score| is X (X = "
             f"{min(cfg['scales']):g}..{max(cfg['scales']):g}). 'centred': scores in [-X, X]; "
             "'shifted': every score lowered by 2X through an extra coordinate of q and k (the "
             "exact output is unchanged). Naive = materialised softmax without max subtraction, "
             "safe = with it, both rounding every array to the dtype; online = the kernel "
             "algorithm with same-dtype or fp32 accumulators. Error: max over rows of the "
             "row-wise relative 2-norm error against exact float64.", ""]
    lines.append(f"{'dtype':<6}{'naive first inf/NaN':>21}{'(shifted)':>11}"
                 f"{'online worst':>14}{'(shifted)':>11}{'fp32-acc worst':>16}{'(shifted)':>11}"
                 f"{'safe worst':>12}")
    for dt in DTYPES:
        s = short(dt)
        f32 = (f"{h[f'online_fp32_{s}_centred_worst']:>16.3g}"
               f"{h[f'online_fp32_{s}_shifted_worst']:>11.3g}") if dt != "float32" else \
            f"{'-':>16}{'-':>11}"
        lines.append(f"{s:<6}{h[f'naive_{s}_centred_first_nonfinite']:>21g}"
                     f"{h[f'naive_{s}_shifted_first_nonfinite']:>11g}"
                     f"{h[f'online_{s}_centred_worst']:>14.3g}"
                     f"{h[f'online_{s}_shifted_worst']:>11.3g}{f32}"
                     f"{max(h[f'safe_{s}_centred_worst'], h[f'safe_{s}_shifted_worst']):>12.3g}")
    finite = all(h[f"{m}_{short(dt)}_{sc}_nonfinite"] == 0 for dt in DTYPES for sc in SCENARIOS
                 for m in ("online", "safe"))
    lines += ["", "Online and safe naive results " + ("are finite at every scale." if finite else
                                                        "are NOT finite at some scale (see CSV).")]
    lines.append("Thresholds: exp overflows above ln(max) = 11.09 (fp16), 88.72 (fp32, bf16); "
                 "it underflows to 0 below about -17.3 (fp16) and -103.3 (fp32, bf16 -92.0, "
                 "subnormals included).")
    for dtype, why in gpu_failures.items():
        lines.append(f"GPU {short(dtype)} not measured: {why}")
    return lines


def plot(rows, cfg):
    """Max relative error against the largest |score|, one panel per scenario; inf/NaN results
    are drawn as crosses on the top edge."""
    fig, axes = new_figure(2, height=4.3)
    colors = {"float16": "C0", "bfloat16": "C1", "float32": "C2"}
    tops = {"float16": 20.0, "bfloat16": 60.0, "float32": 180.0}
    for ax, scenario in zip(axes, SCENARIOS):
        for dt in DTYPES:
            for method, (label, style) in METHODS.items():
                if method == "safe":  # on top of the same-dtype online curve; see the CSV
                    continue
                sel = sorted(_pick(rows, dtype=dt, scenario=scenario, method=method),
                             key=lambda r: r["max_score"])
                if not sel:
                    continue
                x = np.array([r["max_score"] for r in sel])
                err = np.array([r["max_rel"] for r in sel])
                ok = np.isfinite(err)
                ax.loglog(x[ok], np.maximum(err[ok], 1e-9), linestyle=style, marker=".",
                          color=colors[dt], label=f"{short(dt)} {label}" if ax is axes[0] else None)
                if (~ok).any():
                    ax.plot(x[~ok], np.full((~ok).sum(), tops[dt]), "x", color=colors[dt], ms=6)
        ax.axhline(10.0, color="0.6", lw=0.6)
        ax.text(1.05, 12.0, "x: naive output inf / NaN", fontsize=7, color="0.3")
        for thr, name in ((11.09, "fp16 exp overflow"), (88.72, "fp32/bf16 overflow")):
            if scenario == "centred":
                ax.axvline(thr, color="0.7", lw=0.8, ls="--")
                ax.text(thr * 1.05, 1e-8, name, rotation=90, fontsize=6, color="0.4")
        ax.set_ylim(1e-9, 600)
        ax.set_xlabel("largest |score| X")
        ax.set_ylabel("max relative error")
        ax.set_title("scores in [-X, X]" if scenario == "centred" else
                     "scores shifted by -2X (exact softmax unchanged)")
        ax.grid(True, alpha=0.3)
    fig.legend(loc="outside lower center", ncol=4, fontsize=7)
    return fig
