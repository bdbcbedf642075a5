"""The NumPy reference (docs/ops.md): through the formats it equals plain dense math."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import twell
from twell import Hybrid, reference
from twell._arrays import bf16_bits, round_bf16
from twell.reference.forward import ffn_dense, relu
from twell.testing import (
    assert_relative_error,
    assert_same_matrix,
    assert_same_nonfinite,
    relative_error,
)
from twell.testing import strategies as tst


def ffn_bf16_gate(x, w_gate, w_up, w_down):
    """Dense float64 math with the gate rounded to bf16, as the reference models it."""
    x, w_up, w_down = (np.asarray(a, np.float64) for a in (x, w_up, w_down))
    if w_gate is None:
        return round_bf16(relu(x @ w_up.T)).astype(np.float64) @ w_down.T
    g = round_bf16(relu(x @ np.asarray(w_gate, np.float64).T)).astype(np.float64)
    return (g * (x @ w_up.T)) @ w_down.T


def close(actual, expected, tol=1e-12):
    assert actual.shape == expected.shape
    assert relative_error(actual, expected) <= tol


# ------------------------------------------------------------------ bf16 rounding
def ml_dtypes_bits(values: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        return values.astype(ml_dtypes.bfloat16).view(np.uint16).astype(np.uint32)


def check_bf16_bits(values: np.ndarray) -> None:
    ours, theirs = bf16_bits(values), ml_dtypes_bits(values)
    nan = np.isnan(values)
    # NaN payloads may differ; both must be quiet NaNs of the same sign.
    np.testing.assert_array_equal(ours[~nan], theirs[~nan])
    assert np.all((ours[nan] & 0x7FC0) == 0x7FC0)
    np.testing.assert_array_equal(ours[nan] >> 15, values[nan].view(np.uint32) >> 31)


@given(hnp.arrays(np.float32, st.integers(1, 64), elements=st.floats(width=32)))
def test_bf16_rounding_matches_ml_dtypes(values):
    check_bf16_bits(values)


def test_bf16_rounding_matches_ml_dtypes_on_random_and_special_bit_patterns():
    rng = np.random.default_rng(0)
    patterns = [
        rng.integers(0, 2**32, size=1 << 20, dtype=np.uint32),
        # ties (low half exactly 0x8000) with even and odd kept halves, near-ties, carries
        (rng.integers(0, 2**16, size=4096, dtype=np.uint32) << 16) | np.uint32(0x8000),
        (rng.integers(0, 2**16, size=4096, dtype=np.uint32) << 16) | np.uint32(0x7FFF),
        (rng.integers(0, 2**16, size=4096, dtype=np.uint32) << 16) | np.uint32(0x8001),
        np.arange(0, 1 << 16, dtype=np.uint32),  # zero and float32 subnormals
        np.array([0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000, 0xFF800000, 0x7F800001, 0x80000000]),
    ]
    for bits in patterns:
        check_bf16_bits(np.asarray(bits, np.uint32).view(np.float32))


# ------------------------------------------------------------------ forward ops
def rounding_bound(x, w_gate, w_up, w_down):
    """Elementwise bound on |ffn - ffn_dense| from rounding each gate value to bf16.

    bf16 keeps 8 significant bits (unit roundoff 2**-8); the gate goes float64 → float32
    → bf16, which adds at most 2**-23 relative.
    """
    x, w_up, w_down = (np.asarray(a, np.float64) for a in (x, w_up, w_down))
    if w_gate is None:
        magnitude = np.abs(relu(x @ w_up.T))
    else:
        magnitude = np.abs(relu(x @ np.asarray(w_gate, np.float64).T) * (x @ w_up.T))
    return (2.0**-8 + 2.0**-20) * (magnitude @ np.abs(w_down).T)


@given(tst.ffn_problems(), tst.layouts(tiles=(32,)))
def test_ffn_through_the_formats_equals_dense_math(problem, layout):
    tile, slots = layout
    y = reference.ffn(*problem, tile=tile, slots=slots)
    assert y.dtype == np.float64
    y_dense = ffn_dense(*problem)
    bound = rounding_bound(*problem)
    assert np.all(np.abs(y - y_dense) <= bound + 1e-12 * (1 + bound.max()))
    # It models exactly one rounding point: the gate values, rounded to bf16.
    close(y, ffn_bf16_gate(*problem))


@given(tst.ffn_problems(rows=st.integers(4, 16), k=st.integers(16, 48)), tst.layouts(tiles=(32,)))
def test_ffn_meets_the_spec_tolerance(problem, layout):
    """docs/ops.md: ‖y − y_ref‖ / ‖y_ref‖ ≤ 1e-2 (at tiny K a few terms may cancel, so K ≥ 16)."""
    tile, slots = layout
    assert_relative_error(reference.ffn(*problem, tile=tile, slots=slots), ffn_dense(*problem))


@given(tst.ffn_problems(tile=64), tst.layouts(tiles=(64,)))
def test_public_ffn_on_numpy_runs_the_reference(problem, layout):
    tile, slots = layout
    y = twell.ffn(*problem, tile=tile, slots=slots)
    np.testing.assert_array_equal(y, reference.ffn(*problem, tile=tile, slots=slots))


@given(tst.ffn_problems(gated=True), tst.layouts(tiles=(32,)))
def test_gate_packs_the_rounded_relu(problem, layout):
    x, w_gate, w_up, w_down = problem
    tile, slots = layout
    g = twell.gate(x, w_gate, tile=tile, slots=slots)
    assert isinstance(g, Hybrid)
    assert (g.tile, g.slots, g.shape) == (tile, slots, (x.shape[0], w_gate.shape[0]))
    expected = round_bf16(relu(x.astype(np.float64) @ w_gate.T.astype(np.float64)))
    assert_same_matrix(g, expected)
    g.validate()


@given(tst.ffn_problems(gated=True), tst.layouts(tiles=(32,)))
def test_gate_down_and_gated_down_are_consistent(problem, layout):
    x, w_gate, w_up, w_down = problem
    tile, slots = layout
    g = twell.gate(x, w_gate, tile=tile, slots=slots)
    dense_g = g.to_dense(np.float64)
    close(twell.down(g, w_down), dense_g @ w_down.T.astype(np.float64))
    y = twell.gated_down(x, g, w_up, w_down)
    close(y, (dense_g * (x.astype(np.float64) @ w_up.T)) @ w_down.T)
    np.testing.assert_array_equal(y, twell.ffn(x, w_gate, w_up, w_down, tile=tile, slots=slots))


@given(tst.ffn_problems(gated=False), tst.layouts(tiles=(32,)))
def test_nongated_ffn_is_down_of_gate(problem, layout):
    x, _, w_up, w_down = problem
    tile, slots = layout
    y = twell.ffn(x, None, w_up, w_down, tile=tile, slots=slots)
    np.testing.assert_array_equal(
        y, twell.down(twell.gate(x, w_up, tile=tile, slots=slots), w_down)
    )


@given(tst.ffn_problems(rows=st.integers(2, 12)))
def test_results_do_not_depend_on_slots(problem):
    """Heavy rows are routed, never lost: every slots value gives the same y."""
    tile = 32
    results = [reference.ffn(*problem, tile=tile, slots=s) for s in (2, 4, 8, 16, 32)]
    for y in results[1:]:
        close(y, results[0])
    close(results[0], ffn_bf16_gate(*problem))


def test_heavy_rows_are_routed_not_lost():
    rng = np.random.default_rng(3)
    x = round_bf16(rng.standard_normal((6, 8)).astype(np.float32))
    w_gate = round_bf16(rng.standard_normal((64, 8)).astype(np.float32))
    w_up = round_bf16(rng.standard_normal((64, 8)).astype(np.float32))
    w_down = round_bf16(rng.standard_normal((8, 64)).astype(np.float32))
    g = twell.gate(x, w_gate, tile=32, slots=2)  # ~half the units fire: every row heavy
    assert g.dense_rows.size == 6
    close(
        twell.ffn(x, w_gate, w_up, w_down, tile=32, slots=2), ffn_bf16_gate(x, w_gate, w_up, w_down)
    )


@given(tst.ffn_problems(rows=st.integers(2, 8)), st.data())
def test_nonfinite_inputs_propagate_like_dense_math(problem, data):
    x, w_gate, w_up, w_down = problem
    x = x.copy()
    bad_rows = data.draw(st.lists(st.integers(0, x.shape[0] - 1), min_size=1, max_size=3))
    for row in bad_rows:
        column = data.draw(st.integers(1, x.shape[1] - 1))
        x[row, column] = data.draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    with np.errstate(invalid="ignore", over="ignore"):
        y = reference.ffn(x, w_gate, w_up, w_down, tile=32, slots=4)
        y_dense = ffn_dense(x, w_gate, w_up, w_down)
        y_model = ffn_bf16_gate(x, w_gate, w_up, w_down)
    assert_same_nonfinite(y, y_dense)
    good = np.isfinite(x).all(axis=1)
    assert np.isfinite(y[good]).all()
    if not good.any():
        return
    bound = rounding_bound(*problem)[good]
    assert np.all(np.abs(y[good] - y_dense[good]) <= bound + 1e-12 * (1 + bound.max()))
    close(y[good], y_model[good])


def test_infinite_x_with_all_gates_off_propagates_like_dense_math():
    x = np.array([[1.0, np.inf]])
    w_gate = np.tile([0.0, -1.0], (32, 1))  # every pre-activation is -Inf: all gates 0
    w_up, w_down = np.ones((32, 2)), np.ones((2, 32))
    with np.errstate(invalid="ignore"):
        assert_same_nonfinite(
            reference.ffn(x, w_gate, w_up, w_down, tile=32, slots=4),
            ffn_dense(x, w_gate, w_up, w_down),
        )


@given(tst.ffn_problems(tile=32), st.sampled_from([(1,), (2, 3), (3, 1, 2)]))
def test_batch_dimensions_are_flattened_and_restored(problem, batch):
    x, w_gate, w_up, w_down = problem
    k = x.shape[1]
    rows = int(np.prod(batch))
    flat = np.resize(x, (rows, k))  # repeat or cut the drawn tokens to the batch size
    y = twell.ffn(flat.reshape(*batch, k), w_gate, w_up, w_down, tile=32, slots=4)
    assert y.shape == (*batch, k)
    np.testing.assert_array_equal(
        y.reshape(rows, k), twell.ffn(flat, w_gate, w_up, w_down, tile=32, slots=4)
    )
    if w_gate is not None:
        g = twell.gate(flat, w_gate, tile=32, slots=4)
        y = twell.gated_down(flat.reshape(*batch, k), g, w_up, w_down)
        assert y.shape == (*batch, k)


@given(tst.ffn_problems(rows=1, k=8))
def test_a_single_token_without_batch_dimension(problem):
    x, w_gate, w_up, w_down = problem
    y = twell.ffn(x[0], w_gate, w_up, w_down, tile=32, slots=4)
    assert y.shape == (8,)
    np.testing.assert_array_equal(y, twell.ffn(x, w_gate, w_up, w_down, tile=32, slots=4)[0])


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16, np.float64])
@given(problem=tst.ffn_problems(tile=32))
def test_input_dtypes_are_upcast(dtype, problem):
    """bf16-representable values in any float dtype give the same result as float32."""
    expected = twell.ffn(*problem, tile=32, slots=8)
    if dtype is np.float16 and any(
        a is not None and not np.array_equal(a.astype(np.float16).astype(np.float32), a)
        for a in problem
    ):
        return  # not representable in float16
    cast = [None if a is None else a.astype(dtype) for a in problem]
    np.testing.assert_array_equal(twell.ffn(*cast, tile=32, slots=8), expected)


@given(tst.ffn_problems(rows=8, k=16))
def test_reference_float32_accumulation_is_close(problem):
    y32 = reference.ffn(*problem, tile=32, slots=4, dtype=np.float32)
    assert y32.dtype == np.float32
    y64 = reference.ffn(*problem, tile=32, slots=4)
    # A float32 gate may round to the neighbouring bf16 value: up to one rounding bound
    # per side, plus float32 accumulation.
    bound = rounding_bound(*problem)
    magnitude = bound / 2.0**-8
    assert np.all(np.abs(y32 - y64) <= 2 * bound + 1e-5 * (1 + magnitude.max()))


@pytest.mark.filterwarnings("error")
def test_l1_loss_past_float64s_range_is_inf_without_a_warning():
    h = np.full((2, 32), 1e308)
    assert reference.l1_loss(h) == np.inf
    assert reference.l1_loss(Hybrid.from_dense(h, tile=32, slots=4)) == np.inf  # dense rows
