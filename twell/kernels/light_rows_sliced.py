"""Launcher of ``light_rows_sliced.cu``: the light rows of the "sliced" route, the gathered
up and down projections read by 256-column slices of the weights so that the slice being
read stays in L2 (for weights far larger than L2; docs/design.md).

:func:`from_twell` has the contract of :func:`twell.kernels.light_rows.from_twell`
without its training outputs: from a TwELL buffer and the heavy flags the packer set, it
flags the rows over ``max_row_nnz`` (``heavy[m] = 1``) and writes the light rows of
``y``; heavy rows of ``y`` are left to the heavy-row stage.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from twell import tuning
from twell.kernels.activations import row_capacity
from twell.kernels.buffers import alloc, u16
from twell.kernels.compile import Source, declare

#: When the "fused" route takes this stage (:func:`pays`): gathered weights (``w_up`` and
#: ``w_down_t``; non-gated ``w_down_t``) of at least WEIGHT_BYTES, about twice the L2, and
#: at least MIN_ROWS tokens (gated blocks measured; H100: 96 MiB and 4096 tokens, H200:
#: 128 MiB and 8192). On an H100, at K=4096, N=14336 (235 MB of the two) and M=16384 it
#: took 6.03 ms against 8.13 for the per-token gather; at K=2048, N=5632 (46 MB) 1.34
#: against 1.19.
WEIGHT_BYTES: int = tuning.value("light_rows_sliced.WEIGHT_BYTES")
MIN_ROWS: int = tuning.value("light_rows_sliced.MIN_ROWS")
#: Entries whose weight pieces a warp loads at once.
SLICE_UNITS = 8
#: Rows (warps) per block of every kernel here.
ROWS_PER_BLOCK = 8

SOURCE = declare(
    Source(
        "light_rows_sliced.cu",
        parameters=("KDIM", "TILE", "SLOTS", "GATED"),
        constants={"SLICE_UNITS": SLICE_UNITS},
        examples=tuple(
            {"KDIM": k, "TILE": 256, "SLOTS": 32, "GATED": g}
            for k in (8, 264, 2048, 4096) for g in (0, 1)
        ) + ({"KDIM": 136, "TILE": 32, "SLOTS": 2, "GATED": 1},),
    )
)  # fmt: skip


def pays(m: int, k: int, n: int, gated: bool = True) -> bool:
    """Whether the "fused" route reads its light rows by slices here (see WEIGHT_BYTES:
    the matrices the gather reads, ``w_up`` and ``w_down_t``, or ``w_down_t`` alone for
    the non-gated block)."""
    return m >= MIN_ROWS and (2 if gated else 1) * n * k * 2 >= WEIGHT_BYTES


def lists(
    packed: Any, heavy: Any, n: int, max_row_nnz: int, params: dict[str, int]
) -> tuple[Any, Any]:
    """The light rows' TwELL entries in the pair layout (``twell_sliced_lists``): uint32
    ``entries [M, max(1, R)]`` (column | bf16 << 16, TwELL order; ``R =
    backward.row_capacity(...)``, the row stride later kernels take from ``entries``), and
    int32 ``row_nnz [M]`` (0 for heavy rows); rows over ``max_row_nnz`` entries (or ``R``;
    with ``R = 0`` every row with an entry) get ``heavy[m] = 1``. ``params``: this
    source's compile-time parameters (``KDIM``, ``TILE``, ``SLOTS``, ``GATED``)."""
    m = packed.shape[0]
    cap = row_capacity(max_row_nnz, n, params["TILE"], params["SLOTS"], m)
    entries = alloc((m, max(1, cap)), np.uint32)
    row_nnz = alloc((m,), np.int32)
    SOURCE.kernel("twell_sliced_lists", **params)(
        (math.ceil(m / ROWS_PER_BLOCK),), (32 * ROWS_PER_BLOCK,),
        (packed, heavy, entries, row_nnz, np.int32(m), np.int32(n), np.int32(cap)),
    )  # fmt: skip
    return entries, row_nnz


def from_twell(
    x: Any | None, packed: Any, heavy: Any, w_up: Any | None, w_down_t: Any, y: Any, *,
    tile: int, slots: int, max_row_nnz: int,
) -> list[Any]:  # fmt: skip
    """Light rows of ``y`` from a TwELL buffer (rows with ``heavy[m] != 0`` skipped; rows
    with more than ``max_row_nnz`` entries get ``heavy[m] = 1``). Gated if ``w_up`` is
    given. Returns the scratch buffers the launches use (keep them alive as long as a
    CUDA graph that captured the call): the rows' entries (uint32) and, gated, their fp32
    up products, both ``[M, R]`` with ``R = backward.row_capacity(...)`` (the pair layout
    the backward uses), and the rows' counts."""
    m, k = y.shape
    if m == 0:
        return []
    n = w_down_t.shape[0]
    gated = w_up is not None
    params = {"KDIM": k, "TILE": tile, "SLOTS": slots, "GATED": int(gated)}
    entries, row_nnz = lists(packed, heavy, n, max_row_nnz, params)
    cap = entries.shape[1]
    rows = math.ceil(m / ROWS_PER_BLOCK)
    threads = 32 * ROWS_PER_BLOCK
    i32 = np.int32
    slices = math.ceil(k / 256)
    h = None
    if gated:
        h = alloc((m, max(1, cap)), np.float32)
        up = SOURCE.kernel("twell_sliced_up", **params)
        for s in range(slices):  # in order: a pair's slice sums are added in slice order
            up((rows,), (threads,), (u16(x), u16(w_up), entries, row_nnz, h, i32(m), i32(cap),
                                     i32(s), i32(s == slices - 1)))  # fmt: skip
    SOURCE.kernel("twell_sliced_down", **params)(
        (math.ceil(slices * m / ROWS_PER_BLOCK),), (threads,),
        (heavy, entries, row_nnz, np.uint64(0) if h is None else h, u16(w_down_t), u16(y),
         i32(m), i32(cap)),
    )  # fmt: skip
    return [entries, row_nnz, h]
