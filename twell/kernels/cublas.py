"""The dense GEMM twell takes from cuBLAS: ``out = x @ w.T`` in bf16, fp32 accumulation."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from twell.kernels.buffers import empty_bf16, torch_caller, u16

_CUDA_R_16BF = 14
_CUBLAS_COMPUTE_32F = 68
_CUBLAS_GEMM_DEFAULT = -1
_CUBLAS_OP_N = 0
_CUBLAS_OP_T = 1
_ONE = np.ones(1, np.float32)
_ZERO = np.zeros(1, np.float32)


def gemm_nt(x: Any, w: Any, out: Any | None = None, *, via: str | None = None) -> Any:
    """``out[M, N] = x[M, K] @ w[N, K].T`` in bf16 with fp32 accumulation (cuBLAS).

    For an op called with torch tensors, runs through ``torch.mm`` on torch's current
    stream, eager or captured alike (so torch's cuBLAS handle and workspace are set up by
    the eager warm-up calls a capture needs, and replays give eager's bits). Otherwise
    through CuPy's ``gemmEx``, except while CuPy's stream is being captured into a CUDA
    graph (CuPy refuses cuBLAS then): then through torch too, which must be imported
    (``via="torch"`` forces that path, for comparisons). The two libraries may pick
    different cuBLAS kernels, so their bits can differ (each is deterministic).
    """
    import cupy

    m, k = x.shape
    n = w.shape[0]
    if out is None:
        out = empty_bf16((m, n))
    if m == 0 or n == 0:
        return out
    if k == 0:
        u16(out)[...] = 0
        return out
    torch = sys.modules.get("torch")
    if torch_caller():  # already on torch's current stream
        _mm(torch, x, w, out)
        return out
    stream = cupy.cuda.get_current_stream()
    capturing = stream.is_capturing()
    if via == "torch" or (capturing and torch is not None):
        device = torch.device("cuda", x.device.id)
        torch_stream = (
            torch.cuda.ExternalStream(stream.ptr, device=device)
            if stream.ptr
            else torch.cuda.default_stream(device)
        )
        with torch.cuda.stream(torch_stream):
            _mm(torch, x, w, out)
        return out
    if capturing:
        raise RuntimeError(
            "twell's gate GEMM cannot be captured in a CUDA graph through CuPy (CuPy "
            "refuses cuBLAS during stream capture); import torch first to capture it"
        )
    from cupy_backends.cuda.libs import cublas

    handle = cupy.cuda.device.get_cublas_handle()
    mode = cublas.getPointerMode(handle)
    cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
    try:
        # Column-major view: out^T [N, M] = w [N, K] (op T of a K x N matrix) @ x^T [K, M].
        cublas.gemmEx(
            handle, _CUBLAS_OP_T, _CUBLAS_OP_N, n, m, k,
            _ONE.ctypes.data, w.data.ptr, _CUDA_R_16BF, k,
            x.data.ptr, _CUDA_R_16BF, k,
            _ZERO.ctypes.data, out.data.ptr, _CUDA_R_16BF, n,
            _CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT,
        )  # fmt: skip
    finally:
        cublas.setPointerMode(handle, mode)
    return out


def _mm(torch: Any, x: Any, w: Any, out: Any) -> None:
    xt, wt, ot = (torch.from_dlpack(a) for a in (x, w, out))
    torch.mm(xt, wt.t(), out=ot)
