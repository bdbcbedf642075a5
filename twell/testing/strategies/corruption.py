"""Strategies for invalid formats: buffers and Hybrids with exactly one defect that
``validate()`` (and so every op and decoder) must reject."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from twell.formats import Hybrid, TwELL
from twell.testing.strategies._draw import IntArg, seeds, st
from twell.testing.strategies.matrices import TILES, activations, bf16_values_like, layouts, pack

#: Kinds of corruption :func:`corrupt_packed` produces (each one :meth:`TwELL.validate`
#: must reject). Wrong dtype and wrong width fail in the constructor and are not here.
CORRUPTIONS = ("count_over_tile", "column_outside_tile", "duplicate_column", "zero_value")


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
    rng = np.random.default_rng(draw(seeds()))
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
    rng = np.random.default_rng(draw(seeds()))
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
