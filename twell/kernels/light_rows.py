"""Launcher of ``light_rows.cu``: the light rows' gathered up/down projections.

Both kernels take ``(x, source, heavy, w_up, w_down_t, y, M, N, max_row_nnz)``, with
``x``/``w_up`` null for the non-gated block, and write the light rows of ``y``:

- :func:`from_pre` reads the dense bf16 gate pre-activation (the "fused" route) and
  decides every row's ``heavy`` flag by the routing rule (few tokens: through
  ``light_rows_decode``);
- :func:`from_twell` reads a TwELL buffer, skips rows already flagged heavy and flags
  those over ``max_row_nnz``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from twell.kernels import light_rows_decode
from twell.kernels.buffers import alloc, u16
from twell.kernels.compile import Source, declare, launch_after
from twell.options import LIST_CAPACITY

#: Warps per block of the one-warp-per-token kernels (one: a block retires as soon as its
#: token is done, so long tokens do not hold finished warps' registers).
ROW_WARPS = 1
#: Blocks per SM the one-warp kernels' register budget is sized for (their launch bound,
#: at K <= 2048; 8 above): 16 gives 124-127 registers and 16 resident warps per SM, 8
#: gave 140-158 and 12, and 2048 tokens then took two waves (H100, K=2048, N=5632, the
#: block at M=2048: 0.163 ms against 0.179).
ROW_MIN_BLOCKS = 16
#: The fused kernels' scan of a pre-activation tile: two bf16 per instruction (halfword
#: compares), empty tiles skipped after one ballot (1); or one value at a time (0).
SCAN_SIMD = 1
#: The by-columns kernel: a block of warps per token that split the output's columns
#: between them (the one-warp kernel's bits whatever the block's size), at most
#: COLS_WARPS of them (its launch bound).
COLS = "twell_light_rows_from_pre_cols"
COLS_WARPS = 8
#: Most tokens of a call whose light rows take the by-columns kernel (:func:`cols_warps`
#: has the measurements), and most that take it with COLS_WARPS warps a token (4 above).
COLS_ROWS = 16384
COLS_WIDE_ROWS = 4096
#: The by-columns kernel's build for small batches (twice the registers: two entries'
#: up rows and two batches of down-row slices in flight per warp; two CTAs of 8 warps per
#: SM instead of four), and the most tokens that take it (0: never). H200, K=2048,
#: N=5632, the kernel alone in a graph (µs, default build / deep): uniform 64 tokens 11.1
#: / 10.0, 128 11.5 / 10.8, 256 15.3 / 14.2, 384 19.5 / 24.7 (two waves), 1024 40.7 /
#: 48.4; paperlike 128 25.2 / 21.5, 256 31.0 / 25.5. The block in a torch graph, where
#: the heavy rows' stream shares the SMs (pipeline.fused_beside): 128 tokens 28.4 against
#: 29.9, 256 38.5 against 37.2. Same bits.
COLS_DEEP = "twell_light_rows_from_pre_cols_deep"
COLS_DEEP_ROWS = 128

SOURCE = declare(
    Source(
        "light_rows.cu",
        parameters=("KDIM", "TILE", "SLOTS", "GATED"),
        dependent=("twell_light_rows_from_pre", COLS, COLS_DEEP),
        constants={
            "ROW_WARPS": ROW_WARPS, "ROW_MIN_BLOCKS": ROW_MIN_BLOCKS, "SCAN_SIMD": SCAN_SIMD,
            "COLS_WARPS": COLS_WARPS, "LIST_CAPACITY": LIST_CAPACITY,
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


def cols_warps(m: int, k: int) -> int:
    """Warps per token of the by-columns kernel for ``m`` tokens and outputs of ``k``
    columns: :data:`COLS_WARPS` up to :data:`COLS_WIDE_ROWS` tokens, 4 above; at most one
    per 256-column slice.

    H200, K=2048, N=5632, the kernel alone from a pre-activation, in a CUDA graph (µs;
    one-warp kernel / by columns with 4 warps / with 8): ``uniform`` at 128 tokens 36.0 /
    16.8 / 11.3, at 512 51.2 / 30.2 / 24.1, at 1024 55.4 / 41.0 / 40.4, at 2048 81.5 /
    69.2 / 70.2, at 4096 137.6 / 128.1 / 131.4, at 8192 250.9 / 239.9 / 256.9, at 16384
    479.2 / 464.5 / 526.1; ``paperlike`` (rows of very different lengths, which hold up a
    warp per token) at 512 113.8 / 52.0 / 34.6, at 2048 130.4 / 86.5 / 74.5, at 4096 187.6
    / 137.7 / 126.9, at 8192 278.2 / 227.7 / 224.2, at 16384 469.6 / 413.1 / 422.7."""
    return max(1, min(COLS_WARPS if m <= COLS_WIDE_ROWS else 4, -(-k // 256)))


def _launch(
    function: str, grid: int, block: int, x: Any | None, source: Any, heavy: Any,
    w_up: Any | None, w_down_t: Any, y: Any, tile: int, slots: int, max_row_nnz: int,
    extra: tuple = (), *, after_gemm: bool = False, dense: Any | None = None,
) -> None:  # fmt: skip
    """``after_gemm``: the kernel reads the gate GEMM's output and is launched to start as
    that GEMM ends (compile.launch_after). ``dense``: the call's decision (:func:`decide`)
    for the kernels that read the pre-activation (they flag every row heavy when set)."""
    m, k = y.shape
    gated = w_up is not None
    kernel = SOURCE.kernel(function, KDIM=k, TILE=tile, SLOTS=slots, GATED=int(gated))
    if function.startswith("twell_light_rows_from_pre"):
        extra = (_NULL if dense is None else dense,)
    args = (
        u16(x) if gated else _NULL, source, heavy, u16(w_up) if gated else _NULL,
        u16(w_down_t), u16(y), np.int32(m), np.int32(w_down_t.shape[0]),
        np.int32(max_row_nnz), *extra,
    )  # fmt: skip
    launch_after(kernel, (grid,), (block,), args, overlap=after_gemm)


def from_pre(
    x: Any | None, pre: Any, heavy: Any, w_up: Any | None, w_down_t: Any, y: Any, *,
    tile: int, slots: int, max_row_nnz: int, dense: Any | None = None,
) -> None:  # fmt: skip
    """Light rows of ``y`` straight from the bf16 pre-activation ``pre [M, N]``; writes
    ``heavy[m]`` (1: the row is left to the dense path) for every row. Gated if ``w_up``
    is given. ``dense``: the call's decision (:func:`decide`; above the decode bound):
    when set, every row is flagged heavy and none gathered. Up to
    ``light_rows_decode.DECODE_ROWS_BELOW`` tokens (decode), the cluster
    kernel of light_rows_decode.cu runs; above, up to :data:`COLS_ROWS` tokens, a block of
    :func:`cols_warps` warps per token that split the output's columns (the one-warp
    kernel's bits), and past that a warp per token. The decode kernel gives a row
    different bits (its sums differ in order), so where it runs (an H100's tuning; on an
    H200 the by-columns kernel is faster from one token, and the bound is 0) a token's
    output bits depend on M."""
    m = y.shape[0]
    if max_row_nnz < 0:  # the scan's row limit; Options refuses it too
        raise ValueError(f"max_row_nnz must be >= 0, got {max_row_nnz}")
    if m == 0:
        return
    # The kernel is chosen by M here, not in pipeline's fused route: this function is the
    # one "light rows from pre" contract, so every caller (the route, tests, benches) gets
    # the same choice, and the route stays a composition of stages.
    if m <= light_rows_decode.DECODE_ROWS_BELOW:
        if dense is not None:
            raise ValueError("from_pre: a per-call decision needs more than the decode rows")
        light_rows_decode.from_pre(x, pre, heavy, w_up, w_down_t, y, tile=tile, slots=slots,
                                   max_row_nnz=max_row_nnz)  # fmt: skip
        return
    function, grid, block = "twell_light_rows_from_pre", math.ceil(m / ROW_WARPS), ROW_WARPS
    if m <= COLS_ROWS:
        function = COLS_DEEP if m <= COLS_DEEP_ROWS else COLS
        grid, block = m, cols_warps(m, y.shape[1])
    _launch(function, grid, 32 * block, x, u16(pre), heavy, w_up, w_down_t, y, tile, slots,
            max_row_nnz, after_gemm=True, dense=dense)  # fmt: skip


def flags(pre: Any, heavy: Any, *, kdim: int, gated: bool, tile: int, slots: int,
          max_row_nnz: int) -> None:  # fmt: skip
    """``heavy[m]`` = 1 where row ``m`` of ``pre [M, N]`` is heavy by the rule of
    :func:`from_pre`'s kernels (:data:`COLS`'s scan: the flags it writes, alone), else 0;
    nothing gathered. Built with the block's ``KDIM`` and ``GATED`` (the module
    :func:`from_pre` compiles). A plain launch: the fused route runs it first on a second
    stream (twell.kernels.pipeline.fused_beside)."""
    m, n = pre.shape
    if max_row_nnz < 0:
        raise ValueError(f"max_row_nnz must be >= 0, got {max_row_nnz}")
    if m == 0:
        return
    kernel = SOURCE.kernel("twell_light_rows_flags", KDIM=kdim, TILE=tile, SLOTS=slots,
                           GATED=int(gated))  # fmt: skip
    warps = max(1, min(COLS_WARPS, n // tile))
    args = (u16(pre), heavy, np.int32(m), np.int32(n), np.int32(max_row_nnz))
    launch_after(kernel, (m,), (32 * warps,), args, overlap=False)


def from_twell(
    x: Any | None, packed: Any, heavy: Any, w_up: Any | None, w_down_t: Any, y: Any, *,
    tile: int, slots: int, max_row_nnz: int | None = None, row_l1: Any | None = None,
    up: Any | None = None,
) -> None:  # fmt: skip
    """Light rows of ``y`` from a TwELL buffer (rows with ``heavy[m] != 0`` skipped). With
    ``max_row_nnz``, rows holding more entries get ``heavy[m] = 1`` instead. With
    ``row_l1`` (float32 ``[M]``), each light row's sum of ``|h|`` over its entries is
    written there (in the row's entry order; heavy rows' elements are left alone). With
    ``up`` (float32 ``[M, R]``, gated only), entry ``r`` of a light row's TwELL order gets
    its up product ``x[m]·w_up[n]`` at ``up[m, r]`` for ``r < R`` (other elements left
    alone)."""
    m = y.shape[0]
    if m == 0:
        return
    if up is not None and (
        w_up is None or up.ndim != 2 or up.shape[0] != m or np.dtype(up.dtype) != np.float32
        or not up.flags.c_contiguous
    ):  # fmt: skip
        raise ValueError("up: a C-contiguous float32 [M, R] array, and only for the gated block")
    limit = 2**31 - 1 if max_row_nnz is None else max_row_nnz
    _launch("twell_light_rows_from_twell", math.ceil(m / ROW_WARPS), 32 * ROW_WARPS, x, packed,
            heavy, w_up, w_down_t, y, tile, slots, limit,
            (_NULL if row_l1 is None else row_l1, _NULL if up is None else up,
             np.int32(0 if up is None else up.shape[1])))  # fmt: skip


def decide(
    m: int, n: int, *, pre: Any | None = None, packed: Any | None = None,
    heavy: Any | None = None, tile: int, slots: int, row_limit: int, threshold: float,
    kdim: int, gated: bool,
) -> Any:  # fmt: skip
    """The density switch's decision for this call, on the device, from its own rows
    (``twell_light_rows_decide``): int32 ``[1]``, 1 where the mean active units of the
    light rows of a strided sample (density.sample_rows, as the statistics of
    :class:`twell.kernels.density.DensitySwitch` take it) exceed ``threshold``. From the
    bf16 pre-activation ``pre [m, n]``, or from TwELL words ``packed`` and the packer's
    row flags ``heavy``, which are then all set when the call goes dense. ``kdim`` and
    ``gated``: the block's (the kernel comes from the module its light rows use)."""
    import cupy

    from twell.kernels.density import DensitySwitch, sample_rows

    if (pre is None) == (packed is None) or (packed is not None and heavy is None):
        raise ValueError("decide: give pre, or packed with heavy")
    sample = sample_rows(m, DensitySwitch.SAMPLE_ROWS)
    start, step = sample.start, sample.step
    rows = min(DensitySwitch.SAMPLE_ROWS, len(range(start, m, step)))
    # [decision, ticket, counts of the sampled rows]
    dense = alloc((2 + DensitySwitch.SAMPLE_ROWS,), np.int32)
    stream = cupy.cuda.get_current_stream().ptr
    cupy.cuda.runtime.memsetAsync(dense.data.ptr + 4, 0, 4, stream)  # the ticket
    kernel = SOURCE.kernel(
        "twell_light_rows_decide", KDIM=kdim, TILE=tile, SLOTS=slots, GATED=int(gated)
    )
    threads = min(1024, -(-n // 8 // 32) * 32)  # one 16-byte load of the row per thread
    kernel(
        (rows,), (threads,),
        (
            _NULL if pre is None else u16(pre), _NULL if packed is None else packed,
            _NULL if heavy is None else heavy, np.int32(m), np.int32(n), np.int32(start),
            np.int32(step), np.int32(rows), np.int32(row_limit), np.float32(threshold), dense,
            dense[2:],
        ),
    )  # fmt: skip
    return dense[:1]
