"""Helpers for ``python -m twell`` on a GPU: NumPy → CuPy upload and a short demo run."""

from __future__ import annotations

import statistics
from typing import Any

import numpy as np

from twell.kernels.ffn_gpu import BF16, SparseFFN, gate


def to_device(array: np.ndarray | None) -> Any:
    """A NumPy array (ml_dtypes bf16 included) copied to the current GPU as CuPy."""
    import cupy as cp

    if array is None:
        return None
    array = np.ascontiguousarray(array)
    if array.dtype == BF16:
        return cp.asarray(array.view(np.uint16)).view(BF16)
    return cp.asarray(array)


def _median_ms(fn: Any, warmup: int = 5, reps: int = 20) -> float:
    import cupy as cp

    for _ in range(warmup):
        fn()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(reps):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop))
    return statistics.median(times)


def demo_gpu(problem: Any) -> dict[str, Any]:
    """Run a workload problem through the kernels and time it against dense cuBLAS.

    Returns:
        A report: ``"hybrid"`` (the GPU :class:`twell.Hybrid` of the gate), the relative
        error against float64 dense math (first 256 rows), twell and dense times (ms,
        median of 20 after 5 warm-ups; dense through torch when it is installed).
    """
    import cupy as cp

    from twell.reference.forward import ffn_dense

    x, w_gate, w_up, w_down = (to_device(a) for a in problem.arrays())
    block = SparseFFN(w_gate, w_up, w_down)
    y = block(x)
    rows = min(256, x.shape[0])
    got = y[:rows].view(cp.uint16).get().view(BF16).astype(np.float64)
    ref = ffn_dense(problem.x[:rows], problem.w_gate, problem.w_up, problem.w_down)
    report: dict[str, Any] = {
        "hybrid": gate(x, w_gate if w_gate is not None else w_up),
        "rel. error": float(np.linalg.norm(got - ref) / np.linalg.norm(ref)),
        "twell GPU (ms)": _median_ms(lambda: block(x)),
    }
    try:
        import torch
        import torch.nn.functional as F  # noqa: N812
    except ImportError:
        return report
    xt, wu, wd = (torch.from_dlpack(a) for a in (x, w_up, w_down))
    if w_gate is None:
        dense = lambda: F.linear(F.relu(F.linear(xt, wu)), wd)  # noqa: E731
    else:
        wg = torch.from_dlpack(w_gate)
        dense = lambda: F.linear(F.relu(F.linear(xt, wg)) * F.linear(xt, wu), wd)  # noqa: E731
    report["dense cuBLAS (ms)"] = _median_ms(dense)
    report["speedup"] = report["dense cuBLAS (ms)"] / report["twell GPU (ms)"]
    return report
