"""The float64 DMMA forward kernel (kernels/forward_dmma.py) against the float64 reference:
flags, GQA, odd sizes, rows past the keys, lse, packed batches (poisoned offsets too), the small
tiling and the eight-m8n8k4 product of GPUs before sm_90. Chosen by
``precision="tensor_cores"``, and by "auto" for float64 on compute capability 9.0."""
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
    (2, 9, 40, 1, 1, 64, dict(window_size=(5, 3), sinks=2)),   # batch 2 (GQA: the first)
    (1, 40, 17, 1, 1, 32, dict(causal=True, softcap=2.5)),   # rows that see no key
    (1, 5, 100, 1, 1, 32, {}),               # 4 tiles: both stages reused
    (1, 6, 37, 1, 1, 96, dict(causal=True)),  # Q in shared memory, one stage, 3 tiles
    # batch 2 with 2 kv heads: on a GPU, or in the simulator with --full-matrix
    pytest.param(2, 9, 40, 2, 2, 64, dict(window_size=(5, 3), sinks=2),
                 marks=pytest.mark.full_matrix),
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


def _packed(rng, lens_q, lens_k, d, hq):
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lens_q, lens_k))
    q = rng.standard_normal((cu_q[-1], hq, d))
    k, v = (rng.standard_normal((cu_k[-1], 1, d)) for _ in range(2))
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("d, hq, lens_q, lens_k", [
    (32, 2, [7, 0, 1, 20], [9, 3, 1, 40]),     # Q in registers; empty and one-row sequences
    (64, 1, [5, 0, 1, 70], [9, 3, 1, 80]),     # Q in shared memory; a second query tile at an
])                                             # offset; two-stage keys
def test_dmma_packed_batch_matches_reference(d, hq, lens_q, lens_k):
    """cu_seqlens through the DMMA kernel, causal, against CPU mode."""
    from numba_flash.varlen import check_varlen

    rng = np.random.default_rng(6)
    q, k, v, cu_q, cu_k = _packed(rng, lens_q, lens_k, d, hq)
    vl = check_varlen(cu_q, cu_k, None, None, len(q), len(k), "numpy")
    if not SIMULATOR:
        vl = check_varlen(to_device(cu_q), to_device(cu_k), vl.max_seqlen_q, vl.max_seqlen_k,
                          len(q), len(k), "cuda")
    out, lse = launch.attention_cuda(*(to_device(x) for x in (q, k, v)), softmax_scale=0.2,
                                     causal=True, return_lse=True, varlen=vl,
                                     precision="tensor_cores")
    want, want_lse = reference_packed(q, k, v, cu_q, cu_k)
    np.testing.assert_allclose(to_host(out), want, rtol=0, atol=1e-12)
    lse, fin = to_host(lse), np.isfinite(want_lse)
    assert (np.isneginf(lse) == ~fin).all()
    np.testing.assert_allclose(lse[fin], want_lse[fin], rtol=0, atol=1e-12)


def reference_packed(q, k, v, cu_q, cu_k):
    """CPU mode's packed-batch answer (causal, scale 0.2) as (out, lse)."""
    import numba_flash
    return numba_flash.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True,
                                 softmax_scale=0.2, return_lse=True)


def test_dmma_poisoned_offsets_stay_in_bounds():
    """Offsets a GPU caller passes are not read back: the DMMA kernel clamps them as the
    CUDA-core kernel does (past-the-end indices fail in the simulator; negative ones would wrap
    there, so compute-sanitizer checks the same on a GPU: scripts/sanitize_case.py
    --tensor-cores); a valid sequence keeps its answer, every other output row is finite."""
    from numba_flash.varlen import Varlen

    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((35, 2, 32)) for _ in range(3))
    bad = to_device(np.array([0, 10, 40, 30, -5, 35], np.int32))
    out, lse = launch.attention_cuda(*(to_device(x) for x in (q, k, v)), softmax_scale=0.2,
                                     causal=True, return_lse=True, precision="tensor_cores",
                                     varlen=Varlen(5, bad, bad, 12, 12, None, None))
    out, lse = to_host(out), to_host(lse)
    want = reference(q[None, :10], k[None, :10], v[None, :10], softmax_scale=0.2,
                     causal=True)[0]
    np.testing.assert_allclose(out[:10], want, rtol=0, atol=1e-12)
    assert np.isfinite(out).all() and not np.isnan(lse).any()


def test_small_tiling_and_m8n8k4_products(monkeypatch):
    """What a GPU before compute capability 9.0 runs: the small tiling (2 warps, 16-key tiles,
    within 99 KB of shared memory) and every product as eight m8n8k4 DMMAs (the simulator
    models both instructions)."""
    from numba_flash.cuda.kernels.forward_dmma import DmmaGeometry, dmma_smem_bytes

    built = []
    factory = launch.make_dmma_kernel

    def recording(*args):
        built.append(args)
        return factory(*args)

    monkeypatch.setattr(launch, "_dmma_target", lambda: (False, False))
    monkeypatch.setattr(launch, "_KERNELS", {})
    monkeypatch.setattr(launch, "make_dmma_kernel", recording)
    small = DmmaGeometry(16, True, 2, 1)
    entry = launch.kernel_for("float64", 64, True, True, True, False, False,
                              precision="tensor_cores")
    assert entry[1:4] == (32, 64, dmma_smem_bytes(64, small))
    assert built[-1][6:8] == (False, small)          # native m16n8k16 off; the small tiling
    rng = np.random.default_rng(8)
    q = rng.standard_normal((1, 9, 1, 64))
    k, v = (rng.standard_normal((1, 37, 1, 64)) for _ in range(2))
    kw = dict(window_size=(9, 4), sinks=3, softmax_scale=0.125)
    res = launch.attention_cuda(*(to_device(x) for x in (q, k, v)), precision="tensor_cores",
                                **kw)
    np.testing.assert_allclose(to_host(res), reference(q, k, v, **kw), rtol=0, atol=1e-12)


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
    # "auto" takes DMMA for float64 flag and packed calls on compute capability 9.0 (H100 /
    # H200, where it was measured), not in the simulator
    sm90 = not SIMULATOR and cuda.get_current_device().compute_capability == (9, 0)
    for kw in ({}, dict(varlen=True)):
        assert ("make_dmma_kernel" if sm90 else "make_fma_kernel") in name("float64", 64, "auto",
                                                                           **kw)
    for kw in (dict(mask_kind=1), dict(has_alibi=True), dict(score_mod=lambda s, b, h, i, j: s)):
        assert "make_fma_kernel" in name("float64", 64, "auto", **kw)
    assert "make_dmma_kernel" in name("float64", 32, "tensor_cores", varlen=True)
    with pytest.raises(NotImplementedError, match="cu_seqlens"):
        name("float32", 64, "tensor_cores", varlen=True)
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
# (head_dim, has_left, has_right, has_sinks, varlen): causal, and builds that spilled before
# the row-wise copies (window + sinks; causal packed batches)
for d, left, right, sinks, varlen in ((64, False, True, False, False),
                                      (128, False, True, False, False),
                                      (64, True, True, True, False), (128, True, True, True, False),
                                      (96, False, True, False, True)):
    r = kr.report(make_dmma_kernel(d, left, right, sinks, False, True, varlen=varlen).py_func,
                  kr.forward_signature(False, True))
    print(d, r["sass"].count("DMMA.16x8x16"), r["sass"].count("DMMA.8x8x4"), r["n_ldl"],
          r["spill_stores"])
"""


def test_offline_sass_is_dmma_without_local_memory():
    """Every product is one DMMA.16x8x16 (sm_90's m16n8k16 float64), none an m8n8k4, with no
    local memory at the default tilings. Needs the offline CUDA tools (skipped in CI)."""
    lines = run_offline(_OFFLINE)
    assert len(lines) == 5, lines
    for line in lines:
        d, n_k16, n_884, n_ldl, spills = (int(x) for x in line.split())
        # head_dim 64: 16 products for S and 16 for P V per 32-key tile, all unrolled; beyond,
        # ptxas keeps S's k-step loop partly rolled
        assert (n_k16 == 32 if d == 64 else n_k16 >= 16), line
        assert n_884 == 0 and n_ldl == 0 and spills == 0, line
