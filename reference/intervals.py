"""Column intervals: FlashMask's O(N) encoding of a mask (seed 003), in query-row index space.

For every key column ``j`` the *masked* query rows are ``[lts[j], lte[j]) U [uts[j], ute[j])``;
every other row of that column is visible. Rows are query-row indices ``r`` in ``[0, seqlen_q]``
(not aligned positions: row ``r`` sits at aligned position ``r + seqlen_k - seqlen_q``). An
interval with ``start == end`` is empty.

Canonical form (what every ``Mask.column_intervals`` and ``intervals_from_dense`` return): the
masked rows of a column are split into maximal runs of consecutive rows; there are at most two.

* two runs: ``[uts, ute)`` is the upper one (smaller rows), ``[lts, lte)`` the lower one;
* one run: it is the UT interval if it starts at or above the column's diagonal row
  ``d_j = j - (seqlen_k - seqlen_q)`` (``start <= d_j``), else the LT interval;
* an empty UT interval is stored as ``(0, 0)``, an empty LT interval as ``(seqlen_q, seqlen_q)``.

So "UT" is the part of the mask in the upper-right triangle (rows above the diagonal, the part
causality removes) and "LT" the part in the lower-left triangle.
"""
from __future__ import annotations

import numpy as np

__all__ = ["NotRepresentableError", "ColumnIntervals", "intervals_from_dense",
           "intervals_from_runs", "intervals_from_position_runs"]

_FIELDS = ("lts", "lte", "uts", "ute")


class NotRepresentableError(ValueError):
    """A mask has no column-interval form (some column masks more than two runs of rows)."""


def _as_index_vector(name: str, value) -> np.ndarray:
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D vector of integers, got shape {arr.shape}")
    if arr.size and (arr.dtype == bool or not np.issubdtype(arr.dtype, np.integer)):
        raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    return arr.astype(np.int64)


class ColumnIntervals:
    """Masked query rows per key column: ``[lts_j, lte_j) U [uts_j, ute_j)``.

    Parameters
    ----------
    lts, lte, uts, ute : 1-D integer vectors, all of length ``seqlen_k``; stored as int32.
    seqlen_q : int, the number of query rows; every value must satisfy
        ``0 <= start <= end <= seqlen_q``.

    The vectors are kept as given (overlapping or non-canonical intervals are allowed);
    ``canonical()`` returns the canonical form described in the module docstring.
    """

    __hash__ = None

    def __init__(self, lts, lte, uts, ute, seqlen_q: int):
        if isinstance(seqlen_q, bool) or not isinstance(seqlen_q, (int, np.integer)):
            raise TypeError(f"seqlen_q must be an integer, got {seqlen_q!r}")
        if seqlen_q < 0:
            raise ValueError(f"seqlen_q must be >= 0, got {seqlen_q}")
        vecs = [_as_index_vector(n, v) for n, v in zip(_FIELDS, (lts, lte, uts, ute))]
        lengths = {len(v) for v in vecs}
        if len(lengths) != 1:
            raise ValueError("lts, lte, uts, ute must have one length (seqlen_k), got "
                             + ", ".join(f"{n}: {len(v)}" for n, v in zip(_FIELDS, vecs)))
        for (sname, start), (ename, end) in (((_FIELDS[0], vecs[0]), (_FIELDS[1], vecs[1])),
                                             ((_FIELDS[2], vecs[2]), (_FIELDS[3], vecs[3]))):
            bad = (start < 0) | (start > end) | (end > seqlen_q)
            if bad.any():
                j = int(np.argmax(bad))
                raise ValueError(f"column intervals need 0 <= {sname} <= {ename} <= seqlen_q "
                                 f"({seqlen_q}); column {j} has {sname}={start[j]}, "
                                 f"{ename}={end[j]}")
        self.seqlen_q = int(seqlen_q)
        self.lts, self.lte, self.uts, self.ute = (v.astype(np.int32) for v in vecs)

    @property
    def seqlen_k(self) -> int:
        """Number of key columns (the length of each vector)."""
        return len(self.lts)

    def stacked(self) -> np.ndarray:
        """The four vectors as one contiguous int32 array (4, seqlen_k): lts, lte, uts, ute."""
        return np.ascontiguousarray(np.stack([self.lts, self.lte, self.uts, self.ute]))

    def masked_dense(self) -> np.ndarray:
        """Dense masked pairs: bool (seqlen_q, seqlen_k), True where query row r may NOT see j."""
        rows = np.arange(self.seqlen_q, dtype=np.int64)[:, None]
        return (((self.lts <= rows) & (rows < self.lte))
                | ((self.uts <= rows) & (rows < self.ute)))

    def to_dense(self) -> np.ndarray:
        """Dense visibility: bool (seqlen_q, seqlen_k), True where query row r may see key j."""
        return ~self.masked_dense()

    def canonical(self) -> "ColumnIntervals":
        """The same masked rows in canonical form (see the module docstring)."""
        starts = np.stack([self.uts, self.lts], axis=1)
        ends = np.stack([self.ute, self.lte], axis=1)
        return intervals_from_runs(starts, ends, self.seqlen_q, "these column intervals")

    def union(self, other: "ColumnIntervals", what: str = "the intersection") -> "ColumnIntervals":
        """Masked rows of ``self`` or ``other`` (visibility intersected), canonical form.

        Raises NotRepresentableError when some column then masks more than two runs of rows.
        """
        if not isinstance(other, ColumnIntervals):
            raise TypeError(f"other must be ColumnIntervals, got {type(other).__name__}")
        if (other.seqlen_q, other.seqlen_k) != (self.seqlen_q, self.seqlen_k):
            raise ValueError(f"cannot combine column intervals of shape "
                             f"({self.seqlen_q}, {self.seqlen_k}) and "
                             f"({other.seqlen_q}, {other.seqlen_k})")
        starts = np.stack([self.uts, self.lts, other.uts, other.lts], axis=1)
        ends = np.stack([self.ute, self.lte, other.ute, other.lte], axis=1)
        return intervals_from_runs(starts, ends, self.seqlen_q, what)

    def __eq__(self, other):
        if not isinstance(other, ColumnIntervals):
            return NotImplemented
        return (self.seqlen_q == other.seqlen_q and self.seqlen_k == other.seqlen_k
                and all(np.array_equal(getattr(self, f), getattr(other, f)) for f in _FIELDS))

    def __repr__(self):
        def show(v):
            return np.array2string(v, threshold=12, separator=",")
        return (f"ColumnIntervals(seqlen_q={self.seqlen_q}, seqlen_k={self.seqlen_k}, "
                + ", ".join(f"{f}={show(getattr(self, f))}" for f in _FIELDS) + ")")


def _merge_runs(starts: np.ndarray, ends: np.ndarray):
    """Merge per-row sets of half-open intervals into sorted maximal runs.

    starts, ends: int64 (n, m). Returns (count (n,), run_starts (n, m), run_ends (n, m)); runs
    that touch (``[a, b)`` and ``[b, c)``) merge. Vectorised over n; loops over m (small).
    """
    n, m = starts.shape
    empty = starts >= ends
    order = np.argsort(np.where(empty, np.iinfo(np.int64).max, starts), axis=1, kind="stable")
    s = np.take_along_axis(starts, order, axis=1)
    e = np.take_along_axis(ends, order, axis=1)
    live_all = ~np.take_along_axis(empty, order, axis=1)
    out_s = np.zeros((n, m), dtype=np.int64)
    out_e = np.zeros((n, m), dtype=np.int64)
    count = np.zeros(n, dtype=np.int64)
    cols = np.arange(n)
    for t in range(m):
        st, en, live = s[:, t], e[:, t], live_all[:, t]
        last = np.maximum(count - 1, 0)
        last_end = out_e[cols, last]
        extend = live & (count > 0) & (st <= last_end)
        out_e[cols[extend], last[extend]] = np.maximum(last_end[extend], en[extend])
        new = live & ~extend
        out_s[cols[new], count[new]] = st[new]
        out_e[cols[new], count[new]] = en[new]
        count += new
    return count, out_s, out_e


def _too_many_runs(count, run_s, run_e, what: str, hint: str):
    j = int(np.argmax(count > 2))
    runs = ", ".join(f"[{a}, {b})" for a, b in zip(run_s[j, :count[j]], run_e[j, :count[j]]))
    raise NotRepresentableError(
        f"{what} has no column-interval form: key column {j} masks {count[j]} separate runs of "
        f"query rows ({runs}) but column intervals hold at most 2 per column; {hint}")


_BITMASK_HINT = ("use the packed bitmask instead (numba_flash.masks.from_dense keeps working "
                 "through it)")


def _canonical(count, run_s, run_e, seqlen_q: int) -> ColumnIntervals:
    """Canonical ColumnIntervals from merged runs (count <= 2 everywhere)."""
    seqlen_k = len(count)
    diag = np.arange(seqlen_k, dtype=np.int64) - (seqlen_k - seqlen_q)
    two = count == 2
    one = count == 1
    one_upper = one & (run_s[:, 0] <= diag)
    one_lower = one & ~one_upper
    upper = two | one_upper
    uts = np.where(upper, run_s[:, 0], 0)
    ute = np.where(upper, run_e[:, 0], 0)
    lts = np.where(two, run_s[:, 1], np.where(one_lower, run_s[:, 0], seqlen_q))
    lte = np.where(two, run_e[:, 1], np.where(one_lower, run_e[:, 0], seqlen_q))
    return ColumnIntervals(lts, lte, uts, ute, seqlen_q)


def intervals_from_runs(starts, ends, seqlen_q: int, what: str = "this mask",
                        hint: str = _BITMASK_HINT) -> ColumnIntervals:
    """Canonical column intervals from any few masked row intervals per column.

    starts, ends : int arrays (seqlen_k, m): column j masks rows ``[starts[j, t], ends[j, t])``
        for each t (query-row index space; values are clipped to [0, seqlen_q]; empty, unsorted
        and overlapping intervals are fine).
    Raises NotRepresentableError (naming ``what`` and the first offending column) when the union
    has more than two runs in some column. O(seqlen_k * m log m).
    """
    starts = np.clip(np.asarray(starts, dtype=np.int64), 0, seqlen_q)
    ends = np.clip(np.asarray(ends, dtype=np.int64), 0, seqlen_q)
    if starts.ndim != 2 or starts.shape != ends.shape:
        raise ValueError(f"starts and ends must be 2-D of one shape, got {starts.shape} and "
                         f"{ends.shape}")
    if starts.shape[1] < 2:
        pad = np.zeros((starts.shape[0], 2 - starts.shape[1]), dtype=np.int64)
        starts, ends = np.concatenate([starts, pad], 1), np.concatenate([ends, pad], 1)
    count, run_s, run_e = _merge_runs(starts, ends)
    if (count > 2).any():
        _too_many_runs(count, run_s, run_e, what, hint)
    return _canonical(count, run_s, run_e, seqlen_q)


def intervals_from_position_runs(starts, ends, seqlen_q: int, seqlen_k: int,
                                 what: str = "this mask") -> ColumnIntervals:
    """Like ``intervals_from_runs`` but the masked intervals are given in aligned query
    *positions* (row r is position ``r + seqlen_k - seqlen_q``); anything outside the rows is
    clipped away. starts, ends: int64 (seqlen_k, m)."""
    offset = seqlen_k - seqlen_q
    return intervals_from_runs(np.asarray(starts, dtype=np.int64) - offset,
                               np.asarray(ends, dtype=np.int64) - offset, seqlen_q, what)


def intervals_from_dense(visible) -> ColumnIntervals:
    """Canonical column intervals of a dense boolean visibility matrix.

    visible : bool array (seqlen_q, seqlen_k), True where query row r may see key j.
    Returns ColumnIntervals (int32 vectors of length seqlen_k). Raises NotRepresentableError
    naming the first column whose masked rows form more than two runs (and those runs); such a
    mask still works through the packed bitmask (``numba_flash.masks.from_dense``).
    """
    visible = np.asarray(visible)
    if visible.dtype != bool:
        raise TypeError(f"visible must be a bool array, got dtype {visible.dtype}")
    if visible.ndim != 2:
        raise ValueError(f"visible must be 2-D (seqlen_q, seqlen_k), got shape {visible.shape}")
    seqlen_q, seqlen_k = visible.shape
    padded = np.zeros((seqlen_k, seqlen_q + 2), dtype=np.int8)
    padded[:, 1:-1] = ~visible.T
    step = np.diff(padded, axis=1)
    col_s, row_s = np.nonzero(step == 1)    # sorted by column, then row
    _, row_e = np.nonzero(step == -1)
    count = np.bincount(col_s, minlength=seqlen_k).astype(np.int64)
    first = np.concatenate([[0], np.cumsum(count)[:-1]]).astype(np.int64)
    rank = np.arange(len(col_s)) - first[col_s]
    width = max(2, int(count.max()) if seqlen_k else 0)
    run_s = np.zeros((seqlen_k, width), dtype=np.int64)
    run_e = np.zeros((seqlen_k, width), dtype=np.int64)
    run_s[col_s, rank] = row_s
    run_e[col_s, rank] = row_e
    if (count > 2).any():
        _too_many_runs(count, run_s, run_e, "this dense mask", _BITMASK_HINT)
    return _canonical(count, run_s[:, :2], run_e[:, :2], seqlen_q)
