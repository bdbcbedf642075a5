"""Decisions each call takes from its own rows (skipped without a GPU): the count build of
the gate GEMM (dense math for a row count read on the device), the heavy rows through it,
and the density decision of one call (``light_rows.decide``) against the host's rule.

Buffers from twell's pool are poisoned (0xFF bytes), so a row a kernel forgot fails.
"""

from __future__ import annotations

import cupy as cp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from twell import workloads
from twell._arrays import bf16_values
from twell.benchmark import to_device
from twell.kernels import gate_gemm, light_rows
from twell.kernels.convert import as_bf16
from twell.kernels.cublas import gemm_nt
from twell.kernels.density import DensitySwitch, light_mean, sample_rows
from twell.kernels.pack import pack
from twell.kernels.pipeline import PreparedBlock
from twell.options import Options
from twell.reference.forward import ffn_dense
from twell.testing.gpu import poisoned_buffers

POISON = 0x7FC1  # a bf16 NaN no kernel writes


@pytest.fixture(autouse=True)
def _poisoned():
    with poisoned_buffers():
        yield


def _f32(bits: cp.ndarray) -> np.ndarray:
    """bf16 bits (uint16) as float64 on the host."""
    return bf16_values(cp.asnumpy(bits)).astype(np.float64)


def _operands(m: int, n: int, k: int, seed: int) -> tuple[cp.ndarray, cp.ndarray]:
    rng = np.random.default_rng(seed)
    a = as_bf16(cp.asarray(rng.standard_normal((m, k), dtype=np.float32)))
    w = as_bf16(cp.asarray(rng.standard_normal((n, k), dtype=np.float32) * 0.05))
    return a, w


def _counted(a, w, count, *, out_ids=None, gate=None, gate_ids=None, rows_out=None):  # noqa: ANN001, ANN202
    """matmul_counted then reduce_counted into a poisoned output; returns its bits."""
    m, k = a.shape
    rows = cp.asarray([count], dtype=cp.int32)
    out = cp.full((rows_out or m, w.shape[0]), POISON, dtype=cp.uint16)
    part = gate_gemm.matmul_counted(a, w, rows, out, out_ids=out_ids, gate=gate, gate_ids=gate_ids)
    gate_gemm.reduce_counted(part, out, rows, m, k, out, gate=gate, gate_ids=gate_ids,
                             out_ids=out_ids)  # fmt: skip
    return out


def _check(m: int, n: int, k: int, count: int, seed: int) -> None:
    a, w = _operands(m, n, k, seed)
    out = _counted(a, w, count)
    c = min(count, m)
    want = _f32(a.view(cp.uint16))[:c] @ _f32(w.view(cp.uint16)).T
    got = _f32(out)
    if c:
        err = np.abs(got[:c] - want).max() / max(np.abs(want).max(), 1e-30)
        assert err < 1e-2, f"count {count}: relative error {err:.2e}"
    assert (cp.asnumpy(out[c:]) == POISON).all(), "rows past the count were written"


@pytest.mark.parametrize(("n", "k"), [(5632, 2048), (2048, 5632), (512, 264), (768, 40)])
@pytest.mark.parametrize("count", [0, 1, 127, 128, 129, 300, 1000, 1536, 5000])
def test_counted_matmul_computes_the_counted_rows_only(n: int, k: int, count: int) -> None:
    """Counts across the splits' boundaries (a part per k-range while few row tiles
    leave SMs idle), a count past M (M rows), none; rows past the count untouched."""
    _check(1536, n, k, count, seed=count + n)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.integers(1, 700), st.integers(1, 6), st.integers(1, 100), st.integers(0, 800),
    st.integers(0, 2**31 - 1),
)  # fmt: skip
def test_hypothesis_counted_matmul(m: int, n_blocks: int, k8: int, count: int, seed: int):
    _check(m, 128 * n_blocks, 8 * k8, count, seed)


@pytest.mark.parametrize("count", [50, 700])
def test_counted_matmul_scatters_and_gates(count: int) -> None:
    """Rows to ``out_ids`` and ``bf16(relu(g) * bf16(v))`` with the gate's rows by id,
    split (50 rows) and unsplit (700): as computed on the host, only those rows written."""
    m, n, k = 1024, 5632, 2048
    a, w = _operands(m, n, k, seed=count)
    rng = np.random.default_rng(count)
    perm = cp.asarray(rng.permutation(m).astype(np.int32))
    gate = as_bf16(cp.asarray(rng.standard_normal((m, n), dtype=np.float32)))
    gate[3] = np.nan  # a NaN gate row stays NaN (relu keeps it)
    out = _counted(a, w, count, out_ids=perm, gate=gate, gate_ids=perm)
    product = _f32(a.view(cp.uint16))[:count] @ _f32(w.view(cp.uint16)).T
    rows = cp.asnumpy(perm[:count])
    g = _f32(gate.view(cp.uint16))[rows]
    want = np.where(np.isnan(g), np.nan, np.maximum(g, 0)) * product
    got = _f32(out)[rows]
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    assert np.abs(got[ok] - want[ok]).max() / np.abs(want[ok]).max() < 1e-2
    untouched = np.ones(m, bool)
    untouched[rows] = False
    assert (cp.asnumpy(out)[untouched] == POISON).all()


def test_a_rows_bits_depend_on_the_count_only_through_its_parts() -> None:
    """Counts with the same number of parts give a row the same bits; a count that
    splits otherwise may not (the parts add in another order)."""
    a, w = _operands(512, 2048, 5632, seed=1)
    assert gate_gemm.count_splits(100, 2048, 5632, gate_gemm.MAX_SPLITS) == (
        gate_gemm.count_splits(128, 2048, 5632, gate_gemm.MAX_SPLITS)
    )
    assert cp.array_equal(_counted(a, w, 100)[:100], _counted(a, w, 128)[:100])
    assert gate_gemm.count_splits(400, 2048, 5632, gate_gemm.MAX_SPLITS) != (
        gate_gemm.count_splits(100, 2048, 5632, gate_gemm.MAX_SPLITS)
    )


def _host_decision(counts: np.ndarray, flags: np.ndarray, row_limit: int, threshold: float) -> int:
    mean = float(light_mean(counts.astype(np.float32), flags, row_limit, np))
    return int(mean > threshold)


@pytest.mark.parametrize("p", [0.002, 0.01, 0.02, 0.05])
@pytest.mark.parametrize("source", ["pre", "packed"])
def test_the_call_decides_as_the_host_rule_on_its_sample(p: float, source: str) -> None:
    """The device decision from the pre-activation or from TwELL words equals the host's
    rule (density.light_mean of the same sample rows against the threshold); with TwELL
    words a dense call flags every row heavy. Two heavy rows in the sample are left out
    of the mean."""
    m, k, n = 4096, 256, 2048
    prob = workloads.uniform(m, k, n, p=p, seed=int(p * 1000))
    x = prob.x.astype(np.float32)
    sample = np.arange(m)[sample_rows(m, DensitySwitch.SAMPLE_ROWS)][: DensitySwitch.SAMPLE_ROWS]
    x[sample[:2], 1:] *= 4
    xg = as_bf16(cp.asarray(x))
    wg = as_bf16(to_device(prob.w_gate))
    pre = gemm_nt(xg, wg)
    units = (cp.asnumpy(pre.view(cp.int16))[sample] > 0).sum(axis=1)
    row_limit = Options().row_limit(n)
    switch = DensitySwitch(n, row_limit)
    threshold = switch.threshold(m)
    want = _host_decision(units, np.zeros(len(sample), np.uint8), row_limit, threshold)
    kw = dict(tile=256, slots=32, row_limit=row_limit, threshold=threshold, kdim=k, gated=True)
    if source == "pre":
        got = light_rows.decide(m, n, pre=pre, **kw)
    else:
        packed, heavy = pack(pre, 256, 32)
        flags = cp.asnumpy(heavy)[sample]
        want = _host_decision(units, flags, row_limit, threshold)
        got = light_rows.decide(m, n, packed=packed, heavy=heavy, **kw)
        assert bool(cp.asnumpy(heavy).all()) == bool(want)
    assert int(got[0]) == want
    assert want == int(p >= 0.02)  # the workloads straddle the crossover as intended


@pytest.mark.parametrize("share", ["one", 0.1, 0.5, "all", "nan"])
def test_heavy_shares_from_one_row_to_all_rows(share: object) -> None:
    """Heavy rows by count at any share, and NaN rows (heavy, NaN out as in dense math):
    the block against float64 dense math."""
    m, k, n = 2048, 256, 1024
    prob = workloads.uniform(m, k, n, p=0.004, seed=11)
    x = prob.x.astype(np.float32)
    rng = np.random.default_rng(11)
    if share == "one":
        x[1234, 1:] *= 4
    elif share == "all":
        x[:, 1:] *= 4
    elif share == "nan":
        x[[5, 700], 3] = np.nan
    else:
        x[rng.random(m) < share, 1:] *= 4
    x = x.astype(ml_dtypes.bfloat16).astype(np.float32)  # what the block reads
    w = [to_device(a) for a in (prob.w_gate, prob.w_up, prob.w_down)]
    block = PreparedBlock(*w, Options(dense_capacity="auto", density_switch=False))
    y = block.forward(as_bf16(cp.asarray(x)))
    want = ffn_dense(x, prob.w_gate, prob.w_up, prob.w_down)
    got = _f32(y.view(cp.uint16))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    rows = ~np.isnan(want).any(axis=1)
    err = np.linalg.norm(got[rows] - want[rows]) / np.linalg.norm(want[rows])
    assert err < 1e-2


@pytest.mark.parametrize(("m", "count"), [(2048, 2048), (2048, 1500), (16384, 16384), (700, 650)])
def test_gated_count_build_rounds_as_its_reduction(m: int, count: int) -> None:
    """Unsplit with a gate (whose rows reach the epilogue through shared memory, a tile
    ahead): every counted row's bits are ``bf16(relu(g) * v)`` of the ungated build's
    ``v``, exactly (a product of two bf16 is exact in fp32), with several tiles per CTA
    and the gate's rows by a permutation; the rows past the count untouched."""
    n, k = 5632, 2048
    a, w = _operands(m, n, k, seed=m + count)
    assert gate_gemm.count_splits(count, n, k, gate_gemm.MAX_SPLITS) == 1
    rng = np.random.default_rng(count)
    perm = cp.asarray(rng.permutation(m).astype(np.int32))
    gate = as_bf16(cp.asarray(rng.standard_normal((m, n), dtype=np.float32)))
    gate[5, :7] = np.nan
    v = _f32(_counted(a, w, count))[:count]
    got = _f32(_counted(a, w, count, gate=gate, gate_ids=perm))
    g = _f32(gate.view(cp.uint16))[cp.asnumpy(perm[:count])]
    want = (np.where(np.isnan(g), np.nan, np.maximum(g, 0)) * v).astype(np.float32)
    want = want.astype(ml_dtypes.bfloat16).astype(np.float64)
    np.testing.assert_array_equal(got[:count], want)
    assert (cp.asnumpy(_counted(a, w, count, gate=gate, gate_ids=perm)[count:]) == POISON).all()


@pytest.mark.parametrize("count", [512, 511, 600])
def test_a_count_of_all_rows_reads_the_source_in_place(count: int) -> None:
    """Given ``a_all`` (the matrix a gathered rows from by ascending ids), a count of
    all M rows reads it in place of ``a`` (the gather skipped: ``a`` left poisoned here),
    and gives the bits of the gathered copy; a smaller count reads ``a``."""
    m, n, k = 512, 2048, 1024
    src, w = _operands(m, n, k, seed=count)
    ids = cp.arange(m, dtype=cp.int32)
    rows = cp.asarray([count], dtype=cp.int32)
    gathered = cp.full((m, k), POISON, dtype=cp.uint16).view(src.dtype)
    gate_gemm.gather_counted(src, ids, rows, gathered, skip_all=True)
    c = min(count, m)
    if c == m:
        assert (gathered.view(cp.uint16) == POISON).all(), "the gather ran"
    else:
        assert cp.array_equal(gathered[:c], src[:c])
    out = cp.full((m, n), POISON, dtype=cp.uint16)
    part = gate_gemm.matmul_counted(gathered, w, rows, out, a_all=src)
    gate_gemm.reduce_counted(part, out, rows, m, k, out)
    assert cp.array_equal(out[:c], _counted(src, w, count)[:c])
    with pytest.raises(ValueError, match="x_all"):
        gate_gemm.launch(src, w, tile=256, slots=32, output=gate_gemm.OUTPUT_DENSE,
                         pre=out, x_all=src)  # fmt: skip
