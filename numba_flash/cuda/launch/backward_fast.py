"""The backward's repeated call: a full-path call records its launches and workspaces
(``Recording``), a later call with the same signature replays them (``BackwardFast``).

A backward call launches four to six kernels (preprocess, dK / dV, the deterministic dQ
kernel, the reductions) on views of the caller's arrays and of workspaces; the full path
(validation, mask plans, kernel views, a launch plan per kernel) cost ~1.2 ms of host time per
call on the H200 (docs/benchmarks.md, "Launch overhead"), ~70 times a forward call. The
recording keeps each launch's plan with the data pointers that change per call left as
slots, each named by its source: a caller array (dout, q, k, v, out, lse, cu_seqlens_q,
cu_seqlens_k, alibi_slopes), an output (dq, dk, dv) or a workspace (by its order of
allocation). Every other array argument is library-owned (placeholders, a mask's uploaded
plan) and keeps its pointer. A replay allocates the outputs and workspaces with the caller's
allocator on its current stream, clears the workspaces the full path clears, and launches
the plans in order.

Caller arrays may share memory (q, k, v the same tensor; one cu_seqlens for both sides): the
recording keeps which of them did (``pattern``), and a call whose arrays share memory
differently takes the full path (which records it anew). Only calls on the caller's current
stream (``stream=None``) with CuPy arrays or torch tensors are recorded, and only when no
kernel argument points inside a per-call array other than at its start (a view the recording
cannot name).
"""
from __future__ import annotations


from .arrays import array_kind, interface
from .driver import memset32_async
from .fastpath import (array_allocator, call_key, current_stream_reader, device_reader,
                       fast_table, pointer_of, register_fast)

__all__ = ["Recording", "BackwardFast", "backward_fast", "SOURCES"]

SOURCES = ("dout", "q", "k", "v", "out", "lse", "cu_seqlens_q", "cu_seqlens_k", "alibi_slopes",
           "dq", "dk", "dv")
_CALLER = 9                      # SOURCES[:9] are the caller's arrays
_FAST_CALLS = fast_table("attention_backward")


def _extent(x) -> tuple[int, int]:
    """(data pointer, bytes spanned; 0 when empty) of a device array (``interface``: torch
    tensors through their attributes, as torch has no CUDA array interface for bfloat16)."""
    ptr, shape, strides, itemsize, _ = interface(x, array_kind(x))
    span = itemsize + sum((n - 1) * abs(st) for n, st in zip(shape, strides))
    return ptr, span if all(shape) else 0


class Recording:
    """The launches and workspaces of one full-path call (see the module docstring).

    ``arrays``: the call's per-call arrays in ``SOURCES`` order (None where absent)."""

    def __init__(self, arrays):
        self.ok = True
        self.slot_of: dict = {}           # data pointer -> source index
        self.spans: list = []             # (pointer, bytes) of every per-call array
        self.workspaces: list = []        # (shape, dtype name, zeroed)
        self.steps: list = []             # (launch plan, source index of each pointer slot)
        if any(x is not None and array_kind(x) not in ("cupy", "torch") for x in arrays):
            self.ok, arrays = False, [None] * len(arrays)   # host copies, other kinds: no replay
        pointers = [0 if x is None else _extent(x)[0] for x in arrays]
        self.pattern = sharing_pattern(pointers)
        for index, x in enumerate(arrays):
            if x is not None and self.pattern[index] == index:
                self._add(index, x)

    def _add(self, index, x):
        ptr, span = _extent(x)
        if ptr == 0 or ptr in self.slot_of:
            self.ok = False               # empty, or an output / workspace sharing memory
        self.slot_of[ptr] = index
        self.spans.append((ptr, span))

    def add_outputs(self, dq, dk, dv):
        """Note the call's outputs (sources ``dq``, ``dk``, ``dv``)."""
        for index, x in zip(range(_CALLER, _CALLER + 3), (dq, dk, dv)):
            self._add(index, x)

    def workspace(self, arr, shape, dtype_name, zero):
        """Note a workspace the full path allocated (its source index follows the outputs')."""
        self.workspaces.append((tuple(shape), dtype_name, bool(zero)))
        self._add(len(SOURCES) + len(self.workspaces) - 1, arr)

    def source_of(self, arg):
        """The source index of a kernel argument that is a per-call array, None for a
        library-owned one; marks the recording unusable for a view inside a per-call array."""
        ptr, _ = _extent(arg)
        index = self.slot_of.get(ptr)
        if index is None and any(start < ptr < start + span for start, span in self.spans):
            self.ok = False
        return index

    def launch(self, plan, sources):
        self.steps.append((plan, tuple(sources)))


def sharing_pattern(pointers) -> tuple:
    """For each array (by data pointer; 0: absent) the index of the first with its pointer."""
    return tuple(pointers.index(p) for p in pointers)


class BackwardFast:
    """A recorded backward call, replayed on new arrays of the same signature."""

    def __init__(self, recording, kind, q, k, v, device, guards, align):
        self.steps, self.guards, self.device, self.align = recording.steps, guards, device, align
        self.pattern = recording.pattern
        self.current_device = device_reader(type(q))
        self.new_dq, self.new_dk, self.new_dv = (
            array_allocator(kind, q, tuple(x.shape), q.dtype) for x in (q, k, v))
        self.new_workspaces = [(array_allocator(kind, q, shape, name), zero)
                               for shape, name, zero in recording.workspaces]
        self.current_stream = current_stream_reader(kind, q)

    def run(self, arrays, guards):
        """(dq, dk, dv) launched on ``arrays`` (the caller's, ``SOURCES[:9]`` order), or None
        when this call must take the full path after all."""
        for given, recorded in zip(guards, self.guards):
            if given is not recorded:
                return None
        if self.current_device() != self.device:
            return None
        ptrs = [0 if x is None else pointer_of(x) for x in arrays]
        if self.align and ((ptrs[0] | ptrs[1] | ptrs[2] | ptrs[3]) & self.align or ptrs[4] & 3):
            return None                   # the full path raises the alignment error
        if sharing_pattern(ptrs) != self.pattern:
            return None                   # arrays share memory unlike the recorded call's
        handle = self.current_stream()
        outputs = (self.new_dq(), self.new_dk(), self.new_dv())
        ptrs += [pointer_of(x) for x in outputs]
        workspaces = []                   # alive until every launch is enqueued
        for new, zero in self.new_workspaces:
            arr = new()
            workspaces.append(arr)
            ptrs.append(pointer_of(arr))
            if zero:
                memset32_async(ptrs[-1], 0, arr.nbytes // 4, handle)
        for plan, sources in self.steps:
            plan.launch([ptrs[i] for i in sources], handle)
        return outputs


def backward_fast(dout, q, k, v, out, lse, options, extras, guards):
    """A repeated backward call: the recording under this call's signature, replayed.

    ``options``: the call's keyword values (arrays among them keyed by geometry); ``extras``:
    (cu_seqlens_q, cu_seqlens_k, alibi_slopes), None where not given; ``guards``: its mask
    object. Returns ((dq, dk, dv), None) on a hit, else (None, (signature, guards, extras))
    for ``backward_cuda`` to record under (None: this call cannot be recorded)."""
    key = call_key("attention_backward", (dout, q, k, v, out, lse), options)
    if key is None:
        return None, None
    try:
        call = _FAST_CALLS.get(key)
    except TypeError:                     # an unhashable keyword value
        return None, None
    if call is not None:
        result = call.run((dout, q, k, v, out, lse) + tuple(extras), guards)
        if result is not None:
            return result, None
    return None, (key, guards, tuple(extras))


def record(signature, recording, kind, q, k, v, device, align):
    """Keep ``recording`` for later calls of ``signature`` ((key, guards) from
    ``backward_fast``); ``align``: the bits dout, q, k and v's pointers must clear (15 for the
    16-bit kernels' 16-byte copies, which also read out as 32-bit words), 0 for none."""
    if signature is not None and recording.ok and recording.steps:
        key, guards = signature
        register_fast(_FAST_CALLS, key, BackwardFast(recording, kind, q, k, v, device, guards,
                                                     align))
