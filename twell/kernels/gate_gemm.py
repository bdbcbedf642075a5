"""The gate GEMM with relu and TwELL packing in its epilogue (``gate_gemm.cu``).

``relu(x @ w.T)`` goes from tensor cores straight into TwELL words: the dense
pre-activation never reaches global memory. The kernel reads ``x`` and ``w`` through TMA
tensor maps (the driver's ``cuTensorMapEncodeTiled``, called through ctypes on the
``libcuda`` CuPy already uses, twell._driver); a map is 128 bytes passed by value to the
kernel.
"""

from __future__ import annotations

import ctypes
import functools
import math
from typing import Any

import numpy as np

from twell import _driver
from twell.kernels.buffers import alloc
from twell.kernels.compile import Source, declare, device_info

#: Output tile of one CTA (BM x BN) and its k step; the kernel gets them as constants.
BLOCK_M, BLOCK_N, BLOCK_K = 128, 256, 64
#: Depth of the TMA ring, and consumer warpgroups (64 rows of the tile each).
STAGES, CONSUMERS = 3, 2
_EPI_PITCH = BLOCK_N * 2 + 16  # bytes per row of the epilogue's bf16 tile

#: What the kernel stores (compile-time): TwELL words and heavy flags (what the ops use),
#: the dense bf16 pre-activation (tests), or nothing (timing of the main loop; with the
#: epilogue's bf16 tile filled but not packed, or only handed over: timing of its parts);
#: or the packed output plus clock64 cycles of the parts per CTA (8 uint64 each in ``pre``).
OUTPUT_PACKED, OUTPUT_DENSE, OUTPUT_NONE, OUTPUT_TILE_ONLY, OUTPUT_HANDOVER_ONLY = 0, 1, 2, 3, 4
OUTPUT_PROFILE = 5
#: The count build: dense math for a row count read on the device, its reduction split
#: into parts by that count (:func:`matmul_counted`; pipeline.heavy_rows_counted).
OUTPUT_COUNTED = 6
#: The count build splits its reduction until this many work units (row tiles x column
#: tiles x parts) would be exceeded: the SMs of an H100 or H200. A constant, not the
#: device's SM count, so that the parts (and the bits) do not depend on the GPU model.
SPLIT_UNITS = 132
#: Row tiles per group of the kernel's tile order (``unit_of`` in the source): the tiles
#: in flight at once cover a block of rows and columns of the output. The bits do not
#: depend on it.
GROUP_M = 16
#: Rows a packer warp of the count build stores per step (their ids loaded together).
STORE_ROWS = 16


def smem_bytes(stages: int = STAGES, output: int = OUTPUT_PACKED) -> int:
    """Dynamic shared memory of the kernel: the TMA ring, the epilogue's bf16 tile (every
    build but ``OUTPUT_NONE``, the main loop alone), the mbarriers (the ring's two per
    stage, the count build's gate tile's), and slack to align the ring to 1024 bytes (the
    kernel checks the sum)."""
    tile = 0 if output == OUTPUT_NONE else BLOCK_M * _EPI_PITCH
    return stages * (BLOCK_M + BLOCK_N) * BLOCK_K * 2 + tile + (2 * stages + 1) * 8 + 1024


SMEM_BYTES = smem_bytes()
_THREADS = 128 * (CONSUMERS + 1)

SOURCE = declare(
    Source(
        "gate_gemm.cu",
        # STAGES and SMEM_BYTES (smem_bytes of the build) are parameters so that the main
        # loop can be timed with a deeper ring; the kernel checks their agreement.
        parameters=("TILE", "SLOTS", "OUTPUT", "STAGES", "SMEM_BYTES"),
        constants={
            "BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N, "BLOCK_K": BLOCK_K, "CONSUMERS": CONSUMERS,
            "SPLIT_UNITS": SPLIT_UNITS, "STORE_ROWS": STORE_ROWS,
        },
        examples=tuple(
            {"TILE": t, "SLOTS": s, "OUTPUT": OUTPUT_PACKED, "STAGES": STAGES,
             "SMEM_BYTES": SMEM_BYTES}
            for t, s in [(256, 32), (256, 64), (256, 128), (128, 16), (64, 8), (32, 2)]
        ) + tuple({"TILE": 256, "SLOTS": 32, "OUTPUT": o, "STAGES": st,
                   "SMEM_BYTES": smem_bytes(st, o)}
                  for o, st in ((OUTPUT_DENSE, STAGES), (OUTPUT_COUNTED, STAGES),
                                (OUTPUT_NONE, STAGES), (OUTPUT_NONE, 4),
                                (OUTPUT_TILE_ONLY, STAGES), (OUTPUT_HANDOVER_ONLY, STAGES),
                                (OUTPUT_PROFILE, STAGES))),
    )
)  # fmt: skip

# CUtensorMap enums (cuda.h)
_BFLOAT16, _INTERLEAVE_NONE, _SWIZZLE_128B, _L2_256B, _OOB_ZERO = 9, 0, 3, 3, 0


def _encode_tiled() -> Any:
    return _driver.function("cuTensorMapEncodeTiled")


def tensor_map(matrix: Any, box_rows: int) -> np.ndarray:
    """A TMA map of a bf16 row-major ``[rows, K]`` CuPy matrix, boxes of ``box_rows`` x 64
    elements with the 128-byte swizzle, zeros outside; as a 1-element ``V128`` array (the
    kernel argument, passed by value)."""
    rows, k = matrix.shape
    if k % 8 or matrix.data.ptr % 16 or not matrix.flags.c_contiguous:
        raise ValueError("tensor_map: need a C-contiguous, 16-byte aligned matrix with K % 8 == 0")
    return _encoded(matrix.data.ptr, rows, k, box_rows)


@functools.lru_cache(maxsize=256)
def _encoded(address: int, rows: int, k: int, box_rows: int) -> np.ndarray:
    """The map is a function of (address, shape, box) only, so it is cached on them: a
    new array at a recycled address gets the same, still correct, map."""
    raw = ctypes.create_string_buffer(128 + 64)  # CUtensorMap: 128 bytes, 64-byte aligned
    aligned = (ctypes.addressof(raw) + 63) // 64 * 64
    dims = (ctypes.c_uint64 * 2)(k, rows)
    strides = (ctypes.c_uint64 * 1)(k * 2)
    box = (ctypes.c_uint32 * 2)(BLOCK_K, box_rows)
    ones = (ctypes.c_uint32 * 2)(1, 1)
    status = _encode_tiled()(
        aligned, _BFLOAT16, 2, address, dims, strides, box, ones,
        _INTERLEAVE_NONE, _SWIZZLE_128B, _L2_256B, _OOB_ZERO,
    )  # fmt: skip
    if status != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed (CUresult {status}) for {(rows, k)}")
    out = np.frombuffer(ctypes.string_at(aligned, 128), dtype=np.dtype("V128"))
    out.flags.writeable = False
    return out


def gate_pack(x: Any, w: Any, tile: int, slots: int) -> tuple[Any, Any]:
    """``relu(x @ w.T)`` straight into TwELL (packing in the GEMM's epilogue; the
    pre-activation never reaches global memory), for bf16 ``x [M, K]``, ``w [N, K]``.

    Returns:
        ``(packed uint32 [M, N/tile*slots], heavy uint8 [M])``, as ``pack.pack`` does.
    """
    m, n = x.shape[0], w.shape[0]
    packed = alloc((m, n // tile * slots), np.uint32)
    heavy = alloc((m,), np.uint8)
    heavy.fill(0)
    launch(x, w, tile=tile, slots=slots, output=OUTPUT_PACKED, packed=packed, heavy=heavy)
    return packed, heavy


def tiles(m: int, n: int) -> int:
    """The launch's output tiles (``BLOCK_M`` x ``BLOCK_N``) for ``[m, n]``."""
    return math.ceil(m / BLOCK_M) * math.ceil(n / BLOCK_N)


def ctas(m: int, n: int) -> int:
    """The launch's persistent grid: a CTA per SM, at most one per tile."""
    return max(1, min(tiles(m, n), device_info().multiprocessors))


def count_splits(rows: int, n: int, k: int, max_splits: int) -> int:
    """The parts the count build splits the reduction of ``rows`` rows into, for ``w
    [n, k]`` (the kernel's ``twell_count_splits``): the most, at most ``max_splits``, that
    keep row tiles x column tiles x parts within :data:`SPLIT_UNITS`, none empty."""
    kblocks = math.ceil(k / BLOCK_K)
    units = math.ceil(rows / BLOCK_M) * math.ceil(n / BLOCK_N)
    if units == 0:
        return 1
    s = max(1, min(max_splits, kblocks, SPLIT_UNITS // units))
    per = math.ceil(kblocks / s)
    return math.ceil(kblocks / per)


@functools.lru_cache(maxsize=256)
def part_rows(m: int, n: int, k: int, max_splits: int) -> int:
    """Rows of the fp32 parts buffer a count launch of at most ``m`` rows needs (parts x
    rows rounded up to ``BLOCK_M``, the most over the counts it may find; 0 when no count
    splits)."""
    most = 0
    for tiles_m in range(1, math.ceil(m / BLOCK_M) + 1):
        s = count_splits(tiles_m * BLOCK_M, n, k, max_splits)
        if s == 1:
            break
        most = max(most, s * tiles_m * BLOCK_M)
    return most


def launch(
    x: Any,
    w: Any,
    *,
    tile: int,
    slots: int,
    output: int = OUTPUT_PACKED,
    packed: Any | None = None,
    heavy: Any | None = None,
    pre: Any | None = None,
    stages: int = STAGES,
    part: Any | None = None,
    rows: Any | None = None,
    out_ids: Any | None = None,
    gate: Any | None = None,
    gate_ids: Any | None = None,
    max_splits: int = 1,
    grid: int | None = None,
    x_all: Any | None = None,
) -> None:
    """Run the kernel on bf16 ``x [M, K]`` and ``w [N, K]`` (CuPy, C-contiguous).

    ``OUTPUT_PACKED``: relu + TwELL into ``packed`` (uint32 ``[M, N/tile*slots]``) and
    ``heavy`` (uint8 ``[M]``, zeroed by the caller). ``OUTPUT_DENSE``: the bf16 GEMM into
    ``pre`` ``[M, N]``. ``OUTPUT_NONE``, ``OUTPUT_TILE_ONLY``, ``OUTPUT_HANDOVER_ONLY``:
    nothing stored (timing of the main loop and of the epilogue's parts).
    ``OUTPUT_PROFILE``: as ``OUTPUT_PACKED``, plus cycles of the epilogue's parts in
    ``pre`` (uint64 ``[grid, 8]``, grid = :func:`ctas`, viewed as uint16).
    ``stages``: the ring's depth (timing of the main loop only; the other builds' shared
    memory has room for ``STAGES``).

    ``OUTPUT_DENSE`` and ``OUTPUT_COUNTED`` take a device row count ``rows`` (int32, one
    element: the rows ``min(M, rows[0])``; None: M) and ``out_ids`` (int32: bf16 row ``m``
    goes to row ``out_ids[m]`` of ``pre``; None: row m). ``OUTPUT_COUNTED`` splits the
    reduction into :func:`count_splits` parts (at most ``max_splits``) and, split, writes
    fp32 parts to ``part`` (``[part_rows, N]``) for :func:`reduce_counted` instead of
    ``pre``; unsplit, with ``gate`` (bf16 ``[*, N]``) it writes ``bf16(relu(g) * out)``,
    ``g`` row ``gate_ids[m]`` (None: m) of ``gate``.
    ``grid``: CTAs of the persistent grid (default :func:`ctas` of M, N).
    ``x_all`` (``OUTPUT_COUNTED``): the matrix whose rows ``x`` holds, gathered by
    ascending ids (``[M, K]`` too); where the count covers all M rows, the ids are
    0..M-1 and the kernel reads ``x_all`` in place of ``x`` (:func:`gather_counted` then
    skips the copy).
    """
    m, k = x.shape
    n = w.shape[0]
    if m == 0 or n == 0:
        return
    if output in (OUTPUT_PACKED, OUTPUT_PROFILE) and (packed is None or heavy is None):
        raise ValueError("launch: OUTPUT_PACKED and OUTPUT_PROFILE need packed and heavy")
    if output in (OUTPUT_DENSE, OUTPUT_PROFILE) and pre is None:
        raise ValueError("launch: OUTPUT_DENSE and OUTPUT_PROFILE need pre")
    smem = smem_bytes(stages, output)
    if stages < 2 or smem > 232448:
        raise ValueError(f"launch: a ring of {stages} stages does not work with this build")
    if output == OUTPUT_COUNTED and (
        pre is None or (part is None and part_rows(m, n, k, max_splits) > 0)
    ):
        raise ValueError("launch: OUTPUT_COUNTED needs pre, and part when it may split")
    if x_all is not None and (output != OUTPUT_COUNTED or x_all.shape != x.shape):
        raise ValueError("launch: x_all is for OUTPUT_COUNTED, and has x's shape")
    grid = (grid or ctas(m, n),)
    if output == OUTPUT_PROFILE and pre.nbytes < grid[0] * 64:
        raise ValueError(f"launch: OUTPUT_PROFILE needs {grid[0] * 64} bytes of pre")
    fn = SOURCE.kernel(
        "twell_gate_gemm", TILE=tile, SLOTS=slots, OUTPUT=output, STAGES=stages, SMEM_BYTES=smem
    )
    if fn.max_dynamic_shared_size_bytes < smem:
        fn.max_dynamic_shared_size_bytes = smem
    null = np.uint64(0)
    fn(
        grid, (_THREADS,),
        (
            tensor_map(x, BLOCK_M), tensor_map(w, BLOCK_N),
            tensor_map(x if x_all is None else x_all, BLOCK_M),
            null if packed is None else packed, null if heavy is None else heavy,
            null if pre is None else pre.view(np.uint16), null if part is None else part,
            null if rows is None else rows, null if out_ids is None else out_ids,
            null if gate is None else gate.view(np.uint16),
            null if gate_ids is None else gate_ids,
            np.int32(m), np.int32(n), np.int32(k), np.int32(max_splits),
            np.int32(x_all is not None), np.int32(GROUP_M),
        ),
        shared_mem=smem,
    )  # fmt: skip


# ---------------------------------------------------------------------- counted rows
#: Most parts the count build splits a reduction into.
MAX_SPLITS = 16
_REDUCE_THREADS = 256


def _aux(name: str) -> Any:
    """A kernel of the source besides the GEMM (any build has it; the count build's)."""
    return SOURCE.kernel(
        name, TILE=256, SLOTS=32, OUTPUT=OUTPUT_COUNTED, STAGES=STAGES,
        SMEM_BYTES=smem_bytes(STAGES, OUTPUT_COUNTED),
    )  # fmt: skip


def matmul_counted(
    a: Any,
    w: Any,
    rows: Any,
    out: Any,
    *,
    out_ids: Any | None = None,
    gate: Any | None = None,
    gate_ids: Any | None = None,
    a_all: Any | None = None,
) -> Any:
    """``a[i] @ w.T`` for the rows ``i < min(M, rows[0])`` of bf16 ``a [M, K]`` (``w
    [N, K]``; ``rows`` an int32 device count), on tensor cores, the reduction split into
    :func:`count_splits` parts. One part: bf16 into row ``out_ids[i]`` (or ``i``) of
    ``out`` (with ``gate``: ``bf16(relu(g) * bf16(v))`` as :func:`reduce_counted`);
    several: fp32 parts into the returned buffer (None when no count of at most M rows
    splits), which :func:`reduce_counted`, given the same gate, finishes. Grid and
    buffers are sized on the host for M rows; the kernel reads the count (no
    synchronisation). ``a_all``: the matrix ``a`` was gathered from by ascending ids, read
    in its place where the count covers all M rows (``launch``'s ``x_all``).

    The gate of an unsplit launch reaches the epilogue through shared memory: each output
    tile's gate rows are copied in while its main loop runs."""
    m, k = a.shape
    n = w.shape[0]
    rows_part = part_rows(m, n, k, MAX_SPLITS)
    part = alloc((rows_part, n), np.float32) if rows_part else None
    if m:
        launch(
            a, w, tile=256, slots=32, output=OUTPUT_COUNTED, pre=out, part=part, rows=rows,
            out_ids=out_ids, gate=gate, gate_ids=gate_ids, max_splits=MAX_SPLITS,
            grid=device_info().multiprocessors, x_all=a_all,
        )  # fmt: skip
    return part


def reduce_counted(
    part: Any | None,
    single: Any | None,
    rows: Any,
    m: int,
    k: int,
    out: Any,
    *,
    gate: Any | None = None,
    gate_ids: Any | None = None,
    out_ids: Any | None = None,
) -> None:
    """The output of a :func:`matmul_counted` of ``m`` rows and reduction ``k`` for its
    rows ``i < min(m, rows[0])``: ``v`` = the sum of its parts (``part``, fp32, in a fixed order)
    or, unsplit, its bf16 ``single`` (``[M, N]``); then ``out[out_ids[i]]`` (or
    ``out[i]``) = ``bf16(relu(g) * bf16(v))``, ``g = gate[gate_ids[i]]`` (or
    ``gate[i]``), or ``bf16(v)`` without a gate. ``part`` and ``single`` both None:
    ``v = 1`` (``out = relu(g)``). Unsplit, the GEMM wrote the output itself and the
    kernel returns at once."""
    n = out.shape[1]
    if not m:
        return
    none = np.uint64(0)
    _aux("twell_gate_gemm_reduce")(
        (device_info().multiprocessors * 8,), (_REDUCE_THREADS,),
        (
            none if part is None else part, none if single is None else single.view(np.uint16),
            rows, np.int32(m), np.int32(n), np.int32(k),
            np.int32(MAX_SPLITS if part is not None or single is not None else 1),
            none if gate is None else gate.view(np.uint16),
            none if gate_ids is None else gate_ids, none if out_ids is None else out_ids,
            out.view(np.uint16),
        ),
    )  # fmt: skip


def gather_counted(src: Any, ids: Any, rows: Any, out: Any, *, skip_all: bool = False) -> None:
    """``out[i] = src[ids[i]]`` for ``i < min(M, rows[0])`` (``M`` = rows of ``out``;
    bf16 rows of the same width); the rest of ``out`` is left as it is. ``skip_all``: a
    count of all M rows copies nothing, for count builds given ``a_all=src`` (the ids
    ascending, so then 0..M-1)."""
    m, width = out.shape
    if m:
        _aux("twell_gather_counted")(
            (device_info().multiprocessors * 8,), (_REDUCE_THREADS,),
            (src.view(np.uint16), np.int32(width), ids, rows, np.int32(m), out.view(np.uint16),
             np.int32(skip_all)),
        )  # fmt: skip
