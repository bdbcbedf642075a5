"""Checks shared by the formats: the geometry, the routing rule, argument checks, and the
trust rule (:func:`ensure_valid`; a GPU kernel may take over content checks of CuPy data)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from twell._arrays import FLOAT_DTYPES, FLOAT_NAMES, xp_of
from twell.options import MAX_COLUMNS, check_geometry

#: The GPU's one-pass check of a buffer held by CuPy (see :func:`register_device_check`);
#: None: CuPy data goes through the array code NumPy data takes.
_device_check: Callable[..., tuple[str, int, int, int] | None] | None = None


def register_device_check(check: Callable[..., tuple[str, int, int, int] | None]) -> None:
    """Check the contents of buffers held by CuPy with ``check(packed, tile, slots, light,
    routing=...)``: the first failing row-tile check in (row, tile, slot) order as
    ``(what, row, tile, slot)``, or None. :mod:`twell.kernels.validate` registers its
    kernel when imported (``import twell`` imports it); :mod:`twell.formats` sits below
    the kernels and does not import them."""
    global _device_check
    _device_check = check


def check_layout(
    shape: tuple[int, int], tile: int, slots: int, *, name: str = "shape"
) -> tuple[int, int]:
    """Validate a TwELL geometry and return ``(M, N)`` as Python ints (``name``: the
    argument the shape's errors name, e.g. the matrix it was read from).

    Raises:
        ValueError: ``tile``/``slots`` out of range or not powers of two, ``N % tile``,
            ``N > 65536``, or a negative dimension.
        TypeError: a parameter is not an integer.
    """
    tile, slots = check_geometry(tile, slots)
    if len(shape) != 2:
        raise ValueError(f"{name}: expected (M, N), got {shape!r}")
    for d in shape:
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)):
            raise TypeError(f"{name}: expected integer dimensions (M, N), got {shape!r}")
    rows, columns = (int(d) for d in shape)
    if rows < 0 or columns < 0:
        raise ValueError(f"{name}: dimensions must be >= 0, got {shape!r}")
    if columns % tile:
        raise ValueError(f"{name}: N={columns} is not a multiple of tile={tile}")
    if columns > MAX_COLUMNS:
        raise ValueError(f"{name}: N={columns} exceeds {MAX_COLUMNS} (16-bit column indices)")
    return rows, columns


def dense_row_mask(counts: Any, non_finite: Any, slots: int, max_row_nnz: int | None = None) -> Any:
    """The routing rule (docs/format.md): which rows must live in a Hybrid's dense part.

    A row goes dense when one of its tiles overflows (more than ``slots - 1`` nonzeros)
    or it holds a non-finite value; with ``max_row_nnz``, also when it has more nonzeros
    than that (a speed choice of the producer: the result is the same either way). The
    kernels apply the same rule, written once in ``twell/kernels/common.cuh``;
    tests/test_routing_rule.py checks that the two agree.

    Args:
        counts: true nonzero counts per row-tile, ``[M, N / tile]``.
        non_finite: boolean ``[M]``, rows holding a non-finite value.
        slots: words per row-tile (a tile holds ``slots - 1`` entries).
        max_row_nnz: optional limit on a row's nonzeros.

    Returns:
        Boolean ``[M]``.
    """
    xp = xp_of(counts)
    dense = (counts > slots - 1).any(axis=1) | xp.asarray(non_finite, dtype=bool)
    if max_row_nnz is not None:
        dense |= counts.sum(axis=1) > max_row_nnz
    return dense


class Checkable(Protocol):
    """What :func:`ensure_valid` needs of a format: a remembered flag and a full check."""

    _validated: bool

    def validate(self) -> Any: ...


def ensure_valid(matrix: Checkable, name: str | None = None) -> None:
    """Check a format's contents once, before it is first read (docs/format.md).

    Objects twell built are trusted and pass at once; one wrapped around user buffers is
    validated on its first use and remembered as valid. Every op and decoder that reads
    a format goes through here.

    Args:
        matrix: the :class:`TwELL` or :class:`Hybrid`.
        name: the argument's name in the caller, put in front of the message
            (``g.packed: row 2, tile 1, slot 1: ...``).

    Raises:
        ValueError: the contents are invalid.
    """
    if matrix._validated:
        return
    try:
        matrix.validate()
    except ValueError as error:
        if name is None:
            raise
        message = str(error)
        part = message.split(":", 1)[0]
        prefix = f"{name}." if part in ("packed", "dense_rows", "dense") else f"{name}: "
        raise ValueError(prefix + message) from None


def has_device_check(xp: Any) -> bool:
    """Whether data held by ``xp`` is checked by the registered GPU kernel."""
    return xp is not np and _device_check is not None


def device_first_failure(
    ell: Any, light: Any | None, *, routing: bool
) -> tuple[str, int, int, int] | None:
    """The registered kernel's first failure on a CuPy-held :class:`~twell.formats.TwELL`
    (``light``: uint8 ``[M]`` rows whose payloads are read, or None for all)."""
    assert _device_check is not None
    packed = ell.xp.ascontiguousarray(ell.packed)
    with packed.device:
        return _device_check(packed, ell.tile, ell.slots, light, routing=routing)


def row_limit(value: Any) -> int:
    """``max_row_nnz`` checked: an int >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"max_row_nnz: expected an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"max_row_nnz: expected an int >= 0, got {value}")
    return int(value)


def xp_or_none(array: Any) -> Any:
    """``xp_of(array)``, or None for anything that is not a NumPy or CuPy array."""
    try:
        return xp_of(array)
    except TypeError:
        return None


def float_dtype(dtype: Any) -> np.dtype:
    """``dtype`` as a NumPy dtype if it is one of twell's floating dtypes (else TypeError)."""
    try:
        resolved = np.dtype(dtype)
    except TypeError:
        resolved = None
    if resolved is None or resolved not in FLOAT_DTYPES:  # (None == float64 in NumPy)
        given = repr(dtype) if resolved is None else resolved
        raise TypeError(f"dtype: expected a floating dtype ({FLOAT_NAMES}), got {given}")
    return resolved
