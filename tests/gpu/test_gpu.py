"""GPU kernels against the NumPy reference and float64 dense math (skipped without a GPU).

Every output buffer the launchers allocate is poisoned (0xFF bytes: NaN in bf16) before
the kernels run, so an unwritten element fails the comparison.
"""

from __future__ import annotations

import dataclasses

import cupy as cp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from twell import reference, workloads
from twell.benchmark import to_device as to_gpu
from twell.formats import Hybrid, TwELL, to_host
from twell.kernels import buffers, gate_gemm, heavy_rows, hybrid_ops
from twell.kernels.convert import as_bf16
from twell.kernels.cublas import gemm_nt
from twell.kernels.pack import pack
from twell.kernels.pipeline import PreparedBlock
from twell.options import PATHS, Options
from twell.testing import strategies as tst
from twell.testing.asserts import as_host
from twell.testing.gpu import captured_replays, poisoned_buffers

BF16 = np.dtype(ml_dtypes.bfloat16)


def to_f64(a: object) -> np.ndarray:
    return as_host(a).astype(np.float64)


def rel_err(y: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(y - ref) / max(np.linalg.norm(ref), 1e-30))


def assert_close(y: np.ndarray, ref: np.ndarray, tol: float = 1e-2) -> None:
    """Finite where ref is finite (and the same non-finite pattern), rel. error <= tol."""
    finite = np.isfinite(ref)
    np.testing.assert_array_equal(np.isfinite(y), finite)
    rows = finite.all(axis=1)
    err = rel_err(y[rows], ref[rows])
    assert err <= tol, f"relative error {err:.3e} > {tol}"


def problem(kind: str, m: int, k: int, n: int, seed: int = 0) -> workloads.Problem:
    if kind == "uniform":
        return workloads.uniform(m, k, n, p=0.02, seed=seed)
    if kind == "heavy":
        return workloads.heavy(m, k, n, p=0.02, frac=0.05, seed=seed)
    if kind == "dense":  # p = 0.3: most rows overflow at slots=32
        return workloads.uniform(m, k, n, p=0.3, seed=seed)
    if kind == "wide":  # p = 0.2 at N=5632: > 1024 active units per row, no tile > 127
        return workloads.uniform(m, k, n, p=0.2, seed=seed)
    raise ValueError(kind)


def with_special_rows(p: workloads.Problem) -> workloads.Problem:
    """Rows 0: all zero; 1: NaN; 2: +Inf; 3: every unit active (when M allows)."""
    x = p.x.astype(np.float32)
    m = x.shape[0]
    if m > 3:
        x[0] = 0
        x[1, 5] = np.nan
        x[2, 7] = np.inf
        x[3, 0] = -30.0  # w_gate[:, 0] = -z < 0: every gate pre-activation turns positive
    return dataclasses.replace(p, x=x.astype(BF16))


CASES = [
    # (workload, M, K, N, slots)
    ("uniform", 1, 256, 512, 32),
    ("uniform", 129, 264, 512, 32),
    ("heavy", 300, 512, 1024, 32),
    ("heavy", 1000, 2048, 1024, 64),
    ("dense", 257, 256, 512, 32),
    ("uniform", 777, 1024, 768, 128),
    ("heavy", 64, 4096, 512, 32),
    ("wide", 70, 256, 5632, 128),
    ("heavy", 2000, 512, 1024, 32),  # above the one-warp-per-token threshold
]
PACK_CASES = [CASES[i] for i in (1, 2, 3, 4, 7, 8)]


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize(("kind", "m", "k", "n", "slots"), CASES)
def test_ffn_matches_dense_float64(kind: str, m: int, k: int, n: int, slots: int, gated: bool):
    p = with_special_rows(problem(kind, m, k, n, seed=m + k))
    w_gate = p.w_gate if gated else None
    args = [to_gpu(a) for a in (p.x, w_gate, p.w_up, p.w_down)]
    y = hybrid_ops.ffn(*args, Options(slots=slots))
    assert y.shape == (m, k) and np.dtype(y.dtype) == BF16
    oracle = reference.forward.ffn_dense(p.x, w_gate, p.w_up, p.w_down)
    y64 = to_f64(y)
    assert_close(y64, oracle)
    if m > 3:
        assert np.all(y64[0] == 0)
    again = hybrid_ops.ffn(*args, Options(slots=slots))
    assert cp.array_equal(y.view(cp.uint16), again.view(cp.uint16)), "not deterministic"


@pytest.mark.parametrize("path", ["epilogue", "pack"])
@pytest.mark.parametrize(("kind", "m", "k", "n", "slots"), CASES[:5] + CASES[7:])
def test_gate_packs_like_the_reference(kind: str, m: int, k: int, n: int, slots: int, path: str):
    p = with_special_rows(problem(kind, m, k, n, seed=7 + m))
    x, wg = to_gpu(p.x), to_gpu(p.w_gate)
    h = hybrid_ops.gate(x, wg, Options(slots=slots), path=path)
    assert isinstance(h, Hybrid)
    h.validate()
    pre = p.x.astype(np.float64) @ p.w_gate.astype(np.float64).T
    ref = reference.forward.relu(pre)
    got = to_f64(h.to_dense(np.float32))
    # Away from the ReLU threshold, the same pattern and the same values (bf16 rounding).
    tol = 0.05
    clear = np.abs(pre) > tol
    clear &= np.isfinite(pre)
    np.testing.assert_array_equal(got[clear] != 0, ref[clear] != 0)
    close = np.abs(got[clear] - ref[clear]) <= 1e-2 * np.abs(ref[clear]) + 1e-6
    assert close.all()
    near = ~clear & np.isfinite(pre)
    assert np.all((got[near] >= 0) & (got[near] <= 2 * tol))
    # Non-finite rows and overflowing rows are dense; the count words are the true counts.
    rows = set(to_f64(h.dense_rows).astype(int).tolist())
    nonfinite = set(np.nonzero(~np.isfinite(pre).all(axis=1))[0].tolist())
    assert nonfinite <= rows
    counts = to_f64(h.ell.counts()).astype(int)
    dense_gpu = got != 0
    true_counts = dense_gpu.reshape(m, n // 256, 256).sum(axis=2)
    light = np.array([i not in rows for i in range(m)])
    np.testing.assert_array_equal(counts[light], true_counts[light])
    overflow = (true_counts > slots - 1).any(axis=1)
    assert set(np.nonzero(overflow)[0].tolist()) <= rows
    assert rows <= set(np.nonzero(overflow)[0].tolist()) | nonfinite
    # Deterministic bits.
    again = hybrid_ops.gate(x, wg, Options(slots=slots), path=path)
    assert cp.array_equal(h.packed, again.packed)
    assert cp.array_equal(h.dense.view(cp.uint16), again.dense.view(cp.uint16))


@pytest.mark.parametrize(("kind", "m", "k", "n", "slots"), PACK_CASES)
def test_down_and_gated_down_match_the_reference(kind: str, m: int, k: int, n: int, slots: int):
    p = with_special_rows(problem(kind, m, k, n, seed=3 + m))
    x, wg, wu, wd = (to_gpu(a) for a in (p.x, p.w_gate, p.w_up, p.w_down))
    g = hybrid_ops.gate(x, wg, Options(slots=slots))
    g_host = to_host(g)
    y = to_f64(hybrid_ops.gated_down(x, g, wu, wd))
    assert_close(y, reference.gated_down(p.x, g_host, p.w_up, p.w_down))
    y = to_f64(hybrid_ops.down(g, wd))
    assert_close(y, reference.down(g_host, p.w_down))


def test_down_of_a_float32_hybrid_from_dense():
    rng = np.random.default_rng(1)
    m, n, k = 200, 512, 256
    h = np.maximum(rng.standard_normal((m, n)) - 2.0, 0).astype(np.float32)
    h[5] = np.abs(rng.standard_normal(n))  # a dense row
    w_down = (rng.standard_normal((k, n)) / np.sqrt(n)).astype(BF16)
    hg = Hybrid.from_dense(cp.asarray(h), 256, 32)
    assert 5 in cp.asnumpy(hg.dense_rows).tolist()
    y = to_f64(hybrid_ops.down(hg, to_gpu(w_down)))
    assert_close(y, reference.down(to_host(hg), w_down))


@pytest.mark.parametrize("path", ["epilogue", "pack", "sliced"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize(("kind", "m", "k", "n", "slots"), PACK_CASES)
def test_other_paths(kind: str, m: int, k: int, n: int, slots: int, gated: bool, path: str):
    p = with_special_rows(problem(kind, m, k, n, seed=m + 2 * k))
    w_gate = p.w_gate if gated else None
    x, wg, wu, wd = (to_gpu(a) for a in (p.x, w_gate, p.w_up, p.w_down))
    block = PreparedBlock(wg, wu, wd, Options(slots=slots, path=path, density_switch=False))
    y = block(x)
    assert_close(to_f64(y), reference.forward.ffn_dense(p.x, w_gate, p.w_up, p.w_down))
    assert cp.array_equal(y.view(cp.uint16), block(x).view(cp.uint16)), "not deterministic"


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize(
    ("kind", "m", "k", "n"),
    [("heavy", 300, 4096, 512), ("uniform", 37, 8, 512), ("uniform", 513, 1000, 1024)],
)
def test_sliced_route_at_widths_its_slices_cut(kind: str, m: int, k: int, n: int, gated: bool):
    """The sliced route where K is 16 whole slices, less than one, and not a multiple of
    256 (the last slice partly past K)."""
    p = with_special_rows(problem(kind, m, k, n, seed=m + k))
    w_gate = p.w_gate if gated else None
    x, wg, wu, wd = (to_gpu(a) for a in (p.x, w_gate, p.w_up, p.w_down))
    block = PreparedBlock(wg, wu, wd, Options(path="sliced", density_switch=False))
    y = block(x)
    assert_close(to_f64(y), reference.forward.ffn_dense(p.x, w_gate, p.w_up, p.w_down))
    assert cp.array_equal(y.view(cp.uint16), block(x).view(cp.uint16)), "not deterministic"


def test_fused_route_takes_the_slices_where_they_pay(monkeypatch: pytest.MonkeyPatch):
    """Where light_rows_sliced.pays says so, the fused route is the sliced one (bits)."""
    from twell.kernels import light_rows_sliced

    p = with_special_rows(problem("heavy", 300, 512, 1024, seed=3))
    x, wg, wu, wd = (to_gpu(a) for a in (p.x, p.w_gate, p.w_up, p.w_down))
    sliced = PreparedBlock(wg, wu, wd, Options(path="sliced", density_switch=False))(x)
    fused = PreparedBlock(wg, wu, wd, Options(density_switch=False))
    calls = []
    real = light_rows_sliced.from_twell
    monkeypatch.setattr(
        light_rows_sliced, "from_twell", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    fused(x)
    assert not calls  # 1 MiB of weights: the per-token route
    monkeypatch.setattr(light_rows_sliced, "MIN_ROWS", 300)
    monkeypatch.setattr(light_rows_sliced, "WEIGHT_BYTES", 2 * 1024 * 512 * 2)
    after = fused(x)
    assert calls == [1]
    assert cp.array_equal(after.view(cp.uint16), sliced.view(cp.uint16))


def test_fused_route_stays_on_the_scan_and_training_takes_the_epilogue(
    monkeypatch: pytest.MonkeyPatch,
):
    """A gated block's fused route is cuBLAS + the scan at every M (no packing gate GEMM,
    4133 tokens too); its training forward takes the epilogue route, whose output bits
    equal the "epilogue" path's."""
    p = with_special_rows(problem("heavy", 4133, 512, 1024, seed=5))
    x, wg, wu, wd = (to_gpu(a) for a in (p.x, p.w_gate, p.w_up, p.w_down))
    epilogue = PreparedBlock(wg, wu, wd, Options(path="epilogue", density_switch=False))(x)
    fused = PreparedBlock(wg, wu, wd, Options(density_switch=False))
    calls = []
    real = gate_gemm.gate_pack
    monkeypatch.setattr(gate_gemm, "gate_pack", lambda *a: calls.append(1) or real(*a))
    y = fused(x)
    assert not calls and fused.route(4133) == "fused"
    assert_close(to_f64(y), reference.forward.ffn_dense(p.x, p.w_gate, p.w_up, p.w_down))
    trained, _ = fused.forward(x, save=True)
    assert calls == [1] and fused.route(4133, save=True) == "epilogue"
    assert cp.array_equal(trained.view(cp.uint16), epilogue.view(cp.uint16))


def test_sliced_route_with_more_tiles_than_a_warp_has_lanes():
    """64 tiles of 32 units: the lists kernel's second batch of tiles, rows that pass
    max_row_nnz only there (they go to the dense path), and the rest right."""
    p = with_special_rows(problem("uniform", 300, 264, 2048, seed=5))
    x, wg, wu, wd = (to_gpu(a) for a in (p.x, p.w_gate, p.w_up, p.w_down))
    options = Options(tile=32, slots=8, max_row_nnz=45, path="sliced", density_switch=False)
    block = PreparedBlock(wg, wu, wd, options)
    y = block(x)
    assert_close(to_f64(y), reference.forward.ffn_dense(p.x, p.w_gate, p.w_up, p.w_down))
    assert cp.array_equal(y.view(cp.uint16), block(x).view(cp.uint16)), "not deterministic"


def test_prepared_block_equals_functional_ffn():
    p = problem("heavy", 513, 512, 1024, seed=5)
    args = [to_gpu(a) for a in (p.x, p.w_gate, p.w_up, p.w_down)]
    block = PreparedBlock(args[1], args[2], args[3], Options(density_switch=False))
    a = block(args[0])
    b = hybrid_ops.ffn(*args, Options())
    assert cp.array_equal(a.view(cp.uint16), b.view(cp.uint16))


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_other_input_dtypes_round_trip(dtype: type):
    p = problem("uniform", 100, 256, 512, seed=9)
    x = cp.asarray(p.x.astype(dtype))
    y = hybrid_ops.ffn(x, to_gpu(p.w_gate), to_gpu(p.w_up), to_gpu(p.w_down), Options())
    assert y.dtype == np.dtype(dtype)
    assert_close(to_f64(y), reference.forward.ffn_dense(p.x, p.w_gate, p.w_up, p.w_down))


@pytest.mark.parametrize("path", ["fused", "epilogue", "sliced"])
def test_large_m_not_multiple_of_anything(path: str):
    m, k, n = 131072 + 37, 256, 512
    rng = np.random.default_rng(2)
    # Built on the GPU (the CPU workload generator is slow at this size).
    x = cp.asarray(rng.standard_normal((m, k), dtype=np.float32))
    x[:, 0] = 1
    wg = cp.asarray(rng.standard_normal((n, k), dtype=np.float32) / np.sqrt(k))
    wg[:, 0] = -2.3
    wu = cp.asarray(rng.standard_normal((n, k), dtype=np.float32) / np.sqrt(k))
    wd = cp.asarray(rng.standard_normal((k, n), dtype=np.float32) / np.sqrt(n))
    x[1000] *= 6  # a heavy row
    xb, wgb, wub, wdb = (as_bf16(a) for a in (x, wg, wu, wd))
    y = to_f64(PreparedBlock(wgb, wub, wdb, Options(path=path, density_switch=False))(xb))
    rows = np.r_[0:64, 1000, m - 64 : m]
    ref = reference.forward.ffn_dense(to_f64(xb)[rows], to_f64(wgb), to_f64(wub), to_f64(wdb))
    assert_close(y[rows], ref)


def test_public_ops_with_cupy_and_torch():
    import twell

    p = with_special_rows(problem("heavy", 300, 512, 1024, seed=11))
    args = [to_gpu(a) for a in (p.x, p.w_gate, p.w_up, p.w_down)]
    oracle = reference.forward.ffn_dense(p.x, p.w_gate, p.w_up, p.w_down)
    assert_close(to_f64(twell.ffn(*args)), oracle)
    for path in PATHS:
        block = twell.SparseFFN(*args[1:], path=path, density_switch=False)
        assert_close(to_f64(block(args[0])), oracle)
    torch = pytest.importorskip("torch")
    tensors = [torch.from_dlpack(a) for a in args]
    y = twell.ffn(*tensors)
    assert isinstance(y, torch.Tensor) and y.dtype == torch.bfloat16
    assert_close(y.float().cpu().numpy().astype(np.float64), oracle)


def test_twell_object_is_a_cupy_twell():
    p = problem("uniform", 50, 256, 512)
    h = hybrid_ops.gate(to_gpu(p.x), to_gpu(p.w_gate), Options())
    assert isinstance(h.ell, TwELL) and isinstance(h.ell.packed, cp.ndarray)


@pytest.mark.parametrize(
    ("red", "outc", "nrows"),
    [(264, 200, 77), (5632, 136, 3), (1024, 512, 150)],
    ids=["tiled", "tiled-split", "tiled-split2"],
)
@pytest.mark.parametrize(
    ("split", "stages"), [(0, 0), (1, 5), (2, 5), (4, 3), (8, 5)], ids=lambda v: str(v)
)
def test_heavy_rows_matmul(red: int, outc: int, nrows: int, split: int, stages: int):
    """Heavy-row kernels against float64: gathered rows, a gate, ragged sizes, and few
    rows with a long reduction (split across blocks, then reduced in order), for every
    split of the reduction and ring depth the launcher may choose (0: its default)."""
    conf = {"split": split, "stages": stages}
    rng = np.random.default_rng(4)
    m = 300
    a = rng.standard_normal((m, red)).astype(BF16)
    b = rng.standard_normal((outc, red)).astype(BF16)
    gate = rng.standard_normal((m, outc)).astype(BF16)
    rows = np.sort(rng.choice(m, nrows, replace=False)).astype(np.int32)
    out = to_gpu(np.zeros((m, outc), BF16))
    ids, count = cp.asarray(rows), cp.asarray(np.array([rows.size], np.int32))
    heavy_rows.matmul(
        to_gpu(a), to_gpu(b), out, ids, count, m, a_by_id=True, out_by_id=True,
        relu_a=True, gate=to_gpu(gate), gate_by_id=True, relu_gate=True, **conf,
    )  # fmt: skip
    a64 = np.maximum(a.astype(np.float64), 0)
    ref = np.zeros((m, outc))
    ref[rows] = np.maximum(gate.astype(np.float64)[rows], 0) * (a64[rows] @ b.astype(np.float64).T)
    got = to_f64(out)
    assert_close(got[rows], ref[rows])
    untouched = np.setdiff1d(np.arange(m), rows)
    assert np.all(got[untouched] == 0)
    # The same rows given as flags (compacted inside the kernel): the same bits.
    flags = np.zeros(m, np.uint8)
    flags[rows] = 1
    again = to_gpu(np.zeros((m, outc), BF16))
    heavy_rows.matmul(
        to_gpu(a), to_gpu(b), again, None, None, m, a_by_id=True, out_by_id=True,
        relu_a=True, gate=to_gpu(gate), gate_by_id=True, relu_gate=True,
        flags=cp.asarray(flags), **conf,
    )  # fmt: skip
    assert cp.array_equal(out.view(cp.uint16), again.view(cp.uint16))


@pytest.mark.parametrize("m", [1, 64, 1000, 1024])
def test_heavy_rows_from_flags_match_the_compacted_list(m: int):
    """Flags compacted inside the kernel (every count from none to all rows, M up to the
    kernel's bound) give the bits of the compact_rows list, down to untouched rows."""
    rng = np.random.default_rng(m)
    red, outc = 520, 136
    a = rng.standard_normal((m, red)).astype(BF16)
    b = rng.standard_normal((outc, red)).astype(BF16)
    for share in (0.0, 0.1, 1.0):
        flags = (rng.random(m) < share).astype(np.uint8)
        ids, count = heavy_rows.compact_rows(cp.asarray(flags))
        outs = []
        for mode in ("ids", "flags"):
            out = to_gpu(np.full((m, outc), np.nan, BF16))  # poison: untouched rows stay NaN
            rows = (ids, count, None) if mode == "ids" else (None, None, cp.asarray(flags))
            heavy_rows.matmul(to_gpu(a), to_gpu(b), out, rows[0], rows[1], m, a_by_id=True,
                              out_by_id=True, flags=rows[2])  # fmt: skip
            outs.append(out)
        assert cp.array_equal(outs[0].view(cp.uint16), outs[1].view(cp.uint16))
        got = to_f64(outs[1])
        picked = np.nonzero(flags)[0]
        assert np.all(np.isnan(np.delete(got, picked, axis=0)))
        if picked.size:
            ref = a.astype(np.float64)[picked] @ b.astype(np.float64).T
            assert_close(got[picked], ref)
    with pytest.raises(ValueError, match="flags"):
        heavy_rows.matmul(
            to_gpu(a),
            to_gpu(b),
            out,
            None,
            None,
            m,
            a_by_id=True,
            out_by_id=True,
            flags=cp.zeros(heavy_rows.FLAG_ROWS + 1, cp.uint8),
        )


@pytest.mark.parametrize("path", ["fused", "epilogue", "sliced"])
def test_ffn_can_be_captured_in_a_cuda_graph(path: str):
    """No host synchronisation on the ffn path: capture, replay, same bits as eager.

    The gate GEMM goes through torch when torch is imported (CuPy refuses cuBLAS during
    capture), so this needs torch."""
    pytest.importorskip("torch")
    p = with_special_rows(problem("heavy", 200, 512, 1024, seed=21))
    x, wg, wu, wd = (to_gpu(a) for a in (p.x, p.w_gate, p.w_up, p.w_down))
    block = PreparedBlock(wg, wu, wd, Options(path=path, density_switch=False))
    eager = block(x)
    others = []
    first, y = captured_replays(lambda: block(x), between=lambda: others.append(block(x)))
    assert cp.array_equal(y.view(cp.uint16), first.view(cp.uint16)), "replays differ"
    assert_close(to_f64(y), to_f64(eager))
    # an eager call's output, made between the replays from the same memory pool, is left
    # alone by the second replay (the graph keeps its own scratch)
    assert cp.array_equal(others[0].view(cp.uint16), eager.view(cp.uint16))
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        try:
            with pytest.raises(RuntimeError, match="capture SparseFFN"):
                hybrid_ops.ffn(x, wg, wu, wd, Options())
        finally:
            stream.end_capture()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("max_row_nnz", [0, 5, 1024])
def test_row_routing_threshold_does_not_change_results(max_row_nnz: int, path: str):
    p = with_special_rows(problem("heavy", 400, 512, 1024, seed=17))
    args = [to_gpu(a) for a in (p.x, p.w_gate, p.w_up, p.w_down)]
    options = Options(max_row_nnz=max_row_nnz, path=path, density_switch=False)
    block = PreparedBlock(*args[1:], options)
    y = to_f64(block(args[0]))
    assert_close(y, reference.forward.ffn_dense(p.x, p.w_gate, p.w_up, p.w_down))


def test_gemm_through_cupy_and_torch_agree(monkeypatch: pytest.MonkeyPatch):
    import sys

    p = problem("uniform", 300, 512, 1024, seed=23)
    x, w = to_gpu(p.x), to_gpu(p.w_gate)
    pytest.importorskip("torch")
    via_torch = to_f64(gemm_nt(x, w, via="torch"))
    monkeypatch.delitem(sys.modules, "torch")
    via_cupy = to_f64(gemm_nt(x, w))
    ref = p.x.astype(np.float64) @ p.w_gate.astype(np.float64).T
    assert_close(via_torch, ref, 1e-2)
    assert_close(via_cupy, ref, 1e-2)


# ------------------------------------------------------------------ Hypothesis-drawn problems
_GPU_SETTINGS = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


# ------------------------------------------------------------------ gate_gemm.cu
def _gate_gemm_problem(m: int, n: int, k: int, seed: int, dense_every: int = 50) -> tuple:
    """Pre-activations ~ N(-2.6, 1) (about 0.5% positive); every ``dense_every``-th row
    about half positive (it overflows); rows 1 and 2 carry NaN and +Inf when M allows."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    x[:, 0], w[:, 0] = 1.0, -2.6
    x[::dense_every, 0] = 0.0
    if m > 2:
        x[1, k // 2] = np.nan
        x[2, k - 1] = np.inf
    return as_bf16(cp.asarray(x)), as_bf16(cp.asarray(w))


def _check_gate_gemm(m: int, n: int, k: int, tile: int, slots: int, seed: int) -> None:
    """The epilogue's TwELL words and heavy flags equal, bit for bit, pack.cu applied to
    the same kernel's dense output (OUTPUT_DENSE); that output is cuBLAS's GEMM up to
    rounding."""
    x, w = _gate_gemm_problem(m, n, k, seed)
    pre = buffers.empty_bf16((m, n))  # poisoned
    gate_gemm.launch(x, w, tile=tile, slots=slots, output=gate_gemm.OUTPUT_DENSE, pre=pre)
    ref = to_f64(gemm_nt(x, w))
    assert_close(to_f64(pre), ref, 1e-2)
    want_packed, want_heavy = pack(pre, tile, slots)
    packed, heavy = gate_gemm.gate_pack(x, w, tile, slots)
    assert cp.array_equal(heavy, want_heavy)
    assert cp.array_equal(packed, want_packed)
    if m > 2:
        assert bool(heavy[1]) and bool(heavy[2])  # NaN and Inf rows go dense
    # The profiling build packs the same words and records its cycles.
    cycles = cp.zeros((gate_gemm.ctas(m, n), 8), dtype=cp.uint64)
    packed.fill(0xDEADBEEF)
    heavy.fill(0)
    gate_gemm.launch(x, w, tile=tile, slots=slots, output=gate_gemm.OUTPUT_PROFILE,
                     packed=packed, heavy=heavy, pre=cycles.view(cp.uint16))  # fmt: skip
    assert cp.array_equal(heavy, want_heavy) and cp.array_equal(packed, want_packed)
    assert int(cycles[:, 6].sum()) == gate_gemm.tiles(m, n) and bool((cycles[:, 0] > 0).all())
    assert bool((cycles[:, 7] >= cycles[:, 5]).all())  # the packers' end, after their last tile


@pytest.mark.parametrize(
    ("m", "n", "k", "tile", "slots"),
    [
        (1, 256, 8, 256, 32),  # one row, K smaller than a k step
        (300, 512, 128, 256, 32),
        (257, 768, 264, 256, 64),  # K not a multiple of 64
        (1000, 5632, 2048, 256, 32),
        (64, 384, 72, 128, 64),  # N not a multiple of the CTA's 256 columns
        (130, 512, 40, 32, 32),
        (200, 512, 96, 64, 2),  # every nonzero overflows its tile
        (513, 1024, 256, 256, 128),
    ],
)
def test_gate_gemm_epilogue_equals_pack_of_its_gemm(m, n, k, tile, slots):
    _check_gate_gemm(m, n, k, tile, slots, seed=m + n + k)


@_GPU_SETTINGS
@given(
    st.integers(1, 300),
    st.integers(1, 6),
    st.integers(1, 40),
    st.sampled_from([(256, 32), (256, 2), (128, 128), (64, 16), (32, 32)]),
    st.integers(0, 2**31 - 1),
)
def test_hypothesis_gate_gemm(m: int, n_blocks: int, k8: int, geometry: tuple, seed: int):
    tile, slots = geometry
    _check_gate_gemm(m, n_blocks * tile, 8 * k8, tile, slots, seed)


def test_gate_gemm_at_large_m():
    _check_gate_gemm(131072 + 37, 512, 256, 256, 32, seed=3)


@pytest.mark.parametrize("path", ["fused", "epilogue"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("capacity", [0.01, 0.03, 1.0])
def test_heavy_rows_through_fixed_size_gemms(capacity: float, gated: bool, path: str):
    """dense_capacity: the first ceil(f*M) heavy rows through cuBLAS GEMMs, the rest (if
    any) through heavy_rows.cu; with NaN/Inf rows; deterministic."""
    p = with_special_rows(problem("heavy", 600, 512, 1024, seed=31))
    w_gate = p.w_gate if gated else None
    x, wg, wu, wd = (to_gpu(a) for a in (p.x, w_gate, p.w_up, p.w_down))
    options = Options(path=path, dense_capacity=capacity, density_switch=False)
    block = PreparedBlock(wg, wu, wd, options)
    y = block(x)
    assert_close(to_f64(y), reference.forward.ffn_dense(p.x, w_gate, p.w_up, p.w_down))
    assert cp.array_equal(y.view(cp.uint16), block(x).view(cp.uint16)), "not deterministic"


def _hybrid_to_gpu(h: Hybrid) -> Hybrid:
    ell = TwELL(cp.asarray(h.ell.packed), h.shape, h.tile, h.slots)
    return Hybrid(ell, cp.asarray(h.dense_rows), cp.asarray(h.dense))


@_GPU_SETTINGS
@given(
    tst.hybrid_matrices(rows=st.integers(1, 40)),
    st.sampled_from([8, 264]),
    st.integers(0, 2**31 - 1),
)
def test_hypothesis_down(h: Hybrid, k: int, seed: int):
    rng = np.random.default_rng(seed)
    w_down = (rng.standard_normal((k, h.shape[1])) / np.sqrt(h.shape[1])).astype(BF16)
    y = to_f64(hybrid_ops.down(_hybrid_to_gpu(h), to_gpu(w_down)))
    # The GPU flushes subnormals to zero (CuPy compiles with -ftz): flush them in the
    # reference's input too, so the comparison does not depend on denormals.
    dense = np.asarray(h.to_dense(np.float64))
    dense[np.abs(dense) < np.finfo(np.float32).tiny] = 0.0
    assert_close(y, dense @ w_down.astype(np.float64).T)


@_GPU_SETTINGS
@given(tst.ffn_problems(k=st.sampled_from([8, 16, 264]), tiles=st.integers(1, 2), tile=256,
                        rows=st.integers(1, 70)))  # fmt: skip
def test_hypothesis_ffn(p: tst.FFNProblem):
    args = [None if a is None else as_bf16(cp.asarray(a)) for a in p]
    y = to_f64(hybrid_ops.ffn(*args, Options()))
    assert_close(y, reference.forward.ffn_dense(*p))


@pytest.mark.parametrize("k", [12, 4104])
def test_public_ops_reject_widths_the_kernels_cannot_take(k: int) -> None:
    import twell

    x = cp.ones((4, k), dtype=cp.float32)
    w = cp.ones((256, k), dtype=cp.float32)
    with pytest.raises(ValueError, match=f"x: the GPU kernels need K .* got K={k}"):
        twell.ffn(x, w, w, w.T.copy())
    with pytest.raises(ValueError, match="w_gate: the GPU kernels need K"):
        twell.SparseFFN(w, w, w.T.copy())


def kernels_asked(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the kernels looked up (``Source.kernel``) from now to the test's end."""
    from twell.kernels.compile import Source

    asked: list[str] = []
    kernel = Source.kernel

    def spy(self: Source, function: str, **params: int) -> object:
        asked.append(function)
        return kernel(self, function, **params)

    monkeypatch.setattr(Source, "kernel", spy)
    return asked


@pytest.mark.parametrize("shape", [(2048, 5632), (5632, 2048), (64, 64), (72, 200), (8, 8),
                                   (1, 1), (33, 70), (130, 66), (4096, 14336)])  # fmt: skip
@pytest.mark.parametrize("offset", [0, 4])
def test_transpose_gives_every_element(
    shape: tuple, offset: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """convert.transpose (the 16-byte kernel where rows and columns are multiples of 8 and
    the array is 16-byte aligned, the 2-byte one otherwise: ``offset`` elements in)
    against NumPy's transpose, bit for bit, into a poisoned output (the module's
    buffers); the kernel that ran is the one the shape and alignment call for."""
    from twell.kernels.convert import transpose

    asked = kernels_asked(monkeypatch)
    rows, cols = shape
    bits = np.random.default_rng(rows * cols).integers(0, 1 << 16, rows * cols + offset)
    flat = cp.asarray(bits.astype(np.uint16)).view(BF16)
    matrix = flat[offset:].reshape(rows, cols)
    out = transpose(matrix)
    expected = bits[offset:].astype(np.uint16).reshape(rows, cols).T
    assert out.shape == (cols, rows) and out.flags.c_contiguous
    assert np.array_equal(cp.asnumpy(out.view(cp.uint16)), expected)
    wide = offset == 0 and rows % 8 == 0 and cols % 8 == 0
    assert asked == ["twell_transpose_u16x8" if wide else "twell_transpose_u16"]


@pytest.mark.parametrize("n", [2048 * 5632, 4096, 8, 12, 1, 4099])
@pytest.mark.parametrize("offset", [0, 1, 2])
def test_f32_to_bf16_gives_numpys_rounding(
    n: int, offset: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """as_bf16 of fp32 (the 8-wide kernel where the size is a multiple of 8 and the
    array 16-byte aligned, the scalar one otherwise: ``offset`` elements (4 or 8 bytes)
    into a pool buffer, which is 512-byte aligned) against
    ml_dtypes' round-to-nearest-even, bit for bit: random bits (NaN payloads, Inf,
    subnormals and ties included), every value, into a poisoned pool."""
    asked = kernels_asked(monkeypatch)
    rng = np.random.default_rng(n + offset)
    bits = rng.integers(0, 1 << 32, n + offset, dtype=np.uint64).astype(np.uint32)
    special = np.array([0x7F800000, 0xFF800000, 0x7FC00001, 0x00000001, 0x3F808000,
                        0x3F818000, 0x7F7FFFFF, 0x80000000], dtype=np.uint32)  # fmt: skip
    bits[offset : offset + min(n, special.size)] = special[: min(n, special.size)]
    values = bits.view(np.float32)
    with poisoned_buffers():
        got = as_bf16(cp.asarray(values)[offset:])
    expected = values[offset:].astype(BF16).view(np.uint16)
    nan = np.isnan(values[offset:])
    got16 = cp.asnumpy(got.view(cp.uint16))
    assert np.array_equal(got16[~nan], expected[~nan])
    assert np.all(np.isnan(got16[nan].view(BF16).astype(np.float32)))  # NaN stays NaN
    wide = offset == 0 and n % 8 == 0
    assert asked == ["twell_f32_to_bf16_x8" if wide else "twell_f32_to_bf16"]
