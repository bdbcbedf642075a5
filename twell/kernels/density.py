"""The density policy: when a batch, or a row, is too dense for the sparse path.

Two decisions, both without a host synchronisation:

- **a row** with more than ``max_row_nnz`` active units (by default
  ``options.ROW_LIMIT_PERCENT`` of N, :func:`twell.options.default_max_row_nnz`) is a
  heavy row: the light-row kernels leave it to the dense math of the heavy-row stage;
- **a batch** runs in dense math (``pipeline.dense_block``) when the calls before it
  were too dense for the sparse path to pay at its size: :class:`DensitySwitch` measures
  the mean active units per row (:func:`sample_rows`) and the share of heavy rows on the
  device, and compares them with :data:`CROSSOVER` and :data:`HEAVY_DENSE`.

The thresholds are measured per GPU model (twell.tuning; ``python -m twell tune --only
crossover heavy_dense``). The call graphs (twell._graphs) talk to the switch through
:meth:`DensitySwitch.decision` (the key of the graph a call replays),
:attr:`DensitySwitch.refresh_every` and :meth:`DensitySwitch.measure_next` (the eager calls
that keep its statistics fresh).
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from twell import tuning

#: Where the sparse path stops paying, by batch size: ``(M, mean active units per row as
#: a fraction of N)`` at which the route a block takes and dense math take the same time
#: (at K=2048, N=5632). Linear in log2(M) between the points, constant past the ends.
#: Decode batches gain up to high densities (the by-unit route reads each active unit
#: once for all tokens); near 256 tokens the dense GEMMs are at their most efficient per
#: token and the sparse routes at their least (0.32% of N on an H100); prefill batches
#: gain up to about 1%.
CROSSOVER: tuple[tuple[int, float], ...] = tuning.value("density.CROSSOVER")
#: Batch sizes ``[low, high)`` at which a single heavy row makes the dense path pay: the
#: heavy-row stage costs about as much whatever the number of heavy rows (a full read of
#: w_up and w_down for a few rows: 40-91 µs at K=2048, N=5632 on an H100), which is most
#: of the sparse path's gain below ``high`` tokens; in the by-unit route a token with
#: hundreds of units holds up its token group from ``low`` tokens on.
HEAVY_DENSE: tuple[int, int] = tuning.value("density.HEAVY_DENSE")
#: Where a training call's sparse kernels stop paying, by batch size: ``(M, mean active
#: units per token as a fraction of N)`` at which a ``SparseMLP``'s forward + backward on
#: twell's training ops and on its dense torch math take the same GPU time (uniform
#: activations, K=2048, N=5632; a run at K=1024, N=2816 crossed at 1.6-1.8%). Linear in
#: log2(M) between the points, constant past the ends. :class:`twell.capacity.TrainSwitch`
#: runs a layer whose earlier calls were denser than this on the dense math.
TRAIN_CROSSOVER: tuple[tuple[int, float], ...] = tuning.value("density.TRAIN_CROSSOVER")
#: Share of heavy rows above which a batch of at least ``HEAVY_DENSE[0]`` tokens that
#: follows the statistics runs dense math: its heavy rows take twell's heavy-row tiles
#: (or a fixed capacity's cuBLAS GEMMs after the sparse stages), slower per row than
#: dense math alone. Calls that decide per call do their heavy rows by count, at about a
#: dense row's cost each, and need no such rule.
WHOLE_BATCH_SHARE = 0.2
#: Every REFRESH_EVERY-th call of a block replayed from a CUDA graph runs eagerly and
#: measures the statistics (twell._graphs; none with the switch off): a replayed call
#: costs a few µs of host time, an eager one tens.
REFRESH_EVERY = 256


@functools.lru_cache(maxsize=1024)
def crossover(m: int) -> float:
    """:data:`CROSSOVER` at ``m`` tokens (a fraction of N); cached (every replayed call
    asks: whoever changes :data:`CROSSOVER` calls ``crossover.cache_clear()``)."""
    return interpolate(CROSSOVER, m)


@functools.lru_cache(maxsize=256)
def train_crossover(m: int) -> float:
    """:data:`TRAIN_CROSSOVER` at ``m`` tokens (a fraction of N); cached (whoever changes
    :data:`TRAIN_CROSSOVER` calls ``train_crossover.cache_clear()``)."""
    return interpolate(TRAIN_CROSSOVER, m)


def interpolate(points: tuple[tuple[int, float], ...], m: int) -> float:
    """A ``(M, fraction)`` table at ``m``: linear in log2(M) between its points, constant
    past its ends."""
    if m <= points[0][0]:
        return points[0][1]
    for (m0, f0), (m1, f1) in zip(points, points[1:], strict=False):
        if m <= m1:
            t = (math.log2(m) - math.log2(m0)) / (math.log2(m1) - math.log2(m0))
            return float(f0 + t * (f1 - f0))
    return points[-1][1]


class DensitySwitch:
    """Decides, without a host synchronisation, when a batch is too dense for the sparse
    path, from the statistics of the calls before.

    Every :attr:`EVERY`-th eager call (and the one after :meth:`measure_next`: the call
    graphs' refresh calls, :attr:`refresh_every`) measures on the device the mean number
    of active units per row (from a strided sample of :attr:`SAMPLE_ROWS` rows: their TwELL count
    words when the route packed them, else their positive pre-activations; the dense path
    samples its own gate GEMM the same way; the by-unit route counts every row from its
    masks) and the share of heavy rows, and copies both to pinned host memory behind an
    event. A heavy row is one the route left to the dense path (more than ``max_row_nnz``
    units, a tile past its slots, or a non-finite value: the route's flags, every row); the
    by-unit route and the dense path, which have no flags, count rows above
    ``max_row_nnz`` active units (every row). A batch of fewer than
    :attr:`SHARE_ROWS` rows leaves the share as it was (one decode token would set it to
    0 or 1). A later call reads them only
    once the event has completed, so the host never waits; the decision follows the data
    with a lag of a few calls. An ``m``-token call runs ``pipeline.dense_block`` when the mean
    is above :meth:`threshold` (``m``) or when it expects a heavy row and ``m`` lies in
    :data:`HEAVY_DENSE` (docs/design.md). Inside a CUDA-graph capture nothing is measured
    or read: the statistics in force decide.

    Both paths are correct; they round differently, so the same input gives the same
    bits as long as the decision stays the same (``dense`` tells which one ran last).
    """

    #: Rows sampled for an estimate (strided over the batch).
    SAMPLE_ROWS = 64
    #: Eager calls between two estimates: an estimate costs a few small launches and
    #: reductions (on an H100's host, about 0.1–0.3 ms per call when done every call).
    EVERY = 8
    #: Fewest rows whose share of heavy rows is taken.
    SHARE_ROWS = 16

    def __init__(self, n: int, row_limit: int, enabled: bool = True) -> None:
        self.n = n
        self.row_limit = row_limit
        self.enabled = enabled
        self.estimate: float | None = None  # mean active units per light row (light_mean)
        self.heavy_share = 0.0  # share of heavy rows
        self.dense = False
        #: Calls of more tokens than this decide on the device, each from its own rows
        #: (pipeline: ``PreparedBlock.decide``): for them :meth:`go_dense` says no.
        #: None: every call follows the statistics.
        self.per_call_above: int | None = None
        self._pending: tuple[Any, Any] | None = None
        self._calls = 0
        self._due = False

    def threshold(self, m: int) -> float:
        """Mean active units per light row above which an ``m``-token call runs dense
        math (:func:`crossover` of N, at least 8)."""
        return max(8.0, self.n * crossover(m))

    def go_dense(self, m: int, capturing: bool) -> bool:
        """Whether an ``m``-token call runs the dense path (reads a finished estimate,
        never waits; inside a capture, reads nothing)."""
        if not capturing and self._pending is not None and self._pending[1].done:
            estimate, share = (float(v) for v in self._pending[0])
            self.estimate = estimate
            if not math.isnan(share):  # NaN: too few rows to tell
                self.heavy_share = share
            self._pending = None
        low, high = HEAVY_DENSE
        self.dense = (
            self.enabled
            and not self.decides_per_call(m)
            and self.estimate is not None
            and (
                self.estimate > self.threshold(m)
                or (low <= m < high and self.expects_heavy(m))
                or (m >= low and self.heavy_share > WHOLE_BATCH_SHARE)
            )
        )
        return self.dense

    def decides_per_call(self, m: int) -> bool:
        """Whether an ``m``-token call takes its decision on the device from its own rows
        (:attr:`per_call_above`)."""
        return self.enabled and self.per_call_above is not None and m > self.per_call_above

    def decision(self, m: int, read: bool) -> bool:
        """What an ``m``-token call would do now, the key of its graph (the call graphs,
        twell._graphs, capture a graph per key): whether it runs dense math (False for
        a call that decides on the device: its graph holds both ways). With ``read``,
        after taking in statistics that have landed; without, from the statistics in
        force (what a capture runs)."""
        return self.go_dense(m, capturing=not read)

    @property
    def refresh_every(self) -> int | None:
        """Every how many calls a block replayed from CUDA graphs runs one eagerly, after
        :meth:`measure_next` (:data:`REFRESH_EVERY`; None with the switch off: never)."""
        return REFRESH_EVERY if self.enabled else None

    def expects_heavy(self, m: int) -> bool:
        """Whether an ``m``-token call is expected to hold a heavy row (by the last
        measured share; none measured: no)."""
        return self.heavy_share * m >= 0.5

    def measure_next(self) -> None:
        """Make the next eager call measure, whatever :attr:`EVERY` says (the call graphs'
        refresh calls, :attr:`refresh_every`: otherwise only one of every EVERY of
        them would); with an estimate still in flight, the first call after it lands."""
        self._due = self.enabled

    def _measures(self) -> bool:
        """Whether this eager call measures (counts the call)."""
        self._calls += 1
        if not self.enabled or self._pending is not None:
            return False
        if not self._due and self._calls % self.EVERY != 1:
            return False
        self._due = False
        return True

    def observe_masks(self, masks: Any) -> None:
        """:meth:`observe` from decode_units.py's kept-unit bit masks (uint16 ``[M, N/16]``,
        every row: a few tokens, so all of them are counted). A row that keeps every unit
        (a non-finite x: its gate is NaN everywhere) is left out of the mean, as long as
        one row is not, and counts as heavy."""
        import cupy

        if not self._measures():
            return
        with plain_reductions():
            table = _popcount8(masks.device.id)
            counts = table[masks.view(cupy.uint8)].sum(axis=1, dtype=cupy.float32)
            per_row = _mean_of(counts, counts < 16 * masks.shape[1], cupy)
            heavy = None
            if masks.shape[0] >= self.SHARE_ROWS:
                heavy = (counts > self.row_limit).mean(dtype=cupy.float32)
            self._publish(per_row, heavy)

    def observe(self, packed: Any | None, pre: Any, slots: int, heavy: Any | None = None) -> None:
        """Start the estimate of this call (a few small kernels and an async copy): the
        mean from a row sample; the share of heavy rows from ``heavy``, the route's uint8
        row flags, or without them (the dense path) from every row of ``pre``."""

        if not self._measures():
            return
        with plain_reductions():
            self._observe(packed, pre, slots, heavy)

    def _observe(self, packed: Any | None, pre: Any, slots: int, heavy: Any | None) -> None:
        import cupy

        m = pre.shape[0] if packed is None else packed.shape[0]
        rows = sample_rows(m, self.SAMPLE_ROWS)
        if packed is not None:
            words = packed[rows, ::slots][: self.SAMPLE_ROWS]
            counts = words.sum(axis=1, dtype=cupy.float32)
        else:
            sample = pre[rows][: self.SAMPLE_ROWS].view(cupy.int16)
            counts = (sample > 0).sum(axis=1, dtype=cupy.float32)
        flags = None if heavy is None else heavy[rows][: self.SAMPLE_ROWS]
        if m < self.SHARE_ROWS:
            share = None
        elif heavy is not None:
            share = (heavy != 0).mean(dtype=cupy.float32)
        else:
            # Every row where the share decides the path (a sample misses the rare heavy
            # rows); above, the sample (the share then only says whether heavy rows are
            # expected, and counting every row would take a temporary of M x N bytes).
            rows_in = pre if m < HEAVY_DENSE[1] else pre[rows][: self.SAMPLE_ROWS]
            units = (rows_in.view(cupy.int16) > 0).sum(axis=1, dtype=cupy.int32)
            share = (units > self.row_limit).mean(dtype=cupy.float32)
        self._publish(light_mean(counts, flags, self.row_limit, cupy), share)

    def _publish(self, per_row: Any, heavy: Any | None) -> None:
        """Copy the device statistics to pinned memory behind an event (read by go_dense);
        ``heavy`` None (a batch under :attr:`SHARE_ROWS` rows) publishes NaN: the share in
        force stays."""
        import cupy

        if heavy is None:
            heavy = cupy.full((), np.nan, dtype=cupy.float32)
        host = np.frombuffer(cupy.cuda.alloc_pinned_memory(8), np.float32, 2)
        cupy.stack([per_row.reshape(()), heavy.reshape(())]).get(out=host, blocking=False)
        event = cupy.cuda.Event(disable_timing=True)
        event.record()
        self._pending = (host, event)


_plain = threading.Lock()
_plain_depth = 0  # plain_reductions blocks open, over all threads
_plain_saved: Any = None  # CuPy's list before the first of them


@contextlib.contextmanager
def plain_reductions() -> Iterator[None]:
    """CuPy's reductions inside run as its plain reduction kernels, not CUB's.

    twell's statistics reduce small arrays (a sample of rows, M row flags, a weight's
    finiteness once per prepared block). CUB's block-reduction kernels each take 1.4–2.2
    s of NVRTC on their first use (on an H200 host: ten of them made up most of a cold
    process's first calls); CuPy's plain ones under 0.1 s. The setting is CuPy's
    process-wide list: the first block to open (on any thread) saves and empties it, the
    last to close restores it, so blocks that overlap on several threads leave it as it
    was; a reduction another thread runs meanwhile is computed the plain way too (the
    same result)."""
    global _plain_depth, _plain_saved
    try:
        from cupy._core import _accelerator

        get, put = _accelerator.get_reduction_accelerators, _accelerator.set_reduction_accelerators
    except (ImportError, AttributeError):  # a CuPy without the setting: as it is
        yield
        return
    with _plain:
        if _plain_depth == 0:
            _plain_saved = get()
            put([])
        _plain_depth += 1
    try:
        yield
    finally:
        with _plain:
            _plain_depth -= 1
            if _plain_depth == 0:
                put(_plain_saved)
                _plain_saved = None


@functools.cache
def _popcount8(device: int) -> Any:
    """Set bits of every byte value, on ``device`` (uint8 ``[256]``)."""
    import cupy

    with cupy.cuda.Device(device):
        return cupy.asarray([bin(b).count("1") for b in range(256)], dtype=cupy.uint8)


def light_mean(counts: Any, flags: Any | None, row_limit: int, xp: Any) -> Any:
    """The mean active units of a row sample's light rows (a 0-d array of ``xp``, NumPy or
    CuPy): rows over ``row_limit`` units, or flagged heavy by the route (``flags``, uint8,
    nonzero: an overflowing tile or a non-finite value), take the heavy-row stage, whose
    cost the heavy-row share accounts for. Counted in the mean, two of them in a 64-row
    sample (1464 units each at 26% active; a batch with 2% of such tokens has two or
    more in 37% of samples) take the estimate from 28 units to 73, past the crossover of
    16k tokens on an H200 (72), and the whole batch to dense math. A sample with no light
    row gives the mean of all its rows."""
    light = counts <= row_limit
    if flags is not None:
        light &= flags == 0
    return _mean_of(counts, light, xp)


def _mean_of(counts: Any, keep: Any, xp: Any) -> Any:
    """The mean of ``counts`` (float32) over the rows ``keep`` marks, or over all of them
    where it marks none (a 0-d array of ``xp``)."""
    taken = xp.maximum(keep.sum(dtype=xp.float32), 1.0)
    return xp.where(keep.any(), (counts * keep).sum(dtype=xp.float32) / taken,
                    counts.mean(dtype=xp.float32))  # fmt: skip


def sample_rows(m: int, rows: int) -> slice:
    """About ``rows`` of ``m`` rows, strided, for the density estimate: an odd stride
    (so a sample of ``rows`` rows falls once on every residue modulo any power of two up
    to ``rows``; fewer rows where ``m // rows`` is even and small),
    starting half a stride in. A batch of packed sequences whose first tokens fire far
    more units than the rest (a real model's BOS sinks; the ``paperlike`` workload's) is
    then sampled at its true share: a stride of ``m / rows`` from row 0 took every
    sequence's first token whenever the sequence length divided it, and sent such
    batches to the dense path (``paperlike``, M=16384: an estimate of 86 active units per
    row for a mean of 29)."""
    step = max(1, m // rows) | 1
    return slice(step // 2, None, step)
