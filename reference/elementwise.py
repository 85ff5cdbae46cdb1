"""Evaluating a user's scalar function (``mask_mod``, ``score_mod``) on arrays of arguments.

The GPU compiles such a function with Numba and calls it on one element at a time. The reference
calls it once on broadcast NumPy arrays when the body allows (arithmetic, comparisons, ``&``,
``|``, indexing a captured array, NumPy ufuncs), and element by element with Python scalars
otherwise (``if`` on a value, ``math.*`` functions, ``min`` / ``max`` of two values raise on
arrays, and then the scalar path runs). Both give the same values for an elementwise function.
"""
from __future__ import annotations

import warnings

import numpy as np

__all__ = ["call_elementwise", "SLOW_CALLS"]

# Element counts from which the per-element fallback warns (once per function): at about a
# microsecond per Python call, 2**22 calls take seconds.
SLOW_CALLS = 1 << 22
_WARNED: set = set()


def call_elementwise(fn, args, kinds: str) -> np.ndarray:
    """``fn(*args)`` for every element of the broadcast ``args`` (scalars or arrays).

    ``kinds``: the NumPy dtype kinds a vectorised result may have ("bui" for a predicate, "fiu"
    for a number); another kind, or a shape that does not broadcast to the arguments', or an
    exception, falls back to calling ``fn`` per element (ints as Python ints, floats as Python
    floats). Returns an array of the arguments' broadcast shape (the vectorised result as
    returned, broadcast; the per-element results as float64 for "f" in ``kinds``, else bool).
    """
    shape = np.broadcast_shapes(*(np.shape(a) for a in args))
    try:
        with np.errstate(all="ignore"):
            got = np.asarray(fn(*args))
        if got.dtype.kind in kinds and np.broadcast_shapes(got.shape, shape) == shape:
            return np.broadcast_to(got, shape)
    except Exception:  # noqa: BLE001 - not vectorisable: evaluate element by element below
        pass
    size = int(np.prod(shape))
    if size >= SLOW_CALLS and id(fn) not in _WARNED:
        _WARNED.add(id(fn))
        warnings.warn(f"{getattr(fn, '__name__', fn)!s} does not accept NumPy arrays, so it is "
                      f"called once per element ({size} calls here): write its body with array "
                      f"operations (np.where instead of if, np.tanh instead of math.tanh) to "
                      f"make it fast", RuntimeWarning, stacklevel=3)
    # np.frompyfunc calls fn with Python ints and floats, in a C loop (~8x a Python loop).
    full = np.broadcast_arrays(*(np.asarray(a) for a in args))
    got = np.asarray(np.frompyfunc(fn, len(args), 1)(*full), dtype=object)
    return got.astype(np.float64 if "f" in kinds else bool)
