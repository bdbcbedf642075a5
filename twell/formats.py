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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from twell._arrays import (
    FLOAT_DTYPES,
    as_float32,
    bf16_bits,
    bf16_values,
    bfloat16,
    to_numpy,
    xp_of,
)
from twell.options import DEFAULT_SLOTS, DEFAULT_TILE, MAX_COLUMNS, check_geometry

_FLOAT_NAMES = "bfloat16, float16, float32, float64"
#: The GPU's one-pass check of a buffer held by CuPy (see :func:`register_device_check`);
#: None: CuPy data goes through the array code NumPy data takes.
_device_check: Callable[..., tuple[str, int, int, int] | None] | None = None


def register_device_check(check: Callable[..., tuple[str, int, int, int] | None]) -> None:
    """Check the contents of buffers held by CuPy with ``check(packed, tile, slots, light,
    routing=...)``: the first failing row-tile check in (row, tile, slot) order as
    ``(what, row, tile, slot)``, or None. :mod:`twell.kernels.validate` registers its
    kernel when imported (``import twell`` imports it); this module sits below the
    kernels and does not import them."""
    global _device_check
    _device_check = check


def check_layout(shape: tuple[int, int], tile: int, slots: int) -> tuple[int, int]:
    """Validate a TwELL geometry and return ``(M, N)`` as Python ints.

    Raises:
        ValueError: ``tile``/``slots`` out of range or not powers of two, ``N % tile``,
            ``N > 65536``, or a negative dimension.
        TypeError: a parameter is not an integer.
    """
    tile, slots = check_geometry(tile, slots)
    if len(shape) != 2:
        raise ValueError(f"shape: expected (M, N), got {shape!r}")
    for d in shape:
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)):
            raise TypeError(f"shape: expected integer dimensions (M, N), got {shape!r}")
    rows, columns = (int(d) for d in shape)
    if rows < 0 or columns < 0:
        raise ValueError(f"shape: dimensions must be >= 0, got {shape!r}")
    if columns % tile:
        raise ValueError(f"shape: N={columns} is not a multiple of tile={tile}")
    if columns > MAX_COLUMNS:
        raise ValueError(f"shape: N={columns} exceeds {MAX_COLUMNS} (16-bit column indices)")
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


class TwELL:
    """A matrix ``[M, N]`` in tile-wise ELLPACK form (docs/format.md).

    Args:
        packed: ``uint32 [M, (N / tile) * slots]`` words, NumPy or CuPy; not copied.
        shape: ``(M, N)`` of the matrix it encodes.
        tile: columns per tile, a power of two in [32, 256].
        slots: 32-bit words per row-tile including the count word, a power of two in
            [2, tile]; a tile holds at most ``slots - 1`` entries.

    The constructor checks types, dtypes and shapes only (cheap: nothing reads the
    contents); :meth:`validate` checks the contents of a buffer that came from outside,
    and runs by itself once before the first decode or op (:func:`ensure_valid`).
    """

    def __init__(
        self,
        packed: Any,
        shape: tuple[int, int],
        tile: int = DEFAULT_TILE,
        slots: int = DEFAULT_SLOTS,
    ) -> None:
        rows, columns = check_layout(tuple(shape), tile, slots)
        try:
            xp_of(packed)  # raises TypeError for anything but numpy/cupy
        except TypeError as error:
            raise TypeError(f"packed: {error}") from None
        if packed.dtype != np.uint32:
            raise TypeError(f"packed: expected dtype uint32, got {packed.dtype}")
        width = columns // tile * slots
        if packed.shape != (rows, width):
            raise ValueError(
                f"packed: expected shape ({rows}, {width}) for shape={shape!r}, "
                f"tile={tile}, slots={slots}; got {tuple(packed.shape)}"
            )
        self.packed = packed
        self.shape = (rows, columns)
        self.tile = int(tile)
        self.slots = int(slots)
        self._validated = False  # contents not checked yet (see ensure_valid)

    @classmethod
    def _trusted(cls, packed: Any, shape: tuple[int, int], tile: int, slots: int) -> TwELL:
        """A TwELL twell built itself: valid by construction, never checked again."""
        matrix = cls(packed, shape, tile, slots)
        matrix._validated = True
        return matrix

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_dense(cls, h: Any, tile: int = DEFAULT_TILE, slots: int = DEFAULT_SLOTS) -> TwELL:
        """Pack a dense ``[M, N]`` matrix (NumPy or CuPy, any float dtype).

        Values are rounded to bfloat16 (nearest even, from float32). Entries that are zero
        after rounding are not stored. NaN counts as a nonzero and is stored; a finite
        value beyond the bfloat16 range is stored as ±Inf. Overflowed tiles keep their
        true count and the first ``slots - 1`` entries.
        """
        packed, _, _ = _pack(h, tile, slots)
        return cls._trusted(packed, tuple(h.shape), tile, slots)

    # ----------------------------------------------------------------- statistics
    @property
    def xp(self):  # noqa: ANN201 - numpy or cupy module
        """The array module (``numpy`` or ``cupy``) holding the data."""
        return xp_of(self.packed)

    @property
    def tiles(self) -> int:
        """Tiles per row, ``N / tile``."""
        return self.shape[1] // self.tile

    def _words(self) -> Any:
        return self.packed.reshape(self.shape[0], self.tiles, self.slots)

    def counts(self) -> Any:
        """True nonzero count of every row-tile, ``int64 [M, N / tile]``.

        Count words are unsigned 32-bit: a word of 2**31 or more is a large count (invalid,
        see :meth:`validate`), never a negative one.
        """
        return self._words()[:, :, 0].astype(self.xp.int64)

    @property
    def nnz(self) -> int:
        """Nonzeros of the encoded matrix (true counts, overflowed tiles included)."""
        return int(self.counts().sum())

    def overflow_rows(self) -> Any:
        """Sorted row ids (int32) with at least one overflowed tile."""
        xp = self.xp
        return xp.nonzero((self.counts() > self.slots - 1).any(axis=1))[0].astype(xp.int32)

    @property
    def nbytes(self) -> int:
        """Bytes of the packed buffer."""
        return int(self.packed.nbytes)

    def __repr__(self) -> str:
        return (
            f"<TwELL shape={self.shape} tile={self.tile} slots={self.slots} "
            f"nnz={self.nnz} overflow_rows={int(self.overflow_rows().size)} "
            f"bytes={self.nbytes} ({type(self.packed).__module__.split('.')[0]})>"
        )

    # ----------------------------------------------------------------- decoding
    def _live(self, rows: Any = None) -> Any:
        """Boolean ``[M, tiles, slots - 1]``: payload words that hold an entry."""
        xp = self.xp
        counts = self.counts()
        live = counts[:, :, None] > xp.arange(self.slots - 1, dtype=xp.int64)
        live &= (counts <= self.slots - 1)[:, :, None]
        if rows is not None:
            live &= rows[:, None, None]
        return live

    def _stored(self, rows: Any = None) -> tuple[Any, Any, Any, Any]:
        """``(row, tile, slot, word)`` of every stored entry (slot counts from 1)."""
        m, j, s = self.xp.nonzero(self._live(rows))
        return m, j, s + 1, self._words()[m, j, s + 1]

    def entries(self, rows: Any = None) -> tuple[Any, Any, Any]:
        """Stored entries of non-overflowed tiles as ``(row, column, float32 value)``.

        Args:
            rows: optional boolean mask ``[M]`` selecting the rows to decode.

        Entries come in row-major tile order, slot order inside a tile. A raw decoding:
        it does not check the buffer (:meth:`to_dense` and :meth:`to_csr` do).
        """
        xp = self.xp
        m, _, _, word = self._stored(rows)
        column = (word & xp.uint32(0xFFFF)).astype(xp.int32)
        return m.astype(xp.int32), column, bf16_values(word >> 16)

    def _check_decodable(self) -> None:
        ensure_valid(self)
        heavy = self.overflow_rows()
        if heavy.size:
            raise ValueError(
                f"TwELL: {int(heavy.size)} row(s) overflowed a tile (first: row "
                f"{int(heavy[0])}); their entries are not stored here — use a Hybrid"
            )

    def to_dense(self, dtype: Any = np.float32) -> Any:
        """Decode to a dense ``[M, N]`` array of a floating ``dtype``.

        Raises:
            ValueError: a tile overflowed (its row is not in this object: wrap it in a
                :class:`Hybrid`, whose dense part holds such rows), or the buffer is
                invalid (see :meth:`validate`).
            TypeError: ``dtype`` is not a floating dtype.
        """
        dtype = _float_dtype(dtype)
        self._check_decodable()
        xp = self.xp
        out = _zeros(xp, self.shape, dtype)
        m, n, v = self.entries()
        _put(out, (m, n), v)
        return out

    def to_csr(self):  # noqa: ANN201 - scipy/cupyx csr_matrix
        """The matrix as a SciPy (or cupyx) CSR matrix with float32 values.

        Raises:
            ValueError: as :meth:`to_dense`.
        """
        self._check_decodable()
        return _csr(self.entries(), self.shape, self.xp)

    # ----------------------------------------------------------------- validation
    def validate(self, rows: Any = None) -> TwELL:
        """Check the packed buffer's contents; return ``self`` if valid.

        Checks, for every row-tile: count ≤ tile; and where the tile did not overflow,
        each stored column lies inside its tile, columns are distinct, and no stored value
        is ±0.

        Args:
            rows: optional boolean mask ``[M]``; payloads of other rows are not checked
                (a :class:`Hybrid` reads them from its dense part). Count words are
                checked in every row.

        Raises:
            ValueError: naming the first bad row, tile and slot.
        """
        self._validate(rows)
        if rows is None:
            self._validated = True
        return self

    def _validate(self, rows: Any) -> None:
        xp = self.xp
        if xp is not np and _device_check is not None:  # on the GPU: one kernel pass
            light = None if rows is None else xp.ascontiguousarray(rows, dtype=xp.uint8)
            self._raise_gpu_failure(_gpu_first_failure(self, light, routing=False))
            return
        counts = self._words()[:, :, 0]  # compared as unsigned 32-bit words
        too_many = counts > self.tile
        if bool(too_many.any()):
            m, j = (int(i) for i in xp.argwhere(too_many)[0])
            raise ValueError(
                f"packed: row {m}, tile {j}: count {int(counts[m, j])} exceeds the tile "
                f"width {self.tile}"
            )
        m, j, slot, word = self._stored(rows)
        if not m.size:
            return
        column = (word & xp.uint32(0xFFFF)).astype(xp.int32)

        def fail(bad: Any, what: str) -> None:
            i = int(xp.argmax(bad))
            raise ValueError(
                f"packed: row {int(m[i])}, tile {int(j[i])}, slot {int(slot[i])}: "
                + what.format(
                    column=int(column[i]),
                    start=int(j[i]) * self.tile,
                    end=(int(j[i]) + 1) * self.tile,
                )
            )

        outside = (column // self.tile) != j
        if bool(outside.any()):
            fail(outside, "column {column} lies outside the tile [{start}, {end})")
        zero = ((word >> 16) & xp.uint32(0x7FFF)) == 0
        if bool(zero.any()):
            fail(zero, "stores a zero value at column {column} (zeros are never stored)")
        # Duplicates: sort (row, column) keys; equal neighbours are duplicates.
        key = m.astype(xp.int64) * self.shape[1] + column
        order = xp.argsort(key)
        duplicate = xp.zeros(m.shape, dtype=bool)
        duplicate[order[1:]] = key[order[1:]] == key[order[:-1]]
        if bool(duplicate.any()):
            fail(duplicate, "column {column} is stored twice in this tile")

    check_format = validate

    def _raise_gpu_failure(self, failure: tuple[str, int, int, int] | None) -> None:
        """Raise what the NumPy checks raise for the kernel's first failure, if any."""
        if failure is None:
            return
        what, m, j, slot = failure
        words = self._words()
        count = int(words[m, j, 0])
        if what == "count":
            raise ValueError(
                f"packed: row {m}, tile {j}: count {count} exceeds the tile width {self.tile}"
            )
        column = int(words[m, j, slot]) & 0xFFFF
        start, end = j * self.tile, (j + 1) * self.tile
        text = {
            "outside": f"column {column} lies outside the tile [{start}, {end})",
            "zero": f"stores a zero value at column {column} (zeros are never stored)",
            "duplicate": f"column {column} is stored twice in this tile",
        }
        if what in text:
            raise ValueError(f"packed: row {m}, tile {j}, slot {slot}: {text[what]}")
        reason = "overflowed a tile" if what == "overflow" else "holds a non-finite value"
        raise ValueError(f"dense_rows: row {m} {reason} but has no dense backup")


def _gpu_first_failure(
    ell: TwELL, light: Any | None, *, routing: bool
) -> tuple[str, int, int, int] | None:
    assert _device_check is not None
    packed = ell.xp.ascontiguousarray(ell.packed)
    with packed.device:
        return _device_check(packed, ell.tile, ell.slots, light, routing=routing)


class Hybrid:
    """TwELL for light rows plus a dense backup for heavy rows (docs/format.md).

    Args:
        ell: the :class:`TwELL` part, shape ``[M, N]``.
        dense_rows: sorted, unique int32 row ids ``[R]`` read from ``dense``.
        dense: ``[R, N]`` values of those rows (any float dtype).

    Row ``m`` is ``dense[i]`` where ``dense_rows[i] == m``, else row ``m`` of ``ell``.

    The constructor checks types, dtypes and shapes (and that there are at most M ids);
    :meth:`validate` checks the contents, by itself once before the first decode or op
    (:func:`ensure_valid`), unless twell built the object.
    """

    def __init__(self, ell: TwELL, dense_rows: Any, dense: Any) -> None:
        if not isinstance(ell, TwELL):
            raise TypeError(f"ell: expected a TwELL, got {type(ell).__name__}")
        xp = ell.xp
        for name, array in (("dense_rows", dense_rows), ("dense", dense)):
            try:
                library = xp_of(array)
            except TypeError as error:
                raise TypeError(f"{name}: {error}") from None
            if library is not xp:
                raise TypeError(
                    f"{name}: expected a {xp.__name__} array like ell.packed, "
                    f"got {type(array).__module__}.{type(array).__name__}"
                )
        if dense_rows.dtype != np.int32 or dense_rows.ndim != 1:
            raise TypeError(
                f"dense_rows: expected a 1-D int32 array, got {dense_rows.dtype} "
                f"with shape {tuple(dense_rows.shape)}"
            )
        if np.dtype(dense.dtype) not in FLOAT_DTYPES:
            raise TypeError(
                f"dense: expected a floating dtype (bfloat16, float16, float32, float64), "
                f"got {dense.dtype}"
            )
        if dense_rows.shape[0] > ell.shape[0]:
            raise ValueError(
                f"dense_rows: expected at most M={ell.shape[0]} row ids (one per row), "
                f"got {dense_rows.shape[0]}"
            )
        if tuple(dense.shape) != (dense_rows.shape[0], ell.shape[1]):
            raise ValueError(
                f"dense: expected shape ({dense_rows.shape[0]}, {ell.shape[1]}), "
                f"got {tuple(dense.shape)}"
            )
        self.ell = ell
        self.dense_rows = dense_rows
        self.dense = dense
        self._validated = False  # contents not checked yet (see ensure_valid)

    @classmethod
    def _trusted(cls, ell: TwELL, dense_rows: Any, dense: Any) -> Hybrid:
        """A Hybrid twell built itself: valid by construction, never checked again."""
        matrix = cls(ell, dense_rows, dense)
        matrix._validated = True
        return matrix

    @classmethod
    def from_dense(
        cls,
        h: Any,
        tile: int = DEFAULT_TILE,
        slots: int = DEFAULT_SLOTS,
        *,
        max_row_nnz: int | None = None,
        also_dense: Any = None,
    ) -> Hybrid:
        """Split a dense ``[M, N]`` matrix into TwELL and a dense backup.

        A row goes to the dense part when one of its tiles overflows or it holds a
        non-finite value (a finite value beyond the bfloat16 range, which the TwELL part
        would store as ±Inf, counts as one); with ``max_row_nnz`` also when it has more
        nonzeros than that, and with ``also_dense`` (boolean ``[M]``) where that mask is
        set. The dense part keeps ``h``'s values and dtype; the TwELL part holds bf16
        values.
        """
        packed, counts, non_finite = _pack(h, tile, slots)  # checks h first
        xp = xp_of(packed)
        ell = TwELL._trusted(packed, tuple(h.shape), tile, slots)
        if max_row_nnz is not None:
            max_row_nnz = _row_limit(max_row_nnz)
        heavy = dense_row_mask(counts, non_finite, slots, max_row_nnz)
        if also_dense is not None:
            if getattr(also_dense, "shape", None) is None or _xp_or_none(also_dense) is not xp:
                raise TypeError(
                    f"also_dense: expected a {xp.__name__} boolean mask like h, "
                    f"got {type(also_dense).__name__}"
                )
            if tuple(also_dense.shape) != (h.shape[0],):
                raise ValueError(
                    f"also_dense: expected a boolean mask of shape ({h.shape[0]},), "
                    f"got {tuple(also_dense.shape)}"
                )
            heavy |= also_dense.astype(bool)
        rows = xp.nonzero(heavy)[0].astype(xp.int32)
        return cls._trusted(ell, rows, h[rows])

    # ----------------------------------------------------------------- statistics
    @property
    def shape(self) -> tuple[int, int]:
        """``(M, N)``."""
        return self.ell.shape

    @property
    def tile(self) -> int:
        """Tile width of the TwELL part."""
        return self.ell.tile

    @property
    def slots(self) -> int:
        """Slots per row-tile of the TwELL part."""
        return self.ell.slots

    @property
    def packed(self) -> Any:
        """The TwELL part's packed words."""
        return self.ell.packed

    @property
    def xp(self):  # noqa: ANN201
        """The array module (``numpy`` or ``cupy``) holding the data."""
        return self.ell.xp

    def light_mask(self) -> Any:
        """Boolean ``[M]``: rows read from the TwELL part.

        Raises:
            ValueError: the object is invalid (see :meth:`validate`).
        """
        ensure_valid(self)
        return self._light_mask()

    def _light_mask(self) -> Any:
        xp = self.xp
        mask = xp.ones(self.shape[0], dtype=bool)
        mask[self.dense_rows] = False
        return mask

    def counts(self) -> Any:
        """Nonzeros per row-tile, ``int64 [M, N / tile]`` (dense rows counted exactly).

        Raises:
            ValueError: the object is invalid (see :meth:`validate`).
        """
        ensure_valid(self)
        xp = self.xp
        counts = self.ell.counts()
        if self.dense_rows.size:
            tiles = self.dense.reshape(self.dense.shape[0], self.ell.tiles, self.tile)
            counts[self.dense_rows] = (tiles != 0).sum(axis=2, dtype=xp.int64)
        return counts

    @property
    def nnz(self) -> int:
        """Nonzeros of the whole matrix."""
        return int(self.counts().sum())

    def overflow_rows(self) -> Any:
        """Rows whose TwELL tiles overflowed (all of them are among ``dense_rows``)."""
        return self.ell.overflow_rows()

    @property
    def nbytes(self) -> int:
        """Bytes of the three parts together."""
        return int(self.ell.nbytes + self.dense_rows.nbytes + self.dense.nbytes)

    def __repr__(self) -> str:
        rows = self.shape[0]
        heavy = int(self.dense_rows.size)
        share = f"{100 * heavy / rows:.2f}%" if rows else "-"
        try:
            nnz = str(self.nnz)
        except ValueError:
            nnz = "? (invalid: see validate())"
        return (
            f"<Hybrid shape={self.shape} tile={self.tile} slots={self.slots} nnz={nnz} "
            f"dense_rows={heavy} ({share}) bytes={self.nbytes} "
            f"({type(self.packed).__module__.split('.')[0]})>"
        )

    # ----------------------------------------------------------------- decoding
    def to_dense(self, dtype: Any = np.float32) -> Any:
        """Decode to a dense ``[M, N]`` array of a floating ``dtype``.

        Raises:
            ValueError: the object is invalid (see :meth:`validate`).
            TypeError: ``dtype`` is not a floating dtype.
        """
        dtype = _float_dtype(dtype)
        ensure_valid(self)
        xp = self.xp
        out = _zeros(xp, self.shape, dtype)
        m, n, v = self.ell.entries(self.light_mask())
        _put(out, (m, n), v)
        if self.dense_rows.size:
            _put(out, self.dense_rows, _widen(self.dense))
        return out

    def entries(self) -> tuple[Any, Any, Any]:
        """All nonzeros as ``(row, column, float32 value)``, light and dense rows.

        Raises:
            ValueError: the object is invalid (see :meth:`validate`).
        """
        ensure_valid(self)
        xp = self.xp
        m, n, v = self.ell.entries(self.light_mask())
        dense = as_float32(self.dense)
        dm, dn = xp.nonzero(dense != 0)
        dv = dense[dm, dn]
        return (
            xp.concatenate([m, self.dense_rows[dm]]),
            xp.concatenate([n, dn.astype(xp.int32)]),
            xp.concatenate([v, dv]),
        )

    def to_csr(self):  # noqa: ANN201
        """The matrix as a SciPy (or cupyx) CSR matrix with float32 values."""
        return _csr(self.entries(), self.shape, self.xp)

    # ----------------------------------------------------------------- validation
    def validate(self) -> Hybrid:
        """Check both parts and the routing rule; return ``self`` if valid.

        Raises:
            ValueError: ``dense_rows`` not sorted, unique or in range; a row that
                overflowed a tile or holds a non-finite TwELL value has no dense backup;
                or any :meth:`TwELL.validate` failure on the light rows.
        """
        self._validate()
        self._validated = True
        return self

    def _validate(self) -> None:
        xp = self.xp
        rows = self.dense_rows
        if rows.size:
            if bool((rows[1:] <= rows[:-1]).any()):
                raise ValueError("dense_rows: expected sorted, unique row ids")
            if int(rows[0]) < 0 or int(rows[-1]) >= self.shape[0]:
                raise ValueError(
                    f"dense_rows: row ids must lie in [0, {self.shape[0]}), got "
                    f"[{int(rows[0])}, {int(rows[-1])}]"
                )
        light = self._light_mask()  # dense_rows are in range now
        if xp is not np and _device_check is not None:  # on the GPU: one kernel pass
            failure = _gpu_first_failure(self.ell, light.astype(xp.uint8), routing=True)
            self.ell._raise_gpu_failure(failure)
            return
        overflow = self.ell.overflow_rows()
        orphan = overflow[light[overflow]]
        if orphan.size:
            raise ValueError(
                f"dense_rows: row {int(orphan[0])} overflowed a tile but has no dense backup"
            )
        self.ell.validate(light)
        m, _, v = self.ell.entries(light)
        bad = ~xp.isfinite(v)
        if bool(bad.any()):
            raise ValueError(
                f"dense_rows: row {int(m[int(xp.argmax(bad))])} holds a non-finite value "
                "but has no dense backup"
            )

    def _with_dense_rows(self, mask: Any) -> Hybrid:
        """The same matrix with the rows set in ``mask`` (boolean ``[M]``) also read from
        the dense part: what the ops use where only dense math gives dense math's result
        (a non-finite weight or input). The new dense part is float32 (float64 if it
        was), which holds every bf16 TwELL value exactly. ``self`` must be valid.
        """
        xp = self.xp
        light = self.light_mask()
        heavy = ~light | mask
        rows = xp.nonzero(heavy)[0].astype(xp.int32)
        dtype = np.float64 if np.dtype(self.dense.dtype) == np.float64 else np.float32
        dense = xp.zeros((int(rows.shape[0]), self.shape[1]), dtype=dtype)
        m, n, v = self.ell.entries(light & mask)
        dense[xp.searchsorted(rows, m), n] = v.astype(dtype)
        if self.dense_rows.size:
            dense[xp.searchsorted(rows, self.dense_rows)] = _widen(self.dense).astype(dtype)
        return Hybrid._trusted(self.ell, rows, dense)

    check_format = validate


def _csr(entries: tuple[Any, Any, Any], shape: tuple[int, int], xp: Any):  # noqa: ANN202
    m, n, v = entries
    if xp is np:
        import scipy.sparse

        matrix = scipy.sparse.csr_matrix((v, (m, n)), shape=shape, dtype=np.float32)
    else:
        import cupyx.scipy.sparse

        matrix = cupyx.scipy.sparse.coo_matrix((v, (m, n)), shape=shape).tocsr()
    matrix.sum_duplicates()
    return matrix


def to_host(matrix: TwELL | Hybrid) -> TwELL | Hybrid:
    """A NumPy copy of a (possibly CuPy-backed) TwELL or Hybrid (as trusted as it was)."""
    if isinstance(matrix, Hybrid):
        copy = Hybrid(to_host(matrix.ell), to_numpy(matrix.dense_rows), to_numpy(matrix.dense))
    else:
        copy = TwELL(to_numpy(matrix.packed), matrix.shape, matrix.tile, matrix.slots)
    copy._validated = matrix._validated
    return copy


def ensure_valid(matrix: TwELL | Hybrid, name: str | None = None) -> None:
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


def _pack(h: Any, tile: int, slots: int) -> tuple[Any, Any, Any]:
    """Pack ``h`` into TwELL words: ``(packed, counts int64 [M, tiles], non_finite [M])``.

    ``non_finite`` marks the rows holding a value that is NaN or ±Inf once rounded to
    bfloat16 (so also a finite value beyond the bf16 range).
    """
    try:
        xp = xp_of(h)
    except TypeError as error:
        raise TypeError(f"h: {error}") from None
    if np.dtype(h.dtype) not in FLOAT_DTYPES:
        raise TypeError(f"h: expected a floating dtype ({_FLOAT_NAMES}), got {h.dtype}")
    if h.ndim != 2:
        raise ValueError(f"h: expected a 2-D matrix, got shape {tuple(h.shape)}")
    rows, columns = check_layout(tuple(h.shape), tile, slots)
    tiles = columns // tile
    nonzero = h != 0  # NaN counts as a nonzero
    m, n = xp.nonzero(nonzero)
    bits = bf16_bits(h[m, n])
    rounds_to_zero = (bits & xp.uint32(0x7FFF)) == 0  # tiny values: ±0 in bf16
    if bool(rounds_to_zero.any()):
        nonzero[m[rounds_to_zero], n[rounds_to_zero]] = False
        m, n, bits = m[~rounds_to_zero], n[~rounds_to_zero], bits[~rounds_to_zero]
    non_finite = xp.zeros(rows, dtype=bool)
    exponent = xp.uint32(0x7F80)
    non_finite[m[(bits & exponent) == exponent]] = True
    counts = nonzero.reshape(rows, tiles, tile).sum(axis=2, dtype=xp.int64)
    packed = xp.zeros((rows, tiles * slots), dtype=xp.uint32)
    packed[:, ::slots] = counts.astype(xp.uint32)
    if m.size:
        # Entries come in row-major order, so each row-tile's entries are contiguous:
        # an entry's rank in its row-tile is its position minus the group's start.
        group = m * tiles + n // tile
        flat_counts = counts.reshape(-1)
        starts = xp.cumsum(flat_counts) - flat_counts
        rank = xp.arange(m.size) - starts[group]
        keep = rank < slots - 1
        m, n, bits, rank = m[keep], n[keep], bits[keep], rank[keep]
        word = (n // tile) * slots + 1 + rank
        packed[m, word] = n.astype(xp.uint32) | (bits << 16)
    return packed, counts, non_finite


def _row_limit(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"max_row_nnz: expected an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"max_row_nnz: expected an int >= 0, got {value}")
    return int(value)


def _xp_or_none(array: Any) -> Any:
    """``xp_of(array)``, or None for anything that is not a NumPy or CuPy array."""
    try:
        return xp_of(array)
    except TypeError:
        return None


def _float_dtype(dtype: Any) -> np.dtype:
    """``dtype`` as a NumPy dtype if it is one of twell's floating dtypes (else TypeError)."""
    try:
        resolved = np.dtype(dtype)
    except TypeError:
        resolved = None
    if resolved is None or resolved not in FLOAT_DTYPES:  # (None == float64 in NumPy)
        given = repr(dtype) if resolved is None else resolved
        raise TypeError(f"dtype: expected a floating dtype ({_FLOAT_NAMES}), got {given}")
    return resolved


def _zeros(xp: Any, shape: tuple[int, ...], dtype: np.dtype) -> Any:
    if dtype == bfloat16 and xp is not np:  # CuPy holds bf16 as 16-bit words
        return xp.zeros(shape, dtype=xp.uint16).view(bfloat16)
    return xp.zeros(shape, dtype=dtype)


def _widen(values: Any) -> Any:
    """Dense-part values as float32 (float64 kept), for decoding."""
    if np.dtype(values.dtype) == np.float64:
        return values
    return as_float32(values)


def _put(out: Any, index: Any, values: Any) -> None:
    """``out[index] = values`` converted to ``out``'s dtype (bf16 by rounding), quietly."""
    dtype = np.dtype(out.dtype)
    xp = xp_of(out)
    if dtype == bfloat16 and xp is not np:
        out.view(xp.uint16)[index] = bf16_bits(values).astype(xp.uint16)
        return
    with np.errstate(over="ignore"):  # e.g. float32 values beyond float16's range: ±Inf
        out[index] = values.astype(dtype)
