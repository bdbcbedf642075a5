"""The format-level GPU ops on CuPy arrays: ``gate``, ``down``, ``gated_down``, ``ffn``.

Inputs are validated by ``twell.ops``. ``gate`` packs with gate_gemm.cu (or cuBLAS and
pack.cu) and synchronises once, to size the Hybrid's dense part; ``down`` and
``gated_down`` read TwELL with the light-row kernel and the dense part with the heavy-row
kernel; ``ffn`` runs a :class:`PreparedBlock` built for the call.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from twell.formats import Hybrid, TwELL
from twell.kernels import gate_gemm, heavy_rows, light_rows
from twell.kernels.buffers import alloc, empty_bf16
from twell.kernels.convert import as_bf16, from_bf16, transpose
from twell.kernels.cublas import gemm_nt
from twell.kernels.pack import pack
from twell.kernels.pipeline import PreparedBlock
from twell.options import GATE_PATHS, Options, check_width


def gate(x: Any, w_gate: Any, options: Options, path: str = "epilogue") -> Hybrid:
    """``relu(x @ w_gate.T)`` as a CuPy-backed :class:`Hybrid` (dense part in bf16, relu
    applied, NaN kept).

    ``path="epilogue"``: gate_gemm.cu packs TwELL in the GEMM's epilogue and the heavy
    rows' values are recomputed on tensor cores; ``"pack"``: cuBLAS writes the dense
    pre-activation and pack.cu packs it.
    """
    import cupy

    if path not in GATE_PATHS:
        raise ValueError(f"path: expected one of {GATE_PATHS}, got {path!r}")
    tile, slots = options.tile, options.slots
    xb, wb = as_bf16(x), as_bf16(w_gate)
    m, n = xb.shape[0], wb.shape[0]
    if path == "epilogue":
        packed, heavy = gate_gemm.gate_pack(xb, wb, tile, slots)
    else:
        pre = gemm_nt(xb, wb)
        packed, heavy = pack(pre, tile, slots)
    ids, count = heavy_rows.compact_rows(heavy)
    r = int(count.get()[0])
    rows = ids[:r].copy()
    dense = empty_bf16((r, n))
    if r:
        if path == "epilogue":  # the heavy rows' pre-activations, then relu below
            pre = empty_bf16((r, n))
            heavy_rows.matmul(xb, wb, pre, rows, count, r, a_by_id=True, out_by_id=False)
            source_rows = cupy.arange(r, dtype=cupy.int32)
        else:
            source_rows = rows
        heavy_rows.gather_relu_rows(pre, source_rows, dense)
    return Hybrid._trusted(TwELL._trusted(packed, (m, n), tile, slots), rows, dense)


def _hybrid_parts(h: Hybrid) -> tuple[Any, Any, Any, Any, Any, int]:
    """(packed, heavy flags, dense rows as bf16, row ids, device count, R) of a Hybrid."""
    import cupy

    packed = cupy.ascontiguousarray(h.ell.packed)
    rows = cupy.ascontiguousarray(h.dense_rows, dtype=cupy.int32)
    r = int(rows.shape[0])
    heavy = heavy_rows.mark_rows(rows, h.shape[0])
    count = alloc((1,), np.int32)
    count.fill(r)
    dense = as_bf16(h.dense) if r else None
    return packed, heavy, dense, rows, count, r


def down(h: Hybrid, w_down: Any) -> Any:
    """``h @ w_down.T`` for a CuPy Hybrid ``h [M, N]``; bf16 ``[M, K]`` out."""
    wd = as_bf16(w_down)
    m, k = h.shape[0], wd.shape[0]
    check_width(k)
    packed, heavy, dense, rows, count, r = _hybrid_parts(h)
    y = empty_bf16((m, k))
    light_rows.from_twell(None, packed, heavy, None, transpose(wd), y, tile=h.tile,
                          slots=h.slots)  # fmt: skip
    if r:
        heavy_rows.matmul(dense, wd, y, rows, count, r, a_by_id=False, out_by_id=True)
    return y


def gated_down(x: Any, g: Hybrid, w_up: Any, w_down: Any) -> Any:
    """``(g * (x @ w_up.T)) @ w_down.T`` for a CuPy Hybrid ``g``; ``x``'s dtype out."""
    xb, wu, wd = as_bf16(x), as_bf16(w_up), as_bf16(w_down)
    m, k = xb.shape
    check_width(k)
    packed, heavy, dense, rows, count, r = _hybrid_parts(g)
    y = empty_bf16((m, k))
    light_rows.from_twell(xb, packed, heavy, wu, transpose(wd), y, tile=g.tile, slots=g.slots)
    if r:
        hidden = empty_bf16((r, wu.shape[0]))
        heavy_rows.matmul(xb, wu, hidden, rows, count, r, a_by_id=True, out_by_id=False,
                          gate=dense, gate_by_id=False)  # fmt: skip
        heavy_rows.matmul(hidden, wd, y, rows, count, r, a_by_id=False, out_by_id=True)
    return from_bf16(y, x.dtype)


def ffn(x: Any, w_gate: Any | None, w_up: Any, w_down: Any, options: Options) -> Any:
    """The whole block (``w_gate=None``: non-gated); ``x``'s dtype out.

    Prepares the weights on every call, including their finiteness check (one host
    synchronisation): hold a :class:`PreparedBlock` (or the public ``twell.SparseFFN``)
    to pay that once. Not for CUDA-graph capture (its prepared weights and scratch are
    freed after the call).
    """
    import cupy

    if cupy.cuda.get_current_stream().is_capturing():
        raise RuntimeError(
            "ffn: capture SparseFFN(w_gate, w_up, w_down).forward in a CUDA graph, not the "
            "functional ffn (the graph needs buffers that outlive the call)"
        )
    return PreparedBlock(w_gate, w_up, w_down, options).forward(x)
