"""The forward's runtime: ``attention_cuda`` (a validated call -> kernel configuration -> launch
plan -> launch) and ``attention_fast``, the repeated call's path.

A first call of a configuration picks the kernel (kernels/forward_*.py, compiled or loaded from
Numba's disk cache once), builds its mask inputs (maskplan.py) and a ``LaunchPlan`` (driver.py)
whose parameter block holds everything but the caller's data pointers, and records the plan
under the call's signature: array kind, shapes, strides, dtypes, device and every keyword.
A later call with the same signature (``attention_fast``, tried by ``numba_flash.attention``
before any validation: the signature is what validation depends on) only allocates the outputs
with the caller's allocator, writes the pointers and launches on the caller's stream. Under
Numba's simulator the kernels run through Numba's dispatcher on NumPy arrays.
"""
from __future__ import annotations

import math
import os
from typing import Any, NamedTuple

import numpy as np
from numba.cuda import types

from ..kernels import forward_geometry as geometry
from ..kernels.forward_dmma import (dmma_geometry, dmma_smem_bytes, dmma_supported,
                                   make_dmma_kernel)
from ..kernels.forward_fma import make_fma_kernel
from ..kernels.forward_tf32x3 import (make_tf32x3_kernel, tf32x3_geometry, tf32x3_smem_bytes,
                                      tf32x3_supported)
from ..kernels.forward_mma import make_mma_kernel
from ..kernels.forward_ws import (WS_BLOCK_M, WS_LAUNCH_REGISTERS, WS_THREADS, make_ws_kernel,
                                  ws_head_dims, ws_moves_registers, ws_smem_bytes)
from ..kernels.masking import NONE
from ..primitives import SIMULATOR
from .arrays import (FULL_NAMES, HALF_NAMES, SUPPORTED_HEAD_DIMS, BFloat16Array, array_kind,
                     caller_param, check_rows_aligned, dtype_name, empty_like_kind, fixed_param,
                     gpu_inputs, interface, kernel_array, pad_head_dim, padded_head_dim)
from .device import compute_capability, current_device_id
from .driver import ArrayParam, LaunchPlan, ScalarParam, compile_kernel, current_device
from .driver import LaunchError, kernel_registers, output_clearer, raise_dynamic_smem_limit
from .fastpath import FastCall, call_key, fast_table, geometry_of, geometry_reader, register_fast
from .maskplan import dummy_arrays, plan_mask
from .streams import numba_stream, raw_stream_handle

__all__ = ["attention_cuda", "attention_fast", "window_flags", "kernel_for", "KernelKey",
           "KernelEntry", "tile_shape", "SUPPORTED_HEAD_DIMS", "wgmma_device", "WGMMA_ENABLED",
           "tensor_core_kernel", "dynamic_smem_bytes", "compiled_kernel_count"]

_KERNELS: dict = {}
_FAST_CALLS = fast_table("attention")
LOG2E = 1.0 / math.log(2.0)


# NUMBA_FLASH_WGMMA=0 (read once, at import) keeps compute-capability 9.0 devices on the
# mma.sync path, for comparisons; by default they take wgmma at the head dims of WG_HEAD_DIMS.
WGMMA_ENABLED = os.environ.get("NUMBA_FLASH_WGMMA", "1") != "0"


def _capability():
    """The current device's compute capability, None in the simulator."""
    return None if SIMULATOR else compute_capability(current_device_id())


def wgmma_device() -> bool:
    """Whether the current device takes the wgmma path: a compute-capability 9.0 GPU (H100,
    H200; Numba compiles for sm_90a there), not the simulator, and ``NUMBA_FLASH_WGMMA`` not
    set to 0 when the package was imported."""
    return WGMMA_ENABLED and _capability() == (9, 0)


def _dmma_target() -> tuple[bool, bool]:
    """(m16n8k16 float64 instruction, Hopper tilings) of the current device for the DMMA
    kernel: compute capability 9.0+ has the instruction (the simulator models it); the tilings
    of ``dmma_geometry(hopper=True)`` need 9.0's 227 KB of shared memory per block (other GPUs
    take the small tiling, within 99 KB). The simulator runs the Hopper tilings."""
    cc = _capability()
    return (True, True) if cc is None else (cc >= (9, 0), cc == (9, 0))


def _wgmma(dtype_name: str, head_dim: int) -> bool:
    """Whether this call's kernel is the wgmma path (float16 / bfloat16 at a head_dim of
    ``forward_geometry.WG_HEAD_DIMS`` (64, 96, 128, 256) on a compute-capability 9.0 device)."""
    return dtype_name in HALF_NAMES and head_dim in geometry.WG_HEAD_DIMS and wgmma_device()


def dynamic_smem_bytes(dtype_name: str, head_dim: int) -> int:
    """Dynamic shared memory of this configuration's kernel (0: static shared memory only)."""
    if not _wgmma(dtype_name, head_dim):
        return 0
    return geometry.wgmma_smem_bytes(head_dim, geometry.mma_block_n(head_dim, True))


def tile_shape(dtype_name: str, head_dim: int) -> tuple[int, int]:
    """(block_m, block_n) of the kernel for this dtype and head_dim (what tile tables use)."""
    if dtype_name in HALF_NAMES:
        wg = _wgmma(dtype_name, head_dim)
        return geometry.mma_block_m(head_dim, wg), geometry.mma_block_n(head_dim, wg)
    itemsize = 8 if FULL_NAMES[dtype_name] else 4
    return geometry.fma_block_m(head_dim, itemsize), geometry.fma_block_n(head_dim, itemsize)


def tensor_core_kernel(dtype_name: str, head_dim: int, precision: str, mask_kind: int = NONE,
                       varlen: bool = False, has_alibi: bool = False, score_mod=None):
    """Which exact tensor-core kernel serves a float32 / float64 call: "dmma" (float64: flags
    and packed batches), "tf32x3" (float32: flags only) for ``precision="tensor_cores"``; for
    "auto", "dmma" where it applies on a compute-capability 9.0 GPU (H100 / H200, where it was
    measured: 2.7-3.6x the CUDA-core kernel at the same float64 accuracy, docs/benchmarks.md),
    else None (the simulator too: its tests keep the CUDA-core kernel covered); None for
    "ieee" (the CUDA-core kernel) and for 16-bit calls (always on tensor cores).
    NotImplementedError for a "tensor_cores" call those kernels do not take
    (validation.check_precision says so first on the public path)."""
    if dtype_name not in ("float32", "float64") or precision == "ieee":
        return None
    f64 = dtype_name == "float64"
    flags_only = mask_kind == NONE and not has_alibi and score_mod is None
    takes = flags_only and (dmma_supported(head_dim) if f64 else
                            tf32x3_supported(head_dim) and not varlen)
    if precision == "auto":
        return "dmma" if f64 and takes and not SIMULATOR and _dmma_target()[1] else None
    if not takes:
        raise NotImplementedError(
            f"precision='tensor_cores' for {dtype_name} takes head_dim "
            "32 / 64 / 96 / 128 without mask objects, "
            f"alibi_slopes or score_mod{'' if f64 else ' or cu_seqlens'}; got head_dim "
            f"{head_dim}" + ("" if flags_only and (f64 or not varlen) else " with one of them"))
    return "dmma" if f64 else "tf32x3"


def _check_registers(handle, needed: int):
    """A kernel that hands registers between warpgroups (``setmaxnreg``: the warp-specialised
    forward) waits for them forever unless loaded with exactly ``needed`` per thread: refuse
    any other count instead of hanging."""
    n = kernel_registers(handle, current_device())
    if n not in (-1, needed):
        raise LaunchError(f"the forward kernel was built with {n} registers per thread; its "
                          f"register hand-over needs {needed}")


def _warp_specialised(head_dim, has_left, has_sinks, has_softcap, mask_kind, varlen, has_alibi,
                      mask_mod, score_mod) -> bool:
    """Whether a wgmma call takes the warp-specialised kernel (kernels/forward_ws.py): a head
    dim of ``ws_head_dims(mask_kind)`` (no mask object or column intervals), no left window,
    sinks, softcap, packed batch, ALiBi or score_mod (its 384 threads hold 168 registers each,
    216 in the consumers after the producer gives some back; those configurations would need
    more)."""
    return (head_dim in ws_head_dims(mask_kind) and not (has_left or has_sinks or has_softcap
                                                         or varlen or has_alibi)
            and mask_mod is None and score_mod is None)


class KernelKey(NamedTuple):
    """What selects a forward kernel: the launch cache's key (``kernel_for``'s arguments, with
    the kernel family decided from them)."""
    dtype_name: str
    head_dim: int
    has_left: bool
    has_right: bool
    has_sinks: bool
    has_softcap: bool
    write_lse: bool
    mask_kind: int
    varlen: bool
    has_alibi: bool
    mask_mod: Any
    wgmma: bool
    score_mod: Any
    dmma: bool
    tf32x3: bool
    dmma_target: tuple     # the DMMA kernel's (instruction, tilings): ``_dmma_target``


class KernelEntry(NamedTuple):
    """One configuration's kernel and launch geometry: query rows per block, threads per
    block, dynamic shared memory in bytes (0: static shared memory only), and the registers
    per thread it must be loaded with (0: any; ``_check_registers``)."""
    kernel: Any
    block_m: int
    threads: int
    smem_bytes: int
    registers: int = 0


def kernel_for(dtype_name: str, head_dim: int, has_left: bool, has_right: bool, has_sinks: bool,
               has_softcap: bool, write_lse: bool, mask_kind: int = NONE,
               varlen: bool = False, has_alibi: bool = False, mask_mod=None, score_mod=None,
               precision: str = "auto"):
    """The (cached) ``KernelEntry`` of one configuration; ``precision`` as in
    ``tensor_core_kernel``."""
    wg = _wgmma(dtype_name, head_dim)
    exact = tensor_core_kernel(dtype_name, head_dim, precision, mask_kind, varlen, has_alibi,
                               score_mod)
    dmma, tf32 = exact == "dmma", exact == "tf32x3"
    key = KernelKey(dtype_name, head_dim, has_left, has_right, has_sinks, has_softcap,
                    write_lse, mask_kind, varlen, has_alibi, mask_mod, wg, score_mod, dmma, tf32,
                    _dmma_target() if dmma else ())
    entry = _KERNELS.get(key)
    if entry is None and tf32:
        entry = _KERNELS[key] = KernelEntry(make_tf32x3_kernel(head_dim, has_left, has_right,
                                                               has_sinks, has_softcap, write_lse),
                                            *tf32x3_geometry(head_dim),
                                            tf32x3_smem_bytes(head_dim))
    if entry is None and dmma:
        native, hopper = key.dmma_target
        geo = dmma_geometry(head_dim, hopper)
        entry = _KERNELS[key] = KernelEntry(
            make_dmma_kernel(head_dim, has_left, has_right, has_sinks, has_softcap, write_lse,
                             native, geo, varlen),
            16 * geo.warps, 32 * geo.warps, dmma_smem_bytes(head_dim, geo))
    if entry is None and wg and _warp_specialised(head_dim, has_left, has_sinks, has_softcap,
                                                  mask_kind, varlen, has_alibi, mask_mod,
                                                  score_mod):
        entry = _KERNELS[key] = KernelEntry(
            make_ws_kernel(head_dim, HALF_NAMES[dtype_name], has_right, write_lse, mask_kind),
            WS_BLOCK_M, WS_THREADS, ws_smem_bytes(head_dim, mask_kind),
            WS_LAUNCH_REGISTERS if ws_moves_registers(head_dim) else 0)
    if entry is None:
        extra = dict(mask_kind=mask_kind, varlen=varlen, has_alibi=has_alibi, mask_mod=mask_mod,
                     score_mod=score_mod)
        _, block_n = tile_shape(dtype_name, head_dim)
        flags = (has_left, has_right, has_sinks, has_softcap, write_lse, block_n)
        if dtype_name in HALF_NAMES:
            kern = make_mma_kernel(head_dim, HALF_NAMES[dtype_name], *flags,
                                   m_tiles=geometry.mma_m_tiles(head_dim, wg), wgmma=wg, **extra)
            entry = KernelEntry(kern, geometry.mma_block_m(head_dim, wg),
                                geometry.mma_threads(wg), dynamic_smem_bytes(dtype_name, head_dim))
        else:
            kern = make_fma_kernel(head_dim, FULL_NAMES[dtype_name], *flags, **extra)
            itemsize = 8 if FULL_NAMES[dtype_name] else 4
            entry = KernelEntry(kern, geometry.fma_block_m(head_dim, itemsize),
                                geometry.fma_threads(head_dim, itemsize), 0)
        _KERNELS[key] = entry
    return entry


def compiled_kernel_count() -> int:
    """Number of machine-code specialisations held in this process (for cache tests)."""
    if SIMULATOR:
        return len(_KERNELS)
    return sum(len(e.kernel.overloads) for e in _KERNELS.values())


def window_flags(causal: bool, window_size, sinks: int, softcap):
    """The compile-time mask switches of the kernels and the window bounds they read.

    Returns ``(left, right, has_left, has_right, has_sinks, has_softcap)``: causal is the window
    right bound 0 (bottom-right aligned); sinks only matter with a bounded left side; softcap
    None or 0 is off.
    """
    left, right = (int(w) for w in window_size)
    if causal:
        right = 0 if right < 0 else min(right, 0)
    has_left, has_right = left >= 0, right >= 0
    has_sinks = has_left and int(sinks) > 0
    has_softcap = softcap is not None and float(softcap) > 0
    return left, right, has_left, has_right, has_sinks, has_softcap


def _scalars(dtype_name, softmax_scale, softcap, has_softcap):
    """(scale, scale / cap, cap) as the kernel takes them (base 2 in the 16-bit kernels)."""
    scale = float(softmax_scale)
    cap = float(softcap) if has_softcap else 1.0
    if dtype_name in HALF_NAMES:
        return (scale * LOG2E, scale / cap, cap * LOG2E), types.float32
    return (scale, scale / cap, cap), (types.float64 if FULL_NAMES[dtype_name] else types.float32)


class _Problem:
    """One call's geometry and switches, as the runtime needs them (built once per call of the
    slow path)."""

    def __init__(self, q, k, v, options, varlen):
        self.lead = varlen is not None
        if self.lead:
            _, self.heads_q, self.head_dim = q.shape
            self.heads_kv = k.shape[1]
            self.batch, self.seqlen_q = varlen.batch, varlen.max_seqlen_q
            self.seqlen_k = varlen.max_seqlen_k
            self.out_shape, self.lse_shape = tuple(q.shape), (self.heads_q, q.shape[0])
        else:
            self.batch, self.seqlen_q, self.heads_q, self.head_dim = q.shape
            _, self.seqlen_k, self.heads_kv, _ = k.shape
            self.out_shape = (self.batch, self.seqlen_q, self.heads_q, self.head_dim)
            self.lse_shape = (self.batch, self.heads_q, self.seqlen_q)
        o = options
        (self.left, self.right, self.has_left, self.has_right, self.has_sinks,
         self.has_softcap) = window_flags(o["causal"], o["window_size"], o["sinks"], o["softcap"])
        self.sinks = int(o["sinks"])
        self.varlen, self.mask, self.alibi = varlen, o["mask"], o.get("alibi_slopes")
        self.score_mod, self.return_lse = o.get("score_mod"), bool(o["return_lse"])
        self.softmax_scale, self.softcap = o["softmax_scale"], o["softcap"]
        self.precision = o.get("precision", "auto")

    @property
    def empty(self) -> bool:
        return self.batch * self.seqlen_q * self.heads_q == 0 or 0 in self.out_shape


def attention_cuda(q, k, v, *, softmax_scale: float, causal: bool = False, window_size=(-1, -1),
                   sinks: int = 0, mask=None, softcap=None, return_lse: bool = False, stream=None,
                   alibi_slopes=None, varlen=None, score_mod=None, precision="auto", fast=None):
    """FlashAttention forward on the GPU (or Numba's simulator for NumPy inputs).

    q: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim); one
    dtype among float16, bfloat16 (tensor cores, fp32 accumulation), float32, float64 (exact
    CUDA-core paths); any strides with a contiguous head_dim, the pointer and the other strides
    multiples of 16 bytes (length-1 axes exempt); head_dim in 32, 64, 96, 128, 256.
    Returns out of the inputs' kind and dtype, (batch, seqlen_q, heads_q, head_dim) contiguous,
    or (out, lse) with lse float32 (float64 for float64 inputs) (batch, heads_q, seqlen_q),
    natural-log, -inf for rows that
    see no key. Runs on ``stream`` or the caller's current stream; returns without
    synchronising. mask: a ``numba_flash.masks`` object (maskplan.py); alibi_slopes: float32
    (Hq,) or (B, Hq) on the device; varlen: a ``numba_flash.varlen.Varlen`` (q (total_q, Hq,
    D), k / v (total_k, Hkv, D); out the same, lse (Hq, total_q)); score_mod: the user's
    ``fn(score, b, h, q_idx, kv_idx)``; precision: "auto" / "ieee" (float32 / float64 on CUDA
    cores) or "tensor_cores" (DMMA / 3xTF32, ``tensor_core_kernel``). ``fast``: (signature,
    extras, guards) from ``attention_fast``'s miss: the plan is recorded under the signature
    when the kernel reads exactly those caller arrays (cu_seqlens, ALiBi slopes) as they were
    given, guarded by the caller's mask and score_mod objects (not ``mask`` here, which is
    None when validation folded ``masks.causal()`` or ``masks.sliding_window`` into the flags).
    """
    width = _kernel_head_dim(q.shape[-1], v.shape[-1])
    if width is not None and (array_kind(q) in _PADDABLE or v.shape[-1] != q.shape[-1]):
        return _attention_padded(q, k, v, width, softmax_scale=softmax_scale, causal=causal,
                                 window_size=window_size, sinks=sinks, mask=mask,
                                 softcap=softcap, return_lse=return_lse, stream=stream,
                                 alibi_slopes=alibi_slopes, varlen=varlen, score_mod=score_mod,
                                 precision=precision)
    kind, dtype_name, device, _ = gpu_inputs(q, k, v, lead=varlen is not None)
    if not SIMULATOR:
        check_rows_aligned("the forward kernels' 16-byte copies", q=q, k=k, v=v)
    options = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                   sinks=sinks, mask=mask, softcap=softcap, return_lse=return_lse,
                   alibi_slopes=alibi_slopes, score_mod=score_mod, precision=precision)
    p = _Problem(q, k, v, options, varlen)
    # Rows of a packed batch that no sequence owns read 0 / -inf: the varlen kernels clear them
    # (kernels/sequences.py, clear_unowned_rows); a launch with no blocks (max_seqlen_q 0)
    # leaves them to the driver's memsets on the launch stream (``clear``). The simulator's
    # NumPy outputs start as NaN, so that its tests see every row written.
    fill = p.lead and SIMULATOR
    poison = np.nan if fill and not p.empty else None
    out = empty_like_kind(kind, q, p.out_shape, dtype_name, zero=fill and p.empty, fill=poison)
    lse_name = "float64" if dtype_name == "float64" else "float32"
    lse = empty_like_kind(kind, q, p.lse_shape, lse_name,
                          fill=(poison if not p.empty else -np.inf) if fill else None) \
        if p.return_lse else None
    if SIMULATOR:
        if not p.empty:
            _launch_simulated(kind, dtype_name, p, q, k, v, out, lse)
    elif p.lead or not p.empty:
        pointers = _pointers(kind, p, q, k, v, out, lse)
        handle = raw_stream_handle(stream, kind, q)
        clear = _clearer(p, dtype_name) if p.lead and p.empty else None
        if clear is not None:       # before the launch, on its stream
            clear(pointers[3], pointers[4] if p.return_lse else 0, handle)
        if not p.empty:
            plan = _plan(kind, dtype_name, device, p, (q, k, v, out, lse), stream)
            plan.launch(pointers, handle)
            if fast is not None and fast[0] is not None and _same(fast[1], _caller_extras(p)):
                register_fast(_FAST_CALLS, fast[0], FastCall(
                    plan, kind, q, device, p.out_shape, dtype_name, p.lse_shape if
                    p.return_lse else None, fast[1], guards=fast[2], align=15))
    if kind == "cai" and dtype_name == "bfloat16":
        out = BFloat16Array(out)
    return (out, lse) if p.return_lse else out


_PADDABLE = ("numpy", "cupy", "torch")     # array kinds that pad_head_dim copies


def _kernel_head_dim(head_dim: int, head_dim_v: int):
    """The head dim the kernels run a call at when q, k, v cannot go as given, else None: a
    head dim no kernel takes (a multiple of 8 up to 256) rises to the next one
    (``padded_head_dim``); with v's head dim unlike q's (DeepSeek MLA's 192 / 128) both sides
    go to the larger, raised the same way."""
    if head_dim == head_dim_v:
        return padded_head_dim(head_dim)
    wide = max(head_dim, head_dim_v)
    return padded_head_dim(wide) or wide


def _attention_padded(q, k, v, width, **options):
    """Attention at the kernel head dim ``width`` (``_kernel_head_dim``): q, k, v padded with
    zero columns to it (zero columns add nothing to q.k, and the output's extra columns are
    dropped), then the output's first head_dim_v columns copied out. The softmax scale is the
    caller's (default 1/sqrt of q's real head dim), resolved before."""
    kind = array_kind(q)
    if kind not in _PADDABLE:
        raise NotImplementedError(f"v's head_dim ({v.shape[-1]}) unlike q's ({q.shape[-1]}) "
                                  f"needs NumPy / CuPy arrays or torch tensors (padded copies); "
                                  f"got {type(q).__name__}")
    head_dim_v = v.shape[-1]
    padded = [x if x.shape[-1] == width else pad_head_dim(x, kind, width) for x in (q, k, v)]
    result = attention_cuda(*padded, **options)
    out = result[0] if options["return_lse"] else result
    if head_dim_v < width:
        trimmed = empty_like_kind(kind, q, tuple(out.shape[:-1]) + (head_dim_v,),
                                  dtype_name(q))
        trimmed[...] = out[..., :head_dim_v]
        out = trimmed
    return (out, result[1]) if options["return_lse"] else out


def attention_fast(q, k, v, options, extras, guards, stream):
    """A repeated call: the plan recorded under this call's signature, launched on its arrays.

    ``options``: the call's keyword values (``numba_flash.attention`` passes them all, the
    arrays among them as whether each is given); ``extras``: its device arrays beyond q, k, v
    in kernel order (cu_seqlens_q, cu_seqlens_k, alibi_slopes, those given), keyed by their
    geometry; ``guards``: its mask and score_mod. Returns (result, None) on a
    hit, else (None, (signature, extras, guards)) for ``attention_cuda`` to record the plan
    under.
    """
    call = key = None
    geometry = geometry_reader(type(q))
    if geometry is not None:
        key = ("attention", type(q), geometry(q), geometry(k), geometry(v), options)
        if extras:      # cu_seqlens / alibi_slopes: options holds only whether each is given
            shapes = tuple(geometry_of(x) for x in extras)
            key = None if None in shapes else key + shapes
        if key is not None:
            try:
                call = _FAST_CALLS.get(key)
            except TypeError:   # a list window_size, an unhashable mask: the general key
                key = None
    if key is None:
        key = call_key("attention", (q, k, v) + tuple(extras), options)
        if key is None:
            return None, None
        call = _FAST_CALLS.get(key)
    if call is not None:
        result = call.run((q, k, v), extras, guards, stream)
        if result is not None:
            return result, None
    return None, (key, extras, guards)


def _caller_extras(p):
    """The device arrays the kernel reads beyond q, k, v (pointer slots, in order)."""
    extras = []
    if p.varlen is not None:
        extras += [p.varlen.cu_q, p.varlen.cu_k]
    if p.alibi is not None:
        extras.append(p.alibi)
    return tuple(extras)


def _same(given, used) -> bool:
    """Whether the kernel reads the caller's arrays themselves (no converted copies)."""
    return len(given) == len(used) and all(a is b for a, b in zip(given, used))


def _clearer(p, dtype_name):
    """The memsets that set a packed batch's out to zeros and lse to -inf (driver.py's
    ``output_clearer``), sized for this call's outputs."""
    itemsize = 2 if dtype_name in HALF_NAMES else (8 if FULL_NAMES[dtype_name] else 4)
    lse_itemsize = 8 if dtype_name == "float64" else 4
    lse_nbytes = math.prod(p.lse_shape) * lse_itemsize if p.return_lse else 0
    return output_clearer(math.prod(p.out_shape) * itemsize, lse_nbytes, lse_itemsize)


def _pointers(kind, p, q, k, v, out, lse):
    ptrs = [interface(x, kind)[0] for x in (q, k, v, out)]
    if lse is not None:
        ptrs.append(interface(lse, kind)[0])
    if p.varlen is not None:
        ptrs += [interface(p.varlen.cu_q, kind)[0], interface(p.varlen.cu_k, kind)[0]]
    if p.alibi is not None:
        ptrs.append(interface(p.alibi, kind)[0])
    return ptrs


def _plan(kind, dtype_name, device, p, arrays, stream):
    """The launch plan of this configuration (built here each time: the fast path caches)."""
    half = dtype_name in HALF_NAMES
    block_m, block_n = tile_shape(dtype_name, p.head_dim)
    mplan = plan_mask(p.mask, p.batch, p.heads_q, p.seqlen_q, p.seqlen_k, block_m, block_n,
                      p.lead, lambda: numba_stream(stream, kind, arrays[0]))
    kern, block_m, threads, smem, registers = kernel_for(
        dtype_name, p.head_dim, p.has_left, p.has_right, p.has_sinks, p.has_softcap,
        p.return_lse, mplan.kind, p.lead, p.alibi is not None, mplan.mask_mod, p.score_mod,
        p.precision)
    params = [caller_param(x, kind, half and i < 4, p.lead) for i, x in enumerate(arrays[:4])]
    if p.return_lse:
        params.append(caller_param(arrays[4], kind, False, p.lead))
    else:  # never written: write_lse is a compile-time False
        params.append(ArrayParam(types.float32, (1, 1, 1), (4, 4, 4), 4, ptr=0))
    scalars, float_type = _scalars(dtype_name, p.softmax_scale, p.softcap, p.has_softcap)
    params += [ScalarParam(types.int64, n) for n in
               (p.seqlen_q, p.seqlen_k, p.heads_q // p.heads_kv)]
    params += [ScalarParam(float_type, x) for x in scalars]
    params += [ScalarParam(types.int64, n) for n in (p.left, p.right, p.sinks)]
    dummies = dummy_arrays()
    fixed = [mplan.iv, mplan.mm, mplan.table, mplan.bits]
    params += [fixed_param(x) for x in fixed]
    if p.varlen is not None:
        params += [caller_param(x, kind, False) for x in (p.varlen.cu_q, p.varlen.cu_k)]
    else:
        params += [fixed_param(dummies.cu)] * 2
    if p.alibi is not None:
        params.append(_alibi_param(p.alibi, kind, p.batch))
    else:
        params.append(fixed_param(dummies.alibi))
    cufunc = compile_kernel(kern, params)
    if registers:
        _check_registers(cufunc.handle, registers)
    if smem > 48 * 1024:
        raise_dynamic_smem_limit(cufunc.handle, smem, current_device())
    grid = (-(-p.seqlen_q // block_m), p.batch * p.heads_q)
    return LaunchPlan(cufunc, params, grid, threads, smem, keep=(fixed, dummies))


def _alibi_param(slopes, kind, batch):
    """ALiBi slopes as the kernel's (batch, heads_q) float32 array: a (heads_q,) vector is
    broadcast (batch stride 0)."""
    _, shape, strides, _, _ = interface(slopes, kind)
    if len(shape) == 1:
        shape, strides = (batch,) + tuple(shape), (0,) + tuple(strides)
    return ArrayParam(types.float32, shape, strides, 4)


def _launch_simulated(kind, dtype_name, p, q, k, v, out, lse):
    """Numba's dispatcher on NumPy arrays (the simulator's path)."""
    half = dtype_name in HALF_NAMES
    block_m, block_n = tile_shape(dtype_name, p.head_dim)
    mplan = plan_mask(p.mask, p.batch, p.heads_q, p.seqlen_q, p.seqlen_k, block_m, block_n,
                      p.lead, 0)
    kern, block_m, threads, smem, _ = kernel_for(
        dtype_name, p.head_dim, p.has_left, p.has_right, p.has_sinks, p.has_softcap,
        p.return_lse, mplan.kind, p.lead, p.alibi is not None, mplan.mask_mod, p.score_mod,
        p.precision)
    dummies = dummy_arrays()
    lse_arg = kernel_array(lse, kind, False, p.lead) if p.return_lse else \
        kernel_array(np.empty((1, 1, 1), np.float32), kind, False)
    extra = [mplan.iv, mplan.mm, mplan.table, mplan.bits]
    if p.varlen is not None:
        extra += [kernel_array(p.varlen.cu_q, kind, False), kernel_array(p.varlen.cu_k, kind, False)]
    else:
        extra += [dummies.cu, dummies.cu]
    if p.alibi is not None:
        extra.append(kernel_array(np.ascontiguousarray(np.broadcast_to(
            np.asarray(p.alibi, dtype=np.float32), (p.batch, p.heads_q))), kind, False))
    else:
        extra.append(dummies.alibi)
    scalars, _ = _scalars(dtype_name, p.softmax_scale, p.softcap, p.has_softcap)
    fdt = np.float32 if half or not FULL_NAMES[dtype_name] else np.float64
    args = [kernel_array(x, kind, half, p.lead) for x in (q, k, v, out)]
    grid = (-(-p.seqlen_q // block_m), p.batch * p.heads_q)
    kern[grid, threads, 0, smem](*args, lse_arg, p.seqlen_q, p.seqlen_k, p.heads_q // p.heads_kv,
                                 *(fdt(x) for x in scalars), p.left, p.right, p.sinks, *extra)
