"""twell._graph_nodes without a GPU: how a kernel node's arguments are scanned for
pointers into the captured tensors and rewritten (the driver calls themselves run in the
GPU tests, test_gpu_serving.py)."""

from __future__ import annotations

import ctypes
import struct

import pytest

from twell import _graph_nodes
from twell._driver import KernelNodeParams

X, Y = 0x7F00_0000_0000, 0x7F00_4000_0000  # captured input and output
X_BYTES, Y_BYTES = 1 << 20, 1 << 16
RANGES = [(X, X_BYTES), (Y, Y_BYTES)]


def arguments(node: _graph_nodes._KernelNode) -> list[bytes]:
    pairs = zip(node.pointers, node._buffers, strict=True)
    return [ctypes.string_at(p, len(b) - 64) for p, b in pairs]  # each buffer has 64 spare


def test_pointer_words_of_every_argument_kind_are_found_and_rewritten() -> None:
    chunks = [
        struct.pack("<Q", X),  # a pointer argument
        struct.pack("<ii", 7, 9),  # two ints: no pointer
        struct.pack("<QQQ", Y + 4096, 3, 5),  # a structure: pointer, shape, stride
        struct.pack("<Q", X + X_BYTES),  # one past the end: not in the range
        struct.pack("<Q15Q", X + 256, *range(15)),  # a tensor map: address first
    ]
    node = _graph_nodes._KernelNode(0, KernelNodeParams(), "k", chunks, False, RANGES)
    assert [(which, offset) for _, which, offset in node.slots] == [(0, 0), (1, 4096), (0, 256)]
    for slot, which, offset in node.slots:
        slot.value = (0x7E00_0000_0000, 0x7E00_8000_0000)[which] + offset
    got = arguments(node)
    assert got[0] == struct.pack("<Q", 0x7E00_0000_0000)
    assert got[1] == chunks[1] and got[3] == chunks[3]
    assert got[2] == struct.pack("<QQQ", 0x7E00_8000_0000 + 4096, 3, 5)
    assert got[4] == struct.pack("<Q15Q", 0x7E00_0000_0000 + 256, *range(15))
    params = node.params
    assert not params.extra
    assert [params.kernel_params[i] for i in range(5)] == list(node.pointers)


def test_packed_arguments_are_read_from_extra_and_passed_back_packed() -> None:
    raw = struct.pack("<QiiQ", 11, 1, 2, Y + 8)
    buffer = ctypes.create_string_buffer(raw, len(raw))
    size = ctypes.c_size_t(len(raw))
    extra = (ctypes.c_void_p * 5)(1, ctypes.addressof(buffer), 2, ctypes.addressof(size), 0)
    assert _graph_nodes._packed_arguments(extra) == raw
    node = _graph_nodes._KernelNode(0, KernelNodeParams(), "k", [raw], True, RANGES)
    assert [(which, offset) for _, which, offset in node.slots] == [(1, 8)]
    params = node.params
    assert not params.kernel_params
    assert params.extra[0] == 1 and params.extra[1] == node.pointers[0]
    assert ctypes.c_size_t.from_address(params.extra[3]).value == len(raw)
    assert params.extra[4] is None


def test_extra_of_an_unknown_kind_is_not_understood() -> None:
    extra = (ctypes.c_void_p * 3)(5, 1234, 0)
    assert _graph_nodes._packed_arguments(extra) is None
    empty = (ctypes.c_void_p * 1)(0)
    assert _graph_nodes._packed_arguments(empty) is None


def test_driver_structures_match_cuda_h() -> None:
    """CUDA_KERNEL_NODE_PARAMS_v2: 72 bytes, kernelParams at 40, kern at 56;
    CUDA_MEMSET_NODE_PARAMS: 40 bytes; CUlaunchConfig: 56 (cuda.h, 64-bit)."""
    from twell._driver import LaunchConfig, MemsetNodeParams

    assert ctypes.sizeof(KernelNodeParams) == 72
    assert KernelNodeParams.kernel_params.offset == 40
    assert KernelNodeParams.kern.offset == 56
    assert ctypes.sizeof(MemsetNodeParams) == 40
    assert LaunchConfig.stream.offset == 32  # 7 uints, then hStream
    assert ctypes.sizeof(LaunchConfig) == 56


def _repointed_with_fake_driver(monkeypatch, status: int = 0):  # noqa: ANN001, ANN202
    """A Repointed over two fake kernel nodes and a driver that records its updates."""
    calls: list[int] = []

    def set_params(exec_handle, node, params):  # noqa: ANN001, ANN202
        calls.append(node)
        return status

    monkeypatch.setattr(_graph_nodes._driver, "function", lambda name: set_params)
    repointed = object.__new__(_graph_nodes.Repointed)
    repointed.ranges = tuple(RANGES)
    repointed._exec = 1
    repointed._bases = (X, Y)
    chunks = [struct.pack("<QQ", X + 64, Y)]
    repointed._kernels = [
        _graph_nodes._KernelNode(node, KernelNodeParams(), "k", chunks, False, RANGES)
        for node in (11, 12)
    ]
    return repointed, calls


def test_point_updates_only_when_the_addresses_change(monkeypatch) -> None:  # noqa: ANN001
    repointed, calls = _repointed_with_fake_driver(monkeypatch)
    repointed.point((X, Y))
    assert calls == []  # where it points already
    repointed.point((0x7E00_0000_0000, 0x7E00_8000_0000))
    assert calls == [11, 12]
    for kernel in repointed._kernels:
        got = arguments(kernel)[0]
        assert got == struct.pack("<QQ", 0x7E00_0000_0000 + 64, 0x7E00_8000_0000)
    repointed.point((0x7E00_0000_0000, 0x7E00_8000_0000))
    assert calls == [11, 12]


def test_a_failed_update_makes_the_next_point_set_every_node(monkeypatch) -> None:  # noqa: ANN001
    repointed, calls = _repointed_with_fake_driver(monkeypatch, status=1)
    monkeypatch.setattr(
        _graph_nodes._driver, "DriverError", lambda name, status: RuntimeError(name)
    )
    with pytest.raises(RuntimeError):
        repointed.point((0x7E00_0000_0000, Y))
    assert repointed.bases == ()
