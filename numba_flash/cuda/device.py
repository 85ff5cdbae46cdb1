"""The calling thread's current CUDA device, cheaply.

``numba.cuda.get_current_device()`` looks the context up through Numba's context stack; when
the context was made current by another library (CuPy, PyTorch) that lookup is not cached and
costs several microseconds, and a masked attention call asked for it about eight times. The
driver's ``cuCtxGetDevice`` answers in well under a microsecond.
"""
from __future__ import annotations

from numba import cuda

from .warp import SIMULATOR

__all__ = ["current_device_id", "compute_capability"]

_CC: dict = {}


def current_device_id() -> int:
    """Ordinal of the current device (0 in the simulator)."""
    if SIMULATOR:
        return 0
    from cuda.bindings import driver as cu

    err, dev = cu.cuCtxGetDevice()
    if err != cu.CUresult.CUDA_SUCCESS:      # no current context yet: let Numba make one
        return cuda.get_current_device().id
    return int(dev)


def compute_capability(device_id: int) -> tuple:
    """(major, minor) of a device, cached."""
    cc = _CC.get(device_id)
    if cc is None:
        cc = _CC[device_id] = tuple(cuda.gpus[device_id].compute_capability)[:2]
    return cc
