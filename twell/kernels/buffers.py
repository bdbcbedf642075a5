"""Device buffers of the launchers: one allocation function, bf16 views, grid sizes.

Every output and scratch buffer a launcher makes comes from :func:`alloc`. Which
allocator it uses is decided by the caller of the op, for the duration of the call
(:func:`allocating_with`): CuPy's memory pool by default, or torch's caching allocator
when the op was called with torch tensors (so torch's CUDA-graph capture, which gives a
captured call a private memory pool, owns those buffers too). The GPU tests replace
:func:`alloc`'s backing function to fill every buffer with 0xFF bytes (NaN in bf16), so
an element a kernel forgot to write fails the comparison.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from twell._arrays import bfloat16

_allocator: contextvars.ContextVar[Callable[[tuple[int, ...], Any], Any] | None] = (
    contextvars.ContextVar("twell_allocator", default=None)
)
_torch_caller: contextvars.ContextVar[bool] = contextvars.ContextVar("twell_torch", default=False)


def _cupy() -> Any:
    import cupy

    return cupy


def cupy_empty(shape: tuple[int, ...], dtype: Any) -> Any:
    """An uninitialised CuPy array from CuPy's memory pool (the default allocator)."""
    return _cupy().empty(shape, dtype=dtype)


def alloc(shape: tuple[int, ...], dtype: Any) -> Any:
    """An uninitialised CuPy array on the current device, from the current allocator."""
    allocate = _allocator.get()
    return (allocate or cupy_empty)(shape, dtype)


@contextlib.contextmanager
def allocating_with(
    allocate: Callable[[tuple[int, ...], Any], Any] | None, *, torch_caller: bool = False
) -> Iterator[None]:
    """Within the block, :func:`alloc` calls ``allocate(shape, dtype)`` (None: CuPy), and
    :func:`torch_caller` tells whether the op was called with torch tensors (on torch's
    current stream)."""
    token = _allocator.set(allocate)
    caller = _torch_caller.set(torch_caller)
    try:
        yield
    finally:
        _torch_caller.reset(caller)
        _allocator.reset(token)


def torch_caller() -> bool:
    """Whether the running op was called with torch tensors (see :func:`allocating_with`)."""
    return _torch_caller.get()


def torch_owned(buffer: Any) -> bool:
    """Whether a CuPy buffer is memory torch allocated (under a CUDA-graph capture: the
    graph's memory pool then holds it as long as the graph lives)."""
    import cupy

    return isinstance(getattr(getattr(buffer, "data", None), "mem", None),
                      cupy.cuda.UnownedMemory)  # fmt: skip


def keep_for_graph(buffers: list[Any]) -> list[Any]:
    """The buffers of a captured call that must be kept alive for its graph: those
    torch did not allocate (CuPy's pool would hand them out again)."""
    return [b for b in buffers if b is not None and not torch_owned(b)]


def empty_bf16(shape: tuple[int, ...]) -> Any:
    """An uninitialised bf16 CuPy array (from :func:`alloc`)."""
    return alloc(shape, np.uint16).view(bfloat16)


def check_out(name: str, array: Any, shape: tuple[int, ...]) -> None:
    """``ValueError`` naming ``name`` unless ``array`` (CuPy, or NumPy in CPU tests) is a
    C-contiguous, 16-byte aligned bf16 array of ``shape``: a caller's buffer that kernels
    write 8 values at a time into."""
    address = array.ctypes.data if isinstance(array, np.ndarray) else array.data.ptr
    if (np.dtype(array.dtype) != bfloat16 or tuple(array.shape) != tuple(shape)
            or not array.flags.c_contiguous or address % 16):  # fmt: skip
        raise ValueError(f"{name} must be a C-contiguous, 16-byte aligned bf16 array of shape "
                         f"{tuple(shape)}, got {array.dtype} {tuple(array.shape)} at "
                         f"{address:#x}")  # fmt: skip


def u16(array: Any) -> Any:
    """A bf16 (or any 2-byte) array's bits as uint16 (a view, no copy)."""
    return array.view(np.uint16)


def grid_1d(n: int, block: int = 256) -> int:
    """Blocks for a grid-stride loop over ``n`` items: enough to fill the GPU, no more."""
    from twell.kernels.compile import device_info

    return max(1, min(math.ceil(n / block), device_info().multiprocessors * 32))
