"""Launcher of ``light_rows.cu``: the light rows' gathered up/down projections.

Both kernels take ``(x, source, heavy, w_up, w_down_t, y, M, N, max_row_nnz)``, with
``x``/``w_up`` null for the non-gated block, and write the light rows of ``y``:

- :func:`from_pre` reads the dense bf16 gate pre-activation (the "fused" route) and
  decides every row's ``heavy`` flag by the routing rule;
- :func:`from_twell` reads a TwELL buffer, skips rows already flagged heavy and flags
  those over ``max_row_nnz``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from twell.kernels.buffers import u16
from twell.kernels.compile import Source, declare
from twell.options import LIST_CAPACITY

#: Warps per block of the one-warp-per-token kernels (one: a block retires as soon as its
#: token is done, so long tokens do not hold finished warps' registers).
ROW_WARPS = 1
#: Warps sharing one token in the decode-sized kernel.
WIDE_WARPS = 8
#: Up to this many tokens, ``from_pre`` gives each token ``WIDE_WARPS`` warps.
WIDE_ROWS_BELOW = 1024

SOURCE = declare(
    Source(
        "light_rows.cu",
        parameters=("KDIM", "TILE", "SLOTS", "GATED"),
        constants={
            "ROW_WARPS": ROW_WARPS, "WIDE_WARPS": WIDE_WARPS, "LIST_CAPACITY": LIST_CAPACITY,
        },
        examples=tuple(
            {"KDIM": k, "TILE": t, "SLOTS": s, "GATED": g}
            for k, t, s in [
                (2048, 256, 32), (2048, 256, 64), (2048, 256, 128), (4096, 256, 32),
                (4096, 256, 128), (8, 32, 2), (136, 64, 16), (1032, 128, 4),
            ]
            for g in (0, 1)
        ),
    )
)  # fmt: skip

_NULL = np.uint64(0)


def _launch(
    function: str, grid: int, block: int, x: Any | None, source: Any, heavy: Any,
    w_up: Any | None, w_down_t: Any, y: Any, tile: int, slots: int, max_row_nnz: int,
) -> None:  # fmt: skip
    m, k = y.shape
    gated = w_up is not None
    SOURCE.kernel(function, KDIM=k, TILE=tile, SLOTS=slots, GATED=int(gated))(
        (grid,), (block,),
        (
            u16(x) if gated else _NULL, source, heavy, u16(w_up) if gated else _NULL,
            u16(w_down_t), u16(y), np.int32(m), np.int32(w_down_t.shape[0]),
            np.int32(max_row_nnz),
        ),
    )  # fmt: skip


def from_pre(
    x: Any | None, pre: Any, heavy: Any, w_up: Any | None, w_down_t: Any, y: Any, *,
    tile: int, slots: int, max_row_nnz: int,
) -> None:  # fmt: skip
    """Light rows of ``y`` straight from the bf16 pre-activation ``pre [M, N]``; writes
    ``heavy[m]`` (1: the row is left to the dense path) for every row. Gated if ``w_up``
    is given. Few tokens (decode) get a block of ``WIDE_WARPS`` warps each."""
    m = y.shape[0]
    if m == 0:
        return
    if m <= WIDE_ROWS_BELOW:
        function, grid, block = "twell_light_rows_from_pre_wide", m, WIDE_WARPS
    else:
        function, grid, block = "twell_light_rows_from_pre", math.ceil(m / ROW_WARPS), ROW_WARPS
    _launch(function, grid, 32 * block, x, u16(pre), heavy, w_up, w_down_t, y, tile, slots,
            max_row_nnz)  # fmt: skip


def from_twell(
    x: Any | None, packed: Any, heavy: Any, w_up: Any | None, w_down_t: Any, y: Any, *,
    tile: int, slots: int, max_row_nnz: int | None = None,
) -> None:  # fmt: skip
    """Light rows of ``y`` from a TwELL buffer (rows with ``heavy[m] != 0`` skipped). With
    ``max_row_nnz``, rows holding more entries get ``heavy[m] = 1`` instead."""
    m = y.shape[0]
    if m == 0:
        return
    limit = 2**31 - 1 if max_row_nnz is None else max_row_nnz
    _launch("twell_light_rows_from_twell", math.ceil(m / ROW_WARPS), 32 * ROW_WARPS, x, packed,
            heavy, w_up, w_down_t, y, tile, slots, limit)  # fmt: skip
