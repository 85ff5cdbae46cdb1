"""The float64 DMMA forward kernel (kernels/forward_dmma.py) against the float64 reference:
flags, GQA, odd sizes, rows past the keys, lse. Chosen by ``precision="tensor_cores"``."""
from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from numba_flash.cuda.launch import attention as launch
from numba_flash.cuda.primitives import SIMULATOR
from numba_flash_reference.attention import attention as reference

from offline_sass import run_offline
from gpu_arrays import no_repeat_path, to_device, to_host


@pytest.fixture(autouse=True)
def _full_path(monkeypatch):
    no_repeat_path(monkeypatch)


CASES = [  # b, sq, sk, hq, hkv, d, options
    (1, 17, 23, 2, 1, 32, dict(causal=True)),
    (2, 9, 40, 2, 2, 64, dict(window_size=(5, 3), sinks=2)),
    (1, 40, 17, 1, 1, 32, dict(causal=True, softcap=2.5)),   # rows that see no key
]


@pytest.mark.parametrize("b, sq, sk, hq, hkv, d, kw", CASES)
def test_dmma_matches_reference(b, sq, sk, hq, hkv, d, kw):
    rng = np.random.default_rng(sq * 100 + d)
    q = rng.standard_normal((b, sq, hq, d))
    k, v = (rng.standard_normal((b, sk, hkv, d)) for _ in range(2))
    scale = d ** -0.5
    res, lse = launch.attention_cuda(*(to_device(x) for x in (q, k, v)), softmax_scale=scale,
                                     return_lse=True, precision="tensor_cores", **kw)
    ref, ref_lse = reference(q, k, v, softmax_scale=scale, return_lse=True, **kw)
    res, lse = to_host(res), to_host(lse)
    assert lse.dtype == np.float64
    np.testing.assert_allclose(res, ref, rtol=0, atol=1e-12)
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], rtol=1e-12, atol=1e-12)


def test_precision_chooses_the_kernel():
    def name(dtype, d, precision, **kw):
        kern = launch.kernel_for(dtype, d, False, True, False, False, True, precision=precision,
                                 **kw)[0]
        return getattr(kern, "py_func", kern).__qualname__

    assert "make_dmma_kernel" in name("float64", 64, "tensor_cores")
    assert "make_tf32x3_kernel" in name("float32", 96, "tensor_cores")
    for dtype in ("float32", "float64"):
        assert "make_fma_kernel" in name(dtype, 64, "ieee")
    assert "make_fma_kernel" in name("float32", 64, "auto")
    # "auto" takes DMMA for float64 flag calls on sm_90's m16n8k16 (not in the simulator)
    sm90 = not SIMULATOR and cuda.get_current_device().compute_capability >= (9, 0)
    assert ("make_dmma_kernel" if sm90 else "make_fma_kernel") in name("float64", 64, "auto")
    assert "make_fma_kernel" in name("float64", 64, "auto", mask_kind=1)
    with pytest.raises(NotImplementedError, match="head_dim 256"):
        name("float64", 256, "tensor_cores")
    with pytest.raises(NotImplementedError, match="with one of them"):
        name("float32", 64, "tensor_cores", has_alibi=True)


_OFFLINE = r"""
import os, sys
os.environ["NUMBA_ENABLE_CUDASIM"] = "0"
sys.path.insert(0, "scripts")
import kernel_resources as kr
from numba_flash.cuda.kernels.forward_dmma import make_dmma_kernel
for d in (64, 128):
    r = kr.report(make_dmma_kernel(d, False, True, False, False, True).py_func,
                  kr.forward_signature(False, True))
    print(d, r["sass"].count("DMMA.16x8x16"), r["sass"].count("DMMA.8x8x4"), r["n_ldl"],
          r["spill_stores"])
"""


def test_offline_sass_is_dmma_without_local_memory():
    """Every product is one DMMA.16x8x16 (sm_90's m16n8k16 float64), none an m8n8k4, with no
    local memory at the default tilings. Needs the offline CUDA tools (skipped in CI)."""
    lines = run_offline(_OFFLINE)
    assert len(lines) == 2, lines
    for line in lines:
        d, n_k16, n_884, n_ldl, spills = (int(x) for x in line.split())
        assert n_k16 >= 16 and n_884 == 0 and n_ldl == 0 and spills == 0, line
