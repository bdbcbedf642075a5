"""Training's choices from a layer's earlier calls, made without a host wait:
``dense_capacity="auto"``, each layer's capacity of heavy rows done by fixed-size cuBLAS
GEMMs, from the heavy-row counts of its earlier calls (:class:`AutoCapacity`); and the
dense switch, which runs a layer that has been too dense for the sparse kernels on its
dense torch math (:class:`TrainSwitch`). Both are ``twell.torch.SparseMLP``'s defaults.

Eager calls take the capacity from the ``SparseMLP``'s own :class:`AutoCapacity`. Code
that ``torch.compile`` traced reaches the training ops with :data:`AUTO` instead (the
choice cannot be traced: it moves from call to call); the ops' CUDA implementations then
take it from :func:`for_weights`, one :class:`AutoCapacity` per layer, found by its
``w_up``'s storage."""

from __future__ import annotations

import collections
import math
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from twell.options import AUTO_HEADROOM, AUTO_PATIENCE

__all__ = [
    "AUTO", "AUTO_LAG", "DENSE_SHARE", "STEP", "AutoCapacity", "DenseRowsWarning",
    "TrainSwitch", "for_weights", "train_capacity",
]  # fmt: skip

#: How many calls back ``dense_capacity="auto"`` reads a layer's heavy-row count
#: (:class:`AutoCapacity`): the call of the step before the last, long finished when
#: the next one is launched.
AUTO_LAG = 2
#: ``dense_capacity`` as the training ops take ``"auto"`` (their schema wants a float).
AUTO = -1.0
#: Training capacities are multiples of this fraction of M (:func:`train_capacity`).
STEP = 1 / 64
#: A training call with more than this share of its rows over the row limit warns, once
#: per process (:class:`DenseRowsWarning`).
DENSE_SHARE = 0.5


class DenseRowsWarning(RuntimeWarning):
    """Most rows of a training call were over the row limit: they ran as dense rows, and
    the layer cost more than dense math would. Twell pays while the model stays sparse
    (a training run that loses its sparsity shows it in ``twell.torch.l0_per_layer``)."""


_warned = [False]


def train_capacity(count: int, m: int) -> float:
    """The capacity ``"auto"`` gives an ``m``-token training call after a call with
    ``count`` heavy rows: the smallest multiple ``f`` of :data:`STEP` with ``f * m`` at
    least ``AUTO_HEADROOM * count`` (at most 1.0; 0.0 with no heavy rows). Its GEMMs take
    ``ceil(f * m)`` rows, which hold that many.

    Every capacity row costs a dense row's forward and backward whether a heavy row fills
    it or not, so the steps are fine: with 6% of tokens heavy they stop at 5/64 of the
    batch (a ladder of 1/64, 1/16, 1/4 would take a quarter). :class:`AutoCapacity`
    moves up at once and down only after ``AUTO_PATIENCE`` calls, so a layer settles on
    one capacity (one op graph)."""
    if count <= 0 or m <= 0:
        return 0.0
    steps = math.ceil(AUTO_HEADROOM * count / (STEP * m))
    return min(1.0, max(1, steps) * STEP)


class _Lagged:
    """A value of each of a layer's calls, copied to pinned host memory behind an event
    as the call is launched, and read :data:`AUTO_LAG` calls later: normally long landed,
    and never waited for (a copy still in flight, the host running steps ahead of the
    GPU, is read by a later call). Nothing is recorded or read inside a capture."""

    def __init__(self, dtype: torch.dtype, width: int = 1) -> None:
        self._dtype, self._width = dtype, width
        # (pinned [width] buffer, its event, what the caller keeps with the value)
        self._pending: collections.deque[tuple[Any, ...]] = collections.deque()
        self._free: list[tuple[torch.Tensor, Any]] = []  # (pinned buffer, event) to reuse

    def _landed(self) -> Iterator[tuple[list, tuple]]:
        """The values (a list of the buffer's elements) and what was kept with them, of
        the calls read now, oldest first."""
        pending = self._pending
        while len(pending) >= AUTO_LAG and pending[0][1].query():
            host, event, *kept = pending.popleft()
            values = host.tolist()
            self._free.append((host, event))
            yield values, tuple(kept)

    def _record(self, value: torch.Tensor, *kept: Any) -> None:
        """Start the host copy of ``value`` (``width`` elements, or one into the first, on
        the current stream)."""
        if torch.cuda.is_current_stream_capturing():
            return
        if self._free:
            host, event = self._free.pop()
        else:
            host = torch.empty((self._width,), dtype=self._dtype, pin_memory=True)
            event = torch.cuda.Event()
        value = value.detach()
        if value.dim() == 0:
            value = value.reshape(1)
        # (the same shape: a plain device-to-host copy, where a broadcast runs a kernel)
        into = host if value.numel() == self._width else host[: value.numel()]
        into.copy_(value, non_blocking=True)
        event.record(_current_stream(value.get_device()))
        self._pending.append((host, event, *kept))


#: raw ``cudaStream_t`` -> its ``torch.cuda.Stream``: ``torch.cuda.current_stream`` builds
#: a new ``Stream`` object on every call (several microseconds of a training call's host
#: time), where the raw handle is one C call.
_streams: dict[tuple[int, int], torch.cuda.Stream] = {}


def _current_stream(device: int) -> torch.cuda.Stream:
    """torch's current stream on CUDA device ``device``, as an object made once."""
    raw_of = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw_of is None:  # (a torch without it)
        return torch.cuda.current_stream(device)
    raw = raw_of(device)
    found = _streams.get((device, raw))
    if found is None:
        if len(_streams) > 64:  # streams made and dropped by a caller: forget the old
            _streams.clear()
        found = _streams[(device, raw)] = torch.cuda.current_stream(device)
    return found


class AutoCapacity(_Lagged):
    """``dense_capacity="auto"`` for one layer's training calls on CUDA: each call's
    capacity comes from the heavy-row count of the layer's call :data:`AUTO_LAG` calls
    before (:func:`train_capacity`, :meth:`choose`; 0 until then). A call's
    count is copied to pinned memory behind an event as the call is launched; the choice
    reads the copy of a call that lies a whole training step or more in the past, which
    has long landed. The host never waits for it: a copy still in flight (the host runs
    more than ``AUTO_LAG - 1`` steps ahead of the GPU) is read by a later call. In a
    loop whose host stays within a step of the GPU the choice is a function of the data
    and the calls before, the same in every run from the same start (the bits repeat);
    a host that runs further ahead may see a count one call later. It changes time and
    rounding, not what is computed: the capacity rows' GEMMs round their products to
    bf16 as dense bf16 math does, twell's own tiles keep them in fp32, and no row is ever
    dropped. It is not part of a state dict (a resumed run starts again at 0), and each
    process of a distributed run chooses on its own data. Inside a CUDA-graph capture of
    the caller's own the capacity is 0 and nothing is read or recorded: a captured step
    is replayed for as long as the caller likes, and a capacity chosen while the model
    was still dense would cost full-size GEMMs in every replay (pass a fixed
    ``dense_capacity`` to capture one)."""

    def __init__(self) -> None:
        super().__init__(torch.int32)  # (count, call's M)
        self.fraction = 0.0
        self.epoch = 0  # resets so far (counts handed over from before one are dropped)
        self._lower = 0  # calls in a row that asked for less than `fraction`
        self._lower_max = 0.0  # the most they asked for

    def __getstate__(self) -> dict[str, Any]:
        # a copy (copy.deepcopy of a model, pickling) keeps the choice, not the copies in
        # flight: CUDA events and pinned buffers are not copied
        return {"fraction": self.fraction}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()
        self.fraction = state["fraction"]

    def choose(self) -> float:
        """The capacity (a fraction of M) for the next call: up at once to what the count
        of :data:`AUTO_LAG` calls before asks for; down only after ``AUTO_PATIENCE`` calls
        in a row asked for less (then to the most any of them asked), so a count that
        wavers around a level does not switch between two launch sequences (and two op
        graphs) every step."""
        if torch.cuda.is_current_stream_capturing():
            return 0.0
        for values, (m,) in self._landed():
            self.take_count(int(values[0]), m, self.epoch)
        return self.fraction

    def take_count(self, count: int, m: int, epoch: int) -> None:
        """Take in the heavy-row count of an ``m``-token call made at ``epoch`` (counts
        from before the last :meth:`reset` are dropped). :class:`TrainSwitch` hands them
        over where one host copy carries both a call's L0 and its count."""
        if epoch != self.epoch:
            return
        self._take(train_capacity(count, m))
        if count > DENSE_SHARE * m and not _warned[0]:
            _warned[0] = True
            warnings.warn(
                f"twell: {count} of a training call's {m} rows had more active units "
                "than the row limit and ran as dense rows; while most rows do, a "
                "SparseMLP is slower than dense math (twell.torch.l0_per_layer(model) "
                "shows each layer's mean active units; shown once per process)",
                DenseRowsWarning,
                stacklevel=3,
            )

    def current(self) -> float:
        """The choice in force, reading nothing (a forward recomputed inside a backward
        pass takes what its first run took); 0 inside a capture, as :meth:`choose`."""
        return 0.0 if torch.cuda.is_current_stream_capturing() else self.fraction

    def reset(self) -> None:
        """Start again at 0 with nothing in flight (the dense switch calls this while the
        layer runs dense math: counts of its denser past would size the capacity of its
        first calls back on the ops): its own copies are dropped (the pinned buffers go
        with them: torch's host allocator reuses a buffer only once its copy is done),
        and counts that :class:`TrainSwitch` carries for it are dropped when read
        (``epoch``)."""
        self.fraction, self._lower, self._lower_max = 0.0, 0, 0.0
        self._pending.clear()
        self.epoch += 1

    def _take(self, asked: float) -> None:
        if asked >= self.fraction:
            self.fraction, self._lower, self._lower_max = asked, 0, 0.0
        else:
            self._lower += 1
            self._lower_max = max(self._lower_max, asked)
            if self._lower >= AUTO_PATIENCE:
                self.fraction, self._lower, self._lower_max = self._lower_max, 0, 0.0

    def record(self, count: torch.Tensor, m: int) -> None:
        """Start the host copy of a call's heavy-row count (``count``: int32 ``[1]`` on
        the current stream), unless a capture is running."""
        self._record(count, m)


class TrainSwitch(_Lagged):
    """The dense switch of one layer's training calls on CUDA (``twell.torch.SparseMLP``'s
    ``density_switch``): a call runs the layer's dense torch math instead of twell's
    training ops while the layer was too dense for them, and the ops again once it is
    sparse enough. Above a mean of about 1.5% of N active units per token
    (:data:`twell.kernels.density.TRAIN_CROSSOVER`, by batch size) the sparse forward +
    backward costs the GPU more than dense math: a model still dense early in sparsity
    training, or a layer that stays denser than the rest, would otherwise train slower
    than without twell.

    Each call's mean active units per token (its ``l0``, on the ops and on dense math
    alike) is copied to pinned memory behind an event, and read :data:`AUTO_LAG` calls
    later, as :class:`AutoCapacity` reads its counts: the host never waits, and a copy
    still in flight is read by a later call. A call on the training ops copies its L0 and
    heavy-row count in one (:meth:`record` with ``auto``), and the count goes to the
    layer's :class:`AutoCapacity` when read. A call denser than the crossover at its size
    turns the switch on at once; ``AUTO_PATIENCE`` calls in a row at or below it turn it
    off, so a layer near the crossover does not alternate. Dense math computes the same
    ``y``, L1 term and L0 (rounded differently: the bits depend on the path, which depends
    on the calls before, as with ``"auto"``). Inside a CUDA-graph capture of the caller's
    own nothing is read or recorded and the call takes the training ops: a captured step
    is replayed for as long as the caller likes, and dense math captured while the model
    was dense would stay in every replay. A forward recomputed inside a backward pass
    (activation checkpointing) takes :meth:`current`: the choice of its first run. Not
    part of a state dict (a resumed run starts on the ops)."""

    def __init__(self) -> None:
        # (L0 and the heavy-row count; call's M, its N, the AutoCapacity the count goes
        # to and its epoch, or None)
        super().__init__(torch.float32, width=2)
        self.dense = False
        self._below = 0  # calls in a row at or below the crossover while dense

    def __getstate__(self) -> dict[str, Any]:
        return {"dense": self.dense}  # (events and pinned buffers are not copied)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()
        self.dense = state["dense"]

    def choose(self) -> bool:
        """Whether the next call runs dense math, after reading the calls that landed
        (:data:`AUTO_LAG` calls back or more; never waited for). False inside a capture."""
        if torch.cuda.is_current_stream_capturing():
            return False
        for values, (m, n, *auto) in self._landed():
            self._take(values[0] / n, m)
            if auto and auto[0] is not None:
                auto[0].take_count(int(values[1]), m, auto[1])
        return self.dense

    def current(self) -> bool:
        """The choice in force, reading nothing (a forward recomputed inside a backward
        pass takes what its first run took); False inside a capture, as :meth:`choose`."""
        return self.dense and not torch.cuda.is_current_stream_capturing()

    def _take(self, share: float, m: int) -> None:
        """Take in a call of ``m`` tokens whose mean active units were ``share`` of N."""
        from twell.kernels.density import train_crossover

        if share > train_crossover(m):
            self.dense, self._below = True, 0
        elif self.dense:
            self._below += 1
            if self._below >= AUTO_PATIENCE:
                self.dense, self._below = False, 0

    def record(self, l0: torch.Tensor, m: int, n: int, auto: AutoCapacity | None = None) -> None:
        """Start the host copy of a call's L0 (float32 on the current stream) for a call
        of ``m`` tokens and ``n`` units, unless a capture is running. ``l0``: a scalar, or
        float32 ``[2]``, the L0 and the call's heavy-row count, which goes to ``auto``
        when read (one copy for both policies, each value read :data:`AUTO_LAG` calls
        later in call order; a copy, an event and a read cost the host microseconds
        each)."""
        if auto is None:
            self._record(l0, m, n)
        else:
            self._record(l0, m, n, auto, auto.epoch)


#: w_up's (storage, offset in it, shape) -> (a weak reference to the storage, its AutoCapacity)
_by_weights: dict[tuple, tuple[Any, AutoCapacity]] = {}


def for_weights(w_up: torch.Tensor) -> AutoCapacity:
    """The :class:`AutoCapacity` of the layer whose ``w_up`` this is, for the training
    ops called with :data:`AUTO` (module docstring): one per weight (its storage, where
    in it, its shape: layers that are views of one flat buffer get one each), kept while
    the storage lives (a weak reference, as twell.inference's registry keeps blocks)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    storage = w_up.untyped_storage()
    # where in the storage, not the address: a storage resized in place (FSDP2 frees
    # and gathers its parameters so) keeps its layer
    key = (storage._cdata, w_up.storage_offset(), tuple(w_up.shape))
    found = _by_weights.get(key)
    if found is not None and not found[0].expired():
        return found[1]
    for dead in [k for k, (ref, _) in list(_by_weights.items()) if ref.expired()]:
        _by_weights.pop(dead, None)
    auto = AutoCapacity()
    _by_weights[key] = (StorageWeakRef(storage), auto)
    return auto
