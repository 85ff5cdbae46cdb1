"""Test configuration.

Without a usable CUDA driver, Numba's CUDA simulator is switched on before anything imports
``numba.cuda`` so that kernel tests run (slowly, on small shapes) on any machine. On a GPU machine
the real device is used; set ``NUMBA_ENABLE_CUDASIM=1`` yourself to force the simulator there.

Markers (registered in setup.cfg):

- ``gpu``: needs a real CUDA GPU; skipped under the simulator.
- ``full_matrix``: the larger shapes and the rest of the dtype x mask x head_dim product of a
  kernel test whose smallest cases (one of each code path) run everywhere. They run on a GPU
  machine, and in the simulator only when asked: ``--full-matrix`` (or
  ``NUMBA_FLASH_FULL_MATRIX=1``), which takes an hour or more on two CPU cores.

Under the simulator each simulated CUDA thread is a Python thread, and the simulator's block
manager polls its threads in a loop that keeps the GIL for a whole switch interval (5 ms by
default) each time it gets it: the interval is shortened here, which makes kernel tests several
times faster without changing what they run.
"""
import ctypes.util
import os
import sys

import pytest


def _cuda_driver_present() -> bool:
    return ctypes.util.find_library("cuda") is not None or os.path.exists("/dev/nvidia0")


if "NUMBA_ENABLE_CUDASIM" not in os.environ and not _cuda_driver_present():
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

# What numba.core.config reads (any non-zero integer switches the simulator on).
SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM", "0").strip() not in ("", "0")

if SIMULATOR:
    sys.setswitchinterval(2e-4)


def pytest_addoption(parser):
    parser.addoption("--full-matrix", action="store_true", default=False,
                     help="run the tests marked full_matrix under the CUDA simulator too "
                          "(they always run on a GPU machine)")


def _full_matrix_requested(config) -> bool:
    return (config.getoption("--full-matrix")
            or os.environ.get("NUMBA_FLASH_FULL_MATRIX", "") not in ("", "0"))


def pytest_collection_modifyitems(config, items):
    if not SIMULATOR:
        return
    skip_gpu = pytest.mark.skip(reason="needs a real CUDA GPU")
    skip_matrix = pytest.mark.skip(
        reason="full matrix: runs on a GPU machine, or in the simulator with --full-matrix")
    run_matrix = _full_matrix_requested(config)
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip_gpu)
        elif item.get_closest_marker("full_matrix") is not None and not run_matrix:
            item.add_marker(skip_matrix)
