"""The Hybrid container: TwELL for light rows plus a dense backup for heavy rows
(docs/format.md), and :func:`to_host` for both formats."""

from __future__ import annotations

from typing import Any

import numpy as np

from twell._arrays import FLOAT_DTYPES, as_float32, to_numpy, xp_of
from twell.formats.checks import (
    dense_row_mask,
    device_first_failure,
    ensure_valid,
    float_dtype,
    has_device_check,
    row_limit,
    xp_or_none,
)
from twell.formats.ell import TwELL
from twell.formats.packing import csr_matrix, dense_zeros, pack_dense, put_values, widen
from twell.options import DEFAULT_SLOTS, DEFAULT_TILE


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
        packed, counts, non_finite = pack_dense(h, tile, slots)  # checks h first
        xp = xp_of(packed)
        ell = TwELL._trusted(packed, tuple(h.shape), tile, slots)
        if max_row_nnz is not None:
            max_row_nnz = row_limit(max_row_nnz)
        heavy = dense_row_mask(counts, non_finite, slots, max_row_nnz)
        if also_dense is not None:
            if getattr(also_dense, "shape", None) is None or xp_or_none(also_dense) is not xp:
                raise TypeError(
                    f"also_dense: expected a {xp.__name__} boolean mask like h, "
                    f"got {type(also_dense).__name__}"
                )
            if also_dense.dtype != bool:  # a float or int array is not read as truthiness
                raise TypeError(f"also_dense: expected a boolean mask, got {also_dense.dtype}")
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
        dtype = float_dtype(dtype)
        ensure_valid(self)
        xp = self.xp
        out = dense_zeros(xp, self.shape, dtype)
        m, n, v = self.ell.entries(self.light_mask())
        put_values(out, (m, n), v)
        if self.dense_rows.size:
            put_values(out, self.dense_rows, widen(self.dense))
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
        return csr_matrix(self.entries(), self.shape, self.xp)

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
        if has_device_check(xp):  # on the GPU: one kernel pass
            failure = device_first_failure(self.ell, light.astype(xp.uint8), routing=True)
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
            dense[xp.searchsorted(rows, self.dense_rows)] = widen(self.dense).astype(dtype)
        return Hybrid._trusted(self.ell, rows, dense)

    check_format = validate


def to_host(matrix: TwELL | Hybrid) -> TwELL | Hybrid:
    """A NumPy copy of a (possibly CuPy-backed) TwELL or Hybrid (as trusted as it was)."""
    if isinstance(matrix, Hybrid):
        copy = Hybrid(to_host(matrix.ell), to_numpy(matrix.dense_rows), to_numpy(matrix.dense))
    else:
        copy = TwELL(to_numpy(matrix.packed), matrix.shape, matrix.tile, matrix.slots)
    copy._validated = matrix._validated
    return copy
