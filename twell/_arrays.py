"""Array-library plumbing shared by the formats, the reference and the dispatcher.

twell's containers hold NumPy or CuPy arrays; the public ops also take PyTorch tensors.
Nothing here imports CuPy or torch eagerly: a library is only touched when an array of
it is seen.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import ml_dtypes
import numpy as np

bfloat16 = np.dtype(ml_dtypes.bfloat16)

#: Floating dtypes the public ops accept (by ``np.dtype``), and their names.
FLOAT_DTYPES = (bfloat16, np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))
FLOAT_NAMES = "bfloat16, float16, float32, float64"


def dtype_message(name: str, dtype: Any) -> str:
    """The ``TypeError`` message for argument ``name`` of a dtype not in
    :data:`FLOAT_DTYPES` (a float of the other byte order says how to convert it)."""
    found = np.dtype(dtype)
    if found.kind == "f" and not found.isnative:
        native = found.newbyteorder("=")
        return (
            f"{name}: expected native byte order, got {found.str} "
            f"(convert with .astype(np.{native.name}))"
        )
    return f"{name}: expected a floating dtype ({FLOAT_NAMES}), got {dtype}"


def _plain(array: np.ndarray) -> None:
    """``TypeError`` for the NumPy subclasses whose meaning the ops would drop."""
    if isinstance(array, np.ma.MaskedArray):
        raise TypeError(
            "expected a plain numpy.ndarray, got a masked array (the ops would ignore its "
            "mask: pass array.filled(value))"
        )
    if isinstance(array, np.matrix):
        raise TypeError("expected a plain numpy.ndarray, got numpy.matrix (pass np.asarray)")


def library_of(array: Any) -> str:
    """Name the array library of ``array``: ``"numpy"``, ``"cupy"`` or ``"torch"``.

    Raises:
        TypeError: ``array`` is none of the three.
    """
    if isinstance(array, np.ndarray):
        _plain(array)
        return "numpy"
    module = type(array).__module__.split(".")[0]
    if module in ("cupy", "torch"):
        return module
    raise TypeError(
        f"expected a numpy.ndarray, cupy.ndarray or torch.Tensor, got {type(array).__name__}"
    )


def xp_of(array: Any) -> ModuleType:
    """The NumPy-like module (``numpy`` or ``cupy``) that operates on ``array``."""
    if isinstance(array, np.ndarray):
        _plain(array)
        return np
    if type(array).__module__.split(".")[0] == "cupy":
        import cupy

        return cupy
    raise TypeError(f"expected a numpy or cupy array, got {type(array).__name__}")


def to_numpy(array: Any) -> np.ndarray:
    """A NumPy copy of a CuPy array or a torch tensor (any device); NumPy passes through.

    bfloat16 travels as its bits, so it arrives as the ml_dtypes ``bfloat16`` dtype.
    """
    if isinstance(array, np.ndarray):
        return array
    module = type(array).__module__.split(".")[0]
    if module == "torch":
        import torch

        array = array.detach().cpu()
        if array.dtype == torch.bfloat16:  # torch cannot hand bf16 to NumPy directly
            return array.view(torch.int16).numpy().view(bfloat16)
        return array.numpy()
    if module == "cupy":
        if np.dtype(array.dtype) == bfloat16:
            return array.view(np.uint16).get().view(bfloat16)
        return array.get()
    return np.asarray(array)


def bf16_bits(values: Any) -> Any:
    """Round to bfloat16 (nearest, ties to even, from float32) and return the bit patterns.

    Works on NumPy and CuPy arrays alike, so the reference and the GPU containers share
    one definition of the rounding. NaN stays NaN (quiet, sign kept); ±Inf stays ±Inf.

    Returns:
        uint32 array of the same shape with the 16 bf16 bits in its low half.
    """
    xp = xp_of(values)
    # float64 values beyond float32's range become ±Inf here, as the rule says: no warning.
    with np.errstate(over="ignore", invalid="ignore"):
        bits = xp.ascontiguousarray(values, dtype=xp.float32).view(xp.uint32)
    rounded = (bits + (xp.uint32(0x7FFF) + ((bits >> 16) & xp.uint32(1)))) >> 16
    is_nan = (bits & xp.uint32(0x7FFFFFFF)) > xp.uint32(0x7F800000)
    quiet_nan = (bits >> 16) | xp.uint32(0x0040)
    return xp.where(is_nan, quiet_nan, rounded).astype(xp.uint32)


def bf16_values(bits: Any) -> Any:
    """Decode bf16 bit patterns (low 16 bits of each element) to float32."""
    xp = xp_of(bits)
    return ((bits.astype(xp.uint32) & xp.uint32(0xFFFF)) << 16).view(xp.float32)


def round_bf16(values: Any) -> Any:
    """``values`` rounded to the nearest bfloat16, returned as float32."""
    return bf16_values(bf16_bits(values))


def non_finite(array: Any) -> Any:
    """Boolean mask of the NaN and ±Inf elements of a NumPy or CuPy float array.

    bfloat16 is tested on its bits, so CuPy arrays of the ml_dtypes dtype work too.
    """
    xp = xp_of(array)
    if np.dtype(array.dtype) == bfloat16:
        exponent = xp.uint16(0x7F80)
        return (array.view(xp.uint16) & exponent) == exponent
    return ~xp.isfinite(array)


def as_float32(array: Any) -> Any:
    """A NumPy or CuPy float array as float32 (bfloat16 decoded from its bits)."""
    xp = xp_of(array)
    if np.dtype(array.dtype) == bfloat16:
        return bf16_values(array.view(xp.uint16))
    with np.errstate(over="ignore"):
        return array.astype(xp.float32)


def as_float(array: np.ndarray, dtype: Any = np.float64) -> np.ndarray:
    """Upcast a NumPy array (ml_dtypes bf16 included) to a float dtype for the reference."""
    return np.asarray(array).astype(dtype, copy=False)
