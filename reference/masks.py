"""Attention masks: one meaning each (a predicate), and the encodings kernels use.

A mask says which (query i, key j) pairs are visible. Positions are *aligned*: with seqlen_q
queries and seqlen_k keys, query row ``r`` sits at absolute position ``i = r + seqlen_k -
seqlen_q`` (bottom-right alignment, as in flash-attn >= 2.1 and a KV cache), key column ``c`` at
``j = c``. Every formula below is in aligned positions, so one mask object means the same thing
for a prefill (seqlen_q == seqlen_k) and for a decode step over a KV cache (seqlen_q < seqlen_k,
the queries being the last positions). When seqlen_q > seqlen_k the first query rows sit at
negative positions: they precede every key, belong to no document or tree node, and so see no
key under the causal and document-style masks (formulas that do not need a document, such as
``i < G`` or ``j < P``, apply to them as written).

Lengths are per sequence in the packed order: ``doc_lengths`` (and ``block_lengths`` etc.) list
the lengths of consecutive segments along the *key* sequence, and must sum to seqlen_k.

Every mask implements ``_visible(qpos, kpos, seqlen_k)``: a vectorised predicate on broadcast
integer arrays of aligned query positions and key positions. ``to_dense`` turns it into the
(seqlen_q, seqlen_k) boolean visibility matrix, the meaning every encoding must reproduce.
Encodings: ``column_intervals`` (FlashMask's O(N) form, see ``intervals.py``; computed
analytically, never from a dense matrix, except for masks that *are* a dense matrix) and
``to_bitmask`` (1 bit per pair, any mask).

Masks combine by intersection with ``&``.
"""
from __future__ import annotations

import numpy as np

from .elementwise import call_elementwise
from .intervals import (ColumnIntervals, NotRepresentableError, intervals_from_dense,
                        intervals_from_position_runs)

__all__ = ["Mask", "IntersectionMask", "CausalMask", "SlidingWindowMask", "CausalDocumentMask",
           "DocumentMask", "SharedQuestionMask", "GlobalSlidingWindowMask", "CausalBlockwiseMask",
           "PrefixLMCausalMask", "PrefixLMDocumentMask", "QKSparseMask", "RandomEvictionMask",
           "TreeMask", "DenseMask", "ColumnIntervalMask", "MaskModMask", "NotRepresentableError",
           "visible_matrix", "mask_from_flags", "check_seqlens", "check_window_size",
           "pack_bitmask", "unpack_bitmask"]

# A position beyond every query row on either side (rows are clipped to [0, seqlen_q]).
_FAR = 1 << 40


def check_seqlens(seqlen_q, seqlen_k) -> tuple[int, int]:
    """Validate a (seqlen_q, seqlen_k) pair: non-negative Python/NumPy integers."""
    out = []
    for name, value in (("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
        out.append(int(value))
    return out[0], out[1]


def aligned_positions(seqlen_q: int, seqlen_k: int) -> tuple[np.ndarray, np.ndarray]:
    """Aligned absolute positions as broadcastable (seqlen_q, 1) and (1, seqlen_k) int64 arrays."""
    qpos = np.arange(seqlen_q, dtype=np.int64)[:, None] + (seqlen_k - seqlen_q)
    kpos = np.arange(seqlen_k, dtype=np.int64)[None, :]
    return qpos, kpos


# ----------------------------------------------------------------------------- bitmask

def pack_bitmask(visible) -> np.ndarray:
    """Pack a bool visibility matrix (seqlen_q, seqlen_k) into the kernels' bitmask.

    Returns uint8 (seqlen_q, 4 * ceil(seqlen_k / 32)): ``np.packbits(visible, axis=1,
    bitorder="little")`` with each row zero-padded to a whole number of 32-bit words. Bit ``b``
    of byte ``k`` in row ``r`` is pair (r, 8k + b); 1 = visible. On a little-endian machine
    ``bits.view(np.uint32)`` gives (seqlen_q, ceil(seqlen_k / 32)) words where bit ``b`` of word
    ``w`` is column ``32w + b``.
    """
    visible = np.asarray(visible)
    if visible.dtype != bool or visible.ndim != 2:
        raise TypeError(f"visible must be a 2-D bool array, got {visible.dtype} with shape "
                        f"{visible.shape}")
    seqlen_q, seqlen_k = visible.shape
    row_bytes = 4 * ((seqlen_k + 31) // 32)
    bits = np.zeros((seqlen_q, row_bytes), dtype=np.uint8)
    if seqlen_k:
        packed = np.packbits(visible, axis=1, bitorder="little")
        bits[:, :packed.shape[1]] = packed
    return bits


def unpack_bitmask(bits, seqlen_k: int) -> np.ndarray:
    """Inverse of ``pack_bitmask``: uint8 (seqlen_q, row_bytes) -> bool (seqlen_q, seqlen_k)."""
    bits = np.asarray(bits)
    if bits.dtype != np.uint8 or bits.ndim != 2:
        raise TypeError(f"bits must be a 2-D uint8 array, got {bits.dtype} with shape "
                        f"{bits.shape}")
    if bits.shape[1] * 8 < seqlen_k:
        raise ValueError(f"bits rows hold {bits.shape[1] * 8} bits, fewer than seqlen_k "
                         f"({seqlen_k})")
    return np.unpackbits(bits, axis=1, count=seqlen_k, bitorder="little").astype(bool)


# ----------------------------------------------------------------------------- validation

def _check_int(owner: str, name: str, value, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{owner}: {name} must be an integer, got {type(value).__name__} "
                        f"{value!r}")
    if value < minimum:
        raise ValueError(f"{owner}: {name} must be >= {minimum}, got {value}")
    return int(value)


def _check_int_vector(owner: str, name: str, values, minimum: int | None = 0) -> np.ndarray:
    """A 1-D vector of integers (>= minimum unless None) as int64."""
    if isinstance(values, (str, bytes)) or np.isscalar(values):
        raise TypeError(f"{owner}: {name} must be a sequence of integers, got "
                        f"{type(values).__name__} {values!r}")
    try:
        arr = np.asarray(values)
    except ValueError:
        raise TypeError(f"{owner}: {name} must be a flat sequence of integers, got "
                        f"{values!r}") from None
    if arr.ndim != 1:
        raise ValueError(f"{owner}: {name} must be 1-D, got shape {arr.shape}")
    if arr.size and (arr.dtype == bool or not np.issubdtype(arr.dtype, np.integer)):
        raise TypeError(f"{owner}: {name} must hold integers, got dtype {arr.dtype}: "
                        f"{_short(arr)}")
    arr = arr.astype(np.int64)
    if minimum is not None and (arr < minimum).any():
        t = int(np.argmax(arr < minimum))
        raise ValueError(f"{owner}: {name} must be >= {minimum}, got {name}[{t}] = {arr[t]}")
    return arr


def _check_total(owner: str, name: str, total: int, seqlen_k: int) -> None:
    if total != seqlen_k:
        raise ValueError(f"{owner}: {name} must sum to seqlen_k ({seqlen_k}) - lengths are per "
                         f"sequence in the packed order along the keys - but they sum to {total}")


def _short(arr) -> str:
    return np.array2string(np.asarray(arr), threshold=16, separator=", ")


def _segment_of(pos: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Index of the segment holding each position (segments end at ``ends``, a cumulative sum
    of lengths); -1 for positions outside [0, ends[-1]). Empty segments hold nothing."""
    total = ends[-1] if len(ends) else 0
    idx = np.searchsorted(ends, pos, side="right")
    return np.where((pos >= 0) & (pos < total), idx, -1)


def _segment_bounds(lengths: np.ndarray):
    """Per-key (start, end) of the segment holding each key, int64 (sum(lengths),) each."""
    ends = np.cumsum(lengths)
    starts = ends - lengths
    return np.repeat(starts, lengths), np.repeat(ends, lengths)


# ----------------------------------------------------------------------------- base classes

class Mask:
    """Base class of every mask.

    Subclasses implement ``_visible`` (the meaning), ``__repr__``, ``_check_sizes`` when their
    parameters constrain the lengths, and ``_masked_runs`` (masked aligned positions per key
    column) when they have a column-interval form.
    """

    #: True when visibility depends on the batch index and query head (a user ``mask_mod``).
    depends_on_batch_head = False

    def _visible(self, qpos: np.ndarray, kpos: np.ndarray, seqlen_k: int) -> np.ndarray:
        raise NotImplementedError

    def _visible_bh(self, b: int, h: int, qpos: np.ndarray, kpos: np.ndarray,
                    seqlen_k: int) -> np.ndarray:
        """``_visible`` for batch ``b`` and query head ``h``; most masks ignore both."""
        return self._visible(qpos, kpos, seqlen_k)

    def _check_sizes(self, seqlen_q: int, seqlen_k: int) -> None:
        """Raise ValueError when the mask's parameters do not fit these sequence lengths."""

    def _masked_runs(self, seqlen_q: int, seqlen_k: int):
        """Masked aligned query positions of each key column as a few half-open runs.

        Returns (starts, ends), int64 (seqlen_k, m): column j masks positions
        [starts[j, t], ends[j, t]) for every t. O(seqlen_k).
        """
        raise NotRepresentableError(f"{self!r} has no column-interval form; use its bitmask "
                                    f"(to_bitmask) instead")

    def _column_intervals(self, seqlen_q: int, seqlen_k: int) -> ColumnIntervals:
        starts, ends = self._masked_runs(seqlen_q, seqlen_k)
        return intervals_from_position_runs(starts, ends, seqlen_q, seqlen_k, repr(self))

    def to_dense(self, seqlen_q: int, seqlen_k: int) -> np.ndarray:
        """Dense visibility: bool array (seqlen_q, seqlen_k), True where query i may see key j."""
        seqlen_q, seqlen_k = check_seqlens(seqlen_q, seqlen_k)
        self._check_sizes(seqlen_q, seqlen_k)
        qpos, kpos = aligned_positions(seqlen_q, seqlen_k)
        dense = np.broadcast_to(self._visible(qpos, kpos, seqlen_k), (seqlen_q, seqlen_k))
        return np.ascontiguousarray(dense, dtype=bool)

    def to_dense_bh(self, b: int, h: int, seqlen_q: int, seqlen_k: int) -> np.ndarray:
        """Dense visibility for batch ``b`` and query head ``h``: bool (seqlen_q, seqlen_k).
        Equal to ``to_dense`` unless ``depends_on_batch_head``."""
        seqlen_q, seqlen_k = check_seqlens(seqlen_q, seqlen_k)
        self._check_sizes(seqlen_q, seqlen_k)
        qpos, kpos = aligned_positions(seqlen_q, seqlen_k)
        dense = np.broadcast_to(self._visible_bh(int(b), int(h), qpos, kpos, seqlen_k),
                                (seqlen_q, seqlen_k))
        return np.ascontiguousarray(dense, dtype=bool)

    def column_intervals(self, seqlen_q: int, seqlen_k: int) -> ColumnIntervals:
        """Canonical column intervals (int32 vectors of length seqlen_k, rows in [0, seqlen_q]).

        Computed in O(seqlen_k) from the parameters. Raises NotRepresentableError when the mask
        has no such form at these lengths (then use ``to_bitmask``).
        """
        seqlen_q, seqlen_k = check_seqlens(seqlen_q, seqlen_k)
        self._check_sizes(seqlen_q, seqlen_k)
        return self._column_intervals(seqlen_q, seqlen_k)

    def to_bitmask(self, seqlen_q: int, seqlen_k: int) -> np.ndarray:
        """Packed visibility, uint8 (seqlen_q, 4 * ceil(seqlen_k / 32)); see ``pack_bitmask``."""
        return pack_bitmask(self.to_dense(seqlen_q, seqlen_k))

    def __and__(self, other: "Mask") -> "Mask":
        if not isinstance(other, Mask):
            return NotImplemented
        left = self.parts if isinstance(self, IntersectionMask) else (self,)
        right = other.parts if isinstance(other, IntersectionMask) else (other,)
        return IntersectionMask(left + right)


class IntersectionMask(Mask):
    """Pairs visible under every one of ``parts``.

    Column intervals: the union of the parts' masked rows per column, when that union still
    fits two intervals in every column (else NotRepresentableError naming the column).
    """

    def __init__(self, parts):
        self.parts = tuple(parts)
        if not self.parts or not all(isinstance(p, Mask) for p in self.parts):
            raise TypeError(f"IntersectionMask needs Mask parts, got {parts!r}")

    def _check_sizes(self, seqlen_q, seqlen_k):
        for part in self.parts:
            part._check_sizes(seqlen_q, seqlen_k)

    def _visible(self, qpos, kpos, seqlen_k):
        out = self.parts[0]._visible(qpos, kpos, seqlen_k)
        for part in self.parts[1:]:
            out = out & part._visible(qpos, kpos, seqlen_k)
        return out

    @property
    def depends_on_batch_head(self):
        return any(p.depends_on_batch_head for p in self.parts)

    def _visible_bh(self, b, h, qpos, kpos, seqlen_k):
        out = self.parts[0]._visible_bh(b, h, qpos, kpos, seqlen_k)
        for part in self.parts[1:]:
            out = out & part._visible_bh(b, h, qpos, kpos, seqlen_k)
        return out

    def _column_intervals(self, seqlen_q, seqlen_k):
        result = self.parts[0]._column_intervals(seqlen_q, seqlen_k)
        for part in self.parts[1:]:
            result = result.union(part._column_intervals(seqlen_q, seqlen_k), repr(self))
        return result

    def __repr__(self):
        return " & ".join(repr(p) for p in self.parts)


class _SpanMask(Mask):
    """A mask whose visible positions in each key column form one interval [lo_j, hi_j)."""

    def _visible_span(self, seqlen_q: int, seqlen_k: int):
        """(lo, hi) int64 (seqlen_k,): column j is visible exactly at positions [lo_j, hi_j)."""
        raise NotImplementedError

    def _masked_runs(self, seqlen_q, seqlen_k):
        lo, hi = self._visible_span(seqlen_q, seqlen_k)
        starts = np.stack([np.full(seqlen_k, -_FAR, dtype=np.int64), hi], axis=1)
        ends = np.stack([lo, np.full(seqlen_k, _FAR, dtype=np.int64)], axis=1)
        return starts, ends


# ----------------------------------------------------------------------------- implicit masks

class CausalMask(_SpanMask):
    """Visible iff ``j <= i`` (aligned positions).

    Column intervals: UT = rows of positions [.., j), LT empty.
    """

    def _visible(self, qpos, kpos, seqlen_k):
        return kpos <= qpos

    def _visible_span(self, seqlen_q, seqlen_k):
        j = np.arange(seqlen_k, dtype=np.int64)
        return j, np.full(seqlen_k, _FAR, dtype=np.int64)

    def __repr__(self):
        return "causal()"


class SlidingWindowMask(_SpanMask):
    """Visible iff ``i - left <= j <= i + right``; -1 leaves that side unbounded.

    With ``sinks > 0`` the first ``sinks`` keys also stay visible to every query that may see them
    causally (``j < sinks and j <= i``), alongside the window (StreamingLLM attention sinks).
    Parameters: left, right >= -1; sinks >= 0. Column j is visible at positions
    [j - right, j + left] (the sink columns at [j - right, ..)).
    """

    def __init__(self, left: int = -1, right: int = -1, sinks: int = 0):
        for name, value in (("left", left), ("right", right), ("sinks", sinks)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"sliding_window {name} must be an integer, got {value!r}")
        if left < -1 or right < -1:
            raise ValueError(f"window_size must be (left, right) with each >= -1 (-1 = unbounded), "
                             f"got ({left}, {right})")
        if sinks < 0:
            raise ValueError(f"sinks must be >= 0, got {sinks}")
        self.left, self.right, self.sinks = int(left), int(right), int(sinks)

    def _visible(self, qpos, kpos, seqlen_k):
        visible = np.ones(np.broadcast_shapes(qpos.shape, kpos.shape), dtype=bool)
        if self.left >= 0:
            visible &= kpos >= qpos - self.left
        if self.right >= 0:
            visible &= kpos <= qpos + self.right
        if self.sinks > 0:
            visible |= (kpos < self.sinks) & (kpos <= qpos)
        return visible

    def _visible_span(self, seqlen_q, seqlen_k):
        j = np.arange(seqlen_k, dtype=np.int64)
        lo = j - self.right if self.right >= 0 else np.full(seqlen_k, -_FAR, dtype=np.int64)
        hi = j + self.left + 1 if self.left >= 0 else np.full(seqlen_k, _FAR, dtype=np.int64)
        # A sink column adds [j, ..) to a window that already contains j: one span [lo, ..).
        return lo, np.where(j < self.sinks, _FAR, hi)

    def __repr__(self):
        extra = f", sinks={self.sinks}" if self.sinks else ""
        return f"sliding_window({self.left}, {self.right}{extra})"


# ----------------------------------------------------------------------------- document masks

class _DocumentsMixin:
    """Holds ``doc_lengths`` (validated) and checks they sum to seqlen_k."""

    _owner = ""

    def _set_docs(self, doc_lengths):
        self.doc_lengths = _check_int_vector(self._owner, "doc_lengths", doc_lengths)
        self._doc_ends = np.cumsum(self.doc_lengths)

    def _check_sizes(self, seqlen_q, seqlen_k):
        _check_total(self._owner, "doc_lengths", int(self.doc_lengths.sum()), seqlen_k)

    def _same_doc(self, qpos, kpos):
        dq = _segment_of(qpos, self._doc_ends)
        dk = _segment_of(kpos, self._doc_ends)
        return (dq == dk) & (dk >= 0)


class CausalDocumentMask(_DocumentsMixin, _SpanMask):
    """Packed causal documents: visible iff ``j <= i`` and ``doc(i) == doc(j)``.

    doc_lengths: non-negative integers, the document lengths along the key sequence in packed
    order (empty documents allowed), summing to seqlen_k. Column j of document [s, e) is visible
    at positions [j, e): UT = [.., j), LT = [e, ..).
    """

    _owner = "causal_document"

    def __init__(self, doc_lengths):
        self._set_docs(doc_lengths)

    def _visible(self, qpos, kpos, seqlen_k):
        return self._same_doc(qpos, kpos) & (kpos <= qpos)

    def _visible_span(self, seqlen_q, seqlen_k):
        _, end = _segment_bounds(self.doc_lengths)
        return np.arange(seqlen_k, dtype=np.int64), end

    def __repr__(self):
        return f"causal_document({_short(self.doc_lengths)})"


class DocumentMask(_DocumentsMixin, _SpanMask):
    """Bidirectional documents: visible iff ``doc(i) == doc(j)``.

    doc_lengths as in CausalDocumentMask. Column j of document [s, e) is visible at positions
    [s, e): UT = [.., s), LT = [e, ..).
    """

    _owner = "document"

    def __init__(self, doc_lengths):
        self._set_docs(doc_lengths)

    def _visible(self, qpos, kpos, seqlen_k):
        return self._same_doc(qpos, kpos)

    def _visible_span(self, seqlen_q, seqlen_k):
        return _segment_bounds(self.doc_lengths)

    def __repr__(self):
        return f"document({_short(self.doc_lengths)})"


class SharedQuestionMask(_DocumentsMixin, _SpanMask):
    """Shared-question packing (DPO / reward models): each document is a question followed by
    its answers; visible iff ``j <= i``, ``doc(i) == doc(j)`` and (j is in the document's question
    or i and j are in the same answer).

    doc_lengths: document lengths (sum seqlen_k). question_lengths: one per document.
    answer_lengths: one list per document (possibly empty) of that document's answer lengths;
    ``question_lengths[d] + sum(answer_lengths[d]) == doc_lengths[d]``. All >= 0.
    Column j in the question of document [s, e) is visible at [j, e); in an answer [a, b) at
    [j, b).
    """

    _owner = "shared_question"

    def __init__(self, doc_lengths, question_lengths, answer_lengths):
        self._set_docs(doc_lengths)
        questions = _check_int_vector(self._owner, "question_lengths", question_lengths)
        if isinstance(answer_lengths, (str, bytes)) or not hasattr(answer_lengths, "__len__"):
            raise TypeError(f"{self._owner}: answer_lengths must be a list with one list of "
                            f"answer lengths per document, got {answer_lengths!r}")
        n = len(self.doc_lengths)
        if len(questions) != n or len(answer_lengths) != n:
            raise ValueError(f"{self._owner}: doc_lengths, question_lengths and answer_lengths "
                             f"need one entry per document, got {n}, {len(questions)} and "
                             f"{len(answer_lengths)}")
        answers = [_check_int_vector(self._owner, f"answer_lengths[{d}]", a)
                   for d, a in enumerate(answer_lengths)]
        for d in range(n):
            total = int(questions[d] + answers[d].sum())
            if total != self.doc_lengths[d]:
                raise ValueError(f"{self._owner}: document {d} has doc_lengths[{d}] = "
                                 f"{self.doc_lengths[d]} but question_lengths[{d}] + "
                                 f"sum(answer_lengths[{d}]) = {total}")
        self.question_lengths = questions
        self.answer_lengths = [a.tolist() for a in answers]
        # Flat segments in packed order: question of doc 0, its answers, question of doc 1, ...
        seg_len, seg_doc, seg_q = [], [], []
        for d in range(n):
            seg_len += [int(questions[d])] + answers[d].tolist()
            seg_doc += [d] * (1 + len(answers[d]))
            seg_q += [True] + [False] * len(answers[d])
        self._seg_lengths = np.array(seg_len, dtype=np.int64)
        self._seg_ends = np.cumsum(self._seg_lengths)
        self._seg_is_question = np.array(seg_q, dtype=bool)

    def _visible(self, qpos, kpos, seqlen_k):
        sq = _segment_of(qpos, self._seg_ends)
        sk = _segment_of(kpos, self._seg_ends)
        key_in_question = self._seg_is_question[np.maximum(sk, 0)] & (sk >= 0)
        return (kpos <= qpos) & self._same_doc(qpos, kpos) & (key_in_question | (sq == sk))

    def _visible_span(self, seqlen_q, seqlen_k):
        _, doc_end = _segment_bounds(self.doc_lengths)
        _, seg_end = _segment_bounds(self._seg_lengths)
        in_question = np.repeat(self._seg_is_question, self._seg_lengths)
        return np.arange(seqlen_k, dtype=np.int64), np.where(in_question, doc_end, seg_end)

    def __repr__(self):
        return (f"shared_question({_short(self.doc_lengths)}, {_short(self.question_lengths)}, "
                f"{self.answer_lengths if len(self.answer_lengths) <= 8 else '[...]'})")


class PrefixLMDocumentMask(_DocumentsMixin, _SpanMask):
    """Prefix-LM per packed document: visible iff ``doc(i) == doc(j)`` and (j is in the document's
    prefix or ``j <= i``).

    doc_lengths as in CausalDocumentMask; prefix_lengths: one per document, 0 <= prefix_lengths[d]
    <= doc_lengths[d]. Column j of document [s, e) is visible at [s, e) if j < s + prefix, else
    at [j, e).
    """

    _owner = "prefix_lm_document"

    def __init__(self, doc_lengths, prefix_lengths):
        self._set_docs(doc_lengths)
        prefix = _check_int_vector(self._owner, "prefix_lengths", prefix_lengths)
        if len(prefix) != len(self.doc_lengths):
            raise ValueError(f"{self._owner}: prefix_lengths needs one entry per document "
                             f"({len(self.doc_lengths)}), got {len(prefix)}")
        if (prefix > self.doc_lengths).any():
            d = int(np.argmax(prefix > self.doc_lengths))
            raise ValueError(f"{self._owner}: prefix_lengths[{d}] = {prefix[d]} exceeds "
                             f"doc_lengths[{d}] = {self.doc_lengths[d]}")
        self.prefix_lengths = prefix
        self._prefix_ends = self._doc_ends - self.doc_lengths + prefix

    def _visible(self, qpos, kpos, seqlen_k):
        dk = _segment_of(kpos, self._doc_ends)
        in_prefix = (dk >= 0) & (kpos < self._prefix_ends[np.maximum(dk, 0)])
        return self._same_doc(qpos, kpos) & (in_prefix | (kpos <= qpos))

    def _visible_span(self, seqlen_q, seqlen_k):
        start, end = _segment_bounds(self.doc_lengths)
        j = np.arange(seqlen_k, dtype=np.int64)
        prefix_end = np.repeat(self._prefix_ends, self.doc_lengths)
        return np.where(j < prefix_end, start, j), end

    def __repr__(self):
        return f"prefix_lm_document({_short(self.doc_lengths)}, {_short(self.prefix_lengths)})"


class CausalBlockwiseMask(_SpanMask):
    """In-context learning blocks: visible iff ``j <= i`` and (i and j are in the same
    demonstration block, or i is in the final test block).

    block_lengths: lengths (>= 0) of the demonstration blocks in packed order; test_length (>= 0):
    length of the final test block; ``sum(block_lengths) + test_length == seqlen_k``. With the
    test block starting at T, column j of a demonstration block [s, e) is masked at [.., j) and
    [e, T); a test column at [.., j) only.
    """

    _owner = "causal_blockwise"

    def __init__(self, block_lengths, test_length):
        self.block_lengths = _check_int_vector(self._owner, "block_lengths", block_lengths)
        self.test_length = _check_int(self._owner, "test_length", test_length)
        self._seg_lengths = np.append(self.block_lengths, self.test_length)
        self._seg_ends = np.cumsum(self._seg_lengths)
        self._test_start = int(self.block_lengths.sum())

    def _check_sizes(self, seqlen_q, seqlen_k):
        _check_total(self._owner, "sum(block_lengths) + test_length",
                     int(self._seg_lengths.sum()), seqlen_k)

    def _visible(self, qpos, kpos, seqlen_k):
        same = _segment_of(qpos, self._seg_ends) == _segment_of(kpos, self._seg_ends)
        return (kpos <= qpos) & (same | (qpos >= self._test_start))

    def _masked_runs(self, seqlen_q, seqlen_k):
        j = np.arange(seqlen_k, dtype=np.int64)
        _, end = _segment_bounds(self._seg_lengths)
        starts = np.stack([np.full(seqlen_k, -_FAR), end], axis=1)
        ends = np.stack([j, np.full(seqlen_k, self._test_start)], axis=1)
        return starts, ends

    def __repr__(self):
        return f"causal_blockwise({_short(self.block_lengths)}, {self.test_length})"


# ----------------------------------------------------------------------------- other masks

class GlobalSlidingWindowMask(Mask):
    """Global tokens plus a symmetric sliding window (BigBird-like): visible iff ``i < G`` or
    ``j < G`` or ``|i - j| < w``.

    num_global G >= 0, window w >= 0 (w = 1 keeps only the diagonal, w = 0 no window). Column
    j < G is fully visible; column j >= G masks [G, j - w + 1) (UT) and [j + w, ..) (LT).
    """

    _owner = "global_sliding_window"

    def __init__(self, num_global, window):
        self.num_global = _check_int(self._owner, "num_global", num_global)
        self.window = _check_int(self._owner, "window", window)

    def _visible(self, qpos, kpos, seqlen_k):
        g, w = self.num_global, self.window
        return (qpos < g) | (kpos < g) | (np.abs(qpos - kpos) < w)

    def _masked_runs(self, seqlen_q, seqlen_k):
        j = np.arange(seqlen_k, dtype=np.int64)
        g, w = self.num_global, self.window
        global_col = j < g
        starts = np.stack([np.full(seqlen_k, g), j + w], axis=1)
        ends = np.stack([j - w + 1, np.full(seqlen_k, _FAR)], axis=1)
        starts[global_col] = 0
        ends[global_col] = 0
        return starts, ends

    def __repr__(self):
        return f"global_sliding_window({self.num_global}, {self.window})"


class PrefixLMCausalMask(_SpanMask):
    """Prefix LM: visible iff ``j < P`` or ``j <= i``.

    prefix_length P: 0 <= P <= seqlen_k. Column j < P is fully visible; others at [j, ..).
    """

    _owner = "prefix_lm_causal"

    def __init__(self, prefix_length):
        self.prefix_length = _check_int(self._owner, "prefix_length", prefix_length)

    def _check_sizes(self, seqlen_q, seqlen_k):
        if self.prefix_length > seqlen_k:
            raise ValueError(f"{self._owner}: prefix_length ({self.prefix_length}) exceeds "
                             f"seqlen_k ({seqlen_k})")

    def _visible(self, qpos, kpos, seqlen_k):
        return (kpos < self.prefix_length) | (kpos <= qpos)

    def _visible_span(self, seqlen_q, seqlen_k):
        j = np.arange(seqlen_k, dtype=np.int64)
        return np.where(j < self.prefix_length, -_FAR, j), np.full(seqlen_k, _FAR)

    def __repr__(self):
        return f"prefix_lm_causal({self.prefix_length})"


class QKSparseMask(Mask):
    """Causal attention with dropped keys and a dropped query range: visible iff ``j <= i``,
    key j is not in ``dropped_keys`` and not ``start <= i < end`` for ``dropped_rows=(start,
    end)``.

    dropped_keys: key indices in [0, seqlen_k) (duplicates allowed). dropped_rows: (start, end)
    of aligned query positions, 0 <= start <= end <= seqlen_k (equal to query rows when
    seqlen_q == seqlen_k); None drops none. Column j masks [.., j) and [start, end), or every row
    if dropped.
    """

    _owner = "qk_sparse"

    def __init__(self, dropped_keys=(), dropped_rows=None):
        self.dropped_keys = np.unique(_check_int_vector(self._owner, "dropped_keys",
                                                        dropped_keys))
        if dropped_rows is None:
            dropped_rows = (0, 0)
        try:
            start, end = dropped_rows
        except (TypeError, ValueError):
            raise TypeError(f"{self._owner}: dropped_rows must be a pair (start, end), got "
                            f"{dropped_rows!r}") from None
        start = _check_int(self._owner, "dropped_rows start", start)
        end = _check_int(self._owner, "dropped_rows end", end)
        if end < start:
            raise ValueError(f"{self._owner}: dropped_rows must have start <= end, got "
                             f"{dropped_rows!r}")
        self.dropped_rows = (start, end)

    def _check_sizes(self, seqlen_q, seqlen_k):
        if len(self.dropped_keys) and self.dropped_keys[-1] >= seqlen_k:
            raise ValueError(f"{self._owner}: dropped_keys must lie in [0, seqlen_k = "
                             f"{seqlen_k}), got key {self.dropped_keys[-1]}")
        if self.dropped_rows[1] > seqlen_k:
            raise ValueError(f"{self._owner}: dropped_rows {self.dropped_rows} must end at or "
                             f"before seqlen_k ({seqlen_k})")

    def _visible(self, qpos, kpos, seqlen_k):
        start, end = self.dropped_rows
        return ((kpos <= qpos) & ~np.isin(kpos, self.dropped_keys)
                & ~((qpos >= start) & (qpos < end)))

    def _masked_runs(self, seqlen_q, seqlen_k):
        j = np.arange(seqlen_k, dtype=np.int64)
        dropped = np.zeros(seqlen_k, dtype=bool)
        dropped[self.dropped_keys] = True
        start, end = self.dropped_rows
        starts = np.stack([np.full(seqlen_k, -_FAR), np.full(seqlen_k, start),
                           np.where(dropped, -_FAR, 0)], axis=1)
        ends = np.stack([j, np.full(seqlen_k, end), np.where(dropped, _FAR, 0)], axis=1)
        return starts, ends

    def __repr__(self):
        return f"qk_sparse({_short(self.dropped_keys)}, {self.dropped_rows})"


class RandomEvictionMask(_SpanMask):
    """KV eviction: visible iff ``j <= i < evict(j)``.

    evict_rows: one integer per key, in [0, seqlen_k]: the first aligned query position that no
    longer sees key j (seqlen_k = never evicted; a value <= j means key j is never visible).
    Column j is visible at [j, evict(j)).
    """

    _owner = "random_eviction"

    def __init__(self, evict_rows):
        self.evict_rows = _check_int_vector(self._owner, "evict_rows", evict_rows)

    def _check_sizes(self, seqlen_q, seqlen_k):
        if len(self.evict_rows) != seqlen_k:
            raise ValueError(f"{self._owner}: evict_rows needs one entry per key (seqlen_k = "
                             f"{seqlen_k}), got {len(self.evict_rows)}")
        if (self.evict_rows > seqlen_k).any():
            j = int(np.argmax(self.evict_rows > seqlen_k))
            raise ValueError(f"{self._owner}: evict_rows must be <= seqlen_k ({seqlen_k}), got "
                             f"evict_rows[{j}] = {self.evict_rows[j]}")

    def _visible(self, qpos, kpos, seqlen_k):
        return (kpos <= qpos) & (qpos < self.evict_rows[kpos])

    def _visible_span(self, seqlen_q, seqlen_k):
        return np.arange(seqlen_k, dtype=np.int64), self.evict_rows

    def __repr__(self):
        return f"random_eviction({_short(self.evict_rows)})"


class TreeMask(_SpanMask):
    """Speculative-decoding draft tree after a context prefix.

    parents: one entry per tree node, ``parents[0] == -1`` (the root) and
    ``0 <= parents[t] < t`` for t >= 1. prefix_length P >= 0. The tree's nodes are the last
    ``len(parents)`` key positions, node t at position P + t, so seqlen_k must equal
    P + len(parents). Visible iff (``j < P`` and ``j <= i``) or (j is i or an ancestor of i).

    Column intervals exist when the nodes are in DFS preorder (every subtree is a contiguous
    range [t, t + size_t)): node column P + t is visible at [P + t, P + t + size_t), a prefix
    column j at [j, ..). Otherwise ``column_intervals`` raises NotRepresentableError.
    """

    _owner = "tree"

    def __init__(self, parents, prefix_length=0):
        parents = _check_int_vector(self._owner, "parents", parents, minimum=-1)
        if len(parents) == 0:
            raise ValueError(f"{self._owner}: parents must list at least one node (the root)")
        if parents[0] != -1:
            raise ValueError(f"{self._owner}: parents[0] must be -1 (node 0 is the root), got "
                             f"{parents[0]}")
        t = np.arange(len(parents))
        bad = (parents >= t) | ((parents < 0) & (t > 0))
        if bad.any():
            k = int(np.argmax(bad))
            raise ValueError(f"{self._owner}: parents[{k}] = {parents[k]}; every node after the "
                             f"root needs a parent index in [0, {k})")
        self.parents = parents
        self.prefix_length = _check_int(self._owner, "prefix_length", prefix_length)
        n = len(parents)
        size = np.ones(n, dtype=np.int64)
        last = np.arange(n, dtype=np.int64)   # largest index in each subtree
        for node in range(n - 1, 0, -1):
            p = parents[node]
            size[p] += size[node]
            last[p] = max(last[p], last[node])
        self._subtree_size = size
        self._contiguous = last == t + size - 1

    @property
    def is_preorder(self) -> bool:
        """True when the nodes are in DFS preorder (every subtree a contiguous index range)."""
        return bool(self._contiguous.all())

    def _check_sizes(self, seqlen_q, seqlen_k):
        if seqlen_k != self.prefix_length + len(self.parents):
            raise ValueError(f"{self._owner}: seqlen_k ({seqlen_k}) must equal prefix_length "
                             f"({self.prefix_length}) + len(parents) ({len(self.parents)})")

    def ancestor_matrix(self) -> np.ndarray:
        """bool (n, n): [a, b] True iff node b is node a or one of its ancestors."""
        n = len(self.parents)
        anc = np.zeros((n, n), dtype=bool)
        for node in range(n):
            if node:
                anc[node] = anc[self.parents[node]]
            anc[node, node] = True
        return anc

    def _visible(self, qpos, kpos, seqlen_k):
        n, p = len(self.parents), self.prefix_length
        tq, tk = qpos - p, kpos - p
        in_tree = (tq >= 0) & (tq < n) & (tk >= 0) & (tk < n)
        anc = self.ancestor_matrix()[np.clip(tq, 0, n - 1), np.clip(tk, 0, n - 1)]
        return ((kpos < p) & (kpos <= qpos)) | (in_tree & anc)

    def _visible_span(self, seqlen_q, seqlen_k):
        if not self.is_preorder:
            t = int(np.argmin(self._contiguous))
            raise NotRepresentableError(
                f"{self!r} has no column-interval form: its nodes are not in DFS preorder "
                f"(the subtree of node {t} is not a contiguous range of nodes); renumber the "
                f"nodes in DFS preorder, or use the bitmask (to_bitmask / from_dense)")
        j = np.arange(seqlen_k, dtype=np.int64)
        hi = np.concatenate([np.full(self.prefix_length, _FAR, dtype=np.int64),
                             j[self.prefix_length:] + self._subtree_size])
        return j, hi

    def __repr__(self):
        return f"tree({_short(self.parents)}, prefix_length={self.prefix_length})"


class DenseMask(Mask):
    """An arbitrary user mask given as a dense bool matrix (seqlen_q, seqlen_k), True = visible.

    Stored packed, 1 bit per pair, exactly as the kernels read it (see ``pack_bitmask``):
    ``bits`` is uint8 (seqlen_q, 4 * ceil(seqlen_k / 32)). It fits only those lengths. Column
    intervals are derived from the matrix when every column masks at most two runs of rows.
    """

    _owner = "from_dense"

    def __init__(self, visible):
        arr = np.asarray(visible)
        if arr.dtype != bool:
            raise TypeError(f"{self._owner}: matrix must be a bool array (True = visible), got "
                            f"dtype {arr.dtype}")
        if arr.ndim != 2:
            raise ValueError(f"{self._owner}: matrix must be 2-D (seqlen_q, seqlen_k), got shape "
                             f"{arr.shape}")
        self.seqlen_q, self.seqlen_k = arr.shape
        self.bits = pack_bitmask(arr)
        self._matrix = None

    def _check_sizes(self, seqlen_q, seqlen_k):
        if (seqlen_q, seqlen_k) != (self.seqlen_q, self.seqlen_k):
            raise ValueError(f"{self._owner}: this mask was built for (seqlen_q, seqlen_k) = "
                             f"({self.seqlen_q}, {self.seqlen_k}), got ({seqlen_q}, {seqlen_k})")

    def matrix(self) -> np.ndarray:
        """The visibility matrix, bool (seqlen_q, seqlen_k), read-only (unpacked once, cached:
        the online softmax asks for it tile by tile)."""
        if self._matrix is None:
            self._matrix = unpack_bitmask(self.bits, self.seqlen_k)
            self._matrix.flags.writeable = False
        return self._matrix

    def _visible(self, qpos, kpos, seqlen_k):
        rows = qpos - (seqlen_k - self.seqlen_q)
        return self.matrix()[rows, kpos]

    def _column_intervals(self, seqlen_q, seqlen_k):
        return intervals_from_dense(self.matrix())

    def to_bitmask(self, seqlen_q, seqlen_k):
        seqlen_q, seqlen_k = check_seqlens(seqlen_q, seqlen_k)
        self._check_sizes(seqlen_q, seqlen_k)
        return self.bits.copy()

    def __repr__(self):
        return f"from_dense(<{self.seqlen_q}x{self.seqlen_k} matrix>)"


class ColumnIntervalMask(Mask):
    """A user mask given directly as column intervals: query row r is masked for key j iff
    ``lts[j] <= r < lte[j]`` or ``uts[j] <= r < ute[j]``.

    lts, lte, uts, ute: integer vectors of length seqlen_k with 0 <= start <= end <= seqlen_q;
    seqlen_q defaults to the vectors' length. Rows are query-row indices (not positions), so the
    mask fits only those lengths.
    """

    _owner = "column_intervals"

    def __init__(self, lts, lte, uts, ute, seqlen_q=None):
        if seqlen_q is None:
            seqlen_q = len(np.asarray(lts))
        self.intervals = ColumnIntervals(lts, lte, uts, ute, seqlen_q)

    def _check_sizes(self, seqlen_q, seqlen_k):
        shape = (self.intervals.seqlen_q, self.intervals.seqlen_k)
        if (seqlen_q, seqlen_k) != shape:
            raise ValueError(f"{self._owner}: this mask was built for (seqlen_q, seqlen_k) = "
                             f"{shape}, got ({seqlen_q}, {seqlen_k})")

    def _visible(self, qpos, kpos, seqlen_k):
        iv = self.intervals
        rows = qpos - (seqlen_k - iv.seqlen_q)
        masked = (((iv.lts[kpos] <= rows) & (rows < iv.lte[kpos]))
                  | ((iv.uts[kpos] <= rows) & (rows < iv.ute[kpos])))
        return ~masked

    def _column_intervals(self, seqlen_q, seqlen_k):
        return self.intervals.canonical()

    def __repr__(self):
        return f"column_intervals(<{self.intervals.seqlen_q}x{self.intervals.seqlen_k}>)"


class MaskModMask(Mask):
    """A mask given as a plain Python predicate ``fn(b, h, q_idx, kv_idx) -> bool`` (FlexAttention's
    ``mask_mod``): True = visible.

    ``q_idx`` is the query's aligned position (row + seqlen_k - seqlen_q: the row index when
    seqlen_q == seqlen_k, negative for the extra rows when seqlen_q > seqlen_k), ``kv_idx`` the
    key index, ``b`` the batch index and ``h`` the query head. The reference calls ``fn`` once on
    broadcast int64 arrays when it can (a body of comparisons, ``&``, ``|`` and array indexing
    vectorises), else once per pair with Python ints; the GPU compiles the same function with
    Numba. With ``batch_head=False`` the mask is the same for every (b, h) (``fn`` is called with
    b = h = 0), so it has a dense form and its tile table is computed once.
    """

    def __init__(self, fn, batch_head: bool = False):
        if not callable(fn):
            raise TypeError(f"mask_mod: fn must be a callable fn(b, h, q_idx, kv_idx) -> bool, got "
                            f"{type(fn).__name__} {fn!r}")
        if not isinstance(batch_head, (bool, np.bool_)):
            raise TypeError(f"mask_mod: batch_head must be a bool, got {batch_head!r}")
        self.fn = fn
        self.batch_head = bool(batch_head)

    @property
    def depends_on_batch_head(self):
        return self.batch_head

    def _visible(self, qpos, kpos, seqlen_k):
        if self.batch_head:
            raise ValueError(f"{self!r} depends on (b, h): use to_dense_bh(b, h, seqlen_q, "
                             f"seqlen_k), or build it with batch_head=False")
        return self._visible_bh(0, 0, qpos, kpos, seqlen_k)

    def _visible_bh(self, b, h, qpos, kpos, seqlen_k):
        return call_elementwise(self.fn, (b, h, qpos, kpos), "bui") != 0

    def __repr__(self):
        name = getattr(self.fn, "__name__", type(self.fn).__name__)
        return f"mask_mod({name}, batch_head={self.batch_head})"


# ----------------------------------------------------------------------------- flags

def check_window_size(window_size) -> tuple[int, int]:
    """Validate ``window_size=(left, right)`` (-1 = unbounded) and return it as two ints."""
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise TypeError(f"window_size must be a pair (left, right), got {window_size!r}") from None
    for value in (left, right):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"window_size must hold two integers, got {window_size!r}")
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be >= -1 (-1 = unbounded), got {window_size!r}")
    return int(left), int(right)


def mask_from_flags(causal: bool = False, window_size=(-1, -1), sinks: int = 0,
                    mask: Mask | None = None) -> Mask | None:
    """The one mask meant by flash-attn style flags plus an optional mask object.

    ``causal`` is the window (left, 0); ``sinks`` only matters with a bounded window (without one,
    every key a sink could add is visible already). Returns None when every pair is visible.
    """
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    left, right = check_window_size(window_size)
    if isinstance(sinks, bool) or not isinstance(sinks, (int, np.integer)) or sinks < 0:
        raise ValueError(f"sinks must be an integer >= 0, got {sinks!r}")
    if mask is not None and not isinstance(mask, Mask):
        raise TypeError(f"mask must be a numba_flash.masks object (see numba_flash.masks), "
                        f"got {type(mask).__name__}")
    if causal:
        right = 0 if right < 0 else min(right, 0)
    implicit = None
    if causal and left < 0 and right == 0:
        implicit = CausalMask()
    elif left >= 0 or right >= 0:
        implicit = SlidingWindowMask(left, right, int(sinks) if left >= 0 else 0)
    if implicit is None:
        return mask
    return implicit if mask is None else implicit & mask


def visible_matrix(seqlen_q: int, seqlen_k: int, *, causal=False, window_size=(-1, -1), sinks=0,
                   mask: Mask | None = None) -> np.ndarray:
    """Dense bool (seqlen_q, seqlen_k) visibility of the flags and mask together."""
    combined = mask_from_flags(causal, window_size, sinks, mask)
    if combined is None:
        seqlen_q, seqlen_k = check_seqlens(seqlen_q, seqlen_k)
        return np.ones((seqlen_q, seqlen_k), dtype=bool)
    return combined.to_dense(seqlen_q, seqlen_k)
