"""Test configuration.

Without a usable CUDA driver, Numba's CUDA simulator is switched on before anything imports
``numba.cuda`` so that kernel tests run (slowly, on small shapes) on any machine. On a GPU machine
the real device is used; set ``NUMBA_ENABLE_CUDASIM=1`` yourself to force the simulator there.
"""
import ctypes.util
import os


def _cuda_driver_present() -> bool:
    return ctypes.util.find_library("cuda") is not None or os.path.exists("/dev/nvidia0")


if "NUMBA_ENABLE_CUDASIM" not in os.environ and not _cuda_driver_present():
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
