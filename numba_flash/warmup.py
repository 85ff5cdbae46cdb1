"""``numba_flash.warmup``: compile ahead of time the kernels a deployment will call, so that the
first real call of every configuration loads machine code from Numba's disk cache instead of
compiling it (docs/api.md, "Kernel cache and warm-up")."""
from __future__ import annotations

__all__ = ["warmup"]

_HALF = ("float16", "bfloat16")


def warmup(*, dtypes=("float16", "bfloat16"), head_dims=(64, 128), causal=(False, True),
           return_lse=(False,), decode=True, paged=(False, True), library="cupy") -> dict:
    """Run one tiny GPU call of every configuration in the product of the arguments, so that
    each kernel is compiled (or loaded) once and saved in Numba's disk cache.

    dtypes: among float16, bfloat16, float32, float64; head_dims: the forward's head dims;
    causal / return_lse: the flag values to cover; decode: also decode (float16 / bfloat16
    only) with contiguous and/or paged caches (``paged``), split and direct. Inputs are
    contiguous arrays of ``library`` ("cupy" or "torch"), the layout of most calls (a strided
    view is another kernel signature: warm it with a call of your own). Returns
    ``numba_flash.cuda.launch.cache.kernel_cache_stats()`` after the calls. Raises RuntimeError
    without a GPU.
    """
    import numpy as np

    import numba_flash
    from .cuda.launch.cache import kernel_cache_stats

    new = _allocator(library)
    for dt in dtypes:
        for d in head_dims:
            q, k = new((1, 17, 2, d), dt), new((1, 33, 1, d), dt)
            for flag in causal:
                for lse in return_lse:
                    numba_flash.attention(q, k, k, causal=flag, return_lse=lse)
            if decode and dt in _HALF and d <= 256:
                _warm_decode(numba_flash, new, dt, d, paged, np)
    _synchronize(library)
    return kernel_cache_stats()


def _warm_decode(numba_flash, new, dt, d, paged, np):
    q = new((2, 1, 4, d), dt)
    for is_paged in paged:
        if is_paged:
            cache = new((8, 64, 2, d), dt)
            table = _int32(new, np.arange(8, dtype=np.int32).reshape(2, 4))
            for splits in (1, 4):
                numba_flash.decode(q, cache, cache, block_table=table, num_splits=splits)
        else:
            cache = new((2, 256, 2, d), dt)
            for splits in (1, 4):
                numba_flash.decode(q, cache, cache, num_splits=splits)


def _allocator(library):
    """new(shape, dtype name) -> a random device array of ``library``."""
    if library == "torch":
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("numba_flash.warmup needs a CUDA GPU (torch sees none)")
        return lambda shape, dt: torch.randn(shape, device="cuda").to(getattr(torch, dt))
    if library != "cupy":
        raise ValueError(f"library must be 'cupy' or 'torch', got {library!r}")
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no device")
    except Exception as exc:  # noqa: BLE001 - no CuPy, no driver, no device
        raise RuntimeError(f"numba_flash.warmup needs a CUDA GPU and CuPy ({exc}); install the "
                           f"cuda12 / cuda13 extra") from exc
    import ml_dtypes
    import numpy as np

    def new(shape, dt):
        host = np.random.default_rng(0).standard_normal(shape).astype(
            ml_dtypes.bfloat16 if dt == "bfloat16" else dt)
        return cupy.asarray(host)

    return new


def _int32(new, host):
    """A device int32 array of the same library as ``new``'s arrays."""
    probe = new((1,), "float32")
    if type(probe).__module__.startswith("torch"):
        import torch

        return torch.from_numpy(host).cuda()
    import cupy

    return cupy.asarray(host)


def _synchronize(library):
    if library == "torch":
        import torch

        torch.cuda.synchronize()
    else:
        import cupy

        cupy.cuda.runtime.deviceSynchronize()
