"""Study 5: split-KV merge.

Split-KV decoding (FlashDecoding) cuts the keys into n ranges, computes a partial state
(o_i, lse_i) per range and merges them. The partial states here are exact (float64) and are
rounded to the merge precision, so what is measured is the merge itself: stored partials plus
merge arithmetic in fp32, fp16 or bf16, against the number of splits and the merge order
(sequential left to right, a balanced tree, or one flat pass as a combine kernel does).
With a GPU, numba_flash.merge_states (fp32) merges the same partial states, and
numba_flash.decode runs end to end in fp16 with num_splits = n on the first 64 query rows.
"""
from __future__ import annotations

import numpy as np

from numba_flash_reference import Arithmetic, attention, merge_many, round_to, split_attention

from ._numerics import error_stats, random_qkv, short
from ._output import new_figure, progress as _progress

TITLE = "Study 5: split-KV merge"

DTYPES = ("float32", "float16", "bfloat16")
ORDERS = ("sequential", "tree", "flat")
#: Mixed storage: partial outputs in fp16 / bf16, lse and merge arithmetic in fp32.
MIXED = ("float16", "bfloat16")
MIXED_ORDERS = ("sequential", "tree")

CONFIGS = {
    "full": {"splits": [1 << i for i in range(10)], "seqlen": 16384, "rows": 256,
             "head_dim": 64, "seed": 5},
    "tiny": {"splits": [1, 4, 64], "seqlen": 1024, "rows": 16, "head_dim": 64, "seed": 5},
}


def compute(cfg, *, gpu, progress=True):
    """Run the study; returns (rows, headline, summary lines). See module docstring."""
    rng = np.random.default_rng(cfg["seed"])
    q, k, v = random_qkv(rng, cfg["rows"], cfg["seqlen"], cfg["head_dim"])
    exact = attention(q, k, v)
    rows, gpu_failures = [], {}
    for n in _progress(cfg["splits"], desc="split_kv", enabled=progress):
        outs, lses = split_attention(q, k, v, n)
        if gpu.enabled:
            rows += _gpu_rows(gpu, q, k, v, outs, lses, n, exact, gpu_failures)
        for dtype in DTYPES:
            floor = error_stats(round_to(exact, dtype), exact)["max_rel"]
            for order in ORDERS:
                o, _ = merge_many(outs, lses, order=order, dtype=dtype)
                rows.append({"splits": n, "dtype": dtype, "order": order,
                             **error_stats(o, exact), "store_floor": floor})
        for dtype in MIXED:
            floor = error_stats(round_to(exact, dtype), exact)["max_rel"]
            for order in MIXED_ORDERS:
                o = merge_mixed(outs, lses, order=order, o_dtype=dtype)
                rows.append({"splits": n, "dtype": f"{dtype}+fp32lse", "order": order,
                             **error_stats(o, exact), "store_floor": floor})
    return rows, _headline(rows, cfg), _summary(rows, cfg, gpu_failures)


def _gpu_rows(gpu, q, k, v, outs, lses, n, exact, failures):
    """The GPU merge of the exact partial states (fp32) and an fp16 split-KV decode with
    num_splits = n (first 64 query rows, fp16 inputs, against exact attention on them)."""
    rows = []
    if "merge" not in failures:
        try:
            o = gpu.merge_states(outs, lses)
            rows.append({"splits": n, "dtype": "float32", "order": "gpu merge_states",
                         **error_stats(o, exact), "store_floor": float("nan")})
        except Exception as exc:
            failures["merge"] = f"{type(exc).__name__}: {exc}"
    if "decode" not in failures:
        try:
            q16, k16, v16 = (round_to(x, "float16") for x in (q[:, :64], k, v))
            o = gpu.decode(q16, k16, v16, "float16", causal=False, num_splits=n)
            rows.append({"splits": n, "dtype": "float16", "order": "gpu decode",
                         **error_stats(o, attention(q16, k16, v16)),
                         "store_floor": float("nan")})
        except Exception as exc:
            failures["decode"] = f"{type(exc).__name__}: {exc}"
    return rows


def merge_mixed(outs, lses, *, order: str, o_dtype: str) -> np.ndarray:
    """Merge partial states whose outputs are stored in ``o_dtype`` while lse, the weights and
    the products run in float32 (the output of each pairwise merge is stored in ``o_dtype``).

    outs: list of float64 (B, S, H, D); lses: list of float64 (B, H, S). order: "sequential" or
    "tree". Returns the merged output, float64 (B, S, H, D) holding ``o_dtype`` values.
    """
    ar = Arithmetic("float32")

    def pair(a, b):
        (o_a, l_a), (o_b, l_b) = a, b
        big = np.maximum(l_a, l_b)
        w_a, w_b = ar.func(np.exp, ar.sub(l_a, big)), ar.func(np.exp, ar.sub(l_b, big))
        total = ar.add(w_a, w_b)
        f_a = np.swapaxes(ar.div(w_a, total), -1, -2)[..., None]
        f_b = np.swapaxes(ar.div(w_b, total), -1, -2)[..., None]
        o = round_to(ar.add(ar.mul(f_a, o_a), ar.mul(f_b, o_b)), o_dtype)
        return o, ar.add(big, ar.func(np.log, total))

    states = [(round_to(o, o_dtype), ar.round(lse)) for o, lse in zip(outs, lses)]
    with np.errstate(under="ignore"):
        if order == "sequential":
            state = states[0]
            for nxt in states[1:]:
                state = pair(state, nxt)
            return np.asarray(state[0], dtype=np.float64)
        while len(states) > 1:
            merged = [pair(states[i], states[i + 1]) for i in range(0, len(states) - 1, 2)]
            states = merged + ([states[-1]] if len(states) % 2 else [])
    return np.asarray(states[0][0], dtype=np.float64)


def _series(rows, key, dtype, order):
    sel = sorted((r for r in rows if r["dtype"] == dtype and r["order"] == order),
                 key=lambda r: r["splits"])
    return np.array([r["splits"] for r in sel]), np.array([r[key] for r in sel])


def _slope(n, err):
    ok = (n > 1) & (err > 0)
    if ok.sum() < 2:
        return float("nan")
    return float(np.polyfit(np.log(n[ok]), np.log(err[ok]), 1)[0])


def _headline(rows, cfg):
    h, n_max = {}, max(cfg["splits"])
    for dt in DTYPES:
        for order in ORDERS:
            n, err = _series(rows, "max_rel", dt, order)
            h[f"{short(dt)}_{order}_at_max"] = float(err[n == n_max][0])
            h[f"{short(dt)}_{order}_at_1"] = float(err[n == 1][0])
            h[f"{short(dt)}_{order}_slope"] = _slope(n, err)
            _, mean = _series(rows, "mean_rel", dt, order)
            h[f"{short(dt)}_{order}_mean_at_max"] = float(mean[n == n_max][0])
        h[f"{short(dt)}_seq_over_tree"] = h[f"{short(dt)}_sequential_at_max"] / \
            h[f"{short(dt)}_tree_at_max"]
        h[f"{short(dt)}_floor"] = float(_series(rows, "store_floor", dt, "tree")[1][0])
    for dt in MIXED:
        for order in MIXED_ORDERS:
            n, err = _series(rows, "max_rel", f"{dt}+fp32lse", order)
            h[f"{short(dt)}_fp32lse_{order}_at_max"] = float(err[n == n_max][0])
            h[f"{short(dt)}_fp32lse_{order}_slope"] = _slope(n, err)
    return h


def _summary(rows, cfg, gpu_failures):
    h, n_max = _headline(rows, cfg), max(cfg["splits"])
    lines = ["Question: how does merging split-KV partial states grow the error with the number "
             "of splits, and does the merge order (tree vs sequential) matter?",
             f"Method: {cfg['rows']} random query rows, {cfg['seqlen']} keys, D={cfg['head_dim']}; "
             f"the keys are cut into n = {min(cfg['splits'])}..{n_max} equal ranges; exact "
             "partial states (o_i, lse_i) are rounded to the merge dtype and merged with "
             "merge_many (pairwise: m = max lse, w = exp(lse - m), o = (w_a o_a + w_b o_b) / "
             "(w_a + w_b); flat: one max, one weight sum, one weighted sum), every operation "
             "rounded to that dtype. Error against exact float64.", "",
             f"{'dtype':<6}{'store floor':>12}" + "".join(
                 f"{o + ' @' + str(n_max):>17}{'slope':>7}" for o in ORDERS) +
             f"{'seq/tree':>10}"]
    for dt in DTYPES:
        s = short(dt)
        lines.append(f"{s:<6}{h[f'{s}_floor']:>12.3g}" + "".join(
            f"{h[f'{s}_{o}_at_max']:>17.3g}{h[f'{s}_{o}_slope']:>7.2f}" for o in ORDERS) +
            f"{h[f'{s}_seq_over_tree']:>10.2f}")
    for dt in MIXED:
        s = short(dt)
        lines.append(f"{s} o stored, lse and arithmetic in fp32: " + ", ".join(
            f"{o} @{n_max} {h[f'{s}_fp32lse_{o}_at_max']:.3g} (slope "
            f"{h[f'{s}_fp32lse_{o}_slope']:.2f})" for o in MIXED_ORDERS))
    lines += ["(store floor: the error of the exact output merely rounded to the dtype; slope: "
              "fitted exponent of the max error against n, n >= 2.)",
              "GPU part (when a GPU is present): numba_flash.merge_states (fp32, flat) on the "
              "same partial states, and numba_flash.decode in fp16 with num_splits = n."]
    for label, order in (("GPU merge_states fp32", "gpu merge_states"),
                         ("GPU decode fp16", "gpu decode")):
        sel = sorted((r for r in rows if r["order"] == order), key=lambda r: r["splits"])
        if sel:
            lines.append(f"{label}: " + ", ".join(f"n={r['splits']} {r['max_rel']:.3g}"
                                                  for r in sel) + ".")
    for what, why in gpu_failures.items():
        lines.append(f"GPU {what} not measured: {why}")
    return lines


def plot(rows, cfg):
    """Max relative error against the number of splits, one panel per merge dtype."""
    fig, axes = new_figure(3, width=4.0)
    for ax, dt in zip(axes, DTYPES):
        for i, order in enumerate(ORDERS):
            n, err = _series(rows, "max_rel", dt, order)
            ax.loglog(n, err, "-", marker="osx"[i], ms=4, label=order)
        if dt in MIXED:
            for i, order in enumerate(MIXED_ORDERS):
                n, err = _series(rows, "max_rel", f"{dt}+fp32lse", order)
                ax.loglog(n, err, "--", marker="os"[i], ms=3, color=f"C{i}", alpha=0.6,
                          label=f"{order}, lse in fp32")
        for order, marker in (("gpu merge_states", "^"), ("gpu decode", "v")):
            n, err = _series(rows, "max_rel", dt, order)
            if n.size:
                ax.loglog(n, err, "-.", marker=marker, ms=4, color="k", label=order)
        n, floor = _series(rows, "store_floor", dt, "tree")
        ax.loglog(n, floor, ":", color="0.4", label="exact output rounded to dtype")
        ax.set_xscale("log", base=2)
        ax.set_title(f"merge in {short(dt)}")
        ax.set_xlabel("number of splits")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("max relative error")
    axes[0].legend(fontsize=7)
    axes[1].legend(fontsize=7)
    return fig
