"""The dense GEMM twell takes from cuBLAS: ``out = x @ w.T`` in bf16, fp32 accumulation."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from twell.kernels.buffers import empty_bf16, u16

_CUDA_R_16BF = 14
_CUBLAS_COMPUTE_32F = 68
_CUBLAS_GEMM_DEFAULT = -1
_CUBLAS_OP_N = 0
_CUBLAS_OP_T = 1
_ONE = np.ones(1, np.float32)
_ZERO = np.zeros(1, np.float32)


def gemm_nt(x: Any, w: Any, out: Any | None = None, *, via: str | None = None) -> Any:
    """``out[M, N] = x[M, K] @ w[N, K].T`` in bf16 with fp32 accumulation (cuBLAS).

    Runs through CuPy's ``gemmEx``, except while the current stream is being captured
    into a CUDA graph (CuPy refuses cuBLAS during capture): then through torch, which
    must be imported already (``via="torch"`` forces that path, for comparisons). Either
    way on CuPy's current stream. The two paths may pick different cuBLAS kernels, so a
    captured graph's bits can differ from eager ones (each is deterministic).
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
    stream = cupy.cuda.get_current_stream()
    capturing = stream.is_capturing()
    torch = sys.modules.get("torch")
    if via == "torch" or (capturing and torch is not None):
        device = torch.device("cuda", x.device.id)
        torch_stream = (
            torch.cuda.ExternalStream(stream.ptr, device=device)
            if stream.ptr
            else torch.cuda.default_stream(device)
        )
        with torch.cuda.stream(torch_stream):
            xt, wt, ot = (torch.from_dlpack(a) for a in (x, w, out))
            torch.mm(xt, wt.t(), out=ot)
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
