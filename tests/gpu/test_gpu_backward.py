"""The GPU backward pass (twell.kernels.backward) against the float64 reference
(``twell.reference.ffn_backward``); skipped without a GPU.

Every buffer the launchers allocate is poisoned (0xFF bytes: NaN in bf16 and fp32, -1 in
int32) before the kernels run, so an element a kernel forgot to write fails the
comparison.
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
from twell.kernels import backward
from twell.kernels.pipeline import PreparedBlock
from twell.options import Options
from twell.testing import strategies as tst
from twell.testing.asserts import as_host
from twell.testing.gpu import poisoned_buffers

BF16 = np.dtype(ml_dtypes.bfloat16)
TOL = 1e-2


def to_f64(a: object) -> np.ndarray:
    return as_host(a).astype(np.float64)


def assert_grad_close(
    name: str, got: object, ref: np.ndarray | None, tol: float | None = None
) -> None:
    """Same non-finite pattern; relative Frobenius error of the finite entries <= tol
    (default TOL)."""
    tol = TOL if tol is None else tol
    if ref is None:
        assert got is None, name
        return
    got = to_f64(got)
    assert got.shape == ref.shape, (name, got.shape, ref.shape)
    finite = np.isfinite(ref)
    mismatch = int((np.isfinite(got) != finite).sum())
    assert mismatch == 0, f"{name}: {mismatch} entries differ in finiteness from the reference"
    if finite.any():
        diff = np.linalg.norm(got[finite] - ref[finite])
        err = float(diff / max(np.linalg.norm(ref[finite]), 1e-30))
        assert err <= tol, f"{name}: relative error {err:.3e} > {tol}"


def problem(kind: str, m: int, k: int, n: int, seed: int = 0) -> workloads.Problem:
    if kind == "uniform":
        return workloads.uniform(m, k, n, p=0.02, seed=seed)
    if kind == "heavy":
        return workloads.heavy(m, k, n, p=0.02, frac=0.05, seed=seed)
    if kind == "paperlike":
        return workloads.paperlike(m, k, n, seed=seed, seq_len=256)
    raise ValueError(kind)


def weights(p: workloads.Problem, gated: bool) -> tuple[object, object, object]:
    """(w_gate, w_up, w_down); the non-gated block takes the workload's gate as w_up, so
    its hidden activation is as sparse as the gated block's."""
    if gated:
        return p.w_gate, p.w_up, p.w_down
    return None, p.w_gate, p.w_down


def upstream(m: int, k: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((m, k)).astype(BF16)


def run(
    w: tuple[object, object, object], x: np.ndarray, dy: np.ndarray, options: Options,
    l1: float = 0.0, reduction: str = "mean", *, unchecked_weights: bool = False,
) -> tuple[tuple[object, ...], tuple[object, ...]]:  # fmt: skip
    block = PreparedBlock(*(to_gpu(a) for a in w), options)
    if unchecked_weights:  # as a block built without a host synchronisation
        block.weights_finite = None
    xg, dyg = to_gpu(x), to_gpu(dy)
    _, saved = block.forward(xg, save=True)
    got = backward.ffn_backward(block, xg, dyg, saved, l1_coeff=l1, reduction=reduction)
    again = backward.ffn_backward(block, xg, dyg, saved, l1_coeff=l1, reduction=reduction)
    for a, b in zip(got, again, strict=True):
        if a is not None:
            assert cp.array_equal(a.view(cp.uint8), b.view(cp.uint8)), "not deterministic"
    return got, reference.ffn_backward(x, *w, dy, l1, reduction=reduction)


def check(got: tuple[object, ...], ref: tuple[object, ...]) -> None:
    for name, g, r in zip(("dx", "dw_gate", "dw_up", "dw_down"), got, ref, strict=True):
        assert_grad_close(name, g, r)
    assert got[0].dtype == BF16
    assert all(g is None or g.dtype == np.float32 for g in got[1:])


CASES = [
    # (workload, M, K, N, slots)
    ("uniform", 1, 264, 512, 32),
    ("uniform", 37, 8, 512, 32),
    ("uniform", 300, 264, 1024, 64),
    ("heavy", 37, 264, 512, 32),
    ("heavy", 300, 512, 1024, 32),
    ("heavy", 300, 8, 512, 64),
    ("paperlike", 300, 512, 512, 32),
    ("paperlike", 37, 264, 1024, 64),
]


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize(("kind", "m", "k", "n", "slots"), CASES)
def test_backward_matches_reference(kind: str, m: int, k: int, n: int, slots: int, gated: bool):
    p = problem(kind, m, k, n, seed=m + k)
    got, ref = run(weights(p, gated), p.x, upstream(m, k, m), Options(slots=slots))
    check(got, ref)


@pytest.mark.parametrize("strength", ["1e-2", "strong"])
@pytest.mark.parametrize("reduction", ["mean", "per_token"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize(("kind", "m"), [("uniform", 37), ("heavy", 300)])
def test_backward_with_l1(kind: str, m: int, gated: bool, reduction: str, strength: str):
    """l1_coeff = 1e-2, and a coefficient whose per-element gradient (0.05 · sign(h)) is a
    visible part of dh, so that a wrong sign or scale fails."""
    n = 512
    l1 = 1e-2 if strength == "1e-2" else 0.05 * m * (n if reduction == "mean" else 1)
    p = problem(kind, m, 264, n, seed=3)
    got, ref = run(weights(p, gated), p.x, upstream(m, 264, 4), Options(), l1, reduction)
    check(got, ref)


def test_backward_l1_coefficient_on_the_device():
    """A one-element device array as l1_coeff (read by the kernels, never by the host)."""
    p = problem("heavy", 300, 264, 512, seed=3)
    w = weights(p, True)
    block = PreparedBlock(*(to_gpu(a) for a in w), Options())
    xg, dyg = to_gpu(p.x), to_gpu(upstream(300, 264, 4))
    _, saved = block.forward(xg, save=True)
    coeff = cp.full((1,), 3.0, dtype=cp.float32)
    got = backward.ffn_backward(block, xg, dyg, saved, l1_coeff=coeff, reduction="per_token")
    check(got, reference.ffn_backward(p.x, *w, upstream(300, 264, 4), 3.0, reduction="per_token"))
    with pytest.raises(ValueError, match="l1_coeff"):
        backward.ffn_backward(block, xg, dyg, saved, l1_coeff=cp.zeros(2, dtype=cp.float32))


def _with_nonfinite(x: np.ndarray, dy: np.ndarray, where: str) -> tuple[np.ndarray, np.ndarray]:
    x, dy = x.astype(np.float32), dy.astype(np.float32)
    if where in ("x", "both"):
        x[1, 5] = np.nan
        x[2, 7] = np.inf
    if where in ("dy", "both"):
        dy[4, 3] = np.nan  # a light row: dense math spreads it to every unit
        dy[6, 0] = -np.inf
    return x.astype(BF16), dy.astype(BF16)


@pytest.mark.parametrize("where", ["x", "dy", "both"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
def test_backward_nonfinite_rows_propagate_like_dense_math(where: str, gated: bool):
    p = problem("heavy", 300, 264, 512, seed=11)
    x, dy = _with_nonfinite(p.x, upstream(300, 264, 12), where)
    got, ref = run(weights(p, gated), x, dy, Options(), 1e-2)
    check(got, ref)


@pytest.mark.parametrize("checked", ["host", "device"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
def test_backward_nonfinite_weight_runs_dense(gated: bool, checked: str):
    """A NaN weight makes every row dense: the block's host check, or (weights_finite
    None) the backward's own check on the device."""
    p = problem("uniform", 150, 72, 512, seed=5)
    w_gate, w_up, w_down = weights(p, gated)
    w_up = w_up.astype(np.float32)
    w_up[7, 2] = np.nan  # a unit no token may use: dense math still spreads it
    w = (w_gate, w_up.astype(BF16), w_down)
    dy = upstream(150, 72, 6)
    got, ref = run(w, p.x, dy, Options(), unchecked_weights=checked == "device")
    check(got, ref)


def test_backward_checks_unchecked_weights_without_changing_finite_results():
    p = problem("heavy", 300, 264, 512, seed=9)
    dy = upstream(300, 264, 10)
    got, ref = run(weights(p, True), p.x, dy, Options(), unchecked_weights=True)
    check(got, ref)


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
def test_backward_segments_and_heavy_chunks(monkeypatch: pytest.MonkeyPatch, gated: bool):
    """Short unit-list segments (many extra segments) and small heavy chunks (several
    chunks in use) take the code paths that large batches take."""
    monkeypatch.setattr(backward, "MIN_SEGMENT", 4)
    monkeypatch.setattr(backward, "HEAVY_CHUNK_MIN", 64)
    p = problem("heavy", 600, 264, 512, seed=21)
    x, dy = p.x, upstream(600, 264, 22)
    got, ref = run(weights(p, gated), x, dy, Options(max_row_nnz=4))
    # Nearly every row is heavy here (max_row_nnz=4): the tensor-core path keeps da/du in
    # bf16 as dense bf16 autograd does. Its dx error sits at bf16's level: allowed up to
    # 1.25x what torch's own bf16 autograd of the dense block gets on the same inputs.
    dense_err = _dense_bf16_dx_error(weights(p, gated), x, dy, ref[0])
    assert_grad_close("dx", got[0], ref[0], max(TOL, 1.25 * dense_err))
    for name, g, r in zip(("dw_gate", "dw_up", "dw_down"), got[1:], ref[1:], strict=True):
        assert_grad_close(name, g, r)


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize(("k", "chunk"), [(264, 64), (4096, 576)])
def test_heavy_chunks_give_the_same_bits_on_any_grid(
    monkeypatch: pytest.MonkeyPatch, gated: bool, k: int, chunk: int
):
    """Step 4's one launch takes its work from a queue: with one block in all, one per SM
    or three per SM, nearly all-heavy rows give the same bits, and the right gradients.
    Chunks of 64 rows (ten of them; each chunk's dx split over its reduction), and at
    K=4096 one of 576 rows (dx in one part on a 132-SM H100) then one of 24 (split)."""
    monkeypatch.setattr(backward, "HEAVY_CHUNK_MIN", chunk)
    m, n = 600, 512
    p = problem("heavy", m, k, n, seed=23)
    w, x, dy = weights(p, gated), p.x, upstream(m, k, 24)
    results = []
    for blocks in (lambda sms: 1, lambda sms: sms, lambda sms: 3 * sms):
        monkeypatch.setattr(backward, "_heavy_grid", blocks)
        got, ref = run(w, x, dy, Options(max_row_nnz=4))
        dense_err = _dense_bf16_dx_error(w, x, dy, ref[0])
        assert_grad_close("dx", got[0], ref[0], max(TOL, 1.25 * dense_err))
        for name, g, r in zip(("dw_gate", "dw_up", "dw_down"), got[1:], ref[1:], strict=True):
            assert_grad_close(name, g, r)
        results.append(got)
    for got in results[1:]:
        for a, b in zip(results[0], got, strict=True):
            if a is not None:
                assert cp.array_equal(a.view(cp.uint8), b.view(cp.uint8))


def _dense_bf16_dx_error(
    w: tuple, x: np.ndarray, dy: np.ndarray, ref_dx: np.ndarray, l1: float = 0.0,
    reduction: str = "mean",
) -> float:  # fmt: skip
    """Relative error of dx (finite entries) from torch autograd of the dense block in
    bf16, the loss <dy, y> + l1 · L1(h): what dense bf16 math itself gets."""
    torch = pytest.importorskip("torch")

    def t(a: object, grad: bool = False) -> object:
        return torch.from_numpy(np.asarray(a, np.float32)).cuda().bfloat16().requires_grad_(grad)

    wg, wu, wd = (None if a is None else t(a) for a in w)
    xt = t(x, True)
    a = torch.nn.functional.linear(xt, wu if wg is None else wg)
    h = torch.relu(a) if wg is None else torch.relu(a) * torch.nn.functional.linear(xt, wu)
    y = torch.nn.functional.linear(h, wd)
    scale = 1.0 / (h.shape[0] * (h.shape[1] if reduction == "mean" else 1))
    loss = (y.float() * t(dy).float()).sum() + l1 * scale * h.float().abs().sum()
    loss.backward()
    got = xt.grad.double().cpu().numpy()
    finite = np.isfinite(ref_dx) & np.isfinite(got)
    return float(np.linalg.norm((got - ref_dx)[finite]) / np.linalg.norm(ref_dx[finite]))


@pytest.mark.parametrize("rows", [None, 128], ids=["one-launch", "token-ranges"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize(("k", "slicings"), [(1024, (1, 2, 4)), (4096, (1, 2, 16))])
def test_weight_gradient_slices_give_the_same_bits(
    monkeypatch: pytest.MonkeyPatch, gated: bool, rows: int | None, k: int, slicings: tuple
) -> None:
    """The weight-gradient kernel by K slices (with extra segments in use; at K=4096 the
    whole rows take two chunks per thread, a slice one), in one launch or by token ranges
    of 128 (five launches, the later ones adding to the rows): right, and the same bits
    for every slicing."""
    monkeypatch.setattr(backward, "MIN_SEGMENT", 4)
    if rows is not None:
        monkeypatch.setattr(backward, "grad_rows", lambda m, k, s: rows)
    p = problem("paperlike", 600, k, 512, seed=31)
    w, dy = weights(p, gated), upstream(600, k, 32)
    results = []
    for slices in slicings:
        monkeypatch.setattr(backward, "grad_slices", lambda m, k, s=slices: s)
        got, ref = run(w, p.x, dy, Options())
        check(got, ref)
        results.append(got)
    for got in results[1:]:
        for a, b in zip(results[0], got, strict=True):
            if a is not None:
                assert cp.array_equal(a.view(cp.uint8), b.view(cp.uint8))


def test_backward_hot_units_split_into_segments():
    """paperlike has hot units (thousands of tokens): their lists are cut into segments."""
    p = problem("paperlike", 4096, 264, 1024, seed=2)
    got, ref = run(weights(p, True), p.x, upstream(4096, 264, 3), Options())
    check(got, ref)


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
def test_backward_many_tokens(gated: bool):
    """M past 2^17: token ids, pair indices and chunk offsets stay exact."""
    m = 131072 + 37
    p = problem("uniform", m, 16, 256, seed=1)
    got, ref = run(weights(p, gated), p.x, upstream(m, 16, 2), Options())
    check(got, ref)


def test_backward_empty_batch():
    p = problem("uniform", 4, 264, 512)
    block = PreparedBlock(*(to_gpu(a) for a in weights(p, True)), Options())
    x = to_gpu(np.zeros((0, 264), BF16))
    _, saved = block.forward(x, save=True)
    dx, dwg, dwu, dwd = backward.ffn_backward(block, x, x, saved)
    assert dx.shape == (0, 264)
    for g, shape in ((dwg, (512, 264)), (dwu, (512, 264)), (dwd, (264, 512))):
        assert g.shape == shape and not bool(g.any())


def test_backward_rejects_bad_arguments():
    p = problem("uniform", 8, 264, 512)
    block = PreparedBlock(*(to_gpu(a) for a in weights(p, True)), Options())
    x = to_gpu(p.x)
    _, saved = block.forward(x, save=True)
    with pytest.raises(ValueError, match="dy: expected shape"):
        backward.ffn_backward(block, x, x[:4], saved)
    with pytest.raises(ValueError, match="reduction"):
        backward.ffn_backward(block, x, x, saved, reduction="sum")
    with pytest.raises(ValueError, match="l1_coeff"):
        backward.ffn_backward(block, x, x, saved, l1_coeff=float("nan"))
    with pytest.raises(ValueError, match="saved.packed"):
        backward.ffn_backward(block, x[:4], x[:4], saved)


def test_unit_lists_match_numpy():
    """The transposed view, built on its own from packed words, light flags and tile
    offsets computed in NumPy."""
    m, k, n, tile, slots = 700, 264, 1024, 256, 32
    p = problem("heavy", m, k, n, seed=8)
    h = reference.gate(p.x, p.w_gate, tile=tile, slots=slots)
    packed = np.asarray(h.ell.packed)
    light = np.zeros(m, np.uint8)  # 1: a heavy row, left out of the lists
    light[np.asarray(h.dense_rows)] = 1
    counts = packed[:, ::slots].astype(np.int64)
    row_cap = int(counts[light == 0].sum(axis=1).max())
    tile_off = (np.cumsum(counts, axis=1) - counts).astype(np.int32)
    params = {"KDIM": k, "TILE": tile, "SLOTS": slots, "GATED": 1}
    lists = backward.build_unit_lists(
        cp.asarray(packed), cp.asarray(light), cp.asarray(tile_off), n, row_cap, params
    )
    start = cp.asnumpy(lists.unit_start)
    tokens, pairs = cp.asnumpy(lists.tokens), cp.asnumpy(lists.pairs)
    expected: dict[int, list[tuple[int, int]]] = {u: [] for u in range(n)}
    for t in np.nonzero(light == 0)[0]:
        for j in range(n // tile):
            for s in range(1, int(counts[t, j]) + 1):
                unit = int(packed[t, j * slots + s] & 0xFFFF)
                expected[unit].append((int(t), int(t) * row_cap + int(tile_off[t, j]) + s - 1))
    assert start[0] == 0 and start[n] == sum(len(v) for v in expected.values())
    for u in range(n):
        span = slice(start[u], start[u + 1])
        assert list(zip(tokens[span], pairs[span], strict=True)) == expected[u], u


_GPU_SETTINGS = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@_GPU_SETTINGS
@given(
    tst.ffn_problems(k=st.sampled_from([8, 16, 264]), tiles=st.integers(1, 2), tile=256,
                     rows=st.integers(1, 70)),
    st.sampled_from([0.0, 1e-2]),
    st.sampled_from(["mean", "per_token"]),
    st.sampled_from([2, 32]),
    st.integers(0, 2**31 - 1),
)  # fmt: skip
def test_hypothesis_backward(
    p: tst.FFNProblem, l1: float, reduction: str, slots: int, seed: int
) -> None:
    w = tuple(None if a is None else np.asarray(a).astype(BF16) for a in p[1:])
    x = np.asarray(p.x).astype(BF16)
    dy = upstream(x.shape[0], x.shape[1], seed)
    got, ref = run(w, x, dy, Options(slots=slots), l1, reduction)
    # slots=2 makes most rows heavy: their da/du are bf16 on the tensor-core path, as in
    # dense bf16 autograd; dx may then sit at dense bf16 math's own error (tiny K gives
    # few terms to average it away), so it is held to 1.25x that where it exceeds TOL.
    dense_err = _dense_bf16_dx_error(w, x, dy, ref[0], l1, reduction)
    assert_grad_close("dx", got[0], ref[0], max(TOL, 1.25 * dense_err))
    for name, g, r in zip(("dw_gate", "dw_up", "dw_down"), got[1:], ref[1:], strict=True):
        assert_grad_close(name, g, r)


def test_dataclass_fields_are_what_the_pipeline_passes():
    fields = [f.name for f in dataclasses.fields(backward.Activations)]
    assert fields == ["packed", "heavy", "ids", "count", "row_l1", "up"]


@pytest.mark.parametrize(("kind", "m", "k"), [("heavy", 300, 264), ("paperlike", 600, 4096)])
def test_saved_up_products_give_the_recomputed_bits(kind: str, m: int, k: int) -> None:
    """The forward's up products (Activations.up, every entry of every light row) are the
    ones the backward computes without them, bit for bit: both give the same gradients."""
    p = problem(kind, m, k, 512, seed=41)
    block = PreparedBlock(*(to_gpu(a) for a in weights(p, True)), Options())
    xg, dyg = to_gpu(p.x), to_gpu(upstream(m, k, 42))
    _, saved = block.forward(xg, save=True)
    r = backward.row_capacity(block.max_row_nnz, 512, 256, Options().slots, m)
    assert saved.up is not None and saved.up.shape == (m, r)
    with_up = backward.ffn_backward(block, xg, dyg, saved, l1_coeff=1e-2)
    without = backward.ffn_backward(block, xg, dyg, dataclasses.replace(saved, up=None),
                                    l1_coeff=1e-2)  # fmt: skip
    for a, b in zip(with_up, without, strict=True):
        assert cp.array_equal(a.view(cp.uint8), b.view(cp.uint8))
    check(with_up, reference.ffn_backward(p.x, *weights(p, True), upstream(m, k, 42), 1e-2))
    # the saved products are what the backward reads: doubled, every gradient that
    # depends on u changes (da = dh·u, h = g·u); du = dh·g and so dw_up do not
    doubled = dataclasses.replace(saved, up=saved.up * 2)
    changed = backward.ffn_backward(block, xg, dyg, doubled, l1_coeff=1e-2)
    same = [bool(cp.array_equal(a.view(cp.uint8), b.view(cp.uint8)))
            for a, b in zip(with_up, changed, strict=True)]  # fmt: skip
    assert same == [False, False, True, False]  # dx, dw_gate, dw_up, dw_down
    for bad in (saved.up[:, :-1], saved.up.astype(cp.float16), cp.asfortranarray(saved.up)):
        with pytest.raises(ValueError, match="saved.up"):
            backward.ffn_backward(block, xg, dyg, dataclasses.replace(saved, up=bad))
    from twell.kernels import light_rows

    y = cp.empty_like(xg)
    for bad in (saved.up.astype(cp.float16), cp.asfortranarray(saved.up), saved.up[:-1]):
        with pytest.raises(ValueError, match="up"):
            light_rows.from_twell(xg, saved.packed, saved.heavy, block.w_up, block.w_down_t, y,
                                  tile=256, slots=Options().slots, up=bad)  # fmt: skip


def test_nongated_forward_saves_no_up_products() -> None:
    p = problem("uniform", 37, 264, 512, seed=43)
    block = PreparedBlock(*(to_gpu(a) for a in weights(p, False)), Options())
    _, saved = block.forward(to_gpu(p.x), save=True)
    assert saved.up is None


@pytest.mark.parametrize(
    "opts",
    [{}, {"path": "pack"}, {"dense_capacity": 0.25}, {"dense_capacity": 0.02},
     {"dense_capacity": 1.0}, {"slots": 4}, {"max_row_nnz": 4}],
    ids=["epilogue", "pack", "capacity", "capacity_split", "all_capacity", "slots4",
         "row_limit"],
)  # fmt: skip
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize(("kind", "m"), [("uniform", 37), ("heavy", 300), ("paperlike", 129)])
def test_forward_row_l1_matches_reference(kind: str, m: int, gated: bool, opts: dict):
    """``Activations.row_l1`` (the training forward's L1 term per row: light rows from the
    gather, heavy rows from their dense rows) against float64 sums of ``|h|``, NaN/Inf
    rows included; every element written (the buffers are poisoned)."""
    k, n = 264, 1024
    p = problem(kind, m, k, n, seed=3)
    w = weights(p, gated)
    x = np.array(p.x)
    x[min(3, m - 1), 5] = np.nan
    x[m // 2, 7] = np.inf
    options = dataclasses.replace(Options(), **opts)
    block = PreparedBlock(*(to_gpu(a) for a in w), options)
    _, saved = block.forward(to_gpu(x), save=True)
    got = to_f64(saved.row_l1)
    xf = x.astype(np.float64)
    with np.errstate(all="ignore"):
        first = xf @ np.asarray(w[0] if gated else w[1], np.float64).T
        h = np.where(np.isnan(first) | (first > 0), first, 0.0)
        if gated:
            h = h * (xf @ np.asarray(w[1], np.float64).T)
        ref = np.abs(h).sum(axis=1)
    assert got.shape == (m,)
    assert np.array_equal(np.isnan(got), np.isnan(ref)), (np.isnan(got), np.isnan(ref))
    finite = np.isfinite(ref)
    assert np.array_equal(np.isfinite(got), finite)
    err = np.abs(got[finite] - ref[finite]) / np.maximum(ref[finite], 1e-6)
    assert err.max() <= 1e-2, (err.max(), int(err.argmax()))
    _, again = block.forward(to_gpu(x), save=True)
    assert cp.array_equal(again.row_l1.view(cp.uint32), saved.row_l1.view(cp.uint32))
    # A finite poison (0x7F bytes): a row left unwritten would not hide behind a NaN row.
    with poisoned_buffers(0x7F):
        _, finite_poison = block.forward(to_gpu(x), save=True)
    assert cp.array_equal(finite_poison.row_l1.view(cp.uint32), saved.row_l1.view(cp.uint32))


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
def test_bf16_gradients_are_the_fp32_ones_rounded(gated: bool):
    """``grad_dtype=bf16``: the same fp32 accumulation, rounded once (bit for bit)."""
    p = problem("heavy", 300, 264, 1024, seed=5)
    w = weights(p, gated)
    block = PreparedBlock(*(to_gpu(a) for a in w), Options())
    xg, dyg = to_gpu(p.x), to_gpu(upstream(300, 264, 6))
    _, saved = block.forward(xg, save=True)
    f32 = backward.ffn_backward(block, xg, dyg, saved, l1_coeff=1e-2)
    b16 = backward.ffn_backward(block, xg, dyg, saved, l1_coeff=1e-2, grad_dtype=BF16)
    assert_rounded_once(f32, b16)
    with pytest.raises(TypeError, match="grad_dtype"):
        backward.ffn_backward(block, xg, dyg, saved, grad_dtype=np.float16)


def assert_rounded_once(f32: tuple, b16: tuple, case: str = "") -> None:
    """The backward's bf16 results are its fp32 ones rounded once, bit for bit (``dx`` the
    same; any NaN stays a NaN)."""
    assert cp.array_equal(f32[0].view(cp.uint16), b16[0].view(cp.uint16))
    for a, b in zip(f32[1:], b16[1:], strict=True):
        if a is None:
            assert b is None
            continue
        assert b.dtype == BF16 and b.shape == a.shape
        rounded = as_host(a).astype(BF16)
        got = as_host(b)
        same = (got.view(np.uint16) == rounded.view(np.uint16)) | (
            np.isnan(got.astype(np.float32)) & np.isnan(rounded.astype(np.float32))
        )
        assert same.all(), f"{case}: {int((~same).sum())} of {same.size} differ"


@pytest.mark.parametrize(
    "case", ["uniform", "chunks", "folded", "segments_ranges", "gemms", "gemms_segments"]
)
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
def test_bf16_gradients_rounded_in_the_weight_gradient_kernels(
    monkeypatch: pytest.MonkeyPatch, case: str, gated: bool
):
    """bf16 gradients are the fp32 ones rounded once, bit for bit, both where the
    weight-gradient kernels round them themselves (no heavy row left for the chunks:
    ``uniform``, ``folded`` capacity rows, capacity rows through cuBLAS ``gemms`` written
    first, and lists in ``segments`` over several token ranges, with those GEMMs too) and
    where the rounding pass does (heavy rows through the ``chunks``); the pass is launched
    either way and returns at once in the first."""
    m, k, n = 300, 264, 1024
    kind = "uniform" if case in ("uniform", "segments_ranges") else "heavy"
    p = problem(kind, m, k, n, seed=9)
    w = weights(p, gated)
    # heavy: a tenth of the rows or so (5% of tokens ×3, and rows over the row limit)
    capacity = {"folded": 0.2, "gemms": 1.0, "gemms_segments": 1.0}.get(case, 0.0)
    if case.startswith("gemms"):
        monkeypatch.setattr(backward, "FOLD_ROWS", 4)  # 300 capacity rows: cuBLAS
    if case in ("segments_ranges", "gemms_segments"):  # lists of more than 4 pairs split
        monkeypatch.setattr(backward, "segment_length", lambda capacity, n: 4)
        monkeypatch.setattr(backward, "grad_rows", lambda m, k, s: 64)
    # uniform: ~20 units a row, every row light under a row limit of 100
    limit = {"max_row_nnz": 100} if kind == "uniform" else {}
    block = PreparedBlock(*(to_gpu(a) for a in w), Options(dense_capacity=capacity, **limit))
    dy = upstream(m, k, 10)
    xg, dyg = to_gpu(p.x), to_gpu(dy)
    _, saved = block.forward(xg, save=True)
    heavy = int(saved.count[0])
    assert (heavy == 0) == (kind == "uniform"), heavy
    if case == "folded":
        assert 0 < heavy <= block.options.capacity_rows(m) <= backward.FOLD_ROWS
    f32 = backward.ffn_backward(block, xg, dyg, saved, l1_coeff=1e-2)
    with poisoned_buffers():
        b16 = backward.ffn_backward(block, xg, dyg, saved, l1_coeff=1e-2, grad_dtype=BF16)
    assert_rounded_once(f32, b16, case)
    check(f32, reference.ffn_backward(p.x, *w, dy, 1e-2))


# ------------------------------------------------------------------ dense_capacity
def _capacity_problem(kind: str, m: int, k: int, n: int, seed: int) -> tuple:
    """(problem, x, dy): ``nonfinite`` is the heavy workload with NaN and Inf in rows of x
    and dy (those rows join the backward's heavy rows)."""
    p = problem("paperlike" if kind == "paperlike" else "heavy", m, k, n, seed=seed)
    x, dy = p.x, upstream(m, k, seed + 1)
    if kind == "nonfinite":
        x, dy = _with_nonfinite(x, dy, "both")
    return p, x, dy


def _spy(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """Counts the calls of ``backward.<name>`` (which still runs)."""
    calls: list[int] = []
    original = getattr(backward, name)

    def spy(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(backward, name, spy)
    return calls


@pytest.mark.parametrize("l1", ["off", "mean", "per_token_device"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("capacity", [0.01, 0.05, 1.0])
@pytest.mark.parametrize("kind", ["heavy", "paperlike", "nonfinite"])
def test_backward_dense_capacity_matches_reference(
    monkeypatch: pytest.MonkeyPatch, kind: str, capacity: float, gated: bool, l1: str
):
    """dense_capacity: the first ceil(f*M) heavy rows of the backward through cuBLAS GEMMs
    of that many rows, the rest (if any) through the chunk kernels: gradients against the
    float64 reference, NaN/Inf rows included, with the L1 term (a visible part of dh) in
    both reductions, its coefficient also on the device; bits identical on rerun.

    M=300: heavy has 44 heavy rows and paperlike 12 (more than ceil(0.01 M) = 3; 0.05 M =
    15 rows leaves padding rows for paperlike); 1.0 sends every one through cuBLAS and
    launches no chunk."""
    m, k, n = 300, 264, 1024
    p, x, dy = _capacity_problem(kind, m, k, n, seed=3)
    w = weights(p, gated)
    coeff, reduction = {"off": (0.0, "mean"), "mean": (0.05 * m * n, "mean"),
                        "per_token_device": (0.05 * m, "per_token")}[l1]  # fmt: skip
    block = PreparedBlock(*(to_gpu(a) for a in w), Options(dense_capacity=capacity))
    xg, dyg = to_gpu(x), to_gpu(dy)
    _, saved = block.forward(xg, save=True)
    assert int(saved.count[0]) > 3, "the workload must have more heavy rows than 0.01 M"
    l1_arg = cp.full((1,), coeff, dtype=cp.float32) if l1.endswith("device") else coeff
    capacity_calls = _spy(monkeypatch, "_capacity_rows")
    chunk_calls = _spy(monkeypatch, "_heavy_rows")
    got = backward.ffn_backward(block, xg, dyg, saved, l1_coeff=l1_arg, reduction=reduction)
    assert len(capacity_calls) == 1
    assert len(chunk_calls) == (0 if capacity == 1.0 else 1)
    again = backward.ffn_backward(block, xg, dyg, saved, l1_coeff=l1_arg, reduction=reduction)
    for a, b in zip(got, again, strict=True):
        if a is not None:
            assert cp.array_equal(a.view(cp.uint8), b.view(cp.uint8)), "not deterministic"
    check(got, reference.ffn_backward(x, *w, dy, coeff, reduction=reduction))


@pytest.mark.parametrize("geometry", ["row_limit", "slots2"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
def test_backward_more_heavy_rows_than_the_capacity(
    monkeypatch: pytest.MonkeyPatch, gated: bool, geometry: str
):
    """Nearly every row heavy (max_row_nnz=4, or slots=2), dense_capacity 0.01: 6 rows
    through cuBLAS, the rest through several small chunks that start after them."""
    monkeypatch.setattr(backward, "HEAVY_CHUNK_MIN", 64)
    m, k, n = 600, 264, 512
    p = problem("heavy", m, k, n, seed=21)
    x, dy = p.x, upstream(m, k, 22)
    extra = {"max_row_nnz": 4} if geometry == "row_limit" else {"slots": 2}
    options = Options(dense_capacity=0.01, **extra)
    assert options.capacity_rows(m) == 6
    got, ref = run(weights(p, gated), x, dy, options, 1e-2)
    # As test_backward_segments_and_heavy_chunks: dx of (nearly) all-heavy rows is held to
    # 1.25x dense bf16 autograd's own error where that exceeds TOL.
    dense_err = _dense_bf16_dx_error(weights(p, gated), x, dy, ref[0], 1e-2)
    assert_grad_close("dx", got[0], ref[0], max(TOL, 1.25 * dense_err))
    for name, g, r in zip(("dw_gate", "dw_up", "dw_down"), got[1:], ref[1:], strict=True):
        assert_grad_close(name, g, r)


@pytest.mark.parametrize("checked", ["host", "device"])
@pytest.mark.parametrize("capacity", [0.01, 1.0])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
def test_backward_dense_capacity_with_a_nonfinite_weight(gated: bool, capacity: float,
                                                         checked: str):  # fmt: skip
    """A NaN weight makes every row heavy: the capacity GEMMs spread it as dense math does
    (padding rows add nothing)."""
    p = problem("uniform", 150, 72, 512, seed=5)
    w_gate, w_up, w_down = weights(p, gated)
    w_up = w_up.astype(np.float32)
    w_up[7, 2] = np.nan
    w = (w_gate, w_up.astype(BF16), w_down)
    got, ref = run(w, p.x, upstream(150, 72, 6), Options(dense_capacity=capacity),
                   unchecked_weights=checked == "device")  # fmt: skip
    check(got, ref)


@pytest.mark.parametrize("capacity", [0.05, 1.0])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
def test_backward_dense_capacity_through_torch(
    monkeypatch: pytest.MonkeyPatch, gated: bool, capacity: float
):
    """An op called with torch tensors runs the capacity GEMMs through torch (mm / addmm
    with out_dtype=float32) on torch's current stream; a torch without out_dtype falls
    back to the chunk kernels for every heavy row."""
    torch = pytest.importorskip("torch")
    from twell.kernels import buffers, cublas

    m, k, n = 300, 264, 1024
    p, x, dy = _capacity_problem("nonfinite", m, k, n, seed=7)
    w = weights(p, gated)
    block = PreparedBlock(*(to_gpu(a) for a in w), Options(dense_capacity=capacity))
    xg, dyg = to_gpu(x), to_gpu(dy)
    _, saved = block.forward(xg, save=True)
    capacity_calls = _spy(monkeypatch, "_capacity_rows")
    with buffers.allocating_with(None, torch_caller=True):
        got = backward.ffn_backward(block, xg, dyg, saved, l1_coeff=1e-2)
        again = backward.ffn_backward(block, xg, dyg, saved, l1_coeff=1e-2)
    assert len(capacity_calls) == (2 if cublas._torch_has_out_dtype(torch) else 0)
    for a, b in zip(got, again, strict=True):
        if a is not None:
            assert cp.array_equal(a.view(cp.uint8), b.view(cp.uint8)), "not deterministic"
    check(got, reference.ffn_backward(x, *w, dy, 1e-2))


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
def test_backward_dense_capacity_can_be_captured(gated: bool):
    """forward(save=True) + backward captured in a CUDA graph on a CuPy stream: the
    capacity GEMMs then go through torch (CuPy refuses cuBLAS during capture); replays
    give the same bits, and the reference's gradients."""
    torch = pytest.importorskip("torch")
    from twell.kernels import buffers, cublas

    if not cublas._torch_has_out_dtype(torch):
        pytest.skip("this torch's mm has no out_dtype: the capacity rows take the chunks")
    m, k, n = 300, 264, 1024
    p, x, dy = _capacity_problem("heavy", m, k, n, seed=9)
    w = weights(p, gated)
    block = PreparedBlock(*(to_gpu(a) for a in w), Options(dense_capacity=0.05))
    xg, dyg = to_gpu(x), to_gpu(dy)
    stream = cp.cuda.Stream(non_blocking=True)
    # Warm-up through torch on this stream: kernels compiled, the stream's CuPy pool
    # filled, torch's cuBLAS handle and workspace for the stream set up before capture.
    with (
        stream,
        torch.cuda.stream(torch.cuda.ExternalStream(stream.ptr)),
        buffers.allocating_with(None, torch_caller=True),
    ):
        for _ in range(2):
            _, saved = block.forward(xg, save=True)
            backward.ffn_backward(block, xg, dyg, saved, l1_coeff=1e-2)
    with stream:
        stream.synchronize()
        stream.begin_capture()
        _, saved = block.forward(xg, save=True)
        got = backward.ffn_backward(block, xg, dyg, saved, l1_coeff=1e-2)
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
        # To the host: a device copy could take the pool blocks the graph's scratch had.
        first = [None if g is None else as_host(g).copy() for g in got]
        graph.launch(stream)
        stream.synchronize()
    for a, b in zip(got, first, strict=True):
        if a is not None:
            assert np.array_equal(as_host(a).view(np.uint8), b.view(np.uint8)), "replays differ"
    check(got, reference.ffn_backward(x, *w, dy, 1e-2))


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
def test_backward_folded_capacity_rows_match_the_capacity_gemms(
    monkeypatch: pytest.MonkeyPatch, gated: bool
):
    """At the paper's width (K=2048, N=5632) with 1% heavy tokens ×3 and dense_capacity 1/64:
    the capacity rows' weight gradients summed by the weight-gradient kernel (FOLD_ROWS)
    match cuBLAS's GEMMs (written first, beta = 0) to fp32 rounding, dx keeps its bits
    (the same GEMMs make it), the folded path is taken (no weight-gradient GEMM), and
    reruns give the same bits."""
    from twell.kernels import cublas

    m, k, n = 2048, 2048, 5632
    p = workloads.heavy(m, k, n, frac=0.01, seed=31)  # ~20 heavy rows, capacity 32
    x, dy = p.x, upstream(m, k, 32)
    w = weights(p, gated)
    block = PreparedBlock(*(to_gpu(a) for a in w), Options(dense_capacity=1 / 64))
    assert 0 < block.options.capacity_rows(m) <= backward.FOLD_ROWS
    xg, dyg = to_gpu(x), to_gpu(dy)
    _, saved = block.forward(xg, save=True)
    rows = int(saved.count[0])
    assert 0 < rows <= block.options.capacity_rows(m), rows
    weight_gemms: list[bool] = []  # accumulate flag of each weight-gradient GEMM
    gemm = cublas.gemm_f32

    def spy(*args: object, accumulate: bool = False, **kwargs: object) -> object:
        if kwargs.get("transpose_a", False):
            weight_gemms.append(accumulate)
        return gemm(*args, accumulate=accumulate, **kwargs)

    monkeypatch.setattr(backward, "gemm_f32", spy)
    folded = backward.ffn_backward(block, xg, dyg, saved)
    again = backward.ffn_backward(block, xg, dyg, saved)
    assert not weight_gemms, "a weight-gradient GEMM ran for folded rows"
    monkeypatch.setattr(backward, "FOLD_ROWS", 0)
    gemms = backward.ffn_backward(block, xg, dyg, saved)
    assert weight_gemms == [False] * (3 if gated else 2)  # beta = 0: written first
    assert cp.array_equal(folded[0].view(cp.uint16), gemms[0].view(cp.uint16)), "dx changed"
    for a, b, c in zip(folded[1:], again[1:], gemms[1:], strict=True):
        if a is None:
            continue
        assert cp.array_equal(a.view(cp.uint8), b.view(cp.uint8)), "not deterministic"
        scale = float(cp.abs(c).max())
        assert float(cp.abs(a - c).max()) <= 1e-5 * scale, "folded rows differ from cuBLAS"
