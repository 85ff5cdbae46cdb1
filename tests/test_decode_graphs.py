"""Decode inside CUDA graphs (GPU only): a captured call must replay to the bits of an eager
call on the same inputs, with the folded merge's counters and the direct output, for PyTorch
and CuPy stream capture."""
from __future__ import annotations

import numpy as np
import pytest

import numba_flash
from numba_flash.cuda.primitives import SIMULATOR

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(SIMULATOR, reason="needs a real CUDA GPU")]

# (1, 32, 32, 8192)-like: 16 splits, 512 one-warp blocks (the folded merge); num_splits=1 is
# the direct path.
B, HQ, HKV, L, D = 1, 32, 32, 4096, 128


def _torch_inputs(torch, page):
    gen = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(B, 1, HQ, D, device="cuda", dtype=torch.float16, generator=gen)
    k = torch.randn(B, L, HKV, D, device="cuda", dtype=torch.float16, generator=gen)
    v = torch.randn(B, L, HKV, D, device="cuda", dtype=torch.float16, generator=gen)
    lens = torch.tensor([L - 37], dtype=torch.int32, device="cuda")
    if page is None:
        return q, k, v, lens, None
    per = L // page
    perm = torch.randperm(B * per, device="cuda", generator=gen)
    kp = torch.empty(B * per, page, HKV, D, device="cuda", dtype=torch.float16)
    vp = torch.empty_like(kp)
    kp[perm] = k.reshape(B * per, page, HKV, D)
    vp[perm] = v.reshape(B * per, page, HKV, D)
    return q, kp, vp, lens, perm.reshape(B, per).to(torch.int32)


@pytest.mark.parametrize("page, splits", [(None, 16), (None, 1), (16, 16)])
@pytest.mark.parametrize("warm_capture_stream", [True, False])
def test_gpu_torch_graph_replays_eager_bits(page, splits, warm_capture_stream):
    """Two back-to-back decode calls captured in a torch.cuda.CUDAGraph; new queries copied
    in before each replay; every replay equals eager calls on the same inputs, bit for bit.
    ``warm_capture_stream``: an eager call on the capture stream first, or none (the first
    call on that stream is the captured one)."""
    torch = pytest.importorskip("torch")
    q, k, v, lens, table = _torch_inputs(torch, page)
    kw = dict(cache_seqlens=lens, block_table=table, num_splits=splits, return_lse=True)
    numba_flash.decode(q, k, v, **kw)             # compile outside the capture
    torch.cuda.synchronize()
    capture_stream = torch.cuda.Stream()
    if warm_capture_stream:
        capture_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(capture_stream):
            numba_flash.decode(q, k, v, **kw)
        torch.cuda.current_stream().wait_stream(capture_stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=capture_stream):
        out1, lse1 = numba_flash.decode(q, k, v, **kw)
        out2, lse2 = numba_flash.decode(q * 0.5, k, v, **kw)
    for trial in range(3):
        q.copy_(torch.randn_like(q))
        graph.replay()
        torch.cuda.synchronize()
        ref1, rl1 = numba_flash.decode(q, k, v, **kw)
        ref2, rl2 = numba_flash.decode(q * 0.5, k, v, **kw)
        torch.cuda.synchronize()
        assert not torch.isnan(out1.float()).any()
        assert torch.equal(out1, ref1) and torch.equal(lse1, rl1), trial
        assert torch.equal(out2, ref2) and torch.equal(lse2, rl2), trial
    # eager calls on the capture stream after the capture still merge correctly
    with torch.cuda.stream(capture_stream):
        after, _ = numba_flash.decode(q, k, v, **kw)
    torch.cuda.synchronize()
    assert torch.equal(after, ref1)


@pytest.mark.parametrize("splits", [16, 1])
def test_gpu_cupy_graph_replays_eager_bits(splits):
    """The same through CuPy's stream capture (cupy.cuda.Stream.begin_capture)."""
    cp = pytest.importorskip("cupy")
    rng = np.random.default_rng(6)
    q = cp.asarray(rng.standard_normal((B, 1, HQ, D)).astype(np.float16))
    k = cp.asarray(rng.standard_normal((B, L, HKV, D)).astype(np.float16))
    v = cp.asarray(rng.standard_normal((B, L, HKV, D)).astype(np.float16))
    lens = cp.asarray(np.array([L - 11], np.int32))
    kw = dict(cache_seqlens=lens, num_splits=splits, return_lse=True)
    numba_flash.decode(q, k, v, **kw)
    cp.cuda.Device().synchronize()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        out, lse = numba_flash.decode(q, k, v, **kw)
        graph = stream.end_capture()
    for trial in range(3):
        q[...] = cp.asarray(rng.standard_normal(q.shape).astype(np.float16))
        graph.launch(stream)
        stream.synchronize()
        ref, rl = numba_flash.decode(q, k, v, **kw)
        cp.cuda.Device().synchronize()
        assert not cp.isnan(out).any()
        assert cp.array_equal(out, ref) and cp.array_equal(lse, rl), trial


def test_gpu_capture_beyond_the_reserve_raises_clearly():
    """A captured call needing more merge counters than were set aside outside captures
    raises GraphCaptureError naming the fix, and decode works (and captures) afterwards."""
    torch = pytest.importorskip("torch")
    from numba_flash.cuda.launch import decode as dec

    b, hkv, keys = 1024, 8, 64          # 8192 (batch item, kv head) units, two splits each
    q = torch.randn(b, 1, hkv, D, device="cuda", dtype=torch.float16)
    k = torch.randn(b, keys, hkv, D, device="cuda", dtype=torch.float16)
    numba_flash.decode(q[:1], k[:1], k[:1], num_splits=2)        # compiled, small reserve
    torch.cuda.synchronize()
    assert all(s.shape[0] < b * hkv for spares in dec._SPARE_COUNTERS.values() for s in spares)
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(dec.GraphCaptureError, match="outside the capture first"):
        with torch.cuda.graph(graph, stream=stream):
            numba_flash.decode(q, k, k, num_splits=2)
    eager = numba_flash.decode(q, k, k, num_splits=2)              # sets aside a larger reserve
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = numba_flash.decode(q, k, k, num_splits=2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
