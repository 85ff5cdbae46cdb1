"""Device helpers for packed (cu_seqlens) batches: where sequence ``b`` lives, clamped so that
no offsets a caller passes can move a kernel out of bounds, and the output rows no block
computes (cleared by the kernels themselves, so the outputs need no fill before the launch)."""
from __future__ import annotations

from ..primitives.base import inlined

__all__ = ["packed_sequence", "clear_unowned_rows"]


@inlined
def packed_sequence(cu, b, total, max_len):
    """``(offset, length)`` of sequence ``b``: rows ``cu[b] : cu[b + 1]`` of an array of
    ``total`` rows, clamped to ``[0, total]`` (a decreasing pair gives length 0) and to
    ``max_len`` rows (what the launch was sized for). Valid offsets pass unchanged; the host
    checks them with ``check_inputs=True`` (one synchronisation)."""
    start = min(max(cu[b], 0), total)
    end = min(max(cu[b + 1], start), total)
    return start, min(end - start, max_len)


@inlined
def clear_unowned_rows(out, lse, cu, b, h, tile, n_tiles, rows, width, max_len, tid, nthreads,
                       lse_fill, write_lse):
    """The output rows around sequence ``b`` that no block computes, for head ``h``: rows of
    ``b`` past the launch's maximum length ``max_len`` (``packed_sequence`` drops them), rows
    before the first sequence (b = 0) and after the last one (b the last) get zeros in ``out``
    (1, total, H, ``width``) and ``lse_fill`` in ``lse`` (1, H, total) when ``write_lse``.
    The sequence's ``n_tiles`` blocks share them, ``rows`` rows at a time (block ``tile``:
    tiles tile, tile + n_tiles, ...). With valid offsets (cu[0] = 0, cu[B] = total, lengths at
    most max_len) there are none and the loops do not run. ``width`` and ``nthreads``:
    compile-time constants of the caller (the divisions become shifts)."""
    total = out.shape[1]
    start = min(max(cu[b], 0), total)
    end = min(max(cu[b + 1], start), total)
    lo = start + min(end - start, max_len)
    hi = total if b == cu.shape[0] - 2 else end
    head = start if b == 0 else 0        # rows before the first sequence come first
    n = head + hi - lo
    for v0 in range(tile * rows, n, n_tiles * rows):
        for i in range(tid, rows * width, nthreads):
            v = v0 + i // width
            if v < n:
                out[0, v if v < head else lo + v - head, h, i % width] = 0
        if write_lse:
            for i in range(tid, rows, nthreads):
                v = v0 + i
                if v < n:
                    lse[0, h, v if v < head else lo + v - head] = lse_fill
