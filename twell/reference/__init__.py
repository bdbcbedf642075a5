"""NumPy/SciPy reference of every twell op: the oracle for the GPU kernels.

The forward ops go through the formats (so the formats are exercised) and model the
kernels' rounding points: gate values are rounded to bfloat16 where they are packed,
everything else accumulates in ``dtype`` (float64 by default). Inputs may be any float
dtype, ml_dtypes bfloat16 included; they are upcast first.
"""

from twell.reference.backward import ffn_backward, l0, l1_loss
from twell.reference.forward import down, ffn, gate, gated_down

__all__ = ["down", "ffn", "ffn_backward", "gate", "gated_down", "l0", "l1_loss"]
