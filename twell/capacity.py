"""``dense_capacity="auto"`` for training: each layer's capacity of heavy rows done by
fixed-size cuBLAS GEMMs, chosen from the heavy-row counts of its earlier calls without a
host wait (:class:`AutoCapacity`; ``twell.torch.SparseMLP``'s default).

Eager calls take the capacity from the ``SparseMLP``'s own :class:`AutoCapacity`. Code
that ``torch.compile`` traced reaches the training ops with :data:`AUTO` instead (the
choice cannot be traced: it moves from call to call); the ops' CUDA implementations then
take it from :func:`for_weights`, one :class:`AutoCapacity` per layer, found by its
``w_up``'s storage."""

from __future__ import annotations

import collections
import math
import warnings
from typing import Any

import torch

from twell.options import AUTO_HEADROOM, AUTO_PATIENCE

__all__ = [
    "AUTO", "AUTO_LAG", "DENSE_SHARE", "STEP", "AutoCapacity", "DenseRowsWarning",
    "for_weights", "train_capacity",
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


class AutoCapacity:
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
        self.fraction = 0.0
        self._pending: collections.deque[tuple[torch.Tensor, Any, int]] = collections.deque()
        self._free: list[tuple[torch.Tensor, Any]] = []  # (pinned buffer, event) to reuse
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
        pending = self._pending
        # Recorded AUTO_LAG calls ago: normally long done. A copy still in flight (the
        # host runs steps ahead of the GPU) is read by a later call: never waited for.
        while len(pending) >= AUTO_LAG and pending[0][1].query():
            host, event, m = pending.popleft()
            count = int(host[0])
            self._take(train_capacity(count, m))
            self._free.append((host, event))
            if count > DENSE_SHARE * m and not _warned[0]:
                _warned[0] = True
                warnings.warn(
                    f"twell: {count} of a training call's {m} rows had more active units "
                    "than the row limit and ran as dense rows; while most rows do, a "
                    "SparseMLP is slower than dense math (twell.torch.l0_per_layer(model) "
                    "shows each layer's mean active units; shown once per process)",
                    DenseRowsWarning,
                    stacklevel=2,
                )
        return self.fraction

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
        if torch.cuda.is_current_stream_capturing():
            return
        if self._free:
            host, event = self._free.pop()
        else:
            host, event = torch.empty((1,), dtype=torch.int32, pin_memory=True), torch.cuda.Event()
        host.copy_(count.reshape(1), non_blocking=True)  # on count's device
        event.record(torch.cuda.current_stream(count.device))
        self._pending.append((host, event, m))


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
