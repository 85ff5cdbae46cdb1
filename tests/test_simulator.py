"""Numba's CUDA simulator as the kernels' test bed: the fixes numba_flash installs in it."""
import sys
import threading

import numpy as np
import pytest
from numba import cuda      # module level: the simulator swaps module globals only

from conftest import SIMULATOR

pytestmark = pytest.mark.skipif(not SIMULATOR, reason="Numba's CUDA simulator only")


def _threads_meeting_at_one_shared_array(shared, lanes=32):
    """The arrays that ``lanes`` threads, released together, get from one
    ``cuda.shared.array`` line of the simulator's block-wide allocator ``shared``."""
    got = [None] * lanes
    start = threading.Barrier(lanes)

    def lane(i):
        start.wait()
        got[i] = shared.array(16, np.float32)     # one source line, as in a kernel

    threads = [threading.Thread(target=lane, args=(i,)) for i in range(lanes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return got


def test_every_thread_of_a_block_gets_the_same_shared_array():
    # Numba's allocator checks and fills its table without a lock; under frequent thread
    # switches its unpatched version hands two arrays out in ~8 % of such meetings (a thread
    # then computes alone, a rare wrong kernel result in CI). numba_flash installs a locked one.
    import numba_flash.cuda.primitives  # noqa: F401  (installs the fix)
    from numba.cuda.simulator import kernelapi

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        distinct = [len({id(a) for a in _threads_meeting_at_one_shared_array(
            kernelapi.FakeCUDAShared(0))}) for _ in range(50)]
    finally:
        sys.setswitchinterval(interval)
    assert max(distinct) == 1, distinct


def test_shared_arrays_on_different_lines_stay_apart():
    import numba_flash.cuda.primitives  # noqa: F401
    from numba.cuda.simulator import kernelapi

    shared = kernelapi.FakeCUDAShared(0)
    a = shared.array((2, 3), np.float32)
    b = shared.array((2, 3), np.float32)
    assert a is not b and a.shape == (2, 3) and a.dtype == np.float32
    with pytest.raises(RuntimeError, match="alignment"):
        shared.array(4, np.float32, alignment=16)


def test_a_failing_lane_releases_its_warp():
    """A simulated thread that raises makes Numba abort the block; its warp's other lanes,
    waiting in a warp collective, give up at once (they used to wait out a 300 s timeout)."""
    import time

    from numba_flash.cuda.primitives import shfl_xor

    @cuda.jit
    def kernel(out):
        t = cuda.threadIdx.x
        if t == 5:
            out[100] = 1.0          # out of bounds: this lane raises
        out[t] = shfl_xor(np.float32(t), 1)

    before = threading.active_count()
    with pytest.raises(IndexError, match="out of bounds"):
        kernel[1, 32](np.zeros(32, np.float32))
    deadline = time.monotonic() + 10
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() == before


def test_warp_collectives_still_combine():
    from numba_flash.cuda.primitives import shfl_xor

    @cuda.jit
    def kernel(out):
        t = cuda.threadIdx.x
        x = np.float32(t)
        for m in (1, 2, 4, 8, 16):
            x += shfl_xor(x, m)
        out[cuda.blockIdx.x, t] = x

    out = np.zeros((2, 64), np.float32)
    kernel[2, 64](out)
    warp_sums = np.repeat([np.arange(32).sum(), np.arange(32, 64).sum()], 32)
    assert np.array_equal(out, np.broadcast_to(warp_sums, (2, 64)))


def test_block_runner_yields_and_keeps_barriers():
    """The block runner that sleeps between its polls (primitives/base.py) is installed, and it
    keeps the simulator's meaning of a barrier: a round of writes, syncthreads, reads of other
    threads' values, over several rounds, with threads that return early (their block-mates'
    barriers still release) and a 2-D block."""
    from numba.cuda.simulator import kernel as sim

    assert getattr(sim.BlockManager.run, "yields", False)

    @cuda.jit
    def kernel(out, rounds):
        buf = cuda.shared.array(48, np.float32)
        t = cuda.threadIdx.x + 16 * cuda.threadIdx.y
        if t >= 40:
            return                  # these threads leave before every barrier
        acc = np.float32(0)
        for r in range(rounds):
            buf[t] = np.float32(t + r)
            cuda.syncthreads()
            acc += buf[(t + 1) % 40]
            cuda.syncthreads()
        out[cuda.blockIdx.x, t] = acc

    rounds = 5
    out = np.full((3, 40), np.nan, np.float32)
    kernel[3, (16, 3)](out, rounds)
    expect = np.array([sum((t + 1) % 40 + r for r in range(rounds)) for t in range(40)])
    assert np.array_equal(out, np.broadcast_to(expect, (3, 40)))


def test_offset_copies_stay_inside_the_source_array():
    """The simulator's copies from a computed offset (``cp_async16_flat``: bytes;
    ``cp_async16_at``: elements) read what a GPU reads inside the array, any strides, and raise
    IndexError past its extent, where a GPU would read memory that is not the array's."""
    from numba_flash.cuda.primitives import cp_async16_at, cp_async16_flat

    src = np.arange(2 * 3 * 4, dtype=np.float64).reshape(2, 3, 4)[:, ::2]    # strided view
    dst = np.full(8, np.nan)
    cp_async16_flat(dst, 2, src, src.strides[0] + 8, 16)     # row [1, 0], elements 1 and 2
    assert dst[2:4].tolist() == [13.0, 14.0] and np.isnan(dst[:2]).all()
    cp_async16_flat(dst, 4, src, 0, 0)                       # src_bytes 0: zeros
    assert dst[4:6].tolist() == [0.0, 0.0]
    last = (src.strides[0] + src.strides[1]) // 8 + 3      # src[1, 1, 3], the last element
    with pytest.raises(IndexError):
        cp_async16_flat(dst, 0, src, 8 * last, 16)          # it and one past it
    with pytest.raises(IndexError):
        cp_async16_flat(dst, 0, src, -8, 16)
    words = np.zeros((2, 4), np.float32)
    with pytest.raises(IndexError):
        cp_async16_at(words, 0, 0, np.zeros(6, np.float32), 3, 16)
