"""The worked example of docs/theory.md: every printed number is recomputed with
online_attention (trace), split_attention and merge_states, and must match to print precision."""
import ast
import math
import re
from pathlib import Path

import numpy as np
import pytest

import numba_flash_reference as R

DOC = Path(__file__).resolve().parents[1] / "docs" / "theory.md"
MARKER = "# worked example: recomputed by tests/test_theory_example.py"


def parse_example() -> dict:
    """name -> value (float or list) from the fenced block holding MARKER."""
    text = DOC.read_text()
    blocks = re.findall(r"```text\n(.*?)```", text, flags=re.S)
    block = next(b for b in blocks if MARKER in b)
    values = {}
    for line in block.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        name, value = (part.strip() for part in line.split("=", 1))
        values[name] = ast.literal_eval(value)
    return values


@pytest.fixture(scope="module")
def example():
    return parse_example()


def recompute(example) -> dict:
    scores = np.array(example["scores"], dtype=np.float64)
    v = np.array(example["v"], dtype=np.float64)[None, :, None, :]  # (1, 6, 1, 2)
    q = np.array([1.0, 0.0])[None, None, None, :]
    k = np.stack([scores, np.full(6, 0.7)], axis=1)[None, :, None, :]
    kwargs = dict(softmax_scale=1.0, block_m=1, block_n=3, return_lse=True, return_trace=True)
    out, lse, trace = R.online_attention(q, k, v, **kwargs)
    (t1, m1, l1), (t2, m2, l2) = trace[(0, 0, 0)]
    assert (t1, t2) == (0, 1)
    # acc after tile 1 is the first tile's normalised output times l_1.
    out_a, _ = R.online_attention(q, k[:, :3], v[:, :3], **{**kwargs, "return_trace": False})
    (o_a, o_b), (lse_a, lse_b) = R.split_attention(q, k, v, [0, 3, 6], softmax_scale=1.0)
    merged_o, merged_lse = R.merge_states(o_a, lse_a, o_b, lse_b)
    _, lse2, trace2 = R.online_attention(q, k, v, use_exp2=True, **kwargs)
    got = {
        "tile1.m": m1[0], "tile1.p": np.exp(scores[:3] - m1[0]), "tile1.l": l1[0],
        "tile1.acc": out_a[0, 0, 0] * l1[0],
        "tile2.rowmax": scores[3:].max(), "tile2.m": m2[0], "tile2.alpha": math.exp(m1[0] - m2[0]),
        "tile2.p": np.exp(scores[3:] - m2[0]), "tile2.l": l2[0], "tile2.acc": out[0, 0, 0] * l2[0],
        "out": out[0, 0, 0], "lse": lse[0, 0, 0],
        "merge.o_a": o_a[0, 0, 0], "merge.lse_a": lse_a[0, 0, 0],
        "merge.o_b": o_b[0, 0, 0], "merge.lse_b": lse_b[0, 0, 0],
        "exp2.m": trace2[(0, 0, 0)][-1][1][0], "exp2.l": trace2[(0, 0, 0)][-1][2][0],
    }
    # The merged state and the base-2 run agree with the online result.
    np.testing.assert_allclose(merged_o[0, 0, 0], out[0, 0, 0], rtol=0, atol=1e-14)
    np.testing.assert_allclose(merged_lse[0, 0, 0], lse[0, 0, 0], rtol=0, atol=1e-14)
    np.testing.assert_allclose(lse2, lse, rtol=0, atol=1e-14)
    return got


def test_doc_lists_every_quantity(example):
    names = set(example) - {"scores", "v"}
    assert names == set(recompute(example))
    assert len(example["scores"]) == 6 and len(example["v"]) == 6


def test_doc_numbers_match_recomputation(example):
    for name, value in recompute(example).items():
        # Printed with 6 decimals: off by at most half a unit in the last place.
        np.testing.assert_allclose(example[name], value, rtol=0, atol=5.1e-7, err_msg=name)


def test_doc_numbers_match_exact_attention(example):
    scores = np.array(example["scores"])
    v = np.array(example["v"], dtype=np.float64)
    weights = np.exp(scores - scores.max())
    weights /= weights.sum()
    np.testing.assert_allclose(example["out"], weights @ v, rtol=0, atol=5.1e-7)
    lse = scores.max() + math.log(np.exp(scores - scores.max()).sum())
    np.testing.assert_allclose(example["lse"], lse, rtol=0, atol=5.1e-7)
    np.testing.assert_allclose(example["exp2.m"], scores.max() / math.log(2), rtol=0, atol=5.1e-7)
