"""twell.timing's record helpers (the timers themselves need a GPU: the benchmarks and
the GPU suites run them)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from twell import timing


@pytest.mark.parametrize(
    ("name", "folder"),
    [
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H100 PCIe", "h100"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA H200 NVL", "h200"),
        ("NVIDIA GH200 480GB", "nvidia_gh200_480gb"),
        ("NVIDIA H1000", "nvidia_h1000"),
        ("NVIDIA A100-SXM4-80GB", "nvidia_a100_sxm4_80gb"),
        ("cpu", "cpu"),
        ("", "unknown"),
    ],
)
def test_gpu_folder_is_the_tuning_files_model(name, folder) -> None:
    assert timing.gpu_folder(name) == folder


def test_record_path_is_results_gpu_benchmark(tmp_path: Path) -> None:
    assert timing.record_path("ffn", "NVIDIA H200", root=tmp_path) == tmp_path / "h200" / "ffn.json"
    assert timing.record_path("serving", "NVIDIA H100 80GB HBM3") == Path(
        "bench/results/h100/serving.json"
    )


def test_merge_records_keeps_the_latest_record_of_each_configuration(tmp_path: Path) -> None:
    path = tmp_path / "h100" / "ffn.json"  # the folder does not exist yet
    base = {"op": "ffn_forward", "workload": "uniform", "K": 2048, "N": 5632}
    timing.merge_records(path, [{**base, "M": m, "timing": "per_call", "t_ms": 1.0}
                                for m in (64, 4096)])  # fmt: skip
    timing.merge_records(path, [{**base, "M": 64, "timing": "per_call", "t_ms": 2.0},
                                {**base, "M": 64, "timing": "graph", "t_ms": 3.0}])  # fmt: skip
    records = json.loads(path.read_text())
    assert sorted((r["M"], r["timing"], r["t_ms"]) for r in records) == [
        (64, "graph", 3.0), (64, "per_call", 2.0), (4096, "per_call", 1.0)
    ]  # fmt: skip


def test_versions_and_gpu_name_answer_without_a_gpu() -> None:
    assert set(timing.versions()) == {"cupy", "cuda", "torch"}
    assert isinstance(timing.gpu_name(), str)


def test_timing_imports_neither_runner() -> None:
    """twell.timing is the bottom of the benchmark modules: benchmark and sweeps import it,
    it imports neither (the two runners once imported each other)."""
    source = Path(timing.__file__).read_text()
    assert "twell.benchmark" not in source and "twell.sweeps" not in source


def test_wall_ms_times_rounds_of_calls_after_their_untimed_setup() -> None:
    pytest.importorskip("torch")
    seen: list[tuple[str, int]] = []

    def call(i: int) -> None:
        seen.append(("call", i))

    ms = timing.wall_ms(call, calls=2, warmup=1, rounds=3,
                        before=lambda r: seen.append(("before", r)))  # fmt: skip
    assert ms >= 0
    assert seen == [("call", 0), ("before", 0), ("call", 0), ("call", 1), ("before", 1),
                    ("call", 2), ("call", 3), ("before", 2), ("call", 4), ("call", 5)]  # fmt: skip


def _recording(seen: list[tuple[str, int]], name: str, cost_s: float):  # noqa: ANN202
    """A call ``fn(i)`` that records ``(name, i)`` in ``seen`` and takes ``cost_s``."""

    def call(i: int) -> None:
        seen.append((name, i))
        time.sleep(cost_s)

    return call


def test_wall_ms_interleaved_turns_the_order_each_round() -> None:
    pytest.importorskip("torch")
    seen: list[tuple[str, int]] = []
    ms = timing.wall_ms_interleaved(
        {"a": _recording(seen, "a", 0.0), "b": _recording(seen, "b", 0.02)}, warmup=1, rounds=3
    )
    assert seen == [("a", 0), ("b", 0), ("a", 0), ("b", 0), ("b", 1), ("a", 1), ("a", 2),
                    ("b", 2)]  # fmt: skip
    assert set(ms) == {"a", "b"} and ms["b"] >= 20 > ms["a"] >= 0


def test_wall_ms_interleaved_times_rounds_of_calls_per_call() -> None:
    pytest.importorskip("torch")
    seen: list[tuple[str, int]] = []
    ms = timing.wall_ms_interleaved(
        {"a": _recording(seen, "a", 0.0), "b": _recording(seen, "b", 0.01)},
        warmup=0, rounds=2, calls=3,
    )  # fmt: skip
    assert seen == [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1), ("b", 2),
                    ("b", 3), ("b", 4), ("b", 5), ("a", 3), ("a", 4), ("a", 5)]  # fmt: skip
    assert 10 <= ms["b"] < 25 and 0 <= ms["a"] < 10  # per call, not per round


def test_wall_ms_interleaved_runs_before_untimed_ahead_of_each_round() -> None:
    pytest.importorskip("torch")
    seen: list[tuple[str, int]] = []

    def before(name: str, r: int) -> None:
        seen.append((f"before {name}", r))
        time.sleep(0.02)  # not in the figure

    ms = timing.wall_ms_interleaved({"a": _recording(seen, "a", 0.0)}, warmup=0, rounds=2,
                                    before=before)  # fmt: skip
    assert seen == [("before a", 0), ("a", 0), ("before a", 1), ("a", 1)]
    assert ms["a"] < 10


def test_alternating_turns_the_order_and_takes_the_median_of_rounds() -> None:
    calls: list[tuple[str, int]] = []
    figures = {"a": iter([5.0, 1.0, 3.0, 100.0]), "b": iter([2.0, 2.0, 7.0, 2.0])}

    def timer(fn, sets: int) -> float:
        calls.append((fn.__name__, sets))
        return next(figures[fn.__name__])

    def a(i: int) -> None: ...

    def b(i: int) -> None: ...

    out = timing.alternating(timer, {"a": a, "b": b}, rounds=4, sets=3)
    assert [name for name, _ in calls] == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert all(sets == 3 for _, sets in calls)  # the timer's arguments passed on
    assert out == {"a": 4.0, "b": 2.0}  # medians: an outlier round does not move them
