"""The caller's CUDA stream: an explicit ``stream`` argument (CuPy, PyTorch, Numba, cuda.core
stream objects or a raw handle) or else the current stream of the array's library."""
from __future__ import annotations

from numba import cuda

from ..primitives import SIMULATOR

__all__ = ["raw_stream_handle", "numba_stream", "torch_current_stream"]


def raw_stream_handle(stream, kind: str, like):
    """The caller's stream as an int handle (0: the legacy default stream)."""
    if stream is not None:
        if isinstance(stream, int):
            return stream
        for attr in ("ptr", "cuda_stream"):
            handle = getattr(stream, attr, None)
            if isinstance(handle, int):
                return handle
        if hasattr(stream, "__cuda_stream__"):
            return int(stream.__cuda_stream__()[1])
        handle = getattr(stream, "handle", None)
        if isinstance(handle, int):
            return handle
        if type(stream).__module__.startswith("numba"):
            value = getattr(stream.handle, "value", stream.handle)
            return int(value or 0)
        raise TypeError(f"stream must be a CuPy/PyTorch/Numba stream or a raw handle, got {stream!r}")
    if kind == "torch":
        return torch_current_stream(like.device.index)
    try:
        import cupy
    except ImportError:
        return 0
    return cupy.cuda.get_current_stream().ptr


def torch_current_stream(device_index: int) -> int:
    """PyTorch's current stream on a device as a raw handle. ``torch._C._cuda_getCurrentRawStream``
    (what Triton's launcher calls) answers without building a ``torch.cuda.Stream`` object, a
    few microseconds less per call; the public route where it is missing."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream



def numba_stream(stream, kind: str, like):
    """A Numba stream for the launch: the given one, else the caller's current stream."""
    if SIMULATOR:
        return 0
    if stream is not None:
        if isinstance(stream, int):
            return cuda.external_stream(stream) if stream else cuda.default_stream()
        for attr in ("ptr", "cuda_stream", "handle"):
            handle = getattr(stream, attr, None)
            if isinstance(handle, int):
                return cuda.external_stream(handle) if handle else cuda.default_stream()
        if hasattr(stream, "__cuda_stream__"):
            _, handle = stream.__cuda_stream__()
            return cuda.external_stream(handle) if handle else cuda.default_stream()
        if type(stream).__module__.startswith("numba"):
            return stream
        raise TypeError(f"stream must be a CuPy/PyTorch/Numba stream or a raw handle, got {stream!r}")
    handle = 0
    if kind == "torch":
        handle = torch_current_stream(like.device.index)
    else:
        try:
            import cupy

            handle = cupy.cuda.get_current_stream().ptr
        except ImportError:
            handle = 0
    return cuda.external_stream(handle) if handle else cuda.default_stream()

