"""Training through twell's custom ops (twell.autograd, twell.torch.SparseMLP).

CPU tests (CI): the ops pass ``torch.library.opcheck``; SparseMLP's gradients (with and
without the L1 term, both reductions) match torch autograd of the dense Llama MLP;
``torch.compile(fullgraph=True)`` works; the state dict keeps its keys; the backward keeps
no dense ``[M, N]`` tensor; bench/train_small.py --smoke runs.

GPU tests (skipped without CUDA, CuPy, or the GPU backward): gradients against the float64
reference on the heavy and paperlike workloads, bf16 autocast with fp32 master weights,
CUDA-graph capture of forward + backward, torch.compile on CUDA.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from twell import reference, workloads  # noqa: E402
from twell.autograd import ffn_train_backward, ffn_train_forward  # noqa: E402
from twell.testing.asserts import relative_error  # noqa: E402
from twell.torch import SparseMLP, l0_per_layer, l1_penalty, sparsify  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


class LlamaMLP(nn.Module):
    """The shape of transformers' LlamaMLP with ReLU."""

    def __init__(self, k: int, n: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(k, n, bias=False)
        self.up_proj = nn.Linear(k, n, bias=False)
        self.down_proj = nn.Linear(n, k, bias=False)
        self.act_fn = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Decoder(nn.Module):
    """Residual stack of norm + MLP: enough model around the MLPs for compile tests."""

    def __init__(self, k: int, n: int, layers: int) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(k) for _ in range(layers))
        self.mlps = nn.ModuleList(LlamaMLP(k, n) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for norm, mlp in zip(self.norms, self.mlps, strict=True):
            x = x + mlp(norm(x))
        return x


def _mlp(problem: workloads.Problem, dtype: torch.dtype = torch.float64) -> LlamaMLP:
    mlp = LlamaMLP(problem.K, problem.N).to(dtype)
    with torch.no_grad():
        for layer, weight in ((mlp.gate_proj, problem.w_gate), (mlp.up_proj, problem.w_up),
                              (mlp.down_proj, problem.w_down)):  # fmt: skip
            layer.weight.copy_(torch.from_numpy(weight.astype(np.float64)))
    return mlp


def _dense_l1(mlp: LlamaMLP, x: torch.Tensor, reduction: str) -> torch.Tensor:
    h = torch.relu(mlp.gate_proj(x)) * mlp.up_proj(x)
    m = h.numel() // h.shape[-1]
    total = h.abs().sum()
    return total / (m * h.shape[-1]) if reduction == "mean" else total / m


def _grads(module: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    return [x.grad] + [p.grad for p in module.parameters()]


# ---------------------------------------------------------------------- opcheck
def _op_args(dtype: torch.dtype, gated: bool, m: int = 40, k: int = 48, n: int = 256) -> tuple:
    g = torch.Generator().manual_seed(m + k + n)
    x = torch.randn(m, k, dtype=dtype, generator=g, requires_grad=True)
    w_gate = torch.randn(n, k, dtype=dtype, generator=g) / k**0.5 if gated else None
    w_up = torch.randn(n, k, dtype=dtype, generator=g) / k**0.5
    w_down = torch.randn(k, n, dtype=dtype, generator=g) / n**0.5
    weights = [None if w is None else w.requires_grad_() for w in (w_gate, w_up, w_down)]
    return (x, *weights)


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_opcheck_forward_and_backward(dtype: torch.dtype, gated: bool) -> None:
    x, w_gate, w_up, w_down = _op_args(dtype, gated)
    settings = (64, 16, -1, 0.0)
    torch.library.opcheck(ffn_train_forward, (x, w_gate, w_up, w_down, *settings, "mean"))
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
    x, w_gate, w_up, w_down = (t.detach() for t in _op_args(torch.float32, True))
    with pytest.raises(ValueError, match="reduction"):
        ffn_train_forward(x, w_gate, w_up, w_down, 64, 16, -1, 0.0, "sum")
    with pytest.raises(ValueError, match="w_down: expected shape"):
        ffn_train_forward(x, w_gate, w_up, w_down.T, 64, 16, -1, 0.0, "mean")
    with pytest.raises(ValueError, match="tile"):
        ffn_train_forward(x, w_gate, w_up, w_down, 48, 16, -1, 0.0, "mean")
    with pytest.raises(ValueError, match="reduction"):
        SparseMLP.from_module(LlamaMLP(32, 256), reduction="sum")


# ---------------------------------------------------------------------- gradients on CPU
@pytest.mark.parametrize(
    ("coeff", "reduction"), [(0.0, "mean"), (3000.0, "mean"), (10.0, "per_token")],
    ids=["no-l1", "l1-mean", "l1-per-token"],
)  # fmt: skip
@pytest.mark.parametrize("workload", ["uniform", "heavy"])
def test_sparse_mlp_gradients_match_dense_autograd(
    workload: str, coeff: float, reduction: str
) -> None:
    problem = workloads.make(workload, 96, 64, 512, seed=4)
    dense = _mlp(problem)
    sparse = SparseMLP.from_module(_mlp(problem), reduction=reduction)
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
    for got, want in zip(_grads(sparse, xs), _grads(dense, xd), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    active = (torch.from_numpy(problem.gate_preactivation()) > 0).sum().item() / 96
    assert sparse.l0.requires_grad is False
    assert float(sparse.l0) == pytest.approx(active, abs=0.5)


@pytest.mark.parametrize("reduction", ["mean", "per_token"])
def test_nongated_op_gradients_match_dense_autograd(reduction: str) -> None:
    x, _, w_up, w_down = _op_args(torch.float64, False, m=64, k=32, n=128)
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


def test_only_the_l1_term_or_only_y_can_carry_the_gradient() -> None:
    problem = workloads.uniform(32, 32, 256, seed=2)
    sparse = SparseMLP.from_module(_mlp(problem))
    dense = _mlp(problem)
    x = torch.from_numpy(problem.x.astype(np.float64)).requires_grad_()
    sparse(x)
    sparse.l1.backward()  # y unused
    xd = x.detach().clone().requires_grad_()
    _dense_l1(dense, xd, "mean").backward()
    for got, want in zip(_grads(sparse, x), _grads(dense, xd), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-15)


def test_dense_training_path_defines_the_same_l1_and_l0() -> None:
    problem = workloads.heavy(64, 64, 256, seed=7)
    kernels = SparseMLP.from_module(_mlp(problem), reduction="per_token")
    dense = SparseMLP.from_module(_mlp(problem), reduction="per_token", train_kernels=False)
    x = torch.from_numpy(problem.x.astype(np.float64)).requires_grad_()
    kernels(x), dense(x)
    torch.testing.assert_close(kernels.l1.double(), dense.l1.double(), rtol=1e-6, atol=0)
    assert float(kernels.l0) == pytest.approx(float(dense.l0), abs=0.5)


def test_autocast_bf16_with_fp32_master_weights_on_cpu() -> None:
    problem = workloads.uniform(64, 64, 256, seed=3)
    sparse = SparseMLP.from_module(_mlp(problem, torch.float32))
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
    for got, want in zip(_grads(sparse, x), (dx, dwg, dwu, dwd), strict=True):
        assert relative_error(got.double().numpy(), want) < 2e-2


def test_inference_path_runs_the_reference_and_clears_the_statistics() -> None:
    problem = workloads.heavy(48, 64, 256, seed=3)
    mlp = _mlp(problem)
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
    sparse = SparseMLP.from_module(_mlp(problem))
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
    sparse = SparseMLP.from_module(_mlp(problem))
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


# ---------------------------------------------------------------------- model level
def test_backward_keeps_no_dense_hidden_activation() -> None:
    m, k, n = 512, 64, 512
    problem = workloads.uniform(m, k, n, seed=9)
    sparse = SparseMLP.from_module(_mlp(problem, torch.float32))
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


def test_l1_penalty_and_l0_per_layer() -> None:
    torch.manual_seed(1)
    model = Decoder(32, 256, layers=3)
    sparsify(model)
    assert l1_penalty(model) == 0.0 and l0_per_layer(model) == []
    x = torch.randn(2, 5, 32)
    model(x).sum().backward()
    terms = [mlp.l1 for mlp in model.mlps]
    torch.testing.assert_close(l1_penalty(model), terms[0] + terms[1] + terms[2])
    assert len(l0_per_layer(model)) == 3 and all(0 < v <= 256 for v in l0_per_layer(model))


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


def test_auto_capacity_covers_the_last_count_with_headroom() -> None:
    from twell.options import AUTO_CAPACITIES, auto_capacity

    m = 16384
    assert auto_capacity(0, m) == 0.0
    assert auto_capacity(1, m) == 1 / 64
    assert auto_capacity(164, m) == 1 / 64  # heavy 1%: 256 rows hold 1.25 x 164
    assert auto_capacity(256, m) == 1 / 16
    assert auto_capacity(3000, m) == 1 / 4
    assert auto_capacity(m // 2, m) == 1.0
    assert auto_capacity(m, m) == 1.0
    assert auto_capacity(5, 0) == 0.0
    for count in range(0, 200, 7):  # the capacity holds the headroom, or is all of M
        f = auto_capacity(count, 100)
        assert f in AUTO_CAPACITIES
        assert f == 1.0 or math.ceil(f * 100) >= 1.25 * count


def test_auto_capacity_goes_up_at_once_and_down_after_patience(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """AutoCapacity.choose on counts fed by hand (events that have passed): each choice
    reads the count of AUTO_LAG calls before; up at once, down only after AUTO_PATIENCE
    calls in a row asked for less, to the most they asked."""
    from twell.autograd import AUTO_LAG, AutoCapacity
    from twell.options import AUTO_PATIENCE

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)

    class Passed:
        def query(self) -> bool:
            return True

    auto = AutoCapacity()

    def feed(count: int, m: int = 16384) -> None:
        auto._pending.append((torch.tensor([count], dtype=torch.int32), Passed(), m))

    def after(count: int, m: int = 16384) -> float:
        """Record a call's count, then choose for the next call (which reads the count
        recorded AUTO_LAG calls before it)."""
        feed(count, m)
        return auto.choose()

    assert auto.choose() == 0.0  # nothing recorded yet
    for _ in range(AUTO_LAG - 1):
        feed(0)
    assert after(0) == 0.0
    assert after(3000) == 0.0  # not yet read: the count of AUTO_LAG calls before is 0
    for _ in range(AUTO_LAG - 2):
        after(3000)
    assert after(5000) == 1 / 4
    for _ in range(AUTO_LAG - 1):
        after(100)
    assert auto.fraction == 1.0
    for _ in range(AUTO_PATIENCE - 1):  # these read the counts of 100
        assert after(100) == 1.0
    assert after(0) == 1 / 64  # the most the last AUTO_PATIENCE calls asked for
    assert len(auto._free) >= 1  # the pinned buffers are reused
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    pending = len(auto._pending)
    assert auto.choose() == 0.0 and auto.fraction == 1 / 64  # a capture runs without
    assert len(auto._pending) == pending  # nothing read while capturing
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)

    class InFlight:
        def query(self) -> bool:
            return False

    auto._pending.clear()
    for _ in range(AUTO_LAG + 1):
        auto._pending.append((torch.tensor([16384], dtype=torch.int32), InFlight(), 16384))
    assert auto.choose() == 1 / 64 and len(auto._pending) == AUTO_LAG + 1  # never waits


def test_auto_capacity_survives_a_deep_copy() -> None:
    """copy.deepcopy of a model (an EMA copy, say) keeps the choice, not the CUDA state."""
    import copy

    mlp = SparseMLP.from_module(LlamaMLP(32, 256))
    mlp._auto.fraction = 1 / 16
    twin = copy.deepcopy(mlp)
    assert twin._auto is not mlp._auto and twin._auto.fraction == 1 / 16
    assert not twin._auto._pending and not twin._auto._free


def test_training_block_is_a_prepared_block_without_the_host_check() -> None:
    """The training step's block skips the weights' host check (no synchronisation): its
    finiteness is unknown, which makes the backward check the weights on the device."""
    import inspect

    from twell.autograd import _training_block

    source = inspect.getsource(_training_block)
    assert "check_weights=False" in source


# ---------------------------------------------------------------------- GPU
def _gpu_reason() -> str | None:
    from twell.kernels.compile import unavailable_reason

    reason = unavailable_reason()
    if reason is None and not torch.cuda.is_available():
        return "torch has no CUDA device"
    if reason is None:
        from twell.kernels import backward

        if not hasattr(backward, "ffn_backward"):
            return "twell.kernels.backward.ffn_backward is not built yet"
    return reason


needs_gpu = pytest.mark.skipif(_gpu_reason() is not None, reason=str(_gpu_reason()))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("m", [40, 0])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
def test_gpu_ops_match_their_fake_implementations(gated: bool, m: int) -> None:
    """On CUDA too, the ops' outputs have the shapes, dtypes and strides their fake
    implementations promise (``up``: [M, R] gated, [M, 0] not; M = 0 included). Only
    these checks: some outputs have unspecified elements (``ids`` past the count, ``up``
    past a row's entries), which opcheck's eager-against-compiled comparison would read."""
    utils = ("test_schema", "test_faketensor", "test_autograd_registration")
    x, w_gate, w_up, w_down = (
        None if t is None else t.detach().cuda().bfloat16().requires_grad_()
        for t in _op_args(torch.float32, gated, m=m, k=64, n=256)
    )
    settings = (64, 16, -1, 0.0, "mean")
    torch.library.opcheck(ffn_train_forward, (x, w_gate, w_up, w_down, *settings), test_utils=utils)
    with torch.no_grad():
        out = ffn_train_forward(x, w_gate, w_up, w_down, *settings)
    assert out[6].shape == (m, 16 if gated else 0) and out[6].dtype == torch.float32
    detached = [None if t is None else t.detach() for t in (x, w_gate, w_up, w_down)]
    dy = torch.randn_like(detached[0])
    torch.library.opcheck(
        ffn_train_backward, (dy, torch.tensor(0.5, device="cuda"), *detached, *out[2:], *settings),
        test_utils=("test_schema", "test_faketensor"),
    )  # fmt: skip


def _cuda_mlp(problem: workloads.Problem, dtype: torch.dtype, reduction: str) -> SparseMLP:
    return SparseMLP.from_module(_mlp(problem, torch.float32).cuda().to(dtype), reduction=reduction)


def _reference_grads(problem: workloads.Problem, x: np.ndarray, dy: np.ndarray, coeff: float,
                     reduction: str) -> tuple:  # fmt: skip
    _, wg, wu, wd = problem.arrays()
    return reference.ffn_backward(x, wg, wu, wd, dy, coeff, reduction=reduction)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize(
    ("task", "coeff", "reduction"),
    [(True, 0.0, "mean"), (False, 1.0, "mean"), (False, 1.0, "per_token"),
     (True, 300.0, "per_token")],
    ids=["task-only", "l1-only-mean", "l1-only-per-token", "both"],
)  # fmt: skip
@pytest.mark.parametrize("workload", ["heavy", "paperlike"])
def test_gpu_gradients_match_the_float64_reference(
    workload: str, task: bool, coeff: float, reduction: str
) -> None:
    problem = workloads.make(workload, 2048, 512, 2048, seed=11)
    sparse = _cuda_mlp(problem, torch.bfloat16, reduction)
    x = torch.from_numpy(problem.x.astype(np.float32)).cuda().bfloat16().requires_grad_()
    dy = torch.randn(2048, 512, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    dy = dy.bfloat16() if task else torch.zeros_like(x)
    y = sparse(x)
    loss = coeff * sparse.l1
    if task:  # else y carries no gradient: the backward gets dy = None
        loss = loss + (y.float() * dy.float()).sum()
    loss.backward()
    xf = problem.x.astype(np.float64)
    assert relative_error(y.detach().float().cpu().numpy(), reference.ffn(*problem.arrays())) < 1e-2
    _, wg, wu, _ = problem.arrays()
    h = np.maximum(xf @ wg.astype(np.float64).T, 0) * (xf @ wu.astype(np.float64).T)
    assert float(sparse.l1.detach()) == pytest.approx(reference.l1_loss(h, reduction), rel=1e-2)
    assert float(sparse.l0) == pytest.approx(reference.l0(h), rel=2e-2, abs=0.5)
    want = _reference_grads(problem, xf, dy.double().cpu().numpy(), coeff, reduction)
    for got, ref in zip(_grads(sparse, x), want, strict=True):
        if not np.any(ref):  # dw_down of the L1 term alone: no gradient reaches w_down
            assert got is None or not torch.any(got)
            continue
        assert got.dtype == torch.bfloat16
        assert relative_error(got.double().cpu().numpy(), ref) < 2e-2


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("task", [True, False], ids=["task", "l1-only"])
def test_gpu_nongated_op_matches_the_reference(task: bool) -> None:
    problem = workloads.heavy(1024, 256, 1024, seed=4).as_nongated()
    _, _, wu64, wd64 = problem.arrays()
    x, wu, wd = (torch.from_numpy(a.astype(np.float32)).cuda().bfloat16().requires_grad_()
                 for a in (problem.x, wu64, wd64))  # fmt: skip
    y, l1, *_ = ffn_train_forward(x, None, wu, wd, 256, 32, -1, 0.0, "mean")
    dy = torch.randn_like(y) if task else torch.zeros_like(y)
    loss = 1.0 * l1 + ((y * dy).float().sum() if task else 0.0)
    loss.backward()
    want = reference.ffn_backward(problem.x, None, wu64, wd64, dy.double().cpu().numpy(), 1.0)
    for got, ref in zip((x.grad, wu.grad, wd.grad), (want[0], want[2], want[3]), strict=True):
        if not np.any(ref):
            assert got is None or not torch.any(got)
            continue
        assert relative_error(got.double().cpu().numpy(), ref) < 2e-2


@pytest.mark.gpu
@needs_gpu
def test_gpu_autocast_with_fp32_master_weights() -> None:
    problem = workloads.paperlike(2048, 512, 2048, seed=5)
    sparse = _cuda_mlp(problem, torch.float32, "per_token")
    x = torch.from_numpy(problem.x.astype(np.float32)).cuda().requires_grad_()
    dy = torch.randn(2048, 512, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = sparse(x)
        loss = (y.float() * dy).sum() + 0.05 * sparse.l1
    assert y.dtype == torch.bfloat16
    loss.backward()
    assert x.grad.dtype == torch.float32
    assert all(p.grad.dtype == torch.float32 for p in sparse.parameters())
    xb = x.detach().bfloat16().double().cpu().numpy()
    _, wg, wu, wd = problem.arrays()  # bf16 already: the kernels' rounding of the fp32 copies
    want = reference.ffn_backward(xb, wg, wu, wd, dy.double().cpu().numpy(), 0.05,
                                  reduction="per_token")  # fmt: skip
    for got, ref in zip(_grads(sparse, x), want, strict=True):
        assert relative_error(got.double().cpu().numpy(), ref) < 2e-2


def _graph_step(model: nn.Module, x: torch.Tensor, dy: torch.Tensor, coeff: float) -> None:
    y = model(x)
    loss = (y.float() * dy).sum()
    if coeff:
        loss = loss + coeff * l1_penalty(model)
    loss.backward()


def _no_capacity(model: nn.Module) -> None:
    """``model``'s SparseMLP layers run their next call with no capacity GEMMs, as a
    captured step does (``dense_capacity="auto"`` is 0 inside a capture)."""
    for layer in model.modules():
        if isinstance(layer, SparseMLP):
            layer._auto.fraction, layer._auto._event = 0.0, None


def _check_graph_capture(coeff: float, eager_steps: int = 0) -> None:
    torch.manual_seed(0)
    model = Decoder(256, 1024, layers=2).cuda()
    sparsify(model, reduction="per_token")

    def eager_step() -> None:  # its tensors die on return; SparseMLP.l1 must not hold on
        model.zero_grad(set_to_none=True)
        _graph_step(model, torch.randn(512, 256, device="cuda"),
                    torch.randn(512, 256, device="cuda"), coeff)  # fmt: skip

    for _ in range(eager_steps):  # on the current stream: torch's legacy default stream
        eager_step()
    torch.cuda.synchronize()
    reference_model = Decoder(256, 1024, layers=2).cuda()
    sparsify(reference_model, reduction="per_token")
    static_x = torch.randn(512, 256, device="cuda")
    static_dy = torch.randn(512, 256, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up: kernels compiled, cuBLAS set up
            model.zero_grad(set_to_none=True)
            _graph_step(model, static_x, static_dy, coeff)
    torch.cuda.current_stream().wait_stream(side)
    model.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _graph_step(model, static_x, static_dy, coeff)
    for trial in range(2):
        static_x.copy_(torch.randn(512, 256, device="cuda"))
        with torch.no_grad():  # an optimizer-like in-place update between replays
            for p in model.parameters():
                p.mul_(1.0 + 0.01 * trial)
        graph.replay()
        reference_model.load_state_dict(model.state_dict())
        _no_capacity(reference_model)
        reference_model.zero_grad(set_to_none=True)
        _graph_step(reference_model, static_x.clone(), static_dy, coeff)
        torch.cuda.synchronize()
        for a, b in zip(model.parameters(), reference_model.parameters(), strict=True):
            assert (
                torch.equal(a.grad, b.grad)
                or relative_error(a.grad.double().cpu().numpy(), b.grad.double().cpu().numpy())
                < 1e-2
            )


@pytest.mark.gpu
@needs_gpu
def test_gpu_cuda_graph_capture_of_forward_and_backward() -> None:
    _check_graph_capture(0.0)


@pytest.mark.gpu
@needs_gpu
def test_gpu_cuda_graph_capture_after_eager_steps_on_the_default_stream() -> None:
    """Eager training steps first (the parameters' gradient accumulators are made on the
    legacy default stream): a later capture works once nothing keeps those steps'
    autograd graphs alive (SparseMLP.l1 used to)."""
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    _check_graph_capture(1e-3, eager_steps=2)


@pytest.mark.gpu
@needs_gpu
def test_gpu_cuda_graph_capture_with_the_l1_term() -> None:
    from twell.kernels import backward

    if not getattr(backward, "DEVICE_L1_COEFF", False):
        pytest.skip("ffn_backward takes l1_coeff on the host only (DEVICE_L1_COEFF unset)")
    _check_graph_capture(1e-3)


@pytest.mark.gpu
@needs_gpu
def test_gpu_torch_compile_matches_eager() -> None:
    torch.manual_seed(3)
    eager = Decoder(256, 1024, layers=2).cuda()
    sparsify(eager, reduction="per_token")
    compiled_model = Decoder(256, 1024, layers=2).cuda()
    sparsify(compiled_model, reduction="per_token")
    compiled_model.load_state_dict(eager.state_dict())

    def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = model(x)
        return y.float().square().mean() + 1e-3 * l1_penalty(model)

    compiled = torch.compile(step, fullgraph=True)
    x = torch.randn(4, 256, 256, device="cuda")
    step(eager, x).backward()
    compiled(compiled_model, x).backward()
    for a, b in zip(compiled_model.parameters(), eager.parameters(), strict=True):
        assert relative_error(a.grad.double().cpu().numpy(), b.grad.double().cpu().numpy()) < 2e-2


@pytest.mark.gpu
@needs_gpu
def test_gpu_backward_keeps_no_dense_hidden_activation() -> None:
    m, k, n = 4096, 256, 2048
    problem = workloads.paperlike(m, k, n, seed=6)
    sparse = _cuda_mlp(problem, torch.bfloat16, "mean")
    x = torch.from_numpy(problem.x.astype(np.float32)).cuda().bfloat16().requires_grad_()
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = sparse(x)
    assert max(t.numel() for t in saved) < m * n // 4, [tuple(t.shape) for t in saved]
    (y.float().sum() + sparse.l1).backward()


@pytest.mark.gpu
@needs_gpu
def test_gpu_eval_after_a_fused_optimizer_step_sees_the_new_weights() -> None:
    """Fused AdamW writes the parameters without moving their version counters; the
    inference block cached by an earlier no-grad call must not survive a training step."""
    problem = workloads.uniform(256, 256, 512, p=0.02, seed=8)
    mlp = _cuda_mlp(problem, torch.float32, "mean")
    x = torch.from_numpy(problem.x.astype(np.float32)).cuda()
    optimizer = torch.optim.AdamW(mlp.parameters(), lr=1e-2, fused=True)
    with torch.no_grad():
        before = mlp(x.bfloat16())
    with torch.autocast("cuda", dtype=torch.bfloat16):
        (mlp(x).float() ** 2).sum().backward()
    optimizer.step()
    mlp.eval()
    with torch.no_grad():
        after = mlp(x.bfloat16())
        dense = mlp.down_proj(torch.relu(mlp.gate_proj(x)) * mlp.up_proj(x))
    assert not torch.equal(before, after)
    assert relative_error(after.float().cpu().numpy(), dense.float().cpu().numpy()) < 2e-2


def assert_same_training_outputs(want: tuple, got: tuple, slots: int) -> None:
    """The forward op's outputs equal where they are specified: ``y``, ``l1``, ``heavy``,
    ``count``, the heavy ids ``ids[:count]``, the TwELL words of light rows up to each
    tile's count, and the up products of light rows up to their entry count (a tile's
    unused slots, the ids past the count and the rest of ``up`` are unspecified)."""
    y, l1, packed, heavy, ids, count, up = want
    for a, b in zip((y, l1, heavy, count), (got[0], got[1], got[3], got[5]), strict=True):
        assert torch.equal(a, b)
    n = int(count[0])
    assert torch.equal(ids[:n], got[4][:n])
    m = packed.shape[0]
    words, other = packed.view(m, -1, slots), got[2].view(m, -1, slots)
    light = heavy == 0
    assert torch.equal(words[light, :, 0], other[light, :, 0])
    slot = torch.arange(slots, device=packed.device)
    valid = slot[None, None, :] <= words[:, :, :1].clamp(max=slots - 1)
    valid &= light[:, None, None]
    assert torch.equal(words[valid], other[valid])
    entries = words[:, :, 0].clamp(max=slots - 1).sum(dim=1)
    rank = torch.arange(up.shape[1], device=up.device)
    kept = light[:, None] & (rank[None, :] < entries[:, None])
    assert bool(kept.any()) and torch.equal(up[kept], got[6][kept])


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("workload", ["uniform", "heavy"])
def test_gpu_op_graphs_replay_the_eager_bits_into_fresh_tensors(workload: str) -> None:
    """graphs=True: the first call runs eagerly, the second captures, later ones replay;
    every call returns the eager op's bits in tensors of its own (a replay does not
    change what an earlier call returned). The weights are read where they lie (changed
    in place, as an optimizer does); every other input is a new tensor each step, which
    the graph copies in."""
    from twell import autograd

    p = workloads.make(workload, 333, 256, 1024, seed=3)
    x0, wg, wu, wd = (torch.from_numpy(a.astype(np.float32)).cuda().bfloat16()
                      for a in p.arrays())  # fmt: skip
    settings = (256, 32, -1, 0.0, "per_token")
    fw, bw = autograd._OP_FORWARD_GRAPHS, autograd._BACKWARD_GRAPHS
    before = (fw.captures, fw.replays, bw.captures, bw.replays)
    kept = []
    for step in range(4):
        with torch.no_grad():
            wu.mul_(1.0 - 0.0625 * step)
        x = x0 * (1.0 + 0.125 * step)  # new tensors every step
        dy = torch.randn_like(x)
        dl1 = torch.full((), 0.5 + step, device="cuda")
        want = ffn_train_forward(x, wg, wu, wd, *settings)
        got = ffn_train_forward(x.clone(), wg, wu, wd, *settings, True)
        saved = [t.clone() for t in got[2:]]
        want_g = ffn_train_backward(dy, dl1, x, wg, wu, wd, *want[2:], *settings)
        got_g = ffn_train_backward(dy.clone(), dl1.clone(), x.clone(), wg, wu, wd, *saved,
                                   *settings, True)  # fmt: skip
        assert_same_training_outputs(want, got, slots=32)
        for a, b in zip(want_g, got_g, strict=True):
            assert torch.equal(a, b)
        kept.append([t.clone() for t in got + got_g])
        kept[-1].append(got[0])  # the returned y itself, to check after later replays
    for values in kept:
        assert torch.equal(values[-1], values[0])
    assert not torch.equal(kept[0][0], kept[-1][0])
    after = (fw.captures, fw.replays, bw.captures, bw.replays)
    # (an earlier test's graph serves this one if its weights landed at the same places)
    assert (after[0] - before[0], after[1] - before[1]) in ((1, 3), (0, 4))
    assert (after[2] - before[2], after[3] - before[3]) in ((1, 3), (0, 4))


@pytest.mark.gpu
@needs_gpu
def test_gpu_sparse_mlp_with_op_graphs_trains_as_without() -> None:
    """A small decoder trained eagerly for a few steps with op_graphs on and off, on the
    same batches: the same gradients at every step and the same parameters, bit for
    bit."""
    from twell import autograd

    params = []
    batches = [torch.randn(512, 256, device="cuda") for _ in range(5)]
    replays = autograd._FORWARD_GRAPHS.replays, autograd._BACKWARD_GRAPHS.replays
    for op_graphs in (False, True):
        torch.manual_seed(0)
        model = Decoder(256, 1024, layers=2).cuda()
        sparsify(model, reduction="per_token", op_graphs=op_graphs)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        start = [p.detach().clone() for p in model.parameters()]
        trace = []
        for x in batches:
            optimizer.zero_grad(set_to_none=True)
            _graph_step(model, x, x / 512, 1e-3)
            trace.append([p.grad.clone() for p in model.parameters()])
            optimizer.step()
        params.append((trace, [p.detach().clone() for p in model.parameters()]))
        for a, b in zip(start, params[-1][1], strict=True):
            assert not torch.equal(a, b), "a parameter did not move"
    (trace, last), (trace_graphs, last_graphs) = params
    for grads, grads_graphs in zip(trace, trace_graphs, strict=True):
        for a, b in zip(grads, grads_graphs, strict=True):
            assert torch.isfinite(a).all() and torch.equal(a, b)
    for a, b in zip(last, last_graphs, strict=True):
        assert torch.equal(a, b)
    # Same shapes and weights every step: the ops replayed their graphs.
    assert autograd._FORWARD_GRAPHS.replays > replays[0]
    assert autograd._BACKWARD_GRAPHS.replays > replays[1]


@pytest.mark.gpu
@needs_gpu
def test_gpu_auto_capacity_follows_the_previous_call() -> None:
    """dense_capacity="auto" (the default): the first call takes no capacity, the next
    ones the capacity the previous call's heavy-row count asks for; each call gives the
    bits of a layer built with that capacity, the gradients match the float64
    reference, and a second run repeats every choice and every bit."""
    from twell.options import auto_capacity

    problem = workloads.heavy(1024, 256, 1024, p=0.02, frac=0.05, seed=7)
    x = torch.from_numpy(problem.x.astype(np.float32)).cuda().bfloat16()
    dy = torch.randn(1024, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    dy = dy.bfloat16()

    def step(mlp: SparseMLP) -> list[torch.Tensor]:
        xi = x.clone().requires_grad_()
        mlp.zero_grad(set_to_none=True)
        y = mlp(xi)
        ((y.float() * dy).sum() + 0.5 * mlp.l1).backward()
        return [y.detach(), xi.grad, *(p.grad for p in mlp.parameters())]

    runs = []
    for _ in range(2):
        auto = _cuda_mlp(problem, torch.bfloat16, "per_token")
        choices, outputs = [], []
        for _ in range(3):
            outputs.append(step(auto))
            choices.append(auto._auto.fraction)  # what the forward chose
        runs.append((choices, outputs))
    choices, outputs = runs[0]
    heavy = int(
        ffn_train_forward(
            x,
            *(p.detach() for p in _cuda_mlp(problem, torch.bfloat16, "per_token").parameters()),
            256,
            32,
            -1,
            0.0,
            "per_token",
        )[5]
    )
    assert heavy > 8, "the workload must have heavy rows"
    assert choices == [0.0, auto_capacity(heavy, 1024), auto_capacity(heavy, 1024)]
    assert choices[1] > 0.0
    for fraction, got in zip(choices, outputs, strict=True):
        fixed = SparseMLP.from_module(
            _mlp(problem, torch.float32).cuda().bfloat16(), reduction="per_token",
            dense_capacity=fraction,
        )  # fmt: skip
        for a, b in zip(got, step(fixed), strict=True):
            assert torch.equal(a, b)
    want = _reference_grads(problem, problem.x.astype(np.float64), dy.double().cpu().numpy(),
                            0.5, "per_token")  # fmt: skip
    got = outputs[1]
    for g, r in zip((got[1], got[2], got[3], got[4]), want, strict=True):
        assert relative_error(g.double().cpu().numpy(), r) < 2e-2
    assert runs[1][0] == choices
    for a_run, b_run in zip(outputs, runs[1][1], strict=True):
        for a, b in zip(a_run, b_run, strict=True):
            assert torch.equal(a, b)


@pytest.mark.gpu
@needs_gpu
def test_gpu_op_graphs_keep_one_graph_per_layer_as_the_capacity_moves() -> None:
    """OpGraphs(replace=...): a graph captured at a new value of the replaced argument
    (the dense capacity "auto" moves) drops the one captured at the old value."""
    from twell._graphs import OpGraphs

    graphs = OpGraphs(replace=frozenset({1}))
    x = torch.randn(64, device="cuda")
    for c in (1.0, 1.0, 2.0, 2.0, 2.0):  # a value's first call runs eagerly, then capture
        (out,) = graphs(lambda t, c: (t * c,), (x, c), pinned=frozenset())
        assert torch.equal(out, x * c)
    assert graphs.captures == 2 and graphs.replays == 3  # captures replay at once
    assert len(graphs._graphs) == 1
    for _ in range(2):  # another shape: a graph of its own beside the first
        (other,) = graphs(lambda t, c: (t * c,), (x[:32], 2.0), pinned=frozenset())
        assert torch.equal(other, x[:32] * 2.0)
    assert len(graphs._graphs) == 2
    for _ in range(2):  # the second shape's value moves: only its own graph is replaced
        graphs(lambda t, c: (t * c,), (x[:32], 3.0), pinned=frozenset())
    assert len(graphs._graphs) == 2 and graphs.captures == 4
    assert {key[1] for key in graphs._graphs} == {2.0, 3.0}
    graphs.clear()
    assert not graphs._graphs and not graphs._by_rest
