"""numba_flash_reference: the executable specification of numba-flash, in pure NumPy.

Exact attention for every mask in float64, the online-softmax and merge math the kernels follow
(with precision emulation), and the mask encodings. It never imports numba.
"""
from . import masks  # noqa: F401
