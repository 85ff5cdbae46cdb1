"""Optional GPU side of the studies: run numba_flash's CUDA kernels next to the emulation.

A study asks ``gpu_context(gpu)`` once; when CuPy, a real GPU and the CUDA launcher are all
present it gets a context whose ``attention`` runs ``numba_flash.attention(..., backend="cuda")``
on CuPy copies of the (already rounded) float64 inputs. Otherwise the context says why not, and
the study reports that sentence in its summary instead of GPU numbers.
"""
from __future__ import annotations

import os

import numpy as np

__all__ = ["GpuContext", "gpu_context", "GPU_CHOICES"]

GPU_CHOICES = ("auto", "on", "off")


class GpuContext:
    """Whether the GPU part of a study runs (``enabled``), and why (``note``: one sentence)."""

    def __init__(self, enabled: bool, note: str):
        self.enabled = enabled
        self.note = note

    def attention(self, q, k, v, dtype: str, **kwargs) -> np.ndarray:
        """``numba_flash.attention`` on the GPU in ``dtype`` ("float16", "bfloat16", "float32",
        "float64").

        q (B, Sq, Hq, D), k and v (B, Sk, Hkv, D): float64 NumPy arrays whose values are
        representable in ``dtype``; keyword arguments go to ``numba_flash.attention``. Returns the
        output as a float64 NumPy array of q's shape.
        """
        if not self.enabled:
            raise RuntimeError(f"the GPU part is disabled: {self.note}")
        import cupy

        import numba_flash

        arrays = [_to_device(cupy, np.asarray(x), dtype) for x in (q, k, v)]
        out = numba_flash.attention(*arrays, backend="cuda", **kwargs)
        cupy.cuda.get_current_stream().synchronize()
        return _to_host(cupy, out, dtype)

    def decode(self, q, k, v, dtype: str, **kwargs) -> np.ndarray:
        """``numba_flash.decode`` (split-KV) on the GPU in ``dtype``: q (B, Sq <= 64, Hq, D),
        k and v (B, Sk, Hkv, D) float64 NumPy arrays; keyword arguments go to ``decode``
        (e.g. ``num_splits``). Returns the output as float64 NumPy (B, Sq, Hq, D)."""
        if not self.enabled:
            raise RuntimeError(f"the GPU part is disabled: {self.note}")
        import cupy

        import numba_flash

        arrays = [_to_device(cupy, np.asarray(x), dtype) for x in (q, k, v)]
        out = numba_flash.decode(*arrays, backend="cuda", **kwargs)
        cupy.cuda.get_current_stream().synchronize()
        return _to_host(cupy, out, dtype)

    def merge_states(self, outs, lses) -> np.ndarray:
        """``numba_flash.merge_states`` on the GPU (float32): outs, a list of float64
        (B, S, H, D) states; lses, a list of float64 (B, H, S). Returns the merged output as
        float64 NumPy (B, S, H, D)."""
        if not self.enabled:
            raise RuntimeError(f"the GPU part is disabled: {self.note}")
        import cupy

        import numba_flash

        o_parts = [cupy.asarray(np.asarray(o, dtype=np.float32)) for o in outs]
        l_parts = [cupy.asarray(np.asarray(lse, dtype=np.float32)) for lse in lses]
        out, _ = numba_flash.merge_states(o_parts, l_parts)
        cupy.cuda.get_current_stream().synchronize()
        return cupy.asnumpy(out).astype(np.float64)


class _DeviceBFloat16:
    """A CuPy uint16 buffer presented as bfloat16 through ``__cuda_array_interface__``."""

    def __init__(self, storage):
        self.storage = storage
        self.shape = tuple(storage.shape)
        self.dtype = np.dtype("V2")
        cai = dict(storage.__cuda_array_interface__)
        cai["typestr"] = "<V2"
        self.__cuda_array_interface__ = cai


def _to_device(cupy, x: np.ndarray, dtype: str):
    if dtype == "bfloat16":
        import ml_dtypes

        bits = np.ascontiguousarray(x.astype(ml_dtypes.bfloat16)).view(np.uint16)
        return _DeviceBFloat16(cupy.asarray(bits))
    return cupy.asarray(x.astype(dtype))


def _to_host(cupy, out, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        import ml_dtypes

        storage = getattr(out, "storage", out)
        bits = cupy.asnumpy(cupy.asarray(storage)).view(np.uint16)
        return bits.view(ml_dtypes.bfloat16).astype(np.float64)
    return cupy.asnumpy(out).astype(np.float64)


def _why_no_gpu() -> str | None:
    """None when the GPU part can run, else a sentence saying what is missing."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return "Numba's CUDA simulator is on (NUMBA_ENABLE_CUDASIM=1), so no real GPU is used"
    try:
        import cupy
    except ImportError:
        return "CuPy is not installed"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device is visible"
    except Exception as exc:  # driver missing or broken
        return f"no usable CUDA device ({type(exc).__name__}: {exc})"
    try:
        from numba_flash.cuda.launch.attention import attention_cuda  # noqa: F401
    except Exception as exc:
        return (f"numba_flash.cuda.launch.attention_cuda is unavailable "
                f"({type(exc).__name__}: {exc})")
    return None


def gpu_context(gpu="auto") -> GpuContext:
    """Decide whether a study's GPU part runs.

    ``gpu``: "auto" (run when CuPy, a GPU and the CUDA launcher are present), "on" (require them:
    RuntimeError otherwise), "off" (never); True / False mean "on" / "off".
    """
    if gpu is True:
        gpu = "on"
    elif gpu is False:
        gpu = "off"
    if gpu not in GPU_CHOICES:
        raise ValueError(f"gpu must be one of {GPU_CHOICES} (or a bool), got {gpu!r}")
    if gpu == "off":
        return GpuContext(False, "the GPU part was switched off (gpu='off')")
    why = _why_no_gpu()
    if why is None:
        import cupy

        name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
        name = name.decode() if isinstance(name, bytes) else str(name)
        return GpuContext(True, f"GPU kernels measured on {name}")
    if gpu == "on":
        raise RuntimeError(f"gpu='on' but the GPU part cannot run: {why}")
    return GpuContext(False, f"GPU part skipped: {why}")
