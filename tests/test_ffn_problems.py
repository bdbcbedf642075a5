"""ffn_problems() works with the ops as they are: the first test a user writes passes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import twell
from twell import reference
from twell.options import DEFAULT_TILE
from twell.reference.forward import ffn_dense
from twell.testing import assert_relative_error
from twell.testing import strategies as tst


@given(tst.ffn_problems())
def test_the_obvious_first_test_passes(p):
    """A drawn problem straight into the ops with their defaults."""
    y = twell.ffn(p.x, p.w_gate, p.w_up, p.w_down)
    assert y.shape == p.x.shape
    np.testing.assert_array_equal(y, reference.ffn(*p))
    np.testing.assert_array_equal(twell.SparseFFN(p.w_gate, p.w_up, p.w_down)(p.x), y)
    assert p.tile == DEFAULT_TILE


@given(tst.ffn_problems(k=st.integers(16, 48)))
def test_a_drawn_problem_meets_the_spec_tolerance_at_the_defaults(p):
    """docs/ops.md's tolerance against dense math (K >= 16: a few terms may cancel)."""
    assert_relative_error(twell.ffn(*p), ffn_dense(*p))


@pytest.mark.parametrize("tile", [32, 64, 128])
def test_a_problem_drawn_at_a_smaller_tile_carries_a_tile_the_ops_take(tile):
    @given(tst.ffn_problems(tile=tile), st.sampled_from([2, 4, 8, 16, 32]))
    def check(p, slots):
        n = p.w_up.shape[0]
        assert n % p.tile == 0 and tile <= p.tile <= DEFAULT_TILE
        y = twell.ffn(*p, tile=p.tile, slots=slots)
        np.testing.assert_array_equal(y, reference.ffn(*p, tile=p.tile, slots=slots))

    check()


def test_small_tiles_draw_small_problems():
    @given(tst.ffn_problems(tile=32, tiles=st.integers(1, 3)))
    def check(p):
        assert p.w_up.shape[0] in (32, 64, 96)
        assert p.tile in (32, 64)

    check()
