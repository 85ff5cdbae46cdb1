"""The repeated-call path's bookkeeping (numba_flash/cuda/launch/fastpath.py), without a GPU:
signatures, identity guards, the device and alignment checks, pointer order. Arrays are
stand-ins that look like torch tensors to the signature readers; the plan is a recorder."""
from __future__ import annotations

import pytest

from numba_flash.cuda.launch import fastpath


class FakeTensor:
    """Reads like a torch tensor to fastpath (shape, stride(), dtype, get_device(), data_ptr())."""

    requires_grad = False

    def __init__(self, shape, ptr, dtype="float16", device=0):
        self.shape, self._ptr, self.dtype, self._device = tuple(shape), ptr, dtype, device

    def stride(self):
        strides, acc = [], 1
        for n in reversed(self.shape):
            strides.insert(0, acc)
            acc *= n
        return tuple(strides)

    def get_device(self):
        return self._device

    def data_ptr(self):
        return self._ptr


FakeTensor.__module__ = "torch.fake"


class RecordingPlan:
    def __init__(self):
        self.calls = []

    def launch(self, pointers, stream):
        self.calls.append((list(pointers), stream))


@pytest.fixture
def call(monkeypatch):
    """A FastCall on a recording plan; outputs are FakeTensors at fixed addresses."""
    outputs = iter(range(0x9000, 0x10000, 0x100))

    def allocators(kind, like, out_shape, out_dtype, lse_shape):
        new = lambda: FakeTensor(out_shape, next(outputs))  # noqa: E731
        lse = (lambda: FakeTensor(lse_shape, next(outputs), "float32")) if lse_shape else None
        return new, lse, (lambda: 77)

    monkeypatch.setattr(fastpath, "_allocators", allocators)
    current = [0]                      # the current device, as the library reports it
    monkeypatch.setattr(fastpath, "device_reader", lambda t: lambda: current[0])
    like = FakeTensor((1, 8, 2, 64), 0x1000)
    mask = object()
    fast = fastpath.FastCall(RecordingPlan(), "torch", like, 0, (1, 8, 2, 64), "float16",
                             (1, 2, 8), (), guards=(mask, None), align=15)
    fast.current = current
    return fast, mask


def test_signature_covers_geometry_and_keywords():
    q, k = FakeTensor((1, 8, 2, 64), 0x1000), FakeTensor((1, 9, 1, 64), 0x2000)
    base = fastpath.call_key("attention", (q, k, k), (0.125, True, (-1, -1)))
    assert base == fastpath.call_key("attention", (FakeTensor((1, 8, 2, 64), 0x5000), k, k),
                                     (0.125, True, [-1, -1]))       # pointers and list vs tuple
    assert base != fastpath.call_key("attention", (q, k, k), (0.125, False, (-1, -1)))
    assert base != fastpath.call_key("attention", (FakeTensor((1, 8, 2, 64), 0, "bfloat16"),
                                                   k, k), (0.125, True, (-1, -1)))
    assert base != fastpath.call_key("attention", (FakeTensor((1, 8, 2, 64), 0, device=1),
                                                   k, k), (0.125, True, (-1, -1)))
    assert fastpath.call_key("attention", (object(), k, k), ()) is None   # no cheap signature
    grad = FakeTensor((1, 8, 2, 64), 0x1000)
    grad.requires_grad = True           # validation refuses it: it must not match a record
    assert base != fastpath.call_key("attention", (grad, k, k), (0.125, True, (-1, -1)))


def test_signature_keys_numpy_values_by_value():
    """NumPy scalars and small host arrays are keyed by value: keyed by id, a freed value's id
    is soon reused by another value, and a later call would replay a plan made for it."""
    import numpy as np

    q = FakeTensor((1, 8, 2, 64), 0x1000)
    key = lambda *options: fastpath.call_key("attention_backward", (q,), options)  # noqa: E731
    assert key(np.float32(0.125)) == key(np.float32(0.125))
    assert key(np.float32(0.125)) != key(np.float32(0.5))
    assert key(np.float32(0.1)) != key(0.1)            # float32's 0.1 is another number
    assert key(np.int64(90)) != key(np.int64(91))
    assert key(np.array([8, 0])) == key(np.array([8, 0]))
    assert key(np.array([8, 0])) != key(np.array([9, 0]))
    assert key(np.zeros(100)) is None                  # a large host array: no signature


def test_run_writes_pointers_in_order_and_uses_the_stream(call):
    fast, mask = call
    q, k, v = (FakeTensor((1, 8, 2, 64), p) for p in (0x1000, 0x2000, 0x3000))
    out, lse = fast.run((q, k, v), (), (mask, None), None)
    pointers, stream = fast.plan.calls[-1]
    assert pointers == [0x1000, 0x2000, 0x3000, out.data_ptr(), lse.data_ptr()]
    assert stream == 77                                   # the library's current stream
    fast.run((q, k, v), (), (mask, None), 5)
    assert fast.plan.calls[-1][1] == 5                    # an explicit raw handle


def test_run_refuses_what_the_full_path_must_see(call, monkeypatch):
    fast, mask = call
    q, k, v = (FakeTensor((1, 8, 2, 64), p) for p in (0x1000, 0x2000, 0x3000))
    assert fast.run((q, k, v), (), (object(), None), None) is None     # another mask object
    misaligned = FakeTensor((1, 8, 2, 64), 0x1002)
    assert fast.run((misaligned, k, v), (), (mask, None), None) is None   # the full path raises
    fast.current[0] = 1
    assert fast.run((q, k, v), (), (mask, None), None) is None         # another device current
    assert fast.plan.calls == []


def test_order_permutes_pointers_for_the_plan(call):
    fast, mask = call
    fast.order = [0, 1, 2, 5, 3, 4]          # e.g. decode: q, k, v, block_table, out, lse
    q, k, v = (FakeTensor((1, 8, 2, 64), p) for p in (0x1000, 0x2000, 0x3000))
    table = FakeTensor((1, 4), 0x4000, "int32")
    out, lse = fast.run((q, k, v), (table,), (mask, None), None)
    assert fast.plan.calls[-1][0] == [0x1000, 0x2000, 0x3000, 0x4000, out.data_ptr(),
                                      lse.data_ptr()]


def test_tables_are_bounded():
    table = fastpath.fast_table("test-bounded")
    for i in range(fastpath._MAX_ENTRIES + 5):
        fastpath.register_fast(table, i, object())
    assert len(table) <= fastpath._MAX_ENTRIES


def test_attention_signature_keys_packed_batch_arrays_by_geometry():
    """A varlen call's cu_seqlens enter attention's signature by geometry (options carry only
    whether each array is given): the same geometry gives the same key, another length or
    dtype another key, and a missing array a different key than a given one."""
    from numba_flash.cuda.launch import attention as runtime

    q, k, v = (FakeTensor((512, 16, 128), 256 * (i + 1)) for i in range(3))

    def key(cu_q, cu_k, given=(False, False)):
        options = (None, True, (-1, -1), 0, None, None, True, False, "auto", given[0],
                   given[1], 212, 212, None, "auto")
        result, signature = runtime.attention_fast(q, k, v, options, (cu_q, cu_k), (None, None),
                                                   None)
        assert result is None            # the table holds no plan for these stand-ins
        return signature[0]

    cu = FakeTensor((4,), 1 << 20, dtype="int32")
    same = FakeTensor((4,), 1 << 21, dtype="int32")       # other data, same geometry
    longer = FakeTensor((5,), 1 << 22, dtype="int32")
    wide = FakeTensor((4,), 1 << 23, dtype="int64")
    assert key(cu, cu) == key(same, same)
    assert len({key(cu, cu), key(longer, cu), key(cu, wide), key(cu, cu, (True, False))}) == 4


def test_two_input_call_without_alignment_check(call, monkeypatch):
    """merge_states' shape of call: two inputs (o, lse), no alignment bits to check (align 0),
    pointers in the plan's order."""
    fast, _ = call
    merge = fastpath.FastCall(RecordingPlan(), "torch", FakeTensor((1, 8, 2, 64), 0x1000), 0,
                              (1, 8, 2, 64), "float32", (1, 2, 8), (), order=(0, 1, 2, 3))
    merge.current = fast.current
    o, lse = FakeTensor((2, 1, 8, 2, 64), 0x1004, "float32"), FakeTensor((2, 1, 2, 8), 0x2004)
    assert merge.run((o, lse), (), (), None) is not None
    pointers, _ = merge.plan.calls[-1]
    assert pointers[:2] == [0x1004, 0x2004] and len(pointers) == 4
