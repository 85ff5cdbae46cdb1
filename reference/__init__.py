"""numba_flash_reference: the executable specification of numba-flash, in pure NumPy.

Exact attention for every mask in float64, the online-softmax and merge math the kernels follow
(with precision emulation), and the mask encodings. It never imports numba.

``numba_flash_reference.attention`` is the function; its module is reachable as
``sys.modules["numba_flash_reference.attention"]`` or through ``from numba_flash_reference.attention
import ...``.
"""
from . import masks  # noqa: F401
from .attention import Problem, attention, check_problem, check_shapes, check_softcap  # noqa: F401
from .attention import check_input_dtype, check_softmax_scale, visible_block  # noqa: F401
from .merge import merge_many, merge_states, split_attention  # noqa: F401
from .online import dense_tile_classes, online_attention  # noqa: F401
from .precision import Arithmetic, resolve_precision, round_to, unit_roundoff  # noqa: F401
from .backward import attention_backward_reference, attention_backward_tiled  # noqa: F401
from .backward import attention_backward_varlen  # noqa: F401
