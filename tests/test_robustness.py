"""No silent wrong numbers (docs/ops.md, "Errors and bad input"): every entry point
raises or equals dense float64 math.

The properties build corrupt and edge buffers through the public constructors
(``twell.testing.strategies``) and check, for every public op and reference op, that the
call either raises ``TypeError``/``ValueError`` or returns what plain float64 dense math
returns for the same arguments (relative error <= 1e-2 on the finite part, NaN and ±Inf
at the same positions), never a different number. The validity of a malformed argument
is decided here, by rules written independently of twell's validation layer.
"""

from __future__ import annotations

import math
import re

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import twell
from twell import Hybrid, TwELL, reference
from twell._arrays import round_bf16
from twell.testing import assert_relative_error, assert_same_matrix
from twell.testing import strategies as tst

TOL = 1e-2
#: Tests run once per kind of defect: a fifth of the profile's examples each.
PER_KIND = settings(max_examples=max(10, settings.default.max_examples // 5))
FLOATS = {np.dtype(t) for t in (ml_dtypes.bfloat16, np.float16, np.float32, np.float64)}
BAD = (TypeError, ValueError)


# ---------------------------------------------------------------------- oracles
def relu(a: np.ndarray) -> np.ndarray:
    return np.where(np.isnan(a), a, np.maximum(a, 0))


def f64(a: np.ndarray) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


def dense_block(x, w_gate, w_up, w_down, *, bf16_gate: bool = False) -> np.ndarray:
    """Plain float64 dense math of the block, written here (not twell's ffn_dense).

    ``bf16_gate``: round the gate values to bfloat16 first, as the reference and the
    kernels store them (docs/ops.md, Numerics). At the tiny K of these tests one output
    can be a near-cancelling sum, which that rounding alone moves by more than 1e-2.
    """
    x2 = f64(x).reshape(-1, x.shape[-1])

    def gate_values(pre: np.ndarray) -> np.ndarray:
        g = relu(pre)
        return f64(round_bf16(g)) if bf16_gate else g

    with np.errstate(all="ignore"):
        if w_gate is None:
            y = gate_values(x2 @ f64(w_up).T) @ f64(w_down).T
        else:
            y = (gate_values(x2 @ f64(w_gate).T) * (x2 @ f64(w_up).T)) @ f64(w_down).T
    return y.reshape(*x.shape[:-1], y.shape[-1])


def dense_backward(x, w_gate, w_up, w_down, dy, l1_coeff, reduction):
    """Dense float64 gradients of <dy, y> + l1_coeff * L1(h), written here."""
    x2, dy2 = f64(x).reshape(-1, x.shape[-1]), f64(dy).reshape(-1, dy.shape[-1])
    wu, wd = f64(w_up), f64(w_down)
    m, n = x2.shape[0], wu.shape[0]
    c = l1_coeff / max(1, m * n) if reduction == "mean" else l1_coeff / max(1, m)
    with np.errstate(all="ignore"):
        if w_gate is None:
            a = x2 @ wu.T
            h = relu(a)
            dh = dy2 @ wd + c * np.sign(h)
            da = dh * (a > 0)
            return (da @ wu).reshape(x.shape), None, da.T @ x2, dy2.T @ h
        wg = f64(w_gate)
        a, u = x2 @ wg.T, x2 @ wu.T
        h = relu(a) * u
        dh = dy2 @ wd + c * np.sign(h)
        da, du = dh * u * (a > 0), dh * relu(a)
        dx = da @ wg + du @ wu
        return dx.reshape(x.shape), da.T @ x2, du.T @ x2, dy2.T @ h


def assert_matches(actual, expected) -> None:
    actual = np.asarray(actual, dtype=np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    if actual.size:
        assert_relative_error(actual, expected, TOL)


def is_float_array(a, ndim: int | None = None) -> bool:
    return (
        isinstance(a, np.ndarray)
        and a.dtype in FLOATS
        and a.ndim >= 1
        and (ndim is None or a.ndim == ndim)
    )


def raises_or_matches(call, expected) -> None:
    """``expected`` None: the call must raise TypeError/ValueError; else equal it."""
    if expected is None:
        with pytest.raises(BAD):
            call()
        return
    assert_matches(call(), expected)


# ---------------------------------------------------------------------- formats
def hybrid_ops(h: Hybrid, rng: np.random.Generator, k: int, nonfinite: bool):
    """Every op that reads a Hybrid, as (name, call, dense float64 result from h_dense)."""
    m, n = h.shape
    x = rng.standard_normal((m, k)).astype(np.float32)
    w_up = (rng.standard_normal((n, k)) / math.sqrt(k)).astype(np.float32)
    w_down = (rng.standard_normal((k, n)) / math.sqrt(n)).astype(np.float32)
    if nonfinite:
        w_down[rng.integers(k), rng.integers(n)] = rng.choice([np.nan, np.inf, -np.inf])
        w_up[rng.integers(n), rng.integers(k)] = rng.choice([np.nan, np.inf, -np.inf])

    def expected(h_dense: np.ndarray) -> dict:
        with np.errstate(all="ignore"):
            return {
                "down": h_dense @ f64(w_down).T,
                "gated_down": (h_dense * (f64(x) @ f64(w_up).T)) @ f64(w_down).T,
                "l1_loss": np.array(np.abs(h_dense).sum() / max(1, m * n)),
                "l0": np.array(np.count_nonzero(h_dense) / max(1, m)),
            }

    calls = {
        "down": [lambda: twell.down(h, w_down), lambda: reference.down(h, w_down)],
        "gated_down": [
            lambda: twell.gated_down(x, h, w_up, w_down),
            lambda: reference.gated_down(x, h, w_up, w_down),
        ],
        "l1_loss": [lambda: np.array(reference.l1_loss(h))],
        "l0": [lambda: np.array(reference.l0(h))],
    }
    return calls, expected


@given(
    st.one_of(
        tst.corrupt_hybrids().map(lambda case: case.matrix),
        tst.hybrid_matrices(construction="raw", allow_huge=True),
        tst.hybrid_matrices(construction="raw", rows=st.integers(0, 3)),
    ),
    st.integers(1, 6),
    st.booleans(),
    st.integers(0, 2**32 - 1),
)
def test_ops_on_user_built_hybrids_raise_or_equal_dense_math(h, k, nonfinite, seed):
    """Class 2: a corrupt Hybrid raises before it is read; a valid one gives dense math."""
    calls, expected = hybrid_ops(h, np.random.default_rng(seed), k, nonfinite)
    try:
        h.validate()
    except ValueError:
        for variants in calls.values():
            for call in variants:
                with pytest.raises(ValueError, match=r"^h[.:]|^g[.:]|^h: "):
                    call()
        for decode in (h.to_dense, h.to_csr, h.counts, h.entries):
            with pytest.raises(ValueError):
                decode()
        with pytest.raises(AssertionError, match="invalid Hybrid"):
            assert_same_matrix(h, np.zeros(h.shape))
        return
    want = expected(h.to_dense(np.float64))
    for name, variants in calls.items():
        for call in variants:
            assert_matches(call(), want[name])


@pytest.mark.parametrize("kind", tst.HYBRID_CORRUPTIONS)
@PER_KIND
@given(data=st.data())
def test_each_corruption_is_named_in_the_error(kind, data):
    case = data.draw(tst.corrupt_hybrids(kind))
    h = case.matrix
    m, n = h.shape
    with pytest.raises(ValueError, match=r"^h\.(packed|dense_rows): "):
        twell.down(h, np.ones((3, n), np.float32))
    with pytest.raises(ValueError, match=r"^g\.(packed|dense_rows): "):
        reference.gated_down(np.ones((m, 3)), h, np.ones((n, 3)), np.ones((3, n)))


def test_validation_runs_once_per_user_built_object(monkeypatch):
    """Full check before the first read, remembered; objects twell built are never checked."""
    calls = []
    original = Hybrid.validate

    def counting(self):  # noqa: ANN001, ANN202
        calls.append(self)
        return original(self)

    monkeypatch.setattr(Hybrid, "validate", counting)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 8)).astype(np.float32)
    w = rng.standard_normal((64, 8)).astype(np.float32)
    wd = rng.standard_normal((8, 64)).astype(np.float32)
    built = twell.gate(x, w, tile=32, slots=4)
    for _ in range(3):
        twell.down(built, wd)
        twell.gated_down(x, built, w, wd)
    assert calls == []
    user = Hybrid(TwELL(built.packed.copy(), built.shape, 32, 4), built.dense_rows, built.dense)
    for _ in range(3):
        twell.down(user, wd)
        reference.gated_down(x, user, w, wd)
    assert calls == [user]
    assert calls == [user] and twell.formats.to_host(user)._validated


# ---------------------------------------------------------------------- non-finite weights
@given(
    tst.nonfinite_ffn_problems(places=("w_gate", "w_up", "w_down", "x")), st.sampled_from([4, 32])
)
def test_nonfinite_weights_and_inputs_give_dense_math(problem, slots):
    """Class 4: NaN/Inf anywhere, active unit or not, gives what dense math gives."""
    x, wg, wu, wd = problem
    want = dense_block(x, wg, wu, wd, bf16_gate=True)
    assert_matches(twell.ffn(x, wg, wu, wd, tile=32, slots=slots), want)
    assert_matches(reference.ffn(x, wg, wu, wd, tile=32, slots=slots), want)
    assert_matches(twell.SparseFFN(wg, wu, wd, tile=32, slots=slots)(x), want)
    gating = wg if wg is not None else wu
    h = twell.gate(x, gating, tile=32, slots=slots)
    if wg is None:
        assert_matches(twell.down(h, wd), want)
        assert_matches(reference.down(h, wd), want)
    else:
        assert_matches(twell.gated_down(x, h, wu, wd), want)
        assert_matches(reference.gated_down(x, h, wu, wd), want)
    with np.errstate(all="ignore"):
        assert_matches(h.to_dense(np.float64), relu(f64(x) @ f64(gating).T))


@given(
    tst.nonfinite_ffn_problems(places=("w_gate", "w_up", "w_down", "x")),
    st.sampled_from([0.0, 1e-2]),
    st.sampled_from(["mean", "per_token"]),
    st.integers(0, 2**32 - 1),
)
def test_nonfinite_weights_reach_the_gradients_like_dense_math(problem, l1, reduction, seed):
    x, wg, wu, wd = problem
    dy = np.random.default_rng(seed).standard_normal((x.shape[0], x.shape[1]))
    got = reference.ffn_backward(x, wg, wu, wd, dy, l1, reduction=reduction)
    want = dense_backward(x, wg, wu, wd, dy, l1, reduction)
    for g, w in zip(got, want, strict=True):
        assert (g is None) == (w is None)
        if w is not None:
            assert_matches(g, w)


# ---------------------------------------------------------------------- malformed arguments
NAMES = ("x", "w_gate", "w_up", "w_down")


@st.composite
def calls_with_one_bad_argument(draw, names=NAMES):
    problem = draw(tst.ffn_problems(gated=True, k=st.integers(2, 6), tiles=st.integers(1, 2)))
    args = dict(problem._asdict())
    name = draw(st.sampled_from(names))
    args[name], kind = draw(tst.malformed(args[name]))
    return problem, args, name, kind


def block_shapes_ok(args: dict, *, gated: bool, tile: int | None) -> bool:
    """The independent validity rule of a block's arguments (x, w_gate, w_up, w_down)."""
    x, wg, wu, wd = (args[name] for name in NAMES)
    if not is_float_array(x) or x.shape[-1] < 1:
        return False
    k = x.shape[-1]
    if not (is_float_array(wu, 2) and is_float_array(wd, 2)):
        return False
    n = wu.shape[0]
    if wu.shape != (n, k) or wd.shape != (k, n) or n < 1:
        return False
    if gated and not (is_float_array(wg, 2) and wg.shape == (n, k)):
        return False
    return tile is None or n % tile == 0


@given(calls_with_one_bad_argument(), st.sampled_from([4, 32]))
def test_block_ops_raise_or_equal_dense_math(case, slots):
    """Class 1 and 6: ffn, SparseFFN, the reference ffn and ffn_dense on bad arguments."""
    _, args, name, kind = case
    x, wg, wu, wd = (args[n] for n in NAMES)
    gated = wg is not None
    ok = block_shapes_ok(args, gated=gated, tile=32)
    want = dense_block(x, wg, wu, wd, bf16_gate=True) if ok else None
    raises_or_matches(lambda: twell.ffn(x, wg, wu, wd, tile=32, slots=slots), want)
    raises_or_matches(lambda: reference.ffn(x, wg, wu, wd, tile=32, slots=slots), want)
    ok_dense = block_shapes_ok(args, gated=gated, tile=None)
    raises_or_matches(
        lambda: reference.forward.ffn_dense(x, wg, wu, wd),
        dense_block(x, wg, wu, wd) if ok_dense else None,
    )
    if ok:  # an empty batch included
        assert_matches(twell.SparseFFN(wg, wu, wd, tile=32, slots=slots)(x), want)


@given(calls_with_one_bad_argument(("x", "w_gate")))
def test_gate_raises_or_equals_dense_math(case):
    _, args, name, kind = case
    x, wg = args["x"], args["w_gate"]
    ok = (
        is_float_array(x)
        and x.shape[-1] >= 1
        and is_float_array(wg, 2)
        and wg.shape[1] == x.shape[-1]
        and wg.shape[0] >= 1
        and wg.shape[0] % 32 == 0
    )
    for op in (twell.gate, reference.gate):
        if not ok:
            with pytest.raises(BAD):
                op(x, wg, tile=32, slots=4)
            continue
        h = op(x, wg, tile=32, slots=4)
        with np.errstate(all="ignore"):
            want = relu(f64(x).reshape(-1, x.shape[-1]) @ f64(wg).T)
        assert h.shape == want.shape
        if want.size:
            assert_matches(h.to_dense(np.float64), want)


@given(calls_with_one_bad_argument(("x", "w_up", "w_down")))
def test_down_and_gated_down_raise_or_equal_dense_math(case):
    problem, args, name, kind = case
    g = reference.gate(problem.x, problem.w_gate, tile=32, slots=4)
    g_dense = g.to_dense(np.float64)
    m, n = g.shape
    x, wu, wd = args["x"], args["w_up"], args["w_down"]
    ok_down = is_float_array(wd, 2) and wd.shape[1] == n and wd.shape[0] >= 1
    want = g_dense @ f64(wd).T if ok_down else None
    raises_or_matches(lambda: twell.down(g, wd), want)
    raises_or_matches(lambda: reference.down(g, wd), want)
    ok = (
        is_float_array(x)
        and math.prod(x.shape[:-1]) == m
        and x.shape[-1] >= 1
        and is_float_array(wu, 2)
        and wu.shape == (n, x.shape[-1])
        and is_float_array(wd, 2)
        and wd.shape == (x.shape[-1], n)
    )
    want = None
    if ok:
        with np.errstate(all="ignore"):
            y = (g_dense * (f64(x).reshape(m, -1) @ f64(wu).T)) @ f64(wd).T
        want = y.reshape(*x.shape[:-1], y.shape[-1])
    raises_or_matches(lambda: twell.gated_down(x, g, wu, wd), want)
    raises_or_matches(lambda: reference.gated_down(x, g, wu, wd), want)


@st.composite
def backward_calls(draw):
    problem = draw(tst.ffn_problems(k=st.integers(2, 6), tiles=st.integers(1, 2)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    args = dict(problem._asdict())
    args["dy"] = rng.standard_normal(problem.x.shape)
    name = draw(st.sampled_from((*NAMES, "dy", "dy")))
    if name != "w_gate" or args["w_gate"] is not None:
        args[name], _ = draw(tst.malformed(args[name]))
    return args, name


@given(backward_calls(), st.sampled_from([0.0, 0.1]), st.sampled_from(["mean", "per_token"]))
def test_ffn_backward_raises_or_equals_dense_math(case, l1, reduction):
    """Class 1's worst case: dy of the wrong shape must raise, never broadcast."""
    args, name = case
    x, wg, wu, wd, dy = (args[n] for n in (*NAMES, "dy"))
    ok = block_shapes_ok(args, gated=wg is not None, tile=None) and (
        is_float_array(dy) and dy.shape == (*x.shape[:-1], x.shape[-1])
    )
    call = lambda: reference.ffn_backward(x, wg, wu, wd, dy, l1, reduction=reduction)  # noqa: E731
    if not ok:
        with pytest.raises(BAD):
            call()
        return
    want = dense_backward(x, wg, wu, wd, dy, l1, reduction)
    for g, w in zip(call(), want, strict=True):
        assert (g is None) == (w is None)
        if w is not None:
            assert_matches(g, w)


@given(
    st.one_of(
        tst.malformed(np.ones((3, 64), np.float32)), st.tuples(st.just(None), st.just("none"))
    )
)
def test_l1_loss_and_l0_raise_or_equal_dense_math(case):
    h, kind = case
    ok = is_float_array(h)
    if not ok:
        for op in (reference.l1_loss, reference.l0):
            with pytest.raises(BAD):
                op(h)
        return
    tokens = max(1, math.prod(h.shape[:-1]))
    assert reference.l1_loss(h) == pytest.approx(np.abs(f64(h)).sum() / max(1, h.size))
    assert reference.l0(h) == pytest.approx(np.count_nonzero(h) / tokens)


def test_ffn_backward_rejects_the_issue_examples():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 8))
    wg, wu, wd = (
        rng.standard_normal((64, 8)),
        rng.standard_normal((64, 8)),
        rng.standard_normal((8, 64)),
    )
    y = reference.ffn(x, wg, wu, wd, tile=32, slots=4)
    for dy in (y.T, y[:, 0], y[None], y[:, :1]):
        with pytest.raises(ValueError, match=r"^dy: expected shape \(4, 8\)"):
            reference.ffn_backward(x, wg, wu, wd, dy)
    with pytest.raises(ValueError, match="^l1_coeff: expected a finite number"):
        reference.ffn_backward(x, wg, wu, wd, y, float("nan"))
    with pytest.raises(TypeError, match="^l1_coeff: expected a real number"):
        reference.ffn_backward(x, wg, wu, wd, y, "0.1")
    dx, dwg, dwu, dwd = reference.ffn_backward(x[:0], wg, wu, wd, y[:0])
    assert dx.shape == (0, 8) and not dwg.any() and not dwu.any() and not dwd.any()


def test_reference_ops_name_the_argument_and_flatten_batches():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 8))
    wg, wu, wd = (
        rng.standard_normal((32, 8)),
        rng.standard_normal((32, 8)),
        rng.standard_normal((8, 32)),
    )
    y = reference.ffn(x, wg, wu, wd, tile=32, slots=4)
    assert y.shape == (2, 3, 8)
    g = reference.gate(x, wg, tile=32, slots=4)
    assert g.shape == (6, 32)
    assert reference.gated_down(x, g, wu, wd).shape == (2, 3, 8)
    with pytest.raises(
        ValueError, match=r"^x: expected shape \[\.\.\., 8\] \(K = 8, as in w_up, w_down\)"
    ):
        reference.gated_down(x[..., :7], g, wu, wd)
    with pytest.raises(TypeError, match=r"^x: twell\.reference\.gate takes NumPy arrays"):
        torch = pytest.importorskip("torch")
        reference.gate(torch.zeros(2, 8), torch.zeros(32, 8))


def test_reference_rejects_a_bad_accumulation_dtype():
    x, w = np.ones((2, 8)), np.ones((32, 8))
    for dtype in (np.int32, "bogus", np.float16):
        with pytest.raises(TypeError, match="^dtype: expected float32 or float64"):
            reference.gate(x, w, tile=32, slots=4, dtype=dtype)


# ---------------------------------------------------------------------- integer/float edges
@pytest.mark.parametrize("count", [33, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF])
def test_huge_count_words_are_unsigned_and_never_dropped(count):
    """Class 3: a count word >= 2**31 is a large count, seen by every statistic."""
    packed = np.zeros((2, 8), np.uint32)
    packed[1, 4] = count
    ell = TwELL(packed, (2, 64), 32, 4)
    assert ell.counts()[1, 1] == count and (ell.counts() >= 0).all()
    assert ell.nnz == count and f"nnz={count}" in repr(ell)
    assert ell.overflow_rows().tolist() == [1]
    for decode in (ell.to_dense, ell.to_csr):
        with pytest.raises(ValueError, match="count .* exceeds the tile width"):
            decode()
    hybrid = Hybrid(ell, np.array([1], np.int32), np.zeros((1, 64), np.float32))
    with pytest.raises(ValueError, match=r"^h\.packed: row 1, tile 1: count"):
        twell.down(hybrid, np.ones((4, 64)))


@pytest.mark.parametrize("value", [3.4e38, -3.4e38, 1e39, np.finfo(np.float32).max])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_values_beyond_bf16_route_their_row(value, dtype):
    """Class 3: a finite value that rounds to ±Inf in bf16 makes its row dense."""
    if dtype == np.float32 and abs(value) > float(np.finfo(np.float32).max):
        return
    h = np.zeros((3, 64), dtype)
    h[1, 5], h[2, 7] = value, 1.5
    hybrid = Hybrid.from_dense(h, 32, 4)
    assert hybrid.dense_rows.tolist() == [1]
    hybrid.validate()
    np.testing.assert_array_equal(hybrid.to_dense(np.float64), h.astype(np.float64))
    wd = np.ones((2, 64))
    np.testing.assert_allclose(twell.down(hybrid, wd), h.astype(np.float64) @ wd.T)


def test_to_dense_takes_floating_dtypes_only():
    h = Hybrid.from_dense(np.eye(2, 32, dtype=np.float32) * 2.5, 32, 4)
    for matrix in (h, h.ell):
        for dtype in (np.int32, np.uint8, bool, "bogus"):
            with pytest.raises(TypeError, match="^dtype: expected a floating dtype"):
                matrix.to_dense(dtype)
        assert matrix.to_dense(ml_dtypes.bfloat16).dtype == ml_dtypes.bfloat16
        assert matrix.to_dense(np.float16)[0, 0] == 2.5


def test_shape_dimensions_must_be_integers():
    packed = np.zeros((4, 8), np.uint32)
    for shape in ((4.7, 64), (4, 64.0), (True, 64), ("4", 64)):
        with pytest.raises(TypeError, match=r"^shape: expected integer dimensions"):
            TwELL(packed, shape, 32, 4)
    assert TwELL(packed, (np.int64(4), 64), 32, 4).shape == (4, 64)


def test_hybrid_constructor_runs_cheap_structural_checks():
    ell = TwELL(np.zeros((2, 8), np.uint32), (2, 64), 32, 4)
    rows = np.array([0, 1, 1], np.int32)
    with pytest.raises(ValueError, match=r"^dense_rows: expected at most M=2 row ids"):
        Hybrid(ell, rows, np.zeros((3, 64), np.float32))


# ---------------------------------------------------------------------- test helpers
def test_assert_same_matrix_validates_both_sides():
    """Class 5: a bogus count word on an empty tile decodes to nothing, yet is caught."""
    h = np.zeros((2, 64), np.float32)
    h[0, 3] = 1.0
    good = Hybrid.from_dense(h, 32, 4)
    packed = good.packed.copy()
    packed[1, 4] = 1  # row 1, tile 1 is empty: its one "entry" is the zero word
    bogus = Hybrid._trusted(TwELL._trusted(packed, (2, 64), 32, 4), good.dense_rows, good.dense)
    for actual, expected in ((bogus, good), (good, bogus), (bogus, h)):
        with pytest.raises(AssertionError, match="invalid Hybrid: packed: row 1, tile 1"):
            assert_same_matrix(actual, expected)
    with pytest.raises(AssertionError, match="invalid TwELL"):
        assert_same_matrix(TwELL._trusted(packed, (2, 64), 32, 4), h)


# ---------------------------------------------------------------------- errors name x
def test_a_wrong_k_x_is_blamed_on_x():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 8))
    wg, wu, wd = (
        rng.standard_normal((32, 8)),
        rng.standard_normal((32, 8)),
        rng.standard_normal((8, 32)),
    )
    g = twell.gate(x, wg, tile=32, slots=4)
    for call in (
        lambda: twell.gated_down(x[:, :7], g, wu, wd),
        lambda: twell.ffn(x[:, :7], wg, wu, wd, tile=32, slots=4),
        lambda: reference.ffn(x[:, :7], wg, wu, wd, tile=32, slots=4),
    ):
        with pytest.raises(ValueError, match=r"^x: expected shape \[\.\.\., 8\]"):
            call()
    with pytest.raises(ValueError, match=r"^w_up: expected shape \(32, 8\) \(axis 1 = K = 8"):
        twell.ffn(x, wg, wu[:, :7], wd, tile=32, slots=4)
    doc_example = "w_down: expected shape (8, 64) (axis 1 = N = 64, as in w_gate, w_up), "
    doc_example += "got (8, 96)"  # the example of docs/ops.md
    with pytest.raises(ValueError, match=f"^{re.escape(doc_example)}$"):
        twell.ffn(x, np.ones((64, 8)), np.ones((64, 8)), np.ones((8, 96)), tile=32, slots=4)
    with pytest.raises(TypeError, match=r"^x: expected an array, got None"):
        twell.gate(None, wg)
    with pytest.raises(TypeError, match=r"^w_gate: expected an array, got None"):
        twell.gate(x, None)


@given(tst.corrupt_packed())
def test_a_corrupt_twell_is_not_decoded(case):
    packed, shape, tile, slots, kind = case
    ell = TwELL(packed, shape, tile, slots)
    for decode in (ell.to_dense, ell.to_csr):
        with pytest.raises(ValueError, match=r"^(packed: |TwELL: )"):
            decode()
    with pytest.raises(ValueError, match=r"^h(\.packed|: )"):
        reference.l1_loss(ell)


def test_from_dense_checks_its_options():
    h = np.eye(2, 32, dtype=np.float32)
    with pytest.raises(TypeError, match=r"^also_dense: expected a numpy boolean mask"):
        Hybrid.from_dense(h, 32, 4, also_dense=[True, False])
    with pytest.raises(TypeError, match=r"^also_dense: expected a boolean mask, got float64"):
        Hybrid.from_dense(h, 32, 4, also_dense=np.array([0.5, 0.0]))
    with pytest.raises(TypeError, match=r"^max_row_nnz: expected an int"):
        Hybrid.from_dense(h, 32, 4, max_row_nnz=1.5)
    with pytest.raises(ValueError, match=r"^max_row_nnz: expected an int >= 0"):
        Hybrid.from_dense(h, 32, 4, max_row_nnz=-1)


def test_l1_loss_of_an_overflowed_twell_names_h():
    ell = TwELL.from_dense(np.ones((1, 32), np.float32), 32, 4)
    with pytest.raises(ValueError, match=r"^h: TwELL: 1 row\(s\) overflowed"):
        reference.l1_loss(ell)
    assert reference.l0(ell) == 32.0  # the count words are the true counts


@pytest.mark.parametrize("m", [1, 63, 64, 100, 4096, 16384, 16384 + 37, 131072])
def test_density_sample_does_not_align_with_sequence_starts(m: int) -> None:
    # The density switch samples rows of a batch; packed sequences put their densest
    # token (BOS) at multiples of a power of two, which a stride of M / 64 from row 0 hit
    # every time. The sample must fall once on every residue modulo 64 (odd stride).
    from twell.kernels.pipeline import sample_rows

    rows = np.arange(m)[sample_rows(m, 64)][:64]
    assert 0 < rows.size <= 64 and rows.max() < m
    if m >= 64 * 64:
        assert rows.size >= 63
        assert len(set((rows % 64).tolist())) == rows.size
        assert np.count_nonzero(rows % 2048 == 0) <= 1
