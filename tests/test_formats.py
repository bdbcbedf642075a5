"""TwELL and Hybrid (docs/format.md): round trips, statistics, the packed words themselves."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from twell import Hybrid, TwELL
from twell._arrays import round_bf16
from twell.testing import assert_same_matrix
from twell.testing import strategies as tst


def tile_counts(h: np.ndarray, tile: int) -> np.ndarray:
    """True nonzeros per row-tile of a dense matrix (NaN counts)."""
    return (h != 0).reshape(h.shape[0], -1, tile).sum(axis=2)


def overflowing_rows(h: np.ndarray, tile: int, slots: int) -> np.ndarray:
    return np.nonzero((tile_counts(h, tile) > slots - 1).any(axis=1))[0]


# ------------------------------------------------------------------ round trips
@given(tst.twell_matrices(allow_nonfinite=True, with_source=True))
def test_twell_round_trip_is_exact(case):
    matrix, h = case
    assert_same_matrix(matrix, h)
    np.testing.assert_array_equal(matrix.to_dense(), h)


@given(tst.hybrid_matrices(with_source=True))
def test_hybrid_round_trip_is_exact(case):
    matrix, h = case
    assert_same_matrix(matrix, h)
    np.testing.assert_array_equal(matrix.to_dense(), h)
    np.testing.assert_array_equal(matrix.to_dense(np.float64), h.astype(np.float64))


@given(st.data())
def test_from_dense_rounds_values_to_bf16(data):
    tile, slots = data.draw(tst.layouts())
    rows = data.draw(st.integers(1, 6))
    seed = data.draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    h = rng.standard_normal((rows, 2 * tile)).astype(np.float32)
    h[rng.random(h.shape) < 0.9] = 0
    h[0, 0] = 1e-41  # a float32 subnormal that rounds to bf16 zero: not stored
    hybrid = Hybrid.from_dense(h, tile, slots)
    expected = round_bf16(h)
    assert expected[0, 0] == 0
    # Light rows carry bf16 values; the dense backup keeps the caller's values.
    expected[hybrid.dense_rows] = h[hybrid.dense_rows]
    assert_same_matrix(hybrid, expected)
    assert_same_matrix(hybrid, h, round_to_bf16=True)


@pytest.mark.parametrize("rows", [0, 1, 3])
def test_all_zero_and_empty_matrices(rows):
    h = np.zeros((rows, 64), np.float32)
    for matrix in (TwELL.from_dense(h, 32, 4), Hybrid.from_dense(h, 32, 4)):
        assert matrix.nnz == 0
        assert matrix.overflow_rows().size == 0
        assert matrix.to_dense().shape == (rows, 64)
        assert matrix.to_csr().nnz == 0
        assert "nnz=0" in repr(matrix)


# ------------------------------------------------------------------ statistics
@given(tst.packing_problems(allow_nonfinite=True))
def test_overflow_rows_are_the_rows_with_a_full_tile_exceeded(problem):
    h, tile, slots = problem
    ell = TwELL.from_dense(h, tile, slots)
    expected = overflowing_rows(h, tile, slots)
    np.testing.assert_array_equal(ell.overflow_rows(), expected)
    assert ell.overflow_rows().dtype == np.int32
    np.testing.assert_array_equal(Hybrid.from_dense(h, tile, slots).overflow_rows(), expected)


@given(tst.packing_problems(allow_nonfinite=True))
def test_hybrid_dense_rows_are_overflow_and_nonfinite_rows(problem):
    h, tile, slots = problem
    hybrid = Hybrid.from_dense(h, tile, slots)
    must = (tile_counts(h, tile) > slots - 1).any(axis=1) | ~np.isfinite(h).all(axis=1)
    np.testing.assert_array_equal(hybrid.dense_rows, np.nonzero(must)[0])
    assert hybrid.dense_rows.dtype == np.int32
    np.testing.assert_array_equal(hybrid.dense, h[must])
    hybrid.validate()


@given(tst.packing_problems(allow_nonfinite=True))
def test_count_word_is_the_true_count_even_on_overflow(problem):
    h, tile, slots = problem
    ell = TwELL.from_dense(h, tile, slots)
    expected = tile_counts(h, tile)
    np.testing.assert_array_equal(ell.packed[:, ::slots], expected)
    np.testing.assert_array_equal(ell.counts(), expected)
    assert ell.counts().dtype == np.int64  # unsigned count words never turn negative
    assert ell.nnz == np.count_nonzero(h)
    hybrid = Hybrid.from_dense(h, tile, slots)
    np.testing.assert_array_equal(hybrid.counts(), expected)
    assert hybrid.nnz == np.count_nonzero(h)


@given(tst.hybrid_matrices(with_source=True))
def test_hybrid_counts_on_raw_parts(case):
    matrix, h = case
    np.testing.assert_array_equal(matrix.counts(), tile_counts(h, matrix.tile))
    assert matrix.nnz == np.count_nonzero(h)


# ------------------------------------------------------------------ the packed words
def decoded_tiles(packed: np.ndarray, tile: int, slots: int) -> dict:
    """{(row, tile): (count, {column: value bits})} for the tiles that did not overflow."""
    out = {}
    words = packed.reshape(packed.shape[0], -1, slots)
    for m in range(words.shape[0]):
        for j in range(words.shape[1]):
            count = int(words[m, j, 0])
            entries = {}
            if count <= slots - 1:
                for word in words[m, j, 1 : count + 1].tolist():
                    entries[word & 0xFFFF] = word >> 16
            out[(m, j)] = (count, entries)
    return out


@given(tst.packing_problems(allow_nonfinite=True, allow_subnormal=True))
def test_packed_entries_are_the_dense_nonzeros(problem):
    h, tile, slots = problem
    ell = TwELL.from_dense(h, tile, slots)
    got = decoded_tiles(ell.packed, tile, slots)
    want = decoded_tiles(tst.pack(h, tile, slots), tile, slots)
    assert got == want
    # Each stored column lies in its tile; each stored value is the dense value.
    bits = h.view(np.uint32) >> 16
    for (m, j), (count, entries) in got.items():
        assert count == np.count_nonzero(h[m, j * tile : (j + 1) * tile])
        for column, value in entries.items():
            assert j * tile <= column < (j + 1) * tile
            assert value == bits[m, column]


@given(tst.packing_problems(allow_nonfinite=True))
def test_from_dense_is_deterministic_with_ascending_columns(problem):
    h, tile, slots = problem
    first = TwELL.from_dense(h, tile, slots).packed
    np.testing.assert_array_equal(first, TwELL.from_dense(h.copy(), tile, slots).packed)
    words = first.reshape(h.shape[0], -1, slots)
    for m, j in np.ndindex(words.shape[:2]):
        count = min(int(words[m, j, 0]), slots - 1)
        columns = words[m, j, 1 : count + 1] & 0xFFFF
        assert np.all(np.diff(columns.astype(np.int64)) > 0)


@given(tst.twell_matrices(allow_nonfinite=True))
def test_twell_to_csr_agrees_with_to_dense(matrix):
    csr = matrix.to_csr()
    assert csr.shape == matrix.shape
    assert csr.nnz == matrix.nnz
    np.testing.assert_array_equal(csr.toarray(), matrix.to_dense())


@given(tst.hybrid_matrices())
def test_hybrid_to_csr_agrees_with_to_dense(matrix):
    csr = matrix.to_csr()
    assert csr.shape == matrix.shape
    assert csr.nnz == matrix.nnz
    np.testing.assert_array_equal(csr.toarray(), matrix.to_dense())


@given(tst.packing_problems(allow_overflow=True))
def test_twell_to_dense_refuses_overflowed_rows(problem):
    h, tile, slots = problem
    ell = TwELL.from_dense(h, tile, slots)
    if ell.overflow_rows().size:
        with pytest.raises(ValueError, match="overflowed a tile"):
            ell.to_dense()
    else:
        np.testing.assert_array_equal(ell.to_dense(), h)


def test_repr_names_shape_layout_and_sizes():
    h = np.zeros((4, 64), np.float32)
    h[1, :40] = 1.0  # overflows tile 0 at slots=4
    h[2, 3] = 2.0
    ell = TwELL.from_dense(h, 32, 4)
    assert repr(ell) == (
        "<TwELL shape=(4, 64) tile=32 slots=4 nnz=41 overflow_rows=1 bytes=128 (numpy)>"
    )
    text = repr(Hybrid.from_dense(h, 32, 4))
    for part in ("shape=(4, 64)", "tile=32", "slots=4", "nnz=41", "dense_rows=1 (25.00%)"):
        assert part in text


# ------------------------------------------------------------------ a worked example
def test_worked_example_packed_words():
    """A 3 × 64 matrix at tile=32, slots=4, packed by hand.

    Row 0: 1.0 at column 1, -2.0 at 5 (tile 0); 0.5 at 40 (tile 1).
    Row 1: 1.5 at columns 32..35: four entries in tile 1 > slots - 1 = 3, overflow.
    Row 2: 3.0 at column 31 (last of tile 0); 0.1 at 63, which rounds to the bf16
    0x3DCD = 0.10009765625 (float32 0x3DCCCCCD, low half 0xCCCD > 0x8000: round up).

    Word = column | bf16 bits << 16: 1.0 → 0x3F80, -2.0 → 0xC000, 0.5 → 0x3F00,
    1.5 → 0x3FC0, 3.0 → 0x4040.
    """
    h = np.zeros((3, 64), np.float32)
    h[0, [1, 5, 40]] = [1.0, -2.0, 0.5]
    h[1, 32:36] = 1.5
    h[2, [31, 63]] = [3.0, 0.1]
    ell = TwELL.from_dense(h, tile=32, slots=4)
    # fmt: off
    expected = np.array([
        [0x00000002, 0x3F800001, 0xC0000005, 0x00000000,   0x00000001, 0x3F000028, 0, 0],
        [0x00000000, 0x00000000, 0x00000000, 0x00000000,   0x00000004, 0, 0, 0],
        [0x00000001, 0x4040001F, 0x00000000, 0x00000000,   0x00000001, 0x3DCD003F, 0, 0],
    ], dtype=np.uint32)
    # fmt: on
    # Row 1, tile 1 overflowed: its payload (words 5..7) is unspecified.
    payload = np.ones_like(expected, dtype=bool)
    payload[1, 5:8] = False
    np.testing.assert_array_equal(ell.packed[payload], expected[payload])
    np.testing.assert_array_equal(ell.counts(), [[2, 1], [0, 4], [1, 1]])
    np.testing.assert_array_equal(ell.overflow_rows(), [1])
    assert ell.nnz == 9

    hybrid = Hybrid.from_dense(h, tile=32, slots=4)
    np.testing.assert_array_equal(hybrid.dense_rows, [1])  # the heavy row is routed
    np.testing.assert_array_equal(hybrid.dense, h[1:2])
    decoded = hybrid.to_dense()
    assert decoded[2, 63] == np.float32(0.10009765625)
    decoded[2, 63] = np.float32(0.1)
    np.testing.assert_array_equal(decoded, h)

    # The same words wrapped raw, entries in another order and junk in unused words.
    raw = expected.copy()
    raw[0, 1:3] = raw[0, [2, 1]]
    raw[0, 3] = 0xDEADBEEF
    raw[1, 5:8] = 0xFFFFFFFF
    wrapped = Hybrid(TwELL(raw, (3, 64), 32, 4), np.array([1], np.int32), h[1:2]).validate()
    assert_same_matrix(wrapped, hybrid)


def test_docs_format_worked_example():
    """The example of docs/format.md, word for word (keep the two in step)."""
    h = np.zeros((3, 64), np.float32)
    h[0, [3, 5, 40]] = [1.0, -2.5, 0.75]
    h[1, 0:5] = [1, 2, 3, 4, 5]
    h[1, 50] = 0.5
    h[2, [7, 33]] = [2.0, np.nan]
    hybrid = Hybrid.from_dense(h, tile=32, slots=4)
    # fmt: off
    expected = np.array([
        [0x00000002, 0x3F800003, 0xC0200005, 0x00000000, 0x00000001, 0x3F400028, 0, 0],
        [0x00000005, 0x3F800000, 0x40000001, 0x40400002, 0x00000001, 0x3F000032, 0, 0],
        [0x00000001, 0x40000007, 0x00000000, 0x00000000, 0x00000001, 0x7FC00021, 0, 0],
    ], dtype=np.uint32)
    # fmt: on
    np.testing.assert_array_equal(hybrid.packed, expected)
    np.testing.assert_array_equal(hybrid.dense_rows, [1, 2])
    np.testing.assert_array_equal(hybrid.dense, h[1:])
    np.testing.assert_array_equal(hybrid.to_dense(), h)
    hybrid.validate()


# ------------------------------------------------------------------ raw construction
def test_constructor_wraps_without_copying():
    packed = np.zeros((2, 8), np.uint32)
    ell = TwELL(packed, (2, 64), 32, 4)
    assert ell.packed is packed
    rows, dense = np.zeros(0, np.int32), np.zeros((0, 64), np.float32)
    hybrid = Hybrid(ell, rows, dense)
    assert hybrid.ell is ell and hybrid.dense_rows is rows and hybrid.dense is dense
