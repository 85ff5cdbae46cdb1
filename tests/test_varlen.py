"""Packed variable-length batches (cu_seqlens): CPU mode against the reference per sequence,
empty and length-1 sequences, validation, and (with a GPU, or the simulator) the CUDA kernels."""
from __future__ import annotations

import numpy as np
import pytest

from numba import cuda

import numba_flash
from numba_flash.cuda.kernels.sequences import clear_unowned_rows
from numba_flash_reference.attention import attention as reference


def _packed(rng, lens_q, lens_k, hq=4, hkv=2, d=16, dtype=np.float64):
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q = rng.standard_normal((cu_q[-1], hq, d)).astype(dtype)
    k = rng.standard_normal((cu_k[-1], hkv, d)).astype(dtype)
    v = rng.standard_normal((cu_k[-1], hkv, d)).astype(dtype)
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("kw", [{}, {"causal": True}, {"window_size": (3, 1)},
                                {"causal": True, "softcap": 2.0}])
def test_cpu_varlen_matches_reference_per_sequence(kw):
    rng = np.random.default_rng(1)
    lens_q, lens_k = [5, 0, 1, 9, 3], [7, 4, 1, 9, 0]  # empty q, length 1, empty k
    q, k, v, cu_q, cu_k = _packed(rng, lens_q, lens_k)
    out, lse = numba_flash.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                     return_lse=True, **kw)
    assert out.shape == q.shape and lse.shape == (4, len(q))
    assert lse.dtype == (np.float64 if q.dtype == np.float64 else np.float32)
    for s in range(len(lens_q)):
        q0, q1, k0, k1 = cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]
        if q1 == q0:
            continue
        if k1 == k0:
            assert (out[q0:q1] == 0).all() and np.isneginf(lse[:, q0:q1]).all()
            continue
        ref, ref_lse = reference(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1],
                                 return_lse=True, **kw)
        np.testing.assert_allclose(out[q0:q1], ref[0], rtol=0, atol=1e-13)
        np.testing.assert_allclose(lse[:, q0:q1], ref_lse[0].astype(np.float32), rtol=1e-6)


def test_cpu_varlen_alibi_per_sequence_slopes():
    rng = np.random.default_rng(2)
    q, k, v, cu_q, cu_k = _packed(rng, [3, 6], [5, 6], hq=2, hkv=1)
    slopes = np.array([[0.5, 0.25], [0.125, 1.0]], dtype=np.float32)
    out = numba_flash.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True,
                                alibi_slopes=slopes)
    ref = reference(q[None, 3:], k[None, 5:], v[None, 5:], causal=True, alibi_slopes=slopes[1])
    np.testing.assert_allclose(out[3:], ref[0], atol=1e-13)


def test_cpu_varlen_batch_head_mask_mod_sees_the_sequence_as_b():
    """A (b, h)-dependent mask_mod gets the sequence's index as b in CPU mode, as in the GPU
    kernel (it used to get 0 for every sequence)."""
    rng = np.random.default_rng(4)
    lens = [4, 6, 5]
    q, k, v, cu_q, cu_k = _packed(rng, lens, lens, hq=2, hkv=1)
    # sequence b sees b + 1 keys back (per head h: one more for h = 1)
    mod = numba_flash.masks.mask_mod(lambda b, h, qi, kv: (kv <= qi) & (qi - kv <= b + h),
                                     batch_head=True)
    out = numba_flash.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, mask=mod)
    for s in range(len(lens)):
        q0, q1 = cu_q[s], cu_q[s + 1]
        for h in range(2):
            ref = reference(q[None, q0:q1, h:h + 1], k[None, q0:q1], v[None, q0:q1],
                            window_size=(s + h, 0))
            np.testing.assert_allclose(out[q0:q1, h], ref[0, :, 0], atol=1e-13)


def test_varlen_validation_messages():
    rng = np.random.default_rng(3)
    q, k, v, cu_q, cu_k = _packed(rng, [2, 3], [2, 3])
    with pytest.raises(ValueError, match="cu_seqlens_k is None"):
        numba_flash.attention(q, k, v, cu_seqlens_q=cu_q)
    with pytest.raises(TypeError, match="int32"):
        numba_flash.attention(q, k, v, cu_seqlens_q=cu_q.astype(np.float32), cu_seqlens_k=cu_k)
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[-1\] must equal the packed length 5"):
        numba_flash.attention(q, k, v, cu_seqlens_q=np.array([0, 2, 4], np.int32),
                              cu_seqlens_k=cu_k)
    with pytest.raises(ValueError, match="non-decreasing"):
        numba_flash.attention(q, k, v, cu_seqlens_q=np.array([0, 3, 2, 5], np.int32),
                              cu_seqlens_k=np.array([0, 1, 2, 5], np.int32))
    with pytest.raises(ValueError, match="same length"):
        numba_flash.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=np.array([0, 5], np.int32))
    with pytest.raises(ValueError, match="3 dimensions"):
        numba_flash.attention(q[None], k[None], v[None], cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    with pytest.raises(ValueError, match="max_seqlen_q .1. is smaller"):
        numba_flash.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=1)
    with pytest.raises(ValueError, match="packed batches only"):
        numba_flash.attention(q[None], k[None], v[None], max_seqlen_q=3)


# The kernel's options on a packed batch, one test each (pytest-xdist spreads them); the mask
# functions are made once per session (one compiled kernel each).
_MOD = numba_flash.masks.mask_mod(lambda b, h, qi, kv: (qi - kv) % 4 != 2)
# b is the sequence in the kernel and in CPU mode alike
_PER_SEQ = numba_flash.masks.mask_mod(lambda b, h, qi, kv: (kv <= qi) & (qi - kv <= b + 2 * h),
                                      batch_head=True)
VARLEN_OPTIONS = {"causal": {"causal": True},
                  "mask_mod_window": {"mask": _MOD, "window_size": (5, 2)},
                  "batch_head_mask_mod": {"mask": _PER_SEQ}}


@pytest.mark.parametrize("option", sorted(VARLEN_OPTIONS))
def test_cuda_varlen_kernel_matches_reference(option):
    """The kernel on a packed batch (simulator without a GPU)."""
    import inspect

    from numba_flash.cuda.launch import attention as launch
    if "varlen" not in inspect.signature(launch.attention_cuda).parameters:
        pytest.skip("forward kernel without varlen yet (docs/masks.md, 'Status on the GPU')")
    from numba_flash.cuda.primitives import SIMULATOR
    from numba_flash.varlen import check_varlen

    rng = np.random.default_rng(5)
    lens_q, lens_k = ([7, 0, 1, 12], [9, 3, 1, 12]) if SIMULATOR else ([700, 0, 1, 1290, 5],
                                                                        [900, 3, 1, 1290, 0])
    q, k, v, cu_q, cu_k = _packed(rng, lens_q, lens_k, hq=2, hkv=1, d=32, dtype=np.float32)
    vl = check_varlen(cu_q, cu_k, None, None, len(q), len(k), "numpy")
    kw = VARLEN_OPTIONS[option]
    args = (q, k, v)
    if not SIMULATOR:
        import cupy as cp
        args = tuple(cp.asarray(x) for x in args)
        vl = check_varlen(cp.asarray(cu_q), cp.asarray(cu_k), vl.max_seqlen_q,
                          vl.max_seqlen_k, len(q), len(k), "cuda")
    out, lse = launch.attention_cuda(*args, softmax_scale=32 ** -0.5, return_lse=True,
                                     varlen=vl, **kw)
    if not SIMULATOR:
        out, lse = out.get(), lse.get()
    want, want_lse = numba_flash.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                           return_lse=True, softmax_scale=32 ** -0.5, **kw)
    np.testing.assert_allclose(out, want, atol=2e-5)
    fin = np.isfinite(want_lse)
    assert (np.isneginf(lse) == ~fin).all()
    np.testing.assert_allclose(lse[fin], want_lse[fin], atol=2e-5)


def test_cuda_poisoned_offsets_stay_in_bounds():
    """GPU cu_seqlens are not read back (no synchronisation), so the kernels clamp them:
    decreasing, negative and past-the-end offsets, and sequences longer than max_seqlen, run
    without touching memory outside the arrays (the simulator checks every index; on a GPU
    scripts/sanitize_case.py runs the same under compute-sanitizer). Valid sequences of the
    same batch keep their exact result."""
    from gpu_arrays import to_device, to_host
    from numba_flash.cuda.launch.attention import attention_cuda
    from numba_flash.varlen import Varlen

    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((35, 2, 32)).astype(np.float32) for _ in range(3))
    bad = np.array([0, 10, 40, 30, -5, 35], np.int32)       # past the end, decreasing, < 0
    dev = [to_device(x) for x in (q, k, v, bad)]
    unchecked = Varlen(5, dev[3], dev[3], 12, 12, None, None)  # what GPU arrays get
    out, lse = attention_cuda(*dev[:3], softmax_scale=32 ** -0.5, causal=True, return_lse=True,
                              varlen=unchecked)
    out, lse = to_host(out), to_host(lse)
    ref = numba_flash.attention(q[:10][None], k[:10][None], v[:10][None], causal=True)[0]
    np.testing.assert_allclose(out[:10], ref, atol=1e-5)       # sequence 0 is valid
    assert np.isfinite(out).all() and not np.isnan(lse).any()


def _gpu_library(name):
    """What the side-stream test needs of CuPy or torch: (to_device, to_host, nan_array,
    non-blocking stream, busy: hold the current stream up for tens of ms, synchronize)."""
    lib = pytest.importorskip(name)
    if name == "cupy":
        def busy():
            a = lib.ones((4096, 4096), lib.float32)
            for _ in range(8):
                a @ a

        return (lib.asarray, lib.asnumpy, lambda shape, dt: lib.full(shape, np.nan, dtype=dt),
                lib.cuda.Stream(non_blocking=True), busy, lib.cuda.Device().synchronize)
    return (lambda x: lib.from_numpy(x).cuda(), lambda x: x.cpu().numpy(),
            lambda shape, dt: lib.full(shape, float("nan"), dtype=getattr(lib, dt), device="cuda"),
            lib.cuda.Stream(), lambda: lib.cuda._sleep(200_000_000), lib.cuda.synchronize)


@pytest.mark.gpu
@pytest.mark.parametrize("name, dtype", [("cupy", "float16"), ("torch", "float16"),
                                         ("cupy", "float64")])
def test_gpu_varlen_unwritten_rows_on_a_side_stream(name, dtype):
    """Rows past cu_seqlens_q[-1] and those of a sequence with no keys belong to no kernel
    block: they read exactly 0 / -inf although the outputs' memory held NaN (a freed NaN buffer
    of their size, which the pool hands out again) and the call runs on a non-blocking stream
    while the current stream is held up by busy work (the outputs used to be zero-filled on the
    current stream, which then ran after the kernel); the first call (full path) and the
    repeated ones (fast path) alike. float64's lse takes the strided memset of its -inf."""
    to_device, to_host, nan_array, side, busy, synchronize = _gpu_library(name)
    rng = np.random.default_rng(8)
    lens_q, lens_k = [37, 0, 20, 70], [50, 10, 0, 90]
    q, k, v, cu_q, cu_k = _packed(rng, lens_q, lens_k, hq=4, hkv=2, d=64, dtype=dtype)
    used = int(cu_q[-1])
    q = np.concatenate([q, rng.standard_normal((33, 4, 64)).astype(dtype)])   # rows past the end
    exact = np.float64 if dtype == "float64" else np.float32
    want, want_lse = numba_flash.attention(*(x.astype(exact) for x in (q[:used], k, v)),
                                           cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True,
                                           return_lse=True)
    atol = 1e-10 if dtype == "float64" else 3e-3
    args = [to_device(x) for x in (q, k, v, cu_q, cu_k)]
    lse_dtype = "float64" if dtype == "float64" else "float32"
    for _ in range(3):          # the full path, then the repeated-call path
        junk = [nan_array(q.shape, dtype), nan_array((4, len(q)), lse_dtype)]
        del junk
        synchronize()           # the NaN lands (and the uploads) before the side stream runs
        busy()
        out, lse = numba_flash.attention(*args[:3], cu_seqlens_q=args[3], cu_seqlens_k=args[4],
                                         max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k),
                                         causal=True, return_lse=True, stream=side)
        side.synchronize()
        synchronize()
        out, lse = to_host(out).astype(np.float64), to_host(lse)
        assert (out[used:] == 0).all() and np.isneginf(lse[:, used:]).all()
        np.testing.assert_allclose(out[:used], want, rtol=0, atol=atol)
        finite = np.isfinite(want_lse)
        assert (np.isneginf(lse[:, :used]) == ~finite).all()
        np.testing.assert_allclose(lse[:, :used][finite], want_lse[finite], rtol=0, atol=atol)


def test_kernels_clear_rows_no_sequence_owns():
    """clear_unowned_rows (what the varlen forward kernels run first, so that their outputs
    need no fill before the launch): rows before the first sequence, past the launch's
    maximum length and after the last sequence get 0 / -inf, in every head; rows a sequence
    owns are not touched. Offsets GPU callers may pass unchecked: cu[0] = 2, an empty
    sequence, a sequence longer than max_len (3), 4 rows after the last one."""
    from numba_flash.cuda.primitives import SIMULATOR

    if not SIMULATOR:
        pytest.skip("NumPy arrays reach a kernel only in the simulator")
    kernel = cuda.jit(_clear_kernel)
    cu = np.array([2, 5, 5, 9], np.int32)
    out = np.full((1, 13, 2, 3), np.nan, np.float32)
    lse = np.full((1, 2, 13), np.nan, np.float32)
    kernel[(2, 3 * 2), 4](out, lse, cu, 2)
    unowned = [0, 1, 8, 9, 10, 11, 12]
    owned = [r for r in range(13) if r not in unowned]
    assert (out[0, unowned] == 0).all() and (lse[0][:, unowned] == -np.inf).all()
    assert np.isnan(out[0, owned]).all() and np.isnan(lse[0][:, owned]).all()


def _clear_kernel(out, lse, cu, heads):
    b, h = cuda.blockIdx.y // heads, cuda.blockIdx.y % heads
    clear_unowned_rows(out, lse, cu, b, h, cuda.blockIdx.x, cuda.gridDim.x, 2, out.shape[3], 3,
                       cuda.threadIdx.x, cuda.blockDim.x, -np.inf, True)
