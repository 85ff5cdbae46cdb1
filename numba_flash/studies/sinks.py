"""Study 6: does processing attention-sink tokens first stabilise the online softmax?

Seed 000 claims that visiting the sink tokens first "stabilises the online softmax". Here a
StreamingLLM mask (causal sliding window of W keys plus S sink keys at positions 0..S-1) is
given sink logits Delta above the rest (massive activations), and the key tiles are visited
  * sink-first: ascending positions, which is also the natural order of a kernel walking the
    key tiles upwards, and the order of seed 000's phases (sinks, window, diagonal);
  * sink-last: the window tiles ascending, then the sink tile;
  * reverse: descending positions (flash-attn 2's loop from the diagonal back): sinks last.
With the sinks first, the running max is right from the start (no rescaling), and every window
tile adds small values to large l and acc. With the sinks last, the window accumulates at its
own scale and is then multiplied once by a tiny alpha = exp(m_window - m_sink). The study
measures which is more accurate, under fp16 / bf16 / fp32 accumulators.
"""
from __future__ import annotations

import numpy as np

from numba_flash_reference import attention, online_attention, round_to, split_attention
from numba_flash_reference.masks import visible_matrix

from ._numerics import error_stats, short
from ._output import new_figure, progress as _progress

TITLE = "Study 6: attention sinks, first or last"

#: (input dtype = P dtype, accumulator dtype)
SETTINGS = [("float16", "float16"), ("bfloat16", "bfloat16"), ("float16", "float32"),
            ("bfloat16", "float32"), ("float32", "float32")]
ORDERS = ("sink-first", "sink-last", "reverse")
FP16_MIN_NORMAL = 2.0 ** -14

CONFIGS = {
    "full": {"deltas": [float(d) for d in range(0, 26, 2)], "sinks": 4, "window": 4096,
             "rows": 256, "head_dim": 64, "block_m": 64, "block_n": 64, "seed": 6},
    "tiny": {"deltas": [0.0, 8.0, 10.0], "sinks": 4, "window": 2048, "rows": 16,
             "head_dim": 64, "block_m": 16, "block_n": 64, "seed": 6},
}


def _label(in_dtype, accum):
    return f"{short(in_dtype)} in+P / {short(accum)} acc"


def _tile_order(name):
    if name == "sink-first":
        return None
    if name == "reverse":
        return "reverse"
    return lambda i, n_k: np.r_[1:n_k, 0]  # sink tile (tile 0) last


def layout(cfg) -> dict:
    """Sequence lengths and mask flags: the sink tile, a gap of invisible keys, then the window
    of the last ``rows`` queries (their windows end at the last key)."""
    bn = cfg["block_n"]
    seqlen_k = 2 * bn + cfg["window"] + cfg["rows"]
    return {"seqlen_k": seqlen_k, "mask": {"causal": True, "window_size": (cfg["window"] - 1, 0),
                                          "sinks": cfg["sinks"]}}


def make_inputs(base, cfg, delta: float, dtype: str):
    """q, k, v of shape (1, S, 1, D) rounded to ``dtype``: the base draw with one coordinate
    turned into a sink bias (q: 1, sink keys: delta / scale, other keys: 0), so sink scores
    are the usual random scores plus ``delta``."""
    q, k, v = (x.copy() for x in base)
    scale = 1.0 / np.sqrt(cfg["head_dim"])
    q[..., -1] = 1.0
    k[..., -1] = 0.0
    k[:, :cfg["sinks"], :, -1] = delta / scale
    return tuple(round_to(x, dtype) for x in (q, k, v))


def mechanism(q, k, cfg, lay) -> dict:
    """Exact-score diagnostics, means over rows: the fraction of each row's window keys whose
    weight exp(s - m) falls below fp16's smallest normal when m is the row max including the
    sinks (sink-first) or only the window's max (an upper bound for sink-last)."""
    scale = 1.0 / np.sqrt(cfg["head_dim"])
    s = scale * (q[0, :, 0] @ k[0, :, 0].T)
    vis = visible_matrix(cfg["rows"], lay["seqlen_k"], **lay["mask"])
    window = vis.copy()
    window[:, :cfg["sinks"]] = False
    m_all = np.where(vis, s, -np.inf).max(axis=1, keepdims=True)
    m_win = np.where(window, s, -np.inf).max(axis=1, keepdims=True)
    n_win = window.sum(axis=1)
    below_first = ((np.exp(s - m_all) < FP16_MIN_NORMAL) & window).sum(axis=1) / n_win
    below_last = ((np.exp(s - m_win) < FP16_MIN_NORMAL) & window).sum(axis=1) / n_win
    return {"subnormal_first": float(below_first.mean()),
            "subnormal_last": float(below_last.mean())}


def compute(cfg, *, gpu, progress=True):
    """Run the study; returns (rows, headline, summary lines). See module docstring."""
    rng = np.random.default_rng(cfg["seed"])
    lay = layout(cfg)
    d, n = cfg["head_dim"], lay["seqlen_k"]
    base = (rng.standard_normal((1, cfg["rows"], 1, d)), rng.standard_normal((1, n, 1, d)),
            rng.standard_normal((1, n, 1, d)))
    rows, gpu_failures = [], {}
    for delta in _progress(cfg["deltas"], desc="sinks", enabled=progress):
        q64, k64, v64 = make_inputs(base, cfg, delta, "float64")
        # exact share of the attention mass that falls on the window (not the sinks)
        (_, _), (lse_sink, lse_win) = split_attention(q64, k64, v64, [0, cfg["sinks"], n],
                                                      **lay["mask"])
        share = float(np.exp(lse_win - np.logaddexp(lse_sink, lse_win)).mean())
        diag = {"window_share": share, **mechanism(q64, k64, cfg, lay)}
        for in_dtype, accum in SETTINGS:
            q, k, v = make_inputs(base, cfg, delta, in_dtype)
            exact, lse_exact = attention(q, k, v, return_lse=True, **lay["mask"])
            for order in ORDERS:
                out, lse = online_attention(q, k, v, accum_dtype=accum, p_dtype=in_dtype,
                                            block_m=cfg["block_m"], block_n=cfg["block_n"],
                                            tile_order=_tile_order(order), return_lse=True,
                                            **lay["mask"])
                rows.append({"delta": delta, "in_dtype": in_dtype, "accum_dtype": accum,
                             "order": order, **error_stats(round_to(out, in_dtype), exact),
                             "lse_max_abs": float(np.abs(lse - lse_exact).max()), **diag})
            if gpu.enabled and accum == "float32" and in_dtype not in gpu_failures:
                try:
                    out = gpu.attention(q, k, v, in_dtype, **lay["mask"])
                    rows.append({"delta": delta, "in_dtype": in_dtype, "accum_dtype": accum,
                                 "order": "gpu kernel", **error_stats(out, exact),
                                 "lse_max_abs": float("nan"), **diag})
                except Exception as exc:
                    gpu_failures[in_dtype] = f"{type(exc).__name__}: {exc}"
    return rows, _headline(rows, cfg), _summary(rows, cfg, gpu_failures)


def _series(rows, key, in_dtype, accum, order):
    sel = sorted((r for r in rows if r["in_dtype"] == in_dtype and r["accum_dtype"] == accum
                  and r["order"] == order), key=lambda r: r["delta"])
    return np.array([r["delta"] for r in sel]), np.array([r[key] for r in sel])


def _headline(rows, cfg):
    h = {}
    for in_dtype, accum in SETTINGS:
        t = f"{short(in_dtype)}_{short(accum)}"
        deltas, first = _series(rows, "max_rel", in_dtype, accum, "sink-first")
        _, last = _series(rows, "max_rel", in_dtype, accum, "sink-last")
        _, rev = _series(rows, "max_rel", in_dtype, accum, "reverse")
        ratio = first / last
        h[f"{t}_first_worst"] = float(first.max())
        h[f"{t}_last_worst"] = float(last.max())
        h[f"{t}_reverse_worst"] = float(rev.max())
        h[f"{t}_ratio_max"] = float(ratio.max())
        h[f"{t}_ratio_max_delta"] = float(deltas[ratio.argmax()])
        h[f"{t}_ratio_min"] = float(ratio.min())
        h[f"{t}_ratio_geomean"] = float(np.exp(np.log(ratio).mean()))
        _, lf = _series(rows, "lse_max_abs", in_dtype, accum, "sink-first")
        _, ll = _series(rows, "lse_max_abs", in_dtype, accum, "sink-last")
        h[f"{t}_lse_first_worst"] = float(lf.max())
        h[f"{t}_lse_last_worst"] = float(ll.max())
        h[f"{t}_all_finite"] = float(all(
            r["nonfinite"] == 0 for r in rows
            if r["in_dtype"] == in_dtype and r["accum_dtype"] == accum))
    return h


def _summary(rows, cfg, gpu_failures):
    h = _headline(rows, cfg)
    deltas, share = _series(rows, "window_share", *SETTINGS[0], "sink-first")
    _, sub_first = _series(rows, "subnormal_first", *SETTINGS[0], "sink-first")
    _, sub_last = _series(rows, "subnormal_last", *SETTINGS[0], "sink-first")
    lines = ["Question: seed 000 says processing the sink tokens first stabilises the online "
             "softmax. Does the order of the sink tile matter for accuracy, by how much, and why?",
             f"Method: causal sliding window of {cfg['window']} keys plus {cfg['sinks']} sinks "
             f"(StreamingLLM), {cfg['rows']} query rows at the end of a "
             f"{layout(cfg)['seqlen_k']}-key "
             f"sequence, D={cfg['head_dim']}, block_m={cfg['block_m']}, block_n={cfg['block_n']}; "
             "the sink keys' scores are raised by Delta (random scores ~N(0,1) otherwise). "
             "Orders: sink-first (ascending; natural order; seed 000), sink-last (window tiles, "
             "then the sink tile), reverse (descending). Online softmax emulation, P in the "
             "input dtype, output stored in it; error against exact float64.", "",
             f"{'setting':<24}{'worst err: first':>17}{'last':>10}{'reverse':>10}"
             f"{'first/last: max':>17}{'at Delta':>9}{'min':>7}{'geomean':>9}"
             f"{'lse err first':>15}{'last':>9}"]
    for in_dtype, accum in SETTINGS:
        t = f"{short(in_dtype)}_{short(accum)}"
        lines.append(f"{_label(in_dtype, accum):<24}{h[t + '_first_worst']:>17.3g}"
                     f"{h[t + '_last_worst']:>10.3g}{h[t + '_reverse_worst']:>10.3g}"
                     f"{h[t + '_ratio_max']:>17.2f}{h[t + '_ratio_max_delta']:>9g}"
                     f"{h[t + '_ratio_min']:>7.2f}{h[t + '_ratio_geomean']:>9.2f}"
                     f"{h[t + '_lse_first_worst']:>15.2g}{h[t + '_lse_last_worst']:>9.2g}")
    lines += ["(worst: max over Delta of the max row error; first/last: ratio of the sink-first "
              "to the sink-last max error at the same Delta, > 1 means sink-first is less "
              "accurate.)",
              "Every online result is finite: the running max rules out overflow whatever the "
              "order." if all(h[f"{short(a)}_{short(b)}_all_finite"] for a, b in SETTINGS)
              else "Some online results are NOT finite (see CSV).", "",
              "Exact share of the attention mass on the window, by Delta: " + ", ".join(
                  f"{d:g}: {s:.2g}" for d, s in zip(deltas, share)) + ".",
              "Window weights exp(s - m) below fp16's smallest normal (2^-14), mean fraction: "
              "with m = the sink max (sink-first): " + ", ".join(
                  f"{d:g}: {f:.2f}" for d, f in zip(deltas, sub_first)) +
              "; with m = the window max (sink-last): at most " + ", ".join(
                  f"{d:g}: {f:.2f}" for d, f in zip(deltas, sub_last)) + "."]
    for dtype, why in gpu_failures.items():
        lines.append(f"GPU {short(dtype)} not measured: {why}")
    return lines


def plot(rows, cfg):
    """Three panels of max error against Delta per order (fp16, bf16 accumulators; fp16 inputs
    with fp32 accumulators), and one of the sink-first / sink-last error ratio per setting with
    the window's share of the attention mass."""
    fig, axes = new_figure(2, nrows=2, width=4.8, height=3.3)
    panels = [SETTINGS[0], SETTINGS[1], SETTINGS[2]]
    styles = {"sink-first": ("C3", "o", "-"), "sink-last": ("C0", "s", "-"),
              "reverse": ("C2", "x", "--"), "gpu kernel": ("k", "^", ":")}
    for ax, setting in zip(axes, panels):
        for order, (color, marker, line) in styles.items():
            x, err = _series(rows, "max_rel", *setting, order)
            if x.size:
                ax.semilogy(x, err, line, marker=marker, ms=4, color=color, label=order)
        ax.set_title(_label(*setting), fontsize=10)
        ax.set_xlabel("sink logit gap Delta")
        ax.set_ylabel("max relative error")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    ax = axes[3]
    for i, setting in enumerate(SETTINGS):
        x, first = _series(rows, "max_rel", *setting, "sink-first")
        _, last = _series(rows, "max_rel", *setting, "sink-last")
        ax.semilogy(x, first / last, "-", marker=".", color=f"C{i}", label=_label(*setting))
    x, share = _series(rows, "window_share", *SETTINGS[0], "sink-first")
    ax.semilogy(x, share, ":", color="0.3", label="window share of mass (exact)")
    ax.axhline(1.0, color="0.5", lw=0.8)
    ax.set_title("error ratio sink-first / sink-last", fontsize=10)
    ax.set_xlabel("sink logit gap Delta")
    ax.set_ylim(1e-3, None)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=6.5)
    return fig
