"""Forward ops of the FFN block in NumPy, through TwELL/Hybrid (docs/ops.md).

Shapes (``torch.nn.Linear`` layout): ``x [..., K]`` (leading dimensions are flattened
into M tokens and restored in the output), ``w_gate``/``w_up`` ``[N, K]``,
``w_down [K, N]``. Every function checks its arguments through the same validation layer
as the public ops (``twell._validation``): bad input raises ``TypeError``/``ValueError``
naming the argument, a user-built format is validated before its first read, M = 0 gives
an empty result, and non-finite weights or inputs give what dense math gives.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from twell._arrays import round_bf16
from twell._validation import check_accumulation, check_inputs, dense_where_needed
from twell.formats import DEFAULT_SLOTS, DEFAULT_TILE, Hybrid

T = TypeVar("T")


def _quiet(function: Callable[..., T]) -> Callable[..., T]:
    """Run ``function`` without NumPy floating-point warnings: the reference computes
    dense math on non-finite values on purpose (``0 · Inf = NaN`` is the contract)."""

    @functools.wraps(function)
    def quiet(*args: Any, **kwargs: Any) -> T:
        with np.errstate(all="ignore"):
            return function(*args, **kwargs)

    return quiet


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
    """``relu(x @ w_gate.T)`` rounded to bf16 and packed into a :class:`Hybrid` ``[M, N]``.

    Every gate value — light or heavy row — is rounded to bfloat16, as the kernels store
    them; the dense part holds those values as float32. A row whose pre-activations are
    not all finite goes to the dense part even where ReLU zeroes them (an Inf in ``x``
    gives ``0 · Inf = NaN`` downstream in dense math; the sparse path would skip it).
    """
    inputs = check_inputs(
        x=x, weights={"w_gate": (w_gate, "NK")}, tile=tile, slots=slots, optional=(),
        empty_ok=True, reference="gate",
    )  # fmt: skip
    a = inputs.arrays
    return _gate(a["x"], a["w_gate"], tile, slots, check_accumulation(dtype))


@_quiet
def _gate(x: np.ndarray, w_gate: Any, tile: int, slots: int, dtype: Any) -> Hybrid:
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
    """``h @ w_down.T`` ``[M, K]``: light rows through the TwELL entries, heavy rows densely.

    A non-finite ``w_down`` sends every row through dense math (which then gives NaN
    where an inactive unit meets an Inf, as dense math does).
    """
    inputs = check_inputs(
        hidden=h, hidden_name="h", weights={"w_down": (w_down, "KN")}, optional=(),
        empty_ok=True, reference="down",
    )  # fmt: skip
    return _down(h, inputs.arrays["w_down"], check_accumulation(dtype))


@_quiet
def _down(h: Hybrid, w_down: Any, dtype: Any) -> np.ndarray:
    h = dense_where_needed(h, weights=(w_down,))
    wd = upcast(w_down, dtype)
    y = np.asarray(_light_csr(h, dtype=dtype) @ wd.T)
    if h.dense_rows.size:
        y[h.dense_rows] = upcast(h.dense, dtype) @ wd.T
    return y


def gated_down(x: Any, g: Hybrid, w_up: Any, w_down: Any, *, dtype: Any = np.float64) -> np.ndarray:
    """``(g * (x @ w_up.T)) @ w_down.T`` ``[..., K]``, ``x · w_up`` formed only where
    ``g != 0``.

    A non-finite weight sends every row through dense math, a non-finite token of ``x``
    its own row: there dense math multiplies the inactive units too.
    """
    inputs = check_inputs(
        x=x, hidden=g, hidden_name="g", weights={"w_up": (w_up, "NK"), "w_down": (w_down, "KN")},
        optional=(), empty_ok=True, reference="gated_down",
    )  # fmt: skip
    a = inputs.arrays
    y = _gated_down(a["x"], g, a["w_up"], a["w_down"], check_accumulation(dtype))
    return y.reshape(*inputs.batch_shape, y.shape[-1])


@_quiet
def _gated_down(x: np.ndarray, g: Hybrid, w_up: Any, w_down: Any, dtype: Any) -> np.ndarray:
    g = dense_where_needed(g, x=x, weights=(w_up, w_down))
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
    """The whole block ``[..., K]``; ``w_gate=None`` gives the non-gated
    ``relu(x @ w_up.T) @ w_down.T``."""
    inputs = check_inputs(
        x=x, weights={"w_gate": (w_gate, "NK"), "w_up": (w_up, "NK"), "w_down": (w_down, "KN")},
        tile=tile, slots=slots, empty_ok=True, reference="ffn",
    )  # fmt: skip
    a, dtype = inputs.arrays, check_accumulation(dtype)
    if w_gate is None:
        y = _down(_gate(a["x"], a["w_up"], tile, slots, dtype), a["w_down"], dtype)
    else:
        g = _gate(a["x"], a["w_gate"], tile, slots, dtype)
        y = _gated_down(a["x"], g, a["w_up"], a["w_down"], dtype)
    return y.reshape(*inputs.batch_shape, y.shape[-1])


def ffn_dense(x: Any, w_gate: Any | None, w_up: Any, w_down: Any) -> np.ndarray:
    """Plain dense float64 math of the block ``[..., K]``, no rounding anywhere: the oracle."""
    inputs = check_inputs(
        x=x, weights={"w_gate": (w_gate, "NK"), "w_up": (w_up, "NK"), "w_down": (w_down, "KN")},
        empty_ok=True, reference="ffn_dense",
    )  # fmt: skip
    a = inputs.arrays
    with np.errstate(all="ignore"):
        xf = upcast(a["x"])
        if w_gate is None:
            y = relu(xf @ upcast(a["w_up"]).T) @ upcast(a["w_down"]).T
        else:
            y = (relu(xf @ upcast(a["w_gate"]).T) * (xf @ upcast(a["w_up"]).T)) @ upcast(
                a["w_down"]
            ).T
    return y.reshape(*inputs.batch_shape, y.shape[-1])
