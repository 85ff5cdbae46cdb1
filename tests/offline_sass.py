"""Offline compilation for kernel tests: run a snippet in a fresh process with the CUDA simulator
off (NVVM + ptxas + nvdisasm, no GPU needed; scripts/kernel_resources.py), or skip when the
tools are missing (as on CI's machine)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")
_MISSING = ("NVVM", "libnvvm", "libnvrtc", "DynamicLibNotFoundError", "not found: pip install",
            "nvdisasm")


def run_offline(code: str) -> list[str]:
    """stdout lines of ``code`` run from the repository root with real (offline) compilation."""
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=600, env=dict(os.environ, NUMBA_ENABLE_CUDASIM="0"))
    if res.returncode != 0 and any(word in res.stderr for word in _MISSING):
        pytest.skip("offline CUDA tools not available: " + res.stderr.strip().splitlines()[-1])
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout.strip().splitlines()
