"""Precision emulation: name a floating-point format, round float64 values through it.

``round_to(x, dtype)`` models a store to ``dtype`` followed by a load back into float64: one
round-to-nearest-even, with overflow to +-inf and gradual underflow, exactly as IEEE 754 (and a
GPU register/shared-memory store) does it. The online-softmax reference calls it after every
arithmetic operation to emulate arithmetic carried out in a narrower type.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

__all__ = ["PRECISIONS", "resolve_precision", "precision_name", "round_to", "unit_roundoff",
           "Arithmetic"]

#: Precision names accepted everywhere a precision is asked for.
PRECISIONS = {
    "float64": np.dtype(np.float64),
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
}
_ALIASES = {"double": "float64", "fp64": "float64", "single": "float32", "fp32": "float32",
            "half": "float16", "fp16": "float16", "bf16": "bfloat16"}

# (significand bits incl. the implicit one, minimum normal exponent, largest finite value)
_FORMATS = {
    "float64": (53, -1022, float(np.finfo(np.float64).max)),
    "float32": (24, -126, float(np.finfo(np.float32).max)),
    "float16": (11, -14, float(np.finfo(np.float16).max)),
    "bfloat16": (8, -126, float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)),
}


def resolve_precision(precision, *, argument: str = "precision") -> np.dtype:
    """The NumPy dtype meant by ``precision``.

    ``precision`` is a name ("float64", "float32", "float16", "bfloat16", or an alias such as
    "fp32", "bf16") or anything ``np.dtype`` accepts that denotes one of those four formats
    (``np.float32``, ``ml_dtypes.bfloat16``, ...). Returns a ``np.dtype``; bfloat16 is ml_dtypes'.
    ``argument`` names the caller's argument in error messages.
    """
    if isinstance(precision, str):
        key = _ALIASES.get(precision.lower(), precision.lower())
        if key not in PRECISIONS:
            raise ValueError(f"{argument} must be one of {sorted(PRECISIONS)} (or a matching dtype), "
                             f"got {precision!r}")
        return PRECISIONS[key]
    try:
        dtype = np.dtype(precision)
    except TypeError:
        raise TypeError(f"{argument} must be a precision name or a floating dtype, "
                        f"got {type(precision).__name__} {precision!r}") from None
    for known in PRECISIONS.values():
        if dtype == known:
            return known
    raise ValueError(f"{argument} must be one of {sorted(PRECISIONS)} (or a matching dtype), "
                     f"got dtype {dtype}")


def precision_name(precision, *, argument: str = "precision") -> str:
    """Canonical name ("float64", "float32", "float16" or "bfloat16") of a precision."""
    dtype = resolve_precision(precision, argument=argument)
    return next(name for name, known in PRECISIONS.items() if known == dtype)


def unit_roundoff(precision) -> float:
    """Unit roundoff u = 2**-p of a precision (p significand bits): the worst relative error of
    one round-to-nearest, e.g. 2**-24 for float32."""
    bits, _, _ = _FORMATS[precision_name(precision)]
    return 2.0 ** -bits


def _round_generic(x: np.ndarray, bits: int, emin: int, largest: float) -> np.ndarray:
    """Round-to-nearest-even of float64 ``x`` to a binary format with ``bits`` significand bits,
    minimum normal exponent ``emin`` (subnormals below) and largest finite value ``largest``."""
    _, exponent = np.frexp(x)  # |x| = f * 2**exponent, f in [0.5, 1)
    # Spacing of the target format around x; constant 2**(emin + 1 - bits) among subnormals.
    quantum_exp = np.maximum(exponent, emin + 1) - bits
    # Scaling by a power of two is exact, and np.rint rounds half to even.
    rounded = np.ldexp(np.rint(np.ldexp(x, -quantum_exp)), quantum_exp)
    with np.errstate(invalid="ignore"):
        overflow = np.abs(rounded) > largest
    if np.any(overflow):
        rounded = np.where(overflow, np.copysign(np.inf, x), rounded)
    return rounded


def round_to(x, dtype) -> np.ndarray:
    """Round ``x`` through ``dtype`` and return the result as float64.

    ``x``: array-like of real numbers (any shape, any float dtype); ``dtype``: a precision as
    accepted by ``resolve_precision``. Returns a new float64 ndarray of the same shape whose values
    are representable in ``dtype``: each element correctly rounded (round-to-nearest, ties to even;
    overflow gives +-inf, NaN stays NaN), i.e. the value a store to ``dtype`` would keep.

    bfloat16 is rounded directly from float64 (ml_dtypes' own cast goes through float32 and can
    round twice, e.g. 1 + 2**-8 + 2**-30 must give 1 + 2**-7, not 1).
    """
    name = precision_name(dtype, argument="dtype")
    values = np.array(x, dtype=np.float64, copy=True)
    if name == "float64":
        return values
    if name == "bfloat16":
        return _round_generic(values, *_FORMATS[name])
    # NumPy's float64 -> float32 / float16 casts are single, correctly rounded conversions.
    with np.errstate(over="ignore"):
        return values.astype(PRECISIONS[name]).astype(np.float64)


# Precisions whose arithmetic runs natively: NumPy's float32 +, -, *, / of float32 operands equal
# the float64 result rounded once to float32 (53 >= 2 * 24 + 2 bits, so double rounding is
# innocuous), hence identical to the emulation, only faster. Tests empty this set to check that.
NATIVE = {"float64", "float32"}


class Arithmetic:
    """Arithmetic in one precision: each operation's result correctly rounded to it once.

    ``Arithmetic("float32").add(a, b)`` behaves as an IEEE float32 addition. Values are held in
    ``self.store``: float64 / float32 arrays natively for those two precisions; for float16 and
    bfloat16, float64 arrays holding representable values (each result rounded with
    ``round_to``). Operands must already be representable (results of this object, or ``round``).
    Transcendental functions (``func``) are NumPy's float64 function of the operand, rounded once.
    """

    def __init__(self, precision):
        self.name = precision_name(precision)
        self.native = self.name in NATIVE
        self.store = PRECISIONS[self.name] if self.native else np.dtype(np.float64)

    def round(self, x):
        """Round float64 values to the precision (a store)."""
        if self.name == "float64":
            return np.asarray(x, dtype=np.float64)
        if self.native:
            return np.asarray(x, dtype=np.float64).astype(self.store)
        return round_to(x, self.name)

    def const(self, value: float):
        """A Python number rounded to the precision, as a scalar of the store type."""
        return self.store.type(self.round(np.float64(value)))

    def _op(self, result):
        return result if self.native else round_to(result, self.name)

    def add(self, a, b):
        return self._op(a + b)

    def sub(self, a, b):
        return self._op(a - b)

    def mul(self, a, b):
        return self._op(a * b)

    def div(self, a, b):
        return self._op(a / b)

    def func(self, ufunc, x):
        """A transcendental function: evaluated by NumPy in float64, rounded once."""
        x = np.asarray(x)
        if self.name == "float64":
            return ufunc(x)
        if self.native:
            out = np.empty(x.shape, dtype=self.store)
            return ufunc(x, out=out, dtype=np.float64, casting="same_kind")
        return round_to(ufunc(x), self.name)

    def rowsum(self, x):
        """Sum over the last axis in float64, rounded once."""
        return self.round(x.sum(axis=-1, dtype=np.float64))
