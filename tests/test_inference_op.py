"""The inference op ``twell::ffn`` on the CPU: registration (opcheck), fake tensors,
``torch.compile(fullgraph=True)`` over SparseMLP and SparseFFN, errors, and the
registry of prepared blocks (with the GPU preparation replaced by a stub)."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch_helpers import LlamaMLP  # noqa: E402

from twell import inference, reference, workloads  # noqa: E402
from twell.options import Options  # noqa: E402
from twell.torch import SparseMLP  # noqa: E402

ARGS = inference.op_arguments(Options())


def _weights(k: int = 32, n: int = 256, gated: bool = True, dtype=torch.float32, seed: int = 0):
    p = workloads.uniform(8, k, n, p=0.05, seed=seed)
    w = [None if not gated else p.w_gate, p.w_up, p.w_down]
    return [None if a is None else torch.from_numpy(np.asarray(a, np.float32)).to(dtype)
            for a in w], torch.from_numpy(np.asarray(p.x, np.float32)).to(dtype)  # fmt: skip


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("shape", [(8,), (2, 4), (0,)])
def test_opcheck(gated: bool, shape: tuple[int, ...]) -> None:
    """torch.library.opcheck: schema, fake implementation against the real one (shapes,
    dtypes, strides), and the op under dynamo/AOT (dynamic shapes included)."""
    (wg, wu, wd), x = _weights(gated=gated)
    x = x[: int(np.prod(shape))].reshape(*shape, x.shape[-1])
    torch.library.opcheck(inference.ffn_op, (x, wg, wu, wd, *ARGS))


def test_the_cpu_op_is_the_reference() -> None:
    (wg, wu, wd), x = _weights(dtype=torch.float64)
    y = inference.ffn_op(x.reshape(2, 4, -1), wg, wu, wd, *ARGS)
    want = reference.ffn(x.numpy(), wg.numpy(), wu.numpy(), wd.numpy())
    assert y.shape == (2, 4, x.shape[-1]) and y.dtype == torch.float64
    np.testing.assert_allclose(y.reshape(8, -1).numpy(), want, rtol=1e-12, atol=1e-12)


def test_fake_tensors_give_the_output_shape() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    (wg, wu, wd), x = _weights(dtype=torch.bfloat16)
    x = x.reshape(2, 4, -1)
    with FakeTensorMode() as mode:
        fx = mode.from_tensor(x)
        fw = [mode.from_tensor(w) for w in (wg, wu, wd)]
        y = inference.ffn_op(fx, *fw, *ARGS)
    assert tuple(y.shape) == (2, 4, x.shape[-1]) and y.dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda x, wg, wu, wd: (x[:, :-8], wg, wu, wd), "x: expected shape"),
        (lambda x, wg, wu, wd: (x, wg[:-1], wu, wd), "w_gate: expected shape"),
        (lambda x, wg, wu, wd: (x, wg, wu, wd.T.contiguous()), "w_down: expected shape"),
        (lambda x, wg, wu, wd: (x, wg[:128], wu[:128], wd[:, :128]), "not a multiple of tile"),
    ],
)
def test_bad_shapes_raise_before_anything_runs(change, message: str) -> None:
    (wg, wu, wd), x = _weights()
    args = [a.contiguous() for a in change(x, wg, wu, wd)]
    with pytest.raises(ValueError, match=message):
        inference.ffn_op(*args, *ARGS)
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    fakes = [mode.from_tensor(a) for a in args]
    with mode, pytest.raises(ValueError, match=message):
        inference.ffn_op(*fakes, *ARGS)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_sparse_mlp_is_one_op_in_a_full_graph(backend: str) -> None:
    """fullgraph=True: dynamo must not break the graph anywhere in SparseMLP's inference
    path; the compiled module gives the eager module's numbers."""
    torch.manual_seed(0)
    mlp = SparseMLP.from_module(LlamaMLP(32, 256))
    x = torch.randn(3, 5, 32)
    compiled = torch.compile(mlp, fullgraph=True, backend=backend)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), mlp(x), rtol=0, atol=0)
        torch.testing.assert_close(compiled(x[:, :2]), mlp(x[:, :2]), rtol=0, atol=0)
    assert mlp.l1 is None and mlp.l0 is None


def test_compiled_graph_holds_the_op() -> None:
    """What dynamo records for SparseMLP's inference: the op twell::ffn, nothing of
    twell's launch code."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch.manual_seed(0)
    mlp = SparseMLP.from_module(LlamaMLP(32, 256))
    graphs = []

    def backend(gm, example_inputs):  # noqa: ANN001, ANN202
        graphs.append(gm)
        return gm.forward

    counter = CompileCounterWithBackend(backend)
    with torch.no_grad():
        torch.compile(mlp, fullgraph=True, backend=counter)(torch.randn(4, 32))
    targets = [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert counter.frame_count == 1 and "twell.ffn.default" in targets


def test_compiled_functional_sparse_ffn_on_the_cpu() -> None:
    import twell

    (wg, wu, wd), x = _weights()
    block = twell.SparseFFN(wg.numpy(), wu.numpy(), wd.numpy())  # NumPy: the reference
    want = block(x.numpy())

    def f(x):  # noqa: ANN001, ANN202
        return inference.ffn(x, wg, wu, wd, Options())

    got = torch.compile(f, fullgraph=True, backend="aot_eager")(x.double())
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------- registry
class _Stub:
    """What prepare_gpu returns, without a GPU."""

    builds = 0

    def __init__(self) -> None:
        _Stub.builds += 1
        self.run = lambda x: x

    def __call__(self, x):  # noqa: ANN001, ANN204
        return x


@pytest.fixture
def stub_gpu(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    import twell._blocks

    monkeypatch.setattr(twell._blocks, "prepare_gpu", lambda *a, **k: (object(), _Stub()))
    monkeypatch.setattr(twell._blocks, "check_weights", lambda *a, **k: None)
    monkeypatch.setattr(inference, "_blocks", {})
    _Stub.builds = 0
    yield


def test_registry_reuses_a_block_until_a_weight_changes(stub_gpu) -> None:  # noqa: ANN001
    (wg, wu, wd), _ = _weights()
    options = Options()
    first = inference.block_for(wg, wu, wd, options)
    assert inference.block_for(wg, wu, wd, options) is first and _Stub.builds == 1
    # Another view of the same memory is the same weight.
    assert inference.block_for(wg.detach(), wu, wd, options) is first
    # Other options: another block.
    assert inference.block_for(wg, wu, wd, Options(slots=16)) is not first
    with torch.no_grad():
        wu.mul_(2)  # an in-place change moves the version counter
    second = inference.block_for(wg, wu, wd, options)
    assert second is not first and _Stub.builds == 3
    inference.forget(wg, wu, wd)  # .data writes: the module drops its blocks by hand
    assert inference.block_for(wg, wu, wd, options) is not second


def test_registry_drops_the_blocks_of_freed_weights(stub_gpu) -> None:  # noqa: ANN001
    (wg, wu, wd), _ = _weights()
    inference.block_for(wg, wu, wd, Options())
    assert len(inference._blocks) == 1
    del wg
    gc.collect()
    (wg2, wu2, wd2), _ = _weights(seed=1)
    inference.block_for(wg2, wu2, wd2, Options())  # a build sweeps the dead entries
    assert len(inference._blocks) == 1


def test_a_copy_of_the_same_values_is_another_weight(stub_gpu) -> None:  # noqa: ANN001
    (wg, wu, wd), _ = _weights()
    first = inference.block_for(wg, wu, wd, Options())
    assert inference.block_for(wg.clone(), wu, wd, Options()) is not first


# ---------------------------------------------------------------------- a caller's memo
class _Held:
    """A stand-in block (weakly referable, kept alive by the test)."""

    def alive(self) -> bool:
        return True


def _remembered(x, weights, options, block=None):  # noqa: ANN001, ANN202
    recent = inference.Recent()
    recent.remember(x, tuple(weights), options, block if block is not None else _HELD)
    return recent


_HELD = _Held()


def test_recent_serves_the_same_call_and_nothing_else() -> None:
    (wg, wu, wd), x = _weights()
    options, block = Options(), _Held()
    recent = _remembered(x, (wg, wu, wd), options, block)
    assert recent.block_for(x.clone(), (wg, wu, wd), options) is block
    assert recent.block_for(x[:4], (wg, wu, wd), options) is None  # another shape
    assert recent.block_for(x.double(), (wg, wu, wd), options) is None  # another dtype
    assert recent.block_for(x, (wg, wu, wd), Options()) is None  # other options
    assert recent.block_for(x.t().contiguous().t(), (wg, wu, wd), options) is None
    assert recent.block_for(x, (wg.clone(), wu, wd), options) is None  # another weight
    assert recent.block_for(x, (None, wu, wd), options) is None


def test_recent_sees_every_weight_change_the_registry_sees(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(inference, "_blocks", {})
    (wg, wu, wd), x = _weights()
    options = Options()
    recent = _remembered(x, (wg, wu, wd), options)
    with torch.no_grad():
        wu.mul_(2)  # in place: the version counter moves
    assert recent.block_for(x, (wg, wu, wd), options) is None
    recent = _remembered(x, (wg, wu, wd), options)
    wd.data = wd.data.clone()  # the same tensor object, its memory elsewhere
    assert recent.block_for(x, (wg, wu, wd), options) is None
    recent = _remembered(x, (wg, wu, wd), options)
    inference._blocks[("a key",)] = {}
    inference.forget(wg, wu, wd)  # nothing of these weights: nothing dropped
    assert recent.block_for(x, (wg, wu, wd), options) is not None
    inference._blocks[tuple(inference._identity(t) for t in (wg, wu, wd))] = {}
    inference.forget(wg, wu, wd)  # a write the version counter does not see
    assert recent.block_for(x, (wg, wu, wd), options) is None


def test_recent_sees_a_weight_moved_to_a_view_of_itself() -> None:
    """``.data`` replaced by a view at the same address (a prefix slice, another dtype of
    the same size) keeps the pointer and the version counter: the shape and dtype tell."""
    (wg, wu, wd), x = _weights()
    options = Options()
    recent = _remembered(x, (wg, wu, wd), options)
    wu.data = wu.data[:128]
    assert recent.block_for(x, (wg, wu, wd), options) is None
    (wg, wu, wd), x = _weights(dtype=torch.bfloat16)
    recent = _remembered(x, (wg, wu, wd), options)
    wd.data = wd.data.view(torch.float16)
    assert recent.block_for(x, (wg, wu, wd), options) is None


def test_recent_takes_a_dead_or_missing_weight_for_another() -> None:
    (wg, wu, wd), x = _weights()
    options = Options()
    recent = _remembered(x, (wg, wu, wd), options)
    del wg
    gc.collect()
    assert recent.block_for(x, (None, wu, wd), options) is None  # the gate freed: not None
    recent = _remembered(x, (None, wu, wd), options)
    assert recent.block_for(x, (wu.clone(), wu, wd), options) is None


def test_recent_serves_no_block_whose_weights_storage_is_gone() -> None:
    class Dead(_Held):
        def alive(self) -> bool:
            return False

    (wg, wu, wd), x = _weights()
    block, options = Dead(), Options()
    recent = _remembered(x, (wg, wu, wd), options, block)
    assert recent.block_for(x, (wg, wu, wd), options) is None


def test_recent_is_one_memo_for_threads_sharing_it() -> None:
    """Two threads that share one memo (replicas of a module) with their own weights: a
    call is served only its own weights' block, however their writes interleave."""
    import threading

    options = Options()
    sets = []
    for seed in (0, 1):
        (wg, wu, wd), x = _weights(seed=seed)
        sets.append(((wg, wu, wd), x, _Held()))
    recent, wrong, errors = inference.Recent(), [0], []

    def loop(i: int) -> None:
        weights, x, block = sets[i]
        try:
            for _ in range(20000):
                got = recent.block_for(x, weights, options)
                if got is None:
                    recent.remember(x, weights, options, block)
                elif got is not block:
                    wrong[0] += 1
                if _ % 97 == 0:
                    recent.clear()
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=loop, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and wrong[0] == 0


def test_a_copied_module_starts_with_an_empty_memo() -> None:
    import copy
    import pickle

    (wg, wu, wd), x = _weights()
    recent = _remembered(x, (wg, wu, wd), Options())
    assert recent.remembered() is _HELD
    for twin in (copy.deepcopy(recent), pickle.loads(pickle.dumps(recent))):
        assert twin.remembered() is None and twin.block_for(x, (wg, wu, wd), Options()) is None
    mlp = SparseMLP.from_module(LlamaMLP(32, 256))
    mlp._recent.remember(x, mlp._weights(), mlp.options, _HELD)
    assert copy.deepcopy(mlp)._recent.remembered() is None
    mlp.eval()  # train()/eval() drop the blocks, and the memo with them
    assert mlp._recent.remembered() is None


def test_recent_keeps_neither_the_weights_nor_the_block_alive() -> None:
    (wg, wu, wd), x = _weights()
    block, options = _Held(), Options()
    recent = _remembered(x, (wg, wu, wd), options, block)
    del block
    gc.collect()
    assert recent.block_for(x, (wg, wu, wd), options) is None  # the block is gone
    wu_ref = weakref.ref(wu)
    recent = _remembered(x, (wg, wu, wd), Options())
    del wu
    gc.collect()
    assert wu_ref() is None  # a replaced weight is freed


def test_recent_never_serves_a_block_the_registry_would_not(stub_gpu) -> None:  # noqa: ANN001
    """Random histories of calls, in-place writes, moved weights (``.data`` replaced),
    ``forget`` and ``clear``: whenever the memo serves a call, the block is the one the
    registry's full path gives for those weights and options at that moment."""
    from hypothesis import example, given, settings
    from hypothesis import strategies as st

    steps = st.lists(
        st.tuples(
            # (calls weighted up: a call the memo may serve follows a call of that shape)
            st.sampled_from(["call"] * 3 + ["write", "move", "forget", "clear", "options"]),
            st.integers(0, 2),
            st.integers(1, 3),
        ),  # fmt: skip
        max_size=30,
    )

    @settings(max_examples=60, deadline=None)
    @given(steps)
    @example([("call", 0, 1), ("call", 0, 1)])  # served whatever the draws
    def run(history: list) -> None:
        inference._blocks.clear()
        (wg, wu, wd), x = _weights()
        weights = [wg, wu, wd]
        option_sets = [Options(), Options(slots=16)]
        options = option_sets[0]
        recent = inference.Recent()
        for action, which, rows in history:
            w = weights[which]
            if action == "write":
                with torch.no_grad():
                    w.mul_(1.0)  # the version counter moves
            elif action == "move":
                w.data = w.data.clone()
            elif action == "forget":
                inference.forget(*weights)
            elif action == "clear":
                recent.clear()
            elif action == "options":
                options = option_sets[which % 2]
            xs = x[:rows].contiguous()
            got = recent.block_for(xs, tuple(weights), options)
            full = inference.block_for(*weights, options)
            if got is not None:
                served[0] += 1
                assert got is full
            elif action == "call":
                recent.remember(xs, tuple(weights), options, full)
        inference._blocks.clear()

    served = [0]
    run()
    assert served[0] > 0  # the memo did serve calls
