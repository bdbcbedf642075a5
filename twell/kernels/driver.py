"""Programmatic dependent launch (sm_90) through the driver's ``cuLaunchKernelEx``, which
CuPy does not expose; called through ctypes on the ``libcuda`` CuPy already uses.

A kernel launched by :func:`launch_dependent` may start while the previous kernel on
the stream still runs: its CTAs are scheduled once every CTA of that kernel has executed
``griddepcontrol.launch_dependents`` (or exited), on whatever SMs have room. It must not
read what the previous kernel writes before it knows the writes are done: by
``griddepcontrol.wait`` (the previous grid finished), or, as the gather after the gate
GEMM does, by flags that kernel releases as parts of its output become final. Stream
capture records the launch as a programmatic edge of the CUDA graph.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import numpy as np

#: ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`` (cuda.h).
_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class _LaunchAttribute(ctypes.Structure):
    """``CUlaunchAttribute``: an id, padding to 8 bytes, a 64-byte value union whose first
    int is ``programmaticStreamSerializationAllowed``. (Integer fields, not a ``c_char``
    array: ctypes hands a ``c_char`` array field back as a new ``bytes`` object, and
    writing into that corrupts Python's shared bytes objects.)"""

    _fields_ = [
        ("id", ctypes.c_int),
        ("pad", ctypes.c_int),
        ("allowed", ctypes.c_int),
        ("rest", ctypes.c_uint32 * 15),
    ]


class _LaunchConfig(ctypes.Structure):
    """``CUlaunchConfig`` (cuda.h)."""

    _fields_ = [
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared_mem_bytes", ctypes.c_uint),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.c_void_p),
        ("num_attrs", ctypes.c_uint),
    ]


@functools.cache
def _launch_kernel_ex() -> Any:
    try:
        fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [
        ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
    ]  # fmt: skip
    return fn


def _argument(value: Any) -> Any:
    if isinstance(value, np.int32):
        return ctypes.c_int32(int(value))
    if isinstance(value, np.uint32):
        return ctypes.c_uint32(int(value))
    if isinstance(value, np.uint64):
        return ctypes.c_uint64(int(value))
    if hasattr(value, "data") and hasattr(value.data, "ptr"):  # a CuPy array
        return ctypes.c_uint64(int(value.data.ptr))
    raise TypeError(f"launch_dependent: unsupported kernel argument {type(value).__name__}")


def available() -> bool:
    """Whether the driver has ``cuLaunchKernelEx`` (else callers launch plainly)."""
    return _launch_kernel_ex() is not None


def launch_dependent(
    kernel: Any, grid: int, block: int, args: tuple[Any, ...], shared_mem: int = 0
) -> None:  # fmt: skip
    """Launch ``kernel`` (a compiled CuPy kernel; arguments: CuPy arrays, ``np.int32``,
    ``np.uint32``, ``np.uint64``) as a programmatic dependent of the previous kernel on
    CuPy's current stream (check :func:`available` first).

    Raises:
        RuntimeError: the driver refused the launch.
    """
    import cupy

    values = [_argument(a) for a in args]
    params = (ctypes.c_void_p * len(values))(*(ctypes.addressof(v) for v in values))
    attribute = _LaunchAttribute()
    attribute.id = _PROGRAMMATIC_STREAM_SERIALIZATION
    attribute.allowed = 1
    config = _LaunchConfig()
    config.grid[:] = (grid, 1, 1)
    config.block[:] = (block, 1, 1)
    config.shared_mem_bytes = shared_mem
    config.stream = ctypes.c_void_p(cupy.cuda.get_current_stream().ptr)
    config.attrs = ctypes.cast(ctypes.pointer(attribute), ctypes.c_void_p)
    config.num_attrs = 1
    status = _launch_kernel_ex()(
        ctypes.byref(config), ctypes.c_void_p(kernel.kernel.ptr), params, None
    )
    if status != 0:
        raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {status}")
