"""The training path's policies on CUDA: op graphs (``op_graphs``: the same bits as
without; one graph per layer as the dense capacity moves) and ``dense_capacity="auto"``
following the previous call's heavy rows.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch_helpers import Decoder, cuda_mlp, mlp_from_problem, reference_grads, train_step  # noqa: E402

from twell import workloads  # noqa: E402
from twell.autograd import ffn_train_forward  # noqa: E402
from twell.testing.asserts import relative_error  # noqa: E402
from twell.torch import SparseMLP, sparsify  # noqa: E402

# Through torch's ops, whose buffers come from torch's allocator.
pytestmark = pytest.mark.unpoisoned


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("loop", ["set_to_none", "zeroed", "accumulated", "two_forwards"])
def test_gpu_sparse_mlp_with_op_graphs_trains_as_without(loop: str, dtype: torch.dtype) -> None:
    """A small decoder trained eagerly for a few steps with op_graphs on and off, on the
    same batches: the same gradients at every step and the same parameters, bit for bit.
    Loops: gradients dropped each step, zeroed in place and kept, accumulated over two
    micro-batches, or two forwards (two batches, one loss) before one backward, where the
    first forward's saved tensors sit in the graphs' memory while the second forward's
    graphs replay (OpGraphs copies them out first). In bf16 the backward's graphs hand
    their results over (``.grad`` is their memory) rather than copying them out."""
    from twell import autograd

    params = []
    batches = [torch.randn(512, 256, device="cuda").to(dtype) for _ in range(6)]
    replays = autograd._FORWARD_GRAPHS.replays, autograd._BACKWARD_GRAPHS.replays
    for op_graphs in (False, True):
        torch.manual_seed(0)
        model = Decoder(256, 1024, layers=3).cuda().to(dtype)
        sparsify(model, reduction="per_token", op_graphs=op_graphs, density_switch=False)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        start = [p.detach().clone() for p in model.parameters()]
        trace = []
        for i, x in enumerate(batches):
            if loop != "accumulated" or i % 2 == 0:
                optimizer.zero_grad(set_to_none=loop != "zeroed")
            if loop == "two_forwards":
                other = batches[(i + 1) % len(batches)].flip(0)
                loss = (model(x).float() * x / 512).sum() + (model(other).float() * other).sum()
                loss.backward()
            else:
                train_step(model, x, x / 512, 1e-3)
            trace.append([p.grad.clone() for p in model.parameters()])
            if loop != "accumulated" or i % 2 == 1:
                optimizer.step()
        params.append((trace, [p.detach().clone() for p in model.parameters()]))
        moved = [not torch.equal(a, b) for a, b in zip(start, params[-1][1], strict=True)]
        # (bf16 weights may not resolve every small step)
        assert all(moved) if dtype == torch.float32 else any(moved), moved
    (trace, last), (trace_graphs, last_graphs) = params
    for grads, grads_graphs in zip(trace, trace_graphs, strict=True):
        for a, b in zip(grads, grads_graphs, strict=True):
            assert torch.isfinite(a).all() and torch.equal(a, b)
    for a, b in zip(last, last_graphs, strict=True):
        assert torch.equal(a, b)
    # Same shapes and weights every step: the ops replayed their graphs.
    assert autograd._FORWARD_GRAPHS.replays > replays[0]
    assert autograd._BACKWARD_GRAPHS.replays > replays[1]


def test_gpu_auto_capacity_follows_the_previous_call() -> None:
    """dense_capacity="auto" (the default): the first AUTO_LAG calls take no capacity,
    the next ones the capacity the heavy-row count AUTO_LAG calls back asks for (the
    GPU finished that call long before); each call gives the
    bits of a layer built with that capacity, the gradients match the float64
    reference, and a second run repeats every choice and every bit."""
    from twell.capacity import AUTO_LAG, train_capacity

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
        auto = cuda_mlp(problem, torch.bfloat16, "per_token")
        choices, outputs = [], []
        for _ in range(AUTO_LAG + 2):
            outputs.append(step(auto))
            choices.append(auto._auto.fraction)  # what the forward chose
        runs.append((choices, outputs))
    choices, outputs = runs[0]
    heavy = int(
        ffn_train_forward(
            x,
            *(p.detach() for p in cuda_mlp(problem, torch.bfloat16, "per_token").parameters()),
            256,
            32,
            -1,
            0.0,
            "per_token",
        )[5]
    )
    assert heavy > 8, "the workload must have heavy rows"
    assert choices == [0.0] * AUTO_LAG + [train_capacity(heavy, 1024)] * 2
    assert choices[-1] > 0.0
    for fraction, got in zip(choices, outputs, strict=True):
        fixed = SparseMLP.from_module(
            mlp_from_problem(problem, torch.float32).cuda().bfloat16(), reduction="per_token",
            dense_capacity=fraction, density_switch=False,
        )  # fmt: skip
        for a, b in zip(got, step(fixed), strict=True):
            assert torch.equal(a, b)
    want = reference_grads(problem, problem.x.astype(np.float64), dy.double().cpu().numpy(),
                            0.5, "per_token")  # fmt: skip
    got = outputs[-1]  # with a capacity
    for g, r in zip((got[1], got[2], got[3], got[4]), want, strict=True):
        assert relative_error(g.double().cpu().numpy(), r) < 2e-2
    assert runs[1][0] == choices
    for a_run, b_run in zip(outputs, runs[1][1], strict=True):
        for a, b in zip(a_run, b_run, strict=True):
            assert torch.equal(a, b)


def test_gpu_compiled_training_takes_its_layers_auto_capacity() -> None:
    """Under torch.compile, dense_capacity="auto" comes from the layer's AutoCapacity
    that the ops keep per w_up (twell.capacity.for_weights): after AUTO_LAG steps of a
    workload with heavy rows it is above 0, and the compiled step gives the bits of an
    eager layer built with that capacity."""
    from twell import capacity

    problem = workloads.heavy(1024, 256, 1024, p=0.02, frac=0.05, seed=7)
    x = torch.from_numpy(problem.x.astype(np.float32)).cuda().bfloat16()
    dy = torch.randn(1024, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    dy = dy.bfloat16()

    def step(mlp: SparseMLP, run: object) -> list[torch.Tensor]:
        xi = x.clone().requires_grad_()
        mlp.zero_grad(set_to_none=True)
        y = run(xi)
        ((y.float() * dy).sum() + 0.5 * mlp.l1).backward()
        return [y.detach(), xi.grad, *(p.grad for p in mlp.parameters())]

    torch._dynamo.reset()
    mlp = cuda_mlp(problem, torch.bfloat16, "per_token")
    compiled = torch.compile(mlp, fullgraph=True)
    fractions, outputs = [], []
    for _ in range(capacity.AUTO_LAG + 2):
        outputs.append(step(mlp, compiled))
        torch.cuda.synchronize()
        fractions.append(capacity.for_weights(mlp.up_proj.weight).fraction)
    assert fractions[0] == 0.0 and fractions[-1] > 0.0
    fixed = cuda_mlp(problem, torch.bfloat16, "per_token")
    fixed = SparseMLP(fixed.gate_proj, fixed.up_proj, fixed.down_proj, reduction="per_token",
                      dense_capacity=fractions[-1], density_switch=False)  # fmt: skip
    for a, b in zip(outputs[-1], step(fixed, fixed), strict=True):
        assert torch.equal(a, b)


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


def test_gpu_op_graph_memory_is_counted_and_released() -> None:
    """op_graph_memory counts what the training ops' graphs keep between steps (at least
    each layer's copies of x and dy); release_op_graphs gives it back to torch's cache,
    and the next steps capture again and train as before."""
    from twell import autograd

    autograd.release_op_graphs()
    torch.manual_seed(0)
    model = Decoder(256, 1024, layers=2).cuda()
    sparsify(model, reduction="per_token", op_graphs=True, dense_capacity=0.0,
             density_switch=False)  # fmt: skip
    x = torch.randn(512, 256, device="cuda")
    grads = []
    for _ in range(3):
        model.zero_grad()
        train_step(model, x, x / 512, 1e-3)
        grads.append([p.grad.clone() for p in model.parameters()])
    buffers = sum(b.numel() * b.element_size()
                  for graphs in (autograd._FORWARD_GRAPHS, autograd._BACKWARD_GRAPHS)
                  for slots in graphs._graphs.values() for g in slots
                  for b in g.buffers if b is not None)  # fmt: skip
    held = autograd.op_graph_memory()
    assert buffers >= 2 * 2 * x.numel() * 2  # x and dy of two layers, bf16 at least
    assert held > buffers  # and the pools' outputs and scratch
    reserved = torch.cuda.memory_reserved()
    autograd.release_op_graphs()
    assert torch.cuda.memory_reserved() < reserved
    captures = autograd._BACKWARD_GRAPHS.captures
    for _ in range(3):
        model.zero_grad()
        train_step(model, x, x / 512, 1e-3)
        for a, b in zip(grads[-1], [p.grad for p in model.parameters()], strict=True):
            assert torch.equal(a, b)
    assert autograd._BACKWARD_GRAPHS.captures == captures + 2  # one per layer again


def test_gpu_a_second_backward_with_op_graphs_says_what_to_do() -> None:
    """retain_graph=True and a second backward through a call made with op graphs (its
    saved activations were lent and given back): a clear error naming op_graphs=False,
    which backpropagates twice."""
    problem = workloads.make("uniform", 256, 256, 1024, seed=5)
    x = torch.from_numpy(problem.x.astype(np.float32)).cuda().bfloat16()
    grads = []
    for op_graphs in (True, False):
        mlp = cuda_mlp(problem, torch.bfloat16, "per_token")
        mlp = SparseMLP(mlp.gate_proj, mlp.up_proj, mlp.down_proj, reduction="per_token",
                        dense_capacity=0.0, op_graphs=op_graphs, density_switch=False)  # fmt: skip
        for _ in range(3):  # eager, captured, replayed
            y = mlp(x.requires_grad_())
            y.float().sum().backward(retain_graph=True)
            mlp.zero_grad()
            if op_graphs:
                with pytest.raises(RuntimeError, match="op_graphs=False"):
                    y.float().sum().backward()
            else:
                y.float().sum().backward()
                grads.append(mlp.up_proj.weight.grad.clone())
            del y  # (held, it would keep the graph from replaying: a second slot)
    assert torch.isfinite(grads[-1]).all()


def test_gpu_op_graphs_hand_the_weight_gradients_over_without_a_copy() -> None:
    """In a loop that drops its gradients each step, the backward's graph writes them
    into the same tensors every step (allocated outside the graphs' pool) and those
    become ``.grad`` themselves: no copy, and no second graph (nor for the forward, whose
    ``y`` is handed over the same way)."""
    from twell import autograd

    autograd.release_op_graphs()
    torch.manual_seed(0)
    model = Decoder(256, 1024, layers=2).cuda().bfloat16()
    sparsify(
        model, reduction="per_token", dense_capacity=0.0, density_switch=False
    )  # one graph per layer
    mlps = [m for m in model.modules() if isinstance(m, SparseMLP)]
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    places = []
    for _ in range(5):
        optimizer.zero_grad()
        train_step(model, x, x / 512, 1e-3)
        places.append([m.up_proj.weight.grad.data_ptr() for m in mlps])
        optimizer.step()
    assert places[2] == places[3] == places[4]  # step 0 eager, 1 captures, then replays
    homes = {t.data_ptr() for slots in autograd._BACKWARD_GRAPHS._graphs.values()
             for g in slots for t in g.homes()}  # fmt: skip
    assert set(places[4]) <= homes
    for graphs in (autograd._FORWARD_GRAPHS, autograd._BACKWARD_GRAPHS):  # y handed over too
        assert sum(len(slots) for slots in graphs._graphs.values()) == len(mlps)
        assert all(g.homes() for slots in graphs._graphs.values() for g in slots)


def test_gpu_the_train_switch_runs_a_dense_layer_on_dense_math_and_a_sparse_one_on_the_ops(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """density_switch (the default): a layer whose calls are denser than the training
    crossover runs its dense torch math from the call AUTO_LAG calls after the first such
    one (the same bits as train_kernels=False), and the training ops again once
    AUTO_PATIENCE calls in a row were sparse enough (the same bits as density_switch=False)."""
    import twell.torch as twell_torch
    from twell.capacity import AUTO_LAG
    from twell.options import AUTO_PATIENCE

    calls = []
    ops = twell_torch._ffn_train
    monkeypatch.setattr(twell_torch, "_ffn_train", lambda *a: calls.append(1) or ops(*a))
    dense_problem = workloads.density(0.1, 1024, 256, 1024, seed=3)
    sparse_problem = workloads.uniform(1024, 256, 1024, seed=3)
    x = torch.from_numpy(dense_problem.x.astype(np.float32)).cuda().bfloat16()
    dy = torch.randn(1024, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(2))

    def step(mlp: SparseMLP) -> list[torch.Tensor]:
        xi = x.clone().requires_grad_()
        mlp.zero_grad(set_to_none=True)
        y = mlp(xi)
        ((y.float() * dy).sum() + 0.5 * mlp.l1).backward()
        torch.cuda.synchronize()  # the L0 copies land before the next call reads them
        return [y.detach(), xi.grad, *(p.grad for p in mlp.parameters())]

    def twin(problem: workloads.Problem, **kwargs: object) -> SparseMLP:
        mlp = mlp_from_problem(problem, torch.float32).cuda().bfloat16()
        return SparseMLP.from_module(mlp, reduction="per_token", **kwargs)

    mlp = twin(dense_problem)
    for i in range(AUTO_LAG + 1):
        before = len(calls)
        got = step(mlp)
        assert len(calls) == before + (i < AUTO_LAG), i  # the ops until the first L0 is read
    assert mlp._switch.dense and float(mlp.l0) > 0.05 * 1024
    for a, b in zip(got, step(twin(dense_problem, train_kernels=False)), strict=True):
        assert torch.equal(a, b)
    with torch.no_grad():  # the layer turns sparse
        for layer, w in ((mlp.gate_proj, sparse_problem.w_gate), (mlp.up_proj, sparse_problem.w_up),
                         (mlp.down_proj, sparse_problem.w_down)):  # fmt: skip
            layer.weight.copy_(torch.from_numpy(w.astype(np.float32)))
    x = torch.from_numpy(sparse_problem.x.astype(np.float32)).cuda().bfloat16()
    for _ in range(AUTO_LAG + AUTO_PATIENCE - 1):
        step(mlp)
    assert mlp._switch.dense  # not yet: one call short of the patience
    before = len(calls)
    got = step(mlp)
    assert not mlp._switch.dense and len(calls) == before + 1
    for a, b in zip(got, step(twin(sparse_problem, density_switch=False)), strict=True):
        assert torch.equal(a, b)


def test_gpu_a_recomputed_forward_takes_the_path_of_its_first_run() -> None:
    """Activation checkpointing runs a layer's forward again inside the backward pass: it
    takes the path and capacity its first run took (the dense switch and "auto" read and
    record nothing then), even when an L0 that turns the switch on has landed in between;
    the gradients are those of the layer without checkpointing."""
    from torch.utils.checkpoint import checkpoint

    from twell.capacity import AUTO_LAG

    problem = workloads.uniform(1024, 256, 1024, seed=4)
    x = torch.from_numpy(problem.x.astype(np.float32)).cuda().bfloat16()
    dy = torch.randn(1024, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    dy = dy.bfloat16()

    class Passed:  # an event that has completed (and records nothing when reused)
        def query(self) -> bool:
            return True

        def record(self, stream: object) -> None:
            pass

    def run(mlp: SparseMLP, wrap: bool) -> list[torch.Tensor]:
        xi = x.clone().requires_grad_()
        y = checkpoint(mlp, xi, use_reentrant=False) if wrap else mlp(xi)
        y.backward(dy)
        return [y.detach(), xi.grad, *(p.grad for p in mlp.parameters())]

    mlp = SparseMLP.from_module(mlp_from_problem(problem, torch.float32).cuda().bfloat16())
    # the first run reads a sparse call; a read after it would find a dense one
    # (pinned buffers hold (L0, heavy-row count): the forward reuses these read ones)
    sparse, dense = torch.tensor([1.0, 0.0]), torch.tensor([1000.0, 0.0])
    mlp._switch._pending.extend(
        [(sparse, Passed(), 1024, 1024)] + [(dense, Passed(), 1024, 1024)] * (AUTO_LAG - 1)
    )
    got = run(mlp, wrap=True)
    assert not mlp._switch.dense and len(mlp._switch._pending) == AUTO_LAG  # one record
    twin = SparseMLP.from_module(
        mlp_from_problem(problem, torch.float32).cuda().bfloat16(), density_switch=False
    )
    for a, b in zip(got, run(twin, wrap=False), strict=True):
        assert torch.equal(a, b)


def test_gpu_calls_with_and_without_op_graphs_read_their_counts_in_call_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the dense switch on (the default) every training call's L0 and heavy-row
    count travel in one host copy, read AUTO_LAG calls later in call order, whether the
    call replayed an op graph or not: a layer alternating the two (batch sizes around
    OP_GRAPH_TOKENS do) chooses each call's capacity as a layer that never replays does,
    and its AutoCapacity's own queue stays empty."""
    from twell.kernels import density

    monkeypatch.setattr(density, "TRAIN_CROSSOVER", ((4096, 0.5), (16384, 0.5)))
    density.train_crossover.cache_clear()
    problem = workloads.heavy(1024, 256, 1024, p=0.02, frac=0.05, seed=7)
    x = torch.from_numpy(problem.x.astype(np.float32)).cuda().bfloat16()
    few = x.clone()
    few[: x.shape[0] // 2] = 0  # (zero rows: no active unit) about half the heavy rows
    batches = [few] * 5 + [x] + [few] * 4  # when x's count is read shows the order

    def run(alternate: bool) -> list[float]:
        mlp = SparseMLP.from_module(mlp_from_problem(problem, torch.float32).cuda().bfloat16(),
                                    reduction="per_token")  # fmt: skip
        choices = []
        for i, batch in enumerate(batches):
            mlp.op_graphs = alternate and i % 2 == 0
            xi = batch.clone().requires_grad_()
            mlp(xi).float().sum().backward()
            torch.cuda.synchronize()  # every copy lands before the next call reads
            choices.append(mlp._auto.fraction)
        assert not mlp._auto._pending and not mlp._switch.dense
        return choices

    try:
        mixed, plain = run(True), run(False)
    finally:
        density.train_crossover.cache_clear()
    assert mixed == plain
    assert plain[7] > plain[6] > 0.0, plain  # x's count (call 5) read AUTO_LAG calls on
