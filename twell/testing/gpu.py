"""GPU test support: every buffer twell's kernels write, poisoned before they run.

Example (pytest)::

    @pytest.fixture(autouse=True)
    def poisoned_outputs():
        with twell.testing.gpu.poisoned_buffers():
            yield
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
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
