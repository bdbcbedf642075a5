"""Launcher of ``convert.cu``: bf16 conversions of whole arrays and the bf16 transpose."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from twell._arrays import bfloat16
from twell.kernels.buffers import alloc, empty_bf16, grid_1d, u16
from twell.kernels.compile import Source, declare

SOURCE = declare(Source("convert.cu"))

_TO_BF16 = {
    np.dtype(np.float32): "twell_f32_to_bf16",
    np.dtype(np.float64): "twell_f64_to_bf16",
    np.dtype(np.float16): "twell_f16_to_bf16",
}
_FROM_BF16 = {
    np.dtype(np.float32): "twell_bf16_to_f32",
    np.dtype(np.float64): "twell_bf16_to_f64",
    np.dtype(np.float16): "twell_bf16_to_f16",
}


def as_bf16(array: Any) -> Any:
    """``array`` as a C-contiguous, 16-byte aligned bf16 CuPy array (copy only if needed).

    Other float dtypes are rounded to bf16 (nearest even).
    """
    import cupy

    dtype = np.dtype(array.dtype)
    if dtype == bfloat16:
        if array.flags.c_contiguous and array.data.ptr % 16 == 0:
            return array
        out = empty_bf16(array.shape)
        u16(out)[...] = u16(array)
        return out
    if dtype not in _TO_BF16:
        raise TypeError(f"expected a floating array (bf16/fp16/fp32/fp64), got {dtype}")
    source = cupy.ascontiguousarray(array)
    out = empty_bf16(array.shape)
    n = source.size
    if n and dtype == np.float32 and n % 8 == 0 and source.data.ptr % 16 == 0:
        # 16-byte loads and stores (empty_bf16's buffers are 16-byte aligned); same bits
        SOURCE.kernel("twell_f32_to_bf16_x8")((grid_1d(n // 8),), (256,),
                                              (source, u16(out), np.int64(n // 8)))  # fmt: skip
    elif n:
        SOURCE.kernel(_TO_BF16[dtype])((grid_1d(n),), (256,), (source, u16(out), np.int64(n)))
    return out


def from_bf16(array: Any, dtype: Any) -> Any:
    """A bf16 CuPy array converted to ``dtype`` (returned as is when it is bf16)."""
    dtype = np.dtype(dtype)
    if dtype == bfloat16:
        return array
    if dtype not in _FROM_BF16:
        raise TypeError(f"cannot return results as {dtype}")
    out = alloc(array.shape, dtype)
    n = array.size
    if n:
        SOURCE.kernel(_FROM_BF16[dtype])((grid_1d(n),), (256,), (u16(array), out, np.int64(n)))
    return out


def transpose(matrix: Any) -> Any:
    """A bf16 ``[R, C]`` matrix transposed into a new C-contiguous ``[C, R]`` array."""
    rows, cols = matrix.shape
    out = empty_bf16((cols, rows))
    if not matrix.size:
        return out
    vectors = rows % 8 == 0 and cols % 8 == 0 and matrix.data.ptr % 16 == 0
    if vectors and out.data.ptr % 16 == 0:
        # 16-byte loads and stores where the 2-byte kernel moves 64 bytes a warp (w_down
        # is transposed by every training call's forward and again by its backward)
        grid = (math.ceil(cols / 64), math.ceil(rows / 64))
        SOURCE.kernel("twell_transpose_u16x8")(
            grid, (256,), (u16(matrix), u16(out), np.int32(rows), np.int32(cols))
        )
    else:
        grid = (math.ceil(cols / 32), math.ceil(rows / 32))
        SOURCE.kernel("twell_transpose_u16")(
            grid, (32, 8), (u16(matrix), u16(out), np.int32(rows), np.int32(cols))
        )
    return out
