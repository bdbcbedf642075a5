"""validate() / check_format() (docs/format.md): reject corruption, accept valid buffers."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from twell import Hybrid, TwELL
from twell.testing import strategies as tst

#: What the message must say for each kind of corruption.
MESSAGES = {
    "count_over_tile": r"packed: row \d+, tile \d+: count \d+ exceeds the tile width",
    "column_outside_tile": r"packed: row \d+, tile \d+, slot \d+: column \d+ lies outside the tile",
    "duplicate_column": r"packed: row \d+, tile \d+, slot \d+: column \d+ is stored twice",
    "zero_value": r"packed: row \d+, tile \d+, slot \d+: stores a zero value",
}


# ------------------------------------------------------------------ valid buffers
@given(tst.twell_matrices(allow_overflow=True, allow_nonfinite=True))
def test_validate_accepts_every_valid_twell(matrix):
    assert matrix.validate() is matrix
    assert matrix.check_format() is matrix


@given(tst.hybrid_matrices())
def test_validate_accepts_every_valid_hybrid(matrix):
    assert matrix.validate() is matrix


@given(tst.packing_problems(allow_nonfinite=True), st.integers(0, 2**32 - 1))
def test_validate_ignores_entry_order_and_unused_words(problem, seed):
    h, tile, slots = problem
    rng = np.random.default_rng(seed)
    packed = tst.pack(h, tile, slots, rng=rng, shuffle=True, garbage=True)
    TwELL(packed, h.shape, tile, slots).validate()


# ------------------------------------------------------------------ corrupt buffers
@pytest.mark.parametrize("kind", tst.CORRUPTIONS)
@given(data=st.data())
def test_validate_rejects_each_corruption(kind, data):
    packed, shape, tile, slots, drawn = data.draw(tst.corrupt_packed(kind))
    assert drawn == kind
    matrix = TwELL(packed, shape, tile, slots)  # dtype and width are fine
    with pytest.raises(ValueError, match=MESSAGES[kind]):
        matrix.validate()


@given(tst.corrupt_packed(allow_overflow=False, allow_nonfinite=False))
def test_hybrid_validate_rejects_corruption_in_light_rows(case):
    packed, shape, tile, slots, kind = case
    rows = np.zeros(0, np.int32)
    hybrid = Hybrid(TwELL(packed, shape, tile, slots), rows, np.zeros((0, shape[1]), np.float32))
    # A count over the tile is also an overflow, reported as a row missing from dense_rows.
    expected = MESSAGES[kind]
    if kind == "count_over_tile":
        expected = f"({expected}|overflowed a tile but has no dense backup)"
    with pytest.raises(ValueError, match=expected):
        hybrid.validate()


@given(tst.corrupt_packed())
def test_hybrid_validate_ignores_payloads_of_dense_rows(case):
    """A dense row's TwELL payload is never read, so junk there is fine (counts are checked)."""
    packed, shape, tile, slots, kind = case
    rows = np.arange(shape[0], dtype=np.int32)
    hybrid = Hybrid(TwELL(packed, shape, tile, slots), rows, np.zeros(shape, np.float32))
    if kind == "count_over_tile":
        with pytest.raises(ValueError, match=MESSAGES[kind]):
            hybrid.validate()
    else:
        hybrid.validate()


@pytest.mark.parametrize("count", [257, 0x10000, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF])
def test_count_words_of_any_size_are_rejected(count):
    packed = np.zeros((2, 8), np.uint32)
    packed[1, 0] = count
    with pytest.raises(ValueError, match=MESSAGES["count_over_tile"]):
        TwELL(packed, (2, 512), 256, 4).validate()


def test_message_locates_the_bad_word():
    h = np.zeros((3, 64), np.float32)
    h[2, 40] = 1.0
    packed = TwELL.from_dense(h, 32, 4).packed.copy()
    packed[2, 5] = (packed[2, 5] & 0xFFFF0000) | 3  # column 3 in tile 1
    with pytest.raises(
        ValueError, match=r"row 2, tile 1, slot 1: column 3 lies outside .*\[32, 64\)"
    ):
        TwELL(packed, (3, 64), 32, 4).validate()


# ------------------------------------------------------------------ constructor checks
@pytest.mark.parametrize("dtype", [np.int32, np.float32, np.uint16, np.int64])
def test_constructor_rejects_wrong_dtype(dtype):
    with pytest.raises(TypeError, match="packed: expected dtype uint32"):
        TwELL(np.zeros((2, 8), dtype), (2, 64), 32, 4)


@pytest.mark.parametrize("shape", [(2, 7), (2, 9), (3, 8), (2, 4, 2), (16,)])
def test_constructor_rejects_wrong_width(shape):
    with pytest.raises(ValueError, match=r"packed: expected shape \(2, 8\)"):
        TwELL(np.zeros(shape, np.uint32), (2, 64), 32, 4)


# ------------------------------------------------------------------ Hybrid routing rules
@given(tst.hybrid_matrices(allow_overflow=True, allow_nonfinite=False), st.data())
def test_hybrid_rejects_a_heavy_row_without_dense_backup(matrix, data):
    overflow = matrix.overflow_rows()
    if not overflow.size:
        return
    victim = data.draw(st.sampled_from(overflow.tolist()))
    keep = matrix.dense_rows != victim
    broken = Hybrid(matrix.ell, matrix.dense_rows[keep], matrix.dense[keep])
    with pytest.raises(ValueError, match=r"dense_rows: row \d+ overflowed a tile but has no dense"):
        broken.validate()


def test_hybrid_rejects_a_nonfinite_light_row():
    h = np.zeros((3, 64), np.float32)
    h[1, 7] = np.nan
    h[2, 9] = -np.inf
    for drop in (1, 2):
        hybrid = Hybrid.from_dense(h, 32, 4)
        keep = hybrid.dense_rows != drop
        broken = Hybrid(hybrid.ell, hybrid.dense_rows[keep], hybrid.dense[keep])
        with pytest.raises(ValueError, match=f"row {drop} holds a non-finite value"):
            broken.validate()


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([2, 1], "dense_rows: expected sorted, unique"),
        ([1, 1], "dense_rows: expected sorted, unique"),
        ([0, 2, 2, 3], "dense_rows: expected sorted, unique"),
        ([-1, 0], r"dense_rows: row ids must lie in \[0, 4\)"),
        ([1, 4], r"dense_rows: row ids must lie in \[0, 4\)"),
        ([9], r"dense_rows: row ids must lie in \[0, 4\)"),
    ],
)
def test_hybrid_rejects_bad_dense_rows(rows, message):
    ell = TwELL.from_dense(np.zeros((4, 64), np.float32), 32, 4)
    dense_rows = np.array(rows, np.int32)
    hybrid = Hybrid(ell, dense_rows, np.zeros((len(rows), 64), np.float32))
    with pytest.raises(ValueError, match=message):
        hybrid.validate()
    with pytest.raises(ValueError, match=message):
        hybrid.check_format()


def test_hybrid_accepts_extra_dense_rows():
    """A producer may route light rows too (docs/format.md): still valid, same matrix."""
    h = np.zeros((4, 64), np.float32)
    h[:, 3] = [1, 2, 3, 4]
    ell = TwELL.from_dense(h, 32, 4)
    rows = np.array([0, 3], np.int32)
    Hybrid(ell, rows, h[rows]).validate()
