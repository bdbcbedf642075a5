"""Assertions for tests of code that produces or consumes twell formats.

Everything here compares through decoding, never slot by slot: the order of entries
inside a TwELL tile is not part of the format (docs/format.md). Arrays may be NumPy, CuPy or
PyTorch (CPU or CUDA); they are copied to the host first.

A :class:`TwELL` or :class:`Hybrid` argument is always validated in full first (trusted or
not: these helpers exist to cross-check producers), so a buffer whose decoded entries look
right but whose words break the format (a bogus count word on an empty tile, a stored zero,
a duplicate or out-of-tile column, a heavy row without its dense backup) fails the
assertion too.

Example:
    >>> import numpy as np
    >>> from twell import TwELL
    >>> from twell.testing import assert_same_matrix, relative_error
    >>> h = np.zeros((2, 32), np.float32); h[0, 3] = 1.5
    >>> assert_same_matrix(TwELL.from_dense(h, tile=32, slots=4), h)
    >>> relative_error(np.array([1.0, 2.0]), np.array([1.0, 2.0]))
    0.0
"""

from __future__ import annotations

from typing import Any

import numpy as np

from twell._arrays import round_bf16, to_numpy
from twell.formats import Hybrid, TwELL, to_host

__all__ = [
    "as_host",
    "matrix_entries",
    "assert_same_matrix",
    "relative_error",
    "assert_relative_error",
    "assert_same_nonfinite",
    "assert_matches_dense",
]


#: A NumPy view or copy of a NumPy/CuPy array or a PyTorch tensor (any device).
as_host = to_numpy


def matrix_entries(matrix: Any) -> tuple[tuple[int, int], dict[tuple[int, int], float]]:
    """Decode a TwELL, Hybrid, SciPy sparse or dense 2-D matrix to its nonzero entries.

    Returns:
        ``(shape, {(row, column): value})`` with float64 values; NaN and ±Inf count as
        nonzeros, ±0 never appear.

    Raises:
        AssertionError: a :class:`TwELL` or :class:`Hybrid` fails ``validate()``, or a
            :class:`TwELL` has overflowed tiles (its entries are not all stored: only a
            :class:`Hybrid` can hold such rows).
    """
    if isinstance(matrix, (TwELL, Hybrid)):
        matrix = to_host(matrix)
        kind = type(matrix).__name__
        try:
            matrix.validate()  # always in full: a cross-check trusts no producer
        except ValueError as error:
            raise AssertionError(f"invalid {kind}: {error}") from None
        if isinstance(matrix, TwELL):
            heavy = matrix.overflow_rows()
            if heavy.size:
                raise AssertionError(
                    f"TwELL has {heavy.size} overflowed row(s) (first: {int(heavy[0])}); "
                    "their entries are not stored — compare a Hybrid instead"
                )
        rows, columns, values = (as_host(part) for part in matrix.entries())
        shape = matrix.shape
    elif hasattr(matrix, "tocoo"):  # scipy.sparse (or cupyx) matrix or array
        coo = matrix.tocoo()
        rows, columns, values = (as_host(part) for part in (coo.row, coo.col, coo.data))
        shape = coo.shape
    else:
        dense = as_host(matrix)
        if dense.ndim != 2:
            raise AssertionError(f"expected a 2-D matrix, got shape {dense.shape}")
        rows, columns = np.nonzero(dense != 0)  # NaN is a nonzero
        values = dense[rows, columns]
        shape = dense.shape
    entries: dict[tuple[int, int], float] = {}
    for row, column, value in zip(
        rows.tolist(), columns.tolist(), np.asarray(values, dtype=np.float64).tolist(), strict=True
    ):
        if value == 0:
            continue  # explicit zeros of a sparse matrix are not entries
        if (row, column) in entries:
            raise AssertionError(f"entry ({row}, {column}) is stored twice")
        entries[(row, column)] = value
    return (int(shape[0]), int(shape[1])), entries


def _entries_of(name: str, matrix: Any) -> tuple[tuple[int, int], dict[tuple[int, int], float]]:
    try:
        return matrix_entries(matrix)
    except AssertionError as error:
        raise AssertionError(f"{name}: {error}") from None


def _same_value(a: float, b: float) -> bool:
    return a == b or (a != a and b != b)  # NaN matches NaN


def assert_same_matrix(actual: Any, expected: Any, *, round_to_bf16: bool = False) -> None:
    """Assert that two matrices hold the same (row, column, value) entries and shape.

    Args:
        actual, expected: each a :class:`TwELL`, :class:`Hybrid`, SciPy sparse matrix or
            dense 2-D array (NumPy, CuPy or torch).
        round_to_bf16: compare values after rounding both sides to bfloat16 (for a dense
            matrix whose values are not bf16-representable against a TwELL holding them).

    Values are compared exactly (NaN equals NaN). The message lists the first
    differences. Both sides are validated first when they are formats (see the module's
    docstring).
    """
    shape_a, entries_a = _entries_of("actual", actual)
    shape_b, entries_b = _entries_of("expected", expected)
    if shape_a != shape_b:
        raise AssertionError(f"shapes differ: {shape_a} != {shape_b}")
    if round_to_bf16:
        for entries in (entries_a, entries_b):
            keys = list(entries)
            with np.errstate(over="ignore"):  # beyond float32: ±Inf, as bf16 rounding gives
                values = round_bf16(np.array([entries[k] for k in keys], dtype=np.float32))
            entries.clear()
            entries.update((k, float(v)) for k, v in zip(keys, values.tolist(), strict=True) if v)
    problems = []
    for key in sorted(entries_a.keys() | entries_b.keys()):
        a, b = entries_a.get(key), entries_b.get(key)
        if a is None:
            problems.append(f"{key}: missing (expected {b!r})")
        elif b is None:
            problems.append(f"{key}: unexpected entry {a!r}")
        elif not _same_value(a, b):
            problems.append(f"{key}: {a!r} != {b!r}")
    if problems:
        listed = "; ".join(problems[:8])
        more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
        raise AssertionError(f"matrices differ in {len(problems)} entries: {listed}{more}")


def relative_error(y: Any, y_ref: Any) -> float:
    """``‖y − y_ref‖ / ‖y_ref‖`` (Frobenius norms over all elements, float64).

    Returns 0.0 when both are all zero and ``inf`` when only ``y_ref`` is; NaN when either
    holds a non-finite value (use :func:`assert_relative_error`, which compares those
    positions separately).
    """
    a = as_host(y).astype(np.float64)
    b = as_host(y_ref).astype(np.float64)
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {a.shape} != {b.shape}")
    with np.errstate(all="ignore"):  # non-finite values give NaN, as documented
        reference = float(np.linalg.norm(b.ravel()))
        difference = float(np.linalg.norm((a - b).ravel()))
    if reference == 0.0:
        return 0.0 if difference == 0.0 else float("inf")
    return difference / reference


def assert_same_nonfinite(y: Any, y_ref: Any) -> None:
    """Assert that NaN, +Inf and -Inf sit at the same positions in ``y`` and ``y_ref``."""
    a, b = as_host(y), as_host(y_ref)
    if a.shape != b.shape:
        raise AssertionError(f"shapes differ: {a.shape} != {b.shape}")
    for name, test in (("NaN", np.isnan), ("+Inf", np.isposinf), ("-Inf", np.isneginf)):
        where_a, where_b = test(a), test(b)
        if not np.array_equal(where_a, where_b):
            first = tuple(int(i) for i in np.argwhere(where_a != where_b)[0])
            raise AssertionError(
                f"{name} positions differ: {int(where_a.sum())} vs {int(where_b.sum())} "
                f"(first difference at {first}: {a[first]!r} vs {b[first]!r})"
            )


def assert_relative_error(y: Any, y_ref: Any, tol: float = 1e-2) -> float:
    """Assert ``relative_error(y, y_ref) <= tol`` on the finite part; return the error.

    Non-finite values must sit at the same positions on both sides (checked first); the
    error is then measured over the positions where ``y_ref`` is finite.
    """
    assert_same_nonfinite(y, y_ref)
    a, b = as_host(y), as_host(y_ref)
    finite = np.isfinite(b)
    error = relative_error(a[finite], b[finite])
    if not error <= tol:
        raise AssertionError(f"relative error {error:.3e} exceeds {tol:.1e}")
    return error


def assert_matches_dense(
    y: Any, x: Any, w_gate: Any | None, w_up: Any, w_down: Any, tol: float = 1e-2
) -> float:
    """Assert that ``y`` is the FFN block of ``x`` as dense float64 math computes it
    (:func:`twell.reference.forward.ffn_dense`), row by row, to within ``tol`` of the
    magnitude of the terms summed into the row; return the largest such error.

    A row's outputs ``y[i, k] = Σ_n h[i, n] · w_down[k, n]`` sum terms that can cancel:
    bf16 rounding of ``h`` (what the kernels and the reference ops do) leaves an error
    small against the terms but not always against their sum, which is what
    :func:`assert_relative_error` measures. Here row ``i``'s error ``‖y_i − y_ref,i‖`` is
    measured against ``‖Σ_n |h[i, n]| |w_down[:, n]|‖`` (``h`` in float64): rounding stays
    far under 1% of it, while a dropped row or a wrong unit does not. Non-finite values
    must sit where dense math puts them (checked first); the norms are over the finite
    ones. A row whose terms are all 0 must be exactly 0.
    """
    from twell.reference.forward import ffn_dense

    expected = ffn_dense(x, w_gate, w_up, w_down)
    got = as_host(y)
    if got.shape != expected.shape:
        raise AssertionError(f"shapes differ: {got.shape} != {expected.shape}")
    assert_same_nonfinite(got, expected)
    k = expected.shape[-1] if expected.ndim else 1
    xf = as_host(x).astype(np.float64).reshape(-1, as_host(x).shape[-1])
    with np.errstate(all="ignore"):
        up = xf @ as_host(w_up).astype(np.float64).T
        if w_gate is None:
            h = np.maximum(up, 0.0)
        else:
            h = np.maximum(xf @ as_host(w_gate).astype(np.float64).T, 0.0) * up
        scale = np.abs(h) @ np.abs(as_host(w_down).astype(np.float64)).T
        a = got.astype(np.float64).reshape(-1, k)
        b = expected.reshape(-1, k)
        finite = np.isfinite(b) & np.isfinite(scale)
        difference = np.where(finite, a - b, 0.0)
        bound = np.linalg.norm(np.where(finite, scale, 0.0), axis=1)
        error = np.linalg.norm(difference, axis=1)
    exact = bound == 0.0
    if np.any(error[exact] != 0.0):
        raise AssertionError(f"row {int(np.argmax(exact & (error != 0)))}: no nonzero term, not 0")
    ratios = error[~exact] / bound[~exact]
    worst = float(np.max(ratios, initial=0.0))
    if not worst <= tol:
        row = int(np.flatnonzero(~exact)[np.argmax(ratios)])
        raise AssertionError(
            f"row {row}: error {worst:.3e} of its summed terms' magnitude exceeds {tol:.1e}"
        )
    return worst
