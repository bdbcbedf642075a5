"""Training with twell.torch.SparseMLP on the CPU (the ops run the NumPy reference):
gradients (with and without the L1 term, both reductions) match torch autograd of the
dense Llama MLP; the L1 and L0 statistics; ``torch.compile(fullgraph=True)``; the state
dict keeps its keys; the backward keeps no dense ``[M, N]`` tensor; bench/train_small.py
and bench/train_distributed.py run. On CUDA: tests/gpu/test_gpu_training_model.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch_helpers import Decoder, LlamaMLP, grads, mlp_from_problem  # noqa: E402

import twell.torch as twell_torch  # noqa: E402
from twell import reference, workloads  # noqa: E402
from twell.testing.asserts import relative_error  # noqa: E402
from twell.torch import SparseMLP, l0_per_layer, l1_penalty, sparsify  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _dense_l1(mlp: LlamaMLP, x: torch.Tensor, reduction: str) -> torch.Tensor:
    h = torch.relu(mlp.gate_proj(x)) * mlp.up_proj(x)
    m = h.numel() // h.shape[-1]
    total = h.abs().sum()
    return total / (m * h.shape[-1]) if reduction == "mean" else total / m


@pytest.mark.parametrize(
    ("coeff", "reduction"), [(0.0, "mean"), (3000.0, "mean"), (10.0, "per_token")],
    ids=["no-l1", "l1-mean", "l1-per-token"],
)  # fmt: skip
@pytest.mark.parametrize("workload", ["uniform", "heavy"])
def test_sparse_mlp_gradients_match_dense_autograd(
    workload: str, coeff: float, reduction: str
) -> None:
    problem = workloads.make(workload, 96, 64, 512, seed=4)
    dense = mlp_from_problem(problem)
    sparse = SparseMLP.from_module(mlp_from_problem(problem), reduction=reduction)
    x = torch.from_numpy(problem.x.astype(np.float64)).reshape(4, 24, 64)
    dy = torch.randn(4, 24, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    xd = x.clone().requires_grad_()
    yd = dense(xd)
    l1d = _dense_l1(dense, xd, reduction)
    ((yd * dy).sum() + coeff * l1d).backward()

    xs = x.clone().requires_grad_()
    ys = sparse(xs)
    assert ys.shape == (4, 24, 64) and sparse.l1 is not None and sparse.l1.requires_grad
    ((ys * dy).sum() + coeff * sparse.l1).backward()

    # The forward rounds the gate to bf16 where it packs it (the reference's rounding
    # points); the gradients are float64 exact.
    assert relative_error(ys.detach().numpy(), yd.detach().numpy()) < 1e-2
    torch.testing.assert_close(sparse.l1.double(), l1d.detach(), rtol=1e-6, atol=0)
    for got, want in zip(grads(sparse, xs), grads(dense, xd), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    active = (torch.from_numpy(problem.gate_preactivation()) > 0).sum().item() / 96
    assert sparse.l0.requires_grad is False
    assert float(sparse.l0) == pytest.approx(active, abs=0.5)


def test_only_the_l1_term_or_only_y_can_carry_the_gradient() -> None:
    problem = workloads.uniform(32, 32, 256, seed=2)
    sparse = SparseMLP.from_module(mlp_from_problem(problem))
    dense = mlp_from_problem(problem)
    x = torch.from_numpy(problem.x.astype(np.float64)).requires_grad_()
    sparse(x)
    sparse.l1.backward()  # y unused
    xd = x.detach().clone().requires_grad_()
    _dense_l1(dense, xd, "mean").backward()
    for got, want in zip(grads(sparse, x), grads(dense, xd), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-15)


def test_dense_training_path_defines_the_same_l1_and_l0() -> None:
    problem = workloads.heavy(64, 64, 256, seed=7)
    kernels = SparseMLP.from_module(mlp_from_problem(problem), reduction="per_token")
    dense = SparseMLP.from_module(
        mlp_from_problem(problem), reduction="per_token", train_kernels=False
    )
    x = torch.from_numpy(problem.x.astype(np.float64)).requires_grad_()
    kernels(x), dense(x)
    torch.testing.assert_close(kernels.l1.double(), dense.l1.double(), rtol=1e-6, atol=0)
    assert float(kernels.l0) == pytest.approx(float(dense.l0), abs=0.5)


def test_autocast_bf16_with_fp32_master_weights_on_cpu() -> None:
    problem = workloads.uniform(64, 64, 256, seed=3)
    sparse = SparseMLP.from_module(mlp_from_problem(problem, torch.float32))
    x = torch.from_numpy(problem.x.astype(np.float32)).requires_grad_()
    dy = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = sparse(x)
        assert y.dtype == torch.bfloat16
        (y.float() * dy).sum().backward()
    assert all(p.grad.dtype == torch.float32 for p in sparse.parameters())
    assert x.grad.dtype == torch.float32
    # Oracle: the same block on the bf16-rounded input, fp32 weights.
    xb = x.detach().to(torch.bfloat16).double().numpy()
    wg, wu, wd = (p.detach().double().numpy() for p in sparse.parameters())
    dx, dwg, dwu, dwd = reference.ffn_backward(xb, wg, wu, wd, dy.double().numpy())
    for got, want in zip(grads(sparse, x), (dx, dwg, dwu, dwd), strict=True):
        assert relative_error(got.double().numpy(), want) < 2e-2


def test_inference_path_runs_the_reference_and_clears_the_statistics() -> None:
    problem = workloads.heavy(48, 64, 256, seed=3)
    mlp = mlp_from_problem(problem)
    sparse = SparseMLP.from_module(mlp)
    x = torch.from_numpy(problem.x.astype(np.float64))
    sparse(x.requires_grad_())
    assert sparse.l1 is not None
    with torch.no_grad():
        y = sparse(x)
    want = reference.ffn(*(np.asarray(a, np.float64) for a in
                           (problem.x, problem.w_gate, problem.w_up, problem.w_down)))  # fmt: skip
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-12, atol=1e-12)  # the CPU op's oracle
    assert sparse.l1 is None and sparse.l0 is None


def test_l1_is_detached_once_the_backward_has_passed_the_layer() -> None:
    """After the backward, ``mlp.l1`` holds the value without the step's autograd graph
    (which would otherwise live on until the next forward, with the parameters'
    gradient accumulators and their CUDA streams)."""
    import gc
    import weakref

    problem = workloads.uniform(40, 64, 256, seed=4)
    sparse = SparseMLP.from_module(mlp_from_problem(problem))
    x = torch.from_numpy(problem.x.astype(np.float64)).requires_grad_()
    y = sparse(x)
    term = sparse.l1
    assert term.requires_grad
    value = float(term.detach())
    (y.sum() + 0.5 * term).backward()
    assert not sparse.l1.requires_grad and float(sparse.l1) == value
    assert sparse.l1 is not term
    graph_term = weakref.ref(term)
    del term, y
    gc.collect()
    assert graph_term() is None  # nothing in the module keeps the graph's output alive


def test_l1_stays_differentiable_until_its_own_layer_is_reached() -> None:
    """A second forward before the backward keeps the new term attached (the first
    step's hook only replaces its own term); a backward of the L1 term alone detaches it."""
    problem = workloads.uniform(24, 64, 256, seed=5)
    sparse = SparseMLP.from_module(mlp_from_problem(problem))
    x = torch.from_numpy(problem.x.astype(np.float64)).requires_grad_()
    y1 = sparse(x)
    first = sparse.l1
    y2 = sparse(x * 2)
    second = sparse.l1
    y1.sum().backward()  # reaches the first forward's output only
    assert sparse.l1 is second and second.requires_grad
    second.backward()  # the L1 term alone (y2 gets no gradient)
    assert not sparse.l1.requires_grad and float(sparse.l1) == float(second.detach())
    assert first.requires_grad and y2.requires_grad


def test_empty_batch_trains_to_zero_gradients() -> None:
    sparse = SparseMLP.from_module(LlamaMLP(32, 256))
    x = torch.randn(3, 0, 32, requires_grad=True)
    y = sparse(x)
    assert y.shape == (3, 0, 32)
    (y.sum() + sparse.l1).backward()
    assert float(sparse.l1.detach()) == 0.0 and float(sparse.l0) == 0.0
    assert x.grad.shape == x.shape and not sparse.gate_proj.weight.grad.any()


def test_backward_keeps_no_dense_hidden_activation() -> None:
    m, k, n = 512, 64, 512
    problem = workloads.uniform(m, k, n, seed=9)
    sparse = SparseMLP.from_module(mlp_from_problem(problem, torch.float32))
    x = torch.from_numpy(problem.x.astype(np.float32)).requires_grad_()
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = sparse(x)
    assert saved, "the op saved nothing"
    assert max(t.numel() for t in saved) < m * n // 4, [tuple(t.shape) for t in saved]
    (y.sum() + sparse.l1).backward()


def test_state_dict_round_trip_keeps_names_and_layouts() -> None:
    torch.manual_seed(0)
    dense = Decoder(32, 256, layers=2)
    keys = {name: tuple(t.shape) for name, t in dense.state_dict().items()}
    sparse = Decoder(32, 256, layers=2)
    assert sparsify(sparse, reduction="per_token") == 2
    assert {name: tuple(t.shape) for name, t in sparse.state_dict().items()} == keys
    sparse.load_state_dict(dense.state_dict())
    x = torch.randn(6, 32)
    with torch.no_grad():
        got, want = sparse(x), dense(x)  # the CPU reference: bf16 gate values
        assert float((got - want).norm() / want.norm()) < 1e-2
    back = Decoder(32, 256, layers=2)
    back.load_state_dict(sparse.state_dict())
    for a, b in zip(back.parameters(), dense.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_l1_penalty_and_l0_per_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(twell_torch, "_warned_no_l1", [False])
    torch.manual_seed(1)
    model = Decoder(32, 256, layers=3)
    sparsify(model)
    with pytest.warns(UserWarning, match="no L1 term"):  # before the training forward
        assert l1_penalty(model) == 0.0
    assert l0_per_layer(model) == []
    twell_torch._warned_no_l1[0] = False  # (so that a warning here would show)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # an evaluation: 0.0 without a word
        assert l1_penalty(model) == 0.0
    x = torch.randn(2, 5, 32)
    model(x).sum().backward()
    terms = [mlp.l1 for mlp in model.mlps]
    torch.testing.assert_close(l1_penalty(model), terms[0] + terms[1] + terms[2])
    assert len(l0_per_layer(model)) == 3 and all(0 < v <= 256 for v in l0_per_layer(model))


def test_l1_penalty_and_l0_per_layer_refuse_a_model_with_no_sparse_mlp() -> None:
    model = Decoder(32, 256, layers=2)  # never sparsified: a penalty of 0.0 would drop L1
    for fn in (l1_penalty, l0_per_layer):
        with pytest.raises(ValueError, match="holds no SparseMLP"):
            fn(model)
        with pytest.raises(TypeError, match="expected a torch.nn.Module"):
            fn([model])


def test_sparse_mlp_refuses_a_non_tensor_input_and_names_a_tile_that_fits() -> None:
    model = Decoder(32, 256, layers=1)
    sparsify(model)
    with pytest.raises(TypeError, match="x: expected a torch.Tensor, got list"):
        model.mlps[0]([[1.0] * 32])
    with pytest.raises(ValueError, match=r"N=200 .*; no tile of at least slots=32"):
        sparsify(Decoder(32, 200, layers=1))
    with pytest.raises(ValueError, match=r"N=320 is not a multiple of tile=256; tile=64 fits"):
        sparsify(Decoder(32, 320, layers=1))
    with pytest.raises(ValueError, match=r"N=320 .*; no tile of at least slots=128 divides"):
        sparsify(Decoder(32, 320, layers=1), slots=128)


def test_l1_penalty_with_no_term_compiles_fullgraph(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(twell_torch, "_warned_no_l1", [False])
    model = Decoder(32, 256, layers=1)
    sparsify(model)
    for p in model.parameters():
        p.requires_grad_(False)  # frozen layers: their forward leaves no L1 term

    def step(x: torch.Tensor) -> torch.Tensor:
        return model(x).sum() + l1_penalty(model)

    compiled = torch.compile(step, backend="eager", fullgraph=True)
    x = torch.randn(2, 3, 32)
    torch.testing.assert_close(compiled(x), model(x).sum())


def test_torch_compile_fullgraph_matches_eager_on_cpu() -> None:
    torch.manual_seed(2)
    eager = Decoder(64, 256, layers=2).double()
    sparsify(eager, reduction="per_token")
    compiled_model = Decoder(64, 256, layers=2).double()
    sparsify(compiled_model, reduction="per_token")
    compiled_model.load_state_dict(eager.state_dict())

    def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        y = model(x)
        return (y * y).mean() + 1e-3 * l1_penalty(model)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    x = torch.randn(3, 16, 64, dtype=torch.float64)
    step(eager, x).backward()
    loss = compiled(compiled_model, x)
    loss.backward()
    torch.testing.assert_close(loss, step(eager, x).detach(), rtol=1e-6, atol=1e-9)
    for a, b in zip(compiled_model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-9, atol=1e-12)
    assert compiled_model.mlps[0].l1 is not None and compiled_model.mlps[0].l0 is not None


def test_train_small_smoke(tmp_path: Path) -> None:
    out = tmp_path / "smoke.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [sys.executable, str(ROOT / "bench" / "train_small.py"), "--smoke", "--quiet",
         "--out", str(out), "--save", str(tmp_path / "model.pt")],
        check=True, cwd=ROOT, env=env, timeout=120,
    )  # fmt: skip
    report = json.loads(out.read_text())
    assert report["recipe"]["steps"] == 20 and report["recipe"]["config"]["layers"] == 2
    runs = {run["variant"]: run for run in report["runs"]}
    assert set(runs) == {"dense", "twell"}
    for run in runs.values():
        assert run["steps_done"] == 20
        assert run["train_log"][-1]["loss"] < run["train_log"][0]["loss"]
        assert np.isfinite(run["held_out_loss"]) and len(run["held_out_l0"]) == 2
    assert len(runs["twell"]["train_log"][-1]["l0"]) == 2
    saved = torch.load(tmp_path / "model.pt", weights_only=True)
    assert saved["recipe"]["seed"] == 0
    assert "layers.0.mlp.gate_proj.weight" in saved["state_dict"]


@pytest.mark.slow
def test_train_distributed_smoke_with_ddp_and_fsdp2_over_gloo(tmp_path: Path) -> None:
    """Two CPU processes (torchrun, gloo): DDP and FSDP2 around twell's SparseMLP."""
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun is not installed beside the interpreter")
    out = tmp_path / "dist.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [str(torchrun), "--standalone", "--nproc_per_node", "2",
         str(ROOT / "bench" / "train_distributed.py"), "--smoke", "--variants", "twell",
         "--steps", "4", "--baseline-steps", "2", "--quiet", "--out", str(out)],
        cwd=ROOT, env=env, timeout=240, capture_output=True, text=True,
    )  # fmt: skip
    assert run.returncode == 0, f"torchrun exited {run.returncode}:\n{run.stderr[-4000:]}"
    report = json.loads(out.read_text())
    runs = {run["strategy"]: run for run in report["runs"]}
    assert set(runs) == {"single", "ddp", "fsdp"}
    assert report["nccl_nvls_enable"] == "0"
    for strategy in ("ddp", "fsdp"):
        ranks = runs[strategy]["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1]
        assert runs[strategy]["scaling_efficiency"] > 0
        assert np.isfinite(runs[strategy]["final_mean_loss"])
        # The one-device run on the ranks' batches put together follows the same losses.
        assert runs[strategy]["loss_vs_reference"]["loss_matches"] is True
    # Same initial weights and batches: DDP and FSDP2 follow the same trajectory.
    assert runs["ddp"]["final_mean_loss"] == pytest.approx(
        runs["fsdp"]["final_mean_loss"], rel=1e-4
    )


def test_train_distributed_help() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "train_distributed.py"), "--help"],
        check=True, cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert "fsdp" in result.stdout and "ddp" in result.stdout
