"""Draw every mask kind from the NumPy reference into docs/img/mask_<name>.png.

Each picture has two panels for an N x N problem (N = 64 by default): the visibility matrix
(query rows down, key columns across; dark = visible) and the tile classes a kernel would use
with B x B tiles (B = 8): white = skip, orange = partial (per-element mask), green = full. Tile
classes come from the column intervals (FlashMask's min/max rule) when the mask has them, else
from the dense matrix (exact; such masks run through the bitmask).

Usage: python scripts/plot_masks.py [--out docs/img] [--n 64] [--block 8]
"""
from __future__ import annotations

import argparse
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402

import numba_flash.masks as nfm  # noqa: E402
from numba_flash_reference.intervals import NotRepresentableError  # noqa: E402
from numba_flash_reference.masks import SlidingWindowMask  # noqa: E402
from numba_flash_reference.tiles import (classify_tiles, classify_tiles_dense,  # noqa: E402
                                         tile_counts)


def pictured_masks(n: int):
    """(file name, title, mask) for every mask kind, with readable parameters for length n."""
    q = n // 8
    rng = np.random.default_rng(7)
    docs = [n - 5 * q - q // 2, 3 * q, 2 * q + q // 2]
    evict = np.minimum(np.arange(n) + rng.integers(q, 5 * q, n), n)
    dense = np.kron(rng.random((8, 8)) < 0.55, np.ones((q, q), dtype=bool)) & (
        rng.random((n, n)) < 0.9)
    rows = np.arange(n)
    stripes = (rows // q) % 3 == 0
    ivec = dict(lts=np.full(n, n), lte=np.full(n, n), uts=np.where(stripes, 2 * q, 0),
                ute=np.where(stripes, 5 * q, 0))
    ivec["lts"] = np.maximum(rows + q, ivec["ute"]).clip(max=n)
    return [
        ("causal", "causal()", nfm.causal()),
        ("sliding_window", f"sliding_window({q + 2}, 0)", nfm.sliding_window(q + 2, 0)),
        ("sinks_window", f"sliding_window({q + 2}, 0) + 4 sinks",
         SlidingWindowMask(q + 2, 0, sinks=4)),
        ("causal_document", f"causal_document({docs})", nfm.causal_document(docs)),
        ("document", f"document({docs})", nfm.document(docs)),
        ("shared_question", "shared_question(2 docs, 2 + 3 answers)",
         nfm.shared_question([5 * q, 3 * q], [2 * q, q], [[q, q + q // 2, q // 2],
                                                          [q - 3, q + 3]])),
        ("global_sliding_window", f"global_sliding_window({q // 2}, {q // 2 + 2})",
         nfm.global_sliding_window(q // 2, q // 2 + 2)),
        ("causal_blockwise", f"causal_blockwise([{2 * q}, {q + 3}, {2 * q - 3}], {3 * q})",
         nfm.causal_blockwise([2 * q, q + 3, 2 * q - 3], 3 * q)),
        ("prefix_lm_causal", f"prefix_lm_causal({3 * q - 2})", nfm.prefix_lm_causal(3 * q - 2)),
        ("prefix_lm_document", "prefix_lm_document",
         nfm.prefix_lm_document([5 * q, 3 * q], [2 * q, q + 3])),
        ("qk_sparse", "qk_sparse(5 keys, rows (44, 52))",
         nfm.qk_sparse([3, q + 1, q + 2, 3 * q, 4 * q + 5], (5 * q + 4, 6 * q + 4))),
        ("random_eviction", "random_eviction", nfm.random_eviction(evict)),
        ("tree", f"tree(binary, 31 nodes in preorder, prefix {n - 31})",
         nfm.tree(binary_tree_preorder(5), prefix_length=n - 31)),
        ("tree_bfs", "tree(seed 001, BFS order: bitmask)",
         nfm.tree([-1, 0, 1, 1, 2, 2, 3, 3, 4], prefix_length=n - 9)),
        ("dense", "from_dense(random blocks: bitmask)", nfm.from_dense(dense)),
        ("column_intervals", f"column_intervals: LT = [j + {q}, N), UT = [{2 * q}, {5 * q}) "
                             f"on striped columns",
         nfm.column_intervals(ivec["lts"], ivec["lte"], ivec["uts"], ivec["ute"])),
        ("intersection", f"sliding_window({2 * q}, 0) & causal_document",
         nfm.sliding_window(2 * q, 0) & nfm.causal_document(docs)),
    ]


def binary_tree_preorder(depth: int) -> list[int]:
    """Parents of a complete binary tree of ``depth`` levels, numbered in DFS preorder."""
    parents: list[int] = []

    def visit(parent, level):
        node = len(parents)
        parents.append(parent)
        if level > 1:
            visit(node, level - 1)
            visit(node, level - 1)

    visit(-1, depth)
    return parents


def draw(name, title, mask, n, block, out_dir):
    """Write out_dir/mask_<name>.png; returns its path and the tile counts."""
    visible = mask.to_dense(n, n)
    try:
        classes = classify_tiles(mask.column_intervals(n, n), block, block)
        how = "column intervals"
    except NotRepresentableError:
        classes = classify_tiles_dense(visible, block, block)
        how = "dense, exact"
    counts = tile_counts(classes)
    fig, axes = plt.subplots(1, 2, figsize=(6.0, 3.3), dpi=80)
    axes[0].imshow(visible, cmap=ListedColormap(["#e8e8e8", "#1f3b73"]), vmin=0, vmax=1,
                   interpolation="nearest")
    axes[0].set_title("visible (dark)", fontsize=8)
    tiles = np.kron(classes, np.ones((block, block), dtype=np.int8))[:n, :n]
    axes[1].imshow(tiles, cmap=ListedColormap(["#ffffff", "#f5a623", "#4caf50"]), vmin=0,
                   vmax=2, interpolation="nearest")
    axes[1].imshow(np.ma.masked_where(~visible, visible), cmap=ListedColormap(["#000000"]),
                   alpha=0.25, interpolation="nearest")
    axes[1].set_title(f"{block}x{block} tiles ({how}): {counts['skip']} skip, "
                      f"{counts['partial']} partial, {counts['full']} full", fontsize=7)
    for ax in axes:
        ax.set_xticks(np.arange(-0.5, n, block), minor=True)
        ax.set_yticks(np.arange(-0.5, n, block), minor=True)
        ax.grid(which="minor", color="#999999", linewidth=0.4)
        ax.tick_params(which="both", length=0, labelsize=6)
        ax.set_xlabel("key j", fontsize=7)
        ax.set_ylabel("query i", fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path = os.path.join(out_dir, f"mask_{name}.png")
    fig.savefig(path)
    plt.close(fig)
    return path, counts


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "docs",
                                                      "img"))
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--block", type=int, default=8)
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    for name, title, mask in pictured_masks(args.n):
        path, counts = draw(name, title, mask, args.n, args.block, args.out)
        print(f"{os.path.normpath(path)}: {os.path.getsize(path) // 1024} KB, {counts}")


if __name__ == "__main__":
    main()
