"""The driver-API runtime on a real GPU: launch plans (ctypes cuLaunchKernel) and the
repeated-call path give the same bits as the first call, with torch and CuPy inputs, for
attention (plain, varlen, ALiBi, interval mask), decode (contiguous, paged) and merge_states;
CUDA graph capture of each. The simulator never takes this path (it runs Numba's dispatcher)."""
from __future__ import annotations

import numpy as np
import pytest

import numba_flash
from numba_flash import masks
from numba_flash.cuda.launch import fastpath
from numba_flash.cuda.primitives import SIMULATOR

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(SIMULATOR, reason="needs a real CUDA GPU")]


def _torch():
    return pytest.importorskip("torch")


def _host(x):
    return x.float().cpu().numpy() if type(x).__module__.startswith("torch") else \
        __import__("cupy").asnumpy(x).astype(np.float32)


def _check_twice(call, reference, atol):
    """First call (full path) within ``atol`` of ``reference``; a later call (repeated path)
    bitwise equal to the first, leaving the plan tables as they were."""
    first = call()
    call()              # records the plan (the first call of a process loads the runtime)
    before = {k: len(v) for k, v in fastpath._TABLES.items()}
    second = call()
    after = {k: len(v) for k, v in fastpath._TABLES.items()}
    firsts = first if isinstance(first, tuple) else (first,)
    seconds = second if isinstance(second, tuple) else (second,)
    for a, b in zip(firsts, seconds):
        np.testing.assert_array_equal(_host(a), _host(b))
    assert before == after
    np.testing.assert_allclose(_host(firsts[0]), reference, atol=atol, rtol=0)
    return first


@pytest.mark.parametrize("lib", ["torch", "cupy"])
def test_attention_plain_alibi_mask_varlen_repeat(lib):
    torch = _torch()
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, 130, 4, 64)).astype(np.float32) for _ in range(3))
    slopes = np.abs(rng.standard_normal(4)).astype(np.float32)
    doc = masks.causal_document([50, 80])
    dev = (lambda x: torch.from_numpy(x).cuda()) if lib == "torch" else \
        __import__("cupy").asarray
    qd, kd, vd = (dev(x.astype(np.float16)) for x in (q, k, v))
    for kw in (dict(causal=True), dict(alibi_slopes=slopes, causal=True), dict(mask=doc)):
        ref = numba_flash.attention(q, k, v, backend="cpu", **kw)
        gkw = dict(kw, alibi_slopes=dev(slopes)) if "alibi_slopes" in kw else kw
        _check_twice(lambda: numba_flash.attention(qd, kd, vd, **gkw), ref, 2e-2)
    cu = np.array([0, 60, 60, 130], np.int32)
    ref = numba_flash.attention(q[0], k[0], v[0], causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                backend="cpu")
    cud = dev(cu)
    _check_twice(lambda: numba_flash.attention(qd[0], kd[0], vd[0], causal=True, cu_seqlens_q=cud,
                                               cu_seqlens_k=cud, max_seqlen_q=70, max_seqlen_k=70),
                 ref, 2e-2)


@pytest.mark.parametrize("lib", ["torch", "cupy"])
@pytest.mark.parametrize("paged", [False, True])
def test_decode_and_merge_repeat(lib, paged):
    torch = _torch()
    rng = np.random.default_rng(2)
    b, hq, hkv, d, cap = 2, 8, 2, 128, 1024
    q = rng.standard_normal((b, 1, hq, d)).astype(np.float32)
    kc, vc = (rng.standard_normal((b, cap, hkv, d)).astype(np.float32) for _ in range(2))
    lens = np.array([1000, 333], np.int32)
    dev = (lambda x: torch.from_numpy(np.ascontiguousarray(x)).cuda()) if lib == "torch" else \
        __import__("cupy").asarray
    ref = numba_flash.decode(q, kc, vc, cache_seqlens=lens, backend="cpu")
    if paged:
        table = np.arange(b * cap // 64, dtype=np.int32).reshape(b, cap // 64)
        kp, vp = (x.reshape(b * cap // 64, 64, hkv, d) for x in (kc, vc))
        args = (dev(q.astype(np.float16)), dev(kp.astype(np.float16)), dev(vp.astype(np.float16)))
        extra = dict(block_table=dev(table))
    else:
        args = tuple(dev(x.astype(np.float16)) for x in (q, kc, vc))
        extra = {}
    lens_d = dev(lens)
    for splits in (1, 4):
        _check_twice(lambda: numba_flash.decode(*args, cache_seqlens=lens_d, num_splits=splits,
                                                **extra), ref, 2e-2)
    o = rng.standard_normal((3, 1, 2, 4, 32)).astype(np.float32)
    lse = rng.standard_normal((3, 1, 4, 2)).astype(np.float32)
    ref_o, _ = numba_flash.merge_states(o, lse)
    _check_twice(lambda: numba_flash.merge_states(dev(o), dev(lse)), ref_o, 1e-5)


def test_graph_capture_attention_decode_merge():
    torch = _torch()
    rng = np.random.default_rng(3)
    q, k, v = (torch.from_numpy(rng.standard_normal((1, 64, 4, 64)).astype(np.float16)).cuda()
               for _ in range(3))
    kc, vc = (torch.from_numpy(rng.standard_normal((1, 512, 2, 64)).astype(np.float16)).cuda()
              for _ in range(2))
    qd = q[:, :1].contiguous()
    o = torch.from_numpy(rng.standard_normal((2, 1, 1, 4, 64)).astype(np.float32)).cuda()
    lse = torch.from_numpy(rng.standard_normal((2, 1, 4, 1)).astype(np.float32)).cuda()

    def work():
        return (numba_flash.attention(q, k, v, causal=True), numba_flash.decode(qd, kc, vc),
                numba_flash.merge_states(o, lse)[0])

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        eager = work()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            captured = work()
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(eager, captured):
        assert torch.equal(a, b)


def test_checked_call_never_takes_the_repeated_path():
    """check_inputs=True reads the index arrays back even when the same call was planned
    before (the repeated-call path skips validation): bad cu_seqlens raise."""
    cp = pytest.importorskip("cupy")
    q = cp.asarray(np.random.default_rng(4).standard_normal((40, 2, 64)), cp.float16)
    good = cp.asarray(np.array([0, 20, 40], np.int32))
    bad = cp.asarray(np.array([0, 30, 20], np.int32))
    kw = dict(max_seqlen_q=30, max_seqlen_k=30, causal=True)
    for _ in range(2):
        numba_flash.attention(q, q, q, cu_seqlens_q=good, cu_seqlens_k=good, **kw)
    with pytest.raises(ValueError, match="cu_seqlens_q must be non-decreasing"):
        numba_flash.attention(q, q, q, cu_seqlens_q=bad, cu_seqlens_k=bad, check_inputs=True,
                              **kw)


@pytest.mark.parametrize("mask, flags", [(masks.causal(), dict(causal=True)),
                                         (masks.sliding_window(20, 0),
                                          dict(window_size=(20, 0)))])
def test_folded_mask_calls_take_the_repeated_path(mask, flags, monkeypatch):
    """Validation folds ``masks.causal()`` / ``masks.sliding_window`` into the flags; the
    plan recorded for such a call is guarded by the caller's mask object, so the next call
    with that object skips validation (it once missed every time: ~0.45 ms of host time per
    call, docs/benchmarks.md) and gives the flags' bits."""
    torch = _torch()
    from numba_flash import api

    q, k, v = (torch.randn(1, 70, 2, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    for _ in range(2):
        first = numba_flash.attention(q, k, v, mask=mask)
    validated = []
    real = api.validate
    monkeypatch.setattr(api, "validate", lambda *a, **kw: validated.append(1) or real(*a, **kw))
    again = numba_flash.attention(q, k, v, mask=mask)
    assert validated == []
    assert torch.equal(again, first)
    assert torch.equal(first, numba_flash.attention(q, k, v, **flags))


def test_requires_grad_tensors_never_take_the_repeated_path():
    """A tensor that requires grad is refused by validation (numba_flash.torch carries
    gradients); a call recorded with detached tensors of the same geometry must not let it
    through the repeated path (forward and backward)."""
    torch = _torch()
    q = torch.randn(1, 40, 2, 64, device="cuda", dtype=torch.float16)
    dout = torch.randn_like(q)
    for _ in range(2):
        out, lse = numba_flash.attention(q, q, q, causal=True, return_lse=True)
        numba_flash.attention_backward(dout, q, q, q, out, lse, causal=True)
    q.requires_grad_()
    with pytest.raises(TypeError, match="requires grad"):
        numba_flash.attention(q, q, q, causal=True, return_lse=True)
    with pytest.raises(TypeError, match="requires grad"):
        numba_flash.attention_backward(dout, q, q, q, out, lse, causal=True)
