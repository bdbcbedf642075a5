"""twell.testing itself: the assertions catch what they should, the profiles load as documented."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse
from hypothesis import given, settings
from hypothesis import strategies as st

from twell import Hybrid, TwELL
from twell.testing import (
    assert_matches_dense,
    assert_relative_error,
    assert_same_matrix,
    assert_same_nonfinite,
    profiles,
    relative_error,
)
from twell.testing import strategies as tst


@given(tst.hybrid_matrices(with_source=True))
def test_assert_same_matrix_sees_any_changed_entry(case):
    matrix, h = case
    assert_same_matrix(matrix, h)
    rows, columns = np.nonzero(h)
    if rows.size:
        changed = h.copy()
        changed[rows[0], columns[0]] = 0  # a missing entry
        with pytest.raises(AssertionError, match="missing"):
            assert_same_matrix(changed, matrix)
        changed = h.copy()
        changed[rows[-1], columns[-1]] = 7.0 if h[rows[-1], columns[-1]] != 7.0 else 5.0
        with pytest.raises(AssertionError, match="!="):
            assert_same_matrix(matrix, changed)
    extra = h.copy()
    extra[0, 0] = 1.0 if h[0, 0] == 0 else 0.0
    with pytest.raises(AssertionError, match="matrices differ"):
        assert_same_matrix(matrix, extra)
    with pytest.raises(AssertionError, match="shapes differ"):
        assert_same_matrix(matrix, h[:, : h.shape[1] // 2] if h.shape[1] > 32 else h[:0])


def test_assert_same_matrix_compares_formats_and_sparse_matrices():
    h = np.zeros((2, 64), np.float32)
    h[0, [1, 40]] = [1.5, np.nan]
    h[1, 2] = -np.inf
    assert_same_matrix(TwELL.from_dense(h, 32, 4), Hybrid.from_dense(h, 32, 4))
    assert_same_matrix(scipy.sparse.csr_matrix(h), h)
    overflowing = np.ones((1, 32), np.float32)
    with pytest.raises(AssertionError, match="overflowed"):
        assert_same_matrix(TwELL.from_dense(overflowing, 32, 4), overflowing)
    assert_same_matrix(Hybrid.from_dense(overflowing, 32, 4), overflowing)


def test_relative_error_edge_cases():
    assert relative_error(np.zeros(3), np.zeros(3)) == 0.0
    assert relative_error(np.ones(3), np.zeros(3)) == float("inf")
    assert relative_error(np.array([3.0, 4.0]), np.array([0.0, 0.0]) + [3.0, 4.0]) == 0.0
    assert relative_error(np.array([3.0, 4.0 + 5e-3 * 5]), np.array([3.0, 4.0])) == pytest.approx(
        5e-3
    )
    with pytest.raises(ValueError, match="shapes differ"):
        relative_error(np.zeros(2), np.zeros(3))


def test_assert_relative_error_checks_nonfinite_positions_first():
    y_ref = np.array([1.0, np.nan, np.inf, 2.0])
    assert assert_relative_error(y_ref.copy(), y_ref) == 0.0
    with pytest.raises(AssertionError, match=r"NaN positions differ"):
        assert_same_nonfinite(np.array([1.0, 0.0, np.inf, 2.0]), y_ref)
    with pytest.raises(AssertionError, match=r"\+Inf positions differ"):
        assert_relative_error(np.array([1.0, np.nan, -np.inf, 2.0]), y_ref)
    with pytest.raises(AssertionError, match="exceeds"):
        assert_relative_error(np.array([1.0, np.nan, np.inf, 3.0]), y_ref)


@pytest.fixture
def restore_profile():
    before = settings._current_profile  # noqa: SLF001 - restore what conftest loaded
    yield
    settings.load_profile(before)


@pytest.mark.parametrize(
    ("environment", "expected"),
    [
        ({}, "dev"),
        ({"CI": "true"}, "ci"),
        ({"TWELL_HYPOTHESIS_PROFILE": "deep"}, "deep"),
        ({"CI": "1", "TWELL_HYPOTHESIS_PROFILE": "dev"}, "dev"),
    ],
)
def test_load_profile_follows_the_environment(monkeypatch, restore_profile, environment, expected):
    for name in ("CI", "TWELL_HYPOTHESIS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert profiles.load_profile() == expected
    assert settings().max_examples == settings.get_profile(expected).max_examples


def test_profiles_extend_hypothesis_ci_profile(restore_profile):
    profiles.register_profiles()
    ci = settings.get_profile("ci")
    assert ci.derandomize and ci.database is None and ci.deadline is None  # built-in ci
    assert settings.get_profile("deep").max_examples >= 1000
    assert settings.get_profile("deep").deadline is None
    assert settings.get_profile("dev").max_examples < ci.max_examples
    with pytest.raises(ValueError, match="TWELL_HYPOTHESIS_PROFILE"):
        profiles.load_profile("nonsense")


def test_as_host_takes_torch_bfloat16_tensors():
    torch = pytest.importorskip("torch")
    from twell._arrays import bfloat16
    from twell.testing.asserts import as_host

    values = torch.tensor([1.0, -2.5, 0.1], dtype=torch.bfloat16)
    host = as_host(values)
    assert host.dtype == bfloat16
    np.testing.assert_array_equal(host.astype(np.float32), values.float().numpy())


# ------------------------------------------------------------------ assert_matches_dense
@given(tst.nonfinite_ffn_problems(places=("x", "w_gate", "w_up", "w_down")))
def test_assert_matches_dense_passes_the_reference_ops_with_nan_and_inf(p):
    import twell

    y = twell.ffn(p.x, p.w_gate, p.w_up, p.w_down, tile=p.tile)
    assert assert_matches_dense(y, p.x, p.w_gate, p.w_up, p.w_down) <= 2**-8


@given(tst.ffn_problems(tile=32, rows=st.integers(2, 8)))
def test_assert_matches_dense_sees_a_dropped_row_or_unit(p):
    import twell
    from twell.reference.forward import ffn_dense

    y = twell.ffn(*p, tile=p.tile)
    assert_matches_dense(y, *p)
    want = ffn_dense(*p)
    rows = np.flatnonzero(np.abs(want).max(axis=1) > 0)
    if rows.size:
        dropped = np.array(y, copy=True)
        dropped[rows[0]] = 0.0  # a row a sparse path forgot
        with pytest.raises(AssertionError, match=f"row {rows[0]}"):
            assert_matches_dense(dropped, *p)
    nan = np.array(y, copy=True)
    nan[0, 0] = np.nan
    with pytest.raises(AssertionError, match="NaN positions differ"):
        assert_matches_dense(nan, *p)
    with pytest.raises(AssertionError, match="shapes differ"):
        assert_matches_dense(y[1:], *p)


def test_assert_matches_dense_allows_rounding_not_a_lost_unit() -> None:
    """One row, two units whose terms nearly cancel: bf16 rounding of h is allowed even
    where it is large against the sum; losing a unit is not."""
    x = np.array([[1.0]])
    w_up = np.array([[1.0], [1.0]])
    w_down = np.array([[1.0, -1.0 + 2**-7]])  # y = 2^-7 from terms of magnitude ~1
    exact = x @ w_up.T @ w_down.T
    assert_matches_dense(exact * (1 + 0.5), x, None, w_up, w_down)  # 0.4% of the terms
    with pytest.raises(AssertionError):
        assert_relative_error(exact * 1.5, exact)  # against the sum: 50%
    with pytest.raises(AssertionError, match="row 0"):
        assert_matches_dense(np.array([[1.0]]), x, None, w_up, w_down)  # the second unit lost
    zero = np.zeros((1, 1))
    assert assert_matches_dense(zero, np.zeros((1, 1)), None, w_up, w_down) == 0.0
    with pytest.raises(AssertionError, match="no nonzero term"):
        assert_matches_dense(zero + 1e-30, np.zeros((1, 1)), None, w_up, w_down)


# ------------------------------------------------------------------ robustness strategies
@given(tst.nonfinite_ffn_problems(places=("x", "w_gate", "w_up", "w_down")))
def test_nonfinite_ffn_problems_plant_nan_or_inf(problem):
    planted = [a for a in problem if a is not None and not np.isfinite(a).all()]
    assert planted
    assert problem.x.shape[1] == problem.w_up.shape[1] == problem.w_down.shape[0]


@given(tst.corrupt_hybrids(slot_choices=(4, 32)))
def test_corrupt_hybrids_pass_the_constructors_and_fail_validate(case):
    assert case.kind in tst.HYBRID_CORRUPTIONS
    assert case.matrix.slots in (4, 32)
    with pytest.raises(ValueError, match=r"^(packed|dense_rows): "):
        case.matrix.validate()


@given(tst.malformed(np.ones((3, 4), np.float32)))
def test_malformed_says_what_it_did(case):
    value, kind = case
    assert kind in tst.MALFORMATIONS
    expected_type = {"list": list, "scalar": float, "none": type(None)}.get(kind, np.ndarray)
    assert isinstance(value, expected_type)
    if kind == "transposed":
        assert value.shape == (4, 3)
    if kind in ("shorter", "longer"):
        assert sum(value.shape) == 7 + (1 if kind == "longer" else -1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"k": 1}, "k: expected at least 2"), ({"tile": 48}, "tile: expected one of"),
     ({"rows": -1}, "rows: expected at least 0"), ({"tiles": 0}, "tiles: expected at least 1")],
)  # fmt: skip
def test_ffn_problems_refuse_fixed_arguments_out_of_range(kwargs, message):
    from hypothesis.errors import InvalidArgument

    @settings(max_examples=1, database=None)
    @given(tst.ffn_problems(**kwargs))
    def draw_one(problem):
        pass

    with pytest.raises(InvalidArgument, match=message):
        draw_one()


@settings(max_examples=10, database=None)
@given(tst.nonfinite_ffn_problems(places=("x",), rows=0))
def test_nonfinite_problems_without_rows_plant_their_values_in_a_weight(problem):
    assert problem.x.shape[0] == 0 and not np.isfinite(problem.w_up).all()
