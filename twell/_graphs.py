"""One CUDA graph per batch shape: how an eager torch call costs one graph launch.

A forward pass is about ten kernel launches and as many buffer allocations, each of
which costs several microseconds of Python on the host; at decode-sized batches that,
not the GPU, sets the time of a call. :class:`GraphedBlock` therefore captures the whole
launch sequence of a prepared block once per (tokens, dtype, the density switch's decision
and capacity) with ``torch.cuda.graph`` and replays it: a call is then a copy of ``x`` into the
graph's input buffer, one replay, and a copy of the output out of the graph's buffer
(three operations on torch's current stream). The replay runs the same kernels as an
eager call, so it gives the same bits.

It steps aside (plain launches) when the caller is capturing a graph of its own (the
launches then belong to the caller's graph), above :data:`MAX_TOKENS` tokens (where the
GPU work hides the host cost), and every :data:`REFRESH`-th call, which runs eagerly so
the density switch keeps seeing fresh statistics. Graphs are kept for the most recent
:data:`CACHE` shapes.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable
from typing import Any

#: Largest batch (tokens) replayed from a graph.
MAX_TOKENS = 4096
#: Every REFRESH-th call runs eagerly (fresh density statistics).
REFRESH = 64
#: Graphs kept per block.
CACHE = 8


class GraphedBlock:
    """Replays captured graphs of ``run(x) -> y`` (torch tensors in and out, ``x`` 2-D).

    Args:
        run: the eager call (validation done), on torch's current stream.
        decision: ``decision(m, read)`` returns a hashable key of what a call of ``m``
            rows would do now (the density switch's decision): with ``read``, after taking
            in statistics that have landed; without, from the statistics in force (what a
            capture runs). A graph is captured per key.
    """

    def __init__(self, run: Callable[[Any], Any], decision: Callable[[int, bool], Any]) -> None:
        self.run = run
        self.decision = decision
        self._graphs: collections.OrderedDict[tuple, tuple[Any, Any, Any]] = (
            collections.OrderedDict()
        )
        self._calls = 0

    def __call__(self, x: Any) -> Any:
        import torch

        self._calls += 1
        if (
            x.shape[0] > MAX_TOKENS
            or x.shape[0] == 0
            or torch.cuda.is_current_stream_capturing()
            or self._calls % REFRESH == 0
        ):
            return self.run(x)
        key = (tuple(x.shape), x.dtype, x.device, self.decision(x.shape[0], True))
        found = self._graphs.get(key)
        if found is None:
            found = self._capture(x)
            # The capture's warm-up calls may have taken in newer statistics: file the
            # graph under the decision it ran.
            key = (*key[:3], self.decision(x.shape[0], False))
            self._graphs[key] = found
            while len(self._graphs) > CACHE:
                self._graphs.popitem(last=False)
        else:
            self._graphs.move_to_end(key)
        graph, static_x, static_y = found
        static_x.copy_(x)
        graph.replay()
        return static_y.clone()

    def _capture(self, x: Any) -> tuple[Any, Any, Any]:
        import torch

        static_x = x.clone()
        side = torch.cuda.Stream(x.device)
        side.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up: kernels loaded, torch's cuBLAS set up
                self.run(static_x)
        torch.cuda.current_stream(x.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = self.run(static_x)
        return graph, static_x, static_y


#: Graphs kept per training op (:class:`OpGraphs`): one per layer and batch shape.
OP_CACHE = 128
#: Keys remembered as seen once (a key is captured when it comes back).
OP_SEEN = 256


def _arg_key(arg: Any, pinned: bool) -> Any:
    """What identifies an argument for a graph: a pinned tensor by where it lives and how
    it is laid out (the graph reads that memory), another tensor by its layout (it is
    copied into the graph's own buffer), anything else by value."""
    import torch

    if isinstance(arg, torch.Tensor):
        address = arg.data_ptr() if pinned else None
        return (address, tuple(arg.shape), arg.stride(), arg.dtype, arg.device)
    return arg


class OpGraphs:
    """One CUDA graph per (argument layouts and values) of ``fn(*args)``: how an eager
    training op costs one replay instead of some forty launches and allocations.

    The arguments at the ``pinned`` positions (the weights: parameters stay where they
    are from step to step) are read where they lie, so their addresses are part of the
    key; every other tensor argument is copied into a buffer of the graph before each
    replay (the activations and gradients of a step land at addresses that torch's
    allocator does not repeat reliably). A key's first call runs eagerly; its second
    captures ``fn`` and replays it; later ones replay. The outputs live in the graph's
    memory, so every call returns fresh clones of them (a replay never changes a tensor
    that an earlier call returned). Calls made while the caller is capturing a graph of
    its own run eagerly (their launches belong to that graph).

    The graphs of one instance share one memory pool and one capture stream per device,
    so their scratch memory is shared and only their input buffers and outputs are kept
    per graph. Replays are therefore stream-ordered on the caller's current stream: two
    replays of one instance must not run concurrently on different streams. Everything
    runs with the arguments' device current. A key whose capture failed runs eagerly
    from then on (the error is raised once, by the call that captured).

    Args:
        capacity: graphs kept (least recently used dropped first; :meth:`clear` drops
            them all).
        replace: argument positions of a setting that moves over a run (the dense
            capacity ``dense_capacity="auto"`` picks): a graph captured for one value
            drops the graph of the same other arguments at another value, so a layer
            keeps one graph per batch shape, not one per value it ever took.
    """

    def __init__(self, capacity: int = OP_CACHE, replace: frozenset[int] = frozenset()) -> None:
        self.capacity = capacity
        self.replace = replace
        self._by_rest: dict[tuple, tuple] = {}
        self._graphs: collections.OrderedDict[tuple, tuple[Any, tuple, tuple]] = (
            collections.OrderedDict()
        )
        self._seen: collections.OrderedDict[tuple, None] = collections.OrderedDict()
        self._failed: set[tuple] = set()
        self._pool: Any = None
        self._streams: dict[Any, Any] = {}
        self.captures = 0
        self.replays = 0

    def clear(self) -> None:
        """Drop every graph (and the memory that only they hold)."""
        self._graphs.clear()
        self._by_rest.clear()
        self._seen.clear()
        self._failed.clear()

    def __call__(self, fn: Callable[..., tuple], args: tuple, pinned: frozenset[int]) -> tuple:
        import torch

        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        with torch.cuda.device(device):
            return self._call(fn, args, pinned, device)

    def _call(self, fn: Callable[..., tuple], args: tuple, pinned: frozenset[int],
              device: Any) -> tuple:  # fmt: skip
        import torch

        if torch.cuda.is_current_stream_capturing():
            return fn(*args)
        key = tuple(_arg_key(a, i in pinned) for i, a in enumerate(args))
        found = self._graphs.get(key)
        if found is None:
            if key in self._failed:
                return fn(*args)
            if key not in self._seen:
                self._seen[key] = None
                while len(self._seen) > OP_SEEN:
                    self._seen.popitem(last=False)
                return fn(*args)
            del self._seen[key]
            try:
                found = self._capture(fn, args, pinned, device)
            except BaseException:
                self._failed.add(key)
                raise
            self._graphs[key] = found
            if self.replace:
                rest = tuple(k for i, k in enumerate(key) if i not in self.replace)
                old = self._by_rest.get(rest)
                if old is not None and old != key:
                    self._graphs.pop(old, None)
                self._by_rest[rest] = key
            while len(self._graphs) > self.capacity:
                dropped, _ = self._graphs.popitem(last=False)
                if self.replace:
                    rest = tuple(k for i, k in enumerate(dropped) if i not in self.replace)
                    if self._by_rest.get(rest) == dropped:
                        del self._by_rest[rest]
        else:
            self._graphs.move_to_end(key)
            for buffer, arg in zip(found[1], args, strict=True):
                if buffer is not None:
                    buffer.copy_(arg)
        graph, _, outputs = found
        graph.replay()
        self.replays += 1
        return tuple(None if t is None else t.clone() for t in outputs)

    def _capture(
        self, fn: Callable[..., tuple], args: tuple, pinned: frozenset[int], device: Any
    ) -> tuple[Any, tuple, tuple]:
        """Capture on this instance's side stream of ``device`` with ``capture_begin``/
        ``capture_end``, not the ``torch.cuda.graph`` context: that one empties torch's
        allocator cache first, so every capture would cost the next steps fresh
        allocations from the driver. (The allocator reuses a freed block only on the
        stream that allocated it: one stream lets the graphs share their scratch.)"""
        import torch

        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        side = self._streams.get(device)
        if side is None:
            side = self._streams[device] = torch.cuda.Stream(device)
        buffers = tuple(
            a.clone() if isinstance(a, torch.Tensor) and i not in pinned else None
            for i, a in enumerate(args)
        )
        inputs = tuple(a if b is None else b for a, b in zip(args, buffers, strict=True))
        current = torch.cuda.current_stream()
        side.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            # thread_local: CUDA calls of other threads (a DDP reducer's, a data
            # loader's) neither break this capture nor are broken by it.
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                outputs = fn(*inputs)
            except BaseException:
                with contextlib.suppress(Exception):  # the first error is the one to see
                    graph.capture_end()
                raise
            graph.capture_end()
        current.wait_stream(side)
        self.captures += 1
        return graph, buffers, tuple(outputs)
