"""A captured CUDA graph pointed at new tensors before each launch.

A graph captured from a call reads that call's input and writes its output: their
addresses sit in the arguments of the graph's kernels. :class:`Repointed` finds them
there and, before a launch, swaps in another input and output of the same layout, so a
replay needs no copy into or out of the graph's own buffers (at 16384 tokens those
copies would move 256 MB).

How it finds them: every kernel node's arguments are read back from the graph
(``cuGraphKernelNodeGetParams``; their sizes from ``cuFuncGetParamInfo``, or the one
packed buffer of a launch that passed its arguments through ``extra``, as cuBLAS does)
and every 8-byte word of them that lies inside a given address range (the captured
input's or output's bytes) is a pointer into that tensor, re-pointed as ``new base +
offset``. That covers plain pointer arguments, structures holding pointers (CuPy's and
torch's elementwise kernels) and TMA tensor maps (gate_gemm.cu's and cuBLAS's), which
hold the global address as their first word (the driver's encoding, seen on the H100
and the H200; the GPU tests fail if a graph of the gate GEMM could not be re-pointed).
Only the kernel nodes that refer to a range are updated in the instantiated graph
(``cuGraphExecKernelNodeSetParams``), and only when the addresses differ from the
previous launch's.

What a scan cannot see: a kernel whose arguments cannot be read, or that addresses the
tensors another way (a library's tensor map in an unknown encoding), and copy nodes.
The scan reports them (:attr:`Repointed.opaque`); the caller (twell._graphs) accepts a
graph only after a launch pointed at new tensors reproduced the eager output's bits with
the captured buffers poisoned, and only when every twell kernel was scannable (twell's
kernels are the ones whose reads depend on the data, which one test launch might not
exercise; a library's GEMM or elementwise kernel reads and writes whole operands).
"""

from __future__ import annotations

import ctypes
import functools
import weakref
from collections.abc import Sequence
from typing import Any

from twell import _driver
from twell._driver import KernelNodeParams, MemsetNodeParams, call


@functools.cache
def _parameters(function: int) -> tuple[tuple[int, int], ...] | None:
    """``(offset, size)`` of each argument of a kernel; None where the driver has no
    argument information for it."""
    out = []
    offset, size = ctypes.c_size_t(), ctypes.c_size_t()
    info = _driver.function("cuFuncGetParamInfo")
    while True:
        status = info(function, len(out), ctypes.byref(offset), ctypes.byref(size))
        # Past the last argument. (On the first index it may also mean no information:
        # a kernel without arguments is then taken for opaque, which is the safe side.)
        if status == _driver.INVALID_VALUE and out:
            return tuple(out)
        if status:
            return None
        out.append((offset.value, size.value))


@functools.cache
def kernel_name(function: int) -> str:
    """A kernel's (mangled) name; '' where the driver does not tell."""
    name = ctypes.c_char_p()
    if _driver.function("cuFuncGetName")(ctypes.byref(name), function) or not name.value:
        return ""
    return name.value.decode(errors="replace")


def _nodes(graph: int) -> list[int]:
    count = ctypes.c_size_t(0)
    call("cuGraphGetNodes", graph, None, ctypes.byref(count))
    nodes = (ctypes.c_void_p * count.value)()
    call("cuGraphGetNodes", graph, nodes, ctypes.byref(count))
    return [int(n or 0) for n in nodes[: count.value]]


def _node_type(node: int) -> int:
    kind = ctypes.c_int()
    call("cuGraphNodeGetType", node, ctypes.byref(kind))
    return kind.value


class _KernelNode:
    """A kernel node's arguments copied into buffers of our own (``chunks``: each
    argument's bytes, or with ``packed`` the one buffer of a launch that passed them
    packed through ``extra``), with the words that point into the ranges (``slots``: a
    ctypes view of the word, the range, the offset into it)."""

    def __init__(
        self,
        node: int,
        params: KernelNodeParams,
        name: str,
        chunks: list[bytes],
        packed: bool,
        ranges: Sequence[tuple[int, int]],
    ) -> None:
        self.node = node
        self.name = name
        self.slots: list[tuple[ctypes.c_uint64, int, int]] = []
        self._buffers = []
        self.pointers = (ctypes.c_void_p * max(1, len(chunks)))()
        for index, raw in enumerate(chunks):
            size = len(raw)
            buffer = ctypes.create_string_buffer(size + 64)
            address = (ctypes.addressof(buffer) + 63) // 64 * 64  # tensor maps: 64-aligned
            ctypes.memmove(address, raw, size)
            self._buffers.append(buffer)
            self.pointers[index] = address
            for at in range(0, size - 7, 8):
                word = int.from_bytes(raw[at : at + 8], "little")
                for which, (start, nbytes) in enumerate(ranges):
                    if start <= word < start + nbytes:
                        slot = ctypes.c_uint64.from_address(address + at)
                        self.slots.append((slot, which, word - start))
        self.params = KernelNodeParams()
        ctypes.memmove(ctypes.byref(self.params), ctypes.byref(params), ctypes.sizeof(params))
        if packed:
            self._size = ctypes.c_size_t(len(chunks[0]))
            self._extra = (ctypes.c_void_p * 5)(
                _BUFFER_POINTER, self.pointers[0], _BUFFER_SIZE, ctypes.addressof(self._size), 0
            )
            self.params.kernel_params = None
            self.params.extra = ctypes.cast(self._extra, ctypes.POINTER(ctypes.c_void_p))
        else:
            self.params.kernel_params = ctypes.cast(self.pointers, ctypes.POINTER(ctypes.c_void_p))
            self.params.extra = None


#: ``CU_LAUNCH_PARAM_BUFFER_POINTER`` and ``_SIZE`` (cuda.h): keys of a launch's ``extra``.
_BUFFER_POINTER, _BUFFER_SIZE = 1, 2


def _packed_arguments(extra: Any) -> bytes | None:
    """The argument buffer a launch passed through ``extra`` (None: not understood)."""
    buffer = size = None
    for i in range(0, 16, 2):
        key = extra[i]
        if not key:  # CU_LAUNCH_PARAM_END
            break
        value = extra[i + 1]
        if key == _BUFFER_POINTER:
            buffer = value
        elif key == _BUFFER_SIZE and value:
            size = ctypes.c_size_t.from_address(value).value
        else:
            return None
    if not buffer or size is None:
        return None
    return ctypes.string_at(buffer, size)


def _destroy(exec_handle: int) -> None:
    try:
        _driver.function("cuGraphExecDestroy")(exec_handle)
    except Exception:  # noqa: BLE001 - interpreter shutdown: the driver may be gone
        pass


class Repointed:
    """An instantiated graph of ``graph`` (a ``CUgraph``) whose references to the
    address ``ranges`` (``(start, nbytes)`` each) follow :meth:`point`.

    Attributes:
        patched: names of the kernels whose arguments point into a range.
        opaque: descriptions of the nodes a scan cannot see into (kernels whose
            arguments cannot be read, copy nodes, child graphs).
        blocked: nodes that refer to a range but cannot be re-pointed (memset nodes):
            the graph must not be used re-pointed when this is not empty.
    """

    def __init__(self, graph: int, ranges: Sequence[tuple[int, int]]) -> None:
        self.ranges = tuple((int(s), int(n)) for s, n in ranges)
        self.opaque: list[str] = []
        self.blocked: list[str] = []
        self._kernels: list[_KernelNode] = []
        for node in _nodes(graph):
            kind = _node_type(node)
            if kind == _driver.NODE_KERNEL:
                self._scan_kernel(node)
            elif kind == _driver.NODE_MEMSET:
                memset = MemsetNodeParams()
                call("cuGraphMemsetNodeGetParams", node, ctypes.byref(memset))
                rows = max(1, memset.height)
                end = memset.dst + memset.pitch * (rows - 1) + memset.element_size * memset.width
                if any(memset.dst < s + n and end > s for s, n in self.ranges):
                    self.blocked.append("memset")
            elif kind in (_driver.NODE_MEMCPY, _driver.NODE_GRAPH, _driver.NODE_CONDITIONAL):
                self.opaque.append(f"node type {kind}")
        self.patched = [k.name for k in self._kernels]
        handle = ctypes.c_void_p()
        call("cuGraphInstantiateWithFlags", ctypes.byref(handle), graph, 0)
        self._exec = int(handle.value or 0)
        self._finalizer = weakref.finalize(self, _destroy, self._exec)
        self._bases = tuple(s for s, _ in self.ranges)
        self._launch = _driver.function("cuGraphLaunch")  # bound once: a launch per call

    def _scan_kernel(self, node: int) -> None:
        params = KernelNodeParams()
        call("cuGraphKernelNodeGetParams_v2", node, ctypes.byref(params))
        function = params.func
        if not function and params.kern:
            handle = ctypes.c_void_p()
            call("cuKernelGetFunction", ctypes.byref(handle), params.kern)
            function = handle.value
        name = kernel_name(function) if function else ""
        layout = _parameters(function) if function else None
        if (
            params.kernel_params
            and layout is not None
            and all(params.kernel_params[i] for i in range(len(layout)))
        ):
            chunks = [
                ctypes.string_at(params.kernel_params[i], size)
                for i, (_, size) in enumerate(layout)
            ]
            packed = False
        elif not params.kernel_params and params.extra:
            raw = _packed_arguments(params.extra)
            if raw is None:
                self.opaque.append(f"kernel {name or '?'} (extra not understood)")
                return
            chunks, packed = [raw], True
        else:
            self.opaque.append(f"kernel {name or '?'} (arguments unknown)")
            return
        kernel = _KernelNode(node, params, name, chunks, packed, self.ranges)
        if kernel.slots:
            self._kernels.append(kernel)

    @property
    def bases(self) -> tuple[int, ...]:
        """Where the ranges' references point now (the ranges' own starts at first)."""
        return self._bases

    def point(self, bases: Sequence[int]) -> None:
        """Point the graph's references to range ``i`` at ``bases[i]`` (same offsets)."""
        bases = tuple(bases)
        if bases == self._bases:
            return
        set_params = _driver.function("cuGraphExecKernelNodeSetParams_v2")
        for kernel in self._kernels:
            for slot, which, offset in kernel.slots:
                slot.value = bases[which] + offset
            status = set_params(self._exec, kernel.node, ctypes.byref(kernel.params))
            if status:
                self._bases = ()  # unknown state: every node is set again next time
                raise _driver.DriverError("cuGraphExecKernelNodeSetParams", status)
        self._bases = bases

    def launch(self, stream: int) -> None:
        """Launch the graph on ``stream`` (a ``CUstream`` handle)."""
        status = self._launch(self._exec, stream)
        if status:
            raise _driver.DriverError("cuGraphLaunch", status)

    def close(self) -> None:
        """Destroy the instantiated graph now (it is also destroyed when collected)."""
        self._finalizer()
