"""The home of the FFN block's backward pass on the GPU (not built yet).

What exists: :class:`Activations`, the compressed state a forward pass keeps for the
backward (``PreparedBlock.forward(x, save=True)`` returns it), so the forward already
produces everything the backward will read and nothing dense of size ``[M, N]``.

The design the backward kernels will follow (docs/design.md, "Training"):

- ``dh = dy @ w_down`` only at the active (token, unit) pairs of the packed gate, plus the
  L1 term's gradient (``l1_coeff * sign(h) / (M*N)`` for ``reduction="mean"``, ``/ M`` for
  ``"per_token"``); ``da = dh * u`` and ``du = dh * g`` on the same pairs.
- ``dx = da @ w_gate + du @ w_up`` as a gather over each token's active units (the
  forward's light-row kernel with the roles of x and y exchanged).
- ``dw_gate = daᵀ x``, ``dw_up = duᵀ x``, ``dw_down = dyᵀ h`` through the transposed view
  of the pairs (units × tokens), built on the device by prefix sums, and reduced in a
  fixed order (bitwise reproducible; no float atomics).
- Heavy rows (``ids[:count]``) through dense tensor-core math, as in the forward.

The NumPy oracle of all of it is :func:`twell.reference.ffn_backward`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Activations:
    """What a forward pass keeps for the backward pass, all on the device.

    Attributes:
        packed: TwELL words of ``relu(x @ w_gate.T)`` (``relu(x @ w_up.T)`` for the
            non-gated block), uint32 ``[M, N/tile*slots]``; light rows only are valid.
        heavy: uint8 ``[M]``, 1 for the rows that took the dense path.
        ids: int32, the heavy rows' ids in ascending order (``ids[:count[0]]``).
        count: int32 ``[1]``, the number of heavy rows.
    """

    packed: Any
    heavy: Any
    ids: Any
    count: Any
