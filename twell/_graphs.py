"""One CUDA graph per batch shape: how an eager torch call costs one graph launch.

A forward pass is about ten kernel launches and as many buffer allocations, each of
which costs several microseconds of Python on the host; at decode-sized batches that,
not the GPU, sets the time of a call, and at prefill sizes the GPU waits for the host
before the first kernel. :class:`GraphedBlock` therefore captures the whole launch
sequence of a prepared block once per (tokens, dtype, stream, alignment of ``x``, the
density switch's decision and capacity) and launches the graph instead. Above
:data:`SMALL_TOKENS` tokens the graph's kernels are pointed at the call's ``x`` and at a
fresh output tensor (twell._graph_nodes.Repointed): a call is then an allocation and
one graph launch, with no copy on the GPU. Smaller batches, and a graph that cannot be
re-pointed (a kernel reading ``x`` in a way the scan does not see), replay with a copy
of ``x`` into the graph's input buffer and of its output out (up to
:data:`COPY_TOKENS` tokens; :class:`_Graph` says why small batches copy). Either way the
launch runs the eager call's kernels, so it gives the same bits; a graph is used
re-pointed only after a launch pointed at the call's tensors, with the captured buffers
poisoned, reproduced the eager output bit for bit.

A graph is captured the first time a batch of at most :data:`COPY_TOKENS` tokens comes
(decode shapes repeat), the second time for a larger one (prefill lengths rarely do),
never above :data:`GRAPH_TOKENS` tokens; at most :data:`CACHE` graphs per block are
kept, :data:`LARGE` of them above :data:`COPY_TOKENS` tokens. All blocks' graphs
replayed on one stream share one memory pool (their scratch is reused from one graph to
the next: the launches on one stream never overlap), and a capture takes everything it
allocates but the call's output from that pool, leaving torch's default pool as it found
it (a caller's next allocations land where they would have). Plain launches are used
when the caller is capturing a graph of its own (the launches then belong to the
caller's graph) and every ``refresh_every``-th call of the block's density policy, which
runs eagerly so that the density switch keeps seeing fresh statistics (none with the
switch off).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import weakref
from collections.abc import Callable
from typing import Any

from twell import _graph_nodes
from twell.kernels.compile import planned

#: Largest batch (tokens) replayed with copies of x and y when the graph cannot be
#: re-pointed (the copies cost 4 bytes of traffic per element of x and y each call).
COPY_TOKENS = 4096
#: Largest batch that gets a graph at all: above, a call's GPU work (over 1 ms) hides
#: its host cost, and the graph's memory pool would keep hundreds of MB of scratch.
GRAPH_TOKENS = 16384
#: Most tokens of a call replayed with copies of x and y rather than re-pointed (see
#: _Graph).
SMALL_TOKENS = 256
#: Instantiations of a graph kept pointed at recent calls' tensors (see _Graph).
EXECS = 2
#: Graphs kept per block, and of them at most LARGE above COPY_TOKENS tokens.
CACHE = 8
LARGE = 2
#: Keys remembered per block as seen once (large batches), or as failing to re-point.
SEEN = 64
#: Calls within one cuBLAS epoch (see :data:`_cublas_epoch`) after which a shape whose
#: graph a workspace free dropped is captured again: REGAIN_FIRST after a graph that
#: paid for its capture (PAID_REPLAYS replays: a capture costs about three eager calls
#: and a synchronisation), twice the shape's last wait after one that did not, at most
#: REGAIN. Where torch's graph trees record at every call or two (each recording frees
#: the workspaces), a shape thus backs off to one capture per REGAIN calls; where they
#: stop recording (transformers' static-cache ``generate`` once its cache sits where the
#: trees recorded it), a prefill shape replays from the next call on. A capture itself
#: does not move later allocations (its own go to the graphs' pool,
#: :func:`_allocating_from`), so it does not make the trees record.
REGAIN_FIRST = 2
REGAIN = 64
PAID_REPLAYS = 4

#: (device index, replay stream) -> [memory pool, capture stream, graphs captured into it,
#: torch's routing functions or None (_routing)], shared by all blocks.
_pools: dict[tuple[int, int], list[Any]] = {}

#: How many times torch has freed its cuBLAS workspaces since twell first captured a graph
#: (:func:`_watch_cublas_workspaces`). A graph holding torch's cuBLAS kernels (the gate
#: GEMM, dense math, heavy rows' fixed-size GEMMs) reads the workspace torch kept for the
#: capture stream when it was captured; torch frees those workspaces
#: (``torch._C._cuda_clearCublasWorkspaces``) around every warm-up and recording of its
#: CUDA-graph trees (``torch.compile(mode="reduce-overhead")``, transformers' static-cache
#: ``generate``), and a replay after that writes to freed memory: an illegal address, or
#: another tensor's bytes. Graphs captured in an older epoch are dropped and captured
#: again instead.
_cublas_epoch = [0]


def _watch_cublas_workspaces() -> None:
    """Count torch's frees of its cuBLAS workspaces in :data:`_cublas_epoch` (wraps the
    function torch's graph trees call; once)."""
    import torch

    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None or getattr(clear, "_twell_counts", False):
        return

    def counted(*args: Any, **kwargs: Any) -> Any:
        _cublas_epoch[0] += 1
        return clear(*args, **kwargs)

    counted._twell_counts = True  # type: ignore[attr-defined]
    torch._C._cuda_clearCublasWorkspaces = counted


def _current(graph: Any) -> bool:
    """Whether a captured graph's cuBLAS workspace still exists (see :data:`_cublas_epoch`)."""
    return graph.epoch == _cublas_epoch[0]


class _Graph:
    """A captured call, launched re-pointed at the call's ``x`` and, with
    ``fresh_output``, at a fresh output tensor (else its output is cloned out of
    ``static_y``); or replayed with copies (``static_x`` in, ``static_y`` out): where it
    could not be re-pointed, and for batches of at most :data:`SMALL_TOKENS` tokens.

    Changing where an instantiated graph points costs its next launch an update: 10–25
    µs of host time and tens of µs of GPU latency, which a call of more than
    :data:`SMALL_TOKENS` tokens hides behind the previous call's GPU work. Such a call
    launches whichever of up to :data:`EXECS` instantiations points at its tensors (a
    loop that keeps one output while making the next alternates between two addresses),
    else re-points the least recently used. Small batches replay with copies: on the
    H100 at M=8 and 64, re-pointing measured 0.019 and 0.026 ms a call back to back
    where the tensors stayed in place, against 0.032 and 0.055 with copies, but 0.063 and
    0.070 where calls alternated between two inputs, with any policy tried (one
    instantiation re-pointed each call, two kept pointed, torch's own between copies):
    a graph once re-pointed launched slower between other work, for a reason not found.
    ``keep``: buffers the captured kernels use that the shared memory pool does not own
    (none, normally)."""

    def __init__(self, graph: Any, repointed: Any, static_x: Any, static_y: Any,
                 keep: list[Any], fresh_output: bool) -> None:  # fmt: skip
        self.graph = graph
        self.epoch = _cublas_epoch[0]
        self.replays = 0
        self.execs = [] if repointed is None else [repointed]  # least recently used first
        self.fresh_output = repointed is not None and fresh_output
        self.static_x = static_x if repointed is None else None
        self.static_y = static_y if repointed is None or not self.fresh_output else None
        self.out = (tuple(static_y.shape), static_y.dtype)
        self.keep = keep
        import torch

        self._tensor, self._empty = torch.Tensor, torch.empty

    def __call__(self, x: Any, stream: int) -> Any:
        """The graph's output for ``x``, launched on ``stream`` (a raw CUDA stream: torch's
        current one, where copies and torch's own replay run)."""
        execs = self.execs
        if not execs:
            self.static_x.copy_(x)
            self.graph.replay()
            return self.static_y.clone()
        y = None
        if self.fresh_output:
            # new_empty: x's device without building a torch.device (every microsecond of a
            # replayed call's host time counts); not for a subclass of Tensor, whose
            # new_empty would return the subclass where an eager call returns a Tensor
            shape, dtype = self.out
            y = (
                x.new_empty(shape, dtype=dtype)
                if type(x) is self._tensor
                else self._empty(shape, dtype=dtype, device=x.device)
            )
        want = (x.data_ptr(),) if y is None else (x.data_ptr(), y.data_ptr())
        found = execs[-1]  # the most recently used last: a loop in place hits it
        if found.bases != want:
            found = next((e for e in execs if e.bases == want), None)
            if found is None:
                if len(execs) < EXECS:
                    found = _graph_nodes.Repointed(self.graph.raw_cuda_graph(), execs[0].ranges)
                else:
                    found = execs[0]
                found.point(want)
            if found in execs:
                execs.remove(found)
            execs.append(found)
        found.launch(stream)
        return self.static_y.clone() if y is None else y


class GraphedBlock:
    """Replays captured graphs of ``run(x) -> y`` (torch tensors in and out, ``x`` 2-D).

    Args:
        run: the eager call (validation done), on torch's current stream.
        density: the block's density policy (twell.kernels.density.DensitySwitch):
            ``density.decision(m, read)`` is the hashable key of what a call of ``m``
            rows would do now (with ``read``, after taking in statistics that have
            landed; without, from the statistics in force: what a capture runs), and a
            graph is captured per key; every ``density.refresh_every``-th call runs
            eagerly after ``density.measure_next()``, so that the statistics stay fresh
            (None: the switch is off, no refresh calls).
        scratch: the list into which ``run`` appends the buffers of a captured call
            (``PreparedBlock._graph_scratch``): a capture takes its entries, so that they
            live as long as the graph rather than as long as the block.
    """

    def __init__(self, run: Callable[[Any], Any], density: Any,
                 scratch: list[Any] | None = None) -> None:  # fmt: skip
        self.run = run
        self.decision = density.decision
        self.measure = density.measure_next
        self.refresh = density.refresh_every
        self.scratch = scratch
        self._graphs: collections.OrderedDict[tuple, _Graph] = collections.OrderedDict()
        self._seen: collections.OrderedDict[tuple, None] = collections.OrderedDict()
        self._eager: collections.OrderedDict[tuple, None] = collections.OrderedDict()
        self._epochs: collections.OrderedDict[tuple, int] = collections.OrderedDict()
        # shapes whose graph a free dropped -> [epoch, calls in it]; their waits (REGAIN)
        self._lost: collections.OrderedDict[tuple, list[int]] = collections.OrderedDict()
        self._waits: collections.OrderedDict[tuple, int] = collections.OrderedDict()
        self._calls = 0
        self.captures = 0

    def __call__(self, x: Any) -> Any:
        self._calls += 1
        m = x.shape[0]
        if m == 0 or m > GRAPH_TOKENS or _capturing() or planned():
            return self.run(x)
        if self.refresh is not None and self._calls % self.refresh == 0:
            self.measure()
            return self.run(x)
        device = x.get_device()
        stream = _raw_stream(device)
        # The alignment of x is part of the layout: the captured kernels (cuBLAS's, the
        # gate's TMA map) may rely on the captured x's.
        address = x.data_ptr()
        alignment = min(address & -address, 256)
        key = (x.shape, x.dtype, device, stream, alignment, self.decision(m, True))
        found = self._graphs.get(key)
        if found is not None:
            if _current(found):
                self._graphs.move_to_end(key)
                found.replays += 1
                return found(x, stream)
            del self._graphs[key]  # its cuBLAS workspace is gone
            waited = self._waits.get(key, 0)
            paid = found.replays >= PAID_REPLAYS
            wait = REGAIN_FIRST if paid or not waited else min(2 * waited, REGAIN)
            _note(self._waits, key, wait)
            _note(self._lost, key, [_cublas_epoch[0], 0])
        if key in self._eager or (
            m > COPY_TOKENS and (not _can_repoint() or not _remember(self._seen, key))
        ):
            return self.run(x)
        epoch = _cublas_epoch[0]
        lost = self._lost.get(key)
        if lost is not None:
            # captured again only after its wait in calls within one epoch (see REGAIN)
            lost[:] = [epoch, lost[1] + 1 if lost[0] == epoch else 1]
            if lost[1] < self._waits.get(key, REGAIN_FIRST):
                return self.run(x)
            del self._lost[key]
        elif epoch and self._epochs.get(key) != epoch:
            # torch's graph trees run in this process and free the cuBLAS workspaces at
            # each of their recordings (transformers' generate records anew per call): a
            # shape is captured only once it comes back within one epoch, so that a
            # prompt's prefill does not pay a capture per generate call.
            _note(self._epochs, key, epoch)
            return self.run(x)
        import torch

        try:
            found, y = self._capture(x, torch.cuda.current_stream(device))
        except BaseException:
            _note(self._eager, key)  # the error is raised once; later calls run eagerly
            raise
        # The capture's warm-up calls may have taken in newer statistics: file the graph
        # under the decision it ran.
        key = (*key[:5], self.decision(m, False))
        if found is None:
            _note(self._eager, key)
            return y
        self._graphs[key] = found
        large = [k for k in self._graphs if k[0][0] > COPY_TOKENS]
        if m > COPY_TOKENS and len(large) > LARGE:
            del self._graphs[large[0]]
        while len(self._graphs) > CACHE:
            self._graphs.popitem(last=False)
        return y

    def _capture(self, x: Any, stream: Any) -> tuple[_Graph | None, Any]:
        """Capture ``run`` for ``x``'s layout; returns the graph (None: neither
        re-pointable nor small enough for copies) and this call's output."""
        import torch

        try:
            graph = torch.cuda.CUDAGraph(keep_graph=True)
        except TypeError:  # torch before 2.8: no access to the captured graph
            graph = torch.cuda.CUDAGraph()
        pool, side = _pool(graph, x.device, stream)
        # Everything the capture allocates beside the call's output comes from the graphs'
        # own pool: the copy of x, the warm-up calls' buffers, the captured scratch. In
        # torch's default pool those blocks would change which free block the caller's
        # next allocations take (transformers' static cache is allocated layer by layer
        # during the prefill that captures), and torch's graph trees record anew when
        # their static inputs move.
        with _allocating_from(pool, x.device):
            static_x = _copy_at_alignment(x)
            side.wait_stream(stream)
            with torch.cuda.stream(side):
                for _ in range(2):  # warm-up: kernels loaded, torch's cuBLAS set up
                    expected = self.run(static_x)
        mark = len(self.scratch) if self.scratch is not None else 0
        try:
            static_y = _capture_into(graph, pool, side, self.run, static_x)
        finally:
            stream.wait_stream(side)
            # The capture's buffers that torch's pool does not hold (none, normally:
            # PreparedBlock keeps only those) live with the graph.
            taken = self.scratch[mark:] if self.scratch is not None else []
            keep = [b for entry in taken for b in entry]
            if self.scratch is not None:
                del self.scratch[mark:]
        self.captures += 1
        fresh_output = x.dtype == torch.bfloat16  # the output is the forward's first buffer
        repointed, y = None, None
        if x.shape[0] > SMALL_TOKENS:
            repointed, y = _try_repoint(
                graph, static_x, static_y, x, expected, stream, fresh_output
            )
        if repointed is not None:
            return _Graph(graph, repointed, static_x, static_y, keep, fresh_output), y
        if x.shape[0] > COPY_TOKENS:
            # a run of a copy of x: the call's output, copied out of the graphs' pool
            # (which goes with the last graph of it)
            expected.record_stream(stream)  # made on the capture stream, read on this one
            return None, expected.clone()
        found = _Graph(graph, None, static_x, static_y, keep, False)
        return found, found(x, stream.cuda_stream)


def _capture_into(graph: Any, pool: Any, side: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` captured into ``graph`` on stream ``side`` with memory from ``pool``
    (``capture_begin``/``capture_end``, not the ``torch.cuda.graph`` context, which empties
    torch's allocator cache first); returns what ``fn`` returned."""
    import torch

    _watch_cublas_workspaces()
    with torch.cuda.stream(side):
        # thread_local: CUDA calls of other threads (a DDP reducer's, a data loader's)
        # neither break this capture nor are broken by it.
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            out = fn(*args)
        except BaseException:
            with contextlib.suppress(Exception):  # the first error is the one to see
                graph.capture_end()
            raise
        graph.capture_end()
    return out


def _note(keys: collections.OrderedDict, key: tuple, value: Any = None) -> None:
    """Add ``key`` to ``keys`` (the most recent :data:`SEEN` kept)."""
    keys[key] = value
    keys.move_to_end(key)
    while len(keys) > SEEN:
        keys.popitem(last=False)


@functools.cache
def _torch_calls() -> tuple[Callable[[], bool], Callable[[int], int]]:
    """torch's capture check and its current stream as a ``cudaStream_t``, looked up once:
    the private calls its compiler's generated code uses (the public ones wrap them, and
    ``torch.cuda.current_stream`` builds a ``Stream`` object: several microseconds of a
    replayed call's host time), else the public ones."""
    import torch

    check = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return (
        check or torch.cuda.is_current_stream_capturing,
        raw or (lambda device: torch.cuda.current_stream(device).cuda_stream),
    )


def _capturing() -> bool:
    """Whether torch's current stream is capturing."""
    return _torch_calls()[0]()


def _raw_stream(device: int) -> int:
    """torch's current stream on ``device`` as a ``cudaStream_t``."""
    return _torch_calls()[1](device)


def _can_repoint() -> bool:
    """Whether torch gives access to a captured graph (2.8 and later): without, a batch
    above :data:`COPY_TOKENS` tokens gets no graph."""
    import torch

    return hasattr(torch.cuda.CUDAGraph, "raw_cuda_graph")


def _remember(seen: collections.OrderedDict, key: tuple) -> bool:
    """Whether ``key`` was in ``seen`` (then it is taken out); otherwise adds it."""
    if key in seen:
        del seen[key]
        return True
    _note(seen, key)
    return False


def _pool(graph: Any, device: Any, stream: Any) -> tuple[Any, Any]:
    """The memory pool and capture stream of the graphs replayed on ``stream``, with
    ``graph`` (a torch CUDA graph about to be captured into it) counted as a user of
    the pool until it is collected.

    The capture's allocations outside the graph take the pool too (:func:`_allocating_from`).
    torch releases a pool when the last graph captured into it goes, and its handle
    cannot be captured into again: the entry lives only as long as a graph of it. (Not a
    ``torch.cuda.MemPool``: its destructor empties the pool's cache, which aborts the
    process when it runs while torch's graph trees route allocations to their own pool.)"""
    import torch

    key = (device.index, stream.cuda_stream)
    entry = _pools.get(key)
    if entry is None:
        handle = torch.cuda.graph_pool_handle()
        # The entry holds one use of the pool (routing begun and ended creates it and
        # counts a use; releasing gives that use back), so that the allocations routed to
        # it before a capture (_allocating_from) never find it unused.
        routing = _routing()
        if routing is not None:
            routing[0](device.index, handle)
            routing[1](device.index, handle)
        entry = _pools[key] = [handle, torch.cuda.Stream(device), 0, routing]
    entry[2] += 1

    def release() -> None:
        entry[2] -= 1
        if entry[2] == 0 and _pools.get(key) is entry:
            del _pools[key]
            if entry[3] is not None:
                # only counts the use down: torch frees the pool's memory once no graph
                # uses it and its blocks are free, at a time of its choosing
                entry[3][2](device.index, entry[0])

    weakref.finalize(graph, release)
    return entry[0], entry[1]


def _routing() -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]] | None:
    """torch's functions that route a thread's allocations to a graph pool and back
    (begin, end, release; ``torch.cuda.use_mem_pool`` is built on them), or None on a
    torch without them."""
    import torch

    names = ("_cuda_beginAllocateCurrentThreadToPool", "_cuda_endAllocateToPool",
             "_cuda_releasePool")  # fmt: skip
    found = tuple(getattr(torch._C, name, None) for name in names)
    return None if None in found else found  # type: ignore[return-value]


@contextlib.contextmanager
def _allocating_from(pool: Any, device: Any) -> Any:
    """This thread's torch allocations on ``device`` come from the graph pool ``pool``
    (from torch's default pool on a torch without the routing functions)."""
    routing = _routing()
    if routing is None:
        yield
        return
    begin, end, release = routing
    begin(device.index, pool)
    try:
        yield
    finally:
        end(device.index, pool)
        release(device.index, pool)


def _try_repoint(graph: Any, static_x: Any, static_y: Any, x: Any, expected: Any,
                 stream: Any, fresh_output: bool) -> tuple[Any, Any]:  # fmt: skip
    """The graph re-pointed at ``x`` (and, with ``fresh_output``, at a fresh output),
    and this call's output, when a launch so pointed, with the captured buffers
    poisoned, gives ``expected``'s bits (a synchronisation); else ``(None, None)``.

    The output is re-pointed only where its memory was the capture's first allocation
    (``fresh_output``: the bf16 ``y``, which the forward allocates before anything
    else). A buffer allocated later may lie where the capture had already freed a
    scratch buffer of an earlier kernel, whose pointer would then look like one into
    the output and be moved with it (to memory that may be too small for the scratch)."""
    import torch

    if not hasattr(graph, "raw_cuda_graph"):
        return None, None
    ranges = [(static_x.data_ptr(), _nbytes(static_x))]
    if fresh_output:
        ranges.append((static_y.data_ptr(), _nbytes(static_y)))
    try:
        repointed = _graph_nodes.Repointed(graph.raw_cuda_graph(), ranges)
    except (RuntimeError, TypeError):
        return None, None
    if repointed.blocked or any(" twell_" in f" {name}" for name in repointed.opaque):
        repointed.close()
        return None, None
    y = torch.empty_like(static_y)
    for buffer in (static_x, static_y, y):
        _bytes(buffer).fill_(255)  # NaN in every float type
    try:
        repointed.point((x.data_ptr(), y.data_ptr())[: len(ranges)])
        repointed.launch(stream.cuda_stream)
    except RuntimeError:
        repointed.close()
        static_x.copy_(x)
        return None, None
    if not fresh_output:
        y = static_y.clone()
    if not torch.equal(_bytes(y), _bytes(expected)):
        repointed.close()
        static_x.copy_(x)
        return None, None
    return repointed, y


def _copy_at_alignment(x: Any) -> Any:
    """A copy of contiguous ``x`` at an address of the same remainder modulo 256 (so the
    captured kernels are those an eager call on ``x`` runs)."""
    import torch

    raw = torch.empty(_nbytes(x) + 256, dtype=torch.uint8, device=x.device)
    start = (x.data_ptr() - raw.data_ptr()) % 256
    out = raw[start : start + _nbytes(x)].view(x.dtype).view(x.shape)
    out.copy_(x)
    return out


def _bytes(tensor: Any) -> Any:
    """A contiguous tensor's bytes (a uint8 view; 0-d tensors too)."""
    import torch

    return tensor.reshape(-1).view(torch.uint8)


def _nbytes(tensor: Any) -> int:
    return tensor.numel() * tensor.element_size()


#: Graphs kept per training op (:class:`OpGraphs`): one per layer and batch shape.
OP_CACHE = 128
#: Keys remembered as seen once (a key is captured when it comes back).
OP_SEEN = 256
#: Graphs per key of an :class:`OpGraphs` that hands its outputs over: while one's are
#: still held (gradients accumulated over micro-batches), the next serves.
SLOTS = 2


def _arg_key(arg: Any, pinned: bool) -> Any:
    """What identifies an argument for a graph: a pinned tensor by where it lives and how
    it is laid out (the graph reads that memory), another tensor by its layout (it is
    copied into the graph's own buffer), anything else by value."""
    import torch

    if isinstance(arg, torch.Tensor):
        address = arg.data_ptr() if pinned else None
        return (address, arg.shape, arg.stride(), arg.dtype, arg.device)
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
    replays of one instance must not run concurrently on different streams. And a
    capture takes memory that earlier captures freed, so a graph's scratch may lie where
    a graph captured after it keeps its outputs: before a graph replays, the tensors that
    later-captured graphs lent and that are still held are copied out (:meth:`Lease.keep`;
    two forwards before one backward need this), and outputs that are not lent are
    returned as copies anyway. Everything runs with the arguments' device current. A key
    whose capture failed runs eagerly from then on (the error is raised once, by the call
    that captured).

    ``hand_over``: outputs that ``fn`` can write into given tensors (its keyword ``out``)
    are not copied but handed over. Their tensors are allocated outside the pool when a
    graph is captured, so no graph's scratch lies there, and a graph replays into them
    only while torch counts no user of their storage outside the graph (a returned
    tensor, a view of one, autograd keeping it as ``.grad``; torch's own CUDA graph trees
    judge liveness the same way). While they are held (gradients accumulated over
    micro-batches, or zeroed in place and kept), a second graph of the key serves
    (:data:`SLOTS`); with every slot held, the call runs eagerly. Two uses it cannot see:
    a storage object taken from such a tensor and kept without any tensor, and a read on
    another stream that has not finished when the tensor is dropped (torch's
    ``record_stream`` does not hold a graph back: synchronise first).

    Args:
        capacity: graphs kept (least recently used dropped first; :meth:`clear` drops
            them all).
        replace: argument positions of a setting that moves over a run (the dense
            capacity ``dense_capacity="auto"`` picks): a graph captured for one value
            drops the graph of the same other arguments at another value, so a layer
            keeps one graph per batch shape, not one per value it ever took.
        hand_over: ``hand_over(args)``: the ``(shape, dtype)`` of each output ``fn`` can
            write into a given tensor (None at the others), or None for none; ``fn``
            then returns those tensors as the outputs.
    """

    def __init__(
        self,
        capacity: int = OP_CACHE,
        replace: frozenset[int] = frozenset(),
        hand_over: Callable[[tuple], tuple | None] | None = None,
    ) -> None:
        self.capacity = capacity
        self.replace = replace
        self.hand_over = hand_over
        self._by_rest: dict[tuple, tuple] = {}
        self._graphs: collections.OrderedDict[tuple, list[_OpGraph]] = collections.OrderedDict()
        self._seen: collections.OrderedDict[tuple, None] = collections.OrderedDict()
        self._failed: set[tuple] = set()
        self._one_slot: set[tuple] = set()  # keys whose second slot failed to capture
        self._pool: Any = None
        self._streams: dict[Any, Any] = {}
        # (capture number of the lending graph, weak reference to the Lease) of the
        # leases that may still be held
        self._leases: list[tuple[int, Any]] = []
        self.captures = 0
        self.replays = 0

    def clear(self) -> None:
        """Drop every graph (and the memory that only they hold)."""
        self._graphs.clear()
        self._by_rest.clear()
        self._seen.clear()
        self._failed.clear()
        self._one_slot.clear()
        # torch releases a pool with its last graph; its handle cannot be captured into
        # again.
        self._pool = None

    def __len__(self) -> int:
        """Graphs kept: every slot of every key."""
        return sum(len(slots) for slots in self._graphs.values())

    def memory(self) -> int:
        """Bytes of GPU memory these graphs hold: their input buffers, the tensors they
        hand their outputs over in (held by a caller or not: allocated at capture, not
        by the calls that return them) and the segments of their pool (the other
        outputs, lent tensors and the scratch they share)."""
        import torch

        graphs = [g for slots in self._graphs.values() for g in slots]
        buffers = sum(_nbytes(b) for g in graphs for b in g.buffers if b is not None)
        buffers += sum(u.nbytes() for g in graphs for u in g.users if u is not None)
        if self._pool is None:
            return buffers
        pool = tuple(self._pool)
        return buffers + sum(
            s["total_size"]
            for s in torch.cuda.memory_snapshot()
            if tuple(s.get("segment_pool_id") or ()) == pool
        )

    def __call__(
        self,
        fn: Callable[..., tuple],
        args: tuple,
        pinned: frozenset[int],
        lend: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
    ) -> Any:
        """``fn(*args)``'s outputs, through the graph of the arguments' key.

        ``lend = (inputs, outputs)``: the outputs at those positions, and the graph's
        buffers of the inputs at those positions, are not copied out for the call but
        lent (:class:`Lease`); returns ``(outputs, lease)``, the lent outputs in the
        tuple being the graph's own (valid as long as the lease is held)."""
        import torch

        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        if device.index == torch.cuda.current_device():  # (entering the context costs µs)
            return self._call(fn, args, pinned, device, lend)
        with torch.cuda.device(device):
            return self._call(fn, args, pinned, device, lend)

    def _call(self, fn: Callable[..., tuple], args: tuple, pinned: frozenset[int],
              device: Any, lend: tuple | None) -> Any:  # fmt: skip
        import torch

        if torch.cuda.is_current_stream_capturing() or planned():
            return _eager(fn, args, lend)
        key = tuple(_arg_key(a, i in pinned) for i, a in enumerate(args))
        slots = self._graphs.get(key)
        if slots is not None and not _current(slots[0]):
            del self._graphs[key]  # its cuBLAS workspace is gone: captured again next call
            self._one_slot.discard(key)
            self._seen[key] = None
            return _eager(fn, args, lend)
        if slots is None:
            if key in self._failed:
                return _eager(fn, args, lend)
            if key not in self._seen:
                self._seen[key] = None
                while len(self._seen) > OP_SEEN:
                    self._seen.popitem(last=False)
                return _eager(fn, args, lend)
            del self._seen[key]
            found = self._capture_slot(fn, args, pinned, device, key)
            self._graphs[key] = [found]
            self._replace(key)
        else:
            self._graphs.move_to_end(key)
            found = next((g for g in slots if g.free()), None)
            if found is None:  # every slot's handed-over outputs are still held
                if len(slots) >= SLOTS or key in self._one_slot:
                    return _eager(fn, args, lend)
                found = self._capture_slot(fn, args, pinned, device, key, keep=True)
                if found is None:
                    return _eager(fn, args, lend)
                slots.append(found)
            else:
                holder = found.lease() if found.lease is not None else None
                if holder is not None:
                    holder.keep()  # its backward has not run yet: copy its values out first
                self._protect(found.order)
                for buffer, arg in zip(found.buffers, args, strict=True):
                    if buffer is not None:
                        buffer.copy_(arg)
        found.graph.replay()
        self.replays += 1
        lent = () if lend is None else lend[1]
        outputs = tuple(
            t if t is None or i in lent else t.detach() if u is not None else t.clone()
            for i, (t, u) in enumerate(zip(found.outputs, found.users, strict=True))
        )
        if lend is None:
            return outputs
        inputs = lend[0]
        buffers = [found.buffers[i] if found.buffers[i] is not None else args[i] for i in inputs]
        lease = Lease(buffers + [found.outputs[i] for i in lent], static=True)
        found.lease = weakref.ref(lease)
        self._leases.append((found.order, found.lease))
        if len(self._leases) > 2 * self.capacity:  # (pruned by replays; captures only add)
            self._protect(self.captures)  # no graph is newer: this only forgets
        return outputs, lease

    def _capture_slot(self, fn: Callable[..., tuple], args: tuple, pinned: frozenset[int],
                      device: Any, key: tuple, keep: bool = False) -> _OpGraph | None:  # fmt: skip
        """A new graph of ``key``. A key whose first capture failed runs eagerly from then
        on (the error is raised); a failed second slot (``keep``: the first stays, and the
        call runs eagerly: None) only stops further slots while the key's graphs last."""
        try:
            return self._capture(fn, args, pinned, device)
        except BaseException as error:
            if keep and isinstance(error, Exception):
                self._one_slot.add(key)
                return None
            self._failed.add(key)
            if not self._graphs:
                self._pool = None  # released with the failed capture's graph
            raise

    def _replace(self, key: tuple) -> None:
        """Drop the graphs that ``key`` replaces (``replace``) and the least recently used
        beyond ``capacity``."""
        if self.replace:
            rest = tuple(k for i, k in enumerate(key) if i not in self.replace)
            old = self._by_rest.get(rest)
            if old is not None and old != key:
                self._graphs.pop(old, None)
                self._one_slot.discard(old)
            self._by_rest[rest] = key
        while len(self._graphs) > self.capacity:
            dropped, _ = self._graphs.popitem(last=False)
            self._one_slot.discard(dropped)
            if self.replace:
                rest = tuple(k for i, k in enumerate(dropped) if i not in self.replace)
                if self._by_rest.get(rest) == dropped:
                    del self._by_rest[rest]

    def _protect(self, order: int) -> None:
        """Copy out the tensors still lent by graphs captured after capture ``order``,
        whose replay comes next: its scratch may lie where they do; forget the leases no
        longer held."""
        if not self._leases:
            return
        kept = []
        for captured, ref in self._leases:
            lease = ref()
            if lease is None or not lease.held or not lease.static:
                continue  # released, gone, or already copied out
            if captured > order:
                lease.keep()
            else:
                kept.append((captured, ref))
        self._leases = kept

    def _capture(
        self, fn: Callable[..., tuple], args: tuple, pinned: frozenset[int], device: Any
    ) -> _OpGraph:
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
        specs = None
        if self.hand_over is not None and hasattr(torch._C, "_storage_Use_Count"):
            specs = self.hand_over(args)
        if specs is not None:  # outside the pool: no graph's scratch can lie there
            homes = tuple(
                None if spec is None else torch.empty(spec[0], dtype=spec[1], device=device)
                for spec in specs
            )
            fn = functools.partial(fn, out=homes)
        current = torch.cuda.current_stream()
        side.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        try:
            outputs = tuple(_capture_into(graph, self._pool, side, fn, *inputs))
        finally:
            current.wait_stream(side)
        self.captures += 1
        handed = () if specs is None else tuple(i for i, h in enumerate(homes) if h is not None)
        if specs is not None and any(outputs[i] is not homes[i] for i in handed):
            raise RuntimeError(f"{fn}: did not return the tensors given as out")
        return _OpGraph(graph, buffers, outputs, self.captures, handed)


class _OpGraph:
    """One op graph: the captured graph, its input buffers (None where an argument is
    read in place), its outputs, the lease of its outputs held by the last call, and its
    capture number in its pool (``order``: later captures may use its scratch memory).

    ``users[i]``: for an output handed over (written into a tensor allocated outside the
    pool, ``handed``), its storage (:meth:`free`); None for the others, which calls get
    copies of."""

    __slots__ = ("buffers", "epoch", "graph", "lease", "order", "outputs", "users")

    def __init__(self, graph: Any, buffers: tuple, outputs: tuple, order: int = 0,
                 handed: tuple[int, ...] = ()) -> None:  # fmt: skip
        self.graph, self.buffers, self.outputs, self.order = graph, buffers, outputs, order
        self.epoch = _cublas_epoch[0]
        self.lease: Any = None  # a weak reference
        self.users = tuple(_storage(t) if i in handed else None for i, t in enumerate(outputs))

    def free(self) -> bool:
        """Whether no tensor outside the graph uses its handed-over outputs' memory (a
        replay may write them): torch counts no user of each storage but the graph's
        output tensor and storage object (a returned tensor, a view, autograd's ``.grad``
        each add one)."""
        import torch

        return all(u is None or _unused(u, torch) for u in self.users)

    def homes(self) -> list[Any]:
        """The outputs it hands over."""
        return [t for t, u in zip(self.outputs, self.users, strict=True) if u is not None]


def _storage(tensor: Any) -> Any:
    """``tensor``'s storage object, with its size noted."""
    storage = tensor.untyped_storage()
    storage._twell_nbytes = storage.nbytes()
    return storage


def _unused(storage: Any, torch: Any) -> bool:
    """Whether nothing but the graph holds a handed-over output's ``storage``: torch
    counts two users (the graph's output tensor and this storage object; a tensor, a
    view or autograd's ``.grad`` adds one), and its memory is still the same size (a
    ``resize_`` would have freed it). Not seen: the storage object itself kept without
    any tensor (``y.untyped_storage()`` returns this one)."""
    return (
        torch._C._storage_Use_Count(storage._cdata) <= 2
        and storage.nbytes() == storage._twell_nbytes
    )


class Lease:
    """Tensors of an op graph (outputs, input buffers) lent to one call without a copy.

    They stay that call's values until it calls :meth:`release` (the training backward
    does, once it has read them): the graph's next replay first copies them out for a
    call that still holds them (:meth:`keep`). ``static``: the tensors are still the
    graph's own (an op graph of their addresses may read them in place)."""

    __slots__ = ("__weakref__", "held", "static", "tensors")

    def __init__(self, tensors: list[Any], static: bool) -> None:
        self.tensors, self.static, self.held = tuple(tensors), static, True

    def release(self) -> None:
        self.held = False

    def keep(self) -> None:
        """Copy the tensors out of the graph (before its next replay overwrites them)."""
        if self.held and self.static:
            self.tensors = tuple(None if t is None else t.clone() for t in self.tensors)
            self.static = False


def _eager(fn: Callable[..., tuple], args: tuple, lend: tuple | None) -> Any:
    """``fn(*args)`` run eagerly; with ``lend``, also a lease of the tensors asked for (its
    own, nothing to copy out later)."""
    outputs = fn(*args)
    if lend is None:
        return outputs
    inputs, lent = lend
    return outputs, Lease([args[i] for i in inputs] + [outputs[i] for i in lent], static=False)
