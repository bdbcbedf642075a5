"""The backward's capacity rows (``dense_capacity``) taken apart, at the benchmark shape:
how many heavy rows the forward and the backward route, and the time of each cuBLAS call
of :func:`twell.kernels.backward._capacity_rows` through CuPy and through torch.

    PYTHONPATH=. python bench/dev_capacity.py
"""

from __future__ import annotations

from functools import partial

import cupy as cp
import numpy as np
import torch

from twell import workloads
from twell.benchmark import to_device
from twell.kernels import backward
from twell.kernels.buffers import empty_bf16
from twell.kernels.convert import as_bf16
from twell.kernels.cublas import gemm_f32, gemm_nt
from twell.kernels.pipeline import PreparedBlock
from twell.options import Options

M, K, N = 16384, 2048, 5632


def counts() -> None:
    rng = np.random.default_rng(1)
    for workload in ("uniform", "heavy", "paperlike"):
        p = workloads.make(workload, M, K, N, seed=0)
        dy = to_device(rng.standard_normal((M, K)).astype(p.x.dtype))
        x = to_device(p.x)
        for capacity in (0.0, 0.01, 0.03):
            opts = Options(dense_capacity=capacity)
            block = PreparedBlock(*(to_device(w) for w in (p.w_gate, p.w_up, p.w_down)), opts)
            _, saved = block.forward(x, save=True)
            seen: list = []
            original = backward.compact_rows

            def spy(flags, original=original, seen=seen):  # noqa: ANN001, ANN202
                ids, count = original(flags)
                seen.append(count)
                return ids, count

            backward.compact_rows = spy
            try:
                backward.ffn_backward(block, x, dy, saved)
            finally:
                backward.compact_rows = original
            rows = opts.capacity_rows(M)
            print(f"{workload:<10} capacity {capacity:<5} rows {rows:>4}: forward heavy "
                  f"{int(saved.count[0])}, backward heavy {int(seen[0][0])}")  # fmt: skip


def timed(fn, reps: int = 20) -> float:  # noqa: ANN001
    for _ in range(3):
        fn()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(reps):
        fn()
    stop.record()
    stop.synchronize()
    return cp.cuda.get_elapsed_time(start, stop) / reps * 1e3


def gemms() -> None:
    rng = np.random.default_rng(2)
    w16 = as_bf16(cp.asarray(rng.standard_normal((N, K)) * 0.02, dtype=cp.float32))
    for c in (164, 492):
        x_c = as_bf16(cp.asarray(rng.standard_normal((c, K)), dtype=cp.float32))
        a_c = as_bf16(cp.asarray(rng.standard_normal((c, N)), dtype=cp.float32))
        dx = cp.zeros((c, K), cp.float32)
        dw = cp.zeros((N, K), cp.float32)
        out16 = empty_bf16((c, N))
        for via in (None, "torch"):
            cases = {
                "x_c @ w.T (bf16)": partial(gemm_nt, x_c, w16, out16, via=via),
                "da @ w (fp32)": partial(gemm_f32, a_c, w16, dx, via=via),
                "dx += du @ w": partial(gemm_f32, a_c, w16, dx, accumulate=True, via=via),
                "dW += da.T @ x_c": partial(gemm_f32, a_c, x_c, dw, transpose_a=True,
                                            accumulate=True, via=via),
            }  # fmt: skip
            for name, fn in cases.items():
                print(f"C={c:<4} {via or 'cupy':<6} {name:<18} {timed(fn):8.1f} us")
    torch.cuda.synchronize()


def syncs() -> None:
    """Whether a torch-routed GEMM waits for the GPU (queued behind a GPU sleep)."""
    import time

    rng = np.random.default_rng(3)
    w16 = as_bf16(cp.asarray(rng.standard_normal((N, K)) * 0.02, dtype=cp.float32))
    a_c = as_bf16(cp.asarray(rng.standard_normal((164, N)), dtype=cp.float32))
    x_c = as_bf16(cp.asarray(rng.standard_normal((164, K)), dtype=cp.float32))
    dx = cp.zeros((164, K), cp.float32)
    out16 = empty_bf16((164, N))
    for name, fn in (
        ("gemm_nt torch", partial(gemm_nt, x_c, w16, out16, via="torch")),
        ("gemm_f32 torch", partial(gemm_f32, a_c, w16, dx, via="torch")),
        ("from_dlpack", partial(torch.from_dlpack, x_c)),
    ):
        fn()
        torch.cuda.synchronize()
        torch.cuda._sleep(1_000_000_000)
        t = time.perf_counter()
        fn()
        print(f"{name}: {(time.perf_counter() - t) * 1e3:.1f} ms behind a GPU sleep")
        torch.cuda.synchronize()


if __name__ == "__main__":
    syncs()
    counts()
    gemms()
