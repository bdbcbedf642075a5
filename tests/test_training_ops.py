"""The training ops ``twell::ffn_train_forward`` / ``twell::ffn_train_backward`` on the CPU
(twell.autograd): registration (``torch.library.opcheck``), argument checks, and
gradients against torch autograd of the dense block. On CUDA: tests/gpu/test_gpu_training_ops.py.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch_helpers import LlamaMLP, op_args  # noqa: E402

from twell.autograd import ffn_train_backward, ffn_train_forward  # noqa: E402
from twell.torch import SparseMLP  # noqa: E402


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_opcheck_forward_and_backward(dtype: torch.dtype, gated: bool) -> None:
    from twell.capacity import AUTO

    x, w_gate, w_up, w_down = op_args(dtype, gated)
    settings = (64, 16, -1, 0.0)
    torch.library.opcheck(ffn_train_forward, (x, w_gate, w_up, w_down, *settings, "mean"))
    # "auto", as compiled code passes it (the reference takes no capacity)
    auto = (64, 16, -1, AUTO)
    torch.library.opcheck(ffn_train_forward, (x, w_gate, w_up, w_down, *auto, "mean"))
    with torch.no_grad():
        y, l1, packed, heavy, ids, count, up = ffn_train_forward(
            x, w_gate, w_up, w_down, *settings, "per_token"
        )
    assert packed.dtype == torch.int32 and packed.shape == (40, 256 // 64 * 16)
    assert heavy.dtype == torch.uint8 and ids.shape == (40,) and count.shape == (1,)
    assert l1.dtype == torch.float32 and l1.shape == ()
    # the backward's row capacity: max_row_nnz's default for N=256, 16 (gated only)
    assert up.dtype == torch.float32 and up.shape == (40, 16 if gated else 0)
    detached = [None if w is None else w.detach() for w in (x, w_gate, w_up, w_down)]
    dy = torch.randn_like(y)
    for dl1 in (torch.tensor(0.25), None):
        torch.library.opcheck(
            ffn_train_backward,
            (dy, dl1, *detached, packed, heavy, ids, count, up, *settings, "per_token"),
        )
    torch.library.opcheck(
        ffn_train_backward,
        (None, torch.tensor(2.0), *detached, packed, heavy, ids, count, up, *settings, "mean"),
    )


def test_ops_reject_bad_arguments() -> None:
    x, w_gate, w_up, w_down = (t.detach() for t in op_args(torch.float32, True))
    with pytest.raises(ValueError, match="reduction"):
        ffn_train_forward(x, w_gate, w_up, w_down, 64, 16, -1, 0.0, "sum")
    with pytest.raises(ValueError, match="w_down: expected shape"):
        ffn_train_forward(x, w_gate, w_up, w_down.T, 64, 16, -1, 0.0, "mean")
    with pytest.raises(ValueError, match="tile"):
        ffn_train_forward(x, w_gate, w_up, w_down, 48, 16, -1, 0.0, "mean")
    with pytest.raises(ValueError, match="reduction"):
        SparseMLP.from_module(LlamaMLP(32, 256), reduction="sum")


@pytest.mark.parametrize("reduction", ["mean", "per_token"])
def test_nongated_op_gradients_match_dense_autograd(reduction: str) -> None:
    x, _, w_up, w_down = op_args(torch.float64, False, m=64, k=32, n=128)
    y, l1, *_ = ffn_train_forward(x, None, w_up, w_down, 32, 8, -1, 0.0, reduction)
    dy = torch.randn_like(y)
    ((y * dy).sum() + 0.5 * l1).backward()
    got = [t.grad.clone() for t in (x, w_up, w_down)]
    for t in (x, w_up, w_down):
        t.grad = None
    h = torch.relu(x @ w_up.T)
    l1_dense = h.abs().sum() / (h.numel() if reduction == "mean" else h.shape[0])
    ((h @ w_down.T * dy).sum() + 0.5 * l1_dense).backward()
    torch.testing.assert_close(l1.double(), l1_dense.detach(), rtol=1e-6, atol=0)
    for g, t in zip(got, (x, w_up, w_down), strict=True):
        torch.testing.assert_close(g, t.grad, rtol=1e-9, atol=1e-12)


def test_training_block_is_a_prepared_block_without_the_host_check() -> None:
    """The training step's block skips the weights' host check (no synchronisation): its
    finiteness is unknown, which makes the backward check the weights on the device."""
    import inspect

    from twell.autograd import _training_block

    source = inspect.getsource(_training_block)
    assert "check_weights=False" in source


def test_settings_spell_out_in_the_order_of_the_op_schemas() -> None:
    """One TrainSettings carries the ops' settings; its fields are the schemas' arguments
    after the tensors, in order, and the op graphs find the dense capacity by position."""
    import dataclasses

    from twell import autograd
    from twell.autograd import TrainSettings
    from twell.capacity import AUTO, for_weights
    from twell.options import Options

    options = Options(64, 16, max_row_nnz=5, dense_capacity=0.25)
    settings = TrainSettings.of(options, "per_token", graphs=True)
    assert settings.op_args() == (64, 16, 5, 0.25, "per_token", True)
    assert settings.launch_args() == settings.op_args()[:-1]
    assert TrainSettings.from_op(settings.op_args()) == settings
    assert TrainSettings.from_op(settings.launch_args()).graphs is False
    assert settings.options() == dataclasses.replace(options, density_switch=False)
    auto = TrainSettings.of(Options(dense_capacity="auto"), "mean")
    assert (auto.max_row_nnz, auto.dense_capacity, auto.graphs) == (-1, AUTO, False)
    assert auto.options().max_row_nnz is None and auto.options().auto_capacity
    w_up = torch.zeros(8, 4)  # the backward's view: the capacity in force (a CPU test)
    assert settings.resolved(w_up, choose=False) == (settings, None)
    for_weights(w_up).fraction = 0.25
    resolved, layer = auto.resolved(w_up, choose=False)
    assert layer is for_weights(w_up) and resolved.dense_capacity == 0.25
    assert resolved == dataclasses.replace(auto, dense_capacity=0.25)
    fields = [f.name for f in dataclasses.fields(TrainSettings)]
    for op, tensors in ((torch.ops.twell.ffn_train_forward, 4),
                        (torch.ops.twell.ffn_train_backward, 11)):  # fmt: skip
        names = [a.name for a in op.default._schema.arguments]
        assert names[tensors:] == fields
        capacity = tensors + fields.index("dense_capacity")
        graphs = autograd._BACKWARD_GRAPHS if tensors == 11 else autograd._FORWARD_GRAPHS
        assert graphs.replace == frozenset({capacity})
    assert autograd._OP_FORWARD_GRAPHS.replace == autograd._FORWARD_GRAPHS.replace
