"""Compiled kernels kept on disk as machine code (cubins) and loaded without Numba's dispatcher.

Numba's own disk cache serves a new process's first call, but only after initialising Numba's
CUDA target (its typing and lowering registries, which import SciPy's BLAS): about 0.6 s before
the first kernel of a process can launch, whatever the kernel (issue 23, docs/api.md "Kernel
cache and warm-up"). The launch path needs none of that: it launches a driver handle with its
own parameter block (driver.py). So the first compilation of a configuration also writes the
kernel's cubin and entry name next to Numba's index, and a later process loads that image with
one ``cuLibraryLoadData`` through cuda.core.

An image is keyed exactly as Numba keys its cache entry: the kernel function's module and
qualified name (which carries a digest of the configuration and of every kernel source file,
kernels/jitcache.py), hashes of its bytecode and of its closure's contents, the signature, the
device's compute capability, and the Numba / numba-cuda / numba-flash versions. Kernels that
Numba does not cache (a user's mask_mod or score_mod inside) get no image either. Files are
written whole under a temporary name and renamed, so concurrent writers of one image are safe
and a reader never sees half a file; an image that fails to load is compiled again.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile

__all__ = ["load_image", "store_image", "image_path", "image_stats", "LoadedKernel"]

_MAGIC = b"NUMBA_FLASH_IMAGE 1\n"
_LOADS: dict = {}        # id(dispatcher) -> images loaded for it in this process
_WRITES: dict = {}       # id(dispatcher) -> images written for it in this process


class LoadedKernel:
    """A kernel loaded from an image: ``handle`` (the driver's CUkernel, launched as a
    CUfunction), ``kernel`` (cuda.core's Kernel: attributes, occupancy) and the module it lives
    in (kept alive with it), as Numba's function object offers them to the launch path."""

    __slots__ = ("handle", "kernel", "module", "name")

    def __init__(self, module, kernel, name):
        self.module, self.kernel, self.name = module, kernel, name
        handle = getattr(kernel, "handle", None)
        self.handle = handle if handle is not None else kernel._handle


def image_path(dispatcher, sig, cc) -> str | None:
    """Where the image of ``dispatcher`` compiled for ``sig`` on a device of compute capability
    ``cc`` lives; None when the dispatcher has no disk cache (nothing is stored for it)."""
    cache = getattr(dispatcher, "_cache", None)
    cache_dir = getattr(cache, "_cache_path", None)
    if cache_dir is None:
        return None
    fn = dispatcher.py_func
    return os.path.join(cache_dir, f"{fn.__qualname__}.{_key(fn, sig, cc)}.nfimg")


def _key(fn, sig, cc) -> str:
    import numba
    import numba_cuda
    from numba.core.serialize import dumps

    from ... import __version__

    closure = fn.__closure__
    cvars = dumps(tuple(c.cell_contents for c in closure)) if closure is not None else b""
    parts = (fn.__module__, fn.__qualname__, hashlib.sha256(fn.__code__.co_code).hexdigest(),
             hashlib.sha256(cvars).hexdigest(), str(sig), tuple(cc), numba.__version__,
             numba_cuda.__version__, __version__)
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:24]


def load_image(dispatcher, path: str):
    """The kernel stored at ``path``, loaded into the process; None when there is no readable
    image there (the caller compiles)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    header_end = data.find(b"\n", len(_MAGIC))
    if not data.startswith(_MAGIC) or header_end < 0:
        return None
    try:
        header = json.loads(data[len(_MAGIC):header_end])
    except ValueError:
        return None
    cubin = data[header_end + 1:]
    if not isinstance(header, dict) or len(cubin) != header.get("size") or "entry" not in header:
        return None
    try:
        module = _object_code().from_cubin(cubin, name=header["entry"])
        kernel = module.get_kernel(header["entry"])
    except Exception:  # noqa: BLE001 - a stale or foreign image: compile instead
        return None
    _LOADS[id(dispatcher)] = _LOADS.get(id(dispatcher), 0) + 1
    return LoadedKernel(module, kernel, header["entry"])


def store_image(dispatcher, path: str, compiled) -> None:
    """Write the image of ``compiled`` (what ``dispatcher.compile`` returned) to ``path``;
    a cache directory that cannot be written is skipped silently, as Numba does."""
    library = compiled._codelibrary
    cubin = library.get_cubin()
    cubin = getattr(cubin, "code", cubin)      # numba-cuda 0.30 links to a cuda.core ObjectCode
    if not isinstance(cubin, (bytes, bytearray, memoryview)):
        return                                  # no machine code to keep: Numba's cache serves
    cubin = bytes(cubin)
    header = json.dumps({"entry": library._entry_name, "size": len(cubin)}).encode()
    folder = os.path.dirname(path)
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".nfimg-")
    except OSError:
        return
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_MAGIC + header + b"\n" + cubin)
        os.replace(tmp, path)
    except OSError:
        if os.path.exists(tmp):
            os.unlink(tmp)
        return
    _WRITES[id(dispatcher)] = _WRITES.get(id(dispatcher), 0) + 1


def image_stats(dispatcher) -> tuple[int, int]:
    """(images loaded, images written) for ``dispatcher`` in this process."""
    return _LOADS.get(id(dispatcher), 0), _WRITES.get(id(dispatcher), 0)


def _object_code():
    try:
        from cuda.core import ObjectCode
    except ImportError:              # cuda.core before 0.4 kept it under .experimental
        from cuda.core.experimental import ObjectCode
    return ObjectCode
