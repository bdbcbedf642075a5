"""GPU test support: every buffer twell's kernels write, poisoned before they run.

Example (pytest)::

    @pytest.fixture(autouse=True)
    def poisoned_outputs():
        with twell.testing.gpu.poisoned_buffers():
            yield
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any


@contextlib.contextmanager
def poisoned_buffers(byte: int = 0xFF) -> Iterator[None]:
    """Within the block, every buffer twell's launchers take from CuPy's pool is filled
    with ``byte`` first (0xFF: NaN in bf16, -1 in integers), so an element a kernel
    forgot to write shows in the comparison. Buffers of torch callers come from torch's
    allocator and are not poisoned."""
    import cupy

    from twell.kernels import buffers

    def poisoned(shape: tuple[int, ...], dtype: Any) -> Any:
        out = cupy.empty(shape, dtype=dtype)
        out.view(cupy.uint8).fill(byte)
        return out

    saved = buffers.cupy_empty
    buffers.cupy_empty = poisoned
    try:
        yield
    finally:
        buffers.cupy_empty = saved


def captured_replays(
    call: Callable[[], Any], between: Callable[[], Any] | None = None
) -> tuple[Any, Any]:
    """``call()`` (returning a CuPy array) captured into a CUDA graph and replayed twice:
    one eager call first (CuPy's pool then holds its buffers for the capture to reuse), the
    capture on a fresh non-blocking stream, then the output poisoned (0xFF bytes) and
    ``between()`` run (eager work that reuses freed pool memory) before the second replay.
    Returns a copy of the output after the first replay and the output after the second.
    A capture of twell's gate GEMM needs torch imported (CuPy refuses cuBLAS while
    capturing)."""
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        call()
        stream.synchronize()
        stream.begin_capture()
        out = call()
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
        first = out.copy()
        out.view(cupy.uint8).fill(0xFF)
        if between is not None:
            between()
        graph.launch(stream)
        stream.synchronize()
    return first, out
