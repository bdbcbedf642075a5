"""twell.torch: the Llama-style MLP drop-in on the CPU (on CUDA: tests/gpu/test_gpu_torch.py)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch_helpers import LlamaMLP, mlp_from_problem  # noqa: E402

import twell  # noqa: E402
from twell import workloads  # noqa: E402
from twell.testing.asserts import relative_error  # noqa: E402
from twell.torch import SparseMLP, is_relu_mlp, sparsify  # noqa: E402


class TinyDecoder(nn.Module):
    def __init__(self, k: int, n: int, layers: int, act: type[nn.Module] = nn.ReLU) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.ModuleDict({"mlp": LlamaMLP(k, n, act())}) for _ in range(layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer["mlp"](x)
        return x


def test_sparse_mlp_matches_the_reference_block_on_cpu() -> None:
    problem = workloads.heavy(96, 128, 512, seed=3)
    mlp = SparseMLP.from_module(mlp_from_problem(problem))
    x = torch.from_numpy(problem.x.astype(np.float64)).reshape(2, 48, 128)
    with torch.no_grad():
        y = mlp(x)
    assert y.shape == (2, 48, 128)
    expected = twell.reference.ffn(*problem.arrays()).reshape(2, 48, 128)
    assert relative_error(y.numpy(), expected) < 1e-2


@pytest.mark.parametrize("train_kernels", [True, False], ids=["reference-op", "dense-torch"])
def test_sparse_mlp_gradients_on_cpu_match_the_reference(train_kernels: bool) -> None:
    # train_kernels: through twell::ffn_train_forward/backward (the NumPy reference on
    # CPU); else dense torch math. Both give float64-exact gradients.
    problem = workloads.uniform(16, 64, 256, seed=1)
    mlp = mlp_from_problem(problem)
    sparse = SparseMLP.from_module(mlp, train_kernels=train_kernels)
    x = torch.from_numpy(problem.x.astype(np.float64)).requires_grad_()
    dy = torch.ones(16, 64, dtype=torch.float64)
    sparse(x).backward(dy)
    dx, dwg, dwu, dwd = twell.reference.ffn_backward(*problem.arrays(), dy.numpy())
    np.testing.assert_allclose(x.grad.numpy(), dx, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(mlp.gate_proj.weight.grad.numpy(), dwg, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(mlp.up_proj.weight.grad.numpy(), dwu, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(mlp.down_proj.weight.grad.numpy(), dwd, rtol=1e-9, atol=1e-12)


def test_sparse_mlp_shares_parameters() -> None:
    mlp = LlamaMLP(32, 256, nn.ReLU())
    sparse = SparseMLP.from_module(mlp)
    assert sparse.gate_proj.weight is mlp.gate_proj.weight
    assert sum(p.numel() for p in sparse.parameters()) == 3 * 32 * 256


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.complex64, torch.float8_e4m3fn])
@pytest.mark.parametrize("grad", [True, False], ids=["training", "inference"])
def test_sparse_mlp_refuses_a_non_floating_input(dtype: torch.dtype, grad: bool) -> None:
    """An integer, bool or complex x is a TypeError naming x, in training and inference
    calls alike (the CPU reference would otherwise compute in float64 and cast the result
    back: zeros for integers, silently)."""
    mlp = SparseMLP.from_module(LlamaMLP(64, 256))
    x = torch.ones(2, 64, dtype=dtype)
    with (
        torch.set_grad_enabled(grad),
        pytest.raises(TypeError, match="x: expected a floating dtype"),
    ):
        mlp(x)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.set_grad_enabled(grad):
        with pytest.raises(TypeError, match="x: expected a floating dtype"):  # refused, not cast
            mlp(x)


def test_sparse_mlp_compiles_whole_under_autocast_without_warnings() -> None:
    """The autocast branch's dtype check is traced by dynamo: fullgraph, no warning (a
    cached helper there made dynamo warn), and the gradients flow."""
    mlp = SparseMLP.from_module(LlamaMLP(64, 256))
    compiled = torch.compile(mlp, fullgraph=True, backend="eager")
    x = torch.randn(8, 64, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = compiled(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_from_module_rejects_other_activations_and_biases() -> None:
    with pytest.raises(ValueError, match="act_fn ReLU"):
        SparseMLP.from_module(LlamaMLP(32, 256, nn.SiLU()))
    biased = LlamaMLP(32, 256, nn.ReLU())
    biased.up_proj = nn.Linear(32, 256, bias=True)
    assert not is_relu_mlp(biased)
    with pytest.raises(ValueError, match="up_proj: .*bias"):
        SparseMLP(biased.gate_proj, biased.up_proj, biased.down_proj)
    with pytest.raises(TypeError, match="down_proj: expected an nn.Linear"):
        SparseMLP(biased.gate_proj, biased.gate_proj, nn.Identity())
    with pytest.raises(ValueError, match="N=200 is not a multiple of tile=256"):
        SparseMLP(nn.Linear(32, 200, bias=False), nn.Linear(32, 200, bias=False),
                  nn.Linear(200, 32, bias=False))  # fmt: skip
    with pytest.raises(ValueError, match="down_proj \\[K, N\\]"):
        SparseMLP(nn.Linear(32, 256, bias=False), nn.Linear(32, 256, bias=False),
                  nn.Linear(256, 64, bias=False))  # fmt: skip
    relu_mlp = LlamaMLP(32, 256, nn.ReLU())
    with pytest.raises(ValueError, match="dense_capacity: expected a fraction"):
        SparseMLP.from_module(relu_mlp, dense_capacity=2.0)
    assert SparseMLP.from_module(relu_mlp, dense_capacity=0.1).options.dense_capacity == 0.1
    with pytest.raises(
        ValueError, match="dense_capacity: expected a fraction in \\[0, 1\\] or 'auto'"
    ):
        SparseMLP.from_module(relu_mlp, dense_capacity="dense")
    assert SparseMLP.from_module(relu_mlp)._auto is not None  # "auto" is the default
    assert SparseMLP.from_module(relu_mlp, dense_capacity=0.0)._auto is None


def test_sparsify_replaces_relu_mlps_only_and_keeps_outputs() -> None:
    torch.manual_seed(0)
    model = TinyDecoder(64, 256, layers=3)
    other = TinyDecoder(64, 256, layers=2, act=nn.SiLU)
    x = torch.randn(5, 64)
    with torch.no_grad():
        before = model(x)
    assert sparsify(model) == 3
    assert all(isinstance(layer["mlp"], SparseMLP) for layer in model.layers)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # idempotent, and no warning: its MLPs are sparse
        assert sparsify(model) == 0
    with pytest.warns(UserWarning, match="2 MLP.*activation other than ReLU.*hidden_act='relu'"):
        assert sparsify(other) == 0
    with pytest.warns(UserWarning, match="no module has gate_proj"):
        assert sparsify(nn.Linear(4, 4)) == 0
    with pytest.warns(UserWarning, match="itself a ReLU MLP.*SparseMLP.from_module"):
        assert sparsify(LlamaMLP(64, 256, nn.ReLU())) == 0
    with torch.no_grad():
        after = model(x)
    # On the CPU the sparse layers run twell's reference, whose gate values are bf16 (as
    # TwELL stores them): the dense float32 model's output within that rounding.
    assert float((after - before).norm() / before.norm()) < 1e-2


def test_sparsify_names_the_layer_that_does_not_fit_and_changes_nothing() -> None:
    model = TinyDecoder(64, 256, layers=2)
    model.layers[1]["mlp"] = LlamaMLP(64, 384, nn.ReLU())  # N=384: no multiple of 256
    with pytest.raises(ValueError, match=r"sparsify: building layers\.1\.mlp: .*N=384 .*tile=256"):
        sparsify(model)
    assert not any(isinstance(m, SparseMLP) for m in model.modules())
    assert sparsify(model, tile=128) == 2


def test_sparsify_gives_its_options_to_every_layer_and_refuses_others() -> None:
    with pytest.raises(TypeError, match="unexpected option.*tiles"):
        sparsify(TinyDecoder(64, 256, layers=0), tiles=128)  # refused with nothing to replace
    model = TinyDecoder(64, 256, layers=2)
    options = dict(tile=128, slots=16, dense_capacity=0.25, train_kernels=False,
                   reduction="per_token", op_graphs=False)  # fmt: skip
    assert sparsify(model, **options) == 2
    for layer in model.layers:
        mlp = layer["mlp"]
        assert (mlp.options.tile, mlp.options.slots, mlp.options.dense_capacity) == (128, 16, 0.25)
        assert (mlp.train_kernels, mlp.reduction, mlp.op_graphs) == (False, "per_token", False)
