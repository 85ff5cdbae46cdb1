"""Compiling the kernel factories' closures with Numba's on-disk cache, one cache index per
kernel configuration.

Numba keeps one index file per function (named after its qualified name) holding every cached
specialisation, and picks a data-file number for a new entry by reading that index. Two
processes compiling different configurations of one factory at the same moment (parallel test
workers, one process per GPU) can therefore write the same data file for different kernels and
leave an index entry that points at the other configuration's machine code. Giving each
configuration its own qualified name gives it its own index file: concurrent writers of one
configuration write identical bytes, and different configurations never meet.

Numba invalidates a cache entry only when the kernel's own source file changes: an edit to a
device helper in another module (primitives/, tile_ops.py, masking.py, ...) would leave stale
machine code in the cache. The qualified name therefore also carries a digest of every source
file of numba_flash/cuda/kernels and numba_flash/cuda/primitives (``source_digest``), so a
changed kernel house, or another library version, never meets an old entry.
"""
from __future__ import annotations

import functools
import hashlib
import os

from numba import cuda

from ..primitives import SIMULATOR

__all__ = ["jit_kernel", "config_qualname", "source_digest"]

_CUDA_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """SHA-1 of the kernel house's sources (numba_flash/cuda/kernels and /primitives, every
    .py file by relative path and content), read once per process."""
    h = hashlib.sha1()
    for sub in ("kernels", "primitives"):
        folder = os.path.join(_CUDA_DIR, sub)
        for name in sorted(os.listdir(folder)):
            if name.endswith(".py"):
                h.update(f"{sub}/{name}".encode())
                with open(os.path.join(folder, name), "rb") as f:
                    h.update(f.read())
    return h.hexdigest()


def config_qualname(qualname: str, config: tuple) -> str:
    """``qualname`` with a digest of ``config`` (a tuple of plain constants: ints, floats, bools,
    strings, None) and of the kernel sources appended; the same in every process of one
    library version."""
    digest = hashlib.sha1((repr(tuple(config)) + source_digest()).encode()).hexdigest()[:12]
    return f"{qualname}_{digest}"


def jit_kernel(fn, config: tuple, cache: bool = True, launch_bounds=None):
    """``cuda.jit`` the kernel function ``fn`` that a factory built for ``config`` (its
    arguments, plain constants). With ``cache`` (and outside the simulator, which has no disk
    cache) the on-disk cache is on, under a per-configuration qualified name.
    ``launch_bounds``: the most threads per block the kernel is launched with (PTX ``.maxntid``:
    ptxas then keeps the registers within what that many threads may hold)."""
    opts = {} if launch_bounds is None or SIMULATOR else {"launch_bounds": launch_bounds}
    if SIMULATOR or not cache:
        return cuda.jit(**opts)(fn)
    fn.__qualname__ = config_qualname(fn.__qualname__, config)
    return cuda.jit(cache=True, **opts)(fn)
