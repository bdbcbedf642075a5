"""The one timer every benchmark uses, and where benchmark records go (docs/benchmark.md).

Timings of a call ``fn(i)``, where ``i`` picks one of ``sets`` copies of the inputs so
that rotating through them keeps the working set larger than L2 (``i % sets``). Each is
the median of its repetitions after warm-up calls (compilation excluded), in ms:

- :func:`per_call_ms`: CUDA events around one call, the device synchronised before it:
  what an isolated call costs, host time included when the host is slower than the GPU;
- :func:`back_to_back_ms`: events around ``calls`` calls issued with no sync between
  them, divided by ``calls``: what a model's stream of kernels sees;
- :func:`graph_ms`: ``fn(0) ... fn(sets - 1)`` captured once in a torch CUDA graph,
  replays timed, per call: the GPU's work without launch overhead;
- :func:`wall_ms`: the host's clock around ``calls`` calls, the device synchronised
  around each round: for whole models, and for calls that wait on the device themselves
  (transformers' ``generate``).

And the host's cost of one call, in µs:

- :func:`host_us`: a loop of calls that are not waited for;
- :func:`host_us_queued`: calls queued behind a long GPU sleep, so that the GPU is never
  what the host waits for (a call that synchronises raises).

These run on torch's current stream. :func:`time_ms` and :func:`graph_ms_cupy` are the
per-call and graph timings for callers that hold CuPy arrays only (CuPy's current
stream; no torch needed).

Records: :func:`record_path` names ``bench/results/<gpu>/<benchmark>.json``, the GPU's
folder from :func:`gpu_folder` (``h100``, ``h200``, or the sanitised device name), and
:func:`merge_records` keeps the latest record of each configuration in such a file.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

RESULTS = Path("bench") / "results"
"""Where records go by default, relative to the working directory (a checkout's root)."""

CONFIG_FIELDS = ("op", "api", "workload", "path", "M", "K", "N", "tile", "slots", "timing",
                 "dense_capacity", "max_row_nnz", "layers")  # fmt: skip
"""The fields that name a record's configuration: a rerun replaces the record with the
same values of these (absent fields count as ``None``)."""


# ---- torch: the three timings of docs/benchmark.md and the host's cost


def per_call_ms(fn: Callable[[int], Any], sets: int = 1, reps: int = 20, warmup: int = 5) -> float:
    """Median time of one call between CUDA events, the device idle before each call."""
    import torch

    for i in range(warmup):
        fn(i % sets)
    times = []
    for i in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn(i % sets)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def back_to_back_ms(
    fn: Callable[[int], Any], sets: int = 1, calls: int = 20, reps: int = 5, warmup: int = 5
) -> float:
    """Median over ``reps`` of the time of ``calls`` calls issued without a sync, per call."""
    import torch

    for i in range(warmup):
        fn(i % sets)
    times = []
    for r in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for c in range(calls):
            fn((r * calls + c) % sets)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / calls)
    return statistics.median(times)


def wall_ms(
    fn: Callable[[int], Any], calls: int = 1, warmup: int = 2, rounds: int = 3,
    before: Callable[[int], Any] | None = None,
) -> float:  # fmt: skip
    """Median over ``rounds`` of the wall time of ``calls`` back-to-back calls ``fn(i)``,
    per call, the device synchronised before and after each round (none without CUDA);
    ``before(r)``: untimed work ahead of round ``r`` (a decode loop's prefill)."""
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for i in range(warmup):
        fn(i)
    times = []
    for r in range(rounds):
        if before is not None:
            before(r)
        sync()
        start = time.perf_counter()
        for c in range(calls):
            fn(r * calls + c)
        sync()
        times.append((time.perf_counter() - start) / calls * 1e3)
    return statistics.median(times)


def round_order(names: list[str], r: int) -> list[str]:
    """``names`` turned by ``r`` places: the order of round ``r`` of interleaved timing,
    so that each name goes first in turn."""
    turn = r % len(names)
    return names[turn:] + names[:turn]


def alternating(
    timer: Callable[..., float], fns: dict[str, Callable[[int], Any]], rounds: int = 4,
    **kwargs: Any,
) -> dict[str, float]:  # fmt: skip
    """``timer(fn, **kwargs)`` of each of ``fns`` (by name) in ``rounds`` rounds whose
    order turns (:func:`round_order`), the median over the rounds: the block benchmarks'
    twell and dense figures taken side by side, so that a drift of clocks, heat or host
    over the run weighs on both alike (one after the other, the dense twin of a
    whole-model prefill read 4-8% slower timed second). Any timer above serves
    (``per_call_ms``, ``back_to_back_ms``, ``graph_ms``, ``host_us``, ``time_ms``); one
    that takes a ``rounds`` argument of its own (``wall_ms``) gets its default, as
    ``rounds`` here is this function's."""
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in round_order(names, r):
            times[name].append(timer(fns[name], **kwargs))
    return {name: statistics.median(ts) for name, ts in times.items()}


def wall_ms_interleaved(
    fns: dict[str, Callable[[int], Any]], warmup: int = 1, rounds: int = 7, calls: int = 1,
    before: Callable[[str, int], Any] | None = None,
) -> dict[str, float]:  # fmt: skip
    """Median wall time of a call ``fn(i)`` of each of ``fns`` (ms, by name), their
    rounds interleaved: round ``r`` times ``calls`` back-to-back calls of each (per call),
    in an order that turns with ``r``, so that a host or GPU whose speed drifts over the
    run (other processes, clocks, heat) weighs on every one alike. Timing one after the
    other measured a 1.5x spread from run to run in the ratio of host-bound loops
    (``generate``). ``before(name, r)``: untimed work ahead of that name's round ``r``
    (a decode loop's prefill); the warm-up calls run without it."""
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    names = list(fns)
    for i in range(warmup):
        for name in names:
            fns[name](i)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in round_order(names, r):
            if before is not None:
                before(name, r)
            sync()
            start = time.perf_counter()
            for c in range(calls):
                fns[name](r * calls + c)
            sync()
            times[name].append((time.perf_counter() - start) / calls * 1e3)
    return {name: statistics.median(ts) for name, ts in times.items()}


def graph_of(fn: Callable[[int], Any], sets: int = 1) -> tuple[Any, list]:
    """A user's torch CUDA graph of ``fn(0) ... fn(sets - 1)`` (warmed up on a side stream
    first, as torch asks) and the outputs it writes (keep them while replaying)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(3 * sets):
            fn(i % sets)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        keep = [fn(i) for i in range(sets)]
    return graph, keep


def graph_ms(fn: Callable[[int], Any], sets: int = 1, reps: int = 20) -> float:
    """Median time of one replay of :func:`graph_of`'s graph, per call (``/ sets``)."""
    import torch

    graph, keep = graph_of(fn, sets)
    times = []
    for i in range(5 + reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        if i >= 5:
            times.append(start.elapsed_time(stop) / sets)
    del keep
    return statistics.median(times)


def host_us(fn: Callable[[int], Any], sets: int = 1, calls: int = 200) -> float:
    """CPU time of one call in µs, over a loop of ``calls`` calls that are not waited for."""
    import torch

    for i in range(10):
        fn(i % sets)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(calls):
        fn(i % sets)
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def host_us_queued(
    fn: Callable[[], Any], calls: int = 8, repeats: int = 5, pick: Callable = min
) -> float:
    """Host time per call of ``fn()`` in µs with the GPU held busy: ``calls`` calls queued
    behind a long GPU sleep, ``pick`` (the least by default) of ``repeats`` rounds. Keep
    ``calls`` × launches per call under the launch queue's depth (about 1000)."""
    import torch

    for _ in range(3):
        fn()
    rounds = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        torch.cuda._sleep(1_000_000_000)  # about 0.5 s of GPU clock cycles
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed = time.perf_counter() - start
        torch.cuda.synchronize()
        if elapsed > 0.3:
            raise RuntimeError(f"{fn}: {elapsed:.2f} s behind a GPU sleep: it synchronises")
        rounds.append(elapsed / calls * 1e6)
    return pick(rounds)


# ---- CuPy: per call and graph, for callers without torch


def time_ms(fn: Callable[[int], Any], sets: int = 1, warmup: int = 5, reps: int = 20) -> float:
    """Median CUDA-event time of one call ``fn(i)``, each waited for, on CuPy's stream."""
    import cupy as cp

    for i in range(warmup):
        fn(i % sets)
    times = []
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    for i in range(reps):
        start.record()
        fn(i % sets)
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop))
    return statistics.median(times)


def graph_ms_cupy(fn: Callable[[], Any], reps: int = 20) -> float:
    """Median time of one replay of a CUDA graph captured from ``fn()`` on a CuPy stream."""
    import cupy as cp

    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        for _ in range(3):
            fn()
        stream.synchronize()
        stream.begin_capture()
        keep = fn()  # outputs stay alive with the graph
        graph = stream.end_capture()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for i in range(5 + reps):
        start.record(stream)
        graph.launch(stream)
        stop.record(stream)
        stop.synchronize()
        if i >= 5:
            times.append(cp.cuda.get_elapsed_time(start, stop))
    del keep
    return statistics.median(times)


# ---- records


def gpu_name() -> str:
    """The current GPU's name (CuPy's, else torch's), or ``"cpu"`` where neither sees one."""
    try:
        import cupy as cp

        return cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"].decode()
    except Exception:  # noqa: BLE001 - no CuPy or no GPU: ask torch
        pass
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name()
    except ImportError:
        pass
    return "cpu"


def versions() -> dict[str, str]:
    """The CuPy, CUDA runtime and torch versions, for a record (``"absent"`` if missing)."""
    out = {}
    try:
        import cupy as cp

        out["cupy"] = cp.__version__
        out["cuda"] = str(cp.cuda.runtime.runtimeGetVersion())
    except Exception:  # noqa: BLE001 - no CuPy or no CUDA runtime
        out["cupy"] = out["cuda"] = "absent"
    try:
        import torch

        out["torch"] = torch.__version__
    except ImportError:
        out["torch"] = "absent"
    return out


def gpu_folder(name: str) -> str:
    """The results folder of a device name: its model as the tuning files name it
    (:func:`twell.tuning.model_of`: ``h100``, ``h200``, else the sanitised name)."""
    from twell.tuning import model_of

    return model_of(name)


def record_path(benchmark: str, gpu: str | None = None, root: str | os.PathLike = RESULTS) -> Path:
    """``<root>/<gpu folder>/<benchmark>.json``; the current GPU's folder by default."""
    return Path(root) / gpu_folder(gpu if gpu is not None else gpu_name()) / f"{benchmark}.json"


def config_key(record: dict[str, Any]) -> tuple:
    return tuple(record.get(field) for field in CONFIG_FIELDS)


def merge_records(path: str | os.PathLike, records: Iterable[dict[str, Any]]) -> Path:
    """Write ``records`` into the JSON list at ``path`` (created with its folders): each
    replaces the record there of the same configuration (:data:`CONFIG_FIELDS`), the
    others stay, so the file holds the latest record of every configuration measured.
    Delete the file to start from nothing."""
    path = Path(path)
    records = list(records)
    existing = json.loads(path.read_text()) if path.exists() else []
    new_keys = {config_key(r) for r in records}
    kept = [r for r in existing if config_key(r) not in new_keys]
    write_json(path, kept + records)
    return path


def write_json(path: str | os.PathLike, data: Any) -> Path:
    """``data`` as indented JSON at ``path``, its folders created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path
