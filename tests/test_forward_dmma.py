"""The float64 DMMA forward kernel (kernels/forward_dmma.py) against the float64 reference:
flags, GQA, odd sizes, rows past the keys, lse. It is off by default until measured on a GPU;
these tests turn it on (``attention.DMMA_ENABLED``)."""
from __future__ import annotations

import numpy as np
import pytest

from numba_flash.cuda.launch import attention as launch
from numba_flash_reference.attention import attention as reference

from offline_sass import run_offline
from gpu_arrays import no_repeat_path, to_device, to_host


@pytest.fixture(autouse=True)
def _dmma_on(monkeypatch):
    monkeypatch.setattr(launch, "DMMA_ENABLED", True)
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
                                     return_lse=True, **kw)
    ref, ref_lse = reference(q, k, v, softmax_scale=scale, return_lse=True, **kw)
    res, lse = to_host(res), to_host(lse)
    assert lse.dtype == np.float64
    np.testing.assert_allclose(res, ref, rtol=0, atol=1e-12)
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], rtol=1e-12, atol=1e-12)


def test_dmma_is_chosen_only_for_plain_float64_calls():
    def is_dmma(kern):
        return "make_dmma_kernel" in getattr(kern, "py_func", kern).__qualname__

    assert is_dmma(launch.kernel_for("float64", 64, False, True, False, False, True)[0])
    assert not is_dmma(launch.kernel_for("float64", 256, False, True, False, False, True)[0])
    assert not is_dmma(launch.kernel_for("float64", 64, False, True, False, False, True,
                                         has_alibi=True)[0])
    assert not is_dmma(launch.kernel_for("float32", 64, False, True, False, False, True)[0])


_OFFLINE = r"""
import os, sys
os.environ["NUMBA_ENABLE_CUDASIM"] = "0"
sys.path.insert(0, "scripts")
import kernel_resources as kr
from numba_flash.cuda.kernels.forward_dmma import make_dmma_kernel
for d in (64, 128):
    r = kr.report(make_dmma_kernel(d, False, True, False, False, True).py_func,
                  kr.forward_signature(False, True))
    print(d, r["sass"].count("DMMA"), r["n_ldl"], r["spill_stores"])
"""


def test_offline_sass_is_dmma_without_local_memory():
    """Every product is a DMMA.884 (head_dim / 4 k-steps x 2 n-tiles for S, 4 k-steps x head_dim
    / 8 n-tiles for P V), with no local memory. Needs the offline CUDA tools (skipped in CI)."""
    lines = run_offline(_OFFLINE)
    for line in lines:
        d, n_dmma, n_ldl, spills = (int(x) for x in line.split())
        assert n_dmma == d // 4 * 2 + 4 * d // 8 and n_ldl == 0 and spills == 0, line
