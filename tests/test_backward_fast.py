"""The backward's repeated call (numba_flash/cuda/launch/backward_fast.py).

Without a GPU: the recording names each kernel argument by its source (caller array, output,
workspace) or keeps it as library-owned, and refuses calls it could not replay (arrays sharing
memory, a view inside a per-call array); the replay writes the pointers in plan order and
clears the workspaces the full path clears. On a GPU: a repeated call skips validation and
gives the full path's bits (deterministic mode), for plain, GQA, masked, ALiBi and packed calls,
with torch and CuPy inputs."""
from __future__ import annotations

import numpy as np
import pytest

import numba_flash
from numba_flash import masks
from numba_flash.cuda.launch import backward_fast as bf
from numba_flash.cuda.primitives import SIMULATOR
from test_fastpath import FakeTensor


class Device(FakeTensor):
    """A stand-in device array: a C-contiguous float32 torch tensor to launch/arrays.py too."""

    device = type("Device", (), {"index": 0})()

    def __init__(self, ptr, shape=(4, 8)):
        super().__init__(shape, ptr, np.float32)
        self.nbytes = 4 * int(np.prod(shape))

    @property
    def ptr(self):
        return self.data_ptr()

    def element_size(self):
        return 4


Device.__module__ = "torch.fake"


def caller_arrays():
    return [Device(0x10000 * (i + 1)) for i in range(6)] + [None, None, None]


def test_recording_names_sources_and_keeps_library_arrays():
    arrays = caller_arrays()
    rec = bf.Recording(arrays)
    dq, dk, dv = (Device(0x100000 + 0x1000 * i) for i in range(3))
    rec.add_outputs(dq, dk, dv)
    ws = Device(0x200000)
    rec.workspace(ws, (4, 8), "float32", True)
    assert rec.source_of(arrays[1]) == 1                  # q
    assert rec.source_of(dk) == 10
    assert rec.source_of(ws) == len(bf.SOURCES)           # the first workspace
    assert rec.source_of(Device(0x900000)) is None        # a placeholder / mask plan
    assert rec.ok


def test_recording_keeps_which_caller_arrays_share_memory():
    arrays = caller_arrays()
    arrays[2] = arrays[3] = arrays[1]                     # q, k, v: one tensor
    rec = bf.Recording(arrays)
    assert rec.ok and rec.pattern == (0, 1, 1, 1, 4, 5, 6, 6, 6)
    assert rec.source_of(arrays[3]) == 1


@pytest.mark.parametrize("case", ["inner view", "empty", "host slopes"])
def test_recording_refuses_what_it_cannot_replay(case):
    arrays = caller_arrays()
    if case == "host slopes":               # NumPy ALiBi slopes with GPU q: no replay
        arrays[8] = np.ones(2, np.float32)
    rec = bf.Recording(arrays)
    if case == "inner view":                # a kernel view 64 bytes into q
        rec.source_of(Device(arrays[1].ptr + 64))
    if case == "empty":
        rec.workspace(Device(0, (0,)), (0,), "float32", False)
    assert not rec.ok


def test_replay_writes_pointers_in_plan_order_and_clears_workspaces(monkeypatch):
    class Plan:
        def __init__(self):
            self.calls = []

        def launch(self, pointers, stream):
            self.calls.append((list(pointers), stream))

    arrays = caller_arrays()
    rec = bf.Recording(arrays)
    rec.add_outputs(*(Device(0x100000 + 0x1000 * i) for i in range(3)))
    rec.workspace(Device(0x200000), (4, 8), "float32", True)
    rec.workspace(Device(0x300000), (2, 8), "float32", False)
    first, second = Plan(), Plan()
    rec.launch(first, (0, 1, 12))                 # dout, q, workspace 0
    rec.launch(second, (13, 9, 5))                # workspace 1, dq, lse
    fresh = iter(range(0x700000, 0x800000, 0x1000))
    monkeypatch.setattr(bf, "array_allocator", lambda kind, like, shape, dtype:
                        lambda: Device(next(fresh), shape))
    monkeypatch.setattr(bf, "current_stream_reader", lambda kind, like: lambda: 55)
    monkeypatch.setattr(bf, "device_reader", lambda t: lambda: 0)
    monkeypatch.setattr(bf, "pointer_of", lambda x: x.ptr)
    memsets = []
    monkeypatch.setattr(bf, "memset32_async", lambda *a: memsets.append(a))
    mask = object()
    fast = bf.BackwardFast(rec, "torch", *arrays[1:4], 0, (mask,), 15)
    new = [Device(0x400000 + 0x1000 * i) for i in range(6)] + [None, None, None]
    dq, dk, dv = fast.run(new, (mask,))
    assert (dq.ptr, dk.ptr, dv.ptr) == (0x700000, 0x701000, 0x702000)
    assert memsets == [(0x703000, 0, 32, 55)]     # only the workspace the full path cleared
    assert first.calls == [([new[0].ptr, new[1].ptr, 0x703000], 55)]
    assert second.calls == [([0x704000, 0x700000, new[5].ptr], 55)]
    assert fast.run(new, (object(),)) is None      # another mask object
    misaligned = list(new)
    misaligned[1] = Device(new[1].ptr + 8)
    assert fast.run(misaligned, (mask,)) is None   # the full path raises the alignment error
    unaligned_out = list(new)
    unaligned_out[4] = Device(new[4].ptr + 2)      # the 16-bit kernels read out as words
    assert fast.run(unaligned_out, (mask,)) is None
    aliased = list(new)
    aliased[2] = aliased[1]
    assert fast.run(aliased, (mask,)) is None      # k is q, unlike the recorded call


gpu = pytest.mark.skipif(SIMULATOR, reason="needs a real CUDA GPU")


def _inputs(lib, b, n, hq, hkv, d, dtype="float16", seed=0):
    rng = np.random.default_rng(seed)
    host = [rng.standard_normal(shape).astype(np.float32) for shape in
            ((b, n, hq, d), (b, n, hkv, d), (b, n, hkv, d), (b, n, hq, d))]
    if lib == "torch":
        torch = pytest.importorskip("torch")
        return [torch.from_numpy(x).to("cuda", getattr(torch, dtype)) for x in host]
    cp = pytest.importorskip("cupy")
    return [cp.asarray(x).astype(dtype) for x in host]


def _equal(a, b):
    """Bitwise equal (torch tensors or CuPy arrays; gradients here are finite)."""
    return bool((a == b).all())


def _close(a, b):
    """Equal but for the order of atomic float32 additions (bfloat16 results: a few ulps)."""
    a, b = (x.float() if hasattr(x, "float") else x.astype("float32") for x in (a, b))
    scale = float(abs(a).max()) + 1e-30
    return float(abs(a - b).max()) <= 2 ** -6 * scale


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("lib", ["torch", "cupy"])
@pytest.mark.parametrize("case", ["causal", "gqa", "mask", "alibi", "varlen", "atomic",
                                  "float32"])
def test_repeated_backward_skips_validation_and_matches(lib, case, monkeypatch):
    """Atomic dQ (its zeroed accumulator; bfloat16 with torch) is compared within rounding,
    every other case bit for bit (deterministic mode)."""
    from numba_flash import backward as api_backward

    hq, hkv = (4, 2) if case in ("gqa", "atomic") else (2, 2)
    dtype = {"atomic": "bfloat16" if lib == "torch" else "float16",
             "float32": "float32"}.get(case, "float16")
    q, k, v, dout = _inputs(lib, 2, 70, hq, hkv, 64, dtype)
    kw = dict(deterministic=case != "atomic")
    same = _equal if kw["deterministic"] else _close
    if case in ("causal", "gqa", "atomic", "float32"):
        kw["causal"] = True
    elif case == "mask":
        kw["mask"] = masks.causal_document([30, 40])
    elif case == "alibi":
        slopes = np.array([0.5, 0.25], np.float32)
        kw["alibi_slopes"] = __import__("torch").from_numpy(slopes).cuda() if lib == "torch" \
            else __import__("cupy").asarray(slopes)
    if case == "varlen":
        q, k, v, dout = (x.reshape(140, hq if x.shape[2] == hq else hkv, 64) for x in
                         (q, k, v, dout))
        cu = np.array([0, 50, 140], np.int32)
        cu = __import__("torch").from_numpy(cu).cuda() if lib == "torch" else \
            __import__("cupy").asarray(cu)
        kw.update(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=90, max_seqlen_k=90,
                  causal=True)
    fwd = {key: val for key, val in kw.items() if key != "deterministic"}
    out, lse = numba_flash.attention(q, k, v, return_lse=True, **fwd)
    first = numba_flash.attention_backward(dout, q, k, v, out, lse, **kw)
    numba_flash.attention_backward(dout, q, k, v, out, lse, **kw)      # recorded by now
    validated = []
    real = api_backward.validate
    monkeypatch.setattr(api_backward, "validate",
                        lambda *a, **kw2: validated.append(1) or real(*a, **kw2))
    again = numba_flash.attention_backward(dout, q, k, v, out, lse, **kw)
    assert validated == [], "the repeated call validated: it missed the recorded call"
    for a, b in zip(first, again):
        assert same(a, b)
    # New arrays of the same signature, every one of them with other values (a pointer the
    # recording kept would read the old call's data): the replay's gradients are the full
    # path's on them, bit for bit. out / lse no longer match q, k, v: the gradients are still a
    # deterministic function of the six arrays.
    fresh = (dout * 2 - 1, q * 0.5, k * 1.5, v - 1, out * 0.75, lse + 0.25)
    kw2 = dict(kw)
    if case == "alibi":
        kw2["alibi_slopes"] = kw["alibi_slopes"] * 2
    if case == "varlen":
        kw2["cu_seqlens_q"] = kw2["cu_seqlens_k"] = cu * 1       # same values, new memory
    replayed = numba_flash.attention_backward(*fresh, **kw2)
    assert validated == []
    from numba_flash.cuda.launch.fastpath import fast_table

    fast_table("attention_backward").clear()
    full = numba_flash.attention_backward(*fresh, **kw2)
    assert validated == [1]
    for a, b in zip(full, replayed):
        assert same(a, b)


@gpu
@pytest.mark.gpu
def test_shared_memory_replays_only_alike(monkeypatch):
    """q, k and v the same tensor: the repeated call replays; distinct q, k, v of the same
    geometry do not match that recording, take the full path, and get its gradients."""
    from numba_flash import backward as api_backward

    x, k, v, dout = _inputs("torch", 1, 40, 2, 2, 64)
    kw = dict(causal=True, deterministic=True)
    out, lse = numba_flash.attention(x, x, x, return_lse=True, causal=True)
    for _ in range(2):
        first = numba_flash.attention_backward(dout, x, x, x, out, lse, **kw)
    validated = []
    real = api_backward.validate
    monkeypatch.setattr(api_backward, "validate",
                        lambda *a, **kw2: validated.append(1) or real(*a, **kw2))
    again = numba_flash.attention_backward(dout, x, x, x, out, lse, **kw)
    assert validated == []
    assert all(_equal(a, b) for a, b in zip(first, again))
    out2, lse2 = numba_flash.attention(x, k, v, return_lse=True, causal=True)
    distinct = numba_flash.attention_backward(dout, x, k, v, out2, lse2, **kw)
    assert validated == [1]
    from numba_flash.cuda.launch.fastpath import fast_table

    fast_table("attention_backward").clear()
    full = numba_flash.attention_backward(dout, x, k, v, out2, lse2, **kw)
    assert all(_equal(a, b) for a, b in zip(full, distinct))
