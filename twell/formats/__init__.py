"""TwELL (tile-wise ELLPACK) and Hybrid (TwELL plus a dense backup for heavy rows).

Both containers hold NumPy or CuPy arrays and never copy what they are given; every
method runs on the array library of the data it holds. The layouts are those of
docs/format.md:

- ``TwELL.packed`` is ``uint32 [M, (N / tile) * slots]``. Row ``m``, tile ``j`` owns the
  ``slots`` words from ``j * slots``: word 0 is the true number ``c`` of nonzeros of
  ``h[m, j*tile:(j+1)*tile]``; when ``c <= slots - 1`` words ``1..c`` each hold one entry
  (low 16 bits: global column, high 16 bits: bf16 value). A tile with ``c > slots - 1``
  has *overflowed*: its payload is unspecified and its row must be read elsewhere.
- ``Hybrid`` adds ``dense_rows`` (sorted unique int32 row ids) and ``dense`` (``[R, N]``):
  those rows are read from ``dense``; every other row from ``ell``.

Trust: an object twell built (``from_dense``, the ops' outputs, :func:`to_host` of a
trusted object) is trusted. One wrapped around user buffers is checked for types and
shapes at construction (cheap, no read of the contents) and fully, by ``validate()``,
before it is first read: by an op or a decoder, through :func:`ensure_valid`. A
successful ``validate()`` is remembered on the object; changing its buffers in place
afterwards is the caller's responsibility.

Where each piece lives: :mod:`twell.formats.ell` (:class:`TwELL`),
:mod:`twell.formats.hybrid` (:class:`Hybrid`, :func:`to_host`),
:mod:`twell.formats.packing` (dense → words, decoding helpers) and
:mod:`twell.formats.checks` (geometry, routing rule, trust); every public name is
importable from here.
"""

from twell.formats.checks import (
    check_layout,
    dense_row_mask,
    ensure_valid,
    register_device_check,
)
from twell.formats.ell import TwELL
from twell.formats.hybrid import Hybrid, to_host
from twell.options import DEFAULT_SLOTS, DEFAULT_TILE

__all__ = [
    "DEFAULT_SLOTS",
    "DEFAULT_TILE",
    "Hybrid",
    "TwELL",
    "check_layout",
    "dense_row_mask",
    "ensure_valid",
    "register_device_check",
    "to_host",
]
