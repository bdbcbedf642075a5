"""Programmatic dependent launch on the GPU (skipped without one): the forward pass gives
the same bits with ``compile.PROGRAMMATIC`` on and off, on every route that launches
kernels with ``launch_after`` (decode by unit with the scan and the list down kernels,
the cuBLAS gate then the by-unit kernels, the cluster, wide and one-warp light-row
kernels, the heavy-row stage with and without rows, by flags and by compacted ids),
matches float64 dense math, and replays from a CUDA graph give the same bits twice; a
dependent kernel launched behind a slow kernel that lets it start early reads that
kernel's output, not what was there before. Buffers are poisoned first (0xFF: NaN)."""

from __future__ import annotations

from collections.abc import Iterator

import cupy as cp
import ml_dtypes
import numpy as np
import pytest

from twell import reference, workloads
from twell.benchmark import to_device
from twell.kernels import compile as kc
from twell.kernels import decode_units, heavy_rows
from twell.kernels.pipeline import PreparedBlock
from twell.options import Options
from twell.testing.asserts import as_host, relative_error
from twell.testing.gpu import captured_replays

BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.fixture
def restore_programmatic() -> Iterator[None]:
    saved = kc.PROGRAMMATIC
    yield
    kc.PROGRAMMATIC = saved


CASES = [
    ("uniform", 8, {}),  # the tensor-core gate, then the scan down kernel
    ("uniform", 64, {}),  # cuBLAS, the gate/up kernel after it, the scan
    ("uniform", 128, {}),  # cuBLAS, the gate/up kernel, the list down kernel
    ("uniform", 300, {}),  # the wide light-row kernel; the heavy-row stage by flags, empty
    ("uniform", 1500, {}),  # the one-warp kernel; compact_rows and an empty stage
    ("heavy", 500, {"frac": 0.02}),  # heavy rows through the flags path
    ("heavy", 1500, {"frac": 0.01}),  # heavy rows through compact_rows
]


@pytest.mark.parametrize(("workload", "m", "kw"), CASES, ids=[f"{w}-{m}" for w, m, _ in CASES])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "plain-heavy"])
@pytest.mark.parametrize("by_unit", [True, False], ids=["by-unit", "by-token"])
def test_dependent_launches_give_the_plain_launches_bits(
    workload, m, kw, overlap, by_unit, restore_programmatic, monkeypatch
):
    """``by_unit=False`` keeps batches of at most 192 tokens off the by-unit route, so that
    up to 64 tokens the cluster light-row kernel (light_rows_decode.cu) runs."""
    if not by_unit and m > decode_units.MAX_ROWS:
        pytest.skip("above the by-unit route's bound both are the same call")
    if not by_unit:
        monkeypatch.setattr(decode_units, "MAX_ROWS", 0)
    k, n = 1024, 2048
    p = workloads.make(workload, m, k, n, seed=m, **kw)
    block = PreparedBlock(*(to_device(a) for a in (p.w_gate, p.w_up, p.w_down)),
                          Options(density_switch=False))  # fmt: skip
    real = heavy_rows.matmul
    monkeypatch.setattr(heavy_rows, "matmul", lambda *a, **o: real(*a, **{**o, "overlap": overlap}))
    x = to_device(p.x)
    kc.PROGRAMMATIC = False
    plain = block(x).view(cp.uint16).copy()
    kc.PROGRAMMATIC = True
    on = block(x)
    assert cp.array_equal(on.view(cp.uint16), plain)
    bf = [a.astype(BF16) for a in (p.x, p.w_gate, p.w_up, p.w_down)]
    ref = reference.forward.ffn_dense(*bf)
    assert relative_error(as_host(on).astype(np.float64), ref) <= 1e-2  # NaN if unwritten


@pytest.mark.parametrize("m", [8, 64, 1500])
def test_dependent_launches_replay_from_a_graph(m, restore_programmatic):
    pytest.importorskip("torch")  # the cuBLAS gate GEMM is captured through torch
    kc.PROGRAMMATIC = True
    p = workloads.heavy(m, 1024, 2048, frac=0.01, seed=7)
    block = PreparedBlock(*(to_device(a) for a in (p.w_gate, p.w_up, p.w_down)),
                          Options(density_switch=False))  # fmt: skip
    x = to_device(p.x)
    first, second = captured_replays(lambda: block(x))
    assert cp.array_equal(first.view(cp.uint16), second.view(cp.uint16))
    bf = [a.astype(BF16) for a in (p.x, p.w_gate, p.w_up, p.w_down)]
    ref = reference.forward.ffn_dense(*bf)
    assert relative_error(as_host(first).astype(np.float64), ref) <= 1e-2


SLOW_WRITER = r"""
extern "C" __global__ void slow_writer(const unsigned char* src, unsigned char* dst, int n,
                                       long long cycles) {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");  // the next may start now
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
  for (int i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
}
"""


def test_a_dependent_kernel_waits_for_a_slow_kernel_that_released_it(restore_programmatic):
    """compact_rows launched after a kernel that lets it start at once, then spins about a
    millisecond before writing the row flags: the ids and count are those of the flags
    written, not of the poisoned buffer that was there (every row flagged)."""
    kc.PROGRAMMATIC = True
    m = 3000
    rng = np.random.default_rng(5)
    flags = cp.asarray((rng.random(m) < 0.05).astype(np.uint8))
    heavy = cp.full(m, 0xFF, cp.uint8)
    writer = cp.RawKernel(SLOW_WRITER, "slow_writer")
    writer((1,), (256,), (flags, heavy, np.int32(m), np.int64(2_000_000)))
    ids, count = heavy_rows.compact_rows(heavy, overlap=True)
    expected = cp.flatnonzero(flags).astype(cp.int32)
    assert int(count[0]) == expected.size < m
    assert cp.array_equal(ids[: expected.size], expected)
