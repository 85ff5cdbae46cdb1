"""Study 1: error against sequence length.

For seqlen_k from 256 to 65536, a few hundred random query rows attend to all keys (no mask,
B = H = 1, D = 64). Each precision setting (input dtype, accumulator dtype) runs the online
softmax emulation and, for same-dtype settings, a naive materialised softmax in that dtype;
both are compared with exact float64 attention on the same (rounded) inputs.
"""
from __future__ import annotations

import numpy as np

from numba_flash_reference import attention, online_attention, round_to

from ._numerics import error_stats, naive_attention, short
from ._output import new_figure, progress as _progress

TITLE = "Study 1: error against sequence length"

#: (input dtype, accumulator dtype); P is rounded to the input dtype for the PV product.
SETTINGS = [("float16", "float16"), ("bfloat16", "bfloat16"), ("float32", "float32"),
            ("float16", "float32"), ("bfloat16", "float32")]

CONFIGS = {
    "full": {"seqlens": [256 << i for i in range(9)], "rows": 256, "head_dim": 64,
             "block_n": 64, "seed": 1},
    "tiny": {"seqlens": [256, 1024, 4096], "rows": 16, "head_dim": 64, "block_n": 64, "seed": 1},
}


def _label(in_dtype, accum):
    return f"{short(in_dtype)} in / {short(accum)} acc"


def compute(cfg, *, gpu, progress=True):
    """Run the study; returns (rows, headline, summary lines). See module docstring."""
    rng = np.random.default_rng(cfg["seed"])
    rows, d = [], cfg["head_dim"]
    gpu_failures = {}
    for n in _progress(cfg["seqlens"], desc="seqlen", enabled=progress):
        base = [rng.standard_normal(shape) for shape in
                ((1, cfg["rows"], 1, d), (1, n, 1, d), (1, n, 1, d))]
        for in_dtype in ("float16", "bfloat16", "float32"):
            q, k, v = (round_to(x, in_dtype) for x in base)
            exact = attention(q, k, v)
            for s_in, accum in SETTINGS:
                if s_in != in_dtype:
                    continue
                # A kernel stores its output in the input dtype: round the result to it.
                out = round_to(online_attention(q, k, v, accum_dtype=accum, p_dtype=in_dtype,
                                                block_m=cfg["rows"], block_n=cfg["block_n"]),
                               in_dtype)
                rows.append({"seqlen": n, "in_dtype": in_dtype, "accum_dtype": accum,
                             "method": "online", **error_stats(out, exact)})
            out = naive_attention(q, k, v, dtype=in_dtype)
            rows.append({"seqlen": n, "in_dtype": in_dtype, "accum_dtype": in_dtype,
                         "method": "naive", **error_stats(out, exact)})
            if gpu.enabled and in_dtype not in gpu_failures:
                try:
                    out = gpu.attention(q, k, v, in_dtype)
                    rows.append({"seqlen": n, "in_dtype": in_dtype, "accum_dtype": "float32",
                                 "method": "gpu", **error_stats(out, exact)})
                except Exception as exc:  # a dtype the kernels do not take: say so, go on
                    gpu_failures[in_dtype] = f"{type(exc).__name__}: {exc}"
    return rows, _headline(rows, cfg), _summary(rows, cfg, gpu_failures)


def _pick(rows, **want):
    return [r for r in rows if all(r[k] == v for k, v in want.items())]


def _series(rows, key, **want):
    sel = sorted(_pick(rows, **want), key=lambda r: r["seqlen"])
    return np.array([r["seqlen"] for r in sel]), np.array([r[key] for r in sel])


def _growth(n, err):
    """Slope of log(err) against log(n): 0.5 is a random walk, 1 a systematic drift."""
    ok = np.isfinite(err) & (err > 0)
    if ok.sum() < 2:
        return float("nan")
    return float(np.polyfit(np.log(n[ok]), np.log(err[ok]), 1)[0])


def _headline(rows, cfg):
    h = {}
    n_max = max(cfg["seqlens"])
    for in_dtype, accum in SETTINGS:
        n, err = _series(rows, "max_rel", in_dtype=in_dtype, accum_dtype=accum, method="online")
        tag = f"online_{short(in_dtype)}_{short(accum)}"
        h[f"{tag}_max_at_longest"] = float(err[n == n_max][0])
        h[f"{tag}_slope"] = _growth(n, err)
        h[f"{tag}_all_finite"] = float(np.isfinite(err).all())
    for in_dtype in ("float16", "bfloat16", "float32"):
        n, err = _series(rows, "max_rel", in_dtype=in_dtype, method="naive")
        h[f"naive_{short(in_dtype)}_max_at_longest"] = float(err[n == n_max][0])
        h[f"naive_{short(in_dtype)}_slope"] = _growth(n, err)
    return h


def _summary(rows, cfg, gpu_failures):
    n_min, n_max = min(cfg["seqlens"]), max(cfg["seqlens"])
    lines = ["Question: how does the error of the online softmax grow with the sequence length, "
             "per precision, and how does it compare with a naive softmax in the same dtype?",
             f"Method: {cfg['rows']} random query rows against seqlen_k = {n_min}..{n_max} random "
             f"keys (standard normal q, k, v, D={cfg['head_dim']}, no mask), block_n="
             f"{cfg['block_n']}; error = per-row ||o - o_exact||_2 / ||o_exact||_2 against exact "
             "float64 attention on the same rounded inputs; max and mean over rows. P is rounded "
             "to the input dtype before PV and the output is stored in the input dtype, as a "
             "kernel does; the naive softmax rounds every intermediate array to its dtype.",
             "", f"{'setting':<24}{'max rel err @' + str(n_min):>18}{'@' + str(n_max):>12}"
             f"{'mean @' + str(n_max):>14}{'slope':>8}"]
    for method in ("online", "naive", "gpu"):
        for in_dtype, accum in SETTINGS + [("float16", "float16")]:
            sel = _pick(rows, in_dtype=in_dtype, accum_dtype=accum, method=method)
            if not sel or (method != "online" and in_dtype != accum and method != "gpu"):
                continue
            if method == "gpu" and accum != "float32":
                continue
            by_n = {r["seqlen"]: r for r in sel}
            n, err = _series(rows, "max_rel", in_dtype=in_dtype, accum_dtype=accum, method=method)
            label = f"{method} {_label(in_dtype, accum)}" if method != "naive" else \
                f"naive {short(in_dtype)}"
            line = (f"{label:<24}{by_n[n_min]['max_rel']:>18.3g}{by_n[n_max]['max_rel']:>12.3g}"
                    f"{by_n[n_max]['mean_rel']:>14.3g}{_growth(n, err):>8.2f}")
            if line not in lines:
                lines.append(line)
    lines += ["", "(slope: fitted exponent of max rel err against seqlen_k; 0.5 = random-walk "
              "growth, 1 = linear.)"]
    for dtype, why in gpu_failures.items():
        lines.append(f"GPU {short(dtype)} not measured: {why}")
    return lines


def plot(rows, cfg):
    """Max and mean relative error against seqlen_k; one line per setting."""
    fig, axes = new_figure(2)
    colors = {"float16": "C0", "bfloat16": "C1", "float32": "C2"}
    for ax, key in zip(axes, ("max_rel", "mean_rel")):
        for in_dtype, accum in SETTINGS:
            n, err = _series(rows, key, in_dtype=in_dtype, accum_dtype=accum, method="online")
            style = "-" if in_dtype == accum else "-."
            ax.loglog(n, err, style, marker="o", ms=3, color=colors[in_dtype],
                      label=f"online {_label(in_dtype, accum)}")
        for in_dtype in colors:
            n, err = _series(rows, key, in_dtype=in_dtype, method="naive")
            ax.loglog(n, err, ":", marker="s", ms=3, color=colors[in_dtype],
                      label=f"naive {short(in_dtype)}")
            n, err = _series(rows, key, in_dtype=in_dtype, method="gpu")
            if n.size:
                ax.loglog(n, err, "--", marker="^", ms=4, color=colors[in_dtype],
                          label=f"GPU kernel {short(in_dtype)}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("seqlen_k")
        ax.set_ylabel(("max" if key == "max_rel" else "mean") + " relative error (row 2-norm)")
        ax.grid(True, which="major", alpha=0.3)
    axes[0].set_title("worst row")
    axes[1].set_title("mean over rows")
    axes[1].legend(fontsize=7, loc="best")
    return fig
