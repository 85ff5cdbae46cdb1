"""The calling thread's current CUDA device and devices' compute capabilities, cheaply: the
driver's ``cuCtxGetDevice`` answers in well under a microsecond, where Numba's context lookup
costs several when another library (CuPy, PyTorch) made the context current."""
from __future__ import annotations

from numba import cuda

from ..primitives import SIMULATOR
from .driver import current_device

__all__ = ["current_device_id", "compute_capability", "sm_count"]

_CC: dict = {}
_SMS: dict = {}


def current_device_id() -> int:
    """Ordinal of the current device (0 in the simulator); makes Numba's context current when
    none is."""
    if SIMULATOR:
        return 0
    dev = current_device()
    return dev if dev >= 0 else cuda.get_current_device().id


def compute_capability(device_id: int) -> tuple:
    """(major, minor) of a device, cached."""
    cc = _CC.get(device_id)
    if cc is None:
        cc = _CC[device_id] = tuple(cuda.gpus[device_id].compute_capability)[:2]
    return cc


def sm_count(device_id) -> int:
    """Multiprocessors of a device (None: the current one); 4 in the simulator."""
    if SIMULATOR:
        return 4
    if device_id is None:
        device_id = current_device_id()
    n = _SMS.get(device_id)
    if n is None:
        n = _SMS[device_id] = int(cuda.gpus[device_id].MULTIPROCESSOR_COUNT)
    return n
