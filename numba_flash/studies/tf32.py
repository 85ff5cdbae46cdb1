"""Study 8: float32 attention on TF32 tensor cores, plain and error-compensated (3xTF32).

The two products of attention (S = Q K^T and O = P V) run three ways, everything else (the
softmax, the accumulators) in float32: IEEE float32 products (the CUDA-core kernel), plain TF32
(operands rounded to TF32's 10 mantissa bits, exact products, float32 accumulation: one tensor
core product) and 3xTF32 (each operand split into a TF32 high part and a TF32 remainder,
``a b = a_hi b_hi + a_hi b_lo + a_lo b_hi``: three products; kernels/forward_tf32x3.py). Errors
against the exact float64 attention of the same float32 inputs, against the sequence length
and against the logit scale (the standard deviation of the scores). An emulation in NumPy of
what the kernels compute (the kernels themselves are tested against it in
tests/test_forward_tf32x3.py); no GPU part.
"""
from __future__ import annotations

import numpy as np

from numba_flash_reference import attention

from ._output import new_figure, progress as _progress

TITLE = "Study 8: float32 attention on TF32 tensor cores, plain and 3xTF32"
GPU_PART = False
METHODS = ("ieee", "tf32", "3xtf32")

CONFIGS = {
    "full": {"seqlens": [256 << i for i in range(7)], "scale_for_seqlens": 1.0,
             "scales": [0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0], "seqlen": 4096, "rows": 64,
             "head_dim": 64, "seed": 8},
    "tiny": {"seqlens": [256, 1024], "scale_for_seqlens": 1.0, "scales": [1.0, 8.0],
             "seqlen": 512, "rows": 16, "head_dim": 64, "seed": 8},
}


def to_tf32(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to TF32 (10 mantissa bits, nearest, ties away: cvt.rna)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    finite = np.isfinite(x)
    rounded = ((bits.astype(np.uint64) + 0x1000) & 0xFFFFE000).astype(np.uint32)
    return np.where(finite, rounded.view(np.float32), x).astype(np.float32)


def truncate_tf32(x: np.ndarray) -> np.ndarray:
    """float32 values cut to TF32's 10 mantissa bits (toward zero): what a tensor core reads
    from a float32 register it takes as TF32."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return (bits & np.uint32(0xFFFFE000)).view(np.float32)


def product(a: np.ndarray, b: np.ndarray, method: str) -> np.ndarray:
    """a @ b (float32 operands) as ``method`` computes it, float32 accumulation. 3xTF32 as the
    kernel splits (primitives/mma_exact.py ``split_tf32_fast``): the high part rounded to
    nearest, the remainder ``x - hi`` left unrounded, which the tensor core truncates."""
    a, b = a.astype(np.float32), b.astype(np.float32)
    if method == "ieee":
        return a @ b
    a_hi, b_hi = to_tf32(a), to_tf32(b)
    if method == "tf32":
        return a_hi @ b_hi
    a_lo, b_lo = truncate_tf32(a - a_hi), truncate_tf32(b - b_hi)
    return (a_lo @ b_hi + a_hi @ b_lo) + a_hi @ b_hi


def emulated_attention(q, k, v, scale, method):
    """Dense attention of one head, q (R, D), k / v (N, D) float32, products by ``method``."""
    s = product(q, k.T, method) * np.float32(scale)
    p = np.exp(s - s.max(axis=1, keepdims=True)).astype(np.float32)
    o = product(p, v, method)
    return o / p.sum(axis=1, keepdims=True, dtype=np.float32)


def _case(rng, rows, seqlen, head_dim, logit_scale):
    """(max relative error per method) on random inputs with score std ``logit_scale``."""
    q = (rng.standard_normal((rows, head_dim)) * logit_scale).astype(np.float32)
    k, v = (rng.standard_normal((seqlen, head_dim)).astype(np.float32) for _ in range(2))
    scale = head_dim ** -0.5
    exact = attention(q[None, :, None], k[None, :, None], v[None, :, None],
                      softmax_scale=scale)[0, :, 0]
    denom = np.abs(exact).max()
    return {m: float(np.abs(emulated_attention(q, k, v, scale, m) - exact).max() / denom)
            for m in METHODS}


def compute(cfg, *, gpu, progress=True):
    """Rows (axis, x, method, max_rel), headline ratios, summary lines."""
    rng = np.random.default_rng(cfg["seed"])
    plan = [("seqlen", n, cfg["scale_for_seqlens"]) for n in cfg["seqlens"]]
    plan += [("logit_scale", cfg["seqlen"], s) for s in cfg["scales"]]
    rows = []
    for axis, n, s in _progress(plan, desc="tf32", enabled=progress):
        errors = _case(rng, cfg["rows"], n, cfg["head_dim"], s)
        x = n if axis == "seqlen" else s
        rows += [dict(axis=axis, x=x, method=m, max_rel=e) for m, e in errors.items()]
    return rows, _headline(rows), _summary(rows, cfg)


def _series(rows, axis, method):
    sel = sorted((r for r in rows if r["axis"] == axis and r["method"] == method),
                 key=lambda r: r["x"])
    return np.array([r["x"] for r in sel], float), np.array([r["max_rel"] for r in sel])


def _headline(rows):
    h = {}
    for axis in ("seqlen", "logit_scale"):
        _, ieee = _series(rows, axis, "ieee")
        _, tf = _series(rows, axis, "tf32")
        _, tf3 = _series(rows, axis, "3xtf32")
        h[f"{axis}_3xtf32_over_ieee_max"] = float((tf3 / ieee).max())
        h[f"{axis}_tf32_over_ieee_min"] = float((tf / ieee).min())
        h[f"{axis}_3xtf32_worst"] = float(tf3.max())
        h[f"{axis}_tf32_worst"] = float(tf.max())
    return h


def _summary(rows, cfg):
    h = _headline(rows)
    lines = ["Question: does float32 attention keep float32 accuracy on TF32 tensor cores, "
             "plain or error-compensated (3xTF32)?",
             f"Method: {cfg['rows']} random query rows, D={cfg['head_dim']}, float32 inputs; "
             "the two products by IEEE float32, plain TF32 or 3xTF32, the softmax in float32; "
             "max |error| over the output, relative to max |exact|, exact = float64 attention "
             "of the same inputs.", ""]
    for axis, name in (("seqlen", "seqlen_k"), ("logit_scale", "logit scale")):
        x, ieee = _series(rows, axis, "ieee")
        _, tf = _series(rows, axis, "tf32")
        _, tf3 = _series(rows, axis, "3xtf32")
        lines.append(f"{name:>12}{'IEEE fp32':>12}{'TF32':>12}{'3xTF32':>12}{'3xTF32/IEEE':>13}")
        for i in range(x.size):
            lines.append(f"{x[i]:>12g}{ieee[i]:>12.3g}{tf[i]:>12.3g}{tf3[i]:>12.3g}"
                         f"{tf3[i] / ieee[i]:>13.2f}")
        lines.append("")
    lines.append(f"Answer: 3xTF32 stays within {max(h['seqlen_3xtf32_over_ieee_max'], h['logit_scale_3xtf32_over_ieee_max']):.2f}x "
                 "the IEEE float32 error on every case (worst "
                 f"{max(h['seqlen_3xtf32_worst'], h['logit_scale_3xtf32_worst']):.2g}); plain "
                 f"TF32 is at least {min(h['seqlen_tf32_over_ieee_min'], h['logit_scale_tf32_over_ieee_min']):.0f}x "
                 f"worse (worst {max(h['seqlen_tf32_worst'], h['logit_scale_tf32_worst']):.2g}).")
    return lines


def plot(rows, cfg):
    """Max relative error against seqlen_k and against the logit scale, per method."""
    fig, axes = new_figure(2, width=4.2)
    styles = {"ieee": ("C0", "IEEE fp32 products"), "tf32": ("C3", "plain TF32"),
              "3xtf32": ("C2", "3xTF32")}
    for ax, axis, xlabel in ((axes[0], "seqlen", "seqlen_k"),
                             (axes[1], "logit_scale", "logit scale (score std)")):
        for m in METHODS:
            x, err = _series(rows, axis, m)
            ax.loglog(x, err, "-o", ms=3, color=styles[m][0], label=styles[m][1])
        ax.set_xlabel(xlabel)
        ax.set_ylabel("max relative error")
        ax.grid(True, alpha=0.3)
    axes[0].set_xscale("log", base=2)
    axes[0].set_title(f"logit scale {cfg['scale_for_seqlens']:g}", fontsize=10)
    axes[1].set_title(f"{cfg['seqlen']} keys", fontsize=10)
    axes[0].legend(fontsize=7)
    return fig
