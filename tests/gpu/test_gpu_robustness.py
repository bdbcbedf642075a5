"""No silent wrong numbers on the GPU (docs/ops.md, "Errors and bad input"): the public
ops on CuPy arrays raise or equal dense float64 math (skipped without a GPU; run on the
GPU machine).

Only the public API is used (``twell.gate``, ``twell.down``, ``twell.gated_down``,
``twell.ffn``, ``twell.SparseFFN``), on CuPy arrays and formats wrapped around CuPy
buffers by the public constructors. The properties are those of tests/test_robustness.py:
a user-built Hybrid with a defect raises ``ValueError`` naming the argument before any
kernel reads it; a valid one, and NaN/Inf in any weight or token, give what dense math
gives (NaN and ±Inf at the same positions, relative error <= 1e-2 elsewhere). The shapes
are few and fixed (K = 16, tile 256) so that the kernels compile once per variant.

``pytest -s -k cost tests/test_gpu_robustness.py`` prints what validating a user-built
Hybrid costs at the paper's shape, next to the ``down`` that reads it.
"""

from __future__ import annotations

import math
import statistics
import time

import cupy as cp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import twell
from twell import Hybrid, TwELL, workloads
from twell._arrays import bfloat16, round_bf16
from twell.options import PATHS
from twell.testing import as_host, assert_relative_error
from twell.testing import strategies as tst

# The public ops as a user calls them, on buffers as CuPy's pool hands them out.
pytestmark = pytest.mark.unpoisoned

K = 16  # one KDIM for every kernel variant these tests compile
TILE = 256
SLOTS = (4, 32)  # 4: many overflowing (heavy) rows; 32: the default
TOL = 1e-2
# Kernel variants compile on first use: no deadline. Fewer examples than the CPU suite.
GPU = settings(deadline=None, max_examples=40)
# Valid Hybrids wrapped around user buffers; no subnormals (the GPU flushes them to zero,
# so 0 · Inf would turn a subnormal · Inf = Inf of dense math into NaN).
USER_BUILT = dict(tiles=(TILE,), construction="raw", slot_choices=SLOTS, allow_subnormal=False)


# ---------------------------------------------------------------------- helpers
def relu(a: np.ndarray) -> np.ndarray:
    return np.where(np.isnan(a), a, np.maximum(a, 0))


def f64(a) -> np.ndarray:  # noqa: ANN001
    return as_host(a).astype(np.float64)


def bf16(a: np.ndarray) -> np.ndarray:
    return round_bf16(a.astype(np.float32))


def to_gpu(a: np.ndarray | None):  # noqa: ANN201
    if a is None:
        return None
    if np.dtype(a.dtype) == bfloat16:
        return cp.asarray(np.ascontiguousarray(a).view(np.uint16)).view(bfloat16)
    return cp.asarray(np.ascontiguousarray(a))


def on_gpu(h: Hybrid) -> Hybrid:
    """The same user buffers on the GPU, wrapped by the public constructors."""
    ell = TwELL(cp.asarray(h.packed), h.shape, h.tile, h.slots)
    return Hybrid(ell, cp.asarray(h.dense_rows), cp.asarray(h.dense))


def assert_matches(actual, expected: np.ndarray) -> None:  # noqa: ANN001
    got = f64(actual)
    assert got.shape == expected.shape, (got.shape, expected.shape)
    if got.size:
        assert_relative_error(got, expected, TOL)


def dense_block(x, w_gate, w_up, w_down) -> np.ndarray:  # noqa: ANN001
    """float64 dense math with the gate values rounded to bf16 (as the kernels store them)."""
    x2 = f64(x)
    with np.errstate(all="ignore"):
        if w_gate is None:
            return f64(bf16(relu(x2 @ f64(w_up).T))) @ f64(w_down).T
        g = f64(bf16(relu(x2 @ f64(w_gate).T)))
        return (g * (x2 @ f64(w_up).T)) @ f64(w_down).T


def weights_for(m: int, n: int, rng: np.random.Generator, nonfinite: bool) -> tuple:
    x = bf16(rng.standard_normal((m, K)))
    w_up = bf16(rng.standard_normal((n, K)) / math.sqrt(K))
    w_down = bf16(rng.standard_normal((K, n)) / math.sqrt(n))
    if nonfinite:
        w_down[rng.integers(K), rng.integers(n)] = rng.choice([np.nan, np.inf, -np.inf])
        w_up[rng.integers(n), rng.integers(K)] = rng.choice([np.nan, np.inf, -np.inf])
    return x, w_up, w_down


# ---------------------------------------------------------------------- user-built formats
@GPU
@given(
    st.one_of(
        tst.corrupt_hybrids(tiles=(TILE,), slot_choices=SLOTS).map(lambda case: case.matrix),
        tst.hybrid_matrices(**USER_BUILT),
        tst.hybrid_matrices(**USER_BUILT, rows=st.integers(0, 3)),
    ),
    st.booleans(),
    st.integers(0, 2**32 - 1),
)
def test_user_built_hybrids_raise_or_equal_dense_math(h, nonfinite, seed):
    """twell.down / twell.gated_down on a CuPy Hybrid from user buffers."""
    x, w_up, w_down = weights_for(h.shape[0], h.shape[1], np.random.default_rng(seed), nonfinite)
    hg = on_gpu(h)
    xg, wug, wdg = to_gpu(x), to_gpu(w_up), to_gpu(w_down)
    try:
        h.validate()  # the host copy decides what the GPU call must do
    except ValueError:
        with pytest.raises(ValueError, match=r"^h[.:]"):
            twell.down(hg, wdg)
        with pytest.raises(ValueError, match=r"^g[.:]"):
            twell.gated_down(xg, on_gpu(h), wug, wdg)
        return
    dense = h.to_dense(np.float64)
    with np.errstate(all="ignore"):
        want_down = dense @ f64(w_down).T
        want_gated = (dense * (f64(x) @ f64(w_up).T)) @ f64(w_down).T
    assert_matches(twell.down(hg, wdg), want_down)
    assert_matches(twell.gated_down(xg, hg, wug, wdg), want_gated)


@pytest.mark.parametrize("kind", tst.HYBRID_CORRUPTIONS)
@settings(deadline=None, max_examples=8)
@given(data=st.data())
def test_each_corruption_raises_before_a_kernel_reads_it(kind, data):
    h = on_gpu(data.draw(tst.corrupt_hybrids(kind, tiles=(TILE,), slot_choices=SLOTS)).matrix)
    m, n = h.shape
    with pytest.raises(ValueError, match=r"^h\.(packed|dense_rows): "):
        twell.down(h, cp.ones((K, n), cp.float32))
    with pytest.raises(ValueError, match=r"^g\.(packed|dense_rows): "):
        twell.gated_down(cp.ones((m, K), cp.float32), h, cp.ones((n, K), cp.float32),
                         cp.ones((K, n), cp.float32))  # fmt: skip


def test_validation_runs_once_and_never_on_twell_outputs(monkeypatch):
    calls = []
    original = Hybrid.validate

    def counting(self):  # noqa: ANN001, ANN202
        calls.append(self)
        return original(self)

    monkeypatch.setattr(Hybrid, "validate", counting)
    p = workloads.uniform(64, K, 512, p=0.05, seed=1)
    x, wg, wu, wd = (to_gpu(a) for a in p.arrays())
    built = twell.gate(x, wg)
    for _ in range(3):
        twell.down(built, wd)
        twell.gated_down(x, built, wu, wd)
    assert calls == []
    user = Hybrid(TwELL(built.packed.copy(), built.shape, TILE, 32), built.dense_rows,
                  built.dense)  # fmt: skip
    for _ in range(3):
        twell.down(user, wd)
        twell.gated_down(x, user, wu, wd)
    assert calls == [user]


# ---------------------------------------------------------------------- non-finite weights
@GPU
@given(
    tst.nonfinite_ffn_problems(
        places=("w_gate", "w_up", "w_down", "x"), k=K, tile=TILE, tiles=st.integers(1, 2)
    ),
    st.sampled_from(SLOTS),
)
def test_nonfinite_weights_and_inputs_give_dense_math(problem, slots):
    """NaN/Inf in any weight (active unit or not) or token: every public GPU op."""
    x, wg, wu, wd = (to_gpu(a) for a in problem)
    want = dense_block(*problem)
    assert_matches(twell.ffn(x, wg, wu, wd, slots=slots), want)
    for path in PATHS:
        block = twell.SparseFFN(wg, wu, wd, slots=slots, path=path)
        assert_matches(block(x), want)
    h = twell.gate(x, wg if wg is not None else wu, slots=slots)
    if wg is None:
        assert_matches(twell.down(h, wd), want)
    else:
        assert_matches(twell.gated_down(x, h, wu, wd), want)


@GPU
@given(tst.nonfinite_ffn_problems(k=K, tile=TILE, tiles=st.integers(1, 2)))
def test_nonfinite_weights_with_torch_tensors(problem):
    torch = pytest.importorskip("torch")
    tensors = [None if a is None else torch.from_numpy(a.astype(np.float32)).cuda().bfloat16()
               for a in problem]  # fmt: skip
    want = dense_block(*problem)
    assert_matches(twell.ffn(*tensors).float().cpu().numpy(), want)
    assert_matches(twell.SparseFFN(*tensors[1:])(tensors[0]).float().cpu().numpy(), want)


# ---------------------------------------------------------------------- M = 0
@pytest.mark.parametrize("batch", [(0,), (3, 0)])
def test_an_empty_batch_gives_an_empty_result(batch):
    p = workloads.uniform(4, K, 512, p=0.05, seed=2)
    _, wg, wu, wd = (to_gpu(a) for a in p.arrays())
    x = cp.zeros((*batch, K), cp.float32)
    h = twell.gate(x, wg)
    assert isinstance(h, Hybrid) and h.shape == (0, 512) and h.xp is cp and h.nnz == 0
    y = twell.down(h, wd)
    assert y.shape == (0, K) and np.dtype(y.dtype) == bfloat16
    for y in (twell.gated_down(x, h, wu, wd), twell.ffn(x, wg, wu, wd), twell.ffn(x, None, wu, wd)):
        assert isinstance(y, cp.ndarray) and y.shape == (*batch, K) and y.dtype == cp.float32


def test_an_empty_batch_of_torch_tensors():
    torch = pytest.importorskip("torch")
    p = workloads.uniform(4, K, 512, p=0.05, seed=2)
    _, wg, wu, wd = (torch.from_numpy(a.astype(np.float32)).cuda() for a in p.arrays())
    x = torch.zeros((2, 0, K), device="cuda")
    y = twell.ffn(x, wg, wu, wd)
    assert isinstance(y, torch.Tensor) and y.shape == (2, 0, K) and y.dtype == torch.float32
    assert twell.down(twell.gate(x, wg), wd).dtype == torch.bfloat16


# ---------------------------------------------------------------------- the cost
def _median_ms(fn, reps: int = 7) -> float:  # noqa: ANN001
    fn()
    times = []
    for _ in range(reps):
        cp.cuda.Device().synchronize()
        start = time.perf_counter()
        fn()
        cp.cuda.Device().synchronize()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def test_validation_cost_and_the_prepared_hot_path(monkeypatch, record_property):
    """What checking a user-built Hybrid costs (paid once per object), against the
    ``down`` that reads it; and the prepared SparseFFN never validates anything."""
    m, n, k = 4096, 5632, 2048
    p = workloads.paperlike(m, k, n, seed=0)
    x, wg, wu, wd = (to_gpu(a) for a in p.arrays())
    built = twell.gate(x, wg)

    def user_built() -> Hybrid:
        return Hybrid(TwELL(built.packed, built.shape, TILE, 32), built.dense_rows, built.dense)

    t_validate = _median_ms(lambda: user_built().validate())
    t_down = _median_ms(lambda: twell.down(built, wd))
    t_first = _median_ms(lambda: twell.down(user_built(), wd))
    nbytes = built.nbytes
    line = (
        f"validate() of a user-built Hybrid M={m} N={n} ({nbytes / 2**20:.1f} MiB): "
        f"{t_validate:.2f} ms; down on a trusted one: {t_down:.2f} ms; down on a new "
        f"user-built one (validate + down): {t_first:.2f} ms"
    )
    print(line)
    for key, value in (("validate_ms", t_validate), ("down_ms", t_down), ("first_ms", t_first)):
        record_property(key, round(value, 3))

    def forbidden(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        raise AssertionError("validate() ran in the prepared SparseFFN path")

    block = twell.SparseFFN(wg, wu, wd)
    monkeypatch.setattr(Hybrid, "validate", forbidden)
    monkeypatch.setattr(TwELL, "validate", forbidden)
    block(x)
    cp.cuda.Device().synchronize()
