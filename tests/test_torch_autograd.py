"""numba_flash.torch.attention: gradcheck in float64 on CPU tensors, dtypes, errors, and the
training example of docs/backward.md."""
from __future__ import annotations

import pathlib
import re
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import numba_flash  # noqa: E402
import numba_flash.torch as flash_torch  # noqa: E402
from numba_flash import masks  # noqa: E402

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "backward.md"


def tensors(seed, seqlen_q=5, seqlen_k=6, heads_q=2, heads_kv=2, head_dim=3,
            dtype=torch.float64):
    """q, k, v random normal tensors that require grad."""
    generator = torch.Generator().manual_seed(seed)
    shapes = [(1, seqlen_q, heads_q, head_dim)] + 2 * [(1, seqlen_k, heads_kv, head_dim)]
    return tuple(torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)
                 .requires_grad_() for shape in shapes)


GRADCHECK_CASES = {
    "causal": (dict(causal=True), {}),
    "window_sinks": (dict(window_size=(2, 0), sinks=1), dict(seqlen_q=6)),
    "mask": (dict(mask=masks.prefix_lm_document([3, 3], [1, 2])), dict(seqlen_q=6)),
    "softcap": (dict(softcap=1.5, softmax_scale=0.8), {}),
    "gqa": (dict(causal=True), dict(heads_q=4, heads_kv=1)),
    "alibi": (dict(alibi_slopes=torch.tensor([0.5, 0.25], dtype=torch.float32)), {}),
}


@pytest.mark.parametrize("name", GRADCHECK_CASES)
def test_gradcheck_float64(name):
    options, sizes = GRADCHECK_CASES[name]
    inputs = tensors(len(name), **sizes)
    assert torch.autograd.gradcheck(lambda q, k, v: flash_torch.attention(q, k, v, **options),
                                    inputs)


def test_gradcheck_packed_batch():
    cu_q = torch.tensor([0, 2, 5], dtype=torch.int32)
    cu_k = torch.tensor([0, 3, 6], dtype=torch.int32)
    q, k, v = (x[0] for x in tensors(7))
    assert torch.autograd.gradcheck(
        lambda q, k, v: flash_torch.attention(q, k, v, causal=True, cu_seqlens_q=cu_q,
                                              cu_seqlens_k=cu_k), (q, k, v))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_low_precision_grads_are_attention_backward(dtype):
    q, k, v = tensors(3, dtype=dtype)
    out = flash_torch.attention(q, k, v, causal=True)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(4)).to(dtype)
    out.backward(dout)
    assert out.dtype == dtype and q.grad.dtype == dtype and k.grad.shape == k.shape
    as_numpy = [flash_torch._to_numpy(torch, t) for t in (dout, q, k, v)]
    out_np, lse_np = numba_flash.attention(*as_numpy[1:], causal=True, return_lse=True)
    want = numba_flash.attention_backward(*as_numpy, out_np, lse_np, causal=True)
    for tensor, expected in zip((q, k, v), want):
        np.testing.assert_array_equal(flash_torch._to_numpy(torch, tensor.grad), expected)


def test_only_requested_grads_are_returned():
    q, k, v = tensors(5)
    k.requires_grad_(False)
    flash_torch.attention(q, k, v).sum().backward()
    assert q.grad is not None and k.grad is None and v.grad is not None


def test_option_and_input_errors():
    q, k, v = tensors(6)
    with pytest.raises(TypeError, match=r"unsupported option\(s\) \['return_lse'\]"):
        flash_torch.attention(q, k, v, return_lse=True)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        flash_torch.attention(q.detach().numpy(), k, v)


def test_missing_torch_names_pip_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(ImportError, match="pip install torch"):
        flash_torch.attention(None, None, None)


def test_training_example_of_the_docs_runs():
    text = DOCS.read_text()
    block = re.search(r"<!-- training-example -->\n```python\n(.*?)```", text, re.S).group(1)
    namespace = {"__name__": "training_example"}
    exec(compile(block, str(DOCS), "exec"), namespace)  # noqa: S102 - our own documentation
    losses = namespace["losses"]
    assert losses[-1] < 0.6 * losses[0]
    assert namespace["max_grad_diff"] < 1e-5
