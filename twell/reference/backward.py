"""Backward of the FFN block, the L1 penalty and the L0 statistic, in NumPy/SciPy.

Gated block, with ``a = x Wgᵀ``, ``g = relu(a)``, ``u = x Wuᵀ``, ``h = g ⊙ u``,
``y = h Wdᵀ`` and loss ``L = <dy, y> + l1_coeff · R(h)``:

    dh  = dy Wd + l1_coeff · sign(h) · c       (c = 1/(M·N) for "mean", 1/M for "per_token")
    dWd = dyᵀ h          da = dh ⊙ u ⊙ [a > 0]        du = dh ⊙ g
    dWg = daᵀ x          dWu = duᵀ x                  dx = da Wg + du Wu

Non-gated (``h = relu(a)``, ``a = x Wuᵀ``): ``da = dh ⊙ [a > 0]``, ``dWu = daᵀ x``,
``dx = da Wu``. Everything is exact float64 math (no bf16 rounding); the sparse path
touches only the active units and is used when every input (``x``, the weights, ``dy``)
and the pre-activation are finite; otherwise plain dense math runs, so that a NaN or Inf
reaches the gradients exactly as it does in dense math. Arguments are checked by the
same validation layer as the public ops.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from twell._validation import (
    check_activation,
    check_inputs,
    check_like_output,
    check_number,
    check_reduction,
)
from twell.formats import Hybrid, TwELL
from twell.reference.forward import relu, rowwise_dot, upcast

REDUCTIONS = ("mean", "per_token")


def _l1_scale(reduction: str, rows: int, columns: int) -> float:
    if check_reduction(reduction, REDUCTIONS) == "mean":
        return 1.0 / max(1, rows * columns)
    return 1.0 / max(1, rows)


def l1_loss(h: Any, reduction: str = "mean") -> float:
    """The L1 penalty of activations ``h`` (dense array, :class:`TwELL` or :class:`Hybrid`).

    ``"mean"``: mean of ``|h|`` over all M·N entries. ``"per_token"``: mean over tokens of
    the sum over units (N times larger; the public reference code's convention).
    A TwELL with an overflowed tile does not hold all its entries and raises
    ``ValueError`` (a Hybrid does).
    """
    check_reduction(reduction, REDUCTIONS)
    h = check_activation("h", h, "l1_loss")
    if isinstance(h, (TwELL, Hybrid)):
        rows, columns = h.shape
        try:
            entries = h.to_csr().data
        except ValueError as error:  # a TwELL that overflowed: its entries are not all here
            raise ValueError(f"h: {error}") from None
        with np.errstate(over="ignore"):  # a sum past float64's range is inf, as in dense math
            total = float(np.abs(entries.astype(np.float64)).sum())
    else:
        dense = upcast(h)
        rows, columns = int(np.prod(dense.shape[:-1])), dense.shape[-1]  # tokens × units
        with np.errstate(over="ignore"):
            total = float(np.abs(dense).sum())
    return total * _l1_scale(reduction, rows, columns)


def l0(h: Any) -> float:
    """Mean number of nonzeros per token (row): a metric, not differentiable."""
    h = check_activation("h", h, "l0")
    if isinstance(h, (TwELL, Hybrid)):
        return h.nnz / max(1, h.shape[0])
    dense = np.asarray(h)
    return float(np.count_nonzero(dense)) / max(1, int(np.prod(dense.shape[:-1])))


def ffn_backward(
    x: Any,
    w_gate: Any | None,
    w_up: Any,
    w_down: Any,
    dy: Any,
    l1_coeff: float = 0.0,
    *,
    reduction: str = "mean",
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray, np.ndarray]:
    """Gradients of ``<dy, ffn(x)> + l1_coeff · l1_loss(h, reduction)`` in float64.

    Args:
        x: ``[..., K]`` inputs (leading dimensions are flattened and restored in ``dx``).
        w_gate: ``[N, K]``, or ``None`` for the non-gated block.
        w_up: ``[N, K]``.
        w_down: ``[K, N]``.
        dy: upstream gradient, shaped like the output ``[..., K]``.
        l1_coeff: weight of the L1 penalty on the hidden activation ``h``.
        reduction: ``"mean"`` or ``"per_token"`` (see :func:`l1_loss`).

    Returns:
        ``(dx, dw_gate, dw_up, dw_down)``; ``dw_gate`` is ``None`` for the non-gated block.
    """
    inputs = check_inputs(
        x=x, weights={"w_gate": (w_gate, "NK"), "w_up": (w_up, "NK"), "w_down": (w_down, "KN")},
        empty_ok=True, reference="ffn_backward",
    )  # fmt: skip
    dy = check_like_output("dy", dy, inputs, "ffn_backward")
    l1_coeff = check_number("l1_coeff", l1_coeff)
    check_reduction(reduction, REDUCTIONS)
    args = inputs.arrays
    xf, dyf = upcast(args["x"]), upcast(dy)
    wg = None if w_gate is None else upcast(args["w_gate"])
    wu, wd = upcast(args["w_up"]), upcast(args["w_down"])
    shape = (*inputs.batch_shape, inputs.k)
    if xf.shape[0] == 0:  # no token: no gradient flows into the weights
        zeros = (None if wg is None else np.zeros_like(wg), np.zeros_like(wu), np.zeros_like(wd))
        return (np.zeros(shape), *zeros)
    scale = l1_coeff * _l1_scale(reduction, xf.shape[0], wu.shape[0])
    with np.errstate(all="ignore"):  # dense math on non-finite values is the contract
        a = xf @ (wu if wg is None else wg).T
        arrays = (a, xf, wu, wd, dyf) + (() if wg is None else (wg,))
        inputs_finite = all(bool(np.isfinite(array).all()) for array in arrays)
        if inputs_finite:
            grads = _sparse(xf, wg, wu, wd, dyf, a, scale)
        else:
            grads = _dense(xf, wg, wu, wd, dyf, a, scale)
    dx, dwg, dwu, dwd = grads
    return dx.reshape(shape), dwg, dwu, dwd


def _dense(xf, wg, wu, wd, dyf, a, scale):  # noqa: ANN001, ANN202
    """Plain dense math (also right for non-finite inputs)."""
    dh_base = dyf @ wd
    if wg is None:
        h = relu(a)
        dh = dh_base + scale * np.sign(h)
        da = dh * (a > 0)
        return da @ wu, None, da.T @ xf, dyf.T @ h
    u = xf @ wu.T
    g = relu(a)
    h = g * u
    dh = dh_base + scale * np.sign(h)
    da = dh * u * (a > 0)
    du = dh * g
    return da @ wg + du @ wu, da.T @ xf, du.T @ xf, dyf.T @ h


def _sparse(xf, wg, wu, wd, dyf, a, scale):  # noqa: ANN001, ANN202
    """Touches only the active units ``a > 0`` (finite inputs)."""
    rows, columns = a.shape
    m, n = np.nonzero(a > 0)
    wd_t = np.ascontiguousarray(wd.T)  # [N, K]: unit n's down column is row n

    def csr(values: np.ndarray) -> Any:
        import scipy.sparse  # imported on use: it costs a third of a second

        return scipy.sparse.csr_matrix((values, (m, n)), shape=(rows, columns))

    active = a[m, n]
    if wg is None:
        hidden = active
    else:
        up = rowwise_dot(xf, m, wu, n)
        hidden = active * up
    dh = rowwise_dot(dyf, m, wd_t, n) + scale * np.sign(hidden)
    dwd = np.asarray(csr(hidden).T @ dyf).T
    if wg is None:
        da = csr(dh)
        return np.asarray(da @ wu), None, np.asarray(da.T @ xf), dwd
    da, du = csr(dh * up), csr(dh * active)
    dx = np.asarray(da @ wg) + np.asarray(du @ wu)
    return dx, np.asarray(da.T @ xf), np.asarray(du.T @ xf), dwd
