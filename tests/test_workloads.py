"""The synthetic workloads of docs/benchmark.md: reproducible, right shapes, right sparsity."""

from __future__ import annotations

import doctest

import ml_dtypes
import numpy as np
import pytest

from twell import workloads
from twell.workloads import DENSITIES, WORKLOADS, Problem, make

BF16 = np.dtype(ml_dtypes.bfloat16)
SMALL = (48, 64, 512)  # M, K, N

# Extra arguments per workload for make(); density needs p.
EXTRA = {"uniform": {}, "heavy": {}, "paperlike": {}, "density": {"p": 0.02}}


def bits(problem: Problem) -> list[bytes]:
    return [a.tobytes() for a in problem.arrays() if a is not None]


def tile_counts(problem: Problem, tile: int = 256) -> np.ndarray:
    """Nonzeros of relu(gate) per (row, tile), ``[M, N / tile]``."""
    fired = problem.gate_preactivation() > 0
    return fired.reshape(problem.M, problem.N // tile, tile).sum(axis=2)


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_shapes_and_dtypes(name):
    M, K, N = SMALL
    problem = make(name, M, K, N, seed=3, **EXTRA[name])
    assert isinstance(problem, Problem)
    assert problem.name == name
    assert (problem.M, problem.K, problem.N) == (M, K, N)
    assert problem.x.shape == (M, K)
    assert problem.w_gate.shape == (N, K)
    assert problem.w_up.shape == (N, K)
    assert problem.w_down.shape == (K, N)
    for array in problem.arrays():
        assert array.dtype == BF16
        assert array.flags.c_contiguous
        assert np.isfinite(array.astype(np.float32)).all()
    assert np.all(problem.x[:, 0].astype(np.float32) == 1.0)
    assert problem.params["seed"] == 3
    assert problem.params["design_l0"] > 0
    assert name in repr(problem) and "M=48" in repr(problem)


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_reproducible(name):
    a = make(name, *SMALL, seed=7, **EXTRA[name])
    b = make(name, *SMALL, seed=7, **EXTRA[name])
    c = make(name, *SMALL, seed=8, **EXTRA[name])
    assert bits(a) == bits(b)
    for x, y in zip(bits(a), bits(c), strict=True):
        assert x != y


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_weights_do_not_depend_on_m(name):
    short = make(name, 5, 64, 512, seed=2, **EXTRA[name])
    long = make(name, 40, 64, 512, seed=2, **EXTRA[name])
    for w_short, w_long in zip(short.arrays()[1:], long.arrays()[1:], strict=True):
        assert w_short.tobytes() == w_long.tobytes()
    if name in ("uniform", "density"):  # prefix-stable tokens
        assert short.x.tobytes() == long.x[:5].tobytes()


def test_density_varies_only_the_threshold():
    a = workloads.density(0.01, 16, 64, 256, seed=1)
    b = workloads.density(0.10, 16, 64, 256, seed=1)
    assert a.x.tobytes() == b.x.tobytes()
    assert a.w_gate[:, 1:].tobytes() == b.w_gate[:, 1:].tobytes()
    assert a.w_gate[0, 0] != b.w_gate[0, 0]
    assert a.params["p"] == 0.01 and a.name == "density"


def test_uniform_l0():
    # p = 0.005 at N = 5632: design 28.16 units per token.
    problem = workloads.uniform(2048, 2048, 5632, p=0.005, seed=0)
    assert problem.params["design_l0"] == pytest.approx(28.16)
    assert problem.l0() == pytest.approx(28.16, abs=1.5)


@pytest.mark.parametrize("p", DENSITIES)
def test_density_l0(p):
    problem = workloads.density(p, 256, 256, 2048, seed=0)
    expected = p * 2048
    assert problem.l0() == pytest.approx(expected, rel=0.1, abs=1.0)


def test_paperlike_l0():
    # The paper's 1.5B model: 29 of 5632 units active per token.
    problem = workloads.paperlike(4096, 2048, 5632, seed=0)
    assert problem.params["design_l0"] == pytest.approx(29.0)
    assert problem.l0() == pytest.approx(29.0, abs=3.0)


def test_paperlike_structure():
    problem = workloads.paperlike(2 * 512 + 3, 256, 5632, seed=0, seq_len=512)
    params = problem.params
    assert list(params["sink_rows"]) == [0, 512, 1024]
    dead = params["dead_units"]
    assert len(dead) == round(0.3 * 5632)
    assert np.all(params["unit_threshold"][dead] == 6.0)
    # The 30% dead units practically never fire for ordinary tokens (design rate 2e-5),
    # but do for the sinks.
    fired = problem.gate_preactivation() > 0
    ordinary = np.setdiff1d(np.arange(problem.M), params["sink_rows"])
    assert fired[np.ix_(ordinary, dead)].mean() < 1e-4
    assert fired[np.ix_(params["sink_rows"], dead)].sum() > 0
    # Sinks are heavy: far above the mean, and they overflow 32-slot tiles.
    per_token = fired.sum(axis=1)
    assert per_token[params["sink_rows"]].min() > 5 * per_token[ordinary].mean()
    counts = tile_counts(problem)
    assert np.all(counts[params["sink_rows"]].max(axis=1) > 31)


def test_paperlike_target_l0_scales_with_n():
    assert workloads.paperlike(1, 64, 2816, seed=0).params["design_l0"] == pytest.approx(14.5)
    problem = workloads.paperlike(1, 64, 512, seed=0, target_l0=10.0)
    assert problem.params["design_l0"] == 10.0


def test_heavy_rows_overflow_tiles():
    problem = workloads.heavy(1024, 512, 5632, seed=0)
    heavy_rows = problem.params["heavy_rows"]
    assert len(heavy_rows) == round(0.01 * 1024)
    assert np.all(np.diff(heavy_rows) > 0)
    counts = tile_counts(problem)
    overflowing = np.flatnonzero(counts.max(axis=1) > 31)
    assert len(overflowing) > 0
    # Exactly the heavy tokens overflow: every heavy row does, no ordinary row does.
    assert np.array_equal(overflowing, heavy_rows)
    assert counts.max() < 256


def test_heavy_small_m_keeps_one_heavy_row():
    assert len(workloads.heavy(1, 64, 256).params["heavy_rows"]) == 1
    assert len(workloads.heavy(8, 64, 256, frac=0.0).params["heavy_rows"]) == 0


def test_astype_and_nongated():
    problem = workloads.uniform(8, 64, 256, seed=0)
    as_float = problem.astype(np.float32)
    assert all(a.dtype == np.float32 for a in as_float.arrays())
    np.testing.assert_array_equal(as_float.x, problem.x.astype(np.float32))
    nongated = problem.as_nongated()
    assert nongated.w_gate is None and not nongated.gated
    assert nongated.w_up is problem.w_gate
    np.testing.assert_array_equal(nongated.gate_preactivation(), problem.gate_preactivation())


@pytest.mark.parametrize(
    ("call", "argument"),
    [
        (lambda: workloads.uniform(0, 64, 256), "M"),
        (lambda: workloads.uniform(-3, 64, 256), "M"),
        (lambda: workloads.uniform(2.5, 64, 256), "M"),
        (lambda: workloads.uniform(True, 64, 256), "M"),
        (lambda: workloads.uniform(4, 1, 256), "K"),
        (lambda: workloads.uniform(4, 64, 0), "N"),
        (lambda: workloads.uniform(4, 64, -256), "N"),
        (lambda: workloads.uniform(4, 64, 256, p=0.0), "p"),
        (lambda: workloads.uniform(4, 64, 256, p=1.0), "p"),
        (lambda: workloads.uniform(4, 64, 256, p=-0.1), "p"),
        (lambda: workloads.uniform(4, 64, 256, p=float("nan")), "p"),
        (lambda: workloads.uniform(4, 64, 256, seed=-1), "seed"),
        (lambda: workloads.heavy(4, 64, 256, frac=1.5), "frac"),
        (lambda: workloads.heavy(4, 64, 256, scale=0.0), "scale"),
        (lambda: workloads.heavy(4, 64, 256, scale=float("inf")), "scale"),
        (lambda: workloads.paperlike(4, 64, 256, seq_len=0), "seq_len"),
        (lambda: workloads.paperlike(4, 64, 256, target_l0=-1.0), "target_l0"),
        (lambda: workloads.paperlike(4, 64, 256, target_l0=1e6), "target_l0"),
        (lambda: workloads.paperlike(4, 64, 256, dead_frac=1.0), "dead_frac"),
        (lambda: workloads.density(2.0, 4, 64, 256), "p"),
        (lambda: make("nope", 4, 64, 256), "name"),
        (lambda: make("density", 4, 64, 256), "p"),
    ],
)
def test_bad_arguments_raise(call, argument):
    with pytest.raises(ValueError, match=argument):
        call()


def test_docstring_examples():
    result = doctest.testmod(workloads, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0
    assert result.failed == 0


def test_benchmark_names_set_the_parameters():
    """The benchmark's command-line names: ``density=P``, ``heavy=F`` and ``heavy=FxS``."""
    from twell.benchmark import make_problem

    assert make_problem("density=0.02", 8, 64, 256).params["p"] == 0.02
    p = make_problem("heavy=0.02", 500, 64, 256)
    assert len(p.params["heavy_rows"]) == 10 and p.params["frac"] == 0.02
    assert len(make_problem("heavy", 500, 64, 256).params["heavy_rows"]) == 5
    p = make_problem("heavy=0.02x4", 500, 64, 256)
    assert len(p.params["heavy_rows"]) == 10 and p.params["scale"] == 4.0
    assert make_problem("heavy=0.02", 500, 64, 256).params["scale"] == 3.0
    for bad in ("heavy=0.02x", "heavy=x4", "heavy=", "heavy=0.02X4"):
        with pytest.raises(ValueError, match="heavy=FxS"):
            make_problem(bad, 500, 64, 256)
