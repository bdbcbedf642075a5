"""What a forward pass keeps for the backward pass: the contract between
``PreparedBlock.forward(x, save=True)`` (:mod:`twell.kernels.pipeline`) and
:func:`twell.kernels.backward.ffn_backward`.

A *pair* is an active (token ``t``, unit ``n``) of a light row. Its index is
``p = t * row_cap + r``, ``r`` the entry's rank in its row in TwELL order (tiles
ascending, slots ascending), ``row_cap`` = :func:`row_capacity`: the forward's saved up
products and the backward's per-pair values are indexed by ``p``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from twell.options import LIST_CAPACITY


@dataclass
class Activations:
    """What a forward pass keeps for the backward pass, all on the device.

    Attributes:
        packed: TwELL words of ``relu(x @ w_gate.T)`` (``relu(x @ w_up.T)`` for the
            non-gated block), uint32 ``[M, N/tile*slots]``; light rows only are valid.
        heavy: uint8 ``[M]``, 1 for the rows that took the dense path.
        ids: int32, the heavy rows' ids in ascending order (``ids[:count[0]]``).
        count: int32 ``[1]``, the number of heavy rows.
        row_l1: float32 ``[M]``, each row's sum of ``|h|`` (the L1 term before its
            reduction; the backward does not read it), or None.
        up: float32 ``[M, R]`` (gated), the light rows' up products ``x[t]·w_up[n]`` by
            pair (``R = row_capacity(...)``; the pair index of this module's docstring),
            or None: the backward then recomputes them (the same bits, one more weight
            row read per pair).
    """

    packed: Any
    heavy: Any
    ids: Any
    count: Any
    row_l1: Any | None = None
    up: Any | None = None


def row_capacity(max_row_nnz: int, n: int, tile: int, slots: int, m: int) -> int:
    """Most entries a light row may keep in the backward: the forward's row limit, what
    the TwELL geometry can hold, the light kernel's list, and int32 pair indices."""
    cap = min(max_row_nnz, (n // tile) * (slots - 1), LIST_CAPACITY)
    return max(0, min(cap, (2**31 - 1) // max(1, m)))
