"""GPU launchers of the FFN ops: gate, down, gated_down, ffn, and the prepared SparseFFN.

Inputs are CuPy arrays on the current device, 2-D and C-contiguous (``twell.ops``
validates them). Every launch goes to CuPy's current stream (``twell.ops`` sets it to
torch's stream for torch callers). Computation is bf16 with fp32 accumulation; other
float dtypes are converted to bf16 on entry and the output is returned in ``x``'s dtype.

Pipeline of :func:`ffn` / :meth:`SparseFFN.forward` (no host synchronisation, so
``SparseFFN.forward`` can be captured in a CUDA graph), default ``path="fused"``:

1. ``pre = x @ w_gate.T`` — cuBLAS bf16 GEMM (fp32 accumulation) into a bf16 buffer
   (``w_up`` instead for the non-gated block); :func:`gemm_nt`.
2. ``twell_fused_rows`` (sparse_rows.cu; ``twell_fused_rows_wide`` for M <= 1024) — per
   token: relu and the heavy decision from ``pre`` (tile over slots-1, non-finite, or
   more than ``max_row_nnz`` active units), then the light rows' gathered up/down.
3. ``twell_compact_rows`` — heavy row ids in ascending order and their count, on the
   device (a prefix sum: deterministic).
4. ``twell_dense_rows_tiled`` (+ ``twell_dense_rows_reduce`` when the reduction is
   split) — heavy rows: tensor-core dense math, grid sized for the worst case, reading
   the count on the device (dense_rows.cu).

``path="epilogue"``: step 1 is gate_gemm.cu (wgmma, relu and TwELL packing in the GEMM's
epilogue: :func:`gate_pack`), step 2 ``twell_twell_rows`` reading that TwELL, and the
heavy rows' pre-activations are recomputed by dense_rows.cu before step 4.
``path="pack"``: cuBLAS, pack.cu, then ``twell_twell_rows``. Version 1's sparse_ffn.cu
stays as the simple baseline (:func:`sparse_rows`).

:func:`gate` packs with gate_gemm.cu (or cuBLAS + pack.cu); :func:`gated_down` and
:func:`down` read TwELL with ``twell_twell_rows`` and the dense part with dense_rows.cu.

Same inputs give the same output bits: no step uses atomics.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import ml_dtypes
import numpy as np

from twell.kernels.compile import device_info, kernel

BF16 = np.dtype(ml_dtypes.bfloat16)

#: Largest model width K the sparse kernel supports (x row and y accumulators in registers
#: or shared memory of one warp).
MAX_K = 4096

_CUDA_R_16BF = 14
_CUBLAS_COMPUTE_32F = 68
_CUBLAS_GEMM_DEFAULT = -1
_CUBLAS_OP_N = 0
_CUBLAS_OP_T = 1

_PACK_WARPS = 8  # must match pack.cu
_SPARSE_WARPS = 4  # must match sparse_ffn.cu
_ROW_WARPS = 1  # must match sparse_rows.cu
#: Up to this many tokens, the fused kernel gives each token 8 warps (decode-sized M).
WIDE_ROWS_BELOW = 1024
#: The pipelines of :class:`SparseFFN` (``path=``).
PATHS = ("fused", "epilogue", "pack")


def _cupy() -> Any:
    import cupy

    return cupy


# ---------------------------------------------------------------------- array helpers
def _alloc(shape: tuple[int, ...], dtype: Any) -> Any:
    """Every output and scratch buffer of the launchers comes from here (uninitialised;
    the GPU tests replace this function by one that fills buffers with 0xFF)."""
    return _cupy().empty(shape, dtype=dtype)


def _empty_bf16(shape: tuple[int, ...]) -> Any:
    return _alloc(shape, np.uint16).view(BF16)


def _u16(array: Any) -> Any:
    """The bf16 array's bits as uint16 (a view, no copy)."""
    return array.view(_cupy().uint16)


_TO_BF16 = {
    np.dtype(np.float32): "twell_f32_to_bf16",
    np.dtype(np.float64): "twell_f64_to_bf16",
    np.dtype(np.float16): "twell_f16_to_bf16",
}
_FROM_BF16 = {
    np.dtype(np.float32): "twell_bf16_to_f32",
    np.dtype(np.float64): "twell_bf16_to_f64",
    np.dtype(np.float16): "twell_bf16_to_f16",
}


def _grid_1d(n: int, block: int = 256) -> int:
    return max(1, min(math.ceil(n / block), device_info().multiprocessors * 32))


def as_bf16(array: Any) -> Any:
    """``array`` as a C-contiguous, 16-byte aligned bf16 CuPy array (copy only if needed).

    Other float dtypes are rounded to bf16 (nearest even).
    """
    cp = _cupy()
    dtype = np.dtype(array.dtype)
    if dtype == BF16:
        if array.flags.c_contiguous and array.data.ptr % 16 == 0:
            return array
        out = _empty_bf16(array.shape)
        _u16(out)[...] = _u16(array)
        return out
    if dtype not in _TO_BF16:
        raise TypeError(f"expected a floating array (bf16/fp16/fp32/fp64), got {dtype}")
    source = cp.ascontiguousarray(array)
    out = _empty_bf16(array.shape)
    n = source.size
    if n:
        kernel("convert.cu", _TO_BF16[dtype])(
            (_grid_1d(n),), (256,), (source, _u16(out), np.int64(n))
        )
    return out


def from_bf16(array: Any, dtype: Any) -> Any:
    """A bf16 CuPy array converted to ``dtype`` (returned as is when it is bf16)."""
    dtype = np.dtype(dtype)
    if dtype == BF16:
        return array
    if dtype not in _FROM_BF16:
        raise TypeError(f"cannot return results as {dtype}")
    out = _alloc(array.shape, dtype)
    n = array.size
    if n:
        kernel("convert.cu", _FROM_BF16[dtype])(
            (_grid_1d(n),), (256,), (_u16(array), out, np.int64(n))
        )
    return out


def transpose(matrix: Any) -> Any:
    """A bf16 ``[R, C]`` matrix transposed into a new C-contiguous ``[C, R]`` array."""
    rows, cols = matrix.shape
    out = _empty_bf16((cols, rows))
    if matrix.size:
        grid = (math.ceil(cols / 32), math.ceil(rows / 32))
        kernel("convert.cu", "twell_transpose_u16")(
            grid, (32, 8), (_u16(matrix), _u16(out), np.int32(rows), np.int32(cols))
        )
    return out


# ---------------------------------------------------------------------- launchers
def gemm_nt(x: Any, w: Any, out: Any | None = None, *, via: str | None = None) -> Any:
    """``out[M, N] = x[M, K] @ w[N, K].T`` in bf16 with fp32 accumulation (cuBLAS).

    Runs through CuPy's ``gemmEx``, except while the current stream is being captured
    into a CUDA graph (CuPy refuses cuBLAS during capture): then through torch, which
    must be imported already (``via="torch"`` forces that path, for comparisons). Either
    way on CuPy's current stream. The two paths may pick different cuBLAS kernels, so a
    captured graph's bits can differ from eager ones (each is deterministic).
    """
    cp = _cupy()
    m, k = x.shape
    n = w.shape[0]
    if out is None:
        out = _empty_bf16((m, n))
    if m == 0 or n == 0:
        return out
    if k == 0:
        _u16(out)[...] = 0
        return out
    stream = cp.cuda.get_current_stream()
    capturing = stream.is_capturing()
    torch = sys.modules.get("torch")
    if via == "torch" or (capturing and torch is not None):
        device = torch.device("cuda", x.device.id)
        torch_stream = (
            torch.cuda.ExternalStream(stream.ptr, device=device)
            if stream.ptr
            else torch.cuda.default_stream(device)
        )
        with torch.cuda.stream(torch_stream):
            xt, wt, ot = (torch.from_dlpack(a) for a in (x, w, out))
            torch.mm(xt, wt.t(), out=ot)
        return out
    if capturing:
        raise RuntimeError(
            "twell's gate GEMM cannot be captured in a CUDA graph through CuPy (CuPy "
            "refuses cuBLAS during stream capture); import torch first to capture it"
        )
    from cupy_backends.cuda.libs import cublas

    handle = cp.cuda.device.get_cublas_handle()
    one = np.ones(1, np.float32)
    zero = np.zeros(1, np.float32)
    mode = cublas.getPointerMode(handle)
    cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
    try:
        # Column-major view: out^T [N, M] = w [N, K] (op T of a K x N matrix) @ x^T [K, M].
        cublas.gemmEx(
            handle, _CUBLAS_OP_T, _CUBLAS_OP_N, n, m, k,
            one.ctypes.data, w.data.ptr, _CUDA_R_16BF, k,
            x.data.ptr, _CUDA_R_16BF, k,
            zero.ctypes.data, out.data.ptr, _CUDA_R_16BF, n,
            _CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT,
        )  # fmt: skip
    finally:
        cublas.setPointerMode(handle, mode)
    return out


def pack(pre: Any, tile: int, slots: int) -> tuple[Any, Any]:
    """relu + TwELL packing of a bf16 pre-activation ``[M, N]``.

    Returns:
        ``(packed uint32 [M, N/tile*slots], heavy uint8 [M])``.
    """
    cp = _cupy()
    m, n = pre.shape
    packed = _alloc((m, n // tile * slots), cp.uint32)
    heavy = _alloc((m,), cp.uint8)
    if m:
        kernel("pack.cu", "twell_pack_rows", {"TILE": tile, "SLOTS": slots})(
            (math.ceil(m / _PACK_WARPS),), (_PACK_WARPS * 32,),
            (_u16(pre), packed, heavy, np.int32(m), np.int32(n)),
        )  # fmt: skip
    return packed, heavy


def gate_pack(x: Any, w: Any, tile: int, slots: int) -> tuple[Any, Any]:
    """``relu(x @ w.T)`` straight into TwELL by gate_gemm.cu (packing in the GEMM's
    epilogue; the pre-activation never reaches global memory).

    Returns:
        ``(packed uint32 [M, N/tile*slots], heavy uint8 [M])`` as :func:`pack` does.
    """
    from twell.kernels import gate_gemm

    cp = _cupy()
    m, n = x.shape[0], w.shape[0]
    packed = _alloc((m, n // tile * slots), cp.uint32)
    heavy = _alloc((m,), cp.uint8)
    heavy.fill(0)
    gate_gemm.launch(x, w, tile=tile, slots=slots, packed=packed, heavy=heavy)
    return packed, heavy


def compact_rows(heavy: Any) -> tuple[Any, Any]:
    """Ascending ids of the rows with ``heavy != 0`` (``ids[:count]``) and the count,
    both on the device."""
    cp = _cupy()
    m = heavy.shape[0]
    ids = _alloc((max(m, 1),), cp.int32)
    count = _alloc((1,), cp.int32)
    if m:
        kernel("pack.cu", "twell_compact_rows", {"TILE": 256, "SLOTS": 32})(
            (1,), (1024,), (heavy, np.int32(m), ids, count)
        )
    else:
        count[...] = 0
    return ids, count


def mark_rows(rows: Any, m: int) -> Any:
    """uint8 ``[m]`` flags, 1 at ``rows`` (an int32 device vector)."""
    cp = _cupy()
    heavy = cp.zeros((m,), dtype=cp.uint8)
    r = rows.shape[0]
    if r:
        kernel("pack.cu", "twell_mark_rows", {"TILE": 256, "SLOTS": 32})(
            (math.ceil(r / 256),), (256,), (rows, np.int32(r), heavy)
        )
    return heavy


def sparse_rows(
    x: Any | None,
    packed: Any,
    heavy: Any,
    w_up: Any | None,
    w_down_t: Any,
    y: Any,
    *,
    tile: int,
    slots: int,
    min_blocks: int | None = None,
) -> None:
    """Light rows of ``y`` by version 1 (sparse_ffn.cu: one unit at a time, no list);
    gated if ``w_up`` is given, else ``y = h @ w_down``. Kept as the simple baseline."""
    _launch_rows(
        "sparse_ffn.cu", "twell_sparse_rows", _SPARSE_WARPS, x, packed, heavy, w_up, w_down_t,
        y, tile=tile, slots=slots, min_blocks=min_blocks,
    )  # fmt: skip


def _launch_rows(
    source: str,
    function: str,
    warps_per_token_block: int,
    x: Any | None,
    hidden: Any,
    heavy: Any,
    w_up: Any | None,
    w_down_t: Any,
    y: Any,
    *,
    tile: int,
    slots: int,
    min_blocks: int | None = None,
    units: int | None = None,
    extra: tuple = (),
    wide: bool = False,
) -> None:
    """Launch one of the light-row kernels, which share their arguments:
    ``(x, hidden, heavy, w_up, w_down_t, y, M, N, *extra)`` with ``x``/``w_up`` null for the
    non-gated block; one block of ``warps_per_token_block`` warps per that many tokens, or
    (``wide``) one 8-warp block per token."""
    m, k = y.shape
    n = w_down_t.shape[0]
    if m == 0:
        return
    gated = w_up is not None
    params = {"KDIM": k, "TILE": tile, "SLOTS": slots, "GATED": int(gated)}
    if min_blocks is not None:
        params["MIN_BLOCKS"] = min_blocks
    if units is not None:
        params["UNITS"] = units
    null = np.uint64(0)
    if wide:
        grid, block = (m,), (256,)
    else:
        grid, block = (math.ceil(m / warps_per_token_block),), (warps_per_token_block * 32,)
    kernel(source, function, params)(
        grid, block,
        (
            _u16(x) if gated else null, hidden, heavy,
            _u16(w_up) if gated else null, _u16(w_down_t), _u16(y),
            np.int32(m), np.int32(n), *extra,
        ),
    )  # fmt: skip


def fused_rows(
    x: Any | None,
    pre: Any,
    heavy: Any,
    w_up: Any | None,
    w_down_t: Any,
    y: Any,
    *,
    tile: int,
    slots: int,
    max_row_nnz: int = 1024,
    min_blocks: int | None = None,
    units: int | None = None,
) -> None:
    """Light rows of ``y`` straight from the bf16 pre-activation ``pre [M, N]``; writes
    ``heavy[m]`` (1: row left to the dense path) for every row. Gated if ``w_up`` given.
    Rows with more than ``max_row_nnz`` active units are routed to the dense path."""
    # Few tokens (decode): a block of 8 warps per token splits its units, else one warp.
    wide = y.shape[0] <= WIDE_ROWS_BELOW
    _launch_rows(
        "sparse_rows.cu", "twell_fused_rows_wide" if wide else "twell_fused_rows", _ROW_WARPS,
        x, _u16(pre), heavy, w_up, w_down_t, y, tile=tile, slots=slots,
        min_blocks=min_blocks, units=units, extra=(np.int32(max_row_nnz),), wide=wide,
    )  # fmt: skip


def twell_rows(
    x: Any | None,
    packed: Any,
    heavy: Any,
    w_up: Any | None,
    w_down_t: Any,
    y: Any,
    *,
    tile: int,
    slots: int,
    min_blocks: int | None = None,
    units: int | None = None,
    max_row_nnz: int | None = None,
) -> None:
    """Light rows of ``y`` from a TwELL buffer (rows with ``heavy[m] != 0`` skipped). With
    ``max_row_nnz``, rows holding more entries get ``heavy[m] = 1`` instead (dense path)."""
    _launch_rows(
        "sparse_rows.cu", "twell_twell_rows", _ROW_WARPS, x, packed, heavy, w_up, w_down_t, y,
        tile=tile, slots=slots, min_blocks=min_blocks, units=units,
        extra=(np.int32(2**31 - 1 if max_row_nnz is None else max_row_nnz),),
    )  # fmt: skip


def dense_rows(
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
    tiled: bool = True,
) -> Any:
    """``out[orow(i)] = (gate'[grow(i)] *) (a'[arow(i)] @ b.T)`` for ``i < count[0]``.

    ``a`` is ``[*, RED]``, ``b`` ``[OUTC, RED]``, ``out`` and ``gate`` ``[*, OUTC]``, all bf16.
    ``count`` is a device int32 scalar array of at most ``max_rows`` (sizes the grid).
    ``tiled=False`` runs the simple 16-row kernel (no shared memory), kept as a baseline.
    Returns the scratch workspace it used (None if none), for callers that must keep it.
    """
    outc, red = b.shape
    if max_rows == 0 or outc == 0:
        return None
    gate_args = (
        _u16(gate) if gate is not None else np.uint64(0),
        np.int32(gate_by_id), np.int32(relu_gate),
        _u16(out), np.int32(out_by_id),
    )  # fmt: skip
    common = (
        _u16(a), np.int32(a_by_id), np.int32(relu_a),
        _u16(b), np.int32(outc), np.int32(red),
        ids, count,
    )  # fmt: skip
    sms = device_info().multiprocessors
    if not tiled:
        items = math.ceil(max_rows / 16) * math.ceil(outc / 32)
        grid = max(1, min(items, sms * 8))
        kernel("dense_rows.cu", "twell_dense_rows")((grid,), (128,), common + gate_args)
        return None
    # Split the reduction when few rows leave the GPU idle: the kernels pick the split
    # from the device count; the workspace is sized for the largest split they may pick.
    target = sms * 4
    col_blocks = math.ceil(outc / 64)
    kblocks = math.ceil(red / 32)
    ws_units = min(target // col_blocks + 1, math.ceil(max_rows / 64) * max(1, kblocks // 4))
    ws = _alloc((max(1, ws_units * 64 * outc),), np.float32)
    split = (ws, np.int32(target), np.int32(ws_units))
    max_items = math.ceil(max_rows / 64) * col_blocks * max(1, kblocks // 4)
    grid = max(1, min(max_items, target))
    kernel("dense_rows.cu", "twell_dense_rows_tiled")((grid,), (128,), common + gate_args + split)
    if ws_units >= 2 and target // col_blocks >= 2 and kblocks >= 8:  # a split may happen
        reduce_grid = max(1, min(math.ceil(ws_units * 64 * outc / 2 / 256), sms * 8))
        kernel("dense_rows.cu", "twell_dense_rows_reduce")(
            (reduce_grid,), (256,),
            (ws, count, np.int32(outc), np.int32(red), np.int32(target), np.int32(ws_units), ids)
            + gate_args,
        )  # fmt: skip
    return ws


def check_options(*, path: str = "fused", dense_capacity: float = 0.0) -> None:
    """``ValueError`` unless ``path`` is one of :data:`PATHS` and ``dense_capacity`` a
    fraction in [0, 1] (the options of :class:`SparseFFN`, checked before any launch)."""
    if path not in PATHS:
        raise ValueError(f"path: expected one of {PATHS}, got {path!r}")
    if not 0.0 <= float(dense_capacity) <= 1.0:
        raise ValueError(f"dense_capacity: expected a fraction in [0, 1], got {dense_capacity}")


def default_max_row_nnz(n: int) -> int:
    """Active units per token above which ``ffn`` sends the token to the dense path.

    A gathered unit costs two weight rows from L2; a dense row costs ``N`` units' worth
    of tensor-core work. Measured break-even on an H100 (docs/kernel_notes.md) lies near
    3% of N; capped by the kernel's list size (1024).
    """
    return max(16, min(1024, n * 3 // 100))


# ---------------------------------------------------------------------- the ops
def check_width(k: int, name: str = "x") -> None:
    """The kernels load rows in 16-byte pieces and keep a row in one warp's registers:
    K must be a multiple of 8 and at most :data:`MAX_K` (``ValueError`` naming ``name``)."""
    if k % 8 or k > MAX_K:
        raise ValueError(
            f"{name}: the GPU kernels need K to be a multiple of 8 and at most {MAX_K}; "
            f"got K={k} (the NumPy reference takes any K)"
        )


def gate(x: Any, w_gate: Any, *, tile: int = 256, slots: int = 32, path: str = "epilogue") -> Any:
    """``relu(x @ w_gate.T)`` as a CuPy-backed :class:`twell.formats.Hybrid`.

    ``path="epilogue"`` (default): gate_gemm.cu packs TwELL in the GEMM's epilogue and the
    heavy rows' values are recomputed on tensor cores (dense_rows.cu); ``path="pack"``:
    cuBLAS writes the dense pre-activation, pack.cu packs it. Synchronises once (to read
    the number of heavy rows, which sizes ``dense_rows``). The dense part holds bf16
    values (relu applied, NaN kept).
    """
    from twell.formats import Hybrid, TwELL

    if path not in ("epilogue", "pack"):
        raise ValueError(f"path: expected 'epilogue' or 'pack', got {path!r}")
    cp = _cupy()
    xb, wb = as_bf16(x), as_bf16(w_gate)
    m, n = xb.shape[0], wb.shape[0]
    if path == "epilogue":
        packed, heavy = gate_pack(xb, wb, tile, slots)
    else:
        pre = gemm_nt(xb, wb)
        packed, heavy = pack(pre, tile, slots)
    ids, count = compact_rows(heavy)
    r = int(count.get()[0])
    rows = ids[:r].copy()
    dense = _empty_bf16((r, n))
    if r:
        if path == "epilogue":  # the heavy rows' pre-activations, then relu below
            pre = _empty_bf16((r, n))
            dense_rows(xb, wb, pre, rows, count, r, a_by_id=True, out_by_id=False)
            source_rows = cp.arange(r, dtype=cp.int32)
        else:
            source_rows = rows
        kernel("pack.cu", "twell_gather_relu_rows", {"TILE": tile, "SLOTS": slots})(
            (_grid_1d(r * n),), (256,),
            (_u16(pre), source_rows, np.int32(r), np.int32(n), _u16(dense)),
        )  # fmt: skip
    return Hybrid(TwELL(packed, (m, n), tile, slots), rows, dense)


def _hybrid_parts(h: Any) -> tuple[Any, Any, Any, int]:
    """(packed, heavy flags, dense rows as bf16, R) of a CuPy Hybrid."""
    cp = _cupy()
    packed = h.ell.packed
    if not packed.flags.c_contiguous:
        packed = cp.ascontiguousarray(packed)
    rows = h.dense_rows
    if rows.dtype != cp.int32 or not rows.flags.c_contiguous:
        rows = cp.ascontiguousarray(rows, dtype=cp.int32)
    r = int(rows.shape[0])
    heavy = mark_rows(rows, h.shape[0])
    dense = as_bf16(h.dense) if r else None
    return packed, heavy, dense, r


def down(h: Any, w_down: Any) -> Any:
    """``h @ w_down.T`` for a CuPy Hybrid ``h [M, N]``; bf16 ``[M, K]`` out."""
    cp = _cupy()
    wd = as_bf16(w_down)
    m, n = h.shape
    k = wd.shape[0]
    check_width(k)
    packed, heavy, dense, r = _hybrid_parts(h)
    y = _empty_bf16((m, k))
    twell_rows(None, packed, heavy, None, transpose(wd), y, tile=h.tile, slots=h.slots)
    if r:
        count = cp.full((1,), r, dtype=cp.int32)
        rows = cp.ascontiguousarray(h.dense_rows, dtype=cp.int32)
        dense_rows(dense, wd, y, rows, count, r, a_by_id=False, out_by_id=True)
    return y


def gated_down(x: Any, g: Any, w_up: Any, w_down: Any) -> Any:
    """``(g * (x @ w_up.T)) @ w_down.T`` for a CuPy Hybrid ``g``; ``x``'s dtype out."""
    cp = _cupy()
    xb, wu, wd = as_bf16(x), as_bf16(w_up), as_bf16(w_down)
    m, k = xb.shape
    n = wu.shape[0]
    check_width(k)
    packed, heavy, dense, r = _hybrid_parts(g)
    y = _empty_bf16((m, k))
    twell_rows(xb, packed, heavy, wu, transpose(wd), y, tile=g.tile, slots=g.slots)
    if r:
        count = cp.full((1,), r, dtype=cp.int32)
        rows = cp.ascontiguousarray(g.dense_rows, dtype=cp.int32)
        hidden = _empty_bf16((r, n))
        dense_rows(xb, wu, hidden, rows, count, r, a_by_id=True, out_by_id=False,
                   gate=dense, gate_by_id=False)  # fmt: skip
        dense_rows(hidden, wd, y, rows, count, r, a_by_id=False, out_by_id=True)
    return from_bf16(y, x.dtype)


class SparseFFN:
    """A gated (or non-gated) ReLU FFN block prepared for the GPU kernels.

    Holds the weights as bf16 plus ``w_down_t`` (``w_down`` transposed to ``[N, K]``, so
    each unit's down column is contiguous), built once here and never assumed elsewhere.

    Args:
        w_gate: ``[N, K]`` or None (non-gated block ``relu(x @ w_up.T) @ w_down.T``).
        w_up: ``[N, K]``; w_down: ``[K, N]`` (``torch.nn.Linear`` layout), CuPy arrays.
        tile, slots: TwELL geometry of the hidden activation.
        path: ``"fused"`` (default: the sparse kernel reads the pre-activation directly),
            ``"epilogue"`` (gate_gemm.cu packs TwELL in the gate GEMM's epilogue, then
            ``twell_twell_rows`` reads it) or ``"pack"`` (cuBLAS GEMM, pack.cu, then
            ``twell_twell_rows``), for comparisons.
        max_row_nnz: tokens with more active units take the dense path (default
            :func:`default_max_row_nnz`). Any value gives the same result.
        dense_capacity: a fraction f of M: the first ``ceil(f * M)`` heavy rows go through
            cuBLAS GEMMs of that fixed size (gathered, then scattered back), the rest
            through dense_rows.cu. The GEMMs cost the same however many rows are heavy, so
            this pays where many rows are (skewed models), not on sparse ones. Default 0.
    """

    def __init__(
        self,
        w_gate: Any | None,
        w_up: Any,
        w_down: Any,
        tile: int = 256,
        slots: int = 32,
        *,
        path: str = "fused",
        max_row_nnz: int | None = None,
        dense_capacity: float = 0.0,
    ) -> None:
        check_options(path=path, dense_capacity=dense_capacity)
        self.path = path
        self.w_gate = None if w_gate is None else as_bf16(w_gate)
        self.w_up = as_bf16(w_up)
        self.w_down = as_bf16(w_down)
        n, k = self.w_up.shape
        if self.w_down.shape != (k, n):
            raise ValueError(f"w_down: expected shape ({k}, {n}), got {self.w_down.shape}")
        if self.w_gate is not None and self.w_gate.shape != (n, k):
            raise ValueError(f"w_gate: expected shape ({n}, {k}), got {self.w_gate.shape}")
        if n % tile:
            raise ValueError(f"w_up: N={n} is not a multiple of tile={tile}")
        check_width(k)
        self.tile = int(tile)
        self.slots = int(slots)
        if max_row_nnz is None:
            max_row_nnz = default_max_row_nnz(n)
        if not 0 <= int(max_row_nnz) <= 1024:
            raise ValueError(f"max_row_nnz: expected an int in [0, 1024], got {max_row_nnz}")
        self.max_row_nnz = int(max_row_nnz)
        self.dense_capacity = float(dense_capacity)
        self.w_down_t = transpose(self.w_down)
        self._graph_scratch: list[list[Any]] = []  # buffers of captured calls

    def __call__(self, x: Any) -> Any:
        """The block's output for ``x [M, K]`` (``x``'s dtype)."""
        return self.forward(x)

    def forward(self, x: Any) -> Any:
        """The block's output for ``x [M, K]`` (``x``'s dtype); no host synchronisation.

        May be captured in a CUDA graph (torch must be imported: the gate GEMM then runs
        through it). The scratch buffers a captured call uses are kept alive by this
        object for as long as it lives, so replays never write into reused memory.
        """
        stream = _cupy().cuda.get_current_stream()
        scratch: list[Any] = []
        xb = as_bf16(x)
        y = _ffn(xb, self, scratch)
        out = from_bf16(y, x.dtype)
        if stream.is_capturing():
            self._graph_scratch.append([xb, y, *scratch])
        return out


def _ffn(xb: Any, prepared: SparseFFN, scratch: list[Any]) -> Any:
    """The block on bf16 ``xb``; appends its scratch buffers to ``scratch``."""
    m, k = xb.shape
    if k != prepared.w_up.shape[1]:
        raise ValueError(f"x: expected K={prepared.w_up.shape[1]}, got {k}")
    y = _empty_bf16((m, k))
    if m == 0:
        return y
    gated = prepared.w_gate is not None
    w_first = prepared.w_gate if gated else prepared.w_up
    x_up, w_up = (xb, prepared.w_up) if gated else (None, None)
    pre = None  # the dense pre-activation, where the path writes it
    if prepared.path == "fused":
        pre = gemm_nt(xb, w_first)
        heavy = _alloc((m,), np.uint8)
        fused_rows(
            x_up, pre, heavy, w_up, prepared.w_down_t, y, tile=prepared.tile,
            slots=prepared.slots, max_row_nnz=prepared.max_row_nnz,
        )  # fmt: skip
    else:
        if prepared.path == "epilogue":
            packed, heavy = gate_pack(xb, w_first, prepared.tile, prepared.slots)
        else:
            pre = gemm_nt(xb, w_first)
            packed, heavy = pack(pre, prepared.tile, prepared.slots)
        scratch.append(packed)
        twell_rows(
            x_up, packed, heavy, w_up, prepared.w_down_t, y, tile=prepared.tile,
            slots=prepared.slots, max_row_nnz=prepared.max_row_nnz,
        )  # fmt: skip
    ids, count = compact_rows(heavy)
    recompute = pre is None
    if recompute:  # the heavy rows' pre-activations get recomputed into their rows only
        pre = _empty_bf16((m, prepared.w_up.shape[0]))
    scratch.append(pre)
    return _heavy_rows(xb, prepared, pre, recompute, heavy, ids, count, y, scratch)


def _heavy_rows(
    xb: Any,
    prepared: SparseFFN,
    pre: Any,
    recompute: bool,
    heavy: Any,
    ids: Any,
    count: Any,
    y: Any,
    scratch: list[Any],
) -> Any:
    """Dense math for the heavy rows ``ids[:count]``, whose pre-activations are the same
    rows of ``pre`` (with ``recompute``: computed here first, from ``x``, into those rows);
    writes their rows of ``y`` and returns ``y``."""
    m = xb.shape[0]
    gated = prepared.w_gate is not None
    w_first = prepared.w_gate if gated else prepared.w_up
    scratch += [heavy, ids, count]
    capacity = min(m, math.ceil(prepared.dense_capacity * m))
    if capacity:
        ids, count = _heavy_rows_gemm(
            xb, prepared, None if recompute else pre, ids, count, capacity, y, scratch
        )
        if capacity == m:
            return y
    max_rows = m - capacity
    if recompute:
        scratch.append(
            dense_rows(xb, w_first, pre, ids, count, max_rows, a_by_id=True, out_by_id=True)
        )
    if gated:
        # h = relu(pre) * (x @ w_up.T) for heavy rows, written over their own `pre` rows.
        scratch.append(
            dense_rows(xb, prepared.w_up, pre, ids, count, max_rows, a_by_id=True, out_by_id=True,
                       gate=pre, gate_by_id=True, relu_gate=True)
        )  # fmt: skip
        scratch.append(
            dense_rows(pre, prepared.w_down, y, ids, count, max_rows, a_by_id=True, out_by_id=True)
        )
    else:
        scratch.append(
            dense_rows(pre, prepared.w_down, y, ids, count, max_rows, a_by_id=True,
                       out_by_id=True, relu_a=True)
        )  # fmt: skip
    return y


def _heavy_rows_gemm(
    xb: Any,
    prepared: SparseFFN,
    pre: Any,
    ids: Any,
    count: Any,
    capacity: int,
    y: Any,
    scratch: list[Any],
) -> tuple[Any, Any]:
    """The first ``capacity`` heavy rows through cuBLAS GEMMs of ``capacity`` rows: gather
    x and the pre-activation rows (zeros past the count; ``pre=None``: recomputed from the
    gathered x), ``h = relu(g) * (x @ w_up.T)`` (or ``relu(g)``), ``h @ w_down.T``, scatter.
    Returns the ids and device count of the heavy rows left over (for dense_rows.cu)."""
    cp = _cupy()
    m, k = xb.shape
    n = prepared.w_up.shape[0]
    gated = prepared.w_gate is not None
    rest = _alloc((1,), cp.int32)
    grid = (_grid_1d(capacity * max(k, n) // 8),)
    gather = kernel("pack.cu", "twell_gather_rows", {"TILE": 256, "SLOTS": 32})
    x_c = _empty_bf16((capacity, k))
    gather(grid, (256,), (_u16(xb), np.int32(k), ids, count, np.int32(capacity),
                          _u16(x_c), rest))  # fmt: skip
    if pre is None:
        g_c = gemm_nt(x_c, prepared.w_gate if gated else prepared.w_up)
    else:
        g_c = _empty_bf16((capacity, n))
        gather(grid, (256,), (_u16(pre), np.int32(n), ids, count, np.int32(capacity),
                              _u16(g_c), rest))  # fmt: skip
    u_c = gemm_nt(x_c, prepared.w_up) if gated else None
    kernel("pack.cu", "twell_relu_mul", {"TILE": 256, "SLOTS": 32})(  # h = relu(g) (* u)
        (_grid_1d(capacity * n // 2),), (256,),
        (_u16(g_c), np.uint64(0) if u_c is None else _u16(u_c), _u16(g_c),
         np.int64(capacity * n)),
    )  # fmt: skip
    scratch.append(u_c)
    y_c = gemm_nt(g_c, prepared.w_down)
    kernel("pack.cu", "twell_scatter_rows", {"TILE": 256, "SLOTS": 32})(
        (_grid_1d(capacity * k // 8),), (256,),
        (_u16(y_c), np.int32(k), ids, count, np.int32(capacity), _u16(y)),
    )  # fmt: skip
    scratch += [x_c, g_c, y_c, rest]
    return ids[capacity:], rest


def ffn(
    x: Any, w_gate: Any | None, w_up: Any, w_down: Any, *, tile: int = 256, slots: int = 32
) -> Any:
    """The whole FFN block (``w_gate=None``: non-gated); ``x``'s dtype out.

    Prepares ``w_down``'s transpose on every call: hold a :class:`SparseFFN` to pay that
    once. No host synchronisation. Not for CUDA-graph capture (its prepared weights and
    scratch would be freed after the call): capture ``SparseFFN.forward`` instead.
    """
    if _cupy().cuda.get_current_stream().is_capturing():
        raise RuntimeError(
            "ffn: capture SparseFFN(w_gate, w_up, w_down).forward in a CUDA graph, not the "
            "functional ffn (the graph needs buffers that outlive the call)"
        )
    return SparseFFN(w_gate, w_up, w_down, tile, slots).forward(x)
