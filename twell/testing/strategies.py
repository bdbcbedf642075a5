"""Hypothesis strategies for twell's formats and ops.

Every strategy is public and composable: sizes are small by default (a test runs in
milliseconds) and every size argument takes an ``int``, a strategy, or ``None`` for the
default range. The structure of a drawn matrix (which row is empty, which tile is full or
overflows) is drawn by Hypothesis, so it shrinks to a minimal case; columns and values
come from a NumPy generator seeded by a drawn integer.

Strategies:
    :func:`layouts`            ``(tile, slots)`` pairs valid under docs/format.md.
    :func:`activations`        dense float32 matrices with controlled per-tile counts.
    :func:`packing_problems`   ``(h, tile, slots)``: a layout and an activation for it.
    :func:`twell_matrices`     valid :class:`TwELL` objects (from_dense or raw buffers).
    :func:`hybrid_matrices`    valid :class:`Hybrid` objects (from_dense or raw parts).
    :func:`corrupt_packed`     ``(packed, shape, tile, slots, kind)`` invalid buffers.
    :func:`corrupt_hybrids`    ``CorruptHybrid(matrix, kind)``: a Hybrid built through the
                               public constructors with one defect ``validate()`` rejects.
    :func:`ffn_problems`       ``FFNProblem(x, w_gate, w_up, w_down)`` for the FFN ops.
    :func:`nonfinite_ffn_problems`  FFN problems with NaN/±Inf planted in the weights
                               (preferably at units no token activates) or in ``x``.
    :func:`malformed`          an argument gone wrong: transposed, flattened, batched,
                               resized, the wrong dtype or type, ``None``, ...

Plain helpers:
    :func:`pack`               an independent, loop-level packer (entry order and unused
                               words under the caller's control): the second opinion on
                               :meth:`TwELL.from_dense`, and the way to build raw buffers.
    :func:`bf16_values_like`   random bf16-representable nonzero float32 values.

Example:
    >>> from hypothesis import given
    >>> from twell import Hybrid
    >>> from twell.testing import assert_same_matrix
    >>> from twell.testing import strategies as tst
    >>> @given(tst.packing_problems(allow_nonfinite=True))
    ... def test_round_trip(problem):
    ...     h, tile, slots = problem
    ...     assert_same_matrix(Hybrid.from_dense(h, tile, slots), h)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
from hypothesis import strategies as st
from scipy.special import ndtri

from twell._arrays import round_bf16
from twell.formats import Hybrid, TwELL

__all__ = [
    "TILES",
    "CORRUPTIONS",
    "FFNProblem",
    "layouts",
    "activations",
    "packing_problems",
    "twell_matrices",
    "hybrid_matrices",
    "corrupt_packed",
    "HYBRID_CORRUPTIONS",
    "CorruptHybrid",
    "corrupt_hybrids",
    "ffn_problems",
    "nonfinite_ffn_problems",
    "MALFORMATIONS",
    "malformed",
    "pack",
    "bf16_values_like",
]

#: Tile widths allowed by docs/format.md.
TILES = (32, 64, 128, 256)

#: Kinds of corruption :func:`corrupt_packed` produces (each one :meth:`TwELL.validate`
#: must reject). Wrong dtype and wrong width fail in the constructor and are not here.
CORRUPTIONS = ("count_over_tile", "column_outside_tile", "duplicate_column", "zero_value")

IntArg = int | st.SearchStrategy[int] | None


def _integers(value: IntArg, low: int, high: int) -> st.SearchStrategy[int]:
    """``value`` as a strategy: an int is fixed, ``None`` means ``[low, high]``."""
    if value is None:
        return st.integers(low, high)
    if isinstance(value, st.SearchStrategy):
        return value
    return st.just(int(value))


def _draw_value(draw: st.DrawFn, value: IntArg) -> int | None:
    """Draw ``value`` if it is a strategy; pass ints and ``None`` through."""
    if isinstance(value, st.SearchStrategy):
        return draw(value)
    return None if value is None else int(value)


def _seeds() -> st.SearchStrategy[int]:
    return st.integers(0, 2**32 - 1)


def _powers_of_two(low: int, high: int) -> list[int]:
    return [1 << i for i in range(16) if low <= 1 << i <= high]


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
    options = _powers_of_two(max(2, min_slots), min(tile, max_slots or tile))
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
    tile, slots = _draw_value(draw, tile), _draw_value(draw, slots)
    if tile is None and slots is None:
        tile, slots = draw(layouts())
    elif tile is None:
        tile = draw(st.sampled_from([t for t in TILES if t >= slots]))
    elif slots is None:
        slots = draw(st.sampled_from(_powers_of_two(2, tile)))
    n_rows = draw(_integers(rows, 1, 8))
    n_tiles = draw(_integers(tiles, 1, 3))
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
    rng = np.random.default_rng(draw(_seeds()))
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
        rng = np.random.default_rng(draw(_seeds()))
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
        rng = np.random.default_rng(draw(_seeds()))
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


# --------------------------------------------------------------------------- corruption
def _tile_words(packed: np.ndarray, m: int, j: int, slots: int) -> np.ndarray:
    return packed[m, j * slots : (j + 1) * slots]


@st.composite
def corrupt_packed(
    draw: st.DrawFn,
    kind: str | None = None,
    tiles: tuple[int, ...] = TILES,
    *,
    allow_overflow: bool = True,
    allow_nonfinite: bool = True,
) -> tuple[np.ndarray, tuple[int, int], int, int, str]:
    """``(packed, shape, tile, slots, kind)``: a buffer with exactly one defect.

    The buffer is valid apart from one row-tile that did not overflow (entries shuffled,
    unused words random), corrupted as ``kind`` says:

    - ``"count_over_tile"``: a count word above ``tile`` (up to ``2**32 - 1``).
    - ``"column_outside_tile"``: a stored column outside its tile's range.
    - ``"duplicate_column"``: two entries of one tile with the same column.
    - ``"zero_value"``: a stored entry whose bf16 value is +0 or -0.

    The constructor accepts such a buffer (dtype and width are right);
    :meth:`TwELL.validate` must reject it.

    Args:
        kind: one of :data:`CORRUPTIONS`, or ``None`` to draw one.
        tiles: tile widths to draw from.
        allow_overflow, allow_nonfinite: whether the valid rest of the buffer may hold
            overflowed tiles and NaN/±Inf values (as in :func:`activations`).
    """
    kind = draw(st.sampled_from(CORRUPTIONS)) if kind is None else kind
    if kind not in CORRUPTIONS:
        raise ValueError(f"kind: expected one of {CORRUPTIONS}, got {kind!r}")
    need = 2 if kind == "duplicate_column" else 1
    tile, slots = draw(layouts(tiles, min_slots=4 if need == 2 else 2))
    h = draw(
        activations(
            tile=tile, slots=slots, allow_overflow=allow_overflow, allow_nonfinite=allow_nonfinite
        )
    )
    rng = np.random.default_rng(draw(_seeds()))
    packed = pack(h, tile, slots, rng=rng, shuffle=True, garbage=True)
    rows, tiles_per_row = h.shape[0], h.shape[1] // tile
    counts = packed[:, ::slots].astype(np.int64)
    usable = np.argwhere((counts >= need) & (counts <= slots - 1))
    if kind == "count_over_tile":
        m, j = draw(st.integers(0, rows - 1)), draw(st.integers(0, tiles_per_row - 1))
        _tile_words(packed, m, j, slots)[0] = draw(st.integers(tile + 1, 2**32 - 1))
        return packed, h.shape, tile, slots, kind
    if usable.size:
        m, j = (int(i) for i in usable[draw(st.integers(0, len(usable) - 1))])
    else:  # no tile holds enough entries: write a valid one first
        m, j = draw(st.integers(0, rows - 1)), draw(st.integers(0, tiles_per_row - 1))
        words = _tile_words(packed, m, j, slots)
        columns = j * tile + rng.choice(tile, size=need, replace=False)
        values = bf16_values_like(rng, need).view(np.uint32) >> 16
        words[0] = need
        words[1 : need + 1] = columns.astype(np.uint32) | (values << np.uint32(16))
    words = _tile_words(packed, m, j, slots)
    count = int(words[0])
    slot = draw(st.integers(1, count))
    if kind == "column_outside_tile":
        column = draw(st.integers(0, 65535 - tile))
        column = column if column < j * tile else column + tile  # skip the tile's range
        words[slot] = (words[slot] & np.uint32(0xFFFF0000)) | np.uint32(column)
    elif kind == "zero_value":
        sign = draw(st.sampled_from([0x0000, 0x8000]))
        words[slot] = (words[slot] & np.uint32(0xFFFF)) | np.uint32(sign << 16)
    else:  # duplicate_column: copy another entry's column
        other = draw(st.integers(1, count - 1))
        other = other if other < slot else other + 1
        column = words[other] & np.uint32(0xFFFF)
        words[slot] = (words[slot] & np.uint32(0xFFFF0000)) | column
    return packed, h.shape, tile, slots, kind


#: Kinds of defect :func:`corrupt_hybrids` produces, each one :meth:`Hybrid.validate`
#: rejects: the TwELL corruptions of :data:`CORRUPTIONS` in a light row, and
HYBRID_CORRUPTIONS = CORRUPTIONS + (
    "count_one_too_high",  # a light row-tile's count + 1, the next word left zero
    "dense_backup_dropped",  # a row that must be dense (overflow, NaN/Inf) left out
    "row_id_negative",  # a negative id in dense_rows
    "row_id_out_of_range",  # an id >= M in dense_rows
    "row_ids_unsorted",  # dense_rows out of order
    "row_id_repeated",  # an id twice in dense_rows (with its dense row twice)
)


class CorruptHybrid(NamedTuple):
    """A :class:`Hybrid` built through the public constructors, with one defect."""

    matrix: Hybrid
    kind: str


@st.composite
def corrupt_hybrids(
    draw: st.DrawFn,
    kind: str | None = None,
    tiles: tuple[int, ...] = TILES,
    *,
    rows: IntArg = None,
    row_tiles: IntArg = None,
    slot_choices: tuple[int, ...] | None = None,
) -> CorruptHybrid:
    """Hybrids wrapped around user buffers (``TwELL(packed, ...)``, ``Hybrid(ell, ...)``)
    with exactly one defect of :data:`HYBRID_CORRUPTIONS`.

    Everything else is valid and as untidy as a user's buffer may be (entries shuffled,
    unused words random, extra dense rows with junk TwELL payloads). The constructors
    accept such an object (types and shapes are right); :meth:`Hybrid.validate`, and so
    every op and decoder, must reject it with ``ValueError``.

    Args:
        kind: one of :data:`HYBRID_CORRUPTIONS`, or ``None`` to draw one.
        tiles: tile widths to draw from; ``rows``, ``row_tiles``: as :func:`activations`;
            ``slot_choices``: as :func:`layouts`.
    """
    kind = draw(st.sampled_from(HYBRID_CORRUPTIONS)) if kind is None else kind
    if kind not in HYBRID_CORRUPTIONS:
        raise ValueError(f"kind: expected one of {HYBRID_CORRUPTIONS}, got {kind!r}")
    need = {"duplicate_column": 2, "count_one_too_high": 0}.get(kind, 1)
    tile, slots = draw(layouts(tiles, min_slots=4 if need == 2 else 2, slot_choices=slot_choices))
    h = draw(activations(rows, row_tiles, tile, slots, allow_overflow=True, allow_nonfinite=True))
    rng = np.random.default_rng(draw(_seeds()))
    counts = (h != 0).reshape(h.shape[0], h.shape[1] // tile, tile).sum(axis=2)
    must = (counts > slots - 1).any(axis=1) | ~np.isfinite(h).all(axis=1)
    if kind == "dense_backup_dropped" and not must.any():
        m = draw(st.integers(0, h.shape[0] - 1))  # make a heavy row: a NaN, or an overflow
        if draw(st.booleans()):
            h[m, draw(st.integers(0, h.shape[1] - 1))] = np.nan
        else:
            h[m, :slots] = bf16_values_like(rng, slots)
        must[m] = True
    light_kinds = CORRUPTIONS + ("count_one_too_high",)
    if kind in light_kinds or kind.startswith("row_id") or kind == "row_ids_unsorted":
        h = np.concatenate([h, np.zeros((1, h.shape[1]), np.float32)])  # a light row
        must = np.append(must, False)
    m_light = int(np.nonzero(~must)[0][-1]) if (~must).any() else -1
    j = draw(st.integers(0, h.shape[1] // tile - 1))
    if kind in light_kinds:
        # Give the chosen light row-tile exactly `need` (or more, up to a full tile) entries.
        have = int(np.count_nonzero(h[m_light, j * tile : (j + 1) * tile]))
        if have < need or have > slots - 1:
            h[m_light, j * tile : (j + 1) * tile] = 0
            columns = j * tile + rng.choice(tile, size=need, replace=False)
            h[m_light, columns] = bf16_values_like(rng, need)
    packed = pack(h, tile, slots, rng=rng, shuffle=True, garbage=True)
    extra = np.array(draw(st.lists(st.booleans(), min_size=h.shape[0], max_size=h.shape[0])), bool)
    if m_light >= 0:
        extra[m_light] = False  # the row to corrupt stays light
    dense_rows = np.nonzero(must | extra)[0].astype(np.int32)
    for m in dense_rows[extra[dense_rows] & ~must[dense_rows]]:
        words = packed[m].reshape(-1, slots)
        words[:, 1:] = rng.integers(0, 2**32, size=words[:, 1:].shape, dtype=np.uint32)
    words = packed[m_light, j * slots : (j + 1) * slots]
    count = int(words[0])
    if kind == "count_over_tile":
        words[0] = draw(st.integers(tile + 1, 2**32 - 1))
    elif kind == "count_one_too_high":
        words[0] = count + 1
        if count + 1 <= slots - 1:
            words[count + 1] = 0  # what a zero-filling producer leaves after the entries
    elif kind in CORRUPTIONS:
        slot = draw(st.integers(1, count))
        if kind == "column_outside_tile":
            column = draw(st.integers(0, 65535 - tile))
            column = column if column < j * tile else column + tile
            words[slot] = (words[slot] & np.uint32(0xFFFF0000)) | np.uint32(column)
        elif kind == "zero_value":
            sign = draw(st.sampled_from([0x0000, 0x8000]))
            words[slot] = (words[slot] & np.uint32(0xFFFF)) | np.uint32(sign << 16)
        else:  # duplicate_column
            other = draw(st.integers(1, count - 1))
            other = other if other < slot else other + 1
            words[slot] = (words[slot] & np.uint32(0xFFFF0000)) | (words[other] & 0xFFFF)
    elif kind == "dense_backup_dropped":
        victim = draw(st.sampled_from(np.nonzero(must)[0].tolist()))
        dense_rows = dense_rows[dense_rows != victim]
    elif kind == "row_id_negative":
        dense_rows = np.concatenate([[-draw(st.integers(1, 2**31))], dense_rows])
    elif kind == "row_id_out_of_range":
        dense_rows = np.append(dense_rows, draw(st.integers(h.shape[0], 2**31 - 1)))
    elif kind == "row_ids_unsorted":
        if dense_rows.size < 2:  # M >= 2 here (a light row was appended)
            dense_rows = np.union1d(dense_rows, [0, m_light])
        dense_rows = dense_rows[::-1].copy()
    else:  # row_id_repeated
        if dense_rows.size:
            repeated = draw(st.sampled_from(dense_rows.tolist()))
            dense_rows = np.sort(np.append(dense_rows, repeated))
        else:  # M >= 2 here (a light row was appended)
            dense_rows = np.array([m_light, m_light])
    dense_rows = dense_rows.astype(np.int32)
    safe = np.clip(dense_rows, 0, h.shape[0] - 1)  # the values the user copied
    ell = TwELL(packed, h.shape, tile, slots)
    return CorruptHybrid(Hybrid(ell, dense_rows, h[safe]), kind)


# --------------------------------------------------------------------------- FFN problems
class FFNProblem(NamedTuple):
    """One FFN block's inputs, float32 and bf16-representable (``torch.nn.Linear`` layout).

    ``x`` ``[M, K]``; ``w_gate`` ``[N, K]`` or ``None`` (non-gated); ``w_up`` ``[N, K]``;
    ``w_down`` ``[K, N]``.
    """

    x: np.ndarray
    w_gate: np.ndarray | None
    w_up: np.ndarray
    w_down: np.ndarray


#: Firing probabilities of the gate units (docs/benchmark.md's ``uniform`` at small N).
_FIRING = (0.02, 0.05, 0.1, 0.3)


@st.composite
def ffn_problems(
    draw: st.DrawFn,
    gated: bool | st.SearchStrategy[bool] | None = None,
    *,
    rows: IntArg = None,
    k: IntArg = None,
    tiles: IntArg = None,
    tile: int = 32,
    allow_heavy: bool = True,
) -> FFNProblem:
    """Inputs of a gated or non-gated FFN block, sparse like docs/benchmark.md's ``uniform``.

    ``x[:, 0] = 1`` and column 0 of the gating weight (``w_gate``, or ``w_up`` when
    non-gated) is ``-z`` with ``z = Φ⁻¹(1 - p)``, so a fraction ``p`` (drawn from
    0.02..0.3) of the units fire per token. With ``allow_heavy`` some tokens have
    ``x[:, 1:]`` scaled by 3: they fire many units and overflow small ``slots``.

    Args:
        gated: ``True``/``False``, a strategy, or ``None`` to draw.
        rows: M (default: 1 about a fifth of the time, else 2..16).
        k: K (default 2..16). ``tiles``: N / tile (default 1..3).
        tile: N is a multiple of this.
        allow_heavy: allow heavy tokens.
    """
    if gated is None:
        gated = draw(st.booleans())
    elif isinstance(gated, st.SearchStrategy):
        gated = draw(gated)
    m = _draw_value(draw, rows)
    if m is None:  # decode (M = 1) about a fifth of the time
        m = 1 if draw(st.integers(0, 4)) == 0 else draw(st.integers(2, 16))
    k_ = draw(_integers(k, 2, 16))
    n = draw(_integers(tiles, 1, 3)) * tile
    p = draw(st.sampled_from(_FIRING))
    heavy_share = draw(st.sampled_from([0.0, 0.0, 0.25])) if allow_heavy else 0.0
    rng = np.random.default_rng(draw(_seeds()))

    x = rng.standard_normal((m, k_))
    x[:, 0] = 1.0
    x[rng.random(m) < heavy_share, 1:] *= 3.0
    gating = rng.standard_normal((n, k_)) / np.sqrt(k_ - 1)
    gating[:, 0] = -ndtri(1.0 - p)
    w_up = rng.standard_normal((n, k_)) / np.sqrt(k_)
    w_down = rng.standard_normal((k_, n)) / np.sqrt(n)

    def bf16(a: np.ndarray) -> np.ndarray:
        return round_bf16(a.astype(np.float32))

    if gated:
        return FFNProblem(bf16(x), bf16(gating), bf16(w_up), bf16(w_down))
    return FFNProblem(bf16(x), None, bf16(gating), bf16(w_down))


@st.composite
def nonfinite_ffn_problems(
    draw: st.DrawFn,
    gated: bool | st.SearchStrategy[bool] | None = None,
    *,
    places: tuple[str, ...] = ("w_gate", "w_up", "w_down"),
    max_values: int = 3,
    **kwargs: Any,
) -> FFNProblem:
    """An :func:`ffn_problems` block with 1..``max_values`` NaN/±Inf values planted.

    Each value goes into one of ``places`` (``"x"`` may be added; ``"w_gate"`` falls back
    to ``w_up`` for a non-gated block). Weight values go, when there is one, to a unit
    that no token activates: that is where a sparse path that skips inactive units
    differs from dense math, which computes ``0 · Inf = NaN`` there.

    Args:
        gated: as :func:`ffn_problems`. ``**kwargs``: passed on to it.
        places: where values may go: any of ``"x"``, ``"w_gate"``, ``"w_up"``,
            ``"w_down"``.
        max_values: most values planted.
    """
    problem = draw(ffn_problems(gated, **kwargs))
    arrays = {name: None if a is None else a.copy() for name, a in problem._asdict().items()}
    gating = arrays["w_gate"] if arrays["w_gate"] is not None else arrays["w_up"]
    with np.errstate(all="ignore"):
        pre = problem.x.astype(np.float64) @ gating.T.astype(np.float64)
    inactive = np.nonzero((pre <= 0).all(axis=0))[0]
    n, k = gating.shape
    for _ in range(draw(st.integers(1, max_values))):
        place = draw(st.sampled_from(places))
        if place == "w_gate" and arrays["w_gate"] is None:
            place = "w_up"
        value = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
        if place == "x":
            row = draw(st.integers(0, problem.x.shape[0] - 1))
            arrays["x"][row, draw(st.integers(0, k - 1))] = value
            continue
        pool = inactive if inactive.size and draw(st.integers(0, 3)) else np.arange(n)
        unit = int(pool[draw(st.integers(0, len(pool) - 1))])
        column = draw(st.integers(0, k - 1))
        if place == "w_down":
            arrays["w_down"][column, unit] = value
        else:
            arrays[place][unit, column] = value
    return FFNProblem(**arrays)


#: What :func:`malformed` does to an argument.
MALFORMATIONS = (
    "same",  # unchanged (so that the valid path is exercised too)
    "transposed",  # a.T (for an N-D array: axes reversed)
    "flattened",  # a.ravel()
    "batched",  # a[None]: an extra leading axis
    "unsqueezed",  # a[..., None]: an extra trailing axis
    "shorter",  # one axis one shorter (possibly down to 0)
    "longer",  # one axis one longer (the new entries are zero)
    "float16",  # another floating dtype (valid: twell takes it)
    "integer",  # int32 values
    "boolean",  # bool values
    "complex",  # complex64 values
    "list",  # a Python list
    "scalar",  # a Python float
    "none",  # None
)


@st.composite
def malformed(
    draw: st.DrawFn, array: np.ndarray, kinds: tuple[str, ...] = MALFORMATIONS
) -> tuple[Any, str]:
    """``(value, kind)``: ``array`` gone wrong in one of ``kinds`` (:data:`MALFORMATIONS`).

    Some results are still valid arguments (``"same"``, ``"float16"``, a ``"batched"`` x,
    a transposed square matrix, ``None`` for an optional ``w_gate``): a property test
    decides validity with its own rule and checks that the op raises ``TypeError`` or
    ``ValueError`` exactly when the argument is invalid, and otherwise returns what dense
    math returns for the argument as it is.
    """
    kind = draw(st.sampled_from(kinds))
    if kind == "same":
        return array, kind
    if kind == "transposed":
        return np.ascontiguousarray(array.T), kind
    if kind == "flattened":
        return array.ravel(), kind
    if kind == "batched":
        return array[None], kind
    if kind == "unsqueezed":
        return array[..., None], kind
    if kind in ("shorter", "longer"):
        if array.ndim == 0:
            return array, "same"
        axis = draw(st.integers(0, array.ndim - 1))
        if kind == "shorter":
            return np.take(array, np.arange(max(0, array.shape[axis] - 1)), axis=axis), kind
        pad = [(0, 1 if a == axis else 0) for a in range(array.ndim)]
        return np.pad(array, pad), kind
    if kind == "float16":
        with np.errstate(over="ignore"):
            return array.astype(np.float16), kind
    if kind == "integer":
        with np.errstate(invalid="ignore"):
            return np.nan_to_num(array).astype(np.int32), kind
    if kind == "boolean":
        return array != 0, kind
    if kind == "complex":
        return array.astype(np.complex64), kind
    if kind == "list":
        return array.tolist(), kind
    if kind == "scalar":
        return 1.0, kind
    return None, kind
