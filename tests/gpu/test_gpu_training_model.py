"""Training with twell.torch.SparseMLP on CUDA: gradients against the float64 reference on
the heavy and paperlike workloads, bf16 autocast with fp32 master weights, CUDA-graph
capture of forward + backward, torch.compile, no dense hidden activation kept, and eval
after a fused optimizer step.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch_helpers import Decoder, cuda_mlp, grads, reference_grads, train_step  # noqa: E402

from twell import reference, workloads  # noqa: E402
from twell.testing.asserts import relative_error  # noqa: E402
from twell.torch import SparseMLP, l1_penalty, sparsify  # noqa: E402

# Through torch's ops, whose buffers come from torch's allocator.
pytestmark = pytest.mark.unpoisoned


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
    sparse = cuda_mlp(problem, torch.bfloat16, reduction)
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
    want = reference_grads(problem, xf, dy.double().cpu().numpy(), coeff, reduction)
    for got, ref in zip(grads(sparse, x), want, strict=True):
        if not np.any(ref):  # dw_down of the L1 term alone: no gradient reaches w_down
            assert got is None or not torch.any(got)
            continue
        assert got.dtype == torch.bfloat16
        assert relative_error(got.double().cpu().numpy(), ref) < 2e-2


def test_gpu_autocast_with_fp32_master_weights() -> None:
    problem = workloads.paperlike(2048, 512, 2048, seed=5)
    sparse = cuda_mlp(problem, torch.float32, "per_token")
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
    for got, ref in zip(grads(sparse, x), want, strict=True):
        assert relative_error(got.double().cpu().numpy(), ref) < 2e-2


def _no_capacity(model: nn.Module) -> None:
    """``model``'s SparseMLP layers run their next call with no capacity GEMMs, as a
    captured step does (``dense_capacity="auto"`` is 0 inside a capture)."""
    for layer in model.modules():
        if isinstance(layer, SparseMLP):
            layer._auto.fraction, layer._auto._event = 0.0, None


def _check_graph_capture(coeff: float, eager_steps: int = 0) -> None:
    torch.manual_seed(0)
    model = Decoder(256, 1024, layers=2).cuda()
    sparsify(model, reduction="per_token", density_switch=False)

    def eager_step() -> None:  # its tensors die on return; SparseMLP.l1 must not hold on
        model.zero_grad(set_to_none=True)
        train_step(model, torch.randn(512, 256, device="cuda"),
                    torch.randn(512, 256, device="cuda"), coeff)  # fmt: skip

    for _ in range(eager_steps):  # on the current stream: torch's legacy default stream
        eager_step()
    torch.cuda.synchronize()
    reference_model = Decoder(256, 1024, layers=2).cuda()
    sparsify(reference_model, reduction="per_token", density_switch=False)
    static_x = torch.randn(512, 256, device="cuda")
    static_dy = torch.randn(512, 256, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up: kernels compiled, cuBLAS set up
            model.zero_grad(set_to_none=True)
            train_step(model, static_x, static_dy, coeff)
    torch.cuda.current_stream().wait_stream(side)
    model.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        train_step(model, static_x, static_dy, coeff)
    for trial in range(2):
        static_x.copy_(torch.randn(512, 256, device="cuda"))
        with torch.no_grad():  # an optimizer-like in-place update between replays
            for p in model.parameters():
                p.mul_(1.0 + 0.01 * trial)
        graph.replay()
        reference_model.load_state_dict(model.state_dict())
        _no_capacity(reference_model)
        reference_model.zero_grad(set_to_none=True)
        train_step(reference_model, static_x.clone(), static_dy, coeff)
        torch.cuda.synchronize()
        for a, b in zip(model.parameters(), reference_model.parameters(), strict=True):
            assert (
                torch.equal(a.grad, b.grad)
                or relative_error(a.grad.double().cpu().numpy(), b.grad.double().cpu().numpy())
                < 1e-2
            )


def test_gpu_cuda_graph_capture_of_forward_and_backward() -> None:
    _check_graph_capture(0.0)


def test_gpu_cuda_graph_capture_after_eager_steps_on_the_default_stream() -> None:
    """Eager training steps first (the parameters' gradient accumulators are made on the
    legacy default stream): a later capture works once nothing keeps those steps'
    autograd graphs alive (as SparseMLP.l1 would, were it not detached)."""
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    _check_graph_capture(1e-3, eager_steps=2)


def test_gpu_cuda_graph_capture_with_the_l1_term() -> None:
    from twell.kernels import backward

    if not getattr(backward, "DEVICE_L1_COEFF", False):
        pytest.skip("ffn_backward takes l1_coeff on the host only (DEVICE_L1_COEFF unset)")
    _check_graph_capture(1e-3)


def test_gpu_torch_compile_matches_eager() -> None:
    torch.manual_seed(3)
    eager = Decoder(256, 1024, layers=2).cuda()
    sparsify(eager, reduction="per_token", density_switch=False)
    compiled_model = Decoder(256, 1024, layers=2).cuda()
    sparsify(compiled_model, reduction="per_token", density_switch=False)
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


def test_gpu_compiled_steps_with_op_graphs_give_the_plain_launches_bits() -> None:
    """Compiled code calls the training ops through the dispatcher. With op graphs the
    forward's graphs hand ``y`` over (written again only once nothing holds it) and copy
    the other outputs out; the backward's graphs copy their inputs in and hand the
    gradients over. Over six optimizer steps (weights changed in place, a new input each
    step), a compiled MLP with op graphs gives the loss and gradients of one with plain
    launches, bit for bit, while both ops' graphs replay."""
    from twell import autograd

    problem = workloads.make("heavy", 512, 256, 1024, seed=11)
    models = [cuda_mlp(problem, torch.bfloat16, "mean") for _ in range(2)]
    models[0].op_graphs, models[1].op_graphs = True, False

    def step(mlp: SparseMLP, x: torch.Tensor) -> torch.Tensor:
        return mlp(x).float().square().mean() + 1e-3 * l1_penalty(mlp)

    compiled = torch.compile(step, fullgraph=True)
    optimizers = [torch.optim.SGD(m.parameters(), lr=1e-2) for m in models]
    x0 = torch.from_numpy(problem.x.astype(np.float32)).cuda().bfloat16()
    fw, bw = autograd._OP_FORWARD_GRAPHS, autograd._BACKWARD_GRAPHS
    before = (fw.replays, bw.replays)
    for i in range(6):
        xs = [(x0 * (1.0 + 0.125 * i)).requires_grad_() for _ in models]
        losses = [compiled(m, x) for m, x in zip(models, xs, strict=True)]
        for loss in losses:
            loss.backward()
        assert torch.equal(losses[0], losses[1]), i
        for a, b in zip(grads(models[0], xs[0]), grads(models[1], xs[1]), strict=True):
            assert torch.equal(a, b), i
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    assert fw.replays - before[0] >= 4 and bw.replays - before[1] >= 3


def test_gpu_backward_keeps_no_dense_hidden_activation() -> None:
    m, k, n = 4096, 256, 2048
    problem = workloads.paperlike(m, k, n, seed=6)
    sparse = cuda_mlp(problem, torch.bfloat16, "mean")
    x = torch.from_numpy(problem.x.astype(np.float32)).cuda().bfloat16().requires_grad_()
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = sparse(x)
    assert max(t.numel() for t in saved) < m * n // 4, [tuple(t.shape) for t in saved]
    (y.float().sum() + sparse.l1).backward()


def test_gpu_eval_after_a_fused_optimizer_step_sees_the_new_weights() -> None:
    """Fused AdamW writes the parameters without moving their version counters; the
    inference block cached by an earlier no-grad call must not survive a training step."""
    problem = workloads.uniform(256, 256, 512, p=0.02, seed=8)
    mlp = cuda_mlp(problem, torch.float32, "mean")
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
