"""One instance of every mask kind, with deterministic random-ish parameters, for any lengths.

Other test files parametrize over ``example_masks(seqlen_q, seqlen_k)``; the parameters depend
only on (seqlen_q, seqlen_k, seed), so a failure reproduces.
"""
from __future__ import annotations

import numpy as np

from numba_flash_reference import masks as M

# Kinds whose column intervals are not guaranteed (a random dense matrix rarely has them).
NO_INTERVALS = frozenset({"dense"})


def random_lengths(rng: np.random.Generator, total: int, parts: int) -> list[int]:
    """``parts`` non-negative integers summing to ``total`` (zeros possible)."""
    cuts = np.sort(rng.integers(0, total + 1, size=max(parts, 1) - 1))
    return np.diff(np.concatenate([[0], cuts, [total]])).astype(int).tolist()


def random_preorder_parents(rng: np.random.Generator, n: int) -> list[int]:
    """Parents of a random n-node tree numbered in DFS preorder (each new node hangs off the
    current root-to-last-node path)."""
    parents, path = [-1], [0]
    for node in range(1, n):
        depth = int(rng.integers(0, len(path)))
        del path[depth + 1:]
        parents.append(path[-1])
        path.append(node)
    return parents


def example_masks(seqlen_q: int, seqlen_k: int, seed: int = 0) -> list[tuple[str, M.Mask]]:
    """(name, mask) for every mask kind, each valid for (seqlen_q, seqlen_k).

    seqlen_q >= 0 and seqlen_k >= 0; the tree is left out when seqlen_k == 0. ``seed`` varies
    the parameters (the default keeps the historical values).
    """
    rng = np.random.default_rng([seqlen_q, seqlen_k, seed])
    n = seqlen_k

    def upto(high):  # uniform integer in [0, high]
        return int(rng.integers(0, high + 1))

    docs = random_lengths(rng, n, 1 + upto(4))
    questions, answers = [], []
    for length in docs:
        parts = random_lengths(rng, length, 2 + upto(2))
        questions.append(parts[0])
        answers.append(parts[1:])
    test_length = upto(n)
    drop_start = upto(n)
    dense = rng.random((seqlen_q, n)) < 0.6
    iv = np.sort(rng.integers(0, seqlen_q + 1, size=(4, n)), axis=0)

    out = [
        ("causal", M.CausalMask()),
        ("sliding_window", M.SlidingWindowMask(upto(n // 2 + 1), upto(3))),
        ("sinks_window", M.SlidingWindowMask(upto(n // 3 + 1), 0, sinks=1 + upto(3))),
        ("causal_document", M.CausalDocumentMask(docs)),
        ("document", M.DocumentMask(docs)),
        ("shared_question", M.SharedQuestionMask(docs, questions, answers)),
        ("global_sliding_window", M.GlobalSlidingWindowMask(upto(3), 1 + upto(n // 3 + 1))),
        ("causal_blockwise",
         M.CausalBlockwiseMask(random_lengths(rng, n - test_length, 1 + upto(3)), test_length)),
        ("prefix_lm_causal", M.PrefixLMCausalMask(upto(n))),
        ("prefix_lm_document", M.PrefixLMDocumentMask(docs, [upto(d) for d in docs])),
        ("qk_sparse", M.QKSparseMask(np.flatnonzero(rng.random(n) < 0.2),
                                     (drop_start, drop_start + upto(n - drop_start)))),
        ("random_eviction",
         M.RandomEvictionMask([int(rng.integers(j, n + 1)) for j in range(n)])),
        ("dense", M.DenseMask(dense)),
        ("column_intervals", M.ColumnIntervalMask(iv[2], iv[3], iv[0], iv[1], seqlen_q)),
        ("window_and_document",
         M.SlidingWindowMask(upto(n // 2 + 1), 0) & M.CausalDocumentMask(docs)),
    ]
    if n >= 1:
        nodes = 1 + upto(n - 1)
        out.append(("tree", M.TreeMask(random_preorder_parents(rng, nodes), n - nodes)))
    return out
