"""The training path's policies, on the CPU: ``dense_capacity="auto"``
(twell.options.auto_capacity, twell.capacity.train_capacity and AutoCapacity). On CUDA,
with the op graphs: tests/gpu/test_gpu_training_policy.py.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
from torch_helpers import LlamaMLP  # noqa: E402

from twell.torch import SparseMLP  # noqa: E402


class _Passed:
    """A CUDA event that has completed (a copy that has landed)."""

    def query(self) -> bool:
        return True

    def record(self, stream: object = None) -> None:
        pass


class _InFlight(_Passed):
    """A CUDA event still pending (a copy in flight)."""

    def query(self) -> bool:
        return False


def test_train_capacity_holds_the_headroom_in_steps_of_1_64() -> None:
    from twell.capacity import STEP, train_capacity

    m = 4096
    assert train_capacity(0, m) == 0.0 and train_capacity(5, 0) == 0.0
    assert train_capacity(1, m) == 1 / 64
    assert train_capacity(235, m) == 5 / 64  # 6% heavy: 320 rows, not a quarter of M
    assert train_capacity(m, m) == 1.0
    for m in (1, 3, 100, 3000, 4096, 16384):
        for count in range(0, m + 1, max(1, m // 97)):
            f = train_capacity(count, m)
            assert f == 0.0 if count == 0 else 0.0 < f <= 1.0
            assert (f / STEP).is_integer()
            assert f == 1.0 or math.ceil(f * m) >= 1.25 * count
            if count and f > STEP:  # the smallest such step
                assert (f - STEP) * m < 1.25 * count


def test_auto_capacity_goes_up_at_once_and_down_after_patience(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """AutoCapacity.choose on counts fed by hand (events that have passed): each choice
    reads the count of AUTO_LAG calls before; up at once, down only after AUTO_PATIENCE
    calls in a row asked for less, to the most they asked."""
    from twell.capacity import AUTO_LAG, AutoCapacity
    from twell.options import AUTO_PATIENCE

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)

    auto = AutoCapacity()

    def feed(count: int, m: int = 16384) -> None:
        auto._pending.append((torch.tensor([count], dtype=torch.int32), _Passed(), m))

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
    assert after(5000) == 15 / 64  # ceil(1.25 * 3000 / 256) steps of M / 64
    for _ in range(AUTO_LAG - 1):
        after(100)
    assert auto.fraction == 25 / 64
    for _ in range(AUTO_PATIENCE - 1):  # these read the counts of 100
        assert after(100) == 25 / 64
    assert after(0) == 1 / 64  # the most the last AUTO_PATIENCE calls asked for
    assert len(auto._free) >= 1  # the pinned buffers are reused
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    pending = len(auto._pending)
    assert auto.choose() == 0.0 and auto.fraction == 1 / 64  # a capture runs without
    assert len(auto._pending) == pending  # nothing read while capturing
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)

    auto._pending.clear()
    for _ in range(AUTO_LAG + 1):
        auto._pending.append((torch.tensor([16384], dtype=torch.int32), _InFlight(), 16384))
    assert auto.choose() == 1 / 64 and len(auto._pending) == AUTO_LAG + 1  # never waits


def test_a_call_with_most_rows_dense_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer whose rows mostly overflow the row limit runs slower than dense: the first
    such count read warns (DenseRowsWarning), once per process."""
    import warnings

    from twell import capacity

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(capacity, "_warned", [False])

    auto = capacity.AutoCapacity()

    def read(count: int, m: int = 4096) -> None:
        for _ in range(capacity.AUTO_LAG):
            auto._pending.append((torch.tensor([count], dtype=torch.int32), _Passed(), m))
        auto.choose()

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        read(2048)  # half of the rows: no warning
    with pytest.warns(capacity.DenseRowsWarning, match="2049 of a training call's 4096"):
        read(2049)
    assert auto.fraction == capacity.train_capacity(2049, 4096)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        read(4096)  # once per process
        capacity.AutoCapacity()._take(1.0)


def test_auto_capacity_survives_a_deep_copy() -> None:
    """copy.deepcopy of a model (an EMA copy, say) keeps the choice, not the CUDA state."""
    import copy

    mlp = SparseMLP.from_module(LlamaMLP(32, 256))
    mlp._auto.fraction = 1 / 16
    twin = copy.deepcopy(mlp)
    assert twin._auto is not mlp._auto and twin._auto.fraction == 1 / 16
    assert not twin._auto._pending and not twin._auto._free


def test_for_weights_keeps_one_auto_capacity_per_live_weight_storage() -> None:
    """The compiled ops' "auto": one AutoCapacity per layer (its w_up), also where
    layers are views of one flat buffer, dropped once the storage is gone."""
    import gc

    from twell import capacity

    w = torch.zeros(16, 8)
    other = torch.zeros(16, 8)
    auto = capacity.for_weights(w)
    assert capacity.for_weights(w) is auto and capacity.for_weights(w.view(16, 8)) is auto
    assert capacity.for_weights(other) is not auto
    assert capacity.for_weights(w[8:]) is not capacity.for_weights(w[:8])
    kept = capacity.for_weights(other)
    del w, auto
    gc.collect()
    new = torch.zeros(4, 4)
    capacity.for_weights(new)  # a new layer sweeps the entries of dead storages
    assert not any(ref.expired() for ref, _ in capacity._by_weights.values())
    assert capacity.for_weights(other) is kept


def test_train_switch_goes_dense_at_once_and_back_after_patience(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """TrainSwitch.choose on L0s fed by hand (events that have passed): each choice reads
    the call AUTO_LAG calls before; a call denser than the crossover at its size turns
    dense math on at once, AUTO_PATIENCE calls in a row at or below it turn it off; a
    capture reads nothing and takes the ops; a copy in flight is never waited for."""
    from twell.capacity import AUTO_LAG, TrainSwitch
    from twell.kernels import density
    from twell.options import AUTO_PATIENCE

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(density, "TRAIN_CROSSOVER", ((4096, 0.01), (16384, 0.02)))
    density.train_crossover.cache_clear()

    switch = TrainSwitch()

    def after(l0: float, m: int = 16384, n: int = 1000) -> bool:
        switch._pending.append((torch.tensor([l0]), _Passed(), m, n))
        return switch.choose()

    try:
        assert switch.choose() is False  # nothing recorded yet
        for _ in range(AUTO_LAG - 1):
            assert after(15.0) is False  # not read yet
        assert after(19.0) is False  # reads the first 15: 1.5% of N, below 2% at 16384
        assert after(25.0, m=4096) is False  # reads the 19: below
        for _ in range(AUTO_LAG - 2):
            after(5.0)
        assert after(5.0) is True  # reads the 2.5% at 4096 tokens (crossover 1%)
        assert after(30.0, m=8192) is True  # reads a 5: below, once
        for _ in range(AUTO_PATIENCE - 1):  # the first reads the 30: 3% against 1.5%
            assert after(5.0) is True  # at 8192 tokens, which starts the count again
        for _ in range(AUTO_LAG):
            after(5.0)
        assert switch.dense is False  # AUTO_PATIENCE calls in a row below: the ops again
        assert len(switch._free) >= 1  # the pinned buffers are reused
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        switch.dense = True
        pending = len(switch._pending)
        assert switch.choose() is False and switch.dense  # a capture takes the ops
        assert len(switch._pending) == pending  # and reads nothing
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)

        switch._pending.clear()
        for _ in range(AUTO_LAG + 1):
            switch._pending.append((torch.tensor([0.0]), _InFlight(), 16384, 1000))
        assert switch.choose() is True and len(switch._pending) == AUTO_LAG + 1
    finally:
        density.train_crossover.cache_clear()


def test_the_train_switch_survives_a_deep_copy_and_stays_off_the_cpu() -> None:
    """A copy keeps the switch's state, not its CUDA state; on the CPU a training call
    takes the reference ops and records nothing; density_switch=False has no switch."""
    import copy

    mlp = SparseMLP.from_module(LlamaMLP(32, 256))
    assert mlp._switch is not None and "density_switch=True" in repr(mlp)
    mlp._switch.dense = True
    twin = copy.deepcopy(mlp)
    assert twin._switch is not mlp._switch and twin._switch.dense
    assert not twin._switch._pending and not twin._switch._free
    x = torch.randn(8, 32, requires_grad=True)
    mlp(x).sum().backward()
    assert not mlp._switch._pending
    off = SparseMLP.from_module(LlamaMLP(32, 256), density_switch=False)
    assert off._switch is None and not off.options.density_switch
    with pytest.raises(TypeError, match="density_switch: expected a bool"):
        SparseMLP.from_module(LlamaMLP(32, 256), density_switch=1)


def test_activation_checkpointing_through_a_sparse_mlp_gives_its_gradients() -> None:
    """torch.utils.checkpoint (non-reentrant: the forward runs again inside the backward)
    around a SparseMLP on the CPU: the same gradients as without it."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    mlp = SparseMLP.from_module(LlamaMLP(32, 256))
    x = torch.randn(8, 32)
    grads = []
    for wrap in (True, False):
        xi = x.clone().requires_grad_()
        mlp.zero_grad(set_to_none=True)
        y = checkpoint(mlp, xi, use_reentrant=False) if wrap else mlp(xi)
        y.square().sum().backward()
        grads.append([xi.grad, *(p.grad for p in mlp.parameters())])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


def test_recorded_values_are_read_auto_lag_calls_later_in_reused_buffers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """record() then choose(), as a training loop calls them (events and pinned memory
    faked on the CPU): a call's value is read AUTO_LAG calls later, the host buffers are
    reused once read, and a capture records nothing."""
    from twell.capacity import AUTO_LAG, AutoCapacity, TrainSwitch, train_capacity
    from twell.kernels import density

    empty = torch.empty
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "Event", _Passed)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    made = []

    def pinned(*args: object, pin_memory: bool = False, **kwargs: object) -> torch.Tensor:
        made.append(pin_memory)
        return empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", pinned)
    auto, switch = AutoCapacity(), TrainSwitch()
    choices = []
    for count in [3000] + [0] * (AUTO_LAG + 1):
        choices.append((auto.choose(), switch.choose()))
        auto.record(torch.tensor([count], dtype=torch.int32), 16384)
        switch.record(torch.tensor(1000.0 if count else 1.0), 16384, 5632)
    assert choices[:AUTO_LAG] == [(0.0, False)] * AUTO_LAG  # nothing read yet
    assert choices[AUTO_LAG] == (
        train_capacity(3000, 16384),
        1000 / 5632 > density.train_crossover(16384),
    )
    assert choices[AUTO_LAG][1] is True
    assert len(auto._pending) == len(switch._pending) == AUTO_LAG
    assert made == [True] * (2 * AUTO_LAG)  # AUTO_LAG pinned buffers each, then reused
    assert auto._pending[0][0].dtype == torch.int32 and switch._pending[0][0].dtype == torch.float32
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    auto.record(torch.tensor([5], dtype=torch.int32), 16384)
    switch.record(torch.tensor(1.0), 16384, 5632)
    assert len(auto._pending) == len(switch._pending) == AUTO_LAG  # a capture records nothing


def test_one_copy_carries_l0_and_the_heavy_row_count_to_both_policies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """TrainSwitch.record(stats, m, n, auto): one pinned copy of (L0, count) per call; when
    read (AUTO_LAG calls later) the L0 goes to the switch and the count to the
    AutoCapacity, whose choice is what its own record would have given; counts recorded
    before the AutoCapacity's reset are dropped (a layer back from dense math starts at 0).
    """
    from twell.capacity import AUTO_LAG, AutoCapacity, TrainSwitch, train_capacity

    empty = torch.empty
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "Event", _Passed)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: empty(*a, **k))
    joint, alone = (AutoCapacity(), TrainSwitch()), (AutoCapacity(), TrainSwitch())
    seen = []
    for count in [3000, 0, 40, 0, 0, 0]:
        l0 = 12.0 + count / 1000
        for auto, switch in (joint, alone):
            seen.append((switch.choose(), auto.choose()))
        joint[1].record(torch.tensor([l0, float(count)]), 16384, 5632, joint[0])
        alone[0].record(torch.tensor([count], dtype=torch.int32), 16384)
        alone[1].record(torch.tensor(l0), 16384, 5632)
    assert seen[0::2] == seen[1::2]  # joint == separate copies, call by call
    assert seen[2 * AUTO_LAG] == (False, train_capacity(3000, 16384))
    assert len(joint[1]._pending) == AUTO_LAG and not joint[0]._pending
    assert joint[1]._pending[0][0].shape == (2,)

    auto, switch = AutoCapacity(), TrainSwitch()
    for _ in range(AUTO_LAG):
        switch.record(torch.tensor([12.0, 3000.0]), 16384, 5632, auto)
    auto.reset()  # e.g. the layer ran dense math meanwhile
    switch.choose()
    assert auto.choose() == 0.0  # the counts of before the reset were dropped
    for _ in range(AUTO_LAG):  # calls after the reset: theirs are read, in turn
        switch.record(torch.tensor([12.0, 3000.0]), 16384, 5632, auto)
        switch.choose()
    assert auto.choose() == train_capacity(3000, 16384)


def test_random_call_histories_read_each_value_auto_lag_calls_later_in_call_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SparseMLP's use of the two policies through one queue (the switch's choice, then on
    the ops "auto"'s choice and one copy of (L0, count); on dense math a reset and the L0
    alone), over random histories of L0s, counts and batch sizes, with every copy landed
    or some still in flight: each choice equals an oracle's that takes call i's L0 at the
    first choice made at least AUTO_LAG calls later with its copy landed, in call order,
    and its count likewise unless the layer ran dense math in between."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from twell import capacity
    from twell.capacity import AUTO_LAG, AutoCapacity, TrainSwitch, train_capacity

    monkeypatch.setattr(capacity, "_warned", [True])  # (most rows heavy in some draws)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: empty(*a, **k))

    class Event:  # a copy that lands once the test says so
        def __init__(self) -> None:
            self.done = False

        def record(self, stream: object = None) -> None:
            self.done = False
            events.append(self)

        def query(self) -> bool:
            return self.done

    events: list[Event] = []
    monkeypatch.setattr(torch.cuda, "Event", Event)
    call = st.tuples(
        st.sampled_from([2.0, 60.0, 400.0]),  # L0 of N = 5632: sparse, near, dense
        st.integers(0, 3000),  # heavy rows
        st.sampled_from([4096, 16384]),
        st.booleans(),  # whether the copies so far land before the next call
    )

    @settings(max_examples=60, deadline=None)
    @given(st.lists(call, min_size=1, max_size=40))
    def check(calls: list[tuple[float, int, int, bool]]) -> None:
        events.clear()
        auto, switch = AutoCapacity(), TrainSwitch()
        want_auto, want_switch = AutoCapacity(), TrainSwitch()  # fed by the oracle
        landed: list[int] = []  # calls whose copy has landed
        taken = 0  # calls the oracle has read, in order
        history: list[tuple[float, int, int, bool]] = []  # (l0, count, m, on the ops)
        resets: list[int] = []  # calls that reset "auto"
        for i, (l0, count, m, land) in enumerate(calls):
            # the oracle: calls at least AUTO_LAG back, in order, while their copies landed
            while taken <= i - AUTO_LAG and taken in landed:
                o_l0, o_count, o_m, o_ops = history[taken]
                want_switch._take(o_l0 / 5632, o_m)
                if o_ops and not any(taken < r < i for r in resets):
                    want_auto._take(train_capacity(o_count, o_m))
                taken += 1
            dense = switch.choose()
            assert dense == want_switch.dense, (i, calls)
            if dense:
                auto.reset()
                want_auto.fraction, want_auto._lower, want_auto._lower_max = 0.0, 0, 0.0
                resets.append(i)
                switch.record(torch.tensor(l0), m, 5632)
            else:
                assert auto.choose() == want_auto.fraction, (i, calls)
                switch.record(torch.tensor([l0, float(count)]), m, 5632, auto)
            history.append((l0, count, m, not dense))
            if land:
                for event in events:
                    event.done = True
                landed[:] = list(range(i + 1))
        assert not auto._pending

    check()


def test_the_current_stream_object_is_made_once_per_raw_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The policies' event records take torch's current stream as an object made once per
    (device, raw stream): the same object while the raw stream stays, a new one when the
    caller switches streams, and a bounded cache."""
    from twell import capacity

    raw = {"stream": 11}
    made = []

    def current_stream(device: int | None = None) -> object:
        made.append((device, raw["stream"]))
        return object()

    monkeypatch.setattr(
        torch._C, "_cuda_getCurrentRawStream", lambda d: raw["stream"], raising=False
    )
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(capacity, "_streams", {})
    first = capacity._current_stream(0)
    assert capacity._current_stream(0) is first and made == [(0, 11)]
    raw["stream"] = 12  # the caller's own stream
    assert capacity._current_stream(0) is not first and made[-1] == (0, 12)
    assert capacity._current_stream(1) is not first and made[-1] == (1, 12)
    for s in range(100):
        raw["stream"] = 100 + s
        capacity._current_stream(0)
    assert len(capacity._streams) <= 65
