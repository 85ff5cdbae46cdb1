"""Hardware primitives for the kernels: one instruction family per module, each with a pure-Python
stand-in for Numba's CUDA simulator so that kernel source is the same on both.

* ``base``: the simulator switch, LLVM addressing helpers for inline-PTX intrinsics, the
  simulator's per-warp exchange.
* ``mma``: ``mma.sync.m16n8k16`` (fp16 / bf16 in, fp32 accumulate) and fp32 -> 16-bit packing.
* ``mma_exact``: DMMA (``m16n8k16`` / ``m8n8k4`` float64) and TF32 (``m16n8k8``) products, the
  TF32 split of the 3xTF32 scheme.
* ``ldmatrix``: 8x8 16-bit matrices from shared memory into mma fragments.
* ``cp_async``: asynchronous global -> shared copies and their group waits.
* ``cache_hints``: L2 evict-first policies for streamed copies.
* ``warp``: shuffles, votes, the warp barrier.
* ``fastmath``: ``exp2`` on the special-function unit.
* ``sync``: acquire-release atomics and paired global loads / stores (decode's folded merge).
* ``wgmma``: Hopper warpgroup matrix products, shared-memory descriptors and addresses.
* ``smem``: vectorised shared-memory loads, 2-D views of dynamic shared memory.
* ``vector``: 16-byte read-only global loads, 16-bit -> float32 unpacking.
* ``atomics``: vector reductions into global memory (``red.global.add.v2.f32``).
* ``mbarrier``: Hopper shared-memory barriers with phases (warp-specialised kernels).

Kernels import the names from here: ``from ..primitives import mma16, ldmatrix_x4, ...``.
"""
from .base import SIMULATOR
from .cache_hints import cp_async16_hint, cp_async16_maybe_hint, evict_first_policy
from .cp_async import (cp_async16, cp_async16_at, cp_async16_flat, cp_async_commit,
                       cp_async_wait_1, cp_async_wait_2, cp_async_wait_3, cp_async_wait_all)
from .fastmath import exp2
from .ldmatrix import ldmatrix_x4, ldmatrix_x4_a32, ldmatrix_x4_trans, ldmatrix_x4_trans_a32
from .mma import mma16, mma_bf16, mma_f16, pack16, pack_bf16, pack_f16
from .sync import arrive_acq_rel, bcast0, ld2, st2
from .warp import ballot, lowest_bit, shfl_idx, shfl_xor, syncwarp
from .wgmma import (cp_async4_to, cp_async16_to, cp_async16_at_address, fence_proxy_async,
                    global_address, lds_i32x2, shared_addr, sts32, sw128_desc, wgmma_commit,
                    wgmma_fence, wgmma_hold, wgmma_rs, wgmma_ss, wgmma_ss_mn, wgmma_wait)
from .smem import lds16, shared_view
from .vector import ld_v4, unpack16, unpack_bf16, unpack_f16
from .mma_exact import (mma_f64, mma_f64_k16, mma_f64_k16_884, mma_tf32, split_tf32,
                        split_tf32_fast)
from .atomics import red_add2
from .mbarrier import (fence_mbar_init, mbar_arrive, mbar_init, mbar_try_wait, named_arrive,
                       named_sync, regs_dec_72, regs_inc_216)
