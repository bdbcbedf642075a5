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

    class InFlight:
        def query(self) -> bool:
            return False

    auto._pending.clear()
    for _ in range(AUTO_LAG + 1):
        auto._pending.append((torch.tensor([16384], dtype=torch.int32), InFlight(), 16384))
    assert auto.choose() == 1 / 64 and len(auto._pending) == AUTO_LAG + 1  # never waits


def test_a_call_with_most_rows_dense_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer whose rows mostly overflow the row limit runs slower than dense: the first
    such count read warns (DenseRowsWarning), once per process."""
    import warnings

    from twell import capacity

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(capacity, "_warned", [False])

    class Passed:
        def query(self) -> bool:
            return True

    auto = capacity.AutoCapacity()

    def read(count: int, m: int = 4096) -> None:
        for _ in range(capacity.AUTO_LAG):
            auto._pending.append((torch.tensor([count], dtype=torch.int32), Passed(), m))
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
