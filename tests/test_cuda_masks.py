"""Masks on the device: tile min/max vectors and class tables (numba_flash.cuda.tiles) equal the
reference's, for intervals, packed bitmasks and compiled mask_mods. Small shapes under the
simulator, larger ones on a GPU."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from numba_flash import masks
from numba_flash.cuda.kernels import tile_classes as tiles
from numba_flash.cuda.primitives import SIMULATOR
from numba_flash_reference import tiles as rtiles
from numba_flash_reference.intervals import NotRepresentableError
from mask_examples import example_masks

gpu = pytest.mark.gpu  # skipped under the simulator (tests/conftest.py)
if not SIMULATOR:
    cp = pytest.importorskip("cupy")


def _dev(x):
    return np.ascontiguousarray(x) if SIMULATOR else cp.asarray(np.ascontiguousarray(x))


def _host(x):
    return x if isinstance(x, np.ndarray) else (cp.asnumpy(x) if not SIMULATOR else
                                                 x.copy_to_host())


def _check_intervals(mask, sq, sk, block_m, block_n):
    try:
        iv = mask.column_intervals(sq, sk)
    except NotRepresentableError:
        return False
    mm = tiles.tile_minmax(_dev(iv.stacked().astype(np.int32)), sq, block_n)
    ref = rtiles.tile_minmax(iv, block_n)
    got = _host(mm)
    for row, field in enumerate(tiles.MINMAX_FIELDS):
        np.testing.assert_array_equal(got[row], ref[field], err_msg=f"{mask!r} {field}")
    classes = _host(tiles.classify_intervals(mm, sq, block_m))
    np.testing.assert_array_equal(classes, rtiles.classify_tiles(iv, block_m, block_n),
                                  err_msg=repr(mask))
    return True


def _check_bitmask(dense, block_m, block_n):
    sq, sk = dense.shape
    words = masks.from_dense(dense).to_bitmask(sq, sk).view(np.uint32)
    got = _host(tiles.classify_bitmask(_dev(words), sq, sk, block_m, block_n))
    np.testing.assert_array_equal(got, rtiles.classify_tiles_dense(dense, block_m, block_n))


@settings(max_examples=6 if SIMULATOR else 40, deadline=None)
@given(sq=st.integers(1, 40), sk=st.integers(1, 40), seed=st.integers(0, 999),
       block_m=st.integers(1, 9), block_n=st.integers(1, 9))
def test_interval_tables_equal_reference_for_every_mask(sq, sk, seed, block_m, block_n):
    checked = 0
    for _, mask in example_masks(sq, sk, seed):
        checked += _check_intervals(mask, sq, sk, block_m, block_n)
    assert checked >= 8


@settings(max_examples=15 if SIMULATOR else 40, deadline=None)
@given(sq=st.integers(1, 70), sk=st.integers(1, 100), density=st.floats(0, 1),
       seed=st.integers(0, 999), block_m=st.sampled_from([1, 5, 16, 64]),
       block_n=st.sampled_from([3, 8, 32, 40, 64]))
def test_bitmask_tables_equal_exact_classes(sq, sk, density, seed, block_m, block_n):
    rng = np.random.default_rng(seed)
    dense = rng.random((sq, sk)) < density
    # Whole visible / masked tiles so that FULL and SKIP both occur, not only PARTIAL.
    dense[: sq // 2, : sk // 2] = True
    dense[sq // 2:, sk // 2:] = False
    _check_bitmask(dense, block_m, block_n)


def test_seed001_tree_bitmask_tiles():
    parents = [-1, 0, 1, 1, 2, 2, 3, 3, 4]
    m = masks.tree(parents, prefix_length=23)
    _check_bitmask(m.to_dense(32, 32), 4, 8)


def test_mask_mod_tables_with_captured_document_ids():
    lengths = [6, 3, 8]
    doc = np.repeat(np.arange(3), lengths).astype(np.int32)

    def same_doc_causal(b, h, q, kv):
        return doc[q] == doc[kv] and kv <= q

    got = _host(tiles.classify_mask_mod(same_doc_causal, 1, 1, 17, 17, 6, 5))
    want = rtiles.classify_tiles_dense(masks.causal_document(lengths).to_dense(17, 17), 6, 5)
    np.testing.assert_array_equal(got[0], want)


def test_mask_mod_tables_per_batch_head():
    def per_head(b, h, q, kv):
        return kv <= q - h or b == 1

    got = _host(tiles.classify_mask_mod(per_head, 2, 2, 9, 9, 4, 4))
    m = masks.mask_mod(per_head, batch_head=True)
    for bh in range(4):
        dense = m.to_dense_bh(bh // 2, bh % 2, 9, 9)
        np.testing.assert_array_equal(got[bh], rtiles.classify_tiles_dense(dense, 4, 4))


@gpu
@pytest.mark.parametrize("n", [1000, 4099])
def test_gpu_large_tables(n):
    rng = np.random.default_rng(n)
    for _, mask in example_masks(n, n, 3):
        _check_intervals(mask, n, n, 64, 64)
    # to_dense may hand back a cached read-only matrix: combine into a new array.
    dense = masks.causal_document([n // 3, n // 5, n - n // 3 - n // 5]).to_dense(n, n)
    dense = dense & (rng.random((n, n)) < 0.999)
    _check_bitmask(dense, 64, 64)


# ----------------------------------------------------------------------------- attention kernel

def _attention_case(rng, dtype_name, b, sq, sk, hq, hkv, d, mask, **kw):
    """Run the kernel with a mask object and check the 2x rule against the float64 reference."""
    from numba_flash.cuda.launch import attention as launch
    from numba_flash_reference.attention import attention as reference
    from test_cuda_forward import ATOL, DTYPES, _to_device, _to_host, naive_same_dtype

    dt = DTYPES[dtype_name]
    q = rng.standard_normal((b, sq, hq, d)).astype(dt)
    k = rng.standard_normal((b, sk, hkv, d)).astype(dt)
    v = rng.standard_normal((b, sk, hkv, d)).astype(dt)
    scale = d ** -0.5
    slopes = kw.get("alibi_slopes")      # host float32 (Hq,): the kernel gets a device copy
    dev_kw = dict(kw, alibi_slopes=_to_device(slopes)) if slopes is not None else kw
    out, lse = launch.attention_cuda(*(_to_device(x) for x in (q, k, v)), softmax_scale=scale,
                                     mask=mask, return_lse=True, **dev_kw)
    out, lse = _to_host(out), _to_host(lse)
    ref, ref_lse = reference(q, k, v, softmax_scale=scale, mask=mask, return_lse=True, **kw)
    flags = {key: kw[key] for key in ("causal", "window_size", "sinks") if key in kw}
    from numba_flash_reference.masks import mask_from_flags
    combined = mask_from_flags(mask=mask, **flags)
    if combined is not None and combined.depends_on_batch_head:
        vis = np.stack([np.stack([combined.to_dense_bh(bb, h, sq, sk) for h in range(hq)])
                        for bb in range(b)])
    else:
        vis = np.ones((sq, sk), bool) if combined is None else combined.to_dense(sq, sk)
    bias = None
    if slopes is not None:  # ALiBi: -slope * |i - j| on aligned positions
        dist = np.abs(np.arange(sq)[:, None] + (sk - sq) - np.arange(sk)[None, :])
        bias = -slopes.astype(np.float64)[None, :, None, None] * dist
    naive = naive_same_dtype(q, k, v, scale, vis, kw.get("softcap"), bias)
    err = np.abs(out.astype(np.float64) - ref).max()
    bound = 2 * np.abs(naive - ref).max() + ATOL[dtype_name]
    assert err <= bound, (mask, err, bound)
    finite = np.isfinite(ref_lse)
    assert (np.isneginf(lse) == ~finite).all()
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=1e-4, atol=1e-4)


def _every_third_causal(b, h, q, kv):
    """The mask_mod of SIM_MASKS: one function object for the session, so that its kernels
    (the class-table builder and the attention kernel of each dtype) compile once."""
    return (kv <= q) & ((q - kv) % 3 != 1)


SIM_MASKS = {
    "causal_document": lambda n: masks.causal_document([n // 3, 5, n - n // 3 - 5]),
    "shared_question": lambda n: masks.shared_question([n - 9, 9], [n // 3, 3],
                                                       [[n - 9 - n // 3 - 4, 4], [6]]),
    "tree_bfs_bitmask": lambda n: masks.tree([-1, 0, 1, 1, 2, 2, 3, 3, 4], n - 9),
    "random_dense": lambda n: masks.from_dense(np.random.default_rng(n).random((n, n)) < 0.7),
    "mask_mod": lambda n: masks.mask_mod(_every_third_causal),
}


# One mask per encoding runs everywhere (intervals, packed bitmask, compiled mask_mod); the
# second interval mask and the second (random) bitmask are in the full matrix.
@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.full_matrix)
    if name in ("shared_question", "random_dense") else name for name in sorted(SIM_MASKS)])
def test_kernel_fp32_every_encoding(name):
    rng = np.random.default_rng(7)
    # One head in the simulator (each head is a block: GQA with masks runs in
    # test_kernel_mask_mod_per_head_and_alibi and the backward's mask tests)
    n, hq = (70, 1) if SIMULATOR else (517, 2)
    _attention_case(rng, "float32", 1, n, n, hq, 1, 32, SIM_MASKS[name](n),
                    window_size=(40, -1))


# float16 on intervals also runs in test_kernel_tile_walk_past_32_tiles.
@pytest.mark.parametrize("dtype_name", [pytest.param("float16", marks=pytest.mark.full_matrix),
                                        "bfloat16"])
def test_kernel_half_intervals_and_mask_mod(dtype_name):
    rng = np.random.default_rng(8)
    n = 40 if SIMULATOR else 1029
    d = 32 if SIMULATOR else 128
    _attention_case(rng, dtype_name, 1, n, n, 2, 2, d, SIM_MASKS["causal_document"](n), causal=True)
    if not SIMULATOR:
        for name in sorted(SIM_MASKS):
            _attention_case(rng, dtype_name, 2, n, n, 4, 2, d, SIM_MASKS[name](n), softcap=20.0)


def test_kernel_mask_mod_per_head_and_alibi():
    rng = np.random.default_rng(9)
    m = masks.mask_mod(lambda b, h, q, kv: (kv <= q) & (q - kv <= 3 + 5 * h), batch_head=True)
    # the mask reads h, not b: one batch in the simulator (two heads, 2 blocks), two on a GPU
    n, b = (37, 1) if SIMULATOR else (300, 2)
    _attention_case(rng, "float32", b, n, n, 2, 1, 32, m)
    slopes = np.array([0.3, 0.05], np.float32)
    _attention_case(rng, "float32", 1, n, n, 2, 1, 32, None, causal=True, alibi_slopes=slopes)


@gpu
@pytest.mark.parametrize("n", [1000, 4099])
def test_gpu_every_example_mask_fp16(n):
    rng = np.random.default_rng(n)
    for name, mask in example_masks(n, n, 5):
        _attention_case(rng, "float16", 1, n, n, 2, 1, 64, mask)


def test_packed_row_bounds_decide_the_reference_visibility():
    """The warp-specialised kernel's packed key bounds (``row_bounds_word``: two hidden row
    intervals relative to a 128-row query tile, clamped to it, as (start, length) bytes), read
    with ``mask_tile_rows``' unsigned test ``(r - start) mod 2^32 >= length`` for both
    intervals, give the reference's visibility for every row of the tile: random intervals that
    start and end before, inside and after the tile, empty ones, and keys past the sequence."""
    from numba_flash.cuda.kernels.forward_mma_tiles import TILE_ROWS, row_bounds_word

    pack = getattr(row_bounds_word, "py_func", row_bounds_word)
    rng = np.random.default_rng(12)
    n_keys, sq, seqlen_k = 400, 1000, 390
    starts = rng.integers(0, sq + 1, size=(2, n_keys))
    ends = np.minimum(starts + rng.integers(0, 300, size=(2, n_keys)), sq)
    iv = np.stack([starts[0], ends[0], starts[1], ends[1]]).astype(np.int32)
    iv[:, :20] = iv[:, :1]                     # some empty intervals (start == end)
    rows = np.arange(TILE_ROWS, dtype=np.uint32)
    for row0 in (0, 128, 384, 896):
        for key in range(n_keys):
            w = int(pack(iv, key, seqlen_k, np.int64(row0)))   # int64 as in the kernel
            lts, lln, uts, uln = w & 0xFF, (w >> 8) & 0xFF, (w >> 16) & 0xFF, w >> 24
            got = ((rows - np.uint32(lts)) >= lln) & ((rows - np.uint32(uts)) >= uln)
            r = rows.astype(np.int64) + row0
            lower = (iv[0, key] <= r) & (r < iv[1, key])
            upper = (iv[2, key] <= r) & (r < iv[3, key])
            want = ~(lower | upper)
            want &= key < seqlen_k
            np.testing.assert_array_equal(got, want, err_msg=f"key {key}, row0 {row0}")


@gpu
@pytest.mark.parametrize("dtype_name, d", [("bfloat16", 128), ("float16", 96), ("bfloat16", 64)])
def test_gpu_warp_specialised_interval_masks(dtype_name, d):
    """Column-interval masks at head_dim 64 / 96 / 128 take the warp-specialised kernel (its walk
    over the tiles the mask does not skip, the producer's packed bounds of partial tiles):
    FlashMask's interval masks, alone, with causal and with a right window, at odd lengths,
    Sq < Sk and Sq > Sk, GQA 2, and a walk whose visible tiles lie past the first 32 key tiles,
    against the float64 reference."""
    from numba_flash.cuda.launch import attention as launch
    from numba_flash.cuda.kernels.masking import INTERVALS

    if not launch.wgmma_device():
        pytest.skip("the warp-specialised kernel runs on compute capability 9.0 only")
    for causal in (False, True):
        entry = launch.kernel_for(dtype_name, d, False, causal, False, False, True, INTERVALS)
        assert entry.threads == 384, entry
    rng = np.random.default_rng(d)
    n = 1029
    docs = [300, 7, 500, n - 807]
    cases = [(masks.causal_document(docs), {}), (masks.document(docs), {}),
             (masks.shared_question([n - 9, 9], [n // 3, 3], [[n - 9 - n // 3 - 4, 4], [6]]), {}),
             (masks.global_sliding_window(64, 200), {}), (masks.prefix_lm_causal(n // 4), {}),
             (masks.document(docs), dict(causal=True))]
    for mask, kw in cases:
        _attention_case(rng, dtype_name, 2, n, n, 4, 2, d, mask, **kw)
    _attention_case(rng, dtype_name, 1, 517, n, 2, 1, d, masks.document([n - 130, 130]),
                    causal=True)
    # Sq > Sk with causal (the first rows see no key), and a right window with the mask.
    _attention_case(rng, dtype_name, 1, n, 517, 2, 1, d, masks.document([387, 130]),
                    causal=True)
    _attention_case(rng, dtype_name, 1, n, n, 2, 1, d, masks.causal_document(docs),
                    window_size=(-1, 37))
    sk = 4500                  # 36 key tiles: the visible ones in the second group of 32
    _attention_case(rng, dtype_name, 1, 200, sk, 2, 2, d, masks.document([sk - 130, 130]))


@gpu
def test_gpu_interval_memory_is_linear():
    """Intervals cost O(N) device memory: 16 bytes per key plus 32 per key tile."""
    n = 16384
    m = masks.causal_document([5000, 11384])
    from numba_flash.cuda.launch.maskplan import plan_mask
    plan = plan_mask(m, 1, 1, n, n, 64, 64, False, 0)
    nbytes = plan.iv.nbytes + plan.mm.nbytes
    assert nbytes == 16 * n + 32 * (n // 64)


def test_plan_resolves_the_stream_only_when_it_builds():
    """plan_mask takes the launch stream as a function and calls it only on the call that
    builds the plan (resolving the caller's stream costs host time on every call otherwise);
    the second call returns the cached plan."""
    from numba_flash.cuda.launch.maskplan import plan_mask

    calls = []

    def stream():
        calls.append(1)
        return 0

    m = masks.causal_document([40, 60])
    first = plan_mask(m, 1, 1, 100, 100, 64, 64, False, stream)
    second = plan_mask(m, 1, 1, 100, 100, 64, 64, False, stream)
    assert len(calls) == 1 and second is first
    assert np.array_equal(np.asarray(first.iv if SIMULATOR else first.iv.copy_to_host()),
                          m.column_intervals(100, 100).stacked())


def _far_masks(sq, sk):
    """Masks whose visible key tiles lie in the first and in the second group of 32 tiles."""
    rng = np.random.default_rng(sk)
    dense = np.zeros((sq, sk), bool)
    dense[:, :19] = True
    dense[:, sk - 70:] = rng.random((sq, 70)) < 0.5        # not interval-representable
    return [(masks.global_sliding_window(16, 40), {}),
            (masks.from_dense(dense), {}),
            (masks.causal_document([sk - 100, 100]), dict(window_size=(50, 0), sinks=3)),
            (masks.document([sk - 130, 130]), {})] + ([] if SIMULATOR else [
            # Every tile visible: whole groups of 32 (lane 31's tile included) before the next
            # (on the GPU the vote's int32 result once sign-extended there).
            (masks.document([sk]), {}),
            (masks.prefix_lm_causal(sk // 2), dict(window_size=(sk - 40, -1)))])


@pytest.mark.parametrize("dtype_name,sk", [("float32", 1100), ("float16", 2200)])
def test_kernel_tile_walk_past_32_tiles(dtype_name, sk):
    """The walk classifies 32 key tiles per warp vote: masks whose visible tiles sit in a later
    group (and sinks before a distant window) must still be found (FMA: 32-key tiles, 35 of
    them; tensor cores: 64-key tiles, 35 of them)."""
    rng = np.random.default_rng(11)
    sq = 5
    cases = _far_masks(sq, sk)
    if SIMULATOR and dtype_name == "float16":   # tensor-core steps are slow there: the walk's
        cases = [cases[0], cases[2]]            # two shapes (group jump; sinks, then window)
    for mask, kw in cases:
        from numba_flash.cuda.launch.maskplan import mask_encoding
        assert mask_encoding(mask, sq, sk) in ("intervals", "bitmask")
        _attention_case(rng, dtype_name, 1, sq, sk, 1, 1, 32, mask, **kw)


def _allocated_bytes():
    """Bytes this process holds through Numba's device allocator (what the mask plans allocate
    with), from the allocator's own bookkeeping: unlike the device's free memory, other
    processes on the GPU (pytest-xdist workers) do not move it. With an external memory
    manager plugged into Numba (CuPy's), that pool's used bytes; torch's allocated bytes for
    PyTorch's plugin."""
    from numba import cuda

    manager = cuda.current_context().memory_manager
    allocations = getattr(manager, "allocations", None)
    if allocations is not None:          # Numba's own manager: one entry per live allocation
        return sum(mem.size for mem in list(allocations.values()))
    module = type(manager).__module__
    if module.startswith("cupy"):
        return cp.get_default_memory_pool().used_bytes()
    if module.startswith("torch"):
        import torch

        return torch.cuda.memory_allocated()
    pytest.skip(f"no allocation counter for Numba's memory manager {type(manager).__name__}")


@gpu
def test_gpu_mask_memory_through_allocator_counters():
    """What a mask costs on the device, read from the allocator's counters (so other test
    processes sharing the GPU do not disturb it): column intervals O(N) (16 bytes per key + 32
    per key tile: about 1 MiB at N = 65536, where a bitmask would take 512 MiB); a packed
    bitmask N^2 / 8 bytes plus one byte per tile."""
    from numba import cuda

    from numba_flash.cuda.launch.maskplan import plan_mask

    MiB = 2**20
    # Load the preprocessing kernels and allocate the shared dummy arrays first.
    plan_mask(masks.causal_document([40, 60]), 1, 1, 100, 100, 64, 64, False, 0)
    plan_mask(masks.tree([-1, 0, 1, 1, 2, 2, 3, 3, 4], 91), 1, 1, 100, 100, 64, 64, False, 0)
    cuda.synchronize()

    def used(mask, n):
        before = _allocated_bytes()
        plan = plan_mask(mask, 1, 1, n, n, 64, 64, False, 0)
        cuda.synchronize()
        return _allocated_bytes() - before, plan

    n = 65536
    for i in range(3):
        nbytes, plan = used(masks.causal_document([20000 + i, 45536 - i]), n)
        assert plan.iv.nbytes + plan.mm.nbytes == 16 * n + 32 * (n // 64)
        assert plan.iv.nbytes + plan.mm.nbytes <= nbytes <= 4 * MiB, (i, nbytes)
    n = 16384
    # three branching trees (a chain would be encoded as intervals, not as a bitmask)
    trees = ([-1, 0, 1, 1, 2, 2, 3, 3, 4], [-1, 0, 0, 1, 1, 2, 2, 3, 3], [-1, 0, 0, 1, 2, 3, 4, 5, 6])
    for parents in trees:
        nbytes, plan = used(masks.tree(parents, n - 9), n)
        assert plan.bits.nbytes == n * n // 8
        tiles_bytes = (n // 64) ** 2                          # one int8 class per tile
        assert n * n // 8 + tiles_bytes <= nbytes <= n * n // 8 + tiles_bytes + 4 * MiB, nbytes


@gpu
def test_gpu_masked_launches_repeat_bitwise():
    """Masked (intervals, bitmask, mask_mod), ALiBi and packed calls launched through their
    plans twice give identical bits (the tile walk does not depend on timing)."""
    from numba_flash.cuda.launch import attention as launch
    from numba_flash.varlen import check_varlen

    rng = np.random.default_rng(12)
    n = 2300
    doc = np.repeat(np.arange(3), [900, 700, 700]).astype(np.int32)   # a kernel constant
    cases = [dict(mask=masks.causal_document([900, 700, 700])),
             dict(mask=masks.tree([-1, 0, 1, 1, 2, 2, 3, 3, 4], n - 9)),
             dict(mask=masks.mask_mod(lambda b, h, qi, kv: doc[qi] == doc[kv])),
             dict(causal=True, alibi_slopes=cp.asarray([0.25, 0.0625], cp.float32))]
    for dt in (cp.float16, cp.float32):
        q, k, v = (cp.asarray(rng.standard_normal((1, n, 2, 64))).astype(dt) for _ in range(3))
        cu = cp.asarray([0, 1000, 1000, 2300], cp.int32)
        vl = check_varlen(cu, cu, 1300, 1300, n, n, "cuda")
        calls = [((q, k, v), kw) for kw in cases]
        calls.append(((q[0], k[0], v[0]), dict(causal=True, varlen=vl)))
        for args, kw in calls:
            first = launch.attention_cuda(*args, softmax_scale=0.125, return_lse=True, **kw)
            again = launch.attention_cuda(*args, softmax_scale=0.125, return_lse=True, **kw)
            for a, b in zip(first, again):
                assert bool(cp.all(a.view(cp.uint8) == b.view(cp.uint8))), (dt, kw)
