"""Warp-level exchange without shared memory: shuffles, votes and the warp barrier.

``shfl_xor`` / ``shfl_idx`` read a register of another lane of the same fully active warp;
``ballot`` makes a 32-bit mask of the lanes' predicates (int64, low 32 bits) and ``lowest_bit``
finds its first set bit; ``syncwarp`` orders the lanes' shared-memory accesses. In the simulator
each is a collective over the 32 simulated lanes (base.collective).
"""
from __future__ import annotations

import numpy as np

from .base import SIMULATOR, collective, inlined

__all__ = ["shfl_xor", "shfl_idx", "ballot", "lowest_bit", "syncwarp"]

if not SIMULATOR:
    from numba import cuda

    @inlined
    def shfl_xor(value, lane_mask):
        """``value`` from lane ``lane ^ lane_mask`` of the same (fully active) warp."""
        return cuda.shfl_xor_sync(0xFFFFFFFF, value, lane_mask)

    @inlined
    def shfl_idx(value, src_lane):
        """``value`` of lane ``src_lane`` (0..31) of the same, fully active warp."""
        return cuda.shfl_sync(0xFFFFFFFF, value, src_lane)

    @inlined
    def ballot(pred):
        """int64 with bit i set where lane i's ``pred`` is true (fully active warp)."""
        # Numba types the vote's result as a signed int32: keep the low 32 bits only (lane 31
        # set would otherwise sign-extend into bits 32..63).
        return np.int64(cuda.ballot_sync(0xFFFFFFFF, pred)) & 0xFFFFFFFF

    @inlined
    def lowest_bit(x):
        """Index (0-based) of the lowest set bit of a non-zero 32-bit value ``x`` (int64)."""
        return np.int64(cuda.ffs(np.uint32(x))) - 1

    @inlined
    def syncwarp():
        """Barrier of the (fully active) warp; orders its lanes' shared-memory accesses."""
        cuda.syncwarp(0xFFFFFFFF)

else:
    def _xor_combine(mask):
        def combine(slots):
            return [slots[lane ^ mask] for lane in range(32)]
        return combine

    _XOR = {m: _xor_combine(m) for m in (1, 2, 4, 8, 16)}

    def shfl_xor(value, lane_mask):
        """``value`` from lane ``lane ^ lane_mask`` of the same warp."""
        return collective(value, _XOR[lane_mask])

    def _idx_combine(slots):
        return [slots[int(src)][0] for _, src in slots]

    def shfl_idx(value, src_lane):
        """``value`` of lane ``src_lane`` (0..31) of the same, fully active warp."""
        return collective((value, src_lane), _idx_combine)

    def _ballot_combine(slots):
        word = 0
        for lane, pred in enumerate(slots):
            if pred:
                word |= 1 << lane
        return [np.int64(word)] * 32

    def ballot(pred):
        """int64 with bit i set where lane i's ``pred`` is true (fully active warp)."""
        return collective(bool(pred), _ballot_combine)

    def lowest_bit(x):
        """Index (0-based) of the lowest set bit of a non-zero 32-bit value ``x`` (int64)."""
        x = int(x)
        return np.int64((x & -x).bit_length() - 1)

    _NONE32 = [None] * 32

    def syncwarp():
        """Warp barrier: every simulated lane of the warp arrives before any goes on."""
        collective(None, lambda slots: _NONE32)
