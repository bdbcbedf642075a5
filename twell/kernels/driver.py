"""The two CUDA driver calls twell needs that CuPy does not expose, through ctypes:

- :func:`max_active_clusters`: ``cuOccupancyMaxActiveClusters`` (how many thread-block
  clusters of a kernel fit on the device at once);
- :func:`launch_dependent`: ``cuLaunchKernelEx`` with the programmatic-stream-
  serialisation attribute (programmatic dependent launch, sm_90): the kernel's CTAs may
  start while the previous kernel on the stream is still running, once every CTA of
  that kernel has executed ``griddepcontrol.launch_dependents`` or exited. The kernel
  must execute ``griddepcontrol.wait`` (which returns once the previous kernel has
  finished and its writes are visible) before it reads anything that kernel writes.
  Stream capture records the launch as a programmatic edge of the CUDA graph.

Both take CuPy kernels (``cupy.RawKernel``) and launch on CuPy's current stream.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import numpy as np

#: ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`` (cuda.h).
_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class LaunchConfig(ctypes.Structure):
    """``CUlaunchConfig`` (cuda.h)."""

    _fields_ = [
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared_mem_bytes", ctypes.c_uint),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.c_void_p),
        ("num_attrs", ctypes.c_uint),
    ]


class _LaunchAttribute(ctypes.Structure):
    """``CUlaunchAttribute``: an id, padding to 8 bytes, a 64-byte value union."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


@functools.cache
def _libcuda() -> Any:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


@functools.cache
def _function(name: str, argtypes: tuple[Any, ...]) -> Any:
    lib = _libcuda()
    fn = getattr(lib, name, None) if lib is not None else None
    if fn is not None:
        fn.restype = ctypes.c_int
        fn.argtypes = list(argtypes)
    return fn


def max_active_clusters(
    kernel: Any, grid: int, block: int, shared_mem: int
) -> int | None:  # fmt: skip
    """``cuOccupancyMaxActiveClusters`` for ``kernel`` (its ``__cluster_dims__`` give the
    cluster size), or None when the driver cannot say. A host query."""
    fn = _function(
        "cuOccupancyMaxActiveClusters",
        (ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.POINTER(LaunchConfig)),
    )
    if fn is None:
        return None
    config = LaunchConfig()
    config.grid[:] = (grid, 1, 1)
    config.block[:] = (block, 1, 1)
    config.shared_mem_bytes = shared_mem
    count = ctypes.c_int(0)
    status = fn(ctypes.byref(count), ctypes.c_void_p(kernel.kernel.ptr), ctypes.byref(config))
    return int(count.value) if status == 0 and count.value > 0 else None


def _argument(value: Any) -> ctypes._SimpleCData:
    if isinstance(value, np.int32):
        return ctypes.c_int32(int(value))
    if isinstance(value, np.uint64):
        return ctypes.c_uint64(int(value))
    if hasattr(value, "data") and hasattr(value.data, "ptr"):  # a CuPy array
        return ctypes.c_uint64(int(value.data.ptr))
    raise TypeError(f"launch_dependent: unsupported kernel argument {type(value).__name__}")


def launch_dependent(
    kernel: Any, grid: int, block: int, args: tuple[Any, ...], shared_mem: int = 0
) -> bool:  # fmt: skip
    """Launch ``kernel`` (a ``cupy.RawKernel``; arguments: CuPy arrays, ``np.int32``,
    ``np.uint64``) as a programmatic dependent of the previous kernel on CuPy's current
    stream. Returns False, launching nothing, when the driver has no ``cuLaunchKernelEx``
    (the caller then launches it plainly); raises on a launch error."""
    import cupy

    fn = _function(
        "cuLaunchKernelEx",
        (ctypes.POINTER(LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p),
    )
    if fn is None:
        return False
    values = [_argument(a) for a in args]
    params = (ctypes.c_void_p * len(values))(*(ctypes.addressof(v) for v in values))
    attribute = _LaunchAttribute()
    attribute.id = _PROGRAMMATIC_STREAM_SERIALIZATION
    ctypes.memmove(attribute.value, ctypes.byref(ctypes.c_int(1)), 4)
    config = LaunchConfig()
    config.grid[:] = (grid, 1, 1)
    config.block[:] = (block, 1, 1)
    config.shared_mem_bytes = shared_mem
    config.stream = ctypes.c_void_p(cupy.cuda.get_current_stream().ptr)
    config.attrs = ctypes.cast(ctypes.pointer(attribute), ctypes.c_void_p)
    config.num_attrs = 1
    status = fn(ctypes.byref(config), ctypes.c_void_p(kernel.kernel.ptr), params, None)
    if status != 0:
        raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {status}")
    return True
