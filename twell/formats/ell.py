"""The TwELL container: a matrix ``[M, N]`` as tile-wise ELLPACK words (docs/format.md)."""

from __future__ import annotations

from typing import Any

import numpy as np

from twell._arrays import bf16_values, xp_of
from twell.formats.checks import (
    check_layout,
    device_first_failure,
    ensure_valid,
    float_dtype,
    has_device_check,
)
from twell.formats.packing import csr_matrix, dense_zeros, pack_dense, put_values
from twell.options import DEFAULT_SLOTS, DEFAULT_TILE


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
        packed, _, _ = pack_dense(h, tile, slots)
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
        dtype = float_dtype(dtype)
        self._check_decodable()
        xp = self.xp
        out = dense_zeros(xp, self.shape, dtype)
        m, n, v = self.entries()
        put_values(out, (m, n), v)
        return out

    def to_csr(self):  # noqa: ANN201 - scipy/cupyx csr_matrix
        """The matrix as a SciPy (or cupyx) CSR matrix with float32 values.

        Raises:
            ValueError: as :meth:`to_dense`.
        """
        self._check_decodable()
        return csr_matrix(self.entries(), self.shape, self.xp)

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
        if has_device_check(xp):  # on the GPU: one kernel pass
            light = None if rows is None else xp.ascontiguousarray(rows, dtype=xp.uint8)
            self._raise_gpu_failure(device_first_failure(self, light, routing=False))
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
