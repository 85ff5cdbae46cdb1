"""What the on-disk kernel caches did for this process: per kernel family, how many
specialisations were loaded from disk (hits: a kernel image, images.py, or Numba's cache entry)
and how many were compiled (misses).

Kernels are cached per configuration (kernels/jitcache.py) in Numba's cache directory, with
their images beside Numba's index files: under
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

    for entry in attention._KERNELS.values():
        yield "attention", entry.kernel
    for kern in decode._MMA_KERNELS.values():
        yield "decode", kern
    for kern in decode_fma._KERNELS.values():
        yield "decode", kern
    for kern in merge._KERNELS.values():
        yield "merge", kern
    for kern in backward._KERNELS.values():
        yield "backward", kern


def kernel_cache_stats() -> dict:
    """{family: {"hits": n, "misses": n, "images": n}}: specialisations loaded from disk (a
    kernel image or Numba's cache entry), compiled, and among the hits those loaded from their
    image (without initialising Numba's compiler), per kernel family ("attention", "decode",
    "merge", "backward"). In the simulator (no compilation) every count is 0."""
    from .images import image_stats

    stats: dict = {}
    for family, kern in _dispatchers():
        entry = stats.setdefault(family, {"hits": 0, "misses": 0, "images": 0})
        record = getattr(kern, "stats", None)
        if record is None:          # the simulator's dispatcher keeps no statistics
            continue
        images = image_stats(kern)[0]
        entry["images"] += images
        entry["hits"] += images + sum(record.cache_hits.values())
        entry["misses"] += sum(record.cache_misses.values())
    return stats
