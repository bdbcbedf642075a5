"""Launcher of ``heavy_rows.cu``: finding heavy rows, their dense math, and moving them
to and from fixed-size cuBLAS GEMMs.

Row lists live on the device: ``ids`` (int32, ascending) and ``count`` (an int32 array of
one element). Kernels that work on them read the count on the device and size nothing
from it on the host, so no call here synchronises.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from twell import tuning
from twell.kernels.buffers import alloc, grid_1d, u16
from twell.kernels.compile import Source, declare, device_info, launch_after

#: Most rows :func:`matmul` takes as flags (compacting them itself, in shared memory:
#: at most 1024), and so the most tokens of an inference call whose heavy rows skip
#: :func:`compact_rows` (one launch less, about 3.5 µs on an H100; flags the
#: kernels scan byte by byte in every CTA cost more above 1024 tokens).
FLAG_ROWS: int = tuning.value("heavy_rows.FLAG_ROWS")
SOURCE = declare(
    Source(
        "heavy_rows.cu",
        parameters=("HR_SPLIT", "HR_STAGES"),
        dependent=("twell_heavy_rows_matmul", "twell_compact_rows"),
        constants={"HR_FLAG_ROWS": FLAG_ROWS},
        examples=tuple({"HR_SPLIT": s, "HR_STAGES": d} for s in (1, 2, 4, 8) for d in (3, 5)),
        headers=("tensor_core.cuh",),
    )
)
#: Splits of the reduction ``twell_heavy_rows_matmul`` is built for (CTAs of a cluster).
SPLITS = (8, 4, 2, 1)
#: CTAs one 64-row block of output tiles may take: :func:`split_for` picks the largest
#: split that keeps ``ceil(OUTC / 64) * split`` at or below it (about three CTAs per SM of
#: an H100, fixed so that the bits do not depend on the GPU model).
TARGET_CTAS = 384
#: Depth of the kernel's cp.async ring (``STAGES - 1`` k-slices in flight).
STAGES = 5


def split_for(outc: int) -> int:
    """The split of the reduction for ``outc`` output columns: a function of the weight's
    shape alone, so a row's bits do not depend on the batch or the other heavy rows.

    With few heavy rows (the common case, and what fixes the stage's cost) there is one
    64-row block: 32 tiles for the down projection of a 2048-wide model (split 8), 88 for
    its up projection (split 4), the fastest splits on an H100."""
    tiles = math.ceil(outc / 64)
    return next((s for s in SPLITS if tiles * s <= TARGET_CTAS), 1)


def _kernel(name: str) -> Any:
    """A kernel of the source other than the matmul (built with split 1)."""
    return SOURCE.kernel(name, HR_SPLIT=1, HR_STAGES=STAGES)


_NULL = np.uint64(0)


def compact_rows(heavy: Any, *, overlap: bool = False) -> tuple[Any, Any]:
    """Ascending ids of the rows with ``heavy != 0`` (``ids[:count]``) and the count,
    both on the device (a block-wide prefix sum: deterministic). ``overlap``: launched
    to start while the kernel before it (the one that wrote ``heavy``) ends
    (compile.launch_after)."""
    m = heavy.shape[0]
    ids = alloc((max(m, 1),), np.int32)
    count = alloc((1,), np.int32)
    if m:
        args = (heavy, np.int32(m), ids, count)
        launch_after(_kernel("twell_compact_rows"), (1,), (1024,), args, overlap=overlap)
    else:
        count.fill(0)
    return ids, count


def mark_rows(rows: Any, m: int) -> Any:
    """uint8 ``[m]`` flags, 1 at ``rows`` (an int32 device vector), 0 elsewhere."""
    heavy = alloc((m,), np.uint8)
    heavy.fill(0)
    r = rows.shape[0]
    if r:
        _kernel("twell_mark_rows")((math.ceil(r / 256),), (256,), (rows, np.int32(r), heavy))
    return heavy


def matmul(
    a: Any,
    b: Any,
    out: Any,
    ids: Any,
    count: Any,
    max_rows: int,
    *,
    a_by_id: bool,
    out_by_id: bool,
    relu_a: bool = False,
    gate: Any | None = None,
    gate_by_id: bool = False,
    relu_gate: bool = False,
    flags: Any | None = None,
    split: int = 0,
    stages: int = 0,
    overlap: bool = False,
    per_sm: float = 4.0,
) -> Any:
    """``out[orow(i)] = (gate'[grow(i)] *) (a'[arow(i)] @ b.T)`` for ``i < count[0]``.

    ``a`` is ``[*, RED]``, ``b`` ``[OUTC, RED]``, ``out`` and ``gate`` ``[*, OUTC]``, all
    bf16. A row map is ``ids[i]`` where ``*_by_id`` is set, else ``i``. ``relu_a`` /
    ``relu_gate`` apply relu (NaN kept) on load. ``count`` holds at most ``max_rows``
    (which sizes the grid). With ``flags`` (uint8 ``[m]``, ``m <= FLAG_ROWS``) instead
    of ``ids`` and ``count`` (None), the rows are those flagged, ascending, compacted by
    the kernel itself (what :func:`compact_rows` would give, without its launch). One
    launch: the reduction is split over the CTAs of a thread-block cluster
    (``split``, default :func:`split_for`; the ring holds ``stages`` k-slices, default
    :data:`STAGES`), no workspace. ``overlap``: launched to start while the kernel
    before it ends (:func:`twell.kernels.compile.launch_after`); on an H100 that saved
    ~1.5 µs per forward pass where the stage found no row, and cost 1.4–2.5 where it had
    rows. ``per_sm``: CTAs per SM at most in the grid (a grid-stride loop takes the
    other tiles, each computed alike: the bits do not depend on it). Returns None (no
    buffer to keep alive; the callers' CUDA-graph scratch lists take what it returns).
    """
    outc, red = b.shape
    split = split or split_for(outc)
    stages = stages or STAGES
    if split not in SPLITS or not 2 <= stages <= 5:
        raise ValueError(f"split must be one of {SPLITS} and stages 2..5, got {split}, {stages}")
    if max_rows == 0 or outc == 0:
        return None
    gate_args = (
        _NULL if gate is None else u16(gate), np.int32(gate_by_id), np.int32(relu_gate),
        u16(out), np.int32(out_by_id),
    )  # fmt: skip
    # One cluster per 64 x 64 output tile, at most `per_sm` CTAs per SM in the grid (by
    # default four: the grid-stride loop takes the rest; the kernel's 102-143 registers
    # let three of them be resident at once); the kernels read the row count on the
    # device.
    items = math.ceil(max_rows / 64) * math.ceil(outc / 64)
    clusters = max(1, min(items, int(device_info().multiprocessors * per_sm) // split))
    if flags is not None and flags.shape[0] > FLAG_ROWS:
        raise ValueError(f"flags: at most {FLAG_ROWS} rows, got {flags.shape[0]}")
    rows = (
        (ids, count, _NULL, np.int32(0)) if flags is None
        else (_NULL, _NULL, flags, np.int32(flags.shape[0]))
    )  # fmt: skip
    kernel = SOURCE.kernel("twell_heavy_rows_matmul", HR_SPLIT=split, HR_STAGES=stages)
    args = (u16(a), np.int32(a_by_id), np.int32(relu_a), u16(b), np.int32(outc), np.int32(red),
            *rows, *gate_args)  # fmt: skip
    launch_after(kernel, (clusters * split,), (128,), args, overlap=overlap)
    return None


def gather_relu_rows(pre: Any, rows: Any, dense: Any) -> None:
    """``dense[i] = relu(pre[rows[i]])`` for the ``R`` rows of ``dense`` (NaN kept)."""
    r, n = dense.shape
    if r:
        _kernel("twell_gather_relu_rows")(
            (grid_1d(r * n),), (256,), (u16(pre), rows, np.int32(r), np.int32(n), u16(dense))
        )


def gather_rows(src: Any, ids: Any, count: Any, out: Any, rest: Any) -> None:
    """``out[i] = src[ids[i]]`` for ``i < min(count, C)`` (``C`` = rows of ``out``), zeros
    below; ``rest[0] = max(count - C, 0)``, the rows left over."""
    capacity, width = out.shape
    _kernel("twell_gather_rows")(
        (grid_1d(capacity * width // 8),), (256,),
        (u16(src), np.int32(width), ids, count, np.int32(capacity), u16(out), rest),
    )  # fmt: skip


def relu_mul(g: Any, u: Any | None, h: Any) -> None:
    """``h = bf16(relu(g) * u)`` elementwise (``relu(g)`` when ``u`` is None); NaN kept."""
    size = g.size
    _kernel("twell_relu_mul")(
        (grid_1d(size // 2),), (256,),
        (u16(g), _NULL if u is None else u16(u), u16(h), np.int64(size)),
    )  # fmt: skip


def scatter_rows(src: Any, ids: Any, count: Any, out: Any) -> None:
    """``out[ids[i]] = src[i]`` for ``i < min(count, C)`` (``C`` = rows of ``src``)."""
    capacity, width = src.shape
    _kernel("twell_scatter_rows")(
        (grid_1d(capacity * width // 8),), (256,),
        (u16(src), np.int32(width), ids, count, np.int32(capacity), u16(out)),
    )  # fmt: skip


def row_abs_sum(
    src: Any, ids: Any, count: Any, max_rows: int, out: Any, *, by_id: bool, relu: bool
) -> None:
    """``out[ids[i]] = sum(|h|)`` over the bf16 row ``h = src[ids[i] if by_id else i]``
    (relu first when ``relu``; NaN kept) for ``i < min(count, max_rows)``; float32 ``out``."""
    if max_rows == 0:
        return
    n = src.shape[1]
    _kernel("twell_row_abs_sum")(
        (max(1, min(math.ceil(max_rows / 8), device_info().multiprocessors * 16)),), (256,),
        (u16(src), np.int32(n), ids, count, np.int32(max_rows), np.int32(by_id),
         np.int32(relu), out),
    )  # fmt: skip
