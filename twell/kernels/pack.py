"""Launcher of ``pack.cu``: relu + TwELL packing of a dense bf16 pre-activation."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from twell.kernels.buffers import alloc, u16
from twell.kernels.compile import Source, declare

#: Rows packed by one block (one warp each).
PACK_WARPS = 8
#: The bit tests two bf16 per instruction and empty tiles stored straight away (1), or
#: one value at a time (0); the same words (pack.cu).
PACK_SIMD = 1

SOURCE = declare(
    Source(
        "pack.cu",
        parameters=("TILE", "SLOTS"),
        constants={"PACK_WARPS": PACK_WARPS, "PACK_SIMD": PACK_SIMD},
        examples=tuple(
            {"TILE": t, "SLOTS": s}
            for t, s in [(256, 32), (256, 64), (256, 128), (128, 16), (64, 8), (32, 2)]
        ),
    )
)


def pack(pre: Any, tile: int, slots: int) -> tuple[Any, Any]:
    """relu + TwELL packing of a bf16 pre-activation ``[M, N]``.

    Returns:
        ``(packed uint32 [M, N/tile*slots], heavy uint8 [M])``: heavy rows (a tile
        overflowed, or a non-finite value) have ``heavy[m] = 1``.
    """
    m, n = pre.shape
    packed = alloc((m, n // tile * slots), np.uint32)
    heavy = alloc((m,), np.uint8)
    if m:
        SOURCE.kernel("twell_pack_rows", TILE=tile, SLOTS=slots)(
            (math.ceil(m / PACK_WARPS),), (PACK_WARPS * 32,),
            (u16(pre), packed, heavy, np.int32(m), np.int32(n)),
        )  # fmt: skip
    return packed, heavy
