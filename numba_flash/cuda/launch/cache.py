"""What Numba's on-disk kernel cache did for this process: per kernel family, how many
specialisations were loaded from the cache (hits) and how many were compiled (misses).

Kernels are cached per configuration (kernels/jitcache.py) in Numba's cache directory: under
``NUMBA_CACHE_DIR`` when it is set (set it to move the cache, e.g. to a shared or pre-warmed
location), else next to the package's sources when writable (else Numba's user-wide fallback).
A cache entry is keyed by the kernel's signature, the GPU architecture, the numba-cuda version,
hashes of the kernel's bytecode and closure constants, and (in its name) a digest of every
source file of the kernel house, so it never serves another configuration, device generation
or library version.
"""
from __future__ import annotations

__all__ = ["kernel_cache_stats"]


def _dispatchers():
    """(family, dispatcher) of every kernel this process has built."""
    from ..kernels import decode_fma, merge
    from . import attention, backward, decode

    for kern, _, _ in attention._KERNELS.values():
        yield "attention", kern
    for kern in decode._MMA_KERNELS.values():
        yield "decode", kern
    for kern in decode_fma._KERNELS.values():
        yield "decode", kern
    for kern in merge._KERNELS.values():
        yield "merge", kern
    for kern in backward._KERNELS.values():
        yield "backward", kern


def kernel_cache_stats() -> dict:
    """{family: {"hits": n, "misses": n}}: specialisations loaded from Numba's disk cache and
    compiled in this process, per kernel family ("attention", "decode", "merge", "backward").
    In the simulator (no compilation) every count is 0."""
    stats: dict = {}
    for family, kern in _dispatchers():
        entry = stats.setdefault(family, {"hits": 0, "misses": 0})
        record = getattr(kern, "stats", None)
        if record is None:          # the simulator's dispatcher keeps no statistics
            continue
        entry["hits"] += sum(record.cache_hits.values())
        entry["misses"] += sum(record.cache_misses.values())
    return stats
