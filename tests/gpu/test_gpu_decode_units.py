"""The by-unit decode kernels (decode_units_*.cu) against float64 dense math (skipped
without a GPU).

Every buffer comes from ``twell.kernels.buffers.alloc``, poisoned with 0xFF bytes (NaN in
bf16 and in float32), so a mask word, an ``h`` entry or a row of ``y`` the kernels forgot
to write (or read without writing) fails the comparison.
"""

from __future__ import annotations

import cupy as cp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from twell import reference, workloads
from twell.benchmark import make_problem
from twell.benchmark import to_device as to_gpu
from twell.kernels import buffers, decode_units
from twell.kernels.convert import transpose
from twell.kernels.pipeline import PreparedBlock
from twell.options import Options
from twell.testing.asserts import as_host, relative_error
from twell.testing.gpu import captured_replays

BF16 = np.dtype(ml_dtypes.bfloat16)
TOL = 1e-2


def run_units(x: np.ndarray, w_gate: np.ndarray | None, w_up: np.ndarray,
              w_down: np.ndarray, **geometry: int) -> np.ndarray:  # fmt: skip
    """decode_units.forward on bf16 inputs (``geometry``: its ``ut``, ``down_tokens``,
    ``columns``, ``gate``, ``down``, ``scan_threads``, ``stages``); float64 result."""
    xg, wu, wd = (to_gpu(a.astype(BF16)) for a in (x, w_up, w_down))
    wg = None if w_gate is None else to_gpu(w_gate.astype(BF16))
    y = buffers.alloc((x.shape[0], x.shape[1]), np.uint16).view(wu.dtype)
    decode_units.forward(xg, wu if wg is None else wg, None if wg is None else wu,
                         transpose(wd), y, **geometry)  # fmt: skip
    first = y.view(cp.uint16).copy()
    decode_units.forward(xg, wu if wg is None else wg, None if wg is None else wu,
                         transpose(wd), y, **geometry)  # fmt: skip
    assert cp.array_equal(first, y.view(cp.uint16)), "not deterministic"
    return as_host(y).astype(np.float64)


def check_against_dense(got: np.ndarray, x: np.ndarray, w_gate: np.ndarray | None,
                        w_up: np.ndarray, w_down: np.ndarray) -> None:  # fmt: skip
    bf = [None if a is None else a.astype(BF16) for a in (x, w_gate, w_up, w_down)]
    ref = reference.forward.ffn_dense(*bf)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(ref))
    rows = np.isfinite(ref).all(axis=1)
    assert relative_error(got[rows], ref[rows]) <= TOL
    # and row by row (a wrong 8-column piece of one row would hide in the whole's norm)
    scale = np.linalg.norm(ref[rows]) / np.sqrt(max(1, rows.sum()))
    for g, r in zip(got[rows], ref[rows], strict=True):
        assert np.linalg.norm(g - r) <= TOL * max(np.linalg.norm(r), scale)


@pytest.mark.parametrize("k", [8, 264, 2048])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("m", [1, 2, 7, 8, 9, 16, 33, 64])
def test_units_match_dense_float64(m: int, gated: bool, k: int) -> None:
    """Workloads with heavy rows (many active units: no capacity here) and, from m = 2,
    a NaN and an Inf in x (rows dense math fills with NaN/Inf)."""
    n = 1024
    p = workloads.heavy(m, k, n, p=0.02, frac=0.25, seed=m + k)
    x = p.x.astype(np.float32)
    if m >= 2:
        x[m - 1, k // 2] = np.nan
        x[0, 1] = np.inf
    w_gate = p.w_gate if gated else None
    got = run_units(x, w_gate, p.w_up, p.w_down)
    check_against_dense(got, x, w_gate, p.w_up, p.w_down)


@pytest.mark.parametrize("gate", ["mma", "cublas", "wgmma"])
@pytest.mark.parametrize("ut", [1, 2, 4])
@pytest.mark.parametrize("m", [1, 13, 24, 64])
def test_every_geometry_matches_dense_and_token_groups_keep_the_bits(
    m: int, ut: int, gate: str
) -> None:
    """Each gate CTA width (16, 32, 64 units) at each token count (8 to 64 tokens per gate
    CTA), with each gate, and the down kernel's tokens and columns per CTA: every
    (token, 8 columns) is summed in the same order whatever the CTA's share, so the bits
    do not depend on it."""
    n, k = 1024, 264
    p = workloads.heavy(m, k, n, p=0.02, frac=0.25, seed=m + ut)
    x = p.x.astype(np.float32)
    x[m - 1, 3] = np.nan
    got = run_units(x, p.w_gate, p.w_up, p.w_down, ut=ut, gate=gate, down="lists")
    check_against_dense(got, x, p.w_gate, p.w_up, p.w_down)
    for tokens, columns in ((16, 16), (64, 16), (8, 32), (8, 64), (8, 128), (24, 24)):
        other = run_units(x, p.w_gate, p.w_up, p.w_down, ut=ut, gate=gate,
                          down_tokens=tokens, columns=columns, down="lists")  # fmt: skip
        np.testing.assert_array_equal(other.view(np.uint64), got.view(np.uint64))


DOWNS = {f"scan{t}": {"down": "scan", "scan_threads": t} for t in (64, 128)}
DOWNS["lists"] = {"down": "lists"}


@pytest.mark.parametrize("down", DOWNS)
@pytest.mark.parametrize("k", [8, 264])
@pytest.mark.parametrize("m", [1, 5, 8, 9, 16, 64])
def test_down_by_scan_and_by_lists_match_dense(m: int, k: int, down: str) -> None:
    """Either down kernel (the scan kernel at each CTA size) at any token count (the
    launcher takes the scan up to SCAN_TOKENS), with heavy rows, a NaN and an Inf in x;
    each deterministic."""
    n = 1024
    p = workloads.heavy(m, k, n, p=0.02, frac=0.25, seed=7 * m + k)
    x = p.x.astype(np.float32)
    x[m - 1, k // 2] = np.nan
    x[0, 1] = np.inf
    got = run_units(x, p.w_gate, p.w_up, p.w_down, **DOWNS[down])
    check_against_dense(got, x, p.w_gate, p.w_up, p.w_down)


@pytest.mark.parametrize(("m", "n"), [(3, 2048), (3, 5632), (40, 5632), (8, 8256)])
def test_scan_bits_do_not_depend_on_its_threads(m: int, n: int) -> None:
    """The scan kernel lists a token's units in ascending order and sums them in 32 virtual
    slots and a fixed tree whatever its CTA size: 64 and 128 threads give the same bits,
    also where a thread reads several mask words (N = 5632: 176 words; with heavy rows and
    a NaN row)."""
    k = 264
    p = workloads.heavy(m, k, n, p=0.02, frac=0.25, seed=11 * m + n)
    x = p.x.astype(np.float32)
    x[m // 2, 7] = np.nan
    got = [run_units(x, p.w_gate, p.w_up, p.w_down, **DOWNS[f"scan{t}"]) for t in (64, 128)]
    check_against_dense(got[0], x, p.w_gate, p.w_up, p.w_down)
    np.testing.assert_array_equal(got[1].view(np.uint64), got[0].view(np.uint64))


@pytest.mark.parametrize(
    ("m", "n", "k", "down"),
    [(5, 2 * decode_units.LIST + 64, 264, "lists"), (12, 2 * decode_units.LIST + 64, 264, None),
     *((4, 8256, 136, down) for down in DOWNS)],
)  # fmt: skip
def test_a_token_over_many_list_passes(m: int, n: int, k: int, down: str | None) -> None:
    """A token keeping every unit next to tokens keeping about half and one keeping none:
    at N = 1088 three passes of the list kernel's lists (LIST = 512) and of the scan's;
    at N = 8256 (258 mask words: a scan CTA's threads read runs of three words each with
    128 threads, five with 64) 17 passes of either."""
    rng = np.random.default_rng(5)
    w_gate = rng.standard_normal((n, k)) / np.sqrt(k)
    w_gate[:, 0] = 1.0
    w_up = rng.standard_normal((n, k)) / np.sqrt(k)
    w_down = rng.standard_normal((k, n)) / np.sqrt(n)
    x = rng.standard_normal((m, k))
    x[:, 0] = 0.0
    x[1, 0] = 50.0  # token 1: every gate positive
    x[m - 1, 0] = -50.0  # the last token: none
    got = run_units(x, w_gate, w_up, w_down, **DOWNS.get(down, {}))
    check_against_dense(got, x, w_gate, w_up, w_down)


def test_geometry_the_kernels_cannot_take_is_refused() -> None:
    x = cp.zeros((200, 64), cp.uint16)
    w = cp.zeros((1024, 64), cp.uint16)
    y = cp.zeros((200, 64), cp.uint16)
    with pytest.raises(ValueError, match="shared memory"):
        decode_units.forward(x, w, w, w, y, gate="cublas", ut=4)  # 64 units x 256 tokens
    with pytest.raises(ValueError, match="down_tokens"):
        decode_units.forward(x, w, w, w, y, down_tokens=128)
    with pytest.raises(ValueError, match="down_tokens"):
        decode_units.forward(x, w, w, w, y, columns=4096)
    with pytest.raises(ValueError, match="scan_threads"):
        decode_units.forward(x[:8], w, w, w, y[:8], down="scan", scan_threads=32)
    with pytest.raises(ValueError, match="down must be"):
        decode_units.forward(x[:8], w, w, w, y[:8], down="rows")
    with pytest.raises(ValueError, match="scan_threads"):
        decode_units.forward(x[:8], w, w, w, y[:8], down="lists", scan_threads=64)


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize(("m", "ut"), [(1, 1), (9, 1), (33, 1), (64, 1), (65, 1), (200, 1),
                                       (256, 1), (200, 2), (128, 4)])  # fmt: skip
def test_gate_from_cublas_matches_dense(m: int, ut: int, gated: bool) -> None:
    """The gate kernel reading a cuBLAS pre-activation instead of computing its own (the
    larger token counts), with heavy rows and a NaN row."""
    n, k = 2048, 264
    p = workloads.heavy(m, k, n, p=0.02, frac=0.25, seed=3 * m)
    x = p.x.astype(np.float32)
    x[m // 2, 5] = np.nan
    w_gate = p.w_gate if gated else None
    got = run_units(x, w_gate, p.w_up, p.w_down, gate="cublas", ut=ut)
    check_against_dense(got, x, w_gate, p.w_up, p.w_down)


@pytest.mark.parametrize("k", [8, 264, 2048, 4096])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("m", [1, 9, 25, 33, 47, 64])
def test_wgmma_gate_matches_dense_and_its_ring_and_pre_keep_the_bits(
    m: int, gated: bool, k: int
) -> None:
    """The gate on wgmma through a TMA ring (K past the last 64-wide box filled with zeros
    by TMA, the wgmma rows past M never read), with heavy rows, a NaN and an Inf in x:
    against float64 dense math, and bit for bit the same with any ring depth and with its
    gate written to a pre-activation that the gate/up kernel reads (the same sums in the
    same order)."""
    n = 2048
    p = workloads.heavy(m, k, n, p=0.02, frac=0.25, seed=11 * m + k)
    x = p.x.astype(np.float32)
    x[m // 2, 0] = np.nan
    if m > 2:
        x[1, k - 1] = -np.inf
    w_gate = p.w_gate if gated else None
    for ut in (decode_units.WGMMA_UNIT_TILES, 1):
        got = run_units(x, w_gate, p.w_up, p.w_down, gate="wgmma", ut=ut)
        check_against_dense(got, x, w_gate, p.w_up, p.w_down)
        for geometry in ({"stages": 2}, {"stages": 5}, {"gate": "wgmma_pre"}):
            kw = {"gate": "wgmma", "ut": ut, **geometry}
            other = run_units(x, w_gate, p.w_up, p.w_down, **kw)
            np.testing.assert_array_equal(other.view(np.uint64), got.view(np.uint64))


def test_wgmma_gate_ignores_what_the_ring_held_past_m() -> None:
    """The wgmma tile's rows past M are whatever the ring held (x's box has M rows): a
    call of 64 NaN tokens leaves NaN there, and later calls of fewer tokens on the same
    weights still match dense math in every row."""
    n, k = 2048, 2048
    p = workloads.uniform(64, k, n, p=0.01, seed=5)
    nan = np.full((64, k), np.nan, np.float32)
    poisoned = run_units(nan, p.w_gate, p.w_up, p.w_down, gate="wgmma")
    assert np.isnan(poisoned).all()
    for m in (25, 33, 63):
        got = run_units(p.x[:m], p.w_gate, p.w_up, p.w_down, gate="wgmma")
        check_against_dense(got, p.x[:m], p.w_gate, p.w_up, p.w_down)


@pytest.mark.parametrize(("m", "n", "k"), [(16, 65536, 136), (64, 8192, 136), (4, 2048, 4096)])
def test_largest_shapes_the_route_takes(m: int, n: int, k: int) -> None:
    """The most shared memory the down kernel asks for (masks at their bound) and the
    widest model."""
    assert decode_units.fits(m, n, most=decode_units.MAX_TOKENS)
    p = workloads.uniform(m, k, n, p=0.01, seed=m)
    got = run_units(p.x, p.w_gate, p.w_up, p.w_down)
    check_against_dense(got, p.x, p.w_gate, p.w_up, p.w_down)


def test_overflowing_gate_gives_dense_maths_infinities() -> None:
    """A finite x whose gate overflows float32 for two units of one token (+Inf and -Inf
    pre-activations): the +Inf unit enters the sum, so that row is all ±Inf, as in dense
    math with a float32 accumulator; the other rows are untouched by those units."""
    m, n, k = 3, 256, 64
    rng = np.random.default_rng(5)
    w_gate = rng.standard_normal((n, k)) / np.sqrt(k)
    w_gate[7], w_gate[9] = 0.0, 0.0
    w_gate[7, 0], w_gate[9, 0] = 3e38 / 4, -3e38 / 4
    w_up = rng.standard_normal((n, k)) / np.sqrt(k)
    w_down = rng.standard_normal((k, n)) / np.sqrt(n)
    x = rng.standard_normal((m, k))
    x[:, 0] = 0.0
    x[1, 0] = 8.0
    got = run_units(x, w_gate, w_up, w_down)
    assert np.isinf(got[1]).all()
    rows = [0, 2]
    check_against_dense(got[rows], x[rows], w_gate, w_up, w_down)


@pytest.mark.parametrize("m", [8, 40], ids=["mma_gate", "wgmma_gate"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
def test_capture_in_a_cuda_graph_gives_the_eager_bits(gated: bool, m: int) -> None:
    """Up to WGMMA_TOKENS tokens the route runs twell's kernels only (no cuBLAS): a CuPy
    capture replays the eager bits."""
    n, k = 2048, 1024
    assert decode_units.gate_for(m, n) == ("mma" if m == 8 else "wgmma")
    p = workloads.uniform(m, k, n, p=0.01, seed=2)
    block = PreparedBlock(*(to_gpu(a) for a in (p.w_gate if gated else None, p.w_up, p.w_down)),
                          Options(path="fused", density_switch=False))  # fmt: skip
    x = to_gpu(p.x)
    eager = block(x).view(cp.uint16).copy()
    first, second = captured_replays(lambda: block(x))
    assert cp.array_equal(first.view(cp.uint16), eager)
    assert cp.array_equal(second.view(cp.uint16), eager)


def test_capture_with_the_cublas_gate_replays_its_bits() -> None:
    """Above WGMMA_TOKENS a call captured from CuPy runs the gate GEMM through torch
    (CuPy refuses cuBLAS during capture; eager calls use CuPy's, whose bits may differ):
    every replay gives the first replay's bits, and they match dense math."""
    pytest.importorskip("torch")
    m, n, k = decode_units.WGMMA_TOKENS + 16, 2048, 1024
    assert decode_units.gate_for(m, n) == "cublas"
    p = workloads.uniform(m, k, n, p=0.01, seed=3)
    block = PreparedBlock(*(to_gpu(a) for a in (p.w_gate, p.w_up, p.w_down)),
                          Options(path="fused", density_switch=False))  # fmt: skip
    x = to_gpu(p.x)
    first, second = captured_replays(lambda: block(x))
    assert cp.array_equal(first.view(cp.uint16), second.view(cp.uint16))
    check_against_dense(as_host(first).astype(np.float64), p.x, p.w_gate, p.w_up, p.w_down)


def test_prepared_block_takes_the_route_up_to_its_bound(monkeypatch: pytest.MonkeyPatch):
    p = workloads.uniform(decode_units.MAX_ROWS + 1, 264, 1024, p=0.02, seed=4)
    calls: list[int] = []
    real = decode_units.forward

    def spy(x, *args, **hints):  # noqa: ANN001, ANN202
        calls.append(x.shape[0])
        assert hints == {"units_per_token": None}  # the switch is off: no estimate
        return real(x, *args, **hints)

    monkeypatch.setattr(decode_units, "forward", spy)
    for path in ("fused", "epilogue"):
        block = PreparedBlock(*(to_gpu(a) for a in (p.w_gate, p.w_up, p.w_down)),
                              Options(path=path, density_switch=False))  # fmt: skip
        for m in (1, decode_units.MAX_ROWS, decode_units.MAX_ROWS + 1):
            xs = p.x[:m]
            got = as_host(block(to_gpu(xs))).astype(np.float64)
            ref = reference.forward.ffn_dense(xs, p.w_gate, p.w_up, p.w_down)
            assert relative_error(got, ref) <= TOL
    assert calls == [1, decode_units.MAX_ROWS]


def test_dense_inputs_send_decode_calls_to_dense_math() -> None:
    """The density switch reads the route's masks: at half the units active it turns the
    block to dense math after a few calls (the estimate lands without a host wait)."""
    p = make_problem("density=0.5", 4, 264, 1024, seed=1)
    block = PreparedBlock(*(to_gpu(a) for a in (p.w_gate, p.w_up, p.w_down)), Options())
    ref = reference.forward.ffn_dense(p.x, p.w_gate, p.w_up, p.w_down)
    x = to_gpu(p.x)
    for _ in range(3 * block.density.EVERY):
        got = as_host(block(x)).astype(np.float64)
        assert relative_error(got, ref) <= TOL
        cp.cuda.get_current_stream().synchronize()
    kept = (p.x.astype(np.float64) @ p.w_gate.astype(np.float64).T > 0).sum(axis=1).mean()
    assert block.density.estimate == pytest.approx(kept, rel=0.02)
    assert block.density.dense


def test_a_non_finite_token_does_not_send_decode_calls_dense() -> None:
    """A token whose x holds NaN keeps every unit; the estimate leaves it out."""
    p = make_problem("uniform", 4, 264, 1024, seed=2)
    x = p.x.astype(np.float32)
    x[1, 3] = np.nan
    block = PreparedBlock(*(to_gpu(a) for a in (p.w_gate, p.w_up, p.w_down)), Options())
    xg = to_gpu(x.astype(BF16))
    for _ in range(3 * block.density.EVERY):
        block(xg)
        cp.cuda.get_current_stream().synchronize()
    assert block.density.estimate is not None
    assert block.density.estimate < block.density.threshold(4) and not block.density.dense


def test_forward_refuses_what_the_kernels_cannot_take() -> None:
    """(The bounds themselves: tests/test_kernels_compile.py, no GPU needed.)"""
    most = decode_units.MAX_TOKENS
    with pytest.raises(ValueError, match="decode_units"):
        x = cp.zeros((most + 1, 64), cp.uint16)
        w = cp.zeros((64, 64), cp.uint16)
        decode_units.forward(x, w, None, w, x)
    x = cp.zeros((65, 64), cp.uint16)
    for gate in ("mma", "wgmma", "wgmma_pre"):
        with pytest.raises(ValueError, match=f"the {gate} gate takes at most 64 tokens"):
            decode_units.forward(x, w, None, w, x, gate=gate)
    with pytest.raises(ValueError, match="gate must be one of"):
        decode_units.forward(x[:8], w, None, w, x[:8], gate="tensor")
    with pytest.raises(ValueError, match="wgmma ring"):
        decode_units.forward(x[:8], w, None, w, x[:8], gate="wgmma", stages=1)
    with pytest.raises(ValueError, match="wgmma ring"):
        decode_units.forward(x[:8], w, None, w, x[:8], gate="wgmma", stages=64)
    # TMA reads x through a map: a strided or misaligned x is refused before a launch
    wide = cp.zeros((8, 128), cp.uint16)
    with pytest.raises(ValueError, match="C-contiguous, 16-byte aligned"):
        decode_units.forward(wide[:, :64], w, None, w, x[:8], gate="wgmma")
    shifted = cp.zeros(8 * 64 + 1, cp.uint16)[1:].reshape(8, 64)
    with pytest.raises(ValueError, match="C-contiguous, 16-byte aligned"):
        decode_units.forward(shifted, w, None, w, x[:8], gate="wgmma")


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(
    m=st.integers(1, decode_units.MAX_TOKENS),
    blocks=st.integers(1, 24),
    k=st.sampled_from([8, 16, 136, 264]),
    gated=st.booleans(),
    density=st.sampled_from([0.0, 0.01, 0.2, 1.0]),
    nonfinite=st.sampled_from(["none", "nan", "inf", "-inf"]),
    down=st.sampled_from([None, *DOWNS]),
    seed=st.integers(0, 2**31 - 1),
)
def test_hypothesis_units(m: int, blocks: int, k: int, gated: bool, density: float,
                          nonfinite: str, down: str | None, seed: int) -> None:  # fmt: skip
    """Drawn shapes (N any multiple of 32), densities from none to all units, a
    non-finite x element, and either down kernel."""
    n = 32 * blocks
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k))
    w_first = rng.standard_normal((n, k)) / np.sqrt(k)
    # a bias direction sets the density: units fire where w_first[:, 0] > threshold
    w_first[:, 0] = np.where(rng.random(n) < density, 4.0, -4.0)
    x[:, 0] = np.abs(x[:, 0]) + 1.0
    w_up = rng.standard_normal((n, k)) / np.sqrt(k)
    w_down = rng.standard_normal((k, n)) / np.sqrt(max(1.0, n * max(density, 0.01)))
    if nonfinite != "none":
        x[rng.integers(m), rng.integers(k)] = float(nonfinite)
    w_gate, w_up_ = (w_first, w_up) if gated else (None, w_first)
    got = run_units(x, w_gate, w_up_, w_down, **DOWNS.get(down, {}))
    check_against_dense(got, x, w_gate, w_up_, w_down)
