"""Launcher of ``light_rows_reuse.cu``: the light rows of the "reuse" route, whose down
projection reads each 256-unit chunk of ``w_down_t`` once per block of tokens instead of
once per (token, unit) pair (docs/design.md).

:func:`from_twell` has the contract of :func:`twell.kernels.light_rows.from_twell`: from a
TwELL buffer and the heavy flags the packer set, it flags the rows over ``max_row_nnz``
(``heavy[m] = 1``) and writes the light rows of ``y`` (heavy rows are left to the
heavy-row stage), with the same output bits; for the training forward also the rows'
sums of ``|h|`` and the up products.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from twell.kernels import light_rows_sliced
from twell.kernels.buffers import alloc, u16
from twell.kernels.compile import Source, declare, device_info
from twell.kernels.gate_gemm import tensor_map

#: Output columns and units per chunk of the down kernel (its TMA box: 32 KB).
RD_COLS, RD_CHUNK = 64, 256
#: Entries whose ``w_up`` rows a warp of the up kernel loads at once.
UP_UNITS = 2
#: Tokens per group of 8 lanes in the down kernel: the launcher takes the largest whose
#: grid still fills every SM once (more tokens per CTA: each chunk serves more of them).
TOKENS_PER_GROUP = (8, 4, 2, 1)
#: Consumer warps of the down kernel for each number of tokens per group: 8 tokens' sums
#: and windows need more than the 128 registers a 16-warp block leaves a thread.
WARPS = {8: 11, 4: 15, 2: 15, 1: 15}
#: Depth of the down kernel's ring of 32 KB chunks of ``w_down_t``.
STAGES = 4


def smem_bytes(stages: int) -> int:
    """Dynamic shared memory of the down kernel: the ring, its mbarriers, alignment slack."""
    return stages * RD_CHUNK * 128 + 2 * stages * 8 + 1024


SOURCE = declare(
    Source(
        "light_rows_reuse.cu",
        parameters=("KDIM", "GATED", "TPG", "WARPS", "STAGES"),
        constants={"UP_UNITS": UP_UNITS},
        examples=tuple(
            {"KDIM": k, "GATED": g, "TPG": t, "WARPS": WARPS[t], "STAGES": STAGES}
            for k, t in [(2048, 8), (2048, 4), (4096, 8), (8, 1), (264, 2)]
            for g in (0, 1)
        ),
    )
)  # fmt: skip

_NULL = np.uint64(0)


def tokens_per_group(m: int, k: int, sms: int) -> int:
    """The down kernel's tokens per group for ``m`` tokens of width ``k``: the largest of
    :data:`TOKENS_PER_GROUP` whose grid has at least one CTA per SM (else 1)."""
    slices = math.ceil(k / RD_COLS)
    for tpg in TOKENS_PER_GROUP:
        if slices * math.ceil(m / block_tokens(tpg)) >= sms:
            return tpg
    return 1


def block_tokens(tpg: int, warps: int | None = None) -> int:
    """Tokens per CTA of the down kernel: 4 groups of 8 lanes per consumer warp."""
    return (WARPS[tpg] if warps is None else warps) * 4 * tpg


def from_twell(
    x: Any | None, packed: Any, heavy: Any, w_up: Any | None, w_down_t: Any, y: Any, *,
    tile: int, slots: int, max_row_nnz: int, row_l1: Any | None = None,
    up: Any | None = None, tpg: int | None = None,
) -> list[Any]:  # fmt: skip
    """Light rows of ``y`` from a TwELL buffer (rows with ``heavy[m] != 0`` skipped; rows
    with more than ``max_row_nnz`` entries get ``heavy[m] = 1``): :func:`pairs`, then
    :func:`down`. Gated if ``w_up`` is given. With ``row_l1`` (float32 ``[M]``) each light
    row's sum of ``|h|`` in entry order is written there; with ``up`` (float32 ``[M, R]``,
    gated) entry ``r`` of a light row's TwELL order gets its up product ``x[m]·w_up[n]``
    at ``up[m, r]`` for ``r < R``. ``tpg`` overrides :func:`tokens_per_group`. Returns the
    scratch buffers the launches use (keep them alive as long as a CUDA graph that
    captured the call)."""
    m, k = y.shape
    if m == 0:
        return []
    if tpg is None:
        tpg = tokens_per_group(m, k, device_info().multiprocessors)
    scratch = pairs(x, packed, heavy, w_up, w_down_t.shape[0], k, tile=tile, slots=slots,
                    max_row_nnz=max_row_nnz, row_l1=row_l1, up=up, tpg=tpg)  # fmt: skip
    down(*scratch, heavy, w_down_t, y, tpg=tpg)
    return scratch


def pairs(
    x: Any | None, packed: Any, heavy: Any, w_up: Any | None, n: int, k: int, *, tile: int,
    slots: int, max_row_nnz: int, row_l1: Any | None = None, up: Any | None = None,
    tpg: int = 1, warps: int | None = None, stages: int = STAGES,
) -> list[Any]:  # fmt: skip
    """The light rows' entries in the pair layout and their ``h``: ``[entries, row_nnz,
    h]`` (``light_rows_sliced.lists``; ``h`` float32 ``[M, R]``, gated only, else None),
    and the training outputs of :func:`from_twell`. Flags the rows over ``max_row_nnz``.
    ``tpg``, ``warps`` and ``stages`` only pick the compiled module (:func:`down`'s)."""
    m = packed.shape[0]
    gated = w_up is not None
    params = {"KDIM": k, "TILE": tile, "SLOTS": slots, "GATED": int(gated)}
    entries, row_nnz = light_rows_sliced.lists(packed, heavy, n, max_row_nnz, params)
    if up is not None and (
        not gated or up.ndim != 2 or up.shape[0] != m or np.dtype(up.dtype) != np.float32
        or not up.flags.c_contiguous
    ):  # fmt: skip
        raise ValueError("up: a C-contiguous float32 [M, R] array, and only for the gated block")
    cap = entries.shape[1]
    h = alloc((m, cap), np.float32) if gated else None
    if gated or row_l1 is not None:
        i32 = np.int32
        SOURCE.kernel("twell_reuse_up", **_params(k, gated, tpg, warps, stages))(
            (math.ceil(m / 8),), (256,),
            (u16(x) if gated else _NULL, u16(w_up) if gated else _NULL, entries, row_nnz, heavy,
             _NULL if h is None else h, _NULL if up is None else up,
             _NULL if row_l1 is None else row_l1, i32(m), i32(n), i32(cap),
             i32(0 if up is None else up.shape[1])),
        )  # fmt: skip
    return [entries, row_nnz, h]


def down(
    entries: Any, row_nnz: Any, h: Any | None, heavy: Any, w_down_t: Any, y: Any, *,
    tpg: int | None = None, warps: int | None = None, stages: int = STAGES,
) -> None:  # fmt: skip
    """The light rows of ``y`` from the pair layout (``h`` None: non-gated, ``h`` is the
    entries' bf16 values), each 256-unit chunk of ``w_down_t`` read once per block of
    :func:`block_tokens` tokens. ``tpg``, ``warps``, ``stages``: the block geometry
    (default: :func:`tokens_per_group`, :data:`WARPS`, :data:`STAGES`)."""
    m, k = y.shape
    if m == 0:
        return
    if tpg is None:
        tpg = tokens_per_group(m, k, device_info().multiprocessors)
    params = _params(k, h is not None, tpg, warps, stages)
    fn = SOURCE.kernel("twell_reuse_down", **params)
    smem = smem_bytes(params["STAGES"])
    if fn.max_dynamic_shared_size_bytes < smem:
        fn.max_dynamic_shared_size_bytes = smem
    i32 = np.int32
    fn(
        (math.ceil(k / RD_COLS), math.ceil(m / block_tokens(tpg, params["WARPS"]))),
        (params["WARPS"] * 32 + 32,),
        (tensor_map(w_down_t, RD_CHUNK), entries, _NULL if h is None else h, row_nnz, heavy,
         u16(y), i32(m), i32(w_down_t.shape[0]), i32(entries.shape[1])),
        shared_mem=smem,
    )  # fmt: skip


def _params(k: int, gated: bool, tpg: int, warps: int | None, stages: int) -> dict[str, int]:
    if tpg not in TOKENS_PER_GROUP:
        raise ValueError(f"tpg: expected one of {TOKENS_PER_GROUP}, got {tpg!r}")
    if not 2 <= stages <= 6:
        raise ValueError(f"stages: expected 2..6, got {stages!r}")
    warps = WARPS[tpg] if warps is None else warps
    if not 1 <= warps <= 31:
        raise ValueError(f"warps: expected 1..31, got {warps!r}")
    return {"KDIM": k, "GATED": int(gated), "TPG": tpg, "WARPS": warps, "STAGES": stages}
