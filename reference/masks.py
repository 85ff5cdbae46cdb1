"""Attention masks: one meaning each (a predicate), and the encodings kernels use.

A mask says which (query i, key j) pairs are visible. Positions are *aligned*: with seqlen_q
queries and seqlen_k keys, query row ``r`` sits at absolute position ``r + seqlen_k - seqlen_q``
(bottom-right alignment, as in flash-attn >= 2.1 and a KV cache), key column ``c`` at ``c``.

Every mask implements ``_visible(qpos, kpos, seqlen_k)``: a vectorised predicate on broadcast
integer arrays of aligned query positions and key positions. ``to_dense`` turns it into the
(seqlen_q, seqlen_k) boolean visibility matrix, the meaning every encoding must reproduce.

Masks combine by intersection with ``&``.
"""
from __future__ import annotations

import numpy as np

__all__ = ["Mask", "IntersectionMask", "CausalMask", "SlidingWindowMask", "visible_matrix",
           "mask_from_flags", "check_seqlens"]


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


class Mask:
    """Base class of every mask. Subclasses implement ``_visible`` and ``__repr__``."""

    def _visible(self, qpos: np.ndarray, kpos: np.ndarray, seqlen_k: int) -> np.ndarray:
        raise NotImplementedError

    def _check_sizes(self, seqlen_q: int, seqlen_k: int) -> None:
        """Raise ValueError when the mask's parameters do not fit these sequence lengths."""

    def to_dense(self, seqlen_q: int, seqlen_k: int) -> np.ndarray:
        """Dense visibility: bool array (seqlen_q, seqlen_k), True where query i may see key j."""
        seqlen_q, seqlen_k = check_seqlens(seqlen_q, seqlen_k)
        self._check_sizes(seqlen_q, seqlen_k)
        qpos, kpos = aligned_positions(seqlen_q, seqlen_k)
        dense = np.broadcast_to(self._visible(qpos, kpos, seqlen_k), (seqlen_q, seqlen_k))
        return np.ascontiguousarray(dense, dtype=bool)

    def __and__(self, other: "Mask") -> "Mask":
        if not isinstance(other, Mask):
            return NotImplemented
        left = self.parts if isinstance(self, IntersectionMask) else (self,)
        right = other.parts if isinstance(other, IntersectionMask) else (other,)
        return IntersectionMask(left + right)


class IntersectionMask(Mask):
    """Pairs visible under every one of ``parts``."""

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

    def __repr__(self):
        return " & ".join(repr(p) for p in self.parts)


class CausalMask(Mask):
    """Visible iff ``j <= i`` (aligned positions)."""

    def _visible(self, qpos, kpos, seqlen_k):
        return kpos <= qpos

    def __repr__(self):
        return "causal()"


class SlidingWindowMask(Mask):
    """Visible iff ``i - left <= j <= i + right``; -1 leaves that side unbounded.

    With ``sinks > 0`` the first ``sinks`` keys also stay visible to every query that may see them
    causally (``j < sinks and j <= i``), alongside the window (StreamingLLM attention sinks).
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

    def __repr__(self):
        extra = f", sinks={self.sinks}" if self.sinks else ""
        return f"sliding_window({self.left}, {self.right}{extra})"


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
