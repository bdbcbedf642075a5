"""CuPy and PyTorch arrays in and out of the kernels: zero-copy views, streams, buffers.

A call with torch tensors runs the kernels on views of the tensors' memory (made from the
data pointer: no DLPack exchange, no pointer-attribute query, no synchronisation), on
torch's current stream, and allocates every output and scratch buffer through torch's
caching allocator. That is what makes the call capturable by ``torch.cuda.graph`` in
torch's default capture mode: nothing in it touches the legacy stream, calls
``cudaMalloc`` or waits on the host, and the buffers a captured call uses come from the
graph's private memory pool, which torch keeps for the graph's replays. The output is
handed back as the torch tensor that owns its memory.

A call with CuPy arrays runs on CuPy's current stream and allocates from CuPy's pool.
"""

from __future__ import annotations

import contextlib
import functools
import math
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np

from twell._arrays import bfloat16
from twell._optional import optional_dependency
from twell.kernels.buffers import allocating_with

_streams: dict[tuple[int, int], Any] = {}


@functools.cache
def _torch_dtypes() -> dict[Any, np.dtype]:
    import torch

    return {
        torch.bfloat16: bfloat16,
        torch.float16: np.dtype(np.float16),
        torch.float32: np.dtype(np.float32),
        torch.float64: np.dtype(np.float64),
        torch.uint8: np.dtype(np.uint8),
        torch.int32: np.dtype(np.int32),
    }


@functools.cache
def _numpy_to_torch() -> dict[np.dtype, Any]:
    return {v: k for k, v in _torch_dtypes().items()}


def cupy_view(tensor: Any, *, borrow: bool = False) -> Any:
    """A CuPy array over a C-contiguous CUDA tensor's memory. The view keeps the tensor
    alive, unless ``borrow``: then whoever holds the view must make sure the tensor's
    memory outlives it (twell.inference's registry drops its blocks when their weights'
    storage dies)."""
    import cupy

    dtype = _torch_dtypes()[tensor.dtype]
    nbytes = tensor.numel() * dtype.itemsize
    owner = None if borrow else tensor
    memory = cupy.cuda.UnownedMemory(tensor.data_ptr(), nbytes, owner, tensor.device.index)
    return cupy.ndarray(tuple(tensor.shape), dtype=dtype, memptr=cupy.cuda.MemoryPointer(memory, 0))


class TorchBuffers:
    """An allocator for :func:`twell.kernels.buffers.alloc` that takes memory from torch.

    Remembers the tensor behind each buffer it made, so an output can be returned as
    the torch tensor that owns it: weakly, so a buffer the launcher drops goes back to
    torch's allocator at once (the CuPy array keeps its owner alive, not this table).
    """

    def __init__(self, device: Any) -> None:
        self.device = device
        self._owners: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()

    def __call__(self, shape: tuple[int, ...], dtype: Any) -> Any:
        import cupy
        import torch

        dtype = np.dtype(dtype)
        nbytes = max(1, math.prod(shape) * dtype.itemsize)
        owner = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        memory = cupy.cuda.UnownedMemory(owner.data_ptr(), nbytes, owner, owner.device.index)
        array = cupy.ndarray(shape, dtype=dtype, memptr=cupy.cuda.MemoryPointer(memory, 0))
        self._owners[array.data.ptr] = owner
        return array

    def as_tensor(self, array: Any) -> Any:
        """The torch tensor over ``array`` (one of this allocator's buffers, or a view
        of a caller's tensor); DLPack for anything else."""
        import torch

        owner = self._owners.get(array.data.ptr)
        if owner is None or not array.flags.c_contiguous:
            return torch.from_dlpack(array)
        torch_dtype = _numpy_to_torch()[np.dtype(array.dtype)]
        return owner[: array.nbytes].view(torch_dtype).view(array.shape)


def unview(tensor: Any) -> Any:
    """A torch tensor as one that is not a view (same memory). A custom op's output that
    is a view of a buffer made inside it would refuse in-place changes under autograd.
    ``detach`` gives a tensor of the same memory with no base (one op, where an empty
    tensor and ``set_`` took two: a replayed decode call's host time counts them)."""
    if tensor._base is None:
        return tensor
    return tensor.detach()


def _torch_stream(device_index: int) -> Any:
    """CuPy's handle on torch's current stream of a device (cached per stream)."""
    import cupy
    import torch

    pointer = torch.cuda.current_stream(device_index).cuda_stream
    key = (pointer, device_index)
    stream = _streams.get(key)
    if stream is None:
        stream = _streams[key] = cupy.cuda.ExternalStream(pointer, device_index)
    return stream


@contextlib.contextmanager
def on_gpu(
    library: str, arrays: dict[str, Any], *, borrow: bool = False
) -> Iterator[tuple[dict[str, Any], Any]]:
    """CuPy views of ``arrays`` (CuPy or torch, validated: C-contiguous, one device) on
    their device and the caller's current stream, with the caller's allocator
    (``borrow``: views of torch tensors that do not keep them alive, see
    :func:`cupy_view`).

    Yields:
        ``(views, to_caller)``: the CuPy arrays, and a function that turns a CuPy result
        into the caller's array type.
    """
    with optional_dependency("cupy", "twell's GPU ops"):
        import cupy
    first = next(a for a in arrays.values() if a is not None)
    if library == "torch":
        index = first.device.index
        buffers = TorchBuffers(first.device)
        views = {
            k: None if a is None else cupy_view(a.detach(), borrow=borrow)
            for k, a in arrays.items()
        }
        with (
            cupy.cuda.Device(index),
            _torch_stream(index),
            allocating_with(buffers, torch_caller=True),
        ):
            yield views, buffers.as_tensor
    else:
        with first.device, allocating_with(None):
            yield arrays, lambda array: array
