"""The "reuse" route (light_rows_reuse.cu) on the GPU (skipped without one).

Its down projection reads each 256-unit chunk of ``w_down_t`` once per block of tokens and
sums every row's entries in the order the per-token gather does, with the gather's up
products: so its output bits must equal the "epilogue" route's (the same gate), for every
block geometry (tokens per group), width and problem; and both must match float64 dense
math. Output buffers are poisoned (0xFF bytes) before every launch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import ml_dtypes
import numpy as np
import pytest

from twell import reference, workloads
from twell.kernels.compile import unavailable_reason

pytestmark = pytest.mark.gpu

_REASON = unavailable_reason()
if _REASON is not None:
    pytest.skip(_REASON, allow_module_level=True)

import cupy as cp  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from twell.benchmark import to_device as to_gpu  # noqa: E402
from twell.kernels import gate_gemm, light_rows, light_rows_reuse  # noqa: E402
from twell.kernels.buffers import empty_bf16  # noqa: E402
from twell.kernels.convert import as_bf16  # noqa: E402
from twell.kernels.pipeline import PreparedBlock  # noqa: E402
from twell.options import Options  # noqa: E402
from twell.testing import strategies as tst  # noqa: E402
from twell.testing.asserts import as_host  # noqa: E402
from twell.testing.gpu import captured_replays, poisoned_buffers  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.fixture(autouse=True)
def poisoned_outputs() -> Iterator[None]:
    with poisoned_buffers():
        yield


def to_f64(a: object) -> np.ndarray:
    return as_host(a).astype(np.float64)


def assert_close(y: np.ndarray, ref: np.ndarray, tol: float = 1e-2) -> None:
    finite = np.isfinite(ref)
    np.testing.assert_array_equal(np.isfinite(y), finite)
    rows = finite.all(axis=1)
    err = np.linalg.norm(y[rows] - ref[rows]) / max(np.linalg.norm(ref[rows]), 1e-30)
    assert err <= tol, f"relative error {err:.3e} > {tol}"


def same_bits(a: cp.ndarray, b: cp.ndarray) -> bool:
    return bool(cp.array_equal(a.view(cp.uint16), b.view(cp.uint16)))


def with_special_rows(p: workloads.Problem) -> workloads.Problem:
    """Rows 0: all zero; 1: NaN; 2: +Inf; 3: every unit active (when M allows)."""
    x = p.x.astype(np.float32)
    if x.shape[0] > 3:
        x[0] = 0
        x[1, 5] = np.nan
        x[2, 7] = np.inf
        x[3, 0] = -30.0
    return dataclasses.replace(p, x=x.astype(BF16))


CASES = [
    # (name, M, K, N, tile, slots, p): K not a multiple of 64, N not of the 256-unit chunk,
    # rows of more than 8 entries in one chunk (the group's window refilled), tiles of 32
    ("small", 1, 256, 512, 256, 32, 0.02),
    ("odd", 129, 264, 768, 256, 32, 0.02),
    ("refill", 300, 512, 1024, 256, 64, 0.06),
    ("narrow-tiles", 257, 1000, 544, 32, 8, 0.02),
    ("wide-k", 70, 4096, 512, 256, 32, 0.02),
    ("many", 2000, 512, 1024, 256, 32, 0.02),
]


def _block(p: workloads.Problem, gated: bool, path: str, tile: int, slots: int, **kw) -> tuple:
    w_gate = p.w_gate if gated else None
    x, wg, wu, wd = (to_gpu(a) for a in (p.x, w_gate, p.w_up, p.w_down))
    options = Options(tile=tile, slots=slots, path=path, density_switch=False, **kw)
    return x, PreparedBlock(wg, wu, wd, options)


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize(("name", "m", "k", "n", "tile", "slots", "p"), CASES)
def test_reuse_route_gives_the_epilogue_bits(name, m, k, n, tile, slots, p, gated):
    prob = with_special_rows(workloads.uniform(m, k, n, p=p, seed=m + k))
    x, reuse = _block(prob, gated, "reuse", tile, slots)
    _, epilogue = _block(prob, gated, "epilogue", tile, slots)
    y = reuse(x)
    assert same_bits(y, epilogue(x))
    oracle = reference.forward.ffn_dense(prob.x, prob.w_gate if gated else None, prob.w_up,
                                         prob.w_down)  # fmt: skip
    assert_close(to_f64(y), oracle)
    assert same_bits(y, reuse(x)), "not deterministic"


GEOMETRIES = [(8, None, 4), (4, None, 4), (2, None, 2), (1, 3, 6), (8, 2, 3)]


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize(("tpg", "warps", "stages"), GEOMETRIES)
def test_every_block_geometry_gives_the_gather_bits(tpg, warps, stages, gated: bool):
    """The light stage alone, against light_rows.from_twell on the same TwELL: every
    row's bits, whatever the tokens per CTA, the consumer warps and the ring depth."""
    m, k, n = 1100, 520, 1024
    prob = with_special_rows(workloads.heavy(m, k, n, p=0.03, frac=0.05, seed=tpg))
    x, wg, wu, wd = (as_bf16(to_gpu(a)) for a in (prob.x, prob.w_gate, prob.w_up, prob.w_down))
    w_up = wu if gated else None  # non-gated: relu(x @ wg.T) @ wd.T, as sparse as the gate
    w_down_t = cp.ascontiguousarray(wd.T)
    packed, heavy = gate_gemm.gate_pack(x, wg, 256, 32)
    heavy_gather, heavy_reuse = heavy.copy(), heavy.copy()
    y_gather, y_reuse = empty_bf16((m, k)), empty_bf16((m, k))
    light_rows.from_twell(x if gated else None, packed, heavy_gather, w_up, w_down_t, y_gather,
                          tile=256, slots=32, max_row_nnz=60)  # fmt: skip
    made = light_rows_reuse.pairs(x if gated else None, packed, heavy_reuse, w_up, n, k,
                                  tile=256, slots=32, max_row_nnz=60)  # fmt: skip
    light_rows_reuse.down(*made, heavy_reuse, w_down_t, y_reuse, tpg=tpg, warps=warps,
                          stages=stages)  # fmt: skip
    assert cp.array_equal(heavy_gather, heavy_reuse)
    light = cp.asnumpy(heavy_reuse) == 0
    assert light.sum() > m // 2 and (~light).sum() > 3  # both kinds of rows exercised
    assert np.array_equal(cp.asnumpy(y_gather.view(cp.uint16))[light],
                          cp.asnumpy(y_reuse.view(cp.uint16))[light])  # fmt: skip
    # heavy rows are left alone (still poisoned) by both
    assert np.all(cp.asnumpy(y_reuse.view(cp.uint16))[~light] == 0xFFFF)


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
def test_training_outputs_equal_the_epilogue_routes(gated: bool):
    """forward(save=True): y, the rows' L1 terms and the up products, bit for bit."""
    prob = with_special_rows(workloads.heavy(700, 512, 1024, p=0.02, frac=0.03, seed=4))
    x, reuse = _block(prob, gated, "reuse", 256, 32, dense_capacity=0.0)
    _, epilogue = _block(prob, gated, "epilogue", 256, 32, dense_capacity=0.0)
    y_r, act_r = reuse.forward(x, save=True)
    y_e, act_e = epilogue.forward(x, save=True)
    assert same_bits(y_r, y_e)
    assert cp.array_equal(act_r.heavy, act_e.heavy)
    assert cp.array_equal(act_r.row_l1.view(cp.uint32), act_e.row_l1.view(cp.uint32))
    if gated:
        counts = cp.asnumpy(act_e.packed[:, ::32].sum(axis=1))
        light = cp.asnumpy(act_e.heavy) == 0
        up_r, up_e = cp.asnumpy(act_r.up.view(cp.uint32)), cp.asnumpy(act_e.up.view(cp.uint32))
        for t in np.nonzero(light)[0]:
            c = int(min(counts[t], up_r.shape[1]))
            assert np.array_equal(up_r[t, :c], up_e[t, :c]), t


def test_capture_replays_the_eager_bits():
    pytest.importorskip("torch")
    prob = with_special_rows(workloads.heavy(600, 512, 1024, p=0.02, frac=0.03, seed=8))
    x, block = _block(prob, True, "reuse", 256, 32)
    eager = block(x)
    first, y = captured_replays(lambda: block(x))
    assert same_bits(first, y) and same_bits(y, eager)


def test_large_m_not_multiple_of_any_block():
    m, k, n = 131072 + 37, 256, 512
    rng = np.random.default_rng(2)
    x = cp.asarray(rng.standard_normal((m, k), dtype=np.float32))
    x[:, 0] = 1
    wg = cp.asarray(rng.standard_normal((n, k), dtype=np.float32) / np.sqrt(k))
    wg[:, 0] = -2.3
    wu = cp.asarray(rng.standard_normal((n, k), dtype=np.float32) / np.sqrt(k))
    wd = cp.asarray(rng.standard_normal((k, n), dtype=np.float32) / np.sqrt(n))
    x[1000] *= 6  # a heavy row
    xb, wgb, wub, wdb = (as_bf16(a) for a in (x, wg, wu, wd))
    opts = {"density_switch": False}
    y = PreparedBlock(wgb, wub, wdb, Options(path="reuse", **opts))(xb)
    ref = PreparedBlock(wgb, wub, wdb, Options(path="epilogue", **opts))(xb)
    assert same_bits(y, ref)
    rows = np.r_[0:64, 1000, m - 64 : m]
    dense = reference.forward.ffn_dense(to_f64(xb)[rows], to_f64(wgb), to_f64(wub), to_f64(wdb))
    assert_close(to_f64(y)[rows], dense)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    tst.ffn_problems(k=st.sampled_from([8, 16, 264]), tiles=st.integers(1, 3), tile=256,
                     rows=st.integers(1, 70)),
    st.sampled_from(light_rows_reuse.TOKENS_PER_GROUP),
)  # fmt: skip
def test_hypothesis_reuse_equals_epilogue(p: tst.FFNProblem, tpg: int):
    args = [None if a is None else as_bf16(cp.asarray(a)) for a in p]
    opts = {"density_switch": False}
    epilogue = PreparedBlock(*args[1:], Options(path="epilogue", **opts))(args[0])
    real = light_rows_reuse.tokens_per_group
    light_rows_reuse.tokens_per_group = lambda *a: tpg
    try:
        y = PreparedBlock(*args[1:], Options(path="reuse", **opts))(args[0])
    finally:
        light_rows_reuse.tokens_per_group = real
    assert same_bits(y, epilogue)
    assert_close(to_f64(y), reference.forward.ffn_dense(*p))
