"""The dense GEMMs twell takes from cuBLAS, bf16 inputs with fp32 accumulation:
``out = x @ w.T`` in bf16 (:func:`gemm_nt`), and ``out (+)= a @ b`` / ``a.T @ b`` in fp32
(:func:`gemm_f32`, the training backward's heavy rows)."""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np

from twell.kernels.buffers import empty_bf16, torch_caller, u16

_CUDA_R_32F = 0
_CUDA_R_16BF = 14
_CUBLAS_COMPUTE_32F = 68
_CUBLAS_GEMM_DEFAULT = -1
_CUBLAS_OP_N = 0
_CUBLAS_OP_T = 1
_ONE = np.ones(1, np.float32)
_ZERO = np.zeros(1, np.float32)
#: Whether torch.addmm takes an fp32 ``self`` with bf16 matrices and ``out_dtype``
#: (None: not tried yet). The first torch versions with ``out_dtype`` want ``self`` in the
#: matrices' dtype; there :func:`gemm_f32` adds a separately computed fp32 product.
_ADDMM_F32_SELF: bool | None = None


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
    m, k = x.shape
    n = w.shape[0]
    if out is None:
        out = empty_bf16((m, n))
    if m == 0 or n == 0:
        return out
    if k == 0:
        u16(out)[...] = 0
        return out
    torch = _torch_route(via, "twell's gate GEMM")
    if torch is not None:
        with _torch_stream(torch, x.device.id):
            _mm(torch, x, w, out)
        return out
    # Column-major view: out^T [N, M] = w [N, K] (op T of a K x N matrix) @ x^T [K, M].
    _gemm_ex(_CUBLAS_OP_T, _CUBLAS_OP_N, n, m, k, w, k, x, k, _ZERO, out, _CUDA_R_16BF, n)
    return out


def gemm_f32(
    a: Any,
    b: Any,
    out: Any,
    *,
    transpose_a: bool = False,
    accumulate: bool = False,
    via: str | None = None,
) -> Any:
    """``out[P, Q] = op(a) @ b[R, Q]`` (``accumulate``: ``out += op(a) @ b``), bf16 ``a``
    and ``b``, fp32 ``out`` and accumulation (cuBLAS, one rounding per output element;
    through a torch whose ``addmm`` refuses an fp32 ``out`` with ``out_dtype``, the
    accumulation adds a separate fp32 product: two roundings and an ``[P, Q]``
    temporary).

    ``op(a)`` is ``a`` ``[P, R]``, or with ``transpose_a`` the transpose of ``a``
    ``[R, P]`` (no copy: cuBLAS reads it transposed). All three arrays C-contiguous.
    Runs where :func:`gemm_nt` runs (torch for an op called with torch tensors or under
    capture, else CuPy's ``gemmEx``); through torch it needs ``torch.mm``'s ``out_dtype``
    (:func:`gemm_f32_available` tells). Deterministic for a given path.
    """
    p, q = out.shape
    r = a.shape[0] if transpose_a else a.shape[1]
    if p == 0 or q == 0:
        return out
    if r == 0:
        if not accumulate:
            out.fill(0)
        return out
    torch = _torch_route(via, "twell's fp32 GEMM")
    if torch is not None:
        with _torch_stream(torch, out.device.id):
            _mm_f32(torch, a, b, out, transpose_a, accumulate)
        return out
    # Column-major view: out^T [Q, P] = b^T [Q, R] @ op(a)^T [R, P]. A row-major a [P, R]
    # is a column-major [R, P] (op N, ld R); a row-major a [R, P] is a column-major
    # [P, R], read transposed (op T, ld P).
    _gemm_ex(_CUBLAS_OP_N, _CUBLAS_OP_T if transpose_a else _CUBLAS_OP_N, q, p, r, b, q,
             a, p if transpose_a else r, _ONE if accumulate else _ZERO, out, _CUDA_R_32F,
             q)  # fmt: skip
    return out


def gemm_f32_available() -> bool:
    """Whether :func:`gemm_f32` can run in the current call: through CuPy always; through
    torch (an op called with torch tensors, or a CUDA-graph capture) only with a torch
    whose ``mm`` takes ``out_dtype`` (torch 2.8 and later) and, under capture, only when
    torch is imported."""
    import cupy

    torch = sys.modules.get("torch")
    if torch_caller() or cupy.cuda.get_current_stream().is_capturing():
        return torch is not None and _torch_has_out_dtype(torch)
    return True


@functools.cache
def _torch_has_out_dtype(torch: Any) -> bool:
    try:
        return "dtype_out" in torch.ops.aten.mm.overloads()
    except (AttributeError, RuntimeError):
        return False


def _torch_route(via: str | None, what: str) -> Any | None:
    """The torch module when the GEMM runs through torch, None for CuPy's cuBLAS."""
    import cupy

    torch = sys.modules.get("torch")
    if torch_caller():  # already on torch's current stream
        return torch
    capturing = cupy.cuda.get_current_stream().is_capturing()
    if via == "torch" and torch is None:
        raise RuntimeError(f"{what}: via='torch' needs torch imported")
    if via == "torch" or (capturing and torch is not None):
        return torch
    if capturing:
        raise RuntimeError(
            f"{what} cannot be captured in a CUDA graph through CuPy (CuPy refuses cuBLAS "
            "during stream capture); import torch first to capture it"
        )
    return None


@contextlib.contextmanager
def _torch_stream(torch: Any, device_id: int) -> Iterator[None]:
    """CuPy's current stream made torch's current one, for the duration (nothing to do
    for an op called with torch tensors: CuPy already runs on torch's stream)."""
    if torch_caller():
        yield
        return
    import cupy

    stream = cupy.cuda.get_current_stream()
    device = torch.device("cuda", device_id)
    torch_stream = (
        torch.cuda.ExternalStream(stream.ptr, device=device)
        if stream.ptr
        else torch.cuda.default_stream(device)
    )
    with torch.cuda.stream(torch_stream):
        yield


def _gemm_ex(
    op_a: int, op_b: int, m: int, n: int, k: int, a: Any, lda: int, b: Any, ldb: int,
    beta: np.ndarray, c: Any, c_type: int, ldc: int,
) -> None:  # fmt: skip
    """cuBLAS ``c = op(a) @ op(b) + beta * c`` (column-major, bf16 ``a`` and ``b``, fp32
    compute) through CuPy's handle on its current stream."""
    import cupy
    from cupy_backends.cuda.libs import cublas

    handle = cupy.cuda.device.get_cublas_handle()
    mode = cublas.getPointerMode(handle)
    cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
    try:
        cublas.gemmEx(
            handle, op_a, op_b, m, n, k,
            _ONE.ctypes.data, a.data.ptr, _CUDA_R_16BF, lda,
            b.data.ptr, _CUDA_R_16BF, ldb,
            beta.ctypes.data, c.data.ptr, c_type, ldc,
            _CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT,
        )  # fmt: skip
    finally:
        cublas.setPointerMode(handle, mode)


def _mm(torch: Any, x: Any, w: Any, out: Any) -> None:
    xt, wt, ot = (torch.from_dlpack(a) for a in (x, w, out))
    torch.mm(xt, wt.t(), out=ot)


def _mm_f32(torch: Any, a: Any, b: Any, out: Any, transpose_a: bool, accumulate: bool) -> None:
    global _ADDMM_F32_SELF
    at, bt, ot = (torch.from_dlpack(v) for v in (a, b, out))
    if transpose_a:
        at = at.t()
    if not accumulate:
        torch.mm(at, bt, out_dtype=torch.float32, out=ot)
        return
    if _ADDMM_F32_SELF is not False:
        # A rejected call raises in its argument checks, before it launches anything (a
        # capture in progress stays valid).
        try:
            torch.addmm(ot, at, bt, out_dtype=torch.float32, out=ot)
        except (RuntimeError, TypeError) as error:
            if _ADDMM_F32_SELF or "dtype" not in str(error):
                raise
            _ADDMM_F32_SELF = False
        else:
            _ADDMM_F32_SELF = True
            return
    ot.add_(torch.mm(at, bt, out_dtype=torch.float32))  # an [P, Q] fp32 temporary
