"""NaN and inf in the inputs reach exactly the rows the rules of docs/api.md ("Non-finite
inputs") name, and every other row equals the clean result.

Each test takes a ``backend``: "cpu" (NumPy arrays, CPU mode) and "cuda" (the kernels: CuPy
arrays on a GPU, NumPy arrays in Numba's simulator). Head dims are ones the kernels take.
"""
import numpy as np
import pytest

import numba_flash
from numba_flash import masks
from numba_flash.cuda.primitives import SIMULATOR

BACKENDS = ["cpu", "cuda"]
# (batches, query heads, kv heads) of the attention tests: BIG on CPU mode and, marked
# full_matrix (a GPU machine, or the simulator with --full-matrix), on the kernels; a small
# layout per test on both backends (each (batch, head) is a kernel block, about a second in
# the simulator) that still gives a poisoned row a clean neighbour on the same keys.
BIG = (2, 4, 2)


def layouts(small):
    """(backend, (b, hq, hkv)) parameters: ``small`` and BIG on each backend."""
    return [pytest.param(backend, shape, id=f"{backend}-{'x'.join(map(str, shape))}",
                         marks=[pytest.mark.full_matrix] if backend == "cuda" and shape == BIG
                         else [])
            for backend in BACKENDS for shape in (small, BIG)]


def to_backend(backend, *arrays):
    """The NumPy ``arrays`` as the backend wants them (CuPy arrays for "cuda")."""
    if backend == "cpu" or SIMULATOR:
        return arrays
    cp = pytest.importorskip("cupy")
    try:
        if cp.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
    except Exception as exc:  # noqa: BLE001 - no driver
        pytest.skip(f"no usable CUDA device ({exc})")
    return tuple(cp.asarray(a) for a in arrays)


def to_host(x):
    return x if isinstance(x, np.ndarray) else x.get()


def tol(dtype):
    return dict(rtol=2e-3, atol=1e-3) if np.dtype(dtype).itemsize == 2 else dict(rtol=1e-5,
                                                                                  atol=1e-6)


def check_rows(out, lse, clean_out, clean_lse, nan_rows, dtype):
    """out (B, S, H, D) / lse (B, H, S): rows in ``nan_rows`` (bool (B, S, H)) are NaN in out
    and lse; every other row equals the clean result."""
    out, lse = to_host(out).astype(np.float64), to_host(lse).astype(np.float64)
    clean_out = to_host(clean_out).astype(np.float64)
    clean_lse = to_host(clean_lse).astype(np.float64)
    assert np.isnan(out).all(axis=-1)[nan_rows].all()
    assert np.isnan(lse.transpose(0, 2, 1))[nan_rows].all()
    keep = ~nan_rows
    np.testing.assert_allclose(out[keep], clean_out[keep], **tol(dtype))
    np.testing.assert_allclose(lse.transpose(0, 2, 1)[keep], clean_lse.transpose(0, 2, 1)[keep],
                               **tol(dtype))


def inputs(rng, b, hq, hkv, sq=6, sk=8, d=32, dtype=np.float32):
    q = rng.standard_normal((b, sq, hq, d)).astype(dtype)
    k = rng.standard_normal((b, sk, hkv, d)).astype(dtype)
    v = rng.standard_normal((b, sk, hkv, d)).astype(dtype)
    return q, k, v


def sees(sq, sk):
    """Causal visibility with bottom-right alignment: (sq, sk) bool."""
    return np.arange(sk)[None, :] <= np.arange(sq)[:, None] + sk - sq


def run(backend, q, k, v, **kw):
    args = to_backend(backend, q, k, v)
    return numba_flash.attention(*args, backend=backend, return_lse=True, **kw)


@pytest.mark.parametrize("backend, shape", layouts((1, 2, 1)))
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_q_nonfinite_reaches_its_own_row(backend, shape, value):
    rng = np.random.default_rng(0)
    b, hq, hkv = shape
    q, k, v = inputs(rng, *shape, sq=10, sk=8)   # causal: rows 0 and 1 see no key
    k[..., 0] = np.abs(k[..., 0]) + 0.5     # q[..., 0] = +-inf gives +-inf scores
    clean = run(backend, q, k, v, causal=True)
    bad = q.copy()
    bad[-1, 5, -1, 0] = value               # a row that sees keys
    bad[0, 1, -2, 0] = value                # a row that sees none: stays 0 / -inf
    out, lse = run(backend, bad, k, v, causal=True)
    nan_rows = np.zeros((b, 10, hq), bool)
    if value == -np.inf:
        # every visible score is -inf: the row reaches no key and is empty
        o, l = to_host(out), to_host(lse)
        assert (o[-1, 5, -1] == 0).all() and l[-1, -1, 5] == -np.inf
        expected_o, expected_l = to_host(clean[0]).copy(), to_host(clean[1]).copy()
        expected_o[-1, 5, -1], expected_l[-1, -1, 5] = 0, -np.inf
        clean = (expected_o, expected_l)
    else:
        nan_rows[-1, 5, -1] = True
    check_rows(out, lse, *clean, nan_rows, q.dtype)
    assert (to_host(out)[0, 1, -2] == 0).all() and to_host(lse)[0, -2, 1] == -np.inf


@pytest.mark.parametrize("backend, shape", layouts((1, 2, 1)))
def test_q_inf_times_zero_is_nan(backend, shape):
    rng = np.random.default_rng(1)
    b, hq, hkv = shape
    q, k, v = inputs(rng, *shape)
    k[..., 0] = -np.abs(k[..., 0]) - 0.5    # +inf * negative: -inf scores ...
    k[-1, 2, 0, 0] = 0.0                    # ... except inf * 0 = NaN for key 2 of kv head 0
    clean = run(backend, q, k, v, causal=True)
    bad = q.copy()
    bad[-1, 4, 1, 0] = np.inf               # row 4 (position 6) sees key 2: NaN
    out, lse = run(backend, bad, k, v, causal=True)
    nan_rows = np.zeros((b, 6, hq), bool)
    nan_rows[-1, 4, 1] = True
    check_rows(out, lse, *clean, nan_rows, q.dtype)


@pytest.mark.parametrize("backend, shape", layouts((1, 2, 2)))
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_k_nonfinite_reaches_rows_that_see_the_key(backend, shape, value):
    rng = np.random.default_rng(2)
    b, hq, hkv = shape
    q, k, v = inputs(rng, *shape)
    q[..., 0] = np.abs(q[..., 0]) + 0.5     # inf in k[..., 0]: +inf scores, NaN rows
    clean = run(backend, q, k, v, causal=True)
    bad = k.copy()
    bad[0, 5, 1, 0] = value                 # kv head 1 serves the second group of query heads
    out, lse = run(backend, q, bad, v, causal=True)
    nan_rows = np.zeros((b, 6, hq), bool)
    nan_rows[0, :, hq // hkv:2 * hq // hkv] = sees(6, 8)[:, 5][:, None]   # rows 3, 4, 5
    check_rows(out, lse, *clean, nan_rows, q.dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_k_minus_inf_score_acts_like_the_mask(backend):
    rng = np.random.default_rng(3)
    q, k, v = inputs(rng, 1, 2, 1)
    q[..., 0] = np.abs(q[..., 0]) + 0.5
    bad = k.copy()
    bad[0, 1, 0, 0] = -np.inf               # score -inf for every row: key 1 drops out
    out, lse = run(backend, q, bad, v, causal=True)
    dense = sees(6, 8)
    dense[:, 1] = False
    ref = run(backend, q, k, v, mask=masks.from_dense(dense))
    check_rows(out, lse, *ref, np.zeros((1, 6, 2), bool), q.dtype)


@pytest.mark.parametrize("backend, shape", layouts((1, 2, 2)))
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_v_nonfinite_reaches_one_column_of_rows_that_see_the_key(backend, shape, value):
    rng = np.random.default_rng(4)
    group = shape[1] // shape[2]            # the query heads of one kv head
    q, k, v = inputs(rng, *shape)
    clean_out, clean_lse = (to_host(x) for x in run(backend, q, k, v, causal=True))
    bad = v.copy()
    bad[-1, 4, 0, 7] = value                # kv head 0 serves the first group of query heads
    out, lse = (to_host(x) for x in run(backend, q, k, bad, causal=True))
    hit = np.zeros(out.shape, bool)
    hit[-1, :, :group, 7] = sees(6, 8)[:, 4][:, None]
    assert not np.isfinite(out[hit]).any()
    if np.isnan(value):
        assert np.isnan(out[hit]).all()
    keep = ~hit
    if backend == "cuda":
        # Kernels: the rows of key 4's tile that mask it multiply its V by P = 0, and 0 * nan or
        # 0 * inf is NaN (docs/api.md, "Non-finite inputs"): column 7 may be NaN there too.
        keep[-1, :, :group, 7] = False
        assert np.isfinite(out[-1, :, group:, 7]).all()   # kv head 1 never reads the bad value
    np.testing.assert_allclose(out[keep], clean_out[keep], **tol(q.dtype))
    np.testing.assert_array_equal(lse, clean_lse)       # lse does not read v


@pytest.mark.parametrize("backend, shape", layouts((1, 2, 1)))
def test_masked_keys_never_poison(backend, shape):
    rng = np.random.default_rng(5)
    q, k, v = inputs(rng, *shape, sq=7, sk=7)
    docs = masks.causal_document([3, 4])
    clean = run(backend, q, k, v, mask=docs)
    bad_k, bad_v = k.copy(), v.copy()
    bad_k[:, 1] = np.nan                        # keys of document 0 only
    if backend == "cpu":
        # The kernels multiply a P tile by its V tile: a masked key's 0 * inf in V would reach
        # the rows of its tile (docs/api.md, "Non-finite inputs"); the reference never.
        bad_v[:, 2] = np.inf
        bad_v[:, 6] = np.nan
    bad_k[:, 6] = np.nan                        # the last key: seen by the last row only
    out, lse = run(backend, q, bad_k, bad_v, mask=docs)
    nan_rows = np.zeros((shape[0], 7, shape[1]), bool)
    nan_rows[:, :3] = sees(3, 3)[:, 1][None, :, None]   # rows 1, 2 of document 0
    nan_rows[:, 6] = True
    o, l = to_host(out), to_host(lse)
    assert np.isnan(o[nan_rows]).all() and np.isnan(l.transpose(0, 2, 1)[nan_rows]).all()
    clean_o, clean_l = (to_host(x) for x in clean)
    np.testing.assert_allclose(o[~nan_rows], clean_o[~nan_rows], **tol(q.dtype))
    np.testing.assert_allclose(l.transpose(0, 2, 1)[~nan_rows],
                               clean_l.transpose(0, 2, 1)[~nan_rows], **tol(q.dtype))


@pytest.mark.parametrize("backend, shape", layouts((1, 2, 1)))
def test_varlen_nan_stays_in_its_sequence(backend, shape):
    rng = np.random.default_rng(6)
    _, hq, hkv = shape                      # two packed sequences whatever the batch count
    q = rng.standard_normal((9, hq, 32)).astype(np.float32)
    k = rng.standard_normal((11, hkv, 32)).astype(np.float32)
    v = rng.standard_normal((11, hkv, 32)).astype(np.float32)
    cu_q, cu_k = np.array([0, 4, 9], np.int32), np.array([0, 5, 11], np.int32)

    def call(k_, v_):
        args = to_backend(backend, q, k_, v_, cu_q, cu_k)
        return numba_flash.attention(*args[:3], cu_seqlens_q=args[3], cu_seqlens_k=args[4],
                                     max_seqlen_q=5, max_seqlen_k=6, causal=True,
                                     return_lse=True, backend=backend)

    clean_o, clean_l = (to_host(x) for x in call(k, v))
    bad = k.copy()
    bad[3, 0, 5] = np.nan                   # sequence 0, key 3, kv head 0
    o, l = (to_host(x) for x in call(bad, v))
    nan_rows = np.zeros((9, hq), bool)
    nan_rows[:4, :hq // hkv] = sees(4, 5)[:, 3][:, None]        # rows 2, 3 of sequence 0
    assert np.isnan(o[nan_rows]).all() and np.isnan(l.T[nan_rows]).all()
    np.testing.assert_allclose(o[~nan_rows], clean_o[~nan_rows], **tol(q.dtype))
    np.testing.assert_allclose(l.T[~nan_rows], clean_l.T[~nan_rows], **tol(q.dtype))


def _randn(rng, *shapes, dtype=np.float16):
    return [rng.standard_normal(shape).astype(dtype) for shape in shapes]


def _decode(backend, q, k, v, lens, table=None):
    arrays = (q, k, v, lens) + (() if table is None else (table,))
    moved = to_backend(backend, *arrays)
    return numba_flash.decode(*moved[:3], cache_seqlens=moved[3],
                              block_table=None if table is None else moved[4],
                              return_lse=True, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_contiguous(backend):
    rng = np.random.default_rng(7)
    q, k, v = _randn(rng, (2, 3, 4, 64), (2, 40, 2, 64), (2, 40, 2, 64))
    lens = np.array([30, 40], np.int32)
    bad_k = k.copy()
    bad_k[0, 35:] = np.nan                  # beyond cache_seqlens[0]: never read
    bad_k[0, 28, 1, 3] = np.nan             # seen by rows 1, 2 (positions 28, 29)
    bad_k[1, 12, 0, 0] = np.inf             # q[..., 0] > 0 there: +inf scores for all rows
    q[1, :, :2, 0] = np.abs(q[1, :, :2, 0]) + np.float16(0.5)
    clean = _decode(backend, q, k, v, lens)
    out, lse = _decode(backend, q, bad_k, v, lens)
    nan_rows = np.zeros((2, 3, 4), bool)
    nan_rows[0, 1:, 2:] = True
    nan_rows[1, :, :2] = True
    check_rows(out, lse, *clean, nan_rows, q.dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_paged(backend):
    rng = np.random.default_rng(8)
    q, pages, v = _randn(rng, (2, 1, 4, 64), (6, 16, 2, 64), (6, 16, 2, 64))
    table = np.array([[4, 1], [0, 2]], np.int32)
    lens = np.array([20, 9], np.int32)
    clean = _decode(backend, q, pages, v, lens, table)
    bad_k, bad_v = pages.copy(), v.copy()
    bad_k[3], bad_v[5] = np.nan, np.nan     # pages no sequence uses
    bad_k[1, 10:], bad_v[2] = np.nan, np.nan  # past cache_seqlens: 16 + 4 = 20 and 9 < 16
    bad_v[1, 2, 1, 5] = np.nan              # key 18 of sequence 0, kv head 1, column 5
    out, lse = (to_host(x) for x in _decode(backend, q, bad_k, bad_v, lens, table))
    clean_o, clean_l = (to_host(x) for x in clean)
    hit = np.zeros(out.shape, bool)
    hit[0, 0, 2:, 5] = True
    assert np.isnan(out[hit]).all()
    np.testing.assert_allclose(out[~hit].astype(np.float64), clean_o[~hit].astype(np.float64),
                               **tol(q.dtype))
    np.testing.assert_array_equal(lse, clean_l)


@pytest.mark.parametrize("backend", BACKENDS)
def test_merge_states(backend):
    rng = np.random.default_rng(9)
    o = rng.standard_normal((3, 2, 5, 4, 8)).astype(np.float32)
    lse = rng.standard_normal((3, 2, 4, 5)).astype(np.float32)
    clean_o, clean_l = (to_host(x) for x in numba_flash.merge_states(*to_backend(backend, o, lse)))
    bad_o, bad_l = o.copy(), lse.copy()
    bad_l[0, 1, 2, 3] = np.nan              # row (b 1, s 3, h 2): o and lse NaN
    bad_l[2, 0, 1, 4] = np.inf              # row (b 0, s 4, h 1): exp(inf - inf), NaN
    bad_o[1, 0, 0, 0, 6] = np.nan           # one entry of a non-empty state
    bad_l[1, 1, 0, 2] = -np.inf             # an empty state: its o is ignored ...
    bad_o[1, 1, 2, 0] = np.nan              # ... even when it is NaN
    out, l = (to_host(x) for x in numba_flash.merge_states(*to_backend(backend, bad_o, bad_l)))
    nan_rows = np.zeros((2, 5, 4), bool)
    nan_rows[1, 3, 2] = nan_rows[0, 4, 1] = True
    hit = np.broadcast_to(nan_rows[..., None], out.shape).copy()
    hit[0, 0, 0, 6] = True
    assert np.isnan(out[hit]).all() and np.isnan(l.transpose(0, 2, 1)[nan_rows]).all()
    same = ~hit
    same[1, 2, 0] = False                   # the row with an empty state: checked below
    np.testing.assert_allclose(out[same], clean_o[same], rtol=1e-5, atol=1e-6)
    # the row with the empty state equals the merge of the two others
    two = to_backend(backend, o[[0, 2], 1:2, 2:3, 0:1], lse[[0, 2], 1:2, 0:1, 2:3])
    two_o, _ = numba_flash.merge_states(*two)
    np.testing.assert_allclose(out[1, 2, 0], to_host(two_o)[0, 0, 0], rtol=1e-5, atol=1e-6)
    keep = ~nan_rows
    keep[1, 2, 0] = False
    np.testing.assert_allclose(l.transpose(0, 2, 1)[keep], clean_l.transpose(0, 2, 1)[keep],
                               rtol=1e-5, atol=1e-6)
