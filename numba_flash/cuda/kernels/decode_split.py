"""Device functions shared by the two decode kernels (decode_fma.py's CUDA-core kernel and
decode_mma.py's tensor-core kernel): which keys a split visits, and where a key lives in a
contiguous or paged cache. Flags named ``has_*`` / ``paged`` are compile-time constants of the
calling kernel."""
from __future__ import annotations

from ..primitives.base import inlined

__all__ = ["split_keys", "cache_slot", "window_visible_decode"]


@inlined
def split_keys(chunk, rows, m_rows, seqlen_q, n, has_left, has_right, has_sinks, window_left,
               window_right, sinks, n_splits, split, unit):
    """Keys of one split for the row chunk ``chunk`` (``rows`` packed rows per chunk, ``m_rows``
    live rows in all; row i is query ``i % seqlen_q``, the queries being the last ``seqlen_q``
    of the ``n`` keys).

    The chunk's rows see the window ``[lo, hi)`` plus the sink keys ``[0, ns)`` below it; laid end
    to end they form a "virtual" axis of ``ns + hi - lo`` keys, shared by the splits in whole
    multiples of ``unit`` keys. Returns ``(chunk_rows, q_lo, q_hi, lo, ns, v_start, v_end)``:
    live rows of the chunk, the chunk's first / last query position, the window start, the sink
    count and this split's range on the virtual axis (virtual key ``vk`` is key ``vk`` if
    ``vk < ns`` else ``vk - ns + lo``).
    """
    offset = n - seqlen_q
    chunk_rows = min(rows, m_rows - chunk * rows)
    if seqlen_q < chunk_rows:
        q_lo = offset
        q_hi = n - 1
    else:
        sa = (chunk * rows) % seqlen_q
        sb = (chunk * rows + chunk_rows - 1) % seqlen_q
        q_lo = offset + (sa if sb >= sa else 0)
        q_hi = offset + (sb if sb >= sa else seqlen_q - 1)
    lo = 0
    hi = n
    if has_left:
        lo = max(0, q_lo - window_left)
    if has_right:
        hi = min(n, q_hi + window_right + 1)
    if hi < lo:
        hi = lo
    ns = 0
    if has_sinks:
        ns = max(0, min(sinks, lo, q_hi + 1))
    total = ns + hi - lo
    per = (total + n_splits - 1) // n_splits
    per = ((per + unit - 1) // unit) * unit
    v_start = split * per
    v_end = min(total, v_start + per)
    return chunk_rows, q_lo, q_hi, lo, ns, v_start, v_end


@inlined
def cache_slot(paged, key, ok, b, block_table, n_pages, page_size, page_shift):
    """``(first index, row, ok)`` of key ``key`` of sequence ``b`` in the cache: ``(b, key)``
    for a contiguous cache; for a paged one the page ``block_table[b, key // page_size]`` and
    the row in it (a shift when ``page_shift >= 0``). A page number outside ``[0, n_pages)``
    reads page 0 with ``ok`` false (memory safety; the host validates when asked)."""
    if paged:
        if page_shift >= 0:
            pg = key >> page_shift
            row = key - (pg << page_shift)
        else:
            pg = key // page_size
            row = key - pg * page_size
        page = block_table[b, pg] if ok else 0
        if page < 0 or page >= n_pages:
            page = 0
            ok = False
        return page, row, ok
    return b, key, ok


@inlined
def window_visible_decode(vis, kpos, qp, window_left, window_right, sinks, has_left, has_right,
                          has_sinks):
    """``vis`` (the key is in range) and the flags' window for the query at position ``qp``
    and the key at ``kpos``: at most ``window_right`` keys ahead, at most ``window_left``
    behind unless a sink (``kpos < sinks``, not after the query; sinks come with a left
    bound). decode_mma.py writes the same test out (see there)."""
    if has_right:
        vis = vis and kpos <= qp + window_right
    if has_left:
        inwin = kpos >= qp - window_left
        if has_sinks:
            inwin = inwin or (kpos < sinks and kpos <= qp)
        vis = vis and inwin
    return vis
