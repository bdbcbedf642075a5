"""Launcher of ``validate.cu``: a user-built TwELL buffer's contents checked in one pass
on the GPU (the CuPy twin of ``formats.TwELL.validate``'s NumPy code)."""

from __future__ import annotations

from typing import Any

import numpy as np

from twell.formats import register_device_check
from twell.kernels.buffers import alloc, grid_1d
from twell.kernels.compile import Source, declare

#: Threads per block (the kernel's shared-memory masks are sized for it).
THREADS = 256

SOURCE = declare(
    Source(
        "validate.cu",
        parameters=("TILE", "SLOTS"),
        constants={"THREADS": THREADS},
        examples=tuple(
            {"TILE": t, "SLOTS": s} for t, s in [(256, 32), (256, 256), (128, 16), (32, 2)]
        ),
    )
)

#: What each failure code means (the kernel's header lists the checks).
CODES = {
    1: "count",
    2: "outside",
    3: "zero",
    4: "duplicate",
    5: "overflow",
    6: "non_finite",
}


def first_failure(
    packed: Any, tile: int, slots: int, light: Any | None = None, *, routing: bool = False
) -> tuple[str, int, int, int] | None:
    """The first failing row-tile check in (row, tile, slot) order, as
    ``(what, row, tile, slot)`` with ``what`` one of :data:`CODES`' values; None if the
    buffer is valid. Synchronises once (to read the answer)."""
    m, width = packed.shape
    tiles = width // slots
    if m == 0 or tiles == 0:
        return None
    result = alloc((1,), np.uint64)
    result.fill(np.uint64(2**64 - 1))
    SOURCE.kernel("twell_validate_tiles", TILE=tile, SLOTS=slots)(
        (grid_1d(m * tiles, THREADS),), (THREADS,),
        (packed, np.uint64(0) if light is None else light, np.int32(routing), np.int64(m),
         np.int32(tiles), result),
    )  # fmt: skip
    key = int(result.get()[0])
    if key == 2**64 - 1:
        return None
    code, position = key & 7, key >> 3
    slot, rest = position % slots, position // slots
    return CODES[code], rest // tiles, rest % tiles, slot


register_device_check(first_failure)  # TwELL.validate and Hybrid.validate on CuPy data
