"""Online softmax (the kernel algorithm) against exact attention, its precision emulation, tile
classes / orders / trace, overflow safety, and the precision module it rounds with."""
import importlib
import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import numba_flash_reference as R
from numba_flash_reference import masks as M
from numba_flash_reference import tiles
from mask_examples import NO_INTERVALS, example_masks

precision = importlib.import_module("numba_flash_reference.precision")


def random_qkv(rng, b, sq, sk, hq, hkv, d, dtype=np.float64, spread=1.0):
    q = (rng.standard_normal((b, sq, hq, d)) * spread).astype(dtype)
    k = (rng.standard_normal((b, sk, hkv, d)) * spread).astype(dtype)
    v = rng.standard_normal((b, sk, hkv, d)).astype(dtype)
    return q, k, v


def assert_matches(out, lse, ref, ref_lse, atol=1e-12):
    np.testing.assert_allclose(out, ref, rtol=0, atol=atol)
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=0, atol=atol)


def random_order(seed):
    return lambda i, n: np.random.default_rng([seed, i]).permutation(n)


@st.composite
def online_cases(draw):
    case = dict(
        b=draw(st.integers(1, 2)), hkv=draw(st.integers(1, 2)), group=draw(st.sampled_from([1, 3])),
        d=draw(st.integers(1, 6)), sq=draw(st.integers(1, 19)), sk=draw(st.integers(1, 19)),
        block_m=draw(st.integers(1, 8)), block_n=draw(st.integers(1, 8)),
        use_exp2=draw(st.booleans()), skip_tiles=draw(st.booleans()),
        order=draw(st.sampled_from([None, "reverse", "random"])),
        softcap=draw(st.sampled_from([None, 1.5])), seed=draw(st.integers(0, 2 ** 16)),
        mask_kind=draw(st.sampled_from(["none", "causal", "window", "example"])),
        mask_index=draw(st.integers(0, 63)),
    )
    return case


@settings(max_examples=50, deadline=None)
@given(online_cases())
def test_online_equals_exact_in_float64(case):
    rng = np.random.default_rng(case["seed"])
    sq, sk = case["sq"], case["sk"]
    q, k, v = random_qkv(rng, case["b"], sq, sk, case["hkv"] * case["group"], case["hkv"], case["d"],
                         spread=1.5)
    flags = {}
    if case["mask_kind"] == "causal":
        flags = dict(causal=True)
    elif case["mask_kind"] == "window":
        flags = dict(window_size=(int(rng.integers(0, 6)), int(rng.integers(-1, 3))),
                     sinks=int(rng.integers(0, 3)))
    elif case["mask_kind"] == "example":
        masks = example_masks(sq, sk, seed=case["seed"])
        flags = dict(mask=masks[case["mask_index"] % len(masks)][1])
    order = random_order(case["seed"]) if case["order"] == "random" else case["order"]
    ref, ref_lse = R.attention(q, k, v, softcap=case["softcap"], return_lse=True, **flags)
    out, lse = R.online_attention(q, k, v, softcap=case["softcap"], block_m=case["block_m"],
                                  block_n=case["block_n"], use_exp2=case["use_exp2"],
                                  skip_tiles=case["skip_tiles"], tile_order=order,
                                  return_lse=True, **flags)
    assert_matches(out, lse, ref, ref_lse)


@pytest.mark.parametrize("sq,sk", [(17, 17), (11, 23), (23, 11)])
def test_tile_classes_from_tiles_module(sq, sk):
    """Tile classes from reference/tiles.py (FlashMask's min/max rule and the dense one) give the
    exact result; FULL tiles then run without the per-element mask."""
    rng = np.random.default_rng(sq * 100 + sk)
    q, k, v = random_qkv(rng, 1, sq, sk, 2, 1, 4)
    for name, mask in example_masks(sq, sk):
        ref, ref_lse = R.attention(q, k, v, mask=mask, return_lse=True)
        dense_classes = tiles.classify_tiles_dense(mask.to_dense(sq, sk), 4, 3)
        problem = R.check_problem(q.shape, k.shape, v.shape, mask=mask)
        np.testing.assert_array_equal(R.dense_tile_classes(problem, 4, 3), dense_classes)
        candidates = [dense_classes]
        if name not in NO_INTERVALS:
            candidates.append(tiles.classify_tiles(mask.column_intervals(sq, sk), 4, 3))
        for classes in candidates:
            out, lse = R.online_attention(q, k, v, mask=mask, block_m=4, block_n=3,
                                          tile_classes=classes, return_lse=True)
            assert_matches(out, lse, ref, ref_lse)


def test_full_tiles_skip_the_mask_and_skip_tiles_drop_work():
    rng = np.random.default_rng(1)
    q, k, v = random_qkv(rng, 1, 12, 12, 1, 1, 4)
    all_full = np.full((3, 3), 2, dtype=np.int8)
    # Every tile claimed FULL: the causal mask is never applied, so this is full attention.
    out = R.online_attention(q, k, v, causal=True, block_m=4, block_n=4, tile_classes=all_full)
    np.testing.assert_allclose(out, R.attention(q, k, v), rtol=0, atol=1e-12)
    assert np.abs(out - R.attention(q, k, v, causal=True)).max() > 1e-2
    # Key tile 0 claimed SKIP for query tile 2: its keys are missing from that tile's rows.
    classes = R.dense_tile_classes(R.check_problem(q.shape, k.shape, v.shape, causal=True), 4, 4)
    np.testing.assert_array_equal(classes, [[1, 0, 0], [2, 1, 0], [2, 2, 1]])
    classes[2, 0] = 0
    out = R.online_attention(q, k, v, causal=True, block_m=4, block_n=4, tile_classes=classes)
    expected = R.attention(q[:, 8:], k[:, 4:], v[:, 4:], causal=True)
    np.testing.assert_allclose(out[:, 8:], expected, rtol=0, atol=1e-12)
    # ... unless skipping is off: then the tile is processed with the mask, and all is exact.
    out = R.online_attention(q, k, v, causal=True, block_m=4, block_n=4, tile_classes=classes,
                             skip_tiles=False)
    np.testing.assert_allclose(out, R.attention(q, k, v, causal=True), rtol=0, atol=1e-12)


def test_trace_structure_order_and_final_state():
    rng = np.random.default_rng(2)
    q, k, v = random_qkv(rng, 2, 10, 14, 4, 2, 3)
    for use_exp2 in (False, True):
        out, lse, trace = R.online_attention(q, k, v, causal=True, block_m=4, block_n=5,
                                             tile_order="reverse", use_exp2=use_exp2,
                                             return_lse=True, return_trace=True)
        assert set(trace) == {(b, h, t) for b in range(2) for h in range(4) for t in range(3)}
        for (b, h, t), steps in trace.items():
            rows = min(4, 10 - 4 * t)
            # Causal, aligned bottom-right (offset 4): query tile t reaches key column 4t + rows + 3.
            last_tile = (4 * t + rows - 1 + 4) // 5
            assert [j for j, _, _ in steps] == list(range(last_tile, -1, -1))
            for _, m, l in steps:
                assert m.shape == (rows,) and l.shape == (rows,) and m.dtype == np.float64
            ms = np.array([m for _, m, _ in steps])
            assert np.all(np.diff(ms, axis=0) >= 0)  # the running max never decreases
            m, l = steps[-1][1], steps[-1][2]
            final = (m + np.log2(l)) * math.log(2) if use_exp2 else m + np.log(l)
            np.testing.assert_allclose(final, lse[b, h, 4 * t:4 * t + rows], rtol=0, atol=1e-12)


def test_masked_first_tiles_keep_the_empty_state():
    """Reverse order without skipping: rows first meet only masked keys and must keep m = -inf,
    l = 0 (no NaN from -inf - -inf), then come out exact."""
    rng = np.random.default_rng(3)
    q, k, v = random_qkv(rng, 1, 8, 8, 1, 1, 4)
    out, lse, trace = R.online_attention(q, k, v, causal=True, block_m=4, block_n=4,
                                         tile_order="reverse", skip_tiles=False,
                                         return_lse=True, return_trace=True)
    first_key_tile, m, l = trace[(0, 0, 0)][0]
    assert first_key_tile == 1 and np.all(np.isneginf(m)) and np.all(l == 0)
    assert_matches(out, lse, *R.attention(q, k, v, causal=True, return_lse=True))
    for accum in ("float32", "float16", "bfloat16"):
        out = R.online_attention(q, k, v, causal=True, block_m=4, block_n=4, tile_order="reverse",
                                 skip_tiles=False, accum_dtype=accum)
        assert np.all(np.isfinite(out))


@pytest.mark.parametrize("accum", ["float64", "float32", "float16", "bfloat16"])
def test_empty_rows_in_every_precision(accum):
    rng = np.random.default_rng(4)
    q, k, v = random_qkv(rng, 1, 9, 4, 2, 1, 3)
    out, lse = R.online_attention(q, k, v, causal=True, block_m=2, block_n=3, accum_dtype=accum,
                                  return_lse=True)
    assert np.all(out[:, :5] == 0) and np.all(np.isneginf(lse[:, :, :5]))
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse[:, :, 5:]))
    out, lse = R.online_attention(q, k[:, :0], v[:, :0], accum_dtype=accum, return_lse=True)
    assert np.all(out == 0) and np.all(np.isneginf(lse))


@pytest.mark.parametrize("accum", ["float64", "float32"])
@pytest.mark.parametrize("use_exp2", [False, True])
def test_huge_scores_stay_finite_where_naive_softmax_overflows(accum, use_exp2):
    """Scores near 1e4 (integers, exact in float32): exp without the max shift overflows.

    The online result stays finite and exact up to the accumulator's rounding. In float32 the
    scores are exact, so the natural-exp path is accurate to ~1e-7; folding log2(e) into the scale
    rounds s * log2(e) ~ 14427 to float32, an absolute error up to |s| * 2**-24 in the exponent."""
    atol = {("float64", False): 1e-12, ("float64", True): 1e-12, ("float32", False): 1e-6,
            ("float32", True): 2 * 1e4 * 2.0 ** -24}[(accum, use_exp2)]
    rng = np.random.default_rng(5)
    sk = 11
    k = np.zeros((1, sk, 1, 2))
    k[0, :, 0, 0] = 1.0
    k[0, :, 0, 1] = rng.integers(-4, 1, size=sk)  # score = 10000 + 1 * offset
    q = np.zeros((1, 3, 1, 2))
    q[0, :, 0] = [[10000.0, 1.0], [-10000.0, 1.0], [10000.0, 2.0]]
    v = rng.standard_normal((1, sk, 1, 2))
    scores = np.einsum("qd,kd->qk", q[0, :, 0], k[0, :, 0])
    with np.errstate(over="ignore", invalid="ignore"):
        naive = np.exp(scores) / np.exp(scores).sum(axis=1, keepdims=True)
    assert not np.all(np.isfinite(naive))
    shifted = np.exp(scores - scores.max(axis=1, keepdims=True))
    expected = (shifted / shifted.sum(axis=1, keepdims=True)) @ v[0, :, 0]
    out, lse = R.online_attention(q, k, v, softmax_scale=1.0, block_m=2, block_n=4,
                                  accum_dtype=accum, use_exp2=use_exp2, return_lse=True)
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse))
    np.testing.assert_allclose(out[0, :, 0], expected, rtol=0, atol=atol)
    expected_lse = scores.max(axis=1) + np.log(shifted.sum(axis=1))
    np.testing.assert_allclose(lse[0, 0], expected_lse, rtol=1e-7 if accum == "float32" else 1e-15,
                               atol=atol)
    ref = R.attention(q, k, v, softmax_scale=1.0)
    np.testing.assert_allclose(ref[0, :, 0], expected, rtol=0, atol=1e-12)


def test_precision_errors_are_ordered_and_bounded():
    rng = np.random.default_rng(6)
    q, k, v = random_qkv(rng, 1, 96, 96, 2, 1, 16, dtype=np.float16)
    ref = R.attention(q, k, v, causal=True)
    err = {}
    for accum, p in [("float64", None), ("float32", None), ("float32", "float16"),
                     ("float32", "bfloat16"), ("float16", None), ("bfloat16", None)]:
        out = R.online_attention(q, k, v, causal=True, block_m=16, block_n=32, accum_dtype=accum,
                                 p_dtype=p)
        err[(accum, p)] = np.abs(out - ref).max()
    assert err[("float64", None)] < 1e-13
    assert 1e-9 < err[("float32", None)] < 1e-5
    assert err[("float32", None)] * 10 < err[("float32", "float16")] < 2e-3
    assert err[("float32", "float16")] < err[("float32", "bfloat16")] < 2e-2
    assert err[("float32", "float16")] < err[("float16", None)] < 2e-2
    assert err[("float16", None)] < err[("bfloat16", None)] < 1e-1


def test_native_float32_equals_emulated_float32(monkeypatch):
    rng = np.random.default_rng(7)
    q, k, v = random_qkv(rng, 2, 13, 21, 4, 2, 8, dtype=np.float16, spread=2.0)
    kwargs = dict(causal=True, block_m=4, block_n=8, accum_dtype="float32", p_dtype="float16",
                  softcap=3.0, return_lse=True)
    for use_exp2 in (False, True):
        native = R.online_attention(q, k, v, use_exp2=use_exp2, **kwargs)
        monkeypatch.setattr(precision, "NATIVE", {"float64"})
        emulated = R.online_attention(q, k, v, use_exp2=use_exp2, **kwargs)
        monkeypatch.undo()
        np.testing.assert_array_equal(native[0], emulated[0])
        np.testing.assert_array_equal(native[1], emulated[1])
        assert np.abs(native[0] - R.attention(q, k, v, causal=True, softcap=3.0)).max() > 1e-9


def test_outputs_hold_values_of_the_accumulator_precision():
    rng = np.random.default_rng(8)
    q, k, v = random_qkv(rng, 1, 10, 10, 1, 1, 4)
    for accum in ("float32", "float16", "bfloat16"):
        out, lse = R.online_attention(q, k, v, accum_dtype=accum, return_lse=True)
        np.testing.assert_array_equal(out, R.round_to(out, accum))
        np.testing.assert_array_equal(lse, R.round_to(lse, accum))
        assert out.dtype == np.float64


# ----------------------------------------------------------------------------- precision module

def test_round_to_is_correct_rounding():
    x = np.array([1 + 2 ** -8 + 2 ** -30, 1 + 2 ** -8, 1 + 3 * 2 ** -8, 1e39, -1e-45, np.nan])
    got = R.round_to(x, "bfloat16")
    np.testing.assert_array_equal(got[:5], [1 + 2 ** -7, 1.0, 1 + 2 ** -6, np.inf, -0.0])
    assert np.isnan(got[5])
    # ml_dtypes rounds through float32 and gets the first value wrong; the others agree.
    assert float(np.float64(x[0]).astype(ml_dtypes.bfloat16)) == 1.0
    np.testing.assert_array_equal(R.round_to([1 + 2 ** -11, 1 + 3 * 2 ** -11, 65520.0, 2 ** -25],
                                             np.float16), [1.0, 1 + 2 ** -9, np.inf, 0.0])
    np.testing.assert_array_equal(R.round_to([1 + 2 ** -24, 2 ** -149 * 1.5], "float32"),
                                  [1.0, 2 ** -148])
    values = np.random.default_rng(9).standard_normal(1000) * 1e3
    np.testing.assert_array_equal(R.round_to(values, "float64"), values)
    float32_values = values.astype(np.float32).astype(np.float64)
    np.testing.assert_array_equal(R.round_to(float32_values, "bf16"),
                                  float32_values.astype(ml_dtypes.bfloat16).astype(np.float64))
    assert R.round_to(3.0, "float16").dtype == np.float64


def test_precision_names_and_errors():
    assert R.resolve_precision("fp32") == np.float32
    assert R.resolve_precision(ml_dtypes.bfloat16) == np.dtype(ml_dtypes.bfloat16)
    assert R.resolve_precision(np.float16) == np.float16
    assert R.unit_roundoff("float32") == 2.0 ** -24 and R.unit_roundoff("bfloat16") == 2.0 ** -8
    with pytest.raises(ValueError, match="precision must be one of .* got 'float8'"):
        R.resolve_precision("float8")
    with pytest.raises(ValueError, match="got dtype int32"):
        R.resolve_precision(np.int32)
    with pytest.raises(TypeError, match="precision must be a precision name"):
        R.resolve_precision(object())
    with pytest.raises(ValueError, match="dtype must be one of"):
        R.round_to([1.0], "float128")


@pytest.mark.parametrize("name", ["float16", "bfloat16", "float32"])
def test_arithmetic_matches_native_ieee(name):
    """Each Arithmetic operation equals the IEEE operation of that type (NumPy float16/float32
    and ml_dtypes bfloat16 arithmetic on exactly representable operands)."""
    rng = np.random.default_rng(10)
    native = np.float32 if name == "float32" else precision.PRECISIONS[name].type
    a = R.round_to(rng.standard_normal(2000) * 10, name)
    b = R.round_to(rng.standard_normal(2000), name)
    ar = R.Arithmetic(name)
    a_s, b_s = ar.round(a), ar.round(b)
    an, bn = a.astype(native), b.astype(native)
    for op, ref in ((ar.add, an + bn), (ar.sub, an - bn), (ar.mul, an * bn), (ar.div, an / bn)):
        np.testing.assert_array_equal(np.asarray(op(a_s, b_s), np.float64), ref.astype(np.float64))
    got = np.asarray(ar.func(np.exp, b_s), np.float64)
    np.testing.assert_array_equal(got, R.round_to(np.exp(b), name))


# ----------------------------------------------------------------------------- validation

@pytest.mark.parametrize("kwargs,error,match", [
    (dict(block_m=0), ValueError, "block_m must be a positive integer"),
    (dict(block_n=2.5), TypeError, "block_n must be a positive integer"),
    (dict(block_m=True), TypeError, "block_m must be a positive integer"),
    (dict(accum_dtype="float8"), ValueError, "accum_dtype must be one of"),
    (dict(p_dtype=np.int8), ValueError, "p_dtype must be one of"),
    (dict(tile_order="forward"), ValueError, "tile_order must be None, 'reverse' or a callable"),
    (dict(tile_order=lambda i, n: [0] * n), ValueError, r"must return a permutation of range\(3\)"),
    (dict(tile_classes=np.zeros((2, 2), np.int8)), ValueError, r"tile_classes must have shape .*\(3, 3\)"),
    (dict(tile_classes=np.full((3, 3), 3)), ValueError, "entries must be 0 .skip., 1 .partial. or 2"),
    (dict(tile_classes=np.ones((3, 3))), TypeError, "tile_classes must be an integer array"),
    (dict(use_exp2=1), TypeError, "use_exp2 must be a bool"),
    (dict(softcap=-2.0), ValueError, "softcap"),
    (dict(causal="yes"), TypeError, "causal must be a bool"),
])
def test_online_argument_errors(kwargs, error, match):
    q, k, v = random_qkv(np.random.default_rng(0), 1, 9, 9, 1, 1, 2)
    kwargs = {"block_m": 4, "block_n": 4, **kwargs}
    with pytest.raises(error, match=match):
        R.online_attention(q, k, v, **kwargs)


def test_sliding_window_and_sinks_tile_orders():
    """Order studies: sinks first vs sinks last give the same float64 result as the exact one."""
    rng = np.random.default_rng(11)
    q, k, v = random_qkv(rng, 1, 40, 40, 2, 1, 8)
    ref = R.attention(q, k, v, window_size=(9, 0), sinks=4)
    sinks_last = lambda i, n: list(range(1, n)) + [0]  # noqa: E731
    for order in (None, "reverse", sinks_last):
        out = R.online_attention(q, k, v, window_size=(9, 0), sinks=4, block_m=8, block_n=4,
                                 tile_order=order)
        np.testing.assert_allclose(out, ref, rtol=0, atol=1e-12)
    masks_seen = R.online_attention(q, k, v, mask=M.SlidingWindowMask(9, 0, sinks=4), block_m=8,
                                    block_n=4, tile_order=sinks_last, accum_dtype="float32")
    assert np.abs(masks_seen - ref).max() < 1e-5
