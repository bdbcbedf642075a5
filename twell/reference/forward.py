"""Forward ops of the FFN block in NumPy, through TwELL/Hybrid (docs/ops.md).

Shapes (``torch.nn.Linear`` layout): ``x [M, K]``, ``w_gate``/``w_up`` ``[N, K]``,
``w_down [K, N]``. Arguments are assumed validated (``twell.ops`` does that); these
functions take 2-D ``x``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from twell._arrays import round_bf16
from twell.formats import DEFAULT_SLOTS, DEFAULT_TILE, Hybrid

#: Elements per operand in one chunk of the row-wise dot products (bounds memory).
_CHUNK_ELEMENTS = 1 << 23


def upcast(array: Any, dtype: Any = np.float64) -> np.ndarray:
    """``array`` as a NumPy array of ``dtype`` (bf16/fp16/fp32 inputs are widened)."""
    return np.asarray(array).astype(dtype, copy=False)


def rowwise_dot(a: np.ndarray, a_rows: np.ndarray, b: np.ndarray, b_rows: np.ndarray) -> Any:
    """``out[i] = a[a_rows[i]] · b[b_rows[i]]``, chunked so memory stays bounded."""
    out = np.empty(a_rows.shape[0], dtype=np.result_type(a, b))
    step = max(1, _CHUNK_ELEMENTS // max(1, a.shape[1]))
    for start in range(0, a_rows.shape[0], step):
        stop = start + step
        out[start:stop] = np.einsum("ik,ik->i", a[a_rows[start:stop]], b[b_rows[start:stop]])
    return out


def relu(values: np.ndarray) -> np.ndarray:
    """``max(values, 0)`` with NaN propagated, as dense math does."""
    return np.where(values > 0, values, np.where(np.isnan(values), values, 0)).astype(
        values.dtype, copy=False
    )


def gate(
    x: Any,
    w_gate: Any,
    *,
    tile: int = DEFAULT_TILE,
    slots: int = DEFAULT_SLOTS,
    dtype: Any = np.float64,
) -> Hybrid:
    """``relu(x @ w_gate.T)`` rounded to bf16 and packed into a :class:`Hybrid`.

    Every gate value — light or heavy row — is rounded to bfloat16, as the kernels store
    them; the dense part holds those values as float32. A row whose pre-activations are
    not all finite goes to the dense part even where ReLU zeroes them (an Inf in ``x``
    gives ``0 · Inf = NaN`` downstream in dense math; the sparse path would skip it).
    """
    pre = upcast(x, dtype) @ upcast(w_gate, dtype).T
    non_finite = ~np.isfinite(pre).all(axis=1)
    return Hybrid.from_dense(round_bf16(relu(pre)), tile, slots, also_dense=non_finite)


def _light_csr(h: Hybrid, values: np.ndarray | None = None, dtype: Any = np.float64) -> Any:
    """The light rows of ``h`` as a SciPy CSR matrix (optionally with other values)."""
    m, n, v = h.ell.entries(h.light_mask())
    data = (v if values is None else values).astype(dtype, copy=False)
    import scipy.sparse  # imported on use: it costs a third of a second

    return scipy.sparse.csr_matrix((data, (m, n)), shape=h.shape)


def down(h: Hybrid, w_down: Any, *, dtype: Any = np.float64) -> np.ndarray:
    """``h @ w_down.T``: light rows through the TwELL entries, heavy rows densely."""
    wd = upcast(w_down, dtype)
    y = np.asarray(_light_csr(h, dtype=dtype) @ wd.T)
    if h.dense_rows.size:
        y[h.dense_rows] = upcast(h.dense, dtype) @ wd.T
    return y


def gated_down(x: Any, g: Hybrid, w_up: Any, w_down: Any, *, dtype: Any = np.float64) -> np.ndarray:
    """``(g * (x @ w_up.T)) @ w_down.T`` with ``x · w_up`` formed only where ``g != 0``."""
    xf, wu, wd = upcast(x, dtype), upcast(w_up, dtype), upcast(w_down, dtype)
    light = g.light_mask()
    m, n, gate_values = g.ell.entries(light)
    hidden = gate_values.astype(dtype) * rowwise_dot(xf, m, wu, n)
    import scipy.sparse

    y = np.asarray(scipy.sparse.csr_matrix((hidden, (m, n)), shape=g.shape) @ wd.T)
    if g.dense_rows.size:
        rows = g.dense_rows
        y[rows] = (upcast(g.dense, dtype) * (xf[rows] @ wu.T)) @ wd.T
    return y


def ffn(
    x: Any,
    w_gate: Any | None,
    w_up: Any,
    w_down: Any,
    *,
    tile: int = DEFAULT_TILE,
    slots: int = DEFAULT_SLOTS,
    dtype: Any = np.float64,
) -> np.ndarray:
    """The whole block; ``w_gate=None`` gives the non-gated ``relu(x @ w_up.T) @ w_down.T``."""
    if w_gate is None:
        return down(gate(x, w_up, tile=tile, slots=slots, dtype=dtype), w_down, dtype=dtype)
    g = gate(x, w_gate, tile=tile, slots=slots, dtype=dtype)
    return gated_down(x, g, w_up, w_down, dtype=dtype)


def ffn_dense(x: Any, w_gate: Any | None, w_up: Any, w_down: Any) -> np.ndarray:
    """Plain dense float64 math of the block, no rounding anywhere: the oracle."""
    xf = upcast(x)
    if w_gate is None:
        return relu(xf @ upcast(w_up).T) @ upcast(w_down).T
    return (relu(xf @ upcast(w_gate).T) * (xf @ upcast(w_up).T)) @ upcast(w_down).T
