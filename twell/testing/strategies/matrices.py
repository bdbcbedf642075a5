"""Strategies for activations and valid TwELL / Hybrid objects, and the loop-level packer
that serves as their second opinion."""

from __future__ import annotations

from typing import Any

import numpy as np

from twell._arrays import round_bf16
from twell.formats import Hybrid, TwELL
from twell.testing.strategies._draw import (
    IntArg,
    draw_value,
    int_strategy,
    powers_of_two,
    seeds,
    st,
)

#: Tile widths allowed by docs/format.md.
TILES = (32, 64, 128, 256)


# --------------------------------------------------------------------------- helpers
def bf16_values_like(
    rng: np.random.Generator,
    size: int,
    *,
    allow_negative: bool = True,
    allow_subnormal: bool = False,
    max_exponent: int = 20,
) -> np.ndarray:
    """``size`` random nonzero float32 values that are exactly representable in bf16.

    Args:
        rng: the NumPy generator to draw from.
        allow_negative: draw both signs (else positive only, like ReLU outputs).
        allow_subnormal: about 1 in 16 values is a bf16 (float32) subnormal.
        max_exponent: values lie in ``[2**-max_exponent, 2**(max_exponent + 1))``.
    """
    exponent = rng.integers(127 - max_exponent, 127 + max_exponent + 1, size=size)
    mantissa = rng.integers(0, 128, size=size)
    if allow_subnormal:
        subnormal = rng.random(size) < 1 / 16
        exponent = np.where(subnormal, 0, exponent)
        mantissa = np.where(subnormal, rng.integers(1, 128, size=size), mantissa)
    sign = rng.integers(0, 2, size=size) if allow_negative else np.zeros(size, np.int64)
    bits = (sign << 15) | (exponent << 7) | mantissa
    return (bits.astype(np.uint32) << 16).view(np.float32)


def pack(
    h: np.ndarray,
    tile: int,
    slots: int,
    *,
    rng: np.random.Generator | None = None,
    shuffle: bool = False,
    garbage: bool = False,
) -> np.ndarray:
    """Pack a dense matrix into TwELL words, one row-tile at a time (an oracle).

    Written independently of :meth:`TwELL.from_dense` and deliberately simple. Values
    must already be bf16-representable (they are truncated to their high 16 bits).

    Args:
        h: dense ``[M, N]`` float32 (NaN/±Inf allowed; ±0 are not stored).
        tile, slots: the layout.
        rng: generator for ``shuffle`` and ``garbage``.
        shuffle: store the entries of each tile in random order instead of ascending
            columns (order is not part of the format).
        garbage: fill the unspecified words (after the entries, and the whole payload of
            an overflowed tile) with random bits instead of zeros.

    Returns:
        ``uint32 [M, (N / tile) * slots]``.
    """
    rng = rng if rng is not None else np.random.default_rng(0)
    rows, columns = h.shape
    tiles = columns // tile
    if garbage:
        packed = rng.integers(0, 2**32, size=(rows, tiles * slots), dtype=np.uint32)
    else:
        packed = np.zeros((rows, tiles * slots), dtype=np.uint32)
    bits = np.ascontiguousarray(h, dtype=np.float32).view(np.uint32) >> 16
    for m in range(rows):
        for j in range(tiles):
            start = j * slots
            stored = [n for n in range(j * tile, (j + 1) * tile) if h[m, n] != 0]
            packed[m, start] = len(stored)
            if len(stored) > slots - 1:
                continue  # overflowed: the payload is unspecified
            if shuffle:
                stored = [stored[i] for i in rng.permutation(len(stored))]
            for slot, n in enumerate(stored, start=1):
                packed[m, start + slot] = np.uint32(n) | (bits[m, n] << np.uint32(16))
    return packed


# --------------------------------------------------------------------------- layouts
@st.composite
def layouts(
    draw: st.DrawFn,
    tiles: tuple[int, ...] = TILES,
    *,
    min_slots: int = 2,
    max_slots: int | None = None,
    slot_choices: tuple[int, ...] | None = None,
) -> tuple[int, int]:
    """``(tile, slots)``: tile from ``tiles``; slots a power of two in ``[2, tile]``.

    Args:
        tiles: tile widths to draw from (each a power of two in [32, 256]).
        min_slots, max_slots: further bounds on ``slots`` (e.g. ``min_slots=4`` for
            layouts that can hold two entries per tile).
        slot_choices: if given, ``slots`` is one of these (e.g. the layouts a GPU kernel
            was compiled for).
    """
    tile = draw(st.sampled_from(tiles))
    options = powers_of_two(max(2, min_slots), min(tile, max_slots or tile))
    if slot_choices is not None:
        options = [s for s in options if s in slot_choices]
    if not options:
        raise ValueError(f"no slots in [{min_slots}, {max_slots}] fit tile={tile}")
    return tile, draw(st.sampled_from(options))


# --------------------------------------------------------------------------- activations
#: A finite float32 that rounds to +Inf in bfloat16 (above bf16's largest finite value).
_HUGE = float(np.finfo(np.float32).max)

_ROW_KINDS = ("mixed", "mixed", "mixed", "empty", "heavy")


@st.composite
def activations(
    draw: st.DrawFn,
    rows: IntArg = None,
    tiles: IntArg = None,
    tile: IntArg = None,
    slots: IntArg = None,
    *,
    allow_overflow: bool = True,
    allow_nonfinite: bool = False,
    allow_negative: bool = True,
    allow_subnormal: bool = False,
    allow_huge: bool = False,
) -> np.ndarray:
    """Dense float32 ``[rows, tiles * tile]`` activations with controlled per-tile counts.

    Every nonzero is bf16-representable. Each row is one of: empty; *heavy* (every tile
    overflows, or is exactly full when ``allow_overflow`` is false); or *mixed*, where
    each tile independently holds no entry, 1..slots-2 entries, exactly ``slots - 1``
    entries (full), or ``slots..tile`` entries (overflowing, if allowed).

    Args:
        rows: M (default 1..8). ``tiles``: tiles per row (default 1..3).
        tile, slots: the layout the counts are chosen against; drawn by :func:`layouts`
            when not given (use :func:`packing_problems` to learn the drawn layout).
        allow_overflow: allow tiles with more than ``slots - 1`` entries.
        allow_nonfinite: put up to three NaN/±Inf values into the matrix (they replace
            existing entries when there are some, so the counts mostly stay as drawn).
        allow_negative: draw both signs (else positive, like ReLU outputs).
        allow_subnormal: include bf16 subnormal values.
        allow_huge: put up to two finite float32 values beyond the bfloat16 range
            (±3.4e38, which round to ±Inf in bf16) into the matrix: a Hybrid must route
            their rows like non-finite ones.

    ``rows`` may be 0 when given (an empty matrix).
    """
    tile, slots = draw_value(draw, tile), draw_value(draw, slots)
    if tile is None and slots is None:
        tile, slots = draw(layouts())
    elif tile is None:
        tile = draw(st.sampled_from([t for t in TILES if t >= slots]))
    elif slots is None:
        slots = draw(st.sampled_from(powers_of_two(2, tile)))
    n_rows = draw(int_strategy(rows, 1, 8))
    n_tiles = draw(int_strategy(tiles, 1, 3))
    full = slots - 1
    categories = ["zero", "full"]
    if full > 1:
        categories.append("some")
    if allow_overflow:
        categories.append("overflow")
    counts = np.zeros((n_rows, n_tiles), dtype=np.int64)
    for m in range(n_rows):
        kind = draw(st.sampled_from(_ROW_KINDS))
        for j in range(n_tiles):
            if kind == "empty":
                continue
            if kind == "heavy":
                category = "overflow" if allow_overflow else "full"
            else:
                category = draw(st.sampled_from(categories))
            if category == "some":
                counts[m, j] = draw(st.integers(1, full - 1))
            elif category == "full":
                counts[m, j] = full
            elif category == "overflow":
                counts[m, j] = draw(st.integers(slots, tile))
    rng = np.random.default_rng(draw(seeds()))
    h = np.zeros((n_rows, n_tiles * tile), dtype=np.float32)
    for m in range(n_rows):
        for j in range(n_tiles):
            count = int(counts[m, j])
            if count:
                columns = j * tile + rng.choice(tile, size=count, replace=False)
                h[m, columns] = bf16_values_like(
                    rng, count, allow_negative=allow_negative, allow_subnormal=allow_subnormal
                )
    specials: list[float] = []
    if allow_nonfinite:
        specials += draw(st.lists(st.sampled_from([np.nan, np.inf, -np.inf]), max_size=3))
    if allow_huge:
        specials += draw(st.lists(st.sampled_from([_HUGE, -_HUGE]), max_size=2))
    if h.size:
        for value in specials:
            m, n = np.nonzero(h)
            if m.size:
                i = rng.integers(m.size)
                h[m[i], n[i]] = value
            else:
                h[rng.integers(n_rows), rng.integers(h.shape[1])] = value
    return h


@st.composite
def packing_problems(
    draw: st.DrawFn,
    tiles: tuple[int, ...] = TILES,
    *,
    slot_choices: tuple[int, ...] | None = None,
    **kwargs: Any,
) -> tuple:
    """``(h, tile, slots)``: a layout from :func:`layouts` and an activation drawn for it.

    Args:
        tiles: tile widths to draw from; ``slot_choices``: as :func:`layouts`.
        **kwargs: passed on to :func:`activations` (``rows``, ``tiles`` is spelled
            ``row_tiles`` here, ``allow_*``).
    """
    tile, slots = draw(layouts(tiles, slot_choices=slot_choices))
    row_tiles = kwargs.pop("row_tiles", None)
    h = draw(activations(tiles=row_tiles, tile=tile, slots=slots, **kwargs))
    return h, tile, slots


# --------------------------------------------------------------------------- formats
_CONSTRUCTIONS = ("from_dense", "raw")


def _construction(draw: st.DrawFn, construction: str | None) -> str:
    if construction is None:
        return draw(st.sampled_from(_CONSTRUCTIONS))
    if construction not in _CONSTRUCTIONS:
        raise ValueError(f"construction: expected one of {_CONSTRUCTIONS}, got {construction!r}")
    return construction


@st.composite
def twell_matrices(
    draw: st.DrawFn,
    tiles: tuple[int, ...] = TILES,
    *,
    rows: IntArg = None,
    row_tiles: IntArg = None,
    allow_overflow: bool = False,
    allow_nonfinite: bool = False,
    construction: str | None = None,
    with_source: bool = False,
) -> TwELL | tuple[TwELL, np.ndarray]:
    """Valid :class:`TwELL` objects.

    Args:
        tiles: tile widths to draw from; ``rows``, ``row_tiles``: M and tiles per row.
        allow_overflow: allow overflowed tiles (such a TwELL cannot be decoded alone).
        allow_nonfinite: allow NaN/±Inf values (valid in a TwELL; a Hybrid routes them).
        construction: ``"from_dense"`` (:meth:`TwELL.from_dense`), ``"raw"`` (wrap a
            buffer built by :func:`pack` with entries shuffled inside their tiles and
            random bits in every unspecified word), or ``None`` to draw either.
        with_source: return ``(matrix, h)`` with the dense matrix it encodes.
    """
    h, tile, slots = draw(
        packing_problems(
            tiles,
            rows=rows,
            row_tiles=row_tiles,
            allow_overflow=allow_overflow,
            allow_nonfinite=allow_nonfinite,
            allow_subnormal=True,
        )
    )
    if _construction(draw, construction) == "from_dense":
        matrix = TwELL.from_dense(h, tile, slots)
    else:
        rng = np.random.default_rng(draw(seeds()))
        matrix = TwELL(
            pack(h, tile, slots, rng=rng, shuffle=True, garbage=True), h.shape, tile, slots
        )
    return (matrix, h) if with_source else matrix


@st.composite
def hybrid_matrices(
    draw: st.DrawFn,
    tiles: tuple[int, ...] = TILES,
    *,
    rows: IntArg = None,
    row_tiles: IntArg = None,
    allow_overflow: bool = True,
    allow_nonfinite: bool = True,
    allow_huge: bool = False,
    allow_subnormal: bool = True,
    construction: str | None = None,
    with_source: bool = False,
    slot_choices: tuple[int, ...] | None = None,
) -> Hybrid | tuple[Hybrid, np.ndarray]:
    """Valid :class:`Hybrid` objects.

    ``"from_dense"`` uses :meth:`Hybrid.from_dense` (sometimes with a ``max_row_nnz``
    threshold that routes further rows). ``"raw"`` builds the parts by hand: a shuffled,
    garbage-filled buffer from :func:`pack`, ``dense_rows`` = the rows that must be dense
    (overflowed or non-finite) plus a few drawn extra rows, whose TwELL payloads are then
    overwritten with random bits (they are never read; their count words stay true).

    Args: as :func:`twell_matrices`; ``allow_huge`` as :func:`activations` (finite values
    that a TwELL would store as ±Inf: their rows are dense); ``allow_subnormal`` as
    :func:`activations` (on by default; turn it off for GPU kernels, which flush
    subnormals to zero); ``slot_choices`` as :func:`layouts`.
    """
    h, tile, slots = draw(
        packing_problems(
            tiles,
            slot_choices=slot_choices,
            rows=rows,
            row_tiles=row_tiles,
            allow_overflow=allow_overflow,
            allow_nonfinite=allow_nonfinite,
            allow_subnormal=allow_subnormal,
            allow_huge=allow_huge,
        )
    )
    if _construction(draw, construction) == "from_dense":
        threshold = draw(st.none() | st.integers(0, 2 * slots))
        matrix = Hybrid.from_dense(h, tile, slots, max_row_nnz=threshold)
    else:
        rng = np.random.default_rng(draw(seeds()))
        packed = pack(h, tile, slots, rng=rng, shuffle=True, garbage=True)
        counts = (h != 0).reshape(h.shape[0], h.shape[1] // tile, tile).sum(axis=2)
        must = (counts > slots - 1).any(axis=1) | ~np.isfinite(round_bf16(h)).all(axis=1)
        rows_ = h.shape[0]
        extra = np.array(draw(st.lists(st.booleans(), min_size=rows_, max_size=rows_)), bool)
        dense_rows = np.nonzero(must | extra)[0].astype(np.int32)
        for m in dense_rows[extra[dense_rows] & ~must[dense_rows]]:
            words = packed[m].reshape(-1, slots)
            words[:, 1:] = rng.integers(0, 2**32, size=words[:, 1:].shape, dtype=np.uint32)
        ell = TwELL(packed, h.shape, tile, slots)
        matrix = Hybrid(ell, dense_rows, h[dense_rows])
    return (matrix, h) if with_source else matrix
