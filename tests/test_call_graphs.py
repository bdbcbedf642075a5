"""twell._graphs without a GPU: which instantiation of a re-pointed call graph a call
launches, and when it re-points one (fake instantiations stand in for the driver's; the
launches themselves run in the GPU tests, test_gpu_serving.py); how a graph pool is
held; which lent tensors a training op graph copies out before it replays (the replays:
test_gpu_training_policy.py)."""

from __future__ import annotations

import types
import weakref

import pytest

torch = pytest.importorskip("torch")

from twell import _graphs  # noqa: E402


class FakeRepointed:
    """Stands in for twell._graph_nodes.Repointed: records points and launches."""

    made = 0

    def __init__(self, graph: object, ranges: tuple) -> None:
        FakeRepointed.made += 1
        self.ranges = ranges
        self.bases: tuple = tuple(start for start, _ in ranges)
        self.points: list[tuple] = []
        self.launches = 0

    def point(self, bases: tuple) -> None:
        if tuple(bases) != self.bases:
            self.points.append(tuple(bases))
            self.bases = tuple(bases)

    def launch(self, stream: int) -> None:
        self.launches += 1


@pytest.fixture()
def graph(monkeypatch: pytest.MonkeyPatch) -> _graphs._Graph:
    """A large-batch call graph (re-pointed, fresh outputs) over CPU tensors."""
    monkeypatch.setattr(_graphs._graph_nodes, "Repointed", FakeRepointed)
    FakeRepointed.made = 0
    static_x, static_y = torch.zeros(4, 8), torch.zeros(4, 8)
    first = FakeRepointed(None, ((static_x.data_ptr(), 128), (static_y.data_ptr(), 128)))
    torch_graph = types.SimpleNamespace(raw_cuda_graph=lambda: 0)
    return _graphs._Graph(torch_graph, first, static_x, static_y, [], fresh_output=True)


STREAM = 0  # a raw stream handle


def test_alternating_inputs_settle_on_two_instantiations(graph, monkeypatch) -> None:  # noqa: ANN001
    """A loop that drops each output and alternates between two inputs: once each
    instantiation points at one of them, calls launch with no update."""
    out = torch.zeros(4, 8)  # the output buffer a dropping caller gets back every call
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *args, **kwargs: out)
    x0, x1 = torch.ones(4, 8), torch.ones(4, 8)
    for x in (x0, x1):
        assert graph(x, STREAM) is out
    updates = sum(len(e.points) for e in graph.execs)
    for x in (x0, x1, x0, x1):
        graph(x, STREAM)
    assert sum(len(e.points) for e in graph.execs) == updates
    assert FakeRepointed.made == _graphs.EXECS
    assert sum(e.launches for e in graph.execs) == 6
    assert {e.bases for e in graph.execs} == {
        (x0.data_ptr(), out.data_ptr()),
        (x1.data_ptr(), out.data_ptr()),
    }
    assert graph.static_x is None and graph.static_y is None  # nothing copied, nothing kept


def test_a_tensor_subclass_gets_a_plain_tensor_out(graph) -> None:  # noqa: ANN001
    """As from an eager call: the fresh output is a torch.Tensor, not the input's subclass."""

    class Sub(torch.Tensor):
        pass

    y = graph(torch.ones(4, 8).as_subclass(Sub), STREAM)
    assert type(y) is torch.Tensor and y.shape == (4, 8)
    assert type(graph(torch.ones(4, 8), STREAM)) is torch.Tensor


def test_the_least_recently_used_instantiation_is_re_pointed(graph) -> None:  # noqa: ANN001
    xs = [torch.ones(4, 8) for _ in range(3)]
    kept = [graph(x, STREAM) for x in xs]  # three addresses, two instantiations
    assert FakeRepointed.made == 2
    assert {e.bases[0] for e in graph.execs} == {xs[1].data_ptr(), xs[2].data_ptr()}
    assert len(kept) == 3


def test_a_graph_that_could_not_be_re_pointed_replays_with_copies() -> None:
    static_x, static_y = torch.zeros(2, 3), torch.full((2, 3), 7.0)
    replays = []
    torch_graph = types.SimpleNamespace(replay=lambda: replays.append(static_x.clone()))
    graph = _graphs._Graph(torch_graph, None, static_x, static_y, [], fresh_output=True)
    x = torch.arange(6.0).reshape(2, 3)
    y = graph(x, STREAM)
    assert torch.equal(replays[0], x)  # x copied in before the replay
    assert torch.equal(y, static_y) and y.data_ptr() != static_y.data_ptr()  # cloned out


def test_refresh_calls_run_eagerly_and_measure(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(_graphs, "_capturing", lambda: False)
    measured, ran = [], []
    x = torch.zeros(4, 8)

    class Density:
        refresh_every = 256

        def decision(self, m: int, read: bool) -> int:
            return 0

        def measure_next(self) -> None:
            measured.append(1)

    block = _graphs.GraphedBlock(lambda t: ran.append(t) or "eager", Density(), [])
    block._calls = Density.refresh_every - 1
    assert block(x) == "eager"
    assert ran == [x] and measured == [1]


def test_graphs_of_a_freed_cublas_workspace_are_not_replayed(monkeypatch) -> None:  # noqa: ANN001
    """torch frees its cuBLAS workspaces around every warm-up and recording of its graph
    trees: twell counts those frees, and a graph captured before one is stale."""
    calls = []
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: calls.append(1),
                        raising=False)  # fmt: skip
    _graphs._watch_cublas_workspaces()
    _graphs._watch_cublas_workspaces()  # once: not wrapped twice

    class Captured:
        epoch = _graphs._cublas_epoch[0]

    assert _graphs._current(Captured())
    torch._C._cuda_clearCublasWorkspaces()
    assert calls == [1] and not _graphs._current(Captured())


def _epoch_block(monkeypatch) -> tuple:  # noqa: ANN001
    """A GraphedBlock whose eager runs and captures are recorded, without a GPU: its run
    returns "eager", a capture "captured" (and a graph of the current cuBLAS epoch that
    replays as "replayed"). Returns the block and the lists of runs and captures."""
    monkeypatch.setattr(_graphs, "_capturing", lambda: False)
    monkeypatch.setattr(_graphs, "_raw_stream", lambda device: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(_graphs, "_cublas_epoch", [0])
    ran, captured = [], []

    class Density:
        refresh_every = None

        def decision(self, m: int, read: bool) -> int:
            return 0

        def measure_next(self) -> None:
            pass

    class Fake:
        epoch = 0
        replays = 0

        def __call__(self, x, stream):  # noqa: ANN001, ANN204
            return "replayed"

    block = _graphs.GraphedBlock(lambda t: ran.append(t) or "eager", Density(), [])

    def capture(x, stream):  # noqa: ANN001, ANN202
        captured.append(x)
        fake = Fake()
        fake.epoch = _graphs._cublas_epoch[0]
        return fake, "captured"

    block._capture = capture
    return block, ran, captured


def test_after_a_workspace_free_a_shape_is_captured_only_when_it_comes_back(monkeypatch) -> None:  # noqa: ANN001
    """Once torch's graph trees have freed the cuBLAS workspaces, a shape is captured only
    when it comes back within one epoch (a generate call's prefill, between two
    recordings of the trees, runs eagerly instead of capturing a graph per call)."""
    block, ran, captured = _epoch_block(monkeypatch)
    x, y = torch.zeros(4, 8), torch.zeros(2, 8)
    assert block(x) == "captured" and block(x) == "replayed"  # no free yet: at once
    _graphs._cublas_epoch[0] = 1  # the trees freed the workspaces
    assert block(y) == "eager"  # a new shape: first sighting in this epoch
    assert block(y) == "captured" and block(y) == "replayed"
    _graphs._cublas_epoch[0] = 2
    assert block(y) == "eager"  # stale graph dropped
    _graphs._cublas_epoch[0] = 3  # freed again before the shape came back
    assert block(y) == "eager" and len(captured) == 2


def test_a_lost_shape_waits_longer_while_its_captures_do_not_pay(monkeypatch) -> None:  # noqa: ANN001
    """A shape whose graph a workspace free dropped is captured again after REGAIN_FIRST
    calls within one epoch; after each graph that was dropped before PAID_REPLAYS replays
    it waits twice as long (up to REGAIN): where every capture makes torch's trees record
    (transformers' static-cache generate while its cache moved), captures back off, and
    where the trees stop recording, a prefill shape replays again from its next calls."""
    block, ran, captured = _epoch_block(monkeypatch)
    monkeypatch.setattr(_graphs, "REGAIN_FIRST", 2)
    monkeypatch.setattr(_graphs, "REGAIN", 8)
    monkeypatch.setattr(_graphs, "PAID_REPLAYS", 3)
    x = torch.zeros(4, 8)
    epoch = 0

    def free() -> None:
        nonlocal epoch
        epoch += 1
        _graphs._cublas_epoch[0] = epoch

    def until_captured() -> int:
        """Eager calls before the next capture (that call's result checked)."""
        calls = 0
        while (result := block(x)) == "eager":
            calls += 1
        assert result == "captured"
        return calls

    assert block(x) == "captured"
    free()
    assert until_captured() == 2 - 1  # the first loss: REGAIN_FIRST calls, then capture
    free()  # dropped before any replay: the wait doubles, up to REGAIN
    assert until_captured() == 4 - 1
    free()
    assert until_captured() == 8 - 1
    free()
    assert until_captured() == 8 - 1
    free()
    block(x)  # one call of the wait ...
    free()  # ... and another free: the count restarts in the new epoch, the wait stays
    assert until_captured() == 8 - 1
    assert [block(x) for _ in range(3)] == ["replayed"] * 3  # this one pays
    free()
    assert until_captured() == 2 - 1  # back to REGAIN_FIRST
    assert len(captured) == 7


def test_a_replay_first_copies_out_what_later_captures_lent() -> None:
    """OpGraphs._protect: a graph about to replay may write its scratch where graphs
    captured after it keep their outputs, so the leases those graphs gave out and that
    are still held are copied out first; earlier graphs' leases, released ones and ones
    already copied are left alone."""
    graphs = _graphs.OpGraphs()

    def lent(order: int, held: bool = True) -> _graphs.Lease:
        lease = _graphs.Lease([torch.arange(4.0) + order], static=True)
        if not held:
            lease.release()
        leases.append(lease)  # the caller (the training backward) holds them
        graphs._leases.append((order, weakref.ref(lease)))
        return lease

    leases: list[_graphs.Lease] = []
    early, same, later, released = lent(1), lent(2), lent(3), lent(4, held=False)
    places = [lease.tensors[0].data_ptr() for lease in leases]
    graphs._protect(2)
    assert later.static is False and later.tensors[0].data_ptr() != places[2]
    assert torch.equal(later.tensors[0], torch.arange(4.0) + 3)  # the values, copied
    for lease, place in ((early, places[0]), (same, places[1]), (released, places[3])):
        assert lease.static and lease.tensors[0].data_ptr() == place
    assert [order for order, _ in graphs._leases] == [1, 2]  # the rest need no more checks
    del leases[:2], early, same
    graphs._protect(0)  # gone leases drop out
    assert graphs._leases == []


class FakeOpGraph:
    """Stands in for a captured op graph: a replay runs ``fn`` on the captured inputs
    into the captured outputs, then writes NaN over ``scratch`` (memory that a graph
    captured later may have been given for its outputs)."""

    def __init__(self, fn, inputs: tuple, outputs: tuple) -> None:  # noqa: ANN001
        self.fn, self.inputs, self.outputs, self.scratch = fn, inputs, outputs, []

    def replay(self) -> None:
        for out, value in zip(self.outputs, self.fn(*self.inputs), strict=True):
            out.copy_(value)
        for t in self.scratch:
            t.fill_(float("nan"))


def test_two_forwards_keep_what_the_first_lent(monkeypatch) -> None:  # noqa: ANN001
    """The op graphs' call path without a GPU (fake graphs): two layers' forwards
    captured in order, then two forwards before the backward. The first layer's replay
    writes scratch over the second layer's outputs, which the first forward lent to its
    backward: they are copied out before, so that forward's lease keeps its values."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    graphs = _graphs.OpGraphs()
    made: list[FakeOpGraph] = []

    def capture(fn, args, pinned, device):  # noqa: ANN001, ANN202
        buffers = tuple(None if i in pinned else a.clone() for i, a in enumerate(args))
        inputs = tuple(a if b is None else b for a, b in zip(args, buffers, strict=True))
        fake = FakeOpGraph(fn, inputs, tuple(t.clone() for t in fn(*inputs)))
        made.append(fake)
        graphs.captures += 1
        return _graphs._OpGraph(fake, buffers, fake.outputs, graphs.captures)

    monkeypatch.setattr(graphs, "_capture", capture)
    weights = [torch.tensor([2.0]), torch.tensor([3.0])]

    def forward(layer: int, x: torch.Tensor) -> tuple:
        return graphs._call(lambda x, w: (x * w, x + w), (x, weights[layer]), frozenset({1}),
                            None, ((0,), (1,)))  # fmt: skip

    x = torch.arange(4.0)
    for _ in range(2):  # first sight (eager), then captured; the backward releases
        for layer in (0, 1):
            forward(layer, x)[1].release()
    assert graphs.captures == 2
    made[0].scratch = [made[1].outputs[1]]  # layer 0's scratch lies where layer 1's output is
    (_, lease0a), (_, lease1a) = forward(0, x), forward(1, x)  # the first forward
    second = [forward(0, x + 1), forward(1, x + 1)]  # the second forward
    lease1b = second[1][1]
    assert graphs.replays == 6 and graphs.captures == 2
    assert torch.equal(lease1a.tensors[1], x + 3.0)  # copied out before layer 0's replay
    assert torch.equal(lease0a.tensors[1], x + 2.0)  # copied out before its own replay
    assert torch.equal(lease1b.tensors[1], x + 4.0)
    assert not lease1a.static and lease1b.static


class FakeCaptured:
    """Stands in for torch.cuda.CUDAGraph: a replay runs the captured call again."""

    def __init__(self) -> None:
        self.run = None

    def replay(self) -> None:
        self.run()


def _fake_cuda(monkeypatch) -> None:  # noqa: ANN001
    """OpGraphs' capture path on the CPU: no streams, pools or graphs of CUDA's."""

    class Stream:
        def __init__(self, *args: object) -> None:
            pass

        def wait_stream(self, other: object) -> None:
            pass

    def capture_into(graph, pool, side, fn, *args):  # noqa: ANN001, ANN202
        captured = fn(*args)

        def run() -> None:  # a replay writes where the capture's outputs lie
            for mine, value in zip(captured, fn(*args), strict=True):
                if mine is not value:
                    mine.copy_(value)

        graph.run = run
        return captured

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, 0))
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: Stream())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeCaptured)
    monkeypatch.setattr(_graphs, "_capture_into", capture_into)


def test_handed_over_outputs_are_replayed_into_only_when_free(monkeypatch) -> None:  # noqa: ANN001
    """OpGraphs(hand_over=...) on the CPU with fake graphs: the output comes back in the
    graph's own tensor (allocated outside the pool), no copy; a held result, a view of
    it or autograd's ``.grad`` keeps the graph from replaying into it: a second slot
    serves, and with both held the call runs eagerly. Values are right throughout."""
    _fake_cuda(monkeypatch)
    graphs = _graphs.OpGraphs(hand_over=lambda args: (((4, 8), torch.float32), None))

    def fn(x, w, out=None):  # noqa: ANN001, ANN202
        y = x * w if out is None else torch.mul(x, w, out=out[0])
        return y, (x * w).sum()  # the second output: copied

    def call(x):  # noqa: ANN001, ANN202
        y, total = graphs._call(fn, (x, w), frozenset({1}), None, None)
        assert torch.equal(y, x * w) and torch.equal(total, (x * w).sum())
        return y

    w = torch.full((4, 8), 2.0)
    x = torch.arange(32.0).reshape(4, 8)
    call(x)  # first sight: eager
    a = call(x + 1)  # captured, replayed: the graph's own tensor
    ((slot,),) = graphs._graphs.values()
    home = slot.outputs[0]
    assert a.data_ptr() == home.data_ptr() and graphs.captures == 1
    del a
    b = call(x + 2)  # free again: the same memory
    assert b.data_ptr() == home.data_ptr() and graphs.captures == 1
    view = call(x + 3).view(-1)  # slot 0 held by b: a second slot; a view of it kept
    assert graphs.captures == 2 and view.data_ptr() not in (home.data_ptr(),)
    assert len(graphs) == 2  # one key, two slots
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: [])  # an empty pool
    # both slots' input buffers and handed-over tensors, the held ones included
    assert graphs.memory() == 2 * (x.numel() * 4 + home.numel() * 4)
    replays = graphs.replays
    c = call(x + 4)  # both held: eager
    assert graphs.replays == replays and graphs.captures == 2
    assert torch.equal(b, (x + 2) * w) and torch.equal(view, ((x + 3) * w).view(-1))
    del b
    d = call(x + 5)  # slot 0 free once b is gone
    assert d.data_ptr() == home.data_ptr() and torch.equal(view, ((x + 3) * w).view(-1))
    del c, d, view

    p = torch.nn.Parameter(torch.zeros(4, 8))

    class Op(torch.autograd.Function):
        @staticmethod
        def forward(ctx, p):  # noqa: ANN001, ANN205
            return p.clone()

        @staticmethod
        def backward(ctx, grad):  # noqa: ANN001, ANN205
            return call(x + 6)  # a gradient handed over by the graph

    Op.apply(p).sum().backward()
    assert p.grad.data_ptr() == home.data_ptr()  # torch took it as .grad without a copy
    e = call(x + 7)  # .grad holds slot 0: slot 1 serves
    assert e.data_ptr() != home.data_ptr() and torch.equal(p.grad, (x + 6) * w)
    del e
    p.grad = None
    assert call(x + 8).data_ptr() == home.data_ptr()


def test_without_torchs_use_count_nothing_is_handed_over(monkeypatch) -> None:  # noqa: ANN001
    _fake_cuda(monkeypatch)
    monkeypatch.delattr(torch._C, "_storage_Use_Count")
    graphs = _graphs.OpGraphs(hand_over=lambda args: (((4,), torch.float32),))

    def fn(x, out=None):  # noqa: ANN001, ANN202
        return (x * 2 if out is None else torch.mul(x, 2, out=out[0]),)

    x = torch.arange(4.0)
    for _ in range(3):
        (y,) = graphs._call(fn, (x,), frozenset(), None, None)
        assert torch.equal(y, x * 2)
    ((slot,),) = graphs._graphs.values()
    assert slot.users == (None,) and y.data_ptr() != slot.outputs[0].data_ptr()


def test_a_failed_second_slot_runs_the_call_eagerly(monkeypatch) -> None:  # noqa: ANN001
    """A second slot whose capture fails (say, out of memory while the first slot's
    results are held): that call and later busy ones run eagerly, the first slot keeps
    replaying; once the key's graphs are dropped, it may take two slots again."""
    _fake_cuda(monkeypatch)
    captures = []
    fake = _graphs._capture_into

    def capture_into(graph, pool, side, fn, *args):  # noqa: ANN001, ANN202
        captures.append(1)
        if len(captures) == 2:
            raise RuntimeError("out of memory")
        return fake(graph, pool, side, fn, *args)

    monkeypatch.setattr(_graphs, "_capture_into", capture_into)
    graphs = _graphs.OpGraphs(hand_over=lambda args: (((4,), torch.float32),))

    def fn(x, out=None):  # noqa: ANN001, ANN202
        return (x * 2 if out is None else torch.mul(x, 2, out=out[0]),)

    def call(x):  # noqa: ANN001, ANN202
        (y,) = graphs._call(fn, (x,), frozenset(), None, None)
        assert torch.equal(y, x * 2)
        return y

    x = torch.arange(4.0)
    call(x)
    held = call(x + 1)  # slot 0
    ((slot,),) = graphs._graphs.values()
    eager = call(x + 2)  # slot 0 held; the second slot's capture fails: eager
    assert eager.data_ptr() != slot.outputs[0].data_ptr() and len(captures) == 2
    call(x + 3)  # still held: eager, no second try
    assert len(captures) == 2 and torch.equal(held, (x + 1) * 2)
    del held, eager
    assert call(x + 4).data_ptr() == slot.outputs[0].data_ptr()  # slot 0 replays
    monkeypatch.setattr(_graphs, "_cublas_epoch", [_graphs._cublas_epoch[0] + 1])
    call(x)  # the key's graphs dropped (a freed cuBLAS workspace): eager
    first = call(x)  # captured again
    second = call(x)  # and a second slot may be tried again
    assert len(captures) == 4 and first.data_ptr() != second.data_ptr()


def test_the_lease_list_stays_short_without_replays() -> None:
    """Leases are remembered for later replays; calls that only capture (a setting that
    moves every call) must not grow the list without bound."""
    graphs = _graphs.OpGraphs(capacity=4)
    graphs.captures = 100  # the capture numbers the leases below carry are all past
    held = []
    for i in range(100):
        lease = _graphs.Lease([torch.zeros(1)], static=True)
        if i % 10 == 0:
            held.append(lease)  # a few still held by their backward
        else:
            lease.release()
        graphs._leases.append((i, weakref.ref(lease)))
        if len(graphs._leases) > 2 * graphs.capacity:
            graphs._protect(graphs.captures)
    # the leases still held, and at most the unpruned tail of the others
    assert len(graphs._leases) <= len(held) + 2 * graphs.capacity
    assert all(lease.static for lease in held)  # forgetting copies nothing
    del held[:]
    graphs._protect(graphs.captures)
    assert graphs._leases == []


def test_the_graphs_pool_holds_one_use_while_a_graph_of_it_lives(monkeypatch) -> None:  # noqa: ANN001
    """_pool creates a graph pool holding one use of it for as long as a graph captured
    into it lives (the routing before a capture must never find it unused), and gives
    that use back when the last such graph goes; a later capture takes a new pool."""
    import gc

    calls = []
    names = ("_cuda_beginAllocateCurrentThreadToPool", "_cuda_endAllocateToPool",
             "_cuda_releasePool")  # fmt: skip
    for name in names:
        monkeypatch.setattr(torch._C, name, lambda d, p, name=name: calls.append((name, p)),
                            raising=False)  # fmt: skip
    handles = iter(range(1, 10))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, next(handles)))
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: object())

    class Graph:
        pass

    class Stream:
        cuda_stream = 7

    device = torch.device("cuda", 0)
    first, second = Graph(), Graph()
    pool, _ = _graphs._pool(first, device, Stream())
    assert _graphs._pool(second, device, Stream())[0] == pool == (0, 1)
    assert calls == [(names[0], pool), (names[1], pool)]  # one use held, nothing routed
    with _graphs._allocating_from(pool, device):
        assert calls[-1] == (names[0], pool)
    assert calls[-2:] == [(names[1], pool), (names[2], pool)]  # the routing's use given back
    del first
    gc.collect()
    assert len(calls) == 5  # the other graph still holds the pool
    del second
    gc.collect()
    assert calls[-1] == (names[2], pool) and len(calls) == 6
    assert _graphs._pool(Graph(), device, Stream())[0] == (0, 2)
