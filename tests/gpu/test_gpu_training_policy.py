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


@pytest.mark.parametrize("grads", ["set_to_none", "zeroed", "accumulated"])
def test_gpu_sparse_mlp_with_op_graphs_trains_as_without(grads: str) -> None:
    """A small decoder trained eagerly for a few steps with op_graphs on and off, on the
    same batches: the same gradients at every step and the same parameters, bit for
    bit. The gradients come back in the graphs' memory (not copied out), so how the loop
    treats them matters: dropped each step (``zero_grad()``), zeroed in place and kept
    (``set_to_none=False``: the next backward adds to them), or accumulated over two
    micro-batches."""
    from twell import autograd

    params = []
    batches = [torch.randn(512, 256, device="cuda") for _ in range(6)]
    replays = autograd._FORWARD_GRAPHS.replays, autograd._BACKWARD_GRAPHS.replays
    for op_graphs in (False, True):
        torch.manual_seed(0)
        model = Decoder(256, 1024, layers=2).cuda()
        sparsify(model, reduction="per_token", op_graphs=op_graphs)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        start = [p.detach().clone() for p in model.parameters()]
        trace = []
        for i, x in enumerate(batches):
            if grads != "accumulated" or i % 2 == 0:
                optimizer.zero_grad(set_to_none=grads != "zeroed")
            train_step(model, x, x / 512, 1e-3)
            trace.append([p.grad.clone() for p in model.parameters()])
            if grads != "accumulated" or i % 2 == 1:
                optimizer.step()
        params.append((trace, [p.detach().clone() for p in model.parameters()]))
        for a, b in zip(start, params[-1][1], strict=True):
            assert not torch.equal(a, b), "a parameter did not move"
    (trace, last), (trace_graphs, last_graphs) = params
    for grads_eager, grads_graphs in zip(trace, trace_graphs, strict=True):
        for a, b in zip(grads_eager, grads_graphs, strict=True):
            assert torch.isfinite(a).all() and torch.equal(a, b)
    for a, b in zip(last, last_graphs, strict=True):
        assert torch.equal(a, b)
    # Same shapes and weights every step: the ops replayed their graphs.
    assert autograd._FORWARD_GRAPHS.replays > replays[0]
    assert autograd._BACKWARD_GRAPHS.replays > replays[1]


def test_gpu_op_graphs_hand_the_weight_gradients_over_without_a_copy() -> None:
    """In a loop that drops its gradients each step, the backward's graph is replayed
    into the same memory every step and that memory becomes ``.grad`` itself (torch
    takes a gradient nobody else holds): no copy, no second slot."""
    from twell import autograd

    torch.manual_seed(0)
    model = Decoder(256, 1024, layers=2).cuda()
    sparsify(model, reduction="per_token", dense_capacity=0.0)  # one graph per layer
    mlps = [m for m in model.modules() if isinstance(m, SparseMLP)]
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(512, 256, device="cuda")
    places = []
    captures = autograd._BACKWARD_GRAPHS.captures
    for _ in range(5):
        optimizer.zero_grad()
        train_step(model, x, x / 512, 1e-3)
        places.append([m.up_proj.weight.grad.data_ptr() for m in mlps])
        optimizer.step()
    assert places[2] == places[3] == places[4]  # step 0 eager, 1 captures, then replays
    outputs = {t.data_ptr() for slots in autograd._BACKWARD_GRAPHS._graphs.values()
               for g in slots for t in g.outputs if t is not None}  # fmt: skip
    assert set(places[4]) <= outputs
    assert autograd._BACKWARD_GRAPHS.captures - captures == len(mlps)


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
            dense_capacity=fraction,
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
                      dense_capacity=fractions[-1])  # fmt: skip
    for a, b in zip(outputs[-1], step(fixed, fixed), strict=True):
        assert torch.equal(a, b)


def test_gpu_op_graphs_keep_one_graph_per_layer_as_the_capacity_moves() -> None:
    """OpGraphs(replace=...): a graph captured at a new value of the replaced argument
    (the dense capacity "auto" moves) drops the one captured at the old value."""
    from twell._graphs import OpGraphs

    graphs = OpGraphs(replace=frozenset({1}))
    x = torch.randn(64, device="cuda")
    for c in (1.0, 1.0, 2.0, 2.0, 2.0):  # a value's first call runs eagerly, then capture
        # (the output is dropped at once: a held one would have the next call take a
        # second slot)
        assert torch.equal(graphs(lambda t, c: (t * c,), (x, c), pinned=frozenset())[0], x * c)
    assert graphs.captures == 2 and graphs.replays == 3  # captures replay at once
    assert len(graphs._graphs) == 1
    for _ in range(2):  # another shape: a graph of its own beside the first
        other = graphs(lambda t, c: (t * c,), (x[:32], 2.0), pinned=frozenset())[0]
        assert torch.equal(other, x[:32] * 2.0)
        del other
    assert len(graphs._graphs) == 2
    for _ in range(2):  # the second shape's value moves: only its own graph is replaced
        graphs(lambda t, c: (t * c,), (x[:32], 3.0), pinned=frozenset())
    assert len(graphs._graphs) == 2 and graphs.captures == 4
    assert {key[1] for key in graphs._graphs} == {2.0, 3.0}
    graphs.clear()
    assert not graphs._graphs and not graphs._by_rest


def test_gpu_op_graphs_return_their_memory_and_never_overwrite_a_held_output() -> None:
    """OpGraphs return large outputs in the graph's own memory (no copy) and replay a graph
    only while nothing outside it holds that memory (a view counts); a second slot serves
    while the first is held, and with both held the call runs eagerly. Small outputs are
    copied out."""
    from twell._graphs import OP_COPY_BYTES, SLOTS, OpGraphs

    assert SLOTS == 2
    graphs = OpGraphs()
    x = torch.randn(64, 1024, device="cuda")  # 256 KB outputs: returned in place
    assert x.numel() * 4 > OP_COPY_BYTES

    def fn(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return t * 2.0, t.sum().reshape(1)

    def call(scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            x.copy_(base * scale)
        out = graphs(fn, (x,), pinned=frozenset())
        assert torch.equal(out[0], base * scale * 2.0)
        return out

    base = x.clone()
    call(1.0)  # first sight: eager
    a = call(2.0)  # captured (slot 0) and replayed
    assert graphs.captures == 1
    (slot,) = graphs._graphs.values()
    place = a[0].data_ptr()
    assert place == slot[0].outputs[0].data_ptr()
    assert a[1].data_ptr() != slot[0].outputs[1].data_ptr()  # the scalar: copied out
    del a
    b = call(3.0)  # slot 0 free again: the same memory, no copy
    assert graphs.captures == 1 and b[0].data_ptr() == place
    view = call(4.0)[0].view(-1)  # slot 0 held by b: slot 1; a view of its output kept
    assert graphs.captures == 2 and view.data_ptr() != place
    replays = graphs.replays
    c = call(5.0)  # both slots held: an eager call, nothing overwritten
    assert graphs.replays == replays and c[0].data_ptr() not in (place, view.data_ptr())
    torch.cuda.synchronize()
    assert torch.equal(b[0], base * 6.0) and torch.equal(view, (base * 8.0).view(-1))
    del view
    d = call(6.0)  # slot 1 is free once the view is gone
    assert graphs.replays == replays + 1 and graphs.captures == 2
    assert torch.equal(b[0], base * 6.0) and torch.equal(d[0], base * 12.0)
    graphs.clear()


def test_gpu_op_graph_memory_is_counted_and_released() -> None:
    """op_graph_memory counts what the training ops' graphs keep between steps (at least
    their copies of x and dy); release_op_graphs frees it, and the next steps capture again
    and train as before."""
    from twell import autograd

    autograd.release_op_graphs()
    assert autograd.op_graph_memory() == 0
    torch.manual_seed(0)
    model = Decoder(256, 1024, layers=2).cuda()
    sparsify(model, reduction="per_token", op_graphs=True, dense_capacity=0.0)
    x = torch.randn(512, 256, device="cuda")
    grads = []
    for _ in range(3):
        model.zero_grad()
        train_step(model, x, x / 512, 1e-3)
        grads.append([p.grad.clone() for p in model.parameters()])
    held = autograd.op_graph_memory()
    assert held >= 2 * x.numel() * 2  # at least two layers' bf16 dy buffers
    reserved = torch.cuda.memory_reserved()
    autograd.release_op_graphs()
    assert autograd.op_graph_memory() == 0
    assert torch.cuda.memory_reserved() < reserved
    captures = autograd._BACKWARD_GRAPHS.captures
    for _ in range(3):
        model.zero_grad()
        train_step(model, x, x / 512, 1e-3)
        for a, b in zip(grads[-1], [p.grad for p in model.parameters()], strict=True):
            assert torch.equal(a, b)
    assert autograd._BACKWARD_GRAPHS.captures == captures + 2  # one per layer again
