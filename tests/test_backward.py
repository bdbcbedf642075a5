"""Backward of the FFN block, the L1 penalty and the L0 statistic (twell.reference)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from twell import Hybrid, TwELL, reference
from twell.reference.forward import relu
from twell.testing import relative_error
from twell.testing import strategies as tst


def close(actual, expected, tol):
    if expected is None:
        assert actual is None
        return
    assert actual.shape == expected.shape
    error = relative_error(actual, expected)
    assert error <= tol, f"relative error {error:.2e} > {tol:.0e}"


def hidden(x, w_gate, w_up):
    """``h`` of the block in float64 (``x`` is 2-D)."""
    if w_gate is None:
        return relu(x @ w_up.T)
    return relu(x @ w_gate.T) * (x @ w_up.T)


def penalty(h, reduction):
    total = np.abs(h).sum()
    return total / h.size if reduction == "mean" else total / h.shape[0]


def loss(x, w_gate, w_up, w_down, dy, l1_coeff, reduction):
    """``<dy, y> + l1_coeff · R(h)`` in float64, the function ffn_backward differentiates."""
    h = hidden(x, w_gate, w_up)
    return float((dy * (h @ w_down.T)).sum() + l1_coeff * penalty(h, reduction))


# ------------------------------------------------------------------ against torch autograd
def torch_gradients(x, w_gate, w_up, w_down, dy, l1_coeff, reduction):
    torch = pytest.importorskip("torch")

    def leaf(a):
        if a is None:
            return None
        return torch.tensor(np.asarray(a, np.float64), requires_grad=True)

    tx, tg, tu, td = (leaf(a) for a in (x, w_gate, w_up, w_down))
    flat = tx.reshape(-1, tx.shape[-1])
    if tg is None:
        h = torch.relu(flat @ tu.T)
    else:
        h = torch.relu(flat @ tg.T) * (flat @ tu.T)
    y = (h @ td.T).reshape(tx.shape)
    total = h.abs().sum()
    reg = total / h.numel() if reduction == "mean" else total / h.shape[0]
    (torch.tensor(dy) * y).sum().add(l1_coeff * reg).backward()
    return tuple(None if t is None else t.grad.numpy() for t in (tx, tg, tu, td))


@settings(deadline=None)  # the first call imports torch
@given(
    problem=tst.ffn_problems(),
    l1_coeff=st.sampled_from([0.0, 0.5, 3.0]),
    reduction=st.sampled_from(["mean", "per_token"]),
    batched=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_ffn_backward_matches_torch_autograd(problem, l1_coeff, reduction, batched, seed):
    pytest.importorskip("torch")
    x, w_gate, w_up, w_down = problem
    if batched and x.shape[0] % 2 == 0:
        x = x.reshape(2, x.shape[0] // 2, x.shape[1])
    dy = np.random.default_rng(seed).standard_normal(x.shape)
    ours = reference.ffn_backward(x, w_gate, w_up, w_down, dy, l1_coeff, reduction=reduction)
    theirs = torch_gradients(x, w_gate, w_up, w_down, dy, l1_coeff, reduction)
    assert ours[0].shape == x.shape
    if w_gate is None:
        assert ours[1] is None
    for name, a, b in zip(("dx", "dw_gate", "dw_up", "dw_down"), ours, theirs, strict=True):
        assert a is None or a.dtype == np.float64, name
        close(a, b, 1e-10)


def test_ffn_backward_handles_nonfinite_inputs_like_torch():
    """Non-finite inputs take the dense path; NaN lands where autograd puts it."""
    pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 6))
    x[2, 3] = np.nan
    w_gate, w_up = rng.standard_normal((32, 6)), rng.standard_normal((32, 6))
    w_down, dy = rng.standard_normal((6, 32)), rng.standard_normal((4, 6))
    with np.errstate(invalid="ignore"):
        ours = reference.ffn_backward(x, w_gate, w_up, w_down, dy, 0.5)
    theirs = torch_gradients(x, w_gate, w_up, w_down, dy, 0.5, "mean")
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
        np.testing.assert_allclose(a[~np.isnan(a)], b[~np.isnan(b)], rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------ finite differences
def tiny_problem(gated: bool):
    """A tiny problem whose pre-activations and active h stay far from 0 (no kinks)."""
    for seed in range(1000):
        rng = np.random.default_rng(seed)
        x = rng.standard_normal((3, 4))
        w_gate = rng.standard_normal((32, 4)) if gated else None
        w_up, w_down = rng.standard_normal((32, 4)), rng.standard_normal((4, 32))
        a = x @ (w_gate if gated else w_up).T
        u = x @ w_up.T
        if np.abs(a).min() > 1e-2 and (not gated or np.abs(u[a > 0]).min() > 1e-2):
            return x, w_gate, w_up, w_down, rng.standard_normal((3, 4))
    raise AssertionError("no kink-free problem found")


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize(
    ("l1_coeff", "reduction"), [(0.0, "mean"), (2.0, "mean"), (0.5, "per_token")]
)
def test_ffn_backward_matches_finite_differences(gated, l1_coeff, reduction):
    x, w_gate, w_up, w_down, dy = tiny_problem(gated)
    grads = reference.ffn_backward(x, w_gate, w_up, w_down, dy, l1_coeff, reduction=reduction)
    params = [x, w_gate, w_up, w_down]
    step = 1e-6
    for index, (param, grad) in enumerate(zip(params, grads, strict=True)):
        if param is None:
            assert grad is None
            continue
        numeric = np.zeros_like(param)
        for position in np.ndindex(param.shape):
            values = []
            for sign in (1, -1):
                shifted = [p if p is None else p.copy() for p in params]
                shifted[index][position] += sign * step
                values.append(loss(*shifted, dy, l1_coeff, reduction))
            numeric[position] = (values[0] - values[1]) / (2 * step)
        close(grad, numeric, 1e-6)


def test_ffn_backward_rejects_an_unknown_reduction():
    x, w_gate, w_up, w_down, dy = tiny_problem(True)
    with pytest.raises(ValueError, match="reduction: expected one of"):
        reference.ffn_backward(x, w_gate, w_up, w_down, dy, 1.0, reduction="sum")
    with pytest.raises(ValueError, match="reduction"):
        reference.l1_loss(x, "sum")


# ------------------------------------------------------------------ L1 and L0
@given(tst.packing_problems(allow_negative=True))
def test_l1_loss_and_l0_agree_across_dense_twell_and_hybrid(problem):
    h, tile, slots = problem
    rows, columns = h.shape
    total = np.abs(h.astype(np.float64)).sum()
    hybrid = Hybrid.from_dense(h, tile, slots)
    forms = [h, hybrid]
    if not hybrid.overflow_rows().size:
        forms.append(TwELL.from_dense(h, tile, slots))
    for form in forms:
        close(np.float64(reference.l1_loss(form)), total / (rows * columns), 1e-12)
        close(np.float64(reference.l1_loss(form, "per_token")), total / rows, 1e-12)
        assert reference.l0(form) == np.count_nonzero(h) / rows


@given(tst.activations(rows=6, tile=32, slots=4))
def test_l1_loss_and_l0_count_tokens_over_batch_dimensions(h):
    """For ``[B, S, N]`` activations a token is one of the B·S rows."""
    batched = h.reshape(2, 3, h.shape[1])
    assert reference.l1_loss(batched) == pytest.approx(reference.l1_loss(h), rel=1e-12)
    assert reference.l1_loss(batched, "per_token") == pytest.approx(
        reference.l1_loss(h, "per_token"), rel=1e-12
    )
    assert reference.l0(batched) == reference.l0(h)


def test_the_gpu_backwards_out_is_checked():
    """kernels.backward's ``out`` (the training graphs hand their results over through
    it): bf16 x and gradients only, the results' shapes, C-contiguous and 16-byte
    aligned, dw_gate None exactly for the non-gated block."""
    from ml_dtypes import bfloat16

    from twell.kernels import backward

    m, n, k = 6, 512, 16
    x = np.zeros((m, k), bfloat16)

    def arrays(*shapes):
        return tuple(None if s is None else np.zeros(s, bfloat16) for s in shapes)

    good = arrays((m, k), (n, k), (n, k), (k, n))
    backward._check_out(good, x, np.dtype(bfloat16), m, n, k, gated=True)
    backward._check_out(arrays((m, k), None, (n, k), (k, n)), x, np.dtype(bfloat16), m, n, k,
                        gated=False)  # fmt: skip
    with pytest.raises(TypeError, match="bf16"):
        backward._check_out(good, x.astype(np.float32), np.dtype(bfloat16), m, n, k, True)
    with pytest.raises(TypeError, match="bf16"):
        backward._check_out(good, x, np.dtype(np.float32), m, n, k, True)
    with pytest.raises(ValueError, match="dw_gate None"):
        backward._check_out(good, x, np.dtype(bfloat16), m, n, k, gated=False)
    with pytest.raises(ValueError, match="dw_down must be"):
        backward._check_out(arrays((m, k), (n, k), (n, k), (n, k)), x, np.dtype(bfloat16),
                            m, n, k, True)  # fmt: skip
    with pytest.raises(ValueError, match="dx must be"):
        backward._check_out((np.zeros((k, m), bfloat16).T, *good[1:]), x, np.dtype(bfloat16),
                            m, n, k, True)  # fmt: skip
    raw = np.zeros(m * k + 8, bfloat16)
    start = (-raw.ctypes.data // 2) % 8 + 1  # 2 bytes past a 16-byte boundary
    shifted = raw[start : start + m * k].reshape(m, k)
    assert shifted.ctypes.data % 16 == 2
    with pytest.raises(ValueError, match="aligned"):
        backward._check_out((shifted, *good[1:]), x, np.dtype(bfloat16), m, n, k, True)
