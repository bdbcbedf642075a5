"""The decode kernel (light_rows_decode.cu) against light_rows.cu's by-columns and one-warp
kernels and float64 dense math (skipped without a GPU).

Every buffer comes from ``twell.kernels.buffers.alloc``, poisoned with 0xFF bytes (NaN in
bf16), so an element the kernel forgot to write fails, and heavy rows of ``y`` must still
hold the poison afterwards (the dense path writes them, not this kernel).
"""

from __future__ import annotations

import functools

import cupy as cp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from twell import reference, workloads
from twell.benchmark import to_device as to_gpu
from twell.formats import dense_row_mask
from twell.kernels import buffers, light_rows, light_rows_decode
from twell.kernels.buffers import u16
from twell.kernels.pipeline import PreparedBlock
from twell.options import LIST_CAPACITY, Options, default_max_row_nnz
from twell.testing import strategies as tst

BF16 = np.dtype(ml_dtypes.bfloat16)
POISON = 0xFFFF
NEG, POS = 0xBF80, 0x3F00  # bf16 -1.0 and 0.5
TOL = 1e-2


# ---------------------------------------------------------------------- problems
def bf16_bits(values: np.ndarray) -> np.ndarray:
    return np.asarray(values, dtype=np.float32).astype(BF16).view(np.uint16)


def values(bits: np.ndarray) -> np.ndarray:
    return bits.view(BF16).astype(np.float64)


@functools.lru_cache(maxsize=4)
def weights(n: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """bf16 bits of ``w_up [N, K]`` and ``w_down_t [N, K]``."""
    rng = np.random.default_rng(seed)
    w_up = bf16_bits(rng.standard_normal((n, k)) / np.sqrt(k))
    w_down_t = bf16_bits(rng.standard_normal((n, k)) / np.sqrt(n * 0.01))
    return w_up, w_down_t


def random_pre(rng: np.random.Generator, m: int, n: int, p: float) -> np.ndarray:
    """bf16 bits: each unit positive (0.25..2) with probability ``p``, else negative."""
    magnitude = rng.uniform(0.25, 2.0, size=(m, n))
    return bf16_bits(np.where(rng.random((m, n)) < p, magnitude, -magnitude))


def special_rows(pre: np.ndarray, tile: int, slots: int, max_row_nnz: int) -> None:
    """Boundary cases in rows 1..10 (those that exist); row 0 stays random. Heavy: 1-4, 7,
    9, 10; light: 5 (no active unit), 6, 8."""
    m, n = pre.shape
    tiles = n // tile
    spread = [j * tile + i for i in range(slots - 1) for j in range(tiles)]  # <= slots-1 a tile
    assert max_row_nnz + 1 <= len(spread)

    def active(columns: object) -> np.ndarray:  # -1.0 everywhere, +0.5 at ``columns``
        row = np.full(n, NEG, np.uint16)
        row[columns] = POS
        return row

    empty = active([])
    empty[0::3], empty[1::3] = 0x8000, 0x0000  # -0 and +0 are not active
    overflow = slice(tile, tile + slots) if tiles > 1 else slice(0, slots)
    pokes = {1: (100, 0x7FC0), 2: (200, 0x7F80), 3: (300, 0xFF80), 10: (n - 1, 0xFFC1)}
    rows = {
        4: np.full(n, POS, np.uint16),  # every unit active
        5: empty,
        6: active(slice(0, slots - 1)),  # slots - 1 in one tile
        7: active(overflow),  # slots in one tile
        8: active(spread[:max_row_nnz]),  # max_row_nnz active
        9: active(spread[: max_row_nnz + 1]),  # one more
    }
    for row, (column, bits) in pokes.items():  # NaN, +Inf, -Inf, negative NaN
        if row < m:
            pre[row, column % n] = bits
    for row, values_ in rows.items():
        if row < m:
            pre[row] = values_


def expected_heavy(pre: np.ndarray, tile: int, slots: int, max_row_nnz: int) -> np.ndarray:
    """The routing rule on values (docs/format.md): relu keeps positives and NaN."""
    f = values(pre)
    keeps = (f > 0) | np.isnan(f)
    m, n = pre.shape
    counts = keeps.reshape(m, n // tile, tile).sum(axis=2)
    limit = min(max_row_nnz, LIST_CAPACITY)
    return dense_row_mask(counts, ~np.isfinite(f).all(axis=1), slots, limit)


def dense_rows(x: np.ndarray | None, pre: np.ndarray, w_up: np.ndarray, w_down_t: np.ndarray,
               light: np.ndarray) -> np.ndarray:  # fmt: skip
    """float64 ``y`` of the light rows (heavy rows: zeros)."""
    g = values(pre)
    h = np.where(g > 0, g, 0.0)
    h[~light] = 0.0
    if x is not None:
        h *= values(x) @ values(w_up).T
    return h @ values(w_down_t)


# ---------------------------------------------------------------------- running
def run(kernel: str, x: np.ndarray | None, pre: np.ndarray, w_up: np.ndarray,
        w_down_t: np.ndarray, *, tile: int, slots: int, max_row_nnz: int, warps: int = 8,
        dense: int | None = None) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """``(heavy, y bits)`` from the decode kernel (``"decode"``), the one-warp kernel
    (``"row"``) or the by-columns kernel (``"cols"``, or its small batches' build
    ``"deep"``; ``warps`` warps per token), on
    poisoned buffers; ``dense``: the call's decision those two read (None: none passed;
    given, the heavy flags start at 0 instead of the poison)."""
    m, k = pre.shape[0], w_down_t.shape[1]
    gated = x is not None
    xg, wu = (cp.asarray(x), cp.asarray(w_up)) if gated else (None, None)
    pg, wdt = cp.asarray(pre), cp.asarray(w_down_t)
    heavy = buffers.alloc((m,), np.uint8)
    y = buffers.alloc((m, k), np.uint16)
    if kernel == "decode":
        light_rows_decode.from_pre(xg, pg, heavy, wu, wdt, y, tile=tile, slots=slots,
                                   max_row_nnz=max_row_nnz)  # fmt: skip
    else:
        function, warps = {"cols": (light_rows.COLS, warps),
                           "deep": (light_rows.COLS_DEEP, warps)}.get(
            kernel, ("twell_light_rows_from_pre", 1))  # fmt: skip
        flag = None if dense is None else cp.asarray([dense, 0], dtype=cp.int32)
        if dense is not None:  # flags start at 0: a decision's rows must be flagged by it
            heavy.fill(0)
        light_rows._launch(function, m, 32 * warps, xg, u16(pg), heavy, wu, wdt, y, tile, slots,
                           max_row_nnz, dense=flag)  # fmt: skip
    return heavy.get().astype(bool), y.get()


def rel_err(y: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(y - ref) / max(np.linalg.norm(ref), 1e-30))


def check(x: np.ndarray | None, pre: np.ndarray, w_up: np.ndarray, w_down_t: np.ndarray, *,
          tile: int, slots: int, max_row_nnz: int) -> np.ndarray:  # fmt: skip
    """The decode kernel on one problem: heavy flags by the routing rule and equal to the
    by-columns kernel's; light rows close to float64 math and to that kernel, rows without
    active units zero; heavy rows of y untouched; the same bits on a second run. Returns
    the heavy flags."""
    kw = {"tile": tile, "slots": slots, "max_row_nnz": max_row_nnz}
    heavy, y = run("decode", x, pre, w_up, w_down_t, **kw)
    np.testing.assert_array_equal(heavy, expected_heavy(pre, tile, slots, max_row_nnz))
    light = ~heavy
    assert np.all(y[heavy] == POISON), "heavy rows of y were written"
    got = values(y[light])
    assert np.isfinite(got).all(), "a light row holds NaN/Inf (unwritten?)"
    ref = dense_rows(x, pre, w_up, w_down_t, light)[light]
    if np.linalg.norm(ref) > 0:
        assert rel_err(got, ref) <= TOL
    empty = ~(values(pre[light]) > 0).any(axis=1)
    assert np.all(got[empty] == 0), "a light row without active units is not zero"
    again_heavy, again = run("decode", x, pre, w_up, w_down_t, **kw)
    np.testing.assert_array_equal(again_heavy, heavy)
    np.testing.assert_array_equal(again, y)  # bit for bit (heavy rows: both poison)
    cols_heavy, cols = run("cols", x, pre, w_up, w_down_t, **kw)
    np.testing.assert_array_equal(cols_heavy, heavy)
    want = values(cols[light])
    if np.linalg.norm(want) > 0:
        assert rel_err(got, want) <= TOL
    else:
        assert np.all(got == 0)
    return heavy


# ---------------------------------------------------------------------- tests
N_MAIN = 4608  # 18 tiles of 256, 36 of 128 (two scan windows)


@pytest.mark.parametrize(("tile", "slots"), [(256, 32), (128, 16)])
@pytest.mark.parametrize("k", [8, 264, 2048])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("m", [1, 2, 7, 37, 64])
def test_decode_matches_cols_kernel_and_dense_math(m: int, gated: bool, k: int, tile: int,
                                                   slots: int) -> None:  # fmt: skip
    rng = np.random.default_rng(1000 * m + k)
    limit = default_max_row_nnz(N_MAIN)
    pre = random_pre(rng, m, N_MAIN, 0.01)
    special_rows(pre, tile, slots, limit)
    w_up, w_down_t = weights(N_MAIN, k, seed=k)
    x = bf16_bits(rng.standard_normal((m, k))) if gated else None
    heavy = check(x, pre, w_up, w_down_t, tile=tile, slots=slots, max_row_nnz=limit)
    if m > 10:  # the special rows
        assert heavy[[1, 2, 3, 4, 7, 9, 10]].all() and not heavy[[5, 6, 8]].any()


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
def test_every_row_heavy_leaves_y_untouched(gated: bool) -> None:
    m, k, n = 37, 264, 1024
    rng = np.random.default_rng(5)
    pre = random_pre(rng, m, n, 0.02)
    pre[:, 7] = 0x7FC0
    w_up, w_down_t = weights(n, k, seed=1)
    x = bf16_bits(rng.standard_normal((m, k))) if gated else None
    heavy = check(x, pre, w_up, w_down_t, tile=256, slots=32, max_row_nnz=30)
    assert heavy.all()


@pytest.mark.parametrize("max_row_nnz", [0, 1, LIST_CAPACITY])
def test_row_limits(max_row_nnz: int) -> None:
    """0: only rows without active units are light; the list capacity: none over it."""
    m, k, n = 64, 264, 2048
    rng = np.random.default_rng(max_row_nnz)
    pre = random_pre(rng, m, n, 0.005)
    pre[::5] = NEG
    w_up, w_down_t = weights(n, k, seed=2)
    x = bf16_bits(rng.standard_normal((m, k)))
    check(x, pre, w_up, w_down_t, tile=256, slots=32, max_row_nnz=max_row_nnz)


def test_capacity_limits_of_a_batch() -> None:
    """Many long light rows: a batch's pair list fills up (PAIR_CAPACITY / max_row_nnz
    tokens a batch), and K = 4096 stages the fewest pairs per chunk."""
    m, k, n = 64, 4096, 8192
    rng = np.random.default_rng(9)
    pre = random_pre(rng, m, n, 0.08)  # ~650 active units a row
    w_up, w_down_t = weights(n, k, seed=3)
    x = bf16_bits(rng.standard_normal((m, k)))
    heavy = check(x, pre, w_up, w_down_t, tile=256, slots=128, max_row_nnz=LIST_CAPACITY)
    assert not heavy.all()


@pytest.mark.parametrize("clusters", [1, 3, 64])
def test_any_cluster_count_is_correct(clusters: int) -> None:
    """Fewer clusters than fit (several batches each) or more (a second wave)."""
    m, k, n = 64, 264, 2048
    rng = np.random.default_rng(clusters)
    pre = random_pre(rng, m, n, 0.02)
    special_rows(pre, 256, 32, 40)
    w_up, w_down_t = weights(n, k, seed=4)
    x = cp.asarray(bf16_bits(rng.standard_normal((m, k))))
    heavy = buffers.alloc((m,), np.uint8)
    y = buffers.alloc((m, k), np.uint16)
    light_rows_decode._launch(x, cp.asarray(pre), heavy, cp.asarray(w_up), cp.asarray(w_down_t),
                              y, tile=256, slots=32, max_row_nnz=40, clusters=clusters)  # fmt: skip
    want_heavy, want = run("cols", x.get(), pre, w_up, w_down_t, tile=256, slots=32,
                           max_row_nnz=40)  # fmt: skip
    np.testing.assert_array_equal(heavy.get().astype(bool), want_heavy)
    light = ~want_heavy
    assert np.all(y.get()[want_heavy] == POISON)
    assert rel_err(values(y.get()[light]), values(want[light])) <= TOL


def cols_problem(m: int, k: int, gated: bool, seed: int, p: float = 0.01) -> tuple:
    """A fused-route problem with heavy rows of every kind and rows of many entries."""
    rng = np.random.default_rng(seed)
    limit = default_max_row_nnz(N_MAIN)
    pre = random_pre(rng, m, N_MAIN, p)
    special_rows(pre, 256, 32, limit)
    pre[20:40] = random_pre(rng, 20, N_MAIN, 0.025)  # ~115 entries: many a warp, light
    w_up, w_down_t = weights(N_MAIN, k, seed=k + seed)
    x = bf16_bits(rng.standard_normal((m, k))) if gated else None
    return x, pre, w_up, w_down_t, {"tile": 256, "slots": 32, "max_row_nnz": limit}


@pytest.mark.parametrize("kernel", ["cols", "deep"])
@pytest.mark.parametrize("warps", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("k", [264, 2048, 4096])
def test_cols_kernel_gives_the_one_warp_kernels_bits(
    warps: int, gated: bool, k: int, kernel: str
) -> None:
    """The by-columns kernel (and its deep build) at W warps per token: each output
    column sums its entries in the one-warp kernel's order, so heavy flags and every bit
    of y equal that kernel's (heavy rows untouched), whatever W; close to float64 math."""
    x, pre, w_up, w_down_t, kw = cols_problem(133, k, gated, seed=warps)
    heavy, y = run(kernel, x, pre, w_up, w_down_t, warps=warps, **kw)
    want_heavy, want = run("row", x, pre, w_up, w_down_t, **kw)
    np.testing.assert_array_equal(heavy, want_heavy)
    np.testing.assert_array_equal(heavy, expected_heavy(pre, 256, 32, kw["max_row_nnz"]))
    assert heavy.any() and (~heavy)[20:40].any()  # long light rows among them
    np.testing.assert_array_equal(y, want)  # heavy rows: POISON in both
    light = ~heavy
    assert rel_err(values(y[light]), dense_rows(x, pre, w_up, w_down_t, light)[light]) <= TOL


@pytest.mark.parametrize("kernel", ["row", "cols", "deep"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
def test_the_calls_decision_flags_every_row_or_none(kernel: str, gated: bool) -> None:
    """The light-row kernels from a pre-activation read the call's decision: set, every
    row is flagged heavy and y is left alone; clear, the call is the undecided one."""
    x, pre, w_up, w_down_t, kw = cols_problem(70, 264, gated, seed=3)
    heavy, y = run(kernel, x, pre, w_up, w_down_t, dense=1, **kw)
    assert heavy.all() and np.all(y == POISON)
    want_heavy, want = run(kernel, x, pre, w_up, w_down_t, **kw)
    clear_heavy, clear = run(kernel, x, pre, w_up, w_down_t, dense=0, **kw)
    assert (~want_heavy).any()
    np.testing.assert_array_equal(clear_heavy, want_heavy)
    np.testing.assert_array_equal(clear, want)


@pytest.mark.parametrize("kernel", ["cols", "deep"])
@pytest.mark.parametrize("warps", [1, 8])
def test_cols_kernel_at_the_list_capacity(warps: int, kernel: str) -> None:
    """Rows of exactly LIST_CAPACITY entries (light) and one more (heavy), the row limit at
    the capacity: the by-columns kernel's flags and bits are the one-warp kernel's."""
    m, k, tile, slots = 12, 264, 256, 128
    rng = np.random.default_rng(warps)
    pre = random_pre(rng, m, N_MAIN, 0.01)
    spread = [j * tile + i for i in range(slots - 1) for j in range(N_MAIN // tile)]
    for row, count in ((2, LIST_CAPACITY), (5, LIST_CAPACITY + 1), (7, LIST_CAPACITY - 1)):
        pre[row] = NEG
        pre[row, spread[:count]] = POS
    w_up, w_down_t = weights(N_MAIN, k, seed=4)
    x = bf16_bits(rng.standard_normal((m, k)))
    kw = {"tile": tile, "slots": slots, "max_row_nnz": LIST_CAPACITY}
    heavy, y = run(kernel, x, pre, w_up, w_down_t, warps=warps, **kw)
    want_heavy, want = run("row", x, pre, w_up, w_down_t, **kw)
    np.testing.assert_array_equal(heavy, want_heavy)
    np.testing.assert_array_equal(flags(pre, k, x is not None, **kw), want_heavy)
    assert not heavy[2] and heavy[5] and not heavy[7]
    np.testing.assert_array_equal(y, want)
    light = ~heavy
    assert rel_err(values(y[light]), dense_rows(x, pre, w_up, w_down_t, light)[light]) <= TOL


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=st.integers(1, 300), k=st.sampled_from([8, 136, 1032, 2048]), gated=st.booleans(),
       p=st.sampled_from([0.0, 0.002, 0.01, 0.03]), warps=st.integers(1, 8),
       seed=st.integers(0, 2**16), kernel=st.sampled_from(["cols", "deep"]))  # fmt: skip
def test_hypothesis_cols_kernel(
    m: int, k: int, gated: bool, p: float, warps: int, seed: int, kernel: str
) -> None:
    rng = np.random.default_rng(seed)
    limit = default_max_row_nnz(N_MAIN)
    pre = random_pre(rng, m, N_MAIN, p)
    w_up, w_down_t = weights(N_MAIN, k, seed=seed)
    x = bf16_bits(rng.standard_normal((m, k))) if gated else None
    kw = {"tile": 256, "slots": 32, "max_row_nnz": limit}
    heavy, y = run(kernel, x, pre, w_up, w_down_t, warps=warps, **kw)
    want_heavy, want = run("row", x, pre, w_up, w_down_t, **kw)
    np.testing.assert_array_equal(heavy, want_heavy)
    np.testing.assert_array_equal(flags(pre, k, gated, **kw), want_heavy)
    np.testing.assert_array_equal(y, want)


def flags(pre: np.ndarray, k: int, gated: bool, *, tile: int, slots: int,
          max_row_nnz: int) -> np.ndarray:  # fmt: skip
    """The heavy flags of light_rows.flags (the flags-only scan), poisoned first."""
    heavy = buffers.alloc((pre.shape[0],), np.uint8)
    heavy.fill(7)
    light_rows.flags(cp.asarray(pre), heavy, kdim=k, gated=gated, tile=tile, slots=slots,
                     max_row_nnz=max_row_nnz)  # fmt: skip
    out = heavy.get()
    assert set(np.unique(out)) <= {0, 1}
    return out.astype(bool)


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
def test_flags_kernel_gives_the_light_rows_verdict(gated: bool) -> None:
    """light_rows.flags writes the flags the light-row kernels write (heavy: an
    overflowing tile, a non-finite value, more units than the row limit), NaN and Inf
    rows among them."""
    x, pre, w_up, w_down_t, kw = cols_problem(133, 264, gated, seed=11)
    pre = pre.copy()
    pre[3, 17], pre[9, 4000] = 0x7FC0, 0xFF80  # NaN, -Inf (bf16 bits)
    want_heavy, _ = run("row", x, pre, w_up, w_down_t, **kw)
    assert want_heavy[3] and want_heavy[9] and (~want_heavy).any()
    np.testing.assert_array_equal(flags(pre, 264, gated, **kw), want_heavy)
    np.testing.assert_array_equal(want_heavy, expected_heavy(pre, 256, 32, kw["max_row_nnz"]))


@pytest.mark.parametrize("warps", [1, 4])
@pytest.mark.parametrize(("tile", "slots"), [(32, 8), (64, 12), (128, 16), (256, 32)])
def test_simd_scan_equals_the_scalar_scan(
    tile: int, slots: int, warps: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fused kernels' scan two bf16 at a time (light_rows.SCAN_SIMD, the default) gives
    the scalar scan's heavy flags and output bits at every tile width, on rows holding
    the bit patterns at the edges of relu's rule: +0, -0, the smallest positive and
    negative subnormals, +Inf, -Inf, +NaN and -NaN, and empty tiles."""
    import dataclasses

    m, k = 70, 264
    rng = np.random.default_rng(tile + warps)
    limit = default_max_row_nnz(N_MAIN)
    pre = random_pre(rng, m, N_MAIN, 0.01)
    special_rows(pre, tile, slots, limit)
    edges = np.array([0x0000, 0x8000, 0x0001, 0x8001, 0x7F80, 0xFF80, 0x7FC1, 0xFFC1], np.uint16)
    for i, bits in enumerate(edges):  # one pattern in a light row each, at a lane's odd half
        row = 20 + i
        pre[row] = random_pre(rng, 1, N_MAIN, 0.004)[0]
        pre[row, 3 * tile + 5] = bits
    pre[30:40] = 0x8000  # -0 everywhere: no entry, no tile scanned
    pre[35, 7] = 0x0001  # one subnormal entry among empty tiles
    w_up, w_down_t = weights(N_MAIN, k, seed=tile)
    x = bf16_bits(rng.standard_normal((m, k)))
    kw = {"tile": tile, "slots": slots, "max_row_nnz": limit, "warps": warps}
    assert light_rows.SCAN_SIMD == 1
    heavy, y = run("cols", x, pre, w_up, w_down_t, **kw)
    np.testing.assert_array_equal(heavy, expected_heavy(pre, tile, slots, limit))
    assert heavy[24:28].all() and not heavy[[20, 21, 22, 23, 30, 35]].any()
    scalar = dataclasses.replace(
        light_rows.SOURCE, constants={**light_rows.SOURCE.constants, "SCAN_SIMD": 0}
    )
    monkeypatch.setattr(light_rows, "SOURCE", scalar)
    scalar_heavy, scalar_y = run("cols", x, pre, w_up, w_down_t, **kw)
    np.testing.assert_array_equal(scalar_heavy, heavy)
    np.testing.assert_array_equal(scalar_y[~heavy], y[~heavy])


def test_from_pre_picks_the_decode_kernel_up_to_the_bound(monkeypatch: pytest.MonkeyPatch):
    calls: list[int] = []
    original = light_rows_decode.from_pre

    def spy(*args: object, **kwargs: object) -> None:
        calls.append(args[5].shape[0])
        original(*args, **kwargs)

    monkeypatch.setattr(light_rows_decode, "from_pre", spy)
    # a bound of its own: the tuned one is 0 on an H200 (the by-columns kernel is faster)
    bound = 64
    monkeypatch.setattr(light_rows_decode, "DECODE_ROWS_BELOW", bound)
    k, n = 264, 1024
    w_up, w_down_t = weights(n, k, seed=6)
    for m in (1, bound, bound + 1):
        rng = np.random.default_rng(m)
        pre = cp.asarray(random_pre(rng, m, n, 0.01))
        heavy = buffers.alloc((m,), np.uint8)
        y = buffers.alloc((m, k), np.uint16)
        light_rows.from_pre(None, pre, heavy, None, cp.asarray(w_down_t), y, tile=256, slots=32,
                            max_row_nnz=30)  # fmt: skip
        want = expected_heavy(pre.get(), 256, 32, 30)
        np.testing.assert_array_equal(heavy.get().astype(bool), want)
        assert not (y.get()[~want] == POISON).any() and (y.get()[want] == POISON).all()
    assert calls == [1, bound]


def test_decode_can_be_captured_in_a_cuda_graph() -> None:
    m, k, n = 37, 2048, 4608
    rng = np.random.default_rng(11)
    pre = random_pre(rng, m, n, 0.01)
    special_rows(pre, 256, 32, 100)
    w_up, w_down_t = (cp.asarray(a) for a in weights(n, k, seed=k))
    x, pg = cp.asarray(bf16_bits(rng.standard_normal((m, k)))), cp.asarray(pre)
    kw = {"tile": 256, "slots": 32, "max_row_nnz": 100}
    eager_heavy = buffers.alloc((m,), np.uint8)
    eager = buffers.alloc((m, k), np.uint16)
    light_rows_decode.from_pre(x, pg, eager_heavy, w_up, w_down_t, eager, **kw)
    heavy = buffers.alloc((m,), np.uint8)
    y = buffers.alloc((m, k), np.uint16)
    # The buffers are poisoned on the default stream, which a non-blocking stream does
    # not wait for: a launch on it could run before the poison lands and be overwritten.
    cp.cuda.Device().synchronize()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        light_rows_decode.from_pre(x, pg, heavy, w_up, w_down_t, y, **kw)
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
        first = y.copy()
        y.fill(POISON)
        graph.launch(stream)
        stream.synchronize()
    assert cp.array_equal(heavy, eager_heavy)
    assert cp.array_equal(y, eager) and cp.array_equal(first, eager)


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("m", [1, 37, 64])
def test_fused_route_matches_dense_float64(m: int, gated: bool) -> None:
    """The whole block through the fused route (decode kernel, then the heavy rows)."""
    p = workloads.heavy(m, 512, 1024, p=0.02, frac=0.1, seed=m)
    x = p.x.astype(np.float32)
    if m > 2:
        x[1, 5] = np.nan
    x = x.astype(BF16)
    w_gate = p.w_gate if gated else None
    block = PreparedBlock(*(to_gpu(a) for a in (w_gate, p.w_up, p.w_down)),
                          Options(path="fused", density_switch=False))  # fmt: skip
    y = block(to_gpu(x))
    got = y.view(cp.uint16).get().view(BF16).astype(np.float64)
    ref = reference.forward.ffn_dense(x, w_gate, p.w_up, p.w_down)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(ref))
    rows = np.isfinite(ref).all(axis=1)
    assert rel_err(got[rows], ref[rows]) <= TOL
    assert cp.array_equal(y.view(cp.uint16), block(to_gpu(x)).view(cp.uint16))


_GPU_SETTINGS = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@_GPU_SETTINGS
@given(
    tst.packing_problems(tiles=(32, 128, 256), slot_choices=(4, 16, 32), rows=st.integers(1, 64),
                         row_tiles=st.integers(1, 3), allow_nonfinite=True),
    st.sampled_from([8, 16, 264]),
    st.booleans(),
    st.one_of(st.none(), st.integers(0, 80)),
    st.integers(0, 2**31 - 1),
)  # fmt: skip
def test_hypothesis_decode(problem: tuple, k: int, gated: bool, max_row_nnz: int | None,
                           seed: int) -> None:  # fmt: skip
    h, tile, slots = problem
    pre = bf16_bits(h)
    m, n = pre.shape
    limit = default_max_row_nnz(n) if max_row_nnz is None else max_row_nnz
    rng = np.random.default_rng(seed)
    w_up = bf16_bits(rng.standard_normal((n, k)) / np.sqrt(k))
    w_down_t = bf16_bits(rng.standard_normal((n, k)) / np.sqrt(n))
    x = bf16_bits(rng.standard_normal((m, k))) if gated else None
    check(x, pre, w_up, w_down_t, tile=tile, slots=slots, max_row_nnz=limit)
