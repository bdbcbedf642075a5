"""The few CUDA driver API calls twell makes itself, through ctypes.

CuPy and torch both run on the driver library ``libcuda.so.1``; twell calls it directly
for what neither exposes: TMA tensor maps (``kernels/gate_gemm.py``), the clusters of a
kernel that fit on the GPU at once and launches with a programmatic dependency on the
kernel before (``kernels/compile.py``), and the nodes of a captured CUDA graph
(``_graph_nodes.py``: reading a kernel node's arguments and setting new ones in an
instantiated graph). Each function is declared once with its argument
types; :func:`call` raises on an error code.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

_P, _U32, _U64, _SIZE = ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_size_t
_PP, _PSIZE = ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t)


class KernelNodeParams(ctypes.Structure):
    """``CUDA_KERNEL_NODE_PARAMS_v2`` (cuda.h)."""

    _fields_ = [
        ("func", _P),
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared_mem", ctypes.c_uint),
        ("kernel_params", _PP),
        ("extra", _PP),
        ("kern", _P),
        ("ctx", _P),
    ]


class MemsetNodeParams(ctypes.Structure):
    """``CUDA_MEMSET_NODE_PARAMS`` (cuda.h)."""

    _fields_ = [
        ("dst", _U64),
        ("pitch", _SIZE),
        ("value", ctypes.c_uint),
        ("element_size", ctypes.c_uint),
        ("width", _SIZE),
        ("height", _SIZE),
    ]


class LaunchAttribute(ctypes.Structure):
    """``CUlaunchAttribute`` (cuda.h): an id, padding to 8 bytes, a 64-byte value union
    (its first int is the flag of the attributes twell sets)."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class LaunchConfig(ctypes.Structure):
    """``CUlaunchConfig`` (cuda.h); a kernel that carries its cluster size needs no
    attribute for it."""

    _fields_ = [
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared_mem_bytes", ctypes.c_uint),
        ("stream", _P),
        ("attrs", _P),
        ("num_attrs", ctypes.c_uint),
    ]


#: ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``: the launched kernel may start
#: before the previous kernel in the stream has finished (it waits with
#: ``griddepcontrol.wait`` before it touches that kernel's memory).
ATTRIBUTE_PROGRAMMATIC = 6
#: Graph node types (``CUgraphNodeType``) twell tells apart.
NODE_KERNEL, NODE_MEMCPY, NODE_MEMSET, NODE_GRAPH, NODE_CONDITIONAL = 0, 1, 2, 4, 13
#: ``CUDA_ERROR_INVALID_VALUE``: what ``cuFuncGetParamInfo`` returns past the last argument.
INVALID_VALUE = 1

_SIGNATURES: dict[str, list[Any]] = {
    "cuTensorMapEncodeTiled": [
        _P, ctypes.c_int, _U32, _P, ctypes.POINTER(_U64), ctypes.POINTER(_U64),
        ctypes.POINTER(_U32), ctypes.POINTER(_U32),
        ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
    ],
    "cuOccupancyMaxActiveClusters": [
        ctypes.POINTER(ctypes.c_int), _P, ctypes.POINTER(LaunchConfig)
    ],
    "cuLaunchKernelEx": [ctypes.POINTER(LaunchConfig), _P, _PP, _PP],
    "cuGraphGetNodes": [_P, _PP, _PSIZE],
    "cuGraphNodeGetType": [_P, ctypes.POINTER(ctypes.c_int)],
    "cuGraphKernelNodeGetParams_v2": [_P, ctypes.POINTER(KernelNodeParams)],
    "cuGraphMemsetNodeGetParams": [_P, ctypes.POINTER(MemsetNodeParams)],
    "cuFuncGetParamInfo": [_P, _SIZE, _PSIZE, _PSIZE],
    "cuFuncGetName": [ctypes.POINTER(ctypes.c_char_p), _P],
    "cuKernelGetFunction": [_PP, _P],
    "cuGraphInstantiateWithFlags": [_PP, _P, ctypes.c_ulonglong],
    "cuGraphExecKernelNodeSetParams_v2": [_P, _P, ctypes.POINTER(KernelNodeParams)],
    "cuGraphLaunch": [_P, _P],
    "cuGraphExecDestroy": [_P],
    "cuGetErrorName": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
}  # fmt: skip


@functools.cache
def library() -> ctypes.CDLL:
    """``libcuda.so.1``, its functions declared (RuntimeError where it does not load)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as error:
        raise RuntimeError(
            f"the CUDA driver library (libcuda.so.1) is not loadable: {error}"
        ) from error
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name, None)
        if fn is not None:  # an older driver lacks the newest: call() then says so
            fn.restype = ctypes.c_int
            fn.argtypes = argtypes
    return lib


def function(name: str) -> Any:
    """The declared driver function ``name`` (RuntimeError where the driver lacks it)."""
    fn = getattr(library(), name, None)
    if fn is None or name not in _SIGNATURES:
        raise RuntimeError(f"the CUDA driver has no {name} (a newer driver is needed)")
    return fn


def call(name: str, *args: Any) -> None:
    """Call driver function ``name``; RuntimeError with the error's name on failure."""
    status = function(name)(*args)
    if status:
        raise DriverError(name, status)


class DriverError(RuntimeError):
    """A driver call returned an error code (``status``)."""

    def __init__(self, name: str, status: int) -> None:
        text = ctypes.c_char_p()
        known = function("cuGetErrorName")(status, ctypes.byref(text)) == 0 and text.value
        label = text.value.decode() if known else "unknown error"
        super().__init__(f"{name} failed: {label} ({status})")
        self.status = status
