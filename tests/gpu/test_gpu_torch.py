"""twell.torch on CUDA: SparseMLP runs the kernels and follows weight updates, SparseFFN
takes and returns torch tensors on the current stream, sparsify over a transformers Llama
model."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch_helpers import mlp_from_problem  # noqa: E402

import twell  # noqa: E402
from twell import workloads  # noqa: E402
from twell.testing.asserts import relative_error  # noqa: E402
from twell.torch import SparseMLP, sparsify  # noqa: E402

# Through torch's ops, whose buffers come from torch's allocator.
pytestmark = pytest.mark.unpoisoned


def test_sparse_mlp_runs_the_kernels_on_cuda_and_follows_weight_updates() -> None:
    problem = workloads.heavy(1000, 256, 1024, seed=5)
    mlp = mlp_from_problem(problem).cuda().bfloat16()
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


@pytest.mark.parametrize("grad", [True, False], ids=["training", "inference"])
def test_sparse_mlp_on_cuda_refuses_a_non_floating_input(grad: bool) -> None:
    """An integer x on CUDA: a TypeError naming x before anything launches, in training
    and inference calls alike."""
    problem = workloads.uniform(64, 256, 1024, seed=5)
    sparse = SparseMLP.from_module(mlp_from_problem(problem).cuda().bfloat16())
    x = torch.ones(64, 256, dtype=torch.int32, device="cuda")
    with (
        torch.set_grad_enabled(grad),
        pytest.raises(TypeError, match="x: expected a floating dtype"),
    ):
        sparse(x)
    torch.cuda.synchronize()  # nothing launched that could fail later


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
