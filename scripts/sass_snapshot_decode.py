"""SASS of a fixed set of decode-kernel configurations, offline, to prove a refactor of
kernels/decode_mma.py or kernels/decode_fma.py changes no machine code.

    python scripts/sass_snapshot_decode.py DIR                # write DIR/<config>.sass, DIR/summary.txt
    python scripts/sass_snapshot_decode.py DIR --compare OLD  # ... and diff every kernel against OLD/

Needs what scripts/kernel_resources.py needs (NVVM, ptxas and cuobjdump from the NVIDIA wheels;
no GPU); scripts/sass_snapshot.py does the same for the forward kernels. The configurations
cover the code paths of both decode builders with the launch signatures of
launch/decode.py's plans (C-contiguous caller arrays, one strided-cache variant):

* tensor-core kernel (``make_mma_decode_kernel``): fp16 / bf16; head_dim 16 / 64 / 96 / 128
  (the folded merge's reduce-scatter depth 1 / 3 / 2 / 3; head_dim 96 has no fast copy);
  contiguous and paged caches (power-of-two pages of at least a tile, of half a tile, and
  any page size); direct and folded-merge splits; causal, window + sinks, softcap, draft
  tree; with and without lse; tiles (32, 2, 1), (16, 3, 1), (16, 4, 1), (32, 3, 2); full
  lengths; the evict-first L2 hint.
* CUDA-core kernel (``make_decode_kernel``): head_dim 256 / 128 / 64, 8 / 4 / 2 rows, direct
  and split, paged, the same masks.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import sass_snapshot as ss  # noqa: E402  (sets NUMBA_ENABLE_CUDASIM=0; the run / compare loop)

from numba.cuda import types  # noqa: E402

from numba_flash.cuda.kernels import decode_fma, decode_mma  # noqa: E402

# Tensor-core configurations: name -> make_mma_decode_kernel's keywords (the rest default to
# _MMA_BASE) and the cache layout ("C", or "A" for a strided cache).
_MMA_BASE = dict(head_dim=64, is_bf16=False, paged=False, has_left=False, has_right=True,
                 has_sinks=False, has_softcap=False, has_tree=False, direct=False,
                 write_lse=False, block_n=32, stages=2, warps=1, fold=True,
                 page_pow2=0, full_lens=False, stream_hint=False)
MMA_CONFIGS = {
    "mma_f16_d64_direct_causal_lse_hint": dict(direct=True, fold=False, write_lse=True,
                                               stream_hint=True),
    "mma_bf16_d128_fold_causal_lse_full": dict(head_dim=128, is_bf16=True, write_lse=True,
                                               full_lens=True),
    "mma_f16_d128_paged64_fold_window_sinks": dict(head_dim=128, paged=True, page_pow2=64,
                                                   has_left=True, has_sinks=True),
    "mma_bf16_d64_paged16_fold_tree_lse": dict(is_bf16=True, paged=True, page_pow2=16,
                                               has_tree=True, write_lse=True),
    "mma_f16_d64_pagedany_direct_softcap": dict(paged=True, has_right=False, has_softcap=True,
                                                direct=True, fold=False, block_n=16, stages=3),
    "mma_f16_d96_fold_n16s4_lse": dict(head_dim=96, write_lse=True, block_n=16, stages=4),
    "mma_bf16_d16_fold_window_s3w2": dict(head_dim=16, is_bf16=True, has_left=True,
                                          write_lse=True, stages=3, warps=2),
    "mma_bf16_d128_paged32_fold_all_hint": dict(head_dim=128, is_bf16=True, paged=True,
                                                page_pow2=32, has_left=True, has_sinks=True,
                                                has_softcap=True, has_tree=True, write_lse=True,
                                                stream_hint=True),
    "mma_f16_d128_strided_direct_tree": dict(head_dim=128, has_tree=True, direct=True,
                                             fold=False, write_lse=True, layout="A"),
    "mma_f16_d64_split_nofold": dict(fold=False, has_right=False),
}
# CUDA-core configurations: make_decode_kernel's arguments.
_FMA_BASE = dict(head_dim=256, is_bf16=False, rows=8, paged=False, has_left=False,
                 has_right=True, has_sinks=False, has_softcap=False, has_tree=False,
                 direct=True, write_lse=True)
FMA_CONFIGS = {
    "fma_f16_d256_r8_direct_causal_lse": dict(),
    "fma_bf16_d256_r4_paged_split_window_sinks_softcap": dict(
        is_bf16=True, rows=4, paged=True, has_left=True, has_sinks=True, has_softcap=True,
        direct=False, write_lse=False),
    "fma_f16_d64_r2_split_tree": dict(head_dim=64, rows=2, has_tree=True, direct=False),
    "fma_bf16_d128_r8_paged_direct_tree_nolse": dict(head_dim=128, is_bf16=True, paged=True,
                                                     has_tree=True, write_lse=False),
}


def _arrays(layout: str = "C"):
    """The ten leading kernel arrays of launch/decode.py's ``_decode_arrays``."""
    arr = types.Array
    words = arr(types.uint32, 4, layout)
    return [arr(types.uint32, 4, "C"), words, words, arr(types.int32, 2, "C"),
            arr(types.int32, 1, "C"), arr(types.uint32, 2, "C"), arr(types.uint32, 4, "C"),
            arr(types.float32, 3, "C"), arr(types.float32, 5, "C"), arr(types.float32, 4, "C")]


def mma_signature(layout: str = "C"):
    """``_mma_plan``'s parameters: arrays, counters, 3 int64, 3 float32, 6 int64."""
    return types.void(*_arrays(layout), types.Array(types.int32, 1, "C"),
                      *[types.int64] * 3, *[types.float32] * 3, *[types.int64] * 6)


def fma_signature(layout: str = "C"):
    """``_fma_plan``'s parameters: arrays, 2 int64, 3 float32, 6 int64."""
    return types.void(*_arrays(layout), *[types.int64] * 2, *[types.float32] * 3,
                      *[types.int64] * 6)


def build(name: str):
    """(py_func, signature) of one configuration."""
    if name in MMA_CONFIGS:
        kw = dict(_MMA_BASE, **MMA_CONFIGS[name])
        layout = kw.pop("layout", "C")
        return decode_mma.make_mma_decode_kernel(**kw).py_func, mma_signature(layout)
    kw = dict(_FMA_BASE, **FMA_CONFIGS[name])
    layout = kw.pop("layout", "C")
    return decode_fma.make_decode_kernel(**kw).py_func, fma_signature(layout)


def main():
    args = ss.parse_args(__doc__.splitlines()[0])
    builds = [(name, lambda n=name: build(n) + ((9, 0),))
              for name in list(MMA_CONFIGS) + list(FMA_CONFIGS)
              if not args.only or args.only in name]
    sys.exit(ss.snapshot(builds, args.out, args.compare, width=50))


if __name__ == "__main__":
    main()
