"""SASS of a fixed set of backward-kernel configurations, offline (as scripts/sass_snapshot.py
for the forward): ``--compare`` proves that an edit leaves these kernels' machine code as it was.

    python scripts/sass_snapshot_backward.py DIR [--compare OLD] [--only SUBSTRING]

Covers the four main kernels of kernels/backward.py and the sm_90a dK / dV kernel of
kernels/backward_wgmma.py: the 16-bit dK / dV kernel (with atomic dQ
or not, flags, softcap, interval and bitmask masks, ALiBi, varlen), the 16-bit deterministic dQ kernel, and the
float32 / float64 dK / dV and dQ kernels.
"""
from __future__ import annotations

import inspect
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import kernel_resources as kr  # noqa: E402  (sets NUMBA_ENABLE_CUDASIM=0)
import sass_snapshot as ss  # noqa: E402

from numba.cuda import types  # noqa: E402

from numba_flash.cuda.kernels import backward as bw  # noqa: E402
from numba_flash.cuda.kernels import backward_wgmma as bwg  # noqa: E402
from numba_flash.cuda.kernels.masking import BITMASK, INTERVALS, NONE  # noqa: E402

# flags: (has_left, has_right, has_sinks, has_softcap)
_FLAGS = {"plain": (False, False, False, False), "causal": (False, True, False, False),
          "window_sinks_softcap": (True, True, True, True)}
# name: (kernel, dtype, head_dim, flags, atomic dQ, mask kind)
CONFIGS = {}
for _d in (64, 128):
    for _f in _FLAGS:
        CONFIGS[f"mma_dkdv_float16_d{_d}_{_f}"] = ("dkdv", "float16", _d, _f, True, NONE)
# head_dim 160-256: two warps share 16 keys, each accumulating half the columns (mma_dsplit)
CONFIGS["mma_dkdv_float16_d256_causal"] = ("dkdv", "float16", 256, "causal", True, NONE)
CONFIGS["mma_dkdv_bfloat16_d192_plain"] = ("dkdv", "bfloat16", 192, "plain", True, NONE)
CONFIGS["mma_dkdv_bfloat16_d128_causal_intervals"] = ("dkdv", "bfloat16", 128, "causal", True,
                                                      INTERVALS)
CONFIGS["mma_dkdv_float16_d128_causal_deterministic"] = ("dkdv", "float16", 128, "causal",
                                                         False, NONE)
CONFIGS["mma_dq_float16_d128_causal"] = ("dq", "float16", 128, "causal", False, NONE)
CONFIGS["mma_dq_bfloat16_d64_intervals"] = ("dq", "bfloat16", 64, "plain", False, INTERVALS)
for _dt, _d in (("float32", 64), ("float64", 128)):
    CONFIGS[f"fma_dkdv_{_dt}_d{_d}_causal"] = ("dkdv", _dt, _d, "causal", True, NONE)
    CONFIGS[f"fma_dkdv_{_dt}_d{_d}_window_sinks_softcap"] = ("dkdv", _dt, _d,
                                                             "window_sinks_softcap", True, NONE)
    CONFIGS[f"fma_dkdv_{_dt}_d{_d}_intervals_det"] = ("dkdv", _dt, _d, "plain", False, INTERVALS)
    CONFIGS[f"fma_dq_{_dt}_d{_d}_causal_intervals"] = ("dq", _dt, _d, "causal", False, INTERVALS)
# Bitmask, ALiBi, packed batches (a mask_mod kernel calls a user's device function, which Numba compiles
# only with a CUDA driver present: the simulator tests cover it)
_ALIBI = {"has_alibi": True}

CONFIGS["mma_dkdv_bfloat16_d128_bitmask"] = ("dkdv", "bfloat16", 128, "plain", True, BITMASK)
CONFIGS["mma_dkdv_float16_d128_causal_alibi"] = ("dkdv", "float16", 128, "causal", True, NONE,
                                                 _ALIBI)
CONFIGS["mma_dq_float16_d128_bitmask_alibi"] = ("dq", "float16", 128, "plain", False, BITMASK,
                                                _ALIBI)
_VARLEN = {"varlen": True}
CONFIGS["mma_dkdv_float16_d128_causal_varlen"] = ("dkdv", "float16", 128, "causal", True, NONE,
                                                  _VARLEN)
CONFIGS["mma_dq_bfloat16_d64_varlen"] = ("dq", "bfloat16", 64, "plain", False, NONE, _VARLEN)
CONFIGS["fma_dkdv_float32_d64_varlen"] = ("dkdv", "float32", 64, "causal", True, NONE, _VARLEN)
CONFIGS["fma_dq_float64_d128_varlen"] = ("dq", "float64", 128, "plain", False, NONE, _VARLEN)
CONFIGS["fma_dkdv_float32_d64_bitmask_alibi"] = ("dkdv", "float32", 64, "plain", True, BITMASK,
                                                 _ALIBI)
# the sm_90a dK / dV kernel (kernels/backward_wgmma.py)
CONFIGS["wgmma_dkdv_float16_d128_plain"] = ("wgmma", "float16", 128, "plain", True, NONE)
CONFIGS["wgmma_dkdv_bfloat16_d64_causal"] = ("wgmma", "bfloat16", 64, "causal", True, NONE)
CONFIGS["wgmma_dkdv_float16_d128_window_sinks_softcap"] = ("wgmma", "float16", 128,
                                                           "window_sinks_softcap", True, NONE)
CONFIGS["wgmma_dkdv_bfloat16_d256_causal"] = ("wgmma", "bfloat16", 256, "causal", True, NONE)
CONFIGS["wgmma_dkdv_bfloat16_d128_causal_intervals_det"] = ("wgmma", "bfloat16", 128, "causal",
                                                            False, INTERVALS)


def _signature(py_func, half: bool, atomic: bool, f64: bool):
    """kernel_resources.backward_signature, plus the mask table, bitmask words, ALiBi slopes and
    cu_seqlens where the kernel takes them (after the interval arrays)."""
    sig = kr.backward_signature(half, atomic, f64)
    extra = len(inspect.signature(py_func).parameters) - len(sig.args)
    more = [types.Array(types.int8, 3, "C"), types.Array(types.uint32, 2, "C"),
            types.Array(types.float32, 2, "C"), types.Array(types.int32, 1, "C"),
            types.Array(types.int32, 1, "C")][:extra]
    return types.void(*sig.args, *more)


def build(name: str):
    """(py_func, signature, cc) of one configuration."""
    kernel, dtype, d, flag, atomic, kind, *extra = CONFIGS[name]
    flags, extra = _FLAGS[flag], dict(*extra)
    half = dtype in ("float16", "bfloat16")
    if kernel == "wgmma":
        kern = bwg.make_wgmma_dkdv_kernel(d, dtype == "bfloat16", *flags, atomic, kind, **extra)
        return kern.py_func, _signature(kern.py_func, True, True, False), (9, 0, "a")
    if half and kernel == "dkdv":
        kern = bw.make_mma_dkdv_kernel(d, dtype == "bfloat16", *flags, atomic, kind, **extra)
    elif half:
        kern = bw.make_mma_dq_kernel(d, dtype == "bfloat16", *flags, kind, **extra)
    elif kernel == "dkdv":
        kern = bw.make_fma_dkdv_kernel(d, dtype == "float64", *flags, atomic, kind, **extra)
    else:
        kern = bw.make_fma_dq_kernel(d, dtype == "float64", *flags, kind, **extra)
    is_dkdv = kernel == "dkdv"
    return kern.py_func, _signature(kern.py_func, half, is_dkdv, dtype == "float64"), (9, 0)


def main():
    args = ss.parse_args(__doc__.splitlines()[0])
    builds = [(name, lambda n=name: build(n)) for name in CONFIGS
              if not args.only or args.only in name]
    sys.exit(ss.snapshot(builds, args.out, args.compare, width=48))


if __name__ == "__main__":
    main()
