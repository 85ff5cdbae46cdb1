"""numba_flash.merge_states on NumPy (the reference, float64) and through the GPU merge kernel
(Numba's simulator on NumPy arrays without a GPU, CuPy arrays with one)."""
from __future__ import annotations

import numpy as np
import pytest

import numba_flash
from numba_flash.cuda.launch.merge import merge_states_cuda
from numba_flash.cuda.primitives import SIMULATOR
from numba_flash_reference.attention import attention as reference
from numba_flash_reference.merge import split_attention

if not SIMULATOR:
    cp = pytest.importorskip("cupy")


def _gpu_merge(o, lse):
    """The merge kernel on device arrays (NumPy under the simulator); host results."""
    if SIMULATOR:
        return merge_states_cuda(o, lse)
    out, l = merge_states_cuda(cp.asarray(o), cp.asarray(lse))
    return cp.asnumpy(out), cp.asnumpy(l)


def _split_states(seed, bounds, dtype=np.float64):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, 3, 4, 8))
    k = rng.standard_normal((2, 11, 2, 8))
    v = rng.standard_normal((2, 11, 2, 8))
    outs, lses = split_attention(q, k, v, bounds, causal=True)
    ref, ref_lse = reference(q, k, v, causal=True, return_lse=True)
    return np.stack(outs).astype(dtype), np.stack(lses).astype(dtype), ref, ref_lse


@pytest.mark.parametrize("merge", ["numpy", "kernel"])
def test_merge_of_splits_is_attention(merge):
    bounds = [0, 2, 2, 7, 11]                      # includes an empty split (-inf everywhere)
    dtype = np.float64 if merge == "numpy" else np.float32
    o, lse, ref, ref_lse = _split_states(1, bounds, dtype)
    o[1] = np.nan                                 # an empty state's o is never read
    out, l = numba_flash.merge_states(o, lse) if merge == "numpy" else _gpu_merge(o, lse)
    tol = 1e-12 if merge == "numpy" else 2e-6
    assert out.dtype == dtype and l.dtype == dtype
    assert np.abs(out - ref).max() <= tol
    fin = np.isfinite(ref_lse)
    assert np.abs(l[fin] - ref_lse[fin]).max() <= tol * 4
    assert np.array_equal(np.isneginf(l), np.isneginf(ref_lse))
    assert np.all(out[:, :, :][np.isneginf(ref_lse).transpose(0, 2, 1)] == 0)


@pytest.mark.parametrize("merge", ["numpy", "kernel"])
def test_associative_and_identity(merge):
    o, lse, _, _ = _split_states(2, [0, 3, 6, 9, 11], np.float32)
    run = (lambda a, b: numba_flash.merge_states(a, b)) if merge == "numpy" else _gpu_merge
    whole = run(o, lse)
    left = run(o[:2], lse[:2])
    right = run(o[2:], lse[2:])
    nested = run(np.stack([left[0], right[0]]), np.stack([left[1], right[1]]))
    assert np.abs(nested[0] - whole[0]).max() <= 2e-6
    assert np.abs(nested[1] - whole[1]).max() <= 2e-6
    # -inf is the identity: appending an empty state with garbage o changes nothing
    junk = np.full((1,) + o.shape[1:], 1e30, np.float32)
    empty = np.full((1,) + lse.shape[1:], -np.inf, np.float32)
    with_id = run(np.concatenate([o, junk]), np.concatenate([lse, empty]))
    assert np.abs(with_id[0] - whole[0]).max() <= 1e-6
    assert np.abs(with_id[1] - whole[1]).max() <= 1e-6
    # a single state merges to itself; all-empty gives 0 and -inf, never NaN
    alone = run(o[:1], lse[:1])
    assert np.allclose(alone[0], np.where(np.isneginf(lse[0]).transpose(0, 2, 1)[..., None], 0,
                                          o[0]), atol=1e-6)
    none = run(np.concatenate([junk, junk]), np.concatenate([empty, empty]))
    assert np.all(none[0] == 0) and np.all(np.isneginf(none[1]))


def test_list_input_and_dtype():
    o, lse, ref, _ = _split_states(3, [0, 5, 11], np.float16)
    out, l = numba_flash.merge_states(list(o), list(lse.astype(np.float32)))
    assert out.dtype == np.float16 and out.shape == ref.shape and l.dtype == np.float32
    assert np.abs(out.astype(np.float64) - ref).max() <= 2e-3


def test_bad_input():
    o, lse, _, _ = _split_states(4, [0, 5, 11], np.float32)
    with pytest.raises(ValueError, match=r"lse must have shape \(n_states, batch, heads, seqlen\)"):
        numba_flash.merge_states(o, lse.transpose(0, 1, 3, 2))
    with pytest.raises(ValueError, match="o must have shape"):
        numba_flash.merge_states(o[0], lse[0])
    with pytest.raises(ValueError, match="same number"):
        numba_flash.merge_states(list(o), list(lse)[:1])
    with pytest.raises(TypeError, match="both be arrays or both be lists"):
        numba_flash.merge_states(list(o), lse)
    with pytest.raises(TypeError, match="floating-point"):
        numba_flash.merge_states(o.astype(np.int32), lse)
    with pytest.raises(ValueError, match="stream applies to GPU arrays only"):
        numba_flash.merge_states(o, lse, stream=1)
    if SIMULATOR:
        with pytest.raises(TypeError, match="float32 on the GPU"):
            merge_states_cuda(o.astype(np.float64), lse)
