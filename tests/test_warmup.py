"""Kernel cache and warm-up: ``python -m numba_flash warmup`` and ``numba_flash.warmup``.

Without a GPU the command says so in one line (exit 2). On a GPU, a second process's first
calls of attention and decode load every kernel from its image on disk: checked by the cache's
own record (``kernel_cache_stats``: misses 0, every hit an image), in a private NUMBA_CACHE_DIR.
Without a GPU, tests/test_images.py checks the image keys and files (images.py) on real Numba
dispatchers in a process of their own (the simulator's dispatchers have no disk cache).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from numba_flash.cuda.primitives import SIMULATOR

ROOT = os.path.join(os.path.dirname(__file__), "..")


def test_warmup_without_a_gpu_says_so():
    if not SIMULATOR:
        pytest.skip("a GPU is present: the GPU test below covers warmup")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    res = subprocess.run([sys.executable, "-m", "numba_flash", "warmup", "--library", "cupy"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs a CUDA GPU" in lines[0], res.stderr


_FIRST_CALLS = r"""
import json, cupy as cp, numpy as np, numba_flash
from numba_flash.cuda.launch.cache import kernel_cache_stats
q = cp.asarray(np.random.default_rng(0).standard_normal((2, 100, 8, 128)), cp.float16)
kv = cp.asarray(np.random.default_rng(1).standard_normal((2, 300, 2, 128)), cp.float16)
numba_flash.attention(q, kv, kv, causal=True)
numba_flash.decode(q[:, :1], kv, kv, num_splits=4)
numba_flash.decode(q[:, :1], kv, kv, num_splits=1)
cp.cuda.runtime.deviceSynchronize()
print(json.dumps(kernel_cache_stats()))
"""


@pytest.mark.gpu
@pytest.mark.skipif(SIMULATOR, reason="needs a real CUDA GPU")
def test_second_process_loads_every_kernel_from_the_cache(tmp_path):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    runs = [json.loads(subprocess.run([sys.executable, "-c", _FIRST_CALLS], cwd=ROOT, env=env,
                                      capture_output=True, text=True, check=True,
                                      timeout=600).stdout.splitlines()[-1]) for _ in range(2)]
    first, second = runs
    assert first["attention"]["misses"] >= 1 and first["decode"]["misses"] >= 1, first
    for family in ("attention", "decode"):
        assert second[family]["misses"] == 0, second
        assert second[family]["hits"] == first[family]["misses"], (first, second)
        # every one of them from its image (images.py), none through Numba's dispatcher
        assert second[family]["images"] == first[family]["misses"], (first, second)
