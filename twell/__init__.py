"""twell: TwELL sparse formats and kernels for ReLU feed-forward blocks on Hopper GPUs.

Public API (docs/ops.md): the formats :class:`TwELL` and :class:`Hybrid`, the ops
:func:`gate`, :func:`down`, :func:`gated_down` and :func:`ffn` (NumPy in → reference on
the CPU; CuPy/torch CUDA in → GPU kernels), and the NumPy oracle :mod:`twell.reference`.
"""

from twell import reference
from twell.formats import Hybrid, TwELL
from twell.ops import SparseFFN, down, ffn, gate, gated_down

__version__ = "0.1.0"

__all__ = ["Hybrid", "SparseFFN", "TwELL", "down", "ffn", "gate", "gated_down", "reference"]
