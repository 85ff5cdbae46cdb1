"""The direct launch's parameter block, checked without a GPU.

On a GPU, ``launch._launch_fast`` packs every kernel argument itself (Numba's flattened array
layout: meminfo, parent, size, itemsize, data, shape..., strides...) and hands the list to
``cuda.core.launch``; the simulator never takes that path. Here a subprocess imports the real
launcher with the driver calls stubbed out (``scripts/host_overhead_cpu.py``), captures what
would be launched, and compares it with the layout written out by hand.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")

_CAPTURE = r"""
import ctypes, json, math, sys
sys.path.insert(0, "scripts")
import host_overhead_cpu as h
h.stub_driver(cc=tuple(json.loads(sys.argv[1])))
from numba_flash.cuda.launch import attention as launch
import numba_flash
from numba_flash import masks
captured = []
launch._core_launch = lambda stream, config, kernel, *params: captured.append((config, params))
def plain(x):
    return x.value if isinstance(x, (ctypes.c_int64, ctypes.c_float, ctypes.c_double)) else x
q = h.FakeGPUArray((2, 200, 4, 64), "float16", ptr=0x10000)
k = h.FakeGPUArray((2, 70, 2, 64), "float16", ptr=0x20000)
v = h.FakeGPUArray((2, 70, 2, 64), "float16", ptr=0x30000)
out, lse = numba_flash.attention(q, k, v, causal=True, return_lse=True, softcap=30.0)
numba_flash.attention(q, k, v, mask=masks.causal_document([30, 40]))
# a packed batch and ALiBi: the caller's arrays go in as they are (no Numba wrapper, which
# would need a driver here)
qp, kp, vp = (h.FakeGPUArray((n, hh, 64), "float16", ptr=p)
              for n, hh, p in ((60, 4, 0x10000), (90, 2, 0x20000), (90, 2, 0x30000)))
cu_q = h.FakeGPUArray((3,), "int32", ptr=0x40000)
cu_k = h.FakeGPUArray((3,), "int32", ptr=0x50000)
numba_flash.attention(qp, kp, vp, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=40,
                      max_seqlen_k=50, causal=True)
numba_flash.attention(q, k, v, causal=True, alibi_slopes=h.FakeGPUArray((4,), "float32",
                                                                      ptr=0x60000))
# the first call again on other arrays of the same configuration: a cached launch plan,
# only the data pointers differ (the output's come from the same fake allocator)
q2, k2, v2 = (h.FakeGPUArray(x.shape, "float16", ptr=p)
              for x, p in ((q, 0x11000), (k, 0x21000), (v, 0x31000)))
numba_flash.attention(q2, k2, v2, causal=True, return_lse=True, softcap=30.0)
rows = [[list(c), [plain(p) for p in params]] for c, params in captured]
print(json.dumps({"calls": rows, "out": [out.data.ptr, list(out.shape)],
                  "lse": [lse.data.ptr, list(lse.shape)]}))
"""


def _capture(cc=(9, 0)):
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    res = subprocess.run([sys.executable, "-c", _CAPTURE, json.dumps(list(cc))], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    if res.returncode != 0 and "cuda.core" in res.stderr and "ImportError" in res.stderr:
        pytest.skip("cuda.core is not importable here: " + res.stderr.strip().splitlines()[-1])
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def _flat(ptr, shape, itemsize):
    """Numba's flattened C-contiguous array argument."""
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.insert(0, step)
        step *= n
    size = 1
    for n in shape:
        size *= n
    return [0, 0, size, itemsize, ptr, *shape, *strides]


@pytest.mark.parametrize("cc", [(9, 0), (8, 0)], ids=["sm90-wgmma", "sm80-mma-sync"])
def test_direct_launch_parameters(cc):
    got = _capture(cc)
    (config, params), (mask_config, mask_params), (var_config, var_params), \
        (alibi_config, alibi_params), (again_config, again_params) = got["calls"]
    out_ptr, out_shape = got["out"]
    lse_ptr, lse_shape = got["lse"]
    assert out_shape == [2, 200, 4, 64] and lse_shape == [2, 4, 200]

    # q, k, v and out as uint32 words (pairs along head_dim), lse as float32
    expect = []
    for ptr, shape in ((0x10000, (2, 200, 4, 32)), (0x20000, (2, 70, 2, 32)),
                       (0x30000, (2, 70, 2, 32)), (out_ptr, (2, 200, 4, 32))):
        expect += _flat(ptr, shape, 4)
    expect += _flat(lse_ptr, (2, 4, 200), 4)
    scale, cap, log2e = 64 ** -0.5, 30.0, 1 / math.log(2)
    expect += [200, 70, 2]                                         # seqlen_q, seqlen_k, GQA ratio
    expect += [scale * log2e, scale / cap, cap * log2e]           # float32 scalars
    expect += [-1, 0, 0]                                          # causal: window (-1, 0), no sinks
    n_fixed = len(expect)
    assert len(params) > n_fixed
    for i, (a, b) in enumerate(zip(params[:n_fixed], expect)):
        assert a == pytest.approx(b, rel=1e-6), (i, a, b)

    # geometry: one block per 128-row query tile and (batch x head): two warpgroups of one
    # m-tile (wgmma, sm_90 only) or four warps of two m-tiles (mma.sync)
    grid, threads, smem = config
    assert grid == [2, 2 * 4]
    assert threads == (256 if cc == (9, 0) else 128)
    assert (smem > 48 * 1024) == (cc == (9, 0))

    # the masked call: same leading block with lse omitted (null placeholder), window (-1, -1),
    # then the interval arrays of the mask plan as the first trailing argument
    assert mask_config[0] == grid and mask_config[1] == threads
    # a 4-D array is 13 parameters (5 + 4 shape + 4 strides), the 3-D lse 11, then 6 scalars
    assert mask_params[4 * 13 + 4] == 0                 # lse placeholder: no data pointer
    lead = 4 * 13 + 11 + 6
    assert mask_params[lead:lead + 3] == [-1, -1, 0]
    iv = mask_params[lead + 3:lead + 3 + 9]
    assert iv[2:4] == [4 * 70, 4] and iv[5:7] == [4, 70]   # (4, seqlen_k) int32 intervals

    # packed batch: (1, total, H, D / 2) word views (lead stride 0), grid over the longest
    # sequence and batch x heads; cu_seqlens q and k follow the four mask arrays
    expect = []
    for ptr, shape, strides in ((0x10000, (1, 60, 4, 32), (0, 512, 128, 4)),
                                (0x20000, (1, 90, 2, 32), (0, 256, 128, 4)),
                                (0x30000, (1, 90, 2, 32), (0, 256, 128, 4))):
        size = shape[1] * shape[2] * shape[3]
        expect += [0, 0, size, 4, ptr, *shape, *strides]
    assert var_params[:len(expect)] == expect
    assert var_config[0] == [1, 2 * 4]
    # after the window: the mask arrays, three 2-D (9 parameters each) and one 3-D (11)
    cu = var_params[lead + 3 + 3 * 9 + 11:]
    assert [0, 0, 3, 4, 0x40000, 3, 4] == cu[:7] and [0, 0, 3, 4, 0x50000, 3, 4] == cu[7:14]

    # ALiBi: the (heads_q,) slopes broadcast to (batch, heads_q) with a zero batch stride,
    # the last argument
    assert alibi_params[-9:] == [0, 0, 8, 4, 0x60000, 2, 4, 0, 4]
    assert alibi_config[0] == grid

    # the repeated configuration (a cached plan): the same block with q, k, v's new pointers
    assert again_config == config
    moved = {4: 0x11000, 13 + 4: 0x21000, 2 * 13 + 4: 0x31000}
    assert again_params == [moved.get(i, p) for i, p in enumerate(params)]


_CAPTURE_DECODE = r"""
import ctypes, json, sys
sys.path.insert(0, "scripts")
import host_overhead_cpu as h
h.stub_driver()
from numba_flash.cuda.launch import decode as dec, launch
import numba_flash
captured = []
launch._core_launch = lambda stream, config, kernel, *params: captured.append(params)
def plain(x):
    return x.value if isinstance(x, (ctypes.c_int64, ctypes.c_float, ctypes.c_double)) else x
def call(base):
    q = h.FakeGPUArray((2, 1, 8, 64), "float16", ptr=base)
    k = h.FakeGPUArray((2, 300, 2, 64), "float16", ptr=base + 0x100000)
    v = h.FakeGPUArray((2, 300, 2, 64), "float16", ptr=base + 0x200000)
    lens = h.FakeGPUArray((2,), "int32", ptr=base + 0x300000)
    numba_flash.decode(q, k, v, cache_seqlens=lens, num_splits=3)
call(0x1000000)                 # builds the plan
call(0x5000000)                 # reuses it: new pointers only
dec._DECODE_PLANS.clear()
call(0x5000000)                 # the same call from a fresh plan
print(json.dumps([[plain(p) for p in params] for params in captured]))
"""


def test_decode_cached_plan_equals_a_fresh_one():
    """decode's direct launch caches its parameter block per configuration; a repeated
    configuration on other arrays must give exactly the block a fresh build gives."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    res = subprocess.run([sys.executable, "-c", _CAPTURE_DECODE], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    if res.returncode != 0 and "cuda.core" in res.stderr and "ImportError" in res.stderr:
        pytest.skip("cuda.core is not importable here: " + res.stderr.strip().splitlines()[-1])
    assert res.returncode == 0, res.stderr[-3000:]
    first, cached, fresh = json.loads(res.stdout.strip().splitlines()[-1])
    assert cached == fresh
    assert cached != first
    # q, k, v as uint32 words (pairs along head_dim); the pointers moved, nothing else did
    assert cached[:5] == [0, 0, 2 * 1 * 8 * 32, 4, 0x5000000]
    assert cached[13 + 4] == 0x5100000 and cached[2 * 13 + 4] == 0x5200000
    differ = [i for i, (a, b) in enumerate(zip(first, cached)) if a != b]
    assert differ and all(first[i] - cached[i] == 0x1000000 - 0x5000000 for i in differ)
