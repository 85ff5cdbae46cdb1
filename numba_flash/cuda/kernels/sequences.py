"""Device helper for packed (cu_seqlens) batches: where sequence ``b`` lives, clamped so that
no offsets a caller passes can move a kernel out of bounds."""
from __future__ import annotations

from numba import cuda

__all__ = ["packed_sequence"]


@cuda.jit(device=True, inline=True)
def packed_sequence(cu, b, total, max_len):
    """``(offset, length)`` of sequence ``b``: rows ``cu[b] : cu[b + 1]`` of an array of
    ``total`` rows, clamped to ``[0, total]`` (a decreasing pair gives length 0) and to
    ``max_len`` rows (what the launch was sized for). Valid offsets pass unchanged; the host
    checks them with ``check_inputs=True`` (one synchronisation)."""
    start = min(max(cu[b], 0), total)
    end = min(max(cu[b + 1], start), total)
    return start, min(end - start, max_len)
