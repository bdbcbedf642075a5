"""One CUDA graph per batch shape: how an eager torch call costs one graph launch.

A forward pass is about ten kernel launches and as many buffer allocations, each of
which costs several microseconds of Python on the host; at decode-sized batches that,
not the GPU, sets the time of a call. :class:`GraphedBlock` therefore captures the whole
launch sequence of a prepared block once per (tokens, dtype, dense-or-sparse decision)
with ``torch.cuda.graph`` and replays it: a call is then a copy of ``x`` into the
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
        decision: returns a hashable key of what the eager call would do now (the density
            switch's decision); a graph is captured per key.
    """

    def __init__(self, run: Callable[[Any], Any], decision: Callable[[], Any]) -> None:
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
        key = (tuple(x.shape), x.dtype, x.device, self.decision())
        found = self._graphs.get(key)
        if found is None:
            found = self._capture(x)
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
