"""Compiling the kernel factories' closures with Numba's on-disk cache, one cache index per
kernel configuration.

Numba keeps one index file per function (named after its qualified name) holding every cached
specialisation, and picks a data-file number for a new entry by reading that index. Two
processes compiling different configurations of one factory at the same moment (parallel test
workers, one process per GPU) can therefore write the same data file for different kernels and
leave an index entry that points at the other configuration's machine code. Giving each
configuration its own qualified name gives it its own index file: concurrent writers of one
configuration write identical bytes, and different configurations never meet.
"""
from __future__ import annotations

import hashlib

from numba import cuda

from ..primitives import SIMULATOR

__all__ = ["jit_kernel", "config_qualname"]


def config_qualname(qualname: str, config: tuple) -> str:
    """``qualname`` with a digest of ``config`` (a tuple of plain constants: ints, floats, bools,
    strings, None) appended; the same in every process."""
    digest = hashlib.sha1(repr(tuple(config)).encode()).hexdigest()[:12]
    return f"{qualname}_{digest}"


def jit_kernel(fn, config: tuple, cache: bool = True):
    """``cuda.jit`` the kernel function ``fn`` that a factory built for ``config`` (its
    arguments, plain constants). With ``cache`` (and outside the simulator, which has no disk
    cache) the on-disk cache is on, under a per-configuration qualified name."""
    if SIMULATOR or not cache:
        return cuda.jit(fn)
    fn.__qualname__ = config_qualname(fn.__qualname__, config)
    return cuda.jit(cache=True)(fn)
