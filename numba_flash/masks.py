"""Mask constructors for ``numba_flash.attention(..., mask=...)``.

Each constructor returns a mask object whose meaning is defined once, in the NumPy reference
(``numba_flash_reference.masks``). Every object offers

* ``m.to_dense(seqlen_q, seqlen_k)``: bool (seqlen_q, seqlen_k), True where query row r may see
  key j;
* ``m.column_intervals(seqlen_q, seqlen_k)``: FlashMask's O(N) encoding (``ColumnIntervals``:
  four int32 vectors lts, lte, uts, ute of length seqlen_k; the masked query rows of column j
  are ``[lts_j, lte_j) U [uts_j, ute_j)``); raises ``NotRepresentableError`` when the mask has
  no such form;
* ``m.to_bitmask(seqlen_q, seqlen_k)``: uint8 packed bits, 1 bit per pair (any mask);
* ``m1 & m2``: the intersection (a pair is visible iff both masks let it through).

Positions are aligned bottom-right: query row r sits at position ``i = r + seqlen_k - seqlen_q``
and key column c at ``j = c``, so a mask means the same for a prefill and for decoding over a
KV cache. Lengths (``doc_lengths`` ...) are per sequence in the packed order along the keys and
must sum to seqlen_k. See docs/masks.md for pictures and the interval formulas.

Importing this module imports no numba and compiles nothing.
"""
from __future__ import annotations

from numba_flash_reference import masks as _ref
from numba_flash_reference.intervals import (ColumnIntervals, NotRepresentableError,
                                             intervals_from_dense)
from numba_flash_reference.masks import Mask

__all__ = ["Mask", "ColumnIntervals", "NotRepresentableError", "intervals_from_dense", "causal",
           "sliding_window", "causal_document", "document", "shared_question",
           "global_sliding_window", "causal_blockwise", "prefix_lm_causal", "prefix_lm_document",
           "qk_sparse", "random_eviction", "tree", "from_dense", "column_intervals", "mask_mod"]


def causal() -> Mask:
    """Causal mask: query i sees key j iff ``j <= i``.

    Same as ``attention(..., causal=True)``; useful to combine with ``&``.

    >>> causal().to_dense(3, 3).astype(int).tolist()
    [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    """
    return _ref.CausalMask()


def sliding_window(left: int, right: int) -> Mask:
    """Local attention: query i sees key j iff ``i - left <= j <= i + right``.

    left, right : int >= -1; -1 leaves that side unbounded (``sliding_window(-1, 0)`` is causal).
    Same as ``attention(..., window_size=(left, right))``.

    >>> sliding_window(1, 0).to_dense(4, 4).astype(int).tolist()
    [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]
    """
    return _ref.SlidingWindowMask(left, right)


def causal_document(doc_lengths) -> Mask:
    """Packed causal documents: i sees j iff ``j <= i`` and both lie in the same document.

    doc_lengths : sequence of int >= 0, the lengths of the documents packed one after another
        along the keys; they must sum to seqlen_k.

    >>> causal_document([2, 2]).to_dense(4, 4).astype(int).tolist()
    [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]
    """
    return _ref.CausalDocumentMask(doc_lengths)


def document(doc_lengths) -> Mask:
    """Packed bidirectional documents: i sees j iff both lie in the same document.

    doc_lengths : as in ``causal_document``.

    >>> document([1, 2]).to_dense(3, 3).astype(int).tolist()
    [[1, 0, 0], [0, 1, 1], [0, 1, 1]]
    """
    return _ref.DocumentMask(doc_lengths)


def shared_question(doc_lengths, question_lengths, answer_lengths) -> Mask:
    """Shared-question packing (DPO, reward models): each document is one question followed by
    its answers; i sees j iff ``j <= i``, same document, and (j is in the question, or i and j
    are in the same answer). Answers see the question, never each other.

    doc_lengths : sequence of int >= 0 summing to seqlen_k.
    question_lengths : one int >= 0 per document.
    answer_lengths : one list per document of its answers' lengths (int >= 0), e.g.
        ``[[3, 2], [4]]``; ``question_lengths[d] + sum(answer_lengths[d]) == doc_lengths[d]``.

    >>> shared_question([4], [2], [[1, 1]]).to_dense(4, 4).astype(int).tolist()
    [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 0, 1]]
    """
    return _ref.SharedQuestionMask(doc_lengths, question_lengths, answer_lengths)


def global_sliding_window(num_global: int, window: int) -> Mask:
    """Global tokens plus a symmetric window (BigBird-like): i sees j iff ``i < num_global`` or
    ``j < num_global`` or ``|i - j| < window``.

    num_global : int >= 0, the first positions are global (see and are seen by all).
    window : int >= 0, ``window=2`` keeps the diagonal and one neighbour on each side.

    >>> global_sliding_window(1, 2).to_dense(4, 4).astype(int).tolist()
    [[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 1, 1]]
    """
    return _ref.GlobalSlidingWindowMask(num_global, window)


def causal_blockwise(block_lengths, test_length: int) -> Mask:
    """In-context learning blocks: i sees j iff ``j <= i`` and (same demonstration block, or i
    in the final test block, which sees everything before it).

    block_lengths : sequence of int >= 0, the demonstration blocks in order.
    test_length : int >= 0, the final test block; ``sum(block_lengths) + test_length`` must
        equal seqlen_k.

    >>> causal_blockwise([1, 1], 2).to_dense(4, 4).astype(int).tolist()
    [[1, 0, 0, 0], [0, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    """
    return _ref.CausalBlockwiseMask(block_lengths, test_length)


def prefix_lm_causal(prefix_length: int) -> Mask:
    """Prefix LM: the first ``prefix_length`` keys are seen by everyone, the rest causally:
    i sees j iff ``j < prefix_length`` or ``j <= i``.

    prefix_length : int, 0 <= prefix_length <= seqlen_k.

    >>> prefix_lm_causal(2).to_dense(3, 3).astype(int).tolist()
    [[1, 1, 0], [1, 1, 0], [1, 1, 1]]
    """
    return _ref.PrefixLMCausalMask(prefix_length)


def prefix_lm_document(doc_lengths, prefix_lengths) -> Mask:
    """Prefix LM per packed document: i sees j iff same document and (j in that document's
    prefix, or ``j <= i``).

    doc_lengths : as in ``causal_document``.
    prefix_lengths : one int per document, 0 <= prefix_lengths[d] <= doc_lengths[d].

    >>> prefix_lm_document([2, 2], [2, 0]).to_dense(4, 4).astype(int).tolist()
    [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]
    """
    return _ref.PrefixLMDocumentMask(doc_lengths, prefix_lengths)


def qk_sparse(dropped_keys=(), dropped_rows=None) -> Mask:
    """Causal attention with some keys and a range of queries dropped: i sees j iff ``j <= i``,
    j is not in ``dropped_keys`` and i is not in ``[start, end)``.

    dropped_keys : sequence of key indices in [0, seqlen_k).
    dropped_rows : (start, end) of query positions to drop, 0 <= start <= end <= seqlen_k
        (query rows when seqlen_q == seqlen_k), or None. Dropped queries see no key: their
        output is 0 and their lse -inf.

    >>> qk_sparse([1], (2, 3)).to_dense(4, 4).astype(int).tolist()
    [[1, 0, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 0, 1, 1]]
    """
    return _ref.QKSparseMask(dropped_keys, dropped_rows)


def random_eviction(evict_rows) -> Mask:
    """KV-cache eviction: key j is seen causally until it is evicted: i sees j iff
    ``j <= i < evict_rows[j]``.

    evict_rows : one int per key (length seqlen_k), in [0, seqlen_k]: the first query position
        that no longer sees key j; seqlen_k means never evicted.

    >>> random_eviction([2, 3, 3]).to_dense(3, 3).astype(int).tolist()
    [[1, 0, 0], [1, 1, 0], [0, 1, 1]]
    """
    return _ref.RandomEvictionMask(evict_rows)


def tree(parents, prefix_length: int = 0) -> Mask:
    """Speculative-decoding draft tree (verification step) after a context prefix.

    parents : one int per tree node: ``parents[0] == -1`` (root), else ``0 <= parents[t] < t``.
    prefix_length : int >= 0, context keys before the tree; seqlen_k must equal
        ``prefix_length + len(parents)``, node t being key ``prefix_length + t``.
    i sees j iff (j is a context key and ``j <= i``) or (j is node i or one of its ancestors).
    Column intervals exist when the nodes are numbered in DFS preorder; otherwise the kernel
    uses the bitmask.

    >>> tree([-1, 0, 0]).to_dense(3, 3).astype(int).tolist()
    [[1, 0, 0], [1, 1, 0], [1, 0, 1]]
    """
    return _ref.TreeMask(parents, prefix_length)


def from_dense(matrix) -> Mask:
    """An arbitrary mask from a bool matrix (seqlen_q, seqlen_k), True = visible.

    Stored as a packed bitmask (1 bit per pair, uint8 rows padded to 32-bit words, bit b of byte
    k in row r = pair (r, 8k + b)); it fits only that shape. Column intervals are derived when
    every column masks at most two runs of rows.

    >>> import numpy as np
    >>> from_dense(np.eye(2, dtype=bool)).to_dense(2, 2).astype(int).tolist()
    [[1, 0], [0, 1]]
    """
    return _ref.DenseMask(matrix)


def column_intervals(lts, lte, uts, ute, seqlen_q=None) -> Mask:
    """A mask given directly in FlashMask's column-interval form: query row r is masked for key
    j iff ``lts[j] <= r < lte[j]`` or ``uts[j] <= r < ute[j]``.

    lts, lte, uts, ute : integer vectors of length seqlen_k, ``0 <= start <= end <= seqlen_q``.
    seqlen_q : int, the query rows the vectors refer to; defaults to seqlen_k.

    >>> column_intervals([2, 2], [2, 2], [0, 0], [0, 1]).to_dense(2, 2).astype(int).tolist()
    [[1, 0], [1, 1]]
    """
    return _ref.ColumnIntervalMask(lts, lte, uts, ute, seqlen_q)


def mask_mod(fn, batch_head: bool = False) -> Mask:
    """A mask written as a plain Python function (FlexAttention's ``mask_mod``, for CuPy users).

    fn : ``fn(b, h, q_idx, kv_idx) -> bool``, True = visible. ``b`` is the batch index, ``h`` the
        query head, ``q_idx`` the query's aligned position (its row index when seqlen_q ==
        seqlen_k; see "Positions" in docs/masks.md), ``kv_idx`` the key index. On the GPU, Numba
        compiles ``fn`` into the tile classification and the attention kernel, so its body must
        be Numba-compilable: integer arithmetic, comparisons, ``&`` / ``|`` / ``and`` / ``or``,
        and reads of captured NumPy arrays (document ids...; they become device constants, so
        keep them small, e.g. int32 of length seqlen_k). The CPU reference evaluates the same
        function in NumPy (vectorised when the body allows it, else pair by pair).
    batch_head : bool
        False (default): ``fn`` does not depend on b and h (called with 0, 0), one tile table
        serves every (batch, head). True: evaluated per (b, h) (tables cost batch * heads times
        more to build).

    >>> import numpy as np
    >>> doc = np.array([0, 0, 1, 1, 1])
    >>> m = mask_mod(lambda b, h, q, kv: (doc[q] == doc[kv]) & (kv <= q))
    >>> m.to_dense(5, 5).astype(int).tolist()
    [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]]
    """
    return _ref.MaskModMask(fn, batch_head)
