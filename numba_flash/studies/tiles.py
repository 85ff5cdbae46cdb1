"""Study 4: key-tile size and tile order.

The online softmax rounds its running state (m, l, acc) once per key tile, while the sums inside
a tile run wide (tensor-core accumulation). So the tile size block_n sets how many rounded
updates a row goes through (seqlen_k / block_n), and the tile order sets how often the running
max changes (each change rescales l and acc by alpha = exp(m_old - m_new)). Orders: ascending,
descending, a random permutation, max-first (tiles sorted by their largest score, largest
first: the max is known from the first tile, no rescaling) and max-last (smallest first: the
running max grows at every tile).
"""
from __future__ import annotations

import numpy as np

from numba_flash_reference import attention, online_attention, round_to

from ._numerics import error_stats, random_qkv, short
from ._output import new_figure, progress as _progress

TITLE = "Study 4: tile size and tile order"
GPU_PART = False

SETTINGS = [("float16", "float16"), ("bfloat16", "bfloat16"), ("float32", "float32"),
            ("float16", "float32")]
ORDERS = ("ascending", "descending", "random", "max-first", "max-last")

CONFIGS = {
    "full": {"block_ns": [16, 32, 64, 128, 256], "seqlen": 8192, "rows": 128, "head_dim": 64,
             "seed": 4},
    "tiny": {"block_ns": [16, 64], "seqlen": 512, "rows": 8, "head_dim": 64, "seed": 4},
}


def _label(in_dtype, accum):
    return f"{short(in_dtype)} in / {short(accum)} acc"


def tile_orders(scores: np.ndarray, block_n: int, rng: np.random.Generator) -> dict:
    """Per-row key-tile permutations of every order in ``ORDERS``.

    scores: float64 (rows, seqlen_k). Returns {order: int64 (rows, n_tiles)}; max-first and
    max-last sort the tiles of each row by that row's largest score in the tile.
    """
    r, n = scores.shape
    n_t = -(-n // block_n)
    padded = np.full((r, n_t * block_n), -np.inf)
    padded[:, :n] = scores
    tile_max = padded.reshape(r, n_t, block_n).max(axis=2)
    up = np.tile(np.arange(n_t), (r, 1))
    return {"ascending": up, "descending": up[:, ::-1].copy(),
            "random": np.array([rng.permutation(n_t) for _ in range(r)]),
            "max-first": np.argsort(-tile_max, axis=1, kind="stable"),
            "max-last": np.argsort(tile_max, axis=1, kind="stable")}


def rescale_count(scores: np.ndarray, block_n: int, order: np.ndarray) -> float:
    """Mean number of tiles per row (after the first) where the running max increases."""
    r, n = scores.shape
    n_t = order.shape[1]
    padded = np.full((r, n_t * block_n), -np.inf)
    padded[:, :n] = scores
    tile_max = np.take_along_axis(padded.reshape(r, n_t, block_n).max(axis=2), order, axis=1)
    running = np.maximum.accumulate(tile_max, axis=1)
    return float((running[:, 1:] > running[:, :-1]).sum(axis=1).mean())


def compute(cfg, *, gpu, progress=True):
    """Run the study; returns (rows, headline, summary lines). See module docstring."""
    rng = np.random.default_rng(cfg["seed"])
    base = random_qkv(rng, cfg["rows"], cfg["seqlen"], cfg["head_dim"])
    scale = 1.0 / np.sqrt(cfg["head_dim"])
    scores = scale * (base[0][0, :, 0] @ base[1][0, :, 0].T)
    rows = []
    jobs = [(bn, s) for bn in cfg["block_ns"] for s in SETTINGS]
    for bn, (in_dtype, accum) in _progress(jobs, desc="tiles", enabled=progress):
        q, k, v = (round_to(a, in_dtype) for a in base)
        exact = attention(q, k, v)
        orders = tile_orders(scores, bn, np.random.default_rng(cfg["seed"] + bn))
        for name in ORDERS:
            perm = orders[name]
            # block_m = 1: every query row is its own tile, so each row gets its own order.
            out = online_attention(q, k, v, accum_dtype=accum, p_dtype=in_dtype, block_m=1,
                                   block_n=bn, tile_order=lambda i, n_k, perm=perm: perm[i])
            rows.append({"block_n": bn, "order": name, "in_dtype": in_dtype, "accum_dtype": accum,
                         **error_stats(round_to(out, in_dtype), exact),
                         "rescales_per_row": rescale_count(scores, bn, perm)})
    return rows, _headline(rows, cfg), _summary(rows, cfg, gpu)


def _value(rows, key, **want):
    sel = [r for r in rows if all(r[k] == v for k, v in want.items())]
    return sel[0][key]


def _slope(rows, in_dtype, accum, order="ascending"):
    bns = sorted({r["block_n"] for r in rows})
    err = np.array([_value(rows, "max_rel", block_n=b, order=order, in_dtype=in_dtype,
                           accum_dtype=accum) for b in bns])
    if len(bns) < 2:
        return float("nan")
    return float(np.polyfit(np.log(bns), np.log(err), 1)[0])


def _headline(rows, cfg):
    h = {}
    small, big = min(cfg["block_ns"]), max(cfg["block_ns"])
    for in_dtype, accum in SETTINGS:
        t = f"{short(in_dtype)}_{short(accum)}"
        for b in (small, big):
            h[f"{t}_ascending_bn{b}"] = _value(rows, "max_rel", block_n=b, order="ascending",
                                              in_dtype=in_dtype, accum_dtype=accum)
        h[f"{t}_slope"] = _slope(rows, in_dtype, accum)
        errs = {o: [_value(rows, "max_rel", block_n=b, order=o, in_dtype=in_dtype,
                           accum_dtype=accum) for b in cfg["block_ns"]] for o in ORDERS}
        # spread between the best and worst order, at each block_n, then the largest of those
        h[f"{t}_order_spread"] = float(max(max(errs[o][i] for o in ORDERS) /
                                           min(errs[o][i] for o in ORDERS)
                                           for i in range(len(cfg["block_ns"]))))
        for o in ORDERS:
            h[f"{t}_{o}_mean_over_bn"] = float(np.exp(np.mean(np.log(errs[o]))))
    for o in ORDERS:
        h[f"rescales_{o}_bn{small}"] = _value(rows, "rescales_per_row", block_n=small, order=o,
                                              in_dtype="float32", accum_dtype="float32")
    return h


def _summary(rows, cfg, gpu):
    h = _headline(rows, cfg)
    small, big = min(cfg["block_ns"]), max(cfg["block_ns"])
    lines = ["Question: do the key-tile size block_n and the order of the key tiles change the "
             "error of the online softmax, and how?",
             f"Method: {cfg['rows']} random query rows, {cfg['seqlen']} keys, D={cfg['head_dim']}, "
             f"block_n in {cfg['block_ns']}; each row processes its key tiles in one of "
             f"{', '.join(ORDERS)} (max-first / max-last sort the tiles by their largest score). "
             "Online softmax emulation, every step rounded to the accumulator dtype, P to the "
             "input dtype, output stored in the input dtype; error against exact float64.", "",
             f"{'setting':<22}{'max err bn=' + str(small):>15}{'bn=' + str(big):>10}"
             f"{'slope':>7}  " + "".join(f"{o:>11}" for o in ORDERS)]
    for in_dtype, accum in SETTINGS:
        t = f"{short(in_dtype)}_{short(accum)}"
        lines.append(f"{_label(in_dtype, accum):<22}{h[f'{t}_ascending_bn{small}']:>15.3g}"
                     f"{h[f'{t}_ascending_bn{big}']:>10.3g}{h[f'{t}_slope']:>7.2f}  " +
                     "".join(f"{h[f'{t}_{o}_mean_over_bn']:>11.3g}" for o in ORDERS))
    lines += ["(max err at the smallest / largest block_n in ascending order; slope: fitted "
              "exponent of the error against block_n; per order: geometric mean over block_n of "
              "the max error.)",
              f"Running-max increases per row at block_n={small} (fp32 scores): " + ", ".join(
                  f"{o} {h[f'rescales_{o}_bn{small}']:.1f}" for o in ORDERS) + ".",
              "Largest ratio between the worst and best order at one block_n: " + ", ".join(
                  f"{_label(*s)} {h[f'{short(s[0])}_{short(s[1])}_order_spread']:.2f}x"
                  for s in SETTINGS) + ".",
              "The kernels' tile sizes and order are fixed at compile time, so only the "
              "emulation can vary them."]
    return lines


def plot(rows, cfg):
    """Left: error against block_n (ascending order) per setting. Right two: error against
    block_n per order for the fp16 and bf16 accumulators."""
    fig, axes = new_figure(3, width=4.2)
    colors = dict(zip(SETTINGS, ("C0", "C1", "C2", "C4")))
    bns = sorted({r["block_n"] for r in rows})
    for s in SETTINGS:
        err = [_value(rows, "max_rel", block_n=b, order="ascending", in_dtype=s[0],
                      accum_dtype=s[1]) for b in bns]
        axes[0].loglog(bns, err, "-o", ms=3, color=colors[s], label=_label(*s))
    axes[0].set_title("ascending order")
    axes[0].legend(fontsize=7)
    for ax, s in zip(axes[1:], SETTINGS[:2]):
        for i, o in enumerate(ORDERS):
            err = [_value(rows, "max_rel", block_n=b, order=o, in_dtype=s[0], accum_dtype=s[1])
                   for b in bns]
            ax.loglog(bns, err, "-", marker="osx^v"[i], ms=4, label=o, color=f"C{i + 5}")
        ax.set_title(f"order, {_label(*s)}")
        ax.legend(fontsize=7)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("block_n (keys per tile)")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("max relative error")
    return fig
