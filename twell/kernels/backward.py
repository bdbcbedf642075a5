"""The FFN block's backward pass on the GPU: the launcher of its step sources
``backward_light.cu``, ``backward_lists.cu``, ``backward_grads.cu``, ``backward_heavy.cu``
and ``backward_transpose.cu``.

:func:`ffn_backward` computes the gradients of ``<dy, y> + l1_coeff · l1_loss(h)`` from the
:class:`~twell.kernels.activations.Activations` of ``PreparedBlock.forward(x, save=True)``,
with work proportional to the active units, deterministically (no float atomics) and
without synchronising the host. Its NumPy oracle is :func:`twell.reference.ffn_backward`.
With ``a = x w_gateᵀ, g = relu(a), u = x w_upᵀ, h = g u, y = h w_downᵀ`` (non-gated:
``a = x w_upᵀ, h = relu(a)``) and ``l1s`` the coefficient over ``M·N`` (``"mean"``) or
``M`` (``"per_token"``)::

    dh = dy w_down + l1s sign(h),  da = dh u [a > 0],  du = dh g   (non-gated: da = dh [a > 0])
    dx = da w_gate + du w_up,  dW_gate = daᵀ x,  dW_up = duᵀ x,  dW_down = dyᵀ h

The steps, one source each (each file's header has the details):

1. **Light rows** (``backward_light.cu``), one warp per token: for each active unit of the
   token's TwELL entries, ``u = x·w_up[n]`` (the forward's, ``Activations.up``, or
   recomputed with the same sum), ``dh = dy·w_down_t[n]`` (+ the L1 term), ``da``, ``du``;
   the pair values (``da, du, h``) and the pair's unit are stored at the pair's index.
   Then ``dx`` of the light rows in fp32, a warp per (256-column slice, token),
   slice-major (the slices of ``w_gate`` and ``w_up`` being read stay in L2). The step
   also routes the backward's heavy rows: the forward's, plus rows whose ``x`` or ``dy``
   holds Inf/NaN (dense math spreads those to every unit, so only the dense path
   reproduces it) and rows over the pair capacity.
2. **Unit lists** (``backward_lists.cu``, :class:`UnitLists`): the transposed view of the
   light pairs, built on the device by a counting sort.
3. **Weight gradients of the light pairs** (``backward_grads.cu``), a block per (unit, K
   slice) (long lists in segments), summed in ascending token order in fp32; blocks
   numbered slice-major, and one launch per token range where a slice of ``x`` and ``dy``
   for all tokens would not stay in L2 (:func:`grad_slices`, :func:`grad_rows`: the bits
   depend on the ranges, never on the slices).
4. **Heavy rows** (``backward_heavy.cu``): with ``dense_capacity``, the first
   ``options.capacity_rows(M)`` of them through cuBLAS GEMMs of exactly that many rows
   (:func:`_capacity_rows`, as the forward's capacity GEMMs, run before step 2: up to
   :data:`FOLD_ROWS` of them have their weight gradients summed by step 3's kernel after
   the light pairs', more have them written by cuBLAS first, and step 3 adds to them);
   the rest in chunks of :func:`heavy_chunk_rows` rows: tensor-core tiles for
   ``a, u, dy·w_down`` → ``da, du, h`` (bf16), the rows of ``dx``, and the rows' weight
   gradients added after step 3 (capacity rows and light pairs, then chunks: fixed
   order). All chunks are one launch whose
   blocks take work items from a queue in stage order (the device's heavy-row count
   decides how many exist: none costs one empty launch).
5. ``dw_down`` transposed from the ``[N, K]`` accumulation to ``[K, N]``
   (``backward_transpose.cu``).

Every float sum has one owner and a fixed order: step 1 in entry order, step 3 in token
order (then the folded capacity rows in row order; added to the capacity GEMMs' values
where they ran; then segments in order), step 4 per mma fragment in k order (then splits
in order), the chunks last; cuBLAS is deterministic for a given library path and shape.
The only atomics are on integers (shared bit masks, the heavy step's work queue).

Weight gradients accumulate in fp32 and are returned in ``grad_dtype`` (fp32 by default;
bf16 rounds each once: step 3's kernels round dW_gate and dW_up into their outputs where
no heavy row is left for the chunks, a pass at the end otherwise); ``dx`` in ``x``'s
dtype (bf16 math inside).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from twell._arrays import bfloat16
from twell._validation import check_number, check_reduction
from twell.kernels.activations import Activations, row_capacity  # importable from here too
from twell.kernels.buffers import alloc, check_out, empty_bf16, grid_1d, u16
from twell.kernels.compile import Source, declare, device_info
from twell.kernels.convert import as_bf16, from_bf16
from twell.kernels.cublas import gemm_f32, gemm_f32_available, gemm_nt
from twell.kernels.heavy_rows import compact_rows, gather_rows
from twell.options import LIST_CAPACITY

#: Tokens per block of the unit-list kernels (one bit each in the shared masks).
CHUNK_ROWS = 256
#: Warps of a unit-list block.
UNIT_WARPS = 8
#: Pairs a weight-gradient block stages in shared memory at a time.
GRAD_BATCH = 256
#: Blocks per SM the light kernel's register budget is sized for (255 registers at most).
LIGHT_MIN_BLOCKS = 8
#: The weight-gradient kernel reads the x and dy rows of every pair: for all tokens at once
#: (128 MB at M=16384, K=2048) they do not stay in L2, so the kernel works by K slices, all
#: its running blocks in the same slice, and, where a slice of all tokens is still too
#: large, by token ranges (one launch each): a slice of a range's x and dy takes at most
#: this many bytes (:func:`grad_slices`, :func:`grad_rows`).
GRAD_SLICE_BYTES = 24 << 20
#: Shortest segment of a unit list (a unit with more pairs is split across blocks).
MIN_SEGMENT = 256
#: Heavy rows per chunk of step 4: M / HEAVY_CHUNKS (rounded up to 64), kept within
#: [HEAVY_CHUNK_MIN, HEAVY_CHUNK_MAX]. The chunk's buffers take 3 * rows * N bf16 (gated).
HEAVY_CHUNK_MIN = 1024
HEAVY_CHUNK_MAX = 4096
HEAVY_CHUNKS = 8
#: Resident blocks per SM of step 4's launch (its work items come from a queue, so the
#: bits do not depend on this).
HEAVY_BLOCKS_PER_SM = 3
#: Capacity rows (``options.capacity_rows(M)``) up to which their weight gradients are
#: summed by step 3's kernel after the light pairs (``fold``) instead of by three cuBLAS
#: GEMMs: those write the three fp32 ``[N, K]`` accumulators, and step 3 reads them back
#: (24·N·K bytes, ~0.1 ms at N=5632, K=2048 on an H200) however few rows are heavy,
#: where a folded row costs ``2·NV·K`` flops on CUDA cores at each unit where it is
#: active (gated), in step with the device's count of heavy rows. A model's sink tokens
#: (a few rows per sequence), a few non-finite rows, or 1% of heavy tokens at 4096 meet
#: the smallest ``"auto"`` capacity, 1/64 of the batch: 64 rows at 4096 tokens.
FOLD_ROWS = 64
#: Reductions of the L1 penalty (twell.reference.l1_loss).
REDUCTIONS = ("mean", "per_token")
#: ``l1_coeff`` may be a CuPy float ``[1]`` device array: the kernels read it, so a
#: training step never reads it on the host (twell.autograd uses this).
DEVICE_L1_COEFF = True

#: Model widths of the step sources' example configurations (the compile test builds them).
_WIDTHS = tuple(
    {"KDIM": k, "GATED": g} for k in (8, 264, 2048, 4096) for g in (0, 1)
) + ({"KDIM": 136, "GATED": 1},)  # fmt: skip

# The step sources. A launch gives every parameter of the call (KDIM, TILE, SLOTS, GATED);
# each source is built with the ones it declares.
LIGHT = declare(
    Source(
        "backward_light.cu",
        parameters=("KDIM", "TILE", "SLOTS", "GATED"),
        constants={"LIST_CAPACITY": LIST_CAPACITY, "BW_LIGHT_MIN_BLOCKS": LIGHT_MIN_BLOCKS},
        examples=tuple(
            {"KDIM": k, "TILE": 256, "SLOTS": s, "GATED": g}
            for k in (8, 264, 2048, 4096) for s in (32, 64) for g in (0, 1)
        ) + ({"KDIM": 136, "TILE": 32, "SLOTS": 2, "GATED": 1},),
    )
)  # fmt: skip
LISTS = declare(
    Source(
        "backward_lists.cu",
        parameters=("TILE", "SLOTS"),
        constants={"BW_CHUNK_ROWS": CHUNK_ROWS, "BW_UNIT_WARPS": UNIT_WARPS},
        examples=({"TILE": 256, "SLOTS": 32}, {"TILE": 256, "SLOTS": 64},
                  {"TILE": 32, "SLOTS": 2}),
    )
)  # fmt: skip
GRADS = declare(
    Source(
        "backward_grads.cu",
        parameters=("KDIM", "GATED"),
        constants={"BW_GRAD_BATCH": GRAD_BATCH},
        examples=_WIDTHS,
    )
)
HEAVY = declare(
    Source(
        "backward_heavy.cu",
        parameters=("KDIM", "GATED"),
        examples=_WIDTHS,
        headers=("tensor_core.cuh",),
    )
)
TRANSPOSE = declare(Source("backward_transpose.cu"))
#: The source of each kernel of the backward.
_SOURCE_OF = {
    kernel: source
    for source, kernels in (
        (LIGHT, ("twell_bw_light", "twell_bw_light_saved", "twell_bw_light_dx",
                 "twell_bw_any_nonfinite")),
        (LISTS, ("twell_bw_unit_count", "twell_bw_unit_chunks", "twell_bw_unit_starts",
                 "twell_bw_unit_scatter")),
        (GRADS, ("twell_bw_weight_grads", "twell_bw_weight_grads_sliced",
                 "twell_bw_weight_grads_finish", "twell_bw_round_grads")),
        (HEAVY, ("twell_bw_heavy_chunks", "twell_bw_capacity_units", "twell_bw_capacity_dx")),
        (TRANSPOSE, ("twell_bw_transpose_f32",)),
    )
    for kernel in kernels
}  # fmt: skip

_NULL = np.uint64(0)


def _pointer(array: Any | None) -> Any:
    """A kernel argument: bf16 as uint16, int32 as it is, None as a null pointer."""
    if array is None:
        return _NULL
    return array if array.dtype == np.int32 else u16(array)


@dataclass
class UnitLists:
    """The transposed (units × tokens) view of the light pairs of a TwELL buffer.

    A *pair* is an active (token ``t``, unit ``n``) of a light row. Its index is
    ``p = t * row_cap + r``, ``r`` the entry's rank in its row in TwELL order (tiles
    ascending, slots ascending): ``r = tile_off[t, j] + slot - 1``, where ``tile_off``
    (int32 ``[M, N/tile]``) is the exclusive prefix of the row's tile counts. Arrays of
    per-pair values have ``M * row_cap`` entries and are indexed by ``p``.

    The pairs of unit ``n`` are ``tokens[s:e]`` / ``pairs[s:e]`` with
    ``s, e = unit_start[n], unit_start[n + 1]``, in ascending token order. Built on the
    device, without atomics on values and without host synchronisation: capacities come
    from ``M`` and ``row_cap`` alone (a light row has at most ``row_cap`` entries; the
    builder's caller routes longer rows to the dense path).

    Attributes:
        unit_start: int32 ``[N + 1]``; ``unit_start[N]`` is the number of pairs.
        tokens: int32 ``[capacity]``, the token of each listed pair.
        pairs: int32 ``[capacity]``, the pair index of each listed pair.
        seg_start: int32 ``[N + 1]``: exclusive prefix of the extra segments of each
            unit (``max(0, ceil(count / seg) - 1)``), for kernels that split long lists.
        row_cap, capacity, seg, extra_cap: the bounds (``capacity = M * row_cap``,
            ``extra_cap = capacity // seg`` bounds ``seg_start[N]``).
        counts: int32 ``[ceil(M / CHUNK_ROWS), N]`` scratch (per-chunk offsets).
    """

    unit_start: Any
    tokens: Any
    pairs: Any
    seg_start: Any
    row_cap: int
    capacity: int
    seg: int
    extra_cap: int
    counts: Any


def grad_threads(k: int) -> int:
    """Threads of a weight-gradient block for width ``k`` (backward_grads.cu's
    GRAD_THREADS)."""
    chunks = k // 8
    return 256 if chunks >= 256 else 32 * math.ceil(chunks / 32)


def grad_slices(m: int, k: int) -> int:
    """K slices of the weight-gradient kernel for ``m`` tokens of width ``k``: the fewest
    (a power of two; a slice is a whole number of warps' 16-byte chunks, at most 256) whose
    slice of ``x`` and ``dy`` fits :data:`GRAD_SLICE_BYTES`, else the most the width allows."""
    chunks = k // 8
    whole = [s for s in (2, 4, 8, 16) if chunks % s == 0 and (chunks // s) % 32 == 0]
    options = [1] + [s for s in whole if chunks // s <= 256]
    for s in options:
        if 2 * m * k * 2 // s <= GRAD_SLICE_BYTES:
            return s
    return options[-1]


def grad_rows(m: int, k: int, slices: int) -> int:
    """Tokens per launch of the weight-gradient kernel (all ``m`` when a slice of all of
    them fits :data:`GRAD_SLICE_BYTES`, else ranges of equal length that do)."""
    most = max(1, GRAD_SLICE_BYTES * slices // (4 * k))
    return m if m <= most else math.ceil(m / math.ceil(m / most))


def segment_length(capacity: int, n: int) -> int:
    """Pairs per unit-list segment: a power of two >= MIN_SEGMENT, so that the extra
    segments (at most ``capacity // seg``) need a workspace of at most ``N / 2`` rows."""
    seg = MIN_SEGMENT
    while capacity // seg > max(1, n // 2):
        seg *= 2
    return seg


def heavy_chunk_rows(m: int) -> int:
    """Heavy rows handled per chunk of step 4 (a multiple of 64)."""
    rows = min(m, max(HEAVY_CHUNK_MIN, min(HEAVY_CHUNK_MAX, math.ceil(m / HEAVY_CHUNKS))))
    return 64 * max(1, math.ceil(rows / 64))


def _launch(function: str, grid: tuple[int, ...], block: tuple[int, ...], args: tuple,
            params: dict[str, int]) -> None:  # fmt: skip
    """Launch the backward's kernel ``function``, built by its step's source with that
    source's share of ``params`` (the call's KDIM, TILE, SLOTS, GATED)."""
    source = _SOURCE_OF[function]
    source.kernel(function, **{p: params[p] for p in source.parameters})(grid, block, args)


def _multiprocessors() -> int:
    return device_info().multiprocessors


def build_unit_lists(
    packed: Any, light: Any, tile_off: Any, n: int, row_cap: int, params: dict[str, int]
) -> UnitLists:
    """The :class:`UnitLists` of the rows of ``packed`` with ``light[t] == 0`` (uint8
    ``[M]``; those rows are trusted: counts <= slots - 1, at most ``row_cap`` entries,
    columns inside their tiles), given their ``tile_off``. ``params`` are the call's
    compile-time parameters (``KDIM``, ``TILE``, ``SLOTS``, ``GATED``)."""
    m = packed.shape[0]
    tiles = n // params["TILE"]
    capacity = m * row_cap
    chunks = math.ceil(m / CHUNK_ROWS)
    counts = alloc((chunks, n), np.int32)
    totals = alloc((n,), np.int32)
    unit_start = alloc((n + 1,), np.int32)
    seg_start = alloc((n + 1,), np.int32)
    tokens = alloc((max(1, capacity),), np.int32)
    pairs = alloc((max(1, capacity),), np.int32)
    seg = segment_length(capacity, n)
    i32 = np.int32
    _launch("twell_bw_unit_count", (chunks, tiles), (UNIT_WARPS * 32,),
            (packed, light, i32(m), i32(n), counts), params)  # fmt: skip
    _launch("twell_bw_unit_chunks", (math.ceil(n / 256),), (256,),
            (counts, i32(chunks), i32(n), totals), params)  # fmt: skip
    _launch("twell_bw_unit_starts", (1,), (1024,),
            (totals, i32(n), i32(seg), unit_start, seg_start), params)  # fmt: skip
    _launch("twell_bw_unit_scatter", (chunks, tiles), (UNIT_WARPS * 32,),
            (packed, light, tile_off, i32(m), i32(n), i32(row_cap), counts, unit_start,
             tokens, pairs), params)  # fmt: skip
    return UnitLists(unit_start, tokens, pairs, seg_start, row_cap, capacity, seg,
                     capacity // seg, counts)  # fmt: skip


def ffn_backward(
    block: Any,
    x: Any,
    dy: Any,
    saved: Activations,
    *,
    l1_coeff: float = 0.0,
    reduction: str = "mean",
    grad_dtype: Any = np.float32,
    out: tuple[Any, Any | None, Any, Any] | None = None,
) -> tuple[Any, Any | None, Any, Any]:
    """Gradients of ``<dy, y> + l1_coeff · l1_loss(h, reduction)`` for the block's forward
    ``y, saved = block.forward(x, save=True)``.

    Args:
        block: the ``PreparedBlock`` that ran the forward pass.
        x: ``[M, K]`` CuPy array, the forward's input. dy: ``[M, K]``, the upstream
            gradient (both rounded to bf16 if they are not).
        saved: the forward's :class:`Activations`.
        l1_coeff: weight of the L1 penalty on ``h``: a finite number, or a one-element
            float CuPy array that the kernels read on the device (:data:`DEVICE_L1_COEFF`);
            reduction: ``"mean"`` (divides by M·N) or ``"per_token"`` (divides by M), as
            :func:`twell.reference.l1_loss`.
        grad_dtype: the weight gradients' dtype, float32 or bf16 (accumulated in fp32
            either way, rounded once at the end; bf16 halves their memory, as torch
            keeps bf16 weights' gradients).
        out: where to write the results instead of new arrays (bf16 ``x`` and
            ``grad_dtype`` only): ``(dx, dw_gate, dw_up, dw_down)``, C-contiguous bf16 of
            the shapes returned (``dw_gate`` None for the non-gated block). Every element
            is written. The training op graphs hand their results over this way, in
            memory no other graph's scratch can share.

    Returns:
        ``(dx, dw_gate, dw_up, dw_down)``: ``dx`` ``[M, K]`` in ``x``'s dtype; the weight
        gradients in ``grad_dtype`` with the ``torch.nn.Linear`` layouts ``[N, K]``,
        ``[N, K]``, ``[K, N]``; ``dw_gate`` is None for the non-gated block.

    Memory: besides the outputs and the fp32 accumulators of the weight gradients, the
    scratch of each step is released before the next one (the pair values and unit lists
    before the chunks; the capacity rows' buffers, beside step 1's pair values, before
    step 2, or with up to :data:`FOLD_ROWS` rows after step 3), so the peak is the
    largest step's, not their sum. bf16 gradients have their bf16 ``dW_gate``,
    ``dW_up`` allocated before step 3 (which may write them). The capacity rows take
    ``C = capacity_rows(M)`` rows of ``x`` and ``dy`` (bf16), ``2`` or ``3`` of ``[C, N]``
    (bf16) and one ``[C, K]`` fp32 for their ``dx``.
    """
    check_reduction(reduction, REDUCTIONS)
    grad_dtype = np.dtype(grad_dtype)
    if grad_dtype not in (np.dtype(np.float32), np.dtype(bfloat16)):
        raise TypeError(f"grad_dtype: expected float32 or bfloat16, got {grad_dtype}")
    coeff = _l1_coefficient(l1_coeff)
    if out is not None:
        _check_out(out, x, grad_dtype, x.shape[0], block.n, block.k, block.gated)
    xb, dyb = as_bf16(x), as_bf16(dy)
    n, k, gated = block.n, block.k, block.gated
    if xb.ndim != 2 or xb.shape[1] != k:
        raise ValueError(f"x: expected shape (M, {k}), got {tuple(xb.shape)}")
    if dyb.shape != xb.shape:
        raise ValueError(f"dy: expected shape {tuple(xb.shape)} (x's), got {tuple(dyb.shape)}")
    m = xb.shape[0]
    tile, slots = block.options.tile, block.options.slots
    tiles = n // tile
    nv = 3 if gated else 2
    params = {"KDIM": k, "TILE": tile, "SLOTS": slots, "GATED": int(gated)}
    # Weight gradients, [N, K] each: (dw_gate, dw_up, dw_down_t) or (dw_up, dw_down_t).
    dws = [alloc((n, k), np.float32) for _ in range(nv)]
    dx = empty_bf16((m, k)) if out is None else out[0]
    if m == 0:
        if out is not None:
            for array in out[1:]:
                if array is not None:
                    array.fill(0)
            return out
        for array in dws:
            array.fill(0)
        return _result(dx, x, dws, grad_dtype, params, gated)
    if saved.packed is None or tuple(saved.packed.shape) != (m, tiles * slots):
        raise ValueError(
            f"saved.packed: expected a uint32 array of shape {(m, tiles * slots)}, got "
            f"{None if saved.packed is None else tuple(saved.packed.shape)}"
        )
    if tuple(saved.heavy.shape) != (m,):
        raise ValueError(f"saved.heavy: expected shape {(m,)}, got {tuple(saved.heavy.shape)}")

    sms = _multiprocessors()
    i32 = np.int32
    scale = 1.0 / (m * n) if reduction == "mean" else 1.0 / m
    if isinstance(coeff, float):
        l1 = (_NULL, np.float32(coeff * scale))
    else:  # a device scalar: the kernels multiply it by the scale
        l1 = (coeff, np.float32(scale))
    row_cap = row_capacity(block.max_row_nnz, n, tile, slots, m)
    capacity = m * row_cap
    w_gate = _NULL if block.w_gate is None else u16(block.w_gate)
    w_up, w_down_t = u16(block.w_up), u16(block.w_down_t)
    x16, dy16 = u16(xb), u16(dyb)

    up = _saved_up(saved, gated, m, row_cap)

    # 1. Light rows (backward_light.cu): pair values, the backward's heavy rows; then
    # their dx by slices.
    heavy = alloc((m,), np.uint8)
    tile_off = alloc((m, tiles), np.int32)
    stride = max(1, capacity)
    vals = alloc((nv, stride), np.float32)
    units = alloc((stride,), np.int32)
    row_nnz = alloc((m,), np.int32)
    # A non-finite weight: every row takes dense math (which spreads NaN everywhere).
    all_heavy, all_heavy_dev = _weights_flag(block, sms, params)
    _launch("twell_bw_light" if up is None else "twell_bw_light_saved", (m,), (32,),
            (x16, dy16, saved.packed, saved.heavy, i32(all_heavy), all_heavy_dev, w_gate, w_up,
             w_down_t, _NULL if up is None else up, heavy, tile_off, vals, units, row_nnz,
             np.int64(stride), i32(m), i32(n), i32(row_cap), *l1), params)  # fmt: skip
    _launch("twell_bw_light_dx", (math.ceil(math.ceil(k / 256) * m / 8),), (256,),
            (heavy, row_nnz, units, vals, np.int64(stride), i32(m), i32(row_cap), w_gate,
             w_up, u16(dx)), params)  # fmt: skip
    del units, row_nnz
    ids, count = compact_rows(heavy)
    # Through torch (an op called with torch tensors, or a capture) the capacity's fp32
    # GEMMs need torch.mm's out_dtype: without it, every heavy row takes the chunks.
    cap = block.options.capacity_rows(m)
    if cap and not gemm_f32_available():
        cap = 0
    # The capacity rows' dense math before the light weight gradients: few of them, their
    # weight gradients summed by step 3's kernel (folded); more, written first by cuBLAS
    # (beta = 0), and step 3 adds its sums to theirs (`prior`).
    folded, prior = None, False
    if 0 < cap <= FOLD_ROWS:
        ids, count, folded = _capacity_rows(params, block, cap, xb, dyb, ids, count, l1, dx,
                                            dws, fold=True)  # fmt: skip
    elif cap:
        ids, count, _ = _capacity_rows(params, block, cap, xb, dyb, ids, count, l1, dx, dws)
        prior = True

    # 2. Unit lists of the light pairs (backward_lists.cu).
    lists = build_unit_lists(saved.packed, heavy, tile_off, n, row_cap, params)

    # 3. Weight gradients of the light pairs (backward_grads.cu; every row of dws written).
    ws = alloc((max(1, lists.extra_cap) * nv, k), np.float32)
    accum = (*dws, *([_NULL] * (3 - nv)))
    # bf16 gradients: where no heavy row is left for the chunks (`count`, on the device),
    # the kernels round dW_gate and dW_up into their outputs themselves, and the rounding
    # pass of step 5 returns at once.
    final_ok = grad_dtype == bfloat16
    if out is not None:
        rounded = _given(out, gated)
    else:
        rounded = [empty_bf16((n, k)) for _ in range(nv - 1)] if final_ok else []
    final = (*map(_pointer, rounded), *[_NULL] * (2 - len(rounded)), count, i32(1))
    not_final = (_NULL, _NULL, _NULL, i32(0))
    if not final_ok:
        final = not_final
    # One block per possible item (units, then extra segments) and K slice, slice-major:
    # the hardware scheduler balances long and short lists; blocks past the device's item
    # count return at once.
    slices = grad_slices(m, k)
    rows = grad_rows(m, k, slices)
    no_fold = (*[_NULL] * 6, i32(0))
    fold = no_fold if folded is None else (*map(_pointer, folded), i32(cap))
    for t0 in range(0, m, rows):
        last = t0 + rows >= m  # the folded rows go with the last token range
        _launch("twell_bw_weight_grads" if slices == 1 else "twell_bw_weight_grads_sliced",
                (slices * (n + lists.extra_cap),),
                (grad_threads(k) if slices == 1 else k // 8 // slices,),
                (x16, dy16, lists.tokens, lists.pairs, vals, np.int64(stride),
                 lists.unit_start, lists.seg_start, i32(n), i32(lists.seg),
                 i32(lists.extra_cap), i32(slices), i32(t0), i32(min(m, t0 + rows)),
                 i32(t0 > 0), *accum, ws, *(fold if last else no_fold),
                 *(final if last else not_final), i32(prior)), params)  # fmt: skip
    if lists.extra_cap:
        _launch("twell_bw_weight_grads_finish", (min(lists.extra_cap, sms * 8),), (256,),
                (lists.seg_start, i32(n), i32(lists.extra_cap), ws, *accum, *final),
                params)  # fmt: skip

    # 4. The heavy rows past the capacity (backward_heavy.cu; the count stays on the
    # device), chunk by chunk. The light pairs' scratch goes back to the allocator first
    # (stream-ordered: safe to reuse).
    del vals, lists, ws, tile_off, heavy, folded, fold
    if cap < m:
        _heavy_rows(params, sms, m - cap, n, k, x16, dy16, ids, count, block, w_gate,
                    w_up, w_down_t, l1, dx, accum)  # fmt: skip
    del accum

    # 5. dw_down = dw_down_t transposed (backward_transpose.cu; rounded to grad_dtype).
    return _result(dx, x, dws, grad_dtype, params, gated, rounded, count, out)


def _capacity_rows(
    params: dict[str, int], block: Any, cap: int, x: Any, dy: Any, ids: Any, count: Any,
    l1: tuple[Any, Any], dx: Any, dws: list[Any], *, fold: bool = False,
) -> tuple[Any, Any, tuple[Any, ...] | None]:  # fmt: skip
    """Step 4, first part (run before step 2): dense math for the heavy rows
    ``ids[:min(count, cap)]`` through cuBLAS GEMMs of exactly ``cap`` rows (rows past the
    device count are zeros and add nothing). Writes their rows of ``dx``, and their weight
    gradients into ``dws`` (beta = 0: step 3 adds the light pairs' to them), or with
    ``fold`` leaves those to step 3's kernel. Returns
    the ids and device count of the rows left over, and with ``fold`` what step 3 reads:
    the rows' values in the order of ``dws`` ((da, du, h) gated, (da, h, None)
    non-gated; bf16 ``[cap, N]``), their x and dy rows (bf16 ``[cap, K]``) and the count
    of heavy rows (``count``: the first ``min(count, cap)`` rows are these)."""
    n, k = block.n, block.k
    i32 = np.int32
    rest = alloc((1,), np.int32)
    x_c, dy_c = empty_bf16((cap, k)), empty_bf16((cap, k))
    gather_rows(x, ids, count, x_c, rest)
    gather_rows(dy, ids, count, dy_c, rest)
    a_c = gemm_nt(x_c, block.w_first)
    u_c = gemm_nt(x_c, block.w_up) if block.gated else None
    d_c = gemm_nt(dy_c, block.w_down_t)  # dy · w_down
    # In place: a_c -> da, u_c -> du, d_c -> h (bf16, twell_bw_heavy_units' math).
    _launch("twell_bw_capacity_units", (grid_1d(cap * n // 8),), (256,),
            (u16(a_c), _NULL if u_c is None else u16(u_c), u16(d_c), count, i32(cap), i32(n),
             *l1), params)  # fmt: skip
    # dx = da w_gate + du w_up (da w_up non-gated): both products in one fp32 buffer,
    # rounded once by the scatter.
    dx_c = alloc((cap, k), np.float32)
    gemm_f32(a_c, block.w_first, dx_c)
    if u_c is not None:
        gemm_f32(u_c, block.w_up, dx_c, accumulate=True)
    _launch("twell_bw_capacity_dx", (grid_1d(cap * k // 4),), (256,),
            (dx_c, ids, count, i32(cap), u16(dx)), params)  # fmt: skip
    del dx_c
    if fold:
        values = (a_c, u_c, d_c) if u_c is not None else (a_c, d_c, None)
        return ids[cap:], rest, (*values, x_c, dy_c, count)
    # dW = (da, du, h)ᵀ (x, x, dy), or (da, h)ᵀ (x, dy): the fp32 accumulators' first values.
    pairs = ((a_c, x_c), (u_c, x_c), (d_c, dy_c)) if u_c is not None else ((a_c, x_c), (d_c, dy_c))
    for grad, (lhs, rhs) in zip(dws, pairs, strict=True):
        gemm_f32(lhs, rhs, grad, transpose_a=True)
    return ids[cap:], rest, None


def _heavy_rows(
    params: dict[str, int], sms: int, m: int, n: int, k: int, x16: Any, dy16: Any, ids: Any,
    count: Any, block: Any, w_gate: Any, w_up: Any, w_down_t: Any, l1: tuple[Any, Any],
    dx: Any, out: tuple[Any, ...],
) -> None:  # fmt: skip
    """Step 4: dense math for the rows ``ids[:count]`` (``count`` at most ``m``),
    ``heavy_chunk_rows(m)`` at a time, every chunk in one launch
    (``twell_bw_heavy_chunks``: a ticket-ordered queue of work items; with no rows it
    returns at once)."""
    i32 = np.int32
    cap_rows = heavy_chunk_rows(m)
    ld = 2 * n if block.gated else n  # [da | du] or [da]
    dadu = empty_bf16((cap_rows, ld))
    hbuf = empty_bf16((cap_rows, n))
    target = sms * 4
    row_blocks = math.ceil(cap_rows / 64)
    col_blocks = math.ceil(k / 64)
    kblocks = ld // 32
    ws_units = min(target // col_blocks + 1, row_blocks * max(1, kblocks // 4))
    ws = alloc((max(1, ws_units * 64 * k),), np.float32)
    sync = alloc((2,), np.int32)
    sync.fill(0)
    _launch("twell_bw_heavy_chunks", (_heavy_grid(sms),), (128,),
            (x16, dy16, ids, count, i32(m), i32(cap_rows), w_gate, w_up,
             w_down_t, i32(n), *l1, u16(dadu), i32(ld), u16(hbuf), u16(dx), ws,
             i32(target), i32(ws_units), *out, sync), params)  # fmt: skip


def _heavy_grid(sms: int) -> int:
    """Blocks of step 4's launch."""
    return sms * HEAVY_BLOCKS_PER_SM


def _saved_up(saved: Activations, gated: bool, m: int, row_cap: int) -> Any | None:
    """The forward's up products when the backward can read them, else None."""
    if saved.up is None or not gated:
        return None
    up = saved.up
    if tuple(up.shape) != (m, row_cap) or np.dtype(up.dtype) != np.float32:
        raise ValueError(
            f"saved.up: expected a float32 array of shape {(m, row_cap)}, got "
            f"{up.dtype} {tuple(up.shape)}"
        )
    if not up.flags.c_contiguous:
        raise ValueError("saved.up: expected a C-contiguous array")
    return saved.up


def _weights_flag(block: Any, sms: int, params: dict[str, int]) -> tuple[bool, Any]:
    """Whether every row must take dense math because a weight is not finite: the block's
    host-checked ``weights_finite``, or, when that is None (a block built without a host
    synchronisation), a device flag the light kernel reads."""
    finite = getattr(block, "weights_finite", None)
    if finite is not None:
        return not finite, _NULL
    flag = alloc((1,), np.int32)
    flag.fill(0)
    for w in (block.w_gate, block.w_up, block.w_down):
        if w is not None and w.size:
            n8 = w.size // 8
            _launch("twell_bw_any_nonfinite", (max(1, min(math.ceil(n8 / 256), sms * 8)),),
                    (256,), (u16(w), np.int64(n8), flag), params)  # fmt: skip
    return False, flag


def _l1_coefficient(l1_coeff: Any) -> Any:
    """A finite host ``float``, or a float32 ``[1]`` CuPy copy of a one-element device
    array (not read on the host, so not checked: a NaN there gives NaN gradients, as in
    dense math)."""
    if hasattr(l1_coeff, "__cuda_array_interface__"):
        if getattr(l1_coeff, "size", None) != 1 or np.dtype(l1_coeff.dtype).kind != "f":
            raise ValueError(
                f"l1_coeff: expected a number or a one-element float device array, got "
                f"shape {getattr(l1_coeff, 'shape', None)} dtype {l1_coeff.dtype}"
            )
        import cupy

        out = alloc((1,), np.float32)
        out[...] = cupy.asarray(l1_coeff).reshape(1)
        return out
    return check_number("l1_coeff", l1_coeff)


def _check_out(out: tuple, x: Any, grad_dtype: np.dtype, m: int, n: int, k: int,
               gated: bool) -> None:  # fmt: skip
    """``ffn_backward``'s ``out``: bf16, C-contiguous, 16-byte aligned (the kernels store
    8 values at a time), of the results' shapes."""
    if np.dtype(x.dtype) != bfloat16 or grad_dtype != bfloat16:
        raise TypeError("out: the results are written in place only for bf16 x and gradients")
    if len(out) != 4 or (out[1] is None) == gated:
        raise ValueError("out: expected (dx, dw_gate, dw_up, dw_down), dw_gate None exactly "
                         "for the non-gated block")  # fmt: skip
    shapes = ((m, k), (n, k), (n, k), (k, n))
    for name, array, shape in zip(("dx", "dw_gate", "dw_up", "dw_down"), out, shapes,
                                  strict=True):  # fmt: skip
        if array is not None:
            check_out(f"out: {name}", array, shape)


def _given(out: tuple, gated: bool) -> list[Any]:
    """The bf16 outputs of dW_gate and dW_up in ``out`` (dW_up only, non-gated)."""
    return [out[1], out[2]] if gated else [out[2]]


def _result(
    dx: Any, x: Any, dws: list[Any], grad_dtype: np.dtype, params: dict[str, int], gated: bool,
    rounded: list[Any] | None = None, left: Any = None, out: tuple | None = None,
) -> tuple:  # fmt: skip
    """Step 5 and the outputs: ``dw_down`` from the ``[N, K]`` accumulator ``dws[-1]``,
    the other accumulators rounded to ``grad_dtype`` one at a time (each fp32 array is
    dropped as soon as its rounded copy exists), or, given ``rounded`` (their bf16
    outputs), rounded into those only where step 3 did not (``left``: the device count of
    heavy rows the chunks took; none: step 3 wrote them)."""
    n, k = dws[-1].shape
    dw_down = alloc((k, n), grad_dtype) if out is None else out[3]
    _launch("twell_bw_transpose_f32", (math.ceil(k / 32), math.ceil(n / 32)), (32, 8),
            (dws.pop(), dw_down, np.int32(n), np.int32(k), np.int32(grad_dtype == bfloat16)),
            params)  # fmt: skip
    if rounded:
        for f32, target in zip(dws, rounded, strict=True):
            n8 = f32.size // 8
            _launch("twell_bw_round_grads", (grid_1d(n8),), (256,),
                    (f32, u16(target), np.int64(n8), left, np.int32(1)), params)  # fmt: skip
        dws = list(rounded)
    elif grad_dtype == bfloat16:
        dws = [as_bf16(dws.pop(0)) for _ in range(len(dws))]
    dx_out = from_bf16(dx, x.dtype)
    if gated:
        return dx_out, dws[0], dws[1], dw_down
    return dx_out, None, dws[0], dw_down
