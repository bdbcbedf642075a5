"""Options and limits of twell's ops, defined and checked in one place.

The public boundary (``twell.ops``, ``twell.torch``) turns keyword arguments into one
frozen :class:`Options` (checked on construction) and passes that object down; nothing
below the boundary checks an option again. The limits the kernels impose (the widest
model K, the longest list of active units per token) are constants here, which the
launchers pass to their kernels as compile-time constants.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

#: TwELL geometry defaults: 256 columns per tile, 32 words per row-tile.
DEFAULT_TILE = 256
DEFAULT_SLOTS = 32
#: Column indices are 16 bits: N is at most this.
MAX_COLUMNS = 65536
#: Largest model width K the GPU kernels take (one warp holds a row of x and of y).
MAX_K = 4096
#: Most active units of a token the light-row kernels gather (their shared-memory list);
#: a row with more goes to the dense path, so ``max_row_nnz`` is at most this.
LIST_CAPACITY = 1024
#: The GPU pipelines of a prepared block; see docs/design.md.
PATHS = ("fused", "epilogue", "pack", "sliced")
#: Training's ``"auto"`` sizes the capacity for this many times the heavy rows it last
#: saw (twell.capacity).
AUTO_HEADROOM = 1.25
#: ``"auto"`` steps down to a smaller capacity after this many calls in a row asked for
#: less (up at once).
AUTO_PATIENCE = 8
#: How ``gate`` packs on the GPU: in the GEMM's epilogue, or by a packing kernel.
GATE_PATHS = ("epilogue", "pack")


def _integer(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    return int(value)


def check_geometry(tile: object, slots: object) -> tuple[int, int]:
    """``(tile, slots)`` as ints after checking them (powers of two, 32 <= tile <= 256,
    2 <= slots <= tile).

    Raises:
        TypeError: not integers. ValueError: out of range.
    """
    tile, slots = _integer("tile", tile), _integer("slots", slots)
    if not (32 <= tile <= 256) or tile & (tile - 1):
        raise ValueError(f"tile: expected a power of two in [32, 256], got {tile}")
    if not (2 <= slots <= tile) or slots & (slots - 1):
        raise ValueError(f"slots: expected a power of two in [2, tile={tile}], got {slots}")
    return tile, slots


def check_width(k: int, name: str = "x") -> None:
    """The GPU kernels load rows in 16-byte pieces and keep a row in one warp: K must be a
    multiple of 8 and at most :data:`MAX_K` (``ValueError`` naming ``name``)."""
    if k % 8 or k > MAX_K:
        raise ValueError(
            f"{name}: the GPU kernels need K to be a multiple of 8 and at most {MAX_K}; "
            f"got K={k} (the NumPy reference takes any K)"
        )


def default_max_row_nnz(n: int) -> int:
    """Active units per token above which a token takes the dense path.

    A gathered unit costs two weight rows from L2; a dense row costs ``N`` units' worth
    of tensor-core work. The break-even, a percentage of N, is measured per GPU
    (``options.ROW_LIMIT_PERCENT`` in twell.tuning: 3% on an H100); at most
    :data:`LIST_CAPACITY`.
    """
    return max(16, min(LIST_CAPACITY, n * _row_limit_percent() // 100))


@functools.cache
def _row_limit_percent() -> int:
    from twell import tuning

    return int(tuning.value("options.ROW_LIMIT_PERCENT"))


@dataclass(frozen=True)
class Options:
    """How a block runs: TwELL geometry and GPU pipeline. Checked on construction.

    Args:
        tile, slots: TwELL geometry of the hidden activation (docs/format.md).
        path: the GPU pipeline, one of :data:`PATHS` (same results; different speed).
        max_row_nnz: tokens with more active units take the dense path (None: 3% of N,
            see :func:`default_max_row_nnz`); any value gives the same result.
        dense_capacity: a fraction f of M: the first ``ceil(f * M)`` heavy rows go
            through fixed-size cuBLAS GEMMs, the rest through twell's heavy-row kernels,
            in the forward and in the training backward alike. ``"auto"`` (the default
            of :class:`twell.SparseFFN`, not of this class): an inference call of more
            than ``heavy_rows.FLAG_ROWS`` tokens computes its heavy rows by count on
            tensor cores, whatever their number (pipeline.heavy_rows_counted), a smaller
            one through twell's heavy-row kernels; training needs a layer's history of
            calls (:class:`twell.torch.SparseMLP` keeps one,
            :class:`twell.capacity.AutoCapacity`), so ``twell.autograd.ffn_train``
            refuses it.
        density_switch: run the whole batch in dense math when it has more active units
            per row than the sparse path pays for: decided on the device from the call's
            own rows for inference calls of more than ``heavy_rows.FLAG_ROWS`` tokens
            with ``dense_capacity="auto"``, else from the statistics of earlier calls
            (docs/design.md).
    """

    tile: int = DEFAULT_TILE
    slots: int = DEFAULT_SLOTS
    path: str = "fused"
    max_row_nnz: int | None = None
    dense_capacity: float | str = 0.0
    density_switch: bool = True

    def __post_init__(self) -> None:
        tile, slots = check_geometry(self.tile, self.slots)
        object.__setattr__(self, "tile", tile)
        object.__setattr__(self, "slots", slots)
        if self.path not in PATHS:
            raise ValueError(f"path: expected one of {PATHS}, got {self.path!r}")
        if self.max_row_nnz is not None:
            limit = _integer("max_row_nnz", self.max_row_nnz)
            if not 0 <= limit <= LIST_CAPACITY:
                raise ValueError(
                    f"max_row_nnz: expected an int in [0, {LIST_CAPACITY}], got {limit}"
                )
            object.__setattr__(self, "max_row_nnz", limit)
        if isinstance(self.dense_capacity, str) and self.dense_capacity == "auto":
            capacity = "auto"
        else:
            capacity = self._fraction(self.dense_capacity)
        object.__setattr__(self, "dense_capacity", capacity)
        if not isinstance(self.density_switch, bool):
            raise TypeError(
                f"density_switch: expected a bool, got {type(self.density_switch).__name__}"
            )

    @staticmethod
    def _fraction(value: object) -> float:
        if isinstance(value, str):
            raise ValueError(
                f"dense_capacity: expected a fraction in [0, 1] or 'auto', got {value!r}"
            )
        try:
            capacity = float(value)
        except (TypeError, ValueError):
            raise TypeError(
                f"dense_capacity: expected a number or 'auto', got {type(value).__name__}"
            ) from None
        if not 0.0 <= capacity <= 1.0:
            raise ValueError(f"dense_capacity: expected a fraction in [0, 1], got {value}")
        return capacity

    def row_limit(self, n: int) -> int:
        """``max_row_nnz`` for FFN width ``n`` (the default when it was left None)."""
        return default_max_row_nnz(n) if self.max_row_nnz is None else self.max_row_nnz

    @property
    def auto_capacity(self) -> bool:
        """Whether ``dense_capacity`` is ``"auto"``."""
        return self.dense_capacity == "auto"

    @property
    def fixed_capacity(self) -> float:
        """``dense_capacity`` as a fraction (0.0 for ``"auto"``)."""
        return 0.0 if self.auto_capacity else float(self.dense_capacity)

    def capacity_rows(self, m: int) -> int:
        """Heavy rows of an ``m``-token call that go through the fixed-size GEMMs
        (:attr:`fixed_capacity` of M; none for ``"auto"``)."""
        return min(m, math.ceil(self.fixed_capacity * m))
