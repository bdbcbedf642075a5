"""The density switch's rule (twell.kernels.density), from its statistics alone: which
batch sizes and statistics send a call to dense math. The GPU side (the statistics
measured on the device, read without a wait) is in tests/test_gpu_serving.py.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from twell.kernels.density import (
    CROSSOVER,
    HEAVY_DENSE,
    REFRESH_EVERY,
    WHOLE_BATCH_SHARE,
    DensitySwitch,
    crossover,
    light_mean,
)

N = 5632


def switch(  # noqa: ANN201
    estimate: float | None, heavy_share: float = 0.0, enabled: bool = True
):
    s = DensitySwitch(N, row_limit=168, enabled=enabled)
    s.estimate, s.heavy_share = estimate, heavy_share
    return s


def test_crossover_passes_through_its_points_and_holds_past_the_ends() -> None:
    for m, fraction in CROSSOVER:
        assert crossover(m) == pytest.approx(fraction)
    assert crossover(1) == CROSSOVER[0][1]
    assert crossover(1 << 20) == CROSSOVER[-1][1]


@given(st.integers(1, 1 << 20))
def test_crossover_lies_between_its_neighbouring_points(m: int) -> None:
    low = max((p for p in CROSSOVER if p[0] <= m), default=CROSSOVER[0])
    high = min((p for p in CROSSOVER if p[0] >= m), default=CROSSOVER[-1])
    lo, hi = sorted((low[1], high[1]))
    assert lo - 1e-12 <= crossover(m) <= hi + 1e-12


@pytest.mark.skipif(CROSSOVER[:1] != ((1, 0.2),), reason="the H100's crossover only")
def test_measured_cases() -> None:
    # H100, K=2048, N=5632: uniform 0.5% of N active pays at 64 and 2048 tokens, not at
    # 256; 2% pays at 16 tokens, not at 64
    uniform, two_percent = 0.005 * N, 0.02 * N
    assert not switch(uniform).go_dense(64, False)
    assert switch(uniform).go_dense(256, False)
    assert not switch(uniform).go_dense(2048, False)
    assert switch(0.01 * N).go_dense(2048, False)
    assert not switch(two_percent).go_dense(16, False)
    assert switch(two_percent).go_dense(64, False)


def test_a_heavy_row_sends_only_mid_sized_batches_dense() -> None:
    low, high = HEAVY_DENSE
    share = 0.01  # one token in a hundred is heavy
    s = switch(10.0, heavy_share=share)
    assert not s.go_dense(low - 1, False)
    assert not s.go_dense(high, False)
    assert s.go_dense(max(low, math.ceil(0.5 / share)), False) and s.dense
    assert not s.go_dense(math.ceil(0.5 / share) - 1, False)  # no heavy row expected
    assert not switch(10.0, heavy_share=0.0).go_dense(1024, False)


@given(
    st.integers(1, 1 << 17),
    st.floats(0, N),
    st.floats(0, N),
    st.floats(0, 1),
)
def test_the_decision_is_monotone_in_the_statistics(
    m: int, a: float, b: float, share: float
) -> None:
    low, high = sorted((a, b))
    if switch(low, share).go_dense(m, False):
        assert switch(high, share).go_dense(m, False)
        assert switch(low, 1.0).go_dense(m, False)


def test_no_statistics_or_switched_off_means_sparse() -> None:
    assert not switch(None).go_dense(256, False)
    assert not switch(N, heavy_share=1.0, enabled=False).go_dense(256, False)
    assert switch(N).go_dense(1, True)  # inside a capture the statistics in force decide


def test_options_take_auto_capacity() -> None:
    from twell.options import Options

    auto = Options(dense_capacity="auto")
    assert auto.auto_capacity and auto.fixed_capacity == 0.0 and auto.capacity_rows(100) == 0
    fixed = Options(dense_capacity=0.25)
    assert not fixed.auto_capacity and fixed.capacity_rows(100) == 25
    assert auto != Options()
    for bad, error in (("all", ValueError), ("0.5", ValueError), (2.0, ValueError),
                       (None, TypeError)):  # fmt: skip
        with pytest.raises(error, match="dense_capacity"):
            Options(dense_capacity=bad)


class _Landed:
    done = True


def test_a_share_from_too_few_rows_leaves_the_share_in_force() -> None:
    import numpy as np

    s = switch(10.0, heavy_share=0.01)
    s._pending = (np.array([12.0, np.nan], np.float32), _Landed())  # a decode call's
    assert s.go_dense(1024, False)  # 0.01 * 1024 heavy rows expected
    assert s.estimate == 12.0 and s.heavy_share == pytest.approx(0.01)
    s._pending = (np.array([12.0, 0.0], np.float32), _Landed())
    assert not s.go_dense(1024, False) and s.heavy_share == 0.0


def test_the_training_ops_refuse_auto_capacity() -> None:
    torch = pytest.importorskip("torch")
    from twell.autograd import ffn_train
    from twell.options import Options

    w = torch.ones(256, 64, dtype=torch.float64)
    x = torch.ones(4, 64, dtype=torch.float64)
    with pytest.raises(ValueError, match="auto"):
        ffn_train(x, w, w, w.T.contiguous(), Options(dense_capacity="auto"))


def test_measure_next_makes_the_next_eager_call_measure() -> None:
    s = DensitySwitch(N, row_limit=168)
    taken = [s._measures() for _ in range(2 * s.EVERY)]
    assert taken == [i % s.EVERY == 0 for i in range(2 * s.EVERY)]  # every EVERY-th
    s._calls = 1  # mid-way between two counted measurements
    s.measure_next()
    assert s._measures()  # the call after measure_next measures
    assert not s._measures()  # once
    s.measure_next()
    s._pending = ("statistics in flight", None)
    assert not s._measures()  # never two estimates in flight
    s._pending = None
    assert s._measures()  # still due once the last estimate was read
    off = DensitySwitch(N, row_limit=168, enabled=False)
    off.measure_next()
    assert not off._measures()


def test_the_old_names_are_importable_from_the_pipeline() -> None:
    from twell.kernels import density, pipeline

    for name in ("CROSSOVER", "HEAVY_DENSE", "DensitySwitch", "crossover", "sample_rows"):
        assert getattr(pipeline, name) is getattr(density, name)


def test_the_decision_is_the_key_of_a_graph() -> None:
    """What the call graphs (twell._graphs) read: ``decision(m, read)`` is whether the
    call runs dense math (False where the call decides on the device: one graph holds
    both ways); ``refresh_every`` is None with the switch off."""
    assert switch(28.0, 0.02).decision(16384, True) is False
    dense = switch(N, 0.02)
    assert dense.decision(16384, True) is True
    dense.per_call_above = 1024
    assert dense.decision(16384, True) is False
    assert switch(None).refresh_every == REFRESH_EVERY
    assert switch(None, enabled=False).refresh_every is None


def test_the_decision_reads_landed_statistics_only_when_asked() -> None:
    import numpy as np

    s = switch(10.0)
    s._pending = (np.array([float(N), 0.0], np.float32), _Landed())
    assert s.decision(256, False) is False  # a capture: the statistics in force
    assert s.decision(256, True) is True  # taken in


def test_plain_reductions_overlapping_on_two_threads_restore_cupys_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CuPy's accelerator list is process-wide: blocks that overlap on two threads (a
    warm-up plans on several) leave it empty while any is open and as it was after the
    last one closes, whatever order they close in."""
    import sys
    import threading
    import types

    from twell.kernels.density import plain_reductions

    state = {"list": ["cub"]}
    accelerator = types.SimpleNamespace(
        get_reduction_accelerators=lambda: list(state["list"]),
        set_reduction_accelerators=lambda names: state.update(list=list(names)),
    )
    core = types.ModuleType("cupy._core")
    core._accelerator = accelerator
    monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))
    monkeypatch.setitem(sys.modules, "cupy._core", core)
    monkeypatch.setitem(sys.modules, "cupy._core._accelerator", accelerator)
    for first_out in ("a", "b"):
        entered, leave = threading.Event(), {"a": threading.Event(), "b": threading.Event()}
        inside = []

        def block(
            name: str, entered: threading.Event = entered, leave: dict = leave,
            inside: list = inside,
        ) -> None:  # fmt: skip
            with plain_reductions():
                inside.append(list(state["list"]))
                if name == "a":
                    entered.set()
                leave[name].wait(5)

        a = threading.Thread(target=block, args=("a",))
        a.start()
        entered.wait(5)
        b = threading.Thread(target=block, args=("b",))
        b.start()
        while len(inside) < 2:
            threading.Event().wait(0.01)
        second_out = "b" if first_out == "a" else "a"
        leave[first_out].set()
        (a if first_out == "a" else b).join(5)
        assert state["list"] == []  # the other block is still open
        leave[second_out].set()
        a.join(5)
        b.join(5)
        assert inside == [[], []] and state["list"] == ["cub"]


def test_the_estimate_leaves_heavy_rows_to_their_share() -> None:
    """A 64-row sample with two heavy rows (26% of N each) among rows of 28 units: the
    light rows' mean, which the crossover is for, not 73 units; flagged rows (an
    overflowing tile, NaN) are left out too; a sample of heavy rows only gives its mean."""
    import numpy as np

    counts = np.full(64, 28.0, dtype=np.float32)
    counts[[5, 40]] = 0.26 * N
    assert float(counts.mean()) > 70
    assert float(light_mean(counts, None, 168, np)) == pytest.approx(28.0)
    flags = np.zeros(64, dtype=np.uint8)
    flags[7] = 1
    counts[7] = 40.0  # under the limit, but flagged
    assert float(light_mean(counts, flags, 168, np)) == pytest.approx(28.0)
    heavy_only = np.full(8, 500.0, dtype=np.float32)
    assert float(light_mean(heavy_only, None, 168, np)) == pytest.approx(500.0)


@given(st.floats(0.0, 1.0), st.sampled_from([1, 8, 64, 1024, 2048, 16384, 65536]))
def test_a_batch_mostly_of_heavy_rows_runs_dense(share: float, m: int) -> None:
    """Past WHOLE_BATCH_SHARE (0.2) a batch of HEAVY_DENSE[0] tokens or more that follows
    the statistics runs dense math whatever its light rows' mean; under it, a light mean
    under the crossover keeps the sparse path from HEAVY_DENSE[1] tokens on."""
    assert WHOLE_BATCH_SHARE == pytest.approx(0.2)
    s = switch(8.0, heavy_share=share)
    low, high = HEAVY_DENSE
    if m >= low and share > WHOLE_BATCH_SHARE:
        assert s.go_dense(m, False)
    elif m >= high and 8.0 <= s.threshold(m):
        assert not s.go_dense(m, False)


@pytest.mark.parametrize("enabled", [True, False])
def test_calls_above_the_per_call_bound_leave_the_statistics_alone(enabled: bool) -> None:
    """Calls of more than ``per_call_above`` tokens decide on the device from their own
    rows: whatever the statistics say, the switch sends them nowhere; below the bound
    (and with the switch off) nothing changes."""
    s = switch(estimate=0.5 * N, heavy_share=0.5, enabled=enabled)
    s.per_call_above = 1024
    assert s.decides_per_call(1025) is enabled and not s.decides_per_call(1024)
    assert not s.go_dense(4096, False)
    assert s.go_dense(512, False) is enabled
    assert s.decision(4096, read=False) is False
    s.per_call_above = None
    assert s.go_dense(4096, False) is enabled
