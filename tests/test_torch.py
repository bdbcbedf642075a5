"""twell.torch: the Llama-style MLP drop-in (CPU parts here; the kernel path is GPU-only)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import twell  # noqa: E402
from twell import workloads  # noqa: E402
from twell.testing.asserts import relative_error  # noqa: E402
from twell.torch import SparseMLP, is_relu_mlp, sparsify  # noqa: E402


class LlamaLikeMLP(nn.Module):
    """The shape of transformers' LlamaMLP, without depending on transformers."""

    def __init__(self, k: int, n: int, act: nn.Module) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(k, n, bias=False)
        self.up_proj = nn.Linear(k, n, bias=False)
        self.down_proj = nn.Linear(n, k, bias=False)
        self.act_fn = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class TinyDecoder(nn.Module):
    def __init__(self, k: int, n: int, layers: int, act: type[nn.Module] = nn.ReLU) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.ModuleDict({"mlp": LlamaLikeMLP(k, n, act())}) for _ in range(layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer["mlp"](x)
        return x


def _mlp_from_problem(problem: workloads.Problem) -> LlamaLikeMLP:
    mlp = LlamaLikeMLP(problem.K, problem.N, nn.ReLU()).double()
    with torch.no_grad():
        for layer, weight in (
            (mlp.gate_proj, problem.w_gate),
            (mlp.up_proj, problem.w_up),
            (mlp.down_proj, problem.w_down),
        ):
            layer.weight.copy_(torch.from_numpy(weight.astype(np.float64)))
    return mlp


def test_sparse_mlp_matches_the_reference_block_on_cpu() -> None:
    problem = workloads.heavy(96, 128, 512, seed=3)
    mlp = SparseMLP.from_module(_mlp_from_problem(problem))
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
    mlp = _mlp_from_problem(problem)
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
    mlp = LlamaLikeMLP(32, 256, nn.ReLU())
    sparse = SparseMLP.from_module(mlp)
    assert sparse.gate_proj.weight is mlp.gate_proj.weight
    assert sum(p.numel() for p in sparse.parameters()) == 3 * 32 * 256


def test_from_module_rejects_other_activations_and_biases() -> None:
    with pytest.raises(ValueError, match="act_fn ReLU"):
        SparseMLP.from_module(LlamaLikeMLP(32, 256, nn.SiLU()))
    biased = LlamaLikeMLP(32, 256, nn.ReLU())
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
    relu_mlp = LlamaLikeMLP(32, 256, nn.ReLU())
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
    assert sparsify(model) == 0  # idempotent
    assert sparsify(other) == 0
    with torch.no_grad():
        after = model(x)
    # On the CPU the sparse layers run twell's reference, whose gate values are bf16 (as
    # TwELL stores them): the dense float32 model's output within that rounding.
    assert float((after - before).norm() / before.norm()) < 1e-2


def _cuda_reason() -> str | None:
    from twell.kernels.compile import unavailable_reason

    reason = unavailable_reason()
    if reason is None and not torch.cuda.is_available():
        return "torch has no CUDA device"
    return reason


needs_gpu = pytest.mark.skipif(_cuda_reason() is not None, reason=str(_cuda_reason()))


@pytest.mark.gpu
@needs_gpu
def test_sparse_mlp_runs_the_kernels_on_cuda_and_follows_weight_updates() -> None:
    problem = workloads.heavy(1000, 256, 1024, seed=5)
    mlp = _mlp_from_problem(problem).cuda().bfloat16()
    sparse = SparseMLP.from_module(mlp)
    x = torch.from_numpy(problem.x.astype(np.float32)).cuda().bfloat16()
    with torch.inference_mode():
        y = sparse(x)
        assert y.dtype == torch.bfloat16 and y.is_cuda and y.shape == x.shape
        expected = twell.reference.ffn(*problem.arrays())
        assert relative_error(y.float().cpu().numpy(), expected) < 1e-2
        block = sparse.prepared()
        assert sparse.prepared() is block  # cached while the weights are unchanged
        mlp.down_proj.weight.mul_(2)
        y2 = sparse(x)
        assert sparse.prepared() is not block  # rebuilt after the in-place change
    assert relative_error(y2.float().cpu().numpy(), 2 * expected) < 1e-2


@pytest.mark.gpu
@needs_gpu
def test_sparse_ffn_accepts_torch_and_returns_torch_on_the_current_stream() -> None:
    problem = workloads.uniform(300, 128, 512, seed=2)
    weights = [torch.from_numpy(w.astype(np.float32)).cuda().bfloat16() for w in problem.arrays()]
    x, w_gate, w_up, w_down = weights
    block = twell.SparseFFN(w_gate, w_up, w_down)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        y = block(x.reshape(3, 100, 128))
    stream.synchronize()
    assert isinstance(y, torch.Tensor) and y.shape == (3, 100, 128)
    expected = twell.reference.ffn(*problem.arrays())
    assert relative_error(y.reshape(300, 128).float().cpu().numpy(), expected) < 1e-2
    with pytest.raises(ValueError, match="x: expected shape \\[..., 128\\]"):
        block(x[:, :64])


@pytest.mark.gpu
@needs_gpu
def test_sparsify_a_transformers_llama_model() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=256, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=512, hidden_act="relu",
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).cuda().bfloat16().eval()
    ids = torch.randint(0, 512, (2, 64), device="cuda")
    with torch.inference_mode():
        dense = model(ids).logits.float()
        assert sparsify(model) == 2
        sparse = model(ids).logits.float()
    assert relative_error(sparse.cpu().numpy(), dense.cpu().numpy()) < 2e-2
