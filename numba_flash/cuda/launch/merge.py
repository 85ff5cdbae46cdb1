"""merge_states' runtime: the merge kernel (kernels/merge.py) on the caller's arrays, and the
merge step of the CUDA-core decode kernel's splits."""
from __future__ import annotations

from numba.cuda import types

from ..kernels.merge import MERGE_THREADS, OUT_F32, merge_kernel
from ..primitives import SIMULATOR
from .arrays import array_kind, dtype_name, empty_like_kind, interface, kernel_array
from .device import current_device_id
from .driver import ArrayParam, LaunchPlan, compile_kernel
from .fastpath import FastCall, call_key, fast_table, register_fast
from .streams import raw_stream_handle

__all__ = ["merge_states_cuda", "merge_states_fast", "merge_plan", "merge_simulated"]

_PLANS: dict = {}
_FAST_CALLS = fast_table("merge_states")


def _param(x, kind, words):
    ptr, shape, strides, itemsize, _ = interface(x, kind)
    if words:
        return ArrayParam(types.uint32, tuple(shape[:3]) + (shape[3] // 2,),
                          tuple(strides[:3]) + (4,), 4)
    return ArrayParam(types.float32, shape, strides, itemsize)


def merge_plan(o_part, lse_part, out, lse, kind, out_mode, device):
    """The plan of one merge: o_part float32 (n, B, S, H, D), lse_part float32 (n, B, H, S)
    into out (B, S, H, D) (float32, or 16-bit pairs for ``out_mode`` OUT_F16 / OUT_BF16) and
    lse float32 (B, H, S) or None. Caller pointers in that order (lse last, if any)."""
    words = out_mode != OUT_F32
    params = [_param(o_part, kind, False), _param(lse_part, kind, False),
              _param(out, kind, words)]
    params.append(_param(lse, kind, False) if lse is not None else
                  ArrayParam(types.float32, (1, 1, 1), (4, 4, 4), 4, ptr=0))
    key = (out_mode, lse is not None, device) + tuple((p.shape, p.strides) for p in params)
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= 256:
            _PLANS.clear()
        width = params[2].shape[3]
        items = out.shape[0] * out.shape[1] * out.shape[2] * width
        cufunc = compile_kernel(merge_kernel(out_mode, lse is not None), params)
        plan = _PLANS[key] = LaunchPlan(cufunc, params, (max(1, -(-items // MERGE_THREADS)),),
                                        MERGE_THREADS)
    return plan


def merge_simulated(o_part, lse_part, out, lse, out_mode, write_lse):
    """The merge through Numba's dispatcher on simulator arrays."""
    width = out.shape[3]
    items = out.shape[0] * out.shape[1] * out.shape[2] * width
    if items:
        blocks = -(-items // MERGE_THREADS)
        merge_kernel(out_mode, write_lse)[blocks, MERGE_THREADS, 0](o_part, lse_part, out, lse)


def merge_states_cuda(o, lse, *, stream=None, fast=None):
    """Merge n states held in GPU arrays (or NumPy arrays under the simulator).

    o: float32 (n, B, S, H, D), each state normalised; lse: float32 (n, B, H, S), natural log,
    -inf for empty states. Returns (o, lse): float32 (B, S, H, D) and float32 (B, H, S), arrays
    of the inputs' kind, on ``stream`` or the caller's current stream (no synchronisation).
    ``fast``: the call signature from ``merge_states_fast``'s miss, to record the plan under.
    """
    kind = array_kind(o)
    if array_kind(lse) != kind:
        raise TypeError(f"o and lse must be the same kind of array, got {type(o).__name__} and "
                        f"{type(lse).__name__}")
    for name, x in (("o", o), ("lse", lse)):
        if dtype_name(x) != "float32":
            raise TypeError(f"{name} must be float32 on the GPU, got {dtype_name(x)} (merge "
                            f"partial states in fp32; cast with .astype(float32))")
    n, b, s, h, d = o.shape
    out = empty_like_kind(kind, o, (b, s, h, d), "float32")
    lse_out = empty_like_kind(kind, o, (b, h, s), "float32")
    if SIMULATOR:
        args = [kernel_array(x, kind, False) for x in (o, lse, out, lse_out)]
        merge_simulated(*args, OUT_F32, True)
        return out, lse_out
    if out.size if kind != "torch" else out.numel():
        device = current_device_id()
        plan = merge_plan(o, lse, out, lse_out, kind, OUT_F32, device)
        plan.launch([interface(x, kind)[0] for x in (o, lse, out, lse_out)],
                    raw_stream_handle(stream, kind, o))
        if fast is not None and kind in ("torch", "cupy"):
            register_fast(_FAST_CALLS, fast, FastCall(
                plan, kind, o, device, (b, s, h, d), "float32", (b, h, s), (),
                order=(0, 1, 2, 3)))
    return out, lse_out


def merge_states_fast(o, lse, stream):
    """A repeated merge_states call of the same signature: (result, None) on a hit, else (None,
    signature) for ``merge_states_cuda`` to record the plan under."""
    key = call_key("merge_states", (o, lse), ())
    if key is None:
        return None, None
    call = _FAST_CALLS.get(key)
    if call is not None:
        result = call.run((o, lse), (), (), stream)
        if result is not None:
            return result, None
    return None, key
