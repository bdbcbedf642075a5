"""Between dense matrices and TwELL words: packing (rounding to bf16, counting every
row-tile, keeping the first ``slots - 1`` entries) and the helpers the decoders share."""

from __future__ import annotations

from typing import Any

import numpy as np

from twell._arrays import FLOAT_DTYPES, as_float32, bf16_bits, bfloat16, dtype_message, xp_of
from twell.formats.checks import check_layout


def pack_dense(h: Any, tile: int, slots: int) -> tuple[Any, Any, Any]:
    """Pack ``h`` into TwELL words: ``(packed, counts int64 [M, tiles], non_finite [M])``.

    ``non_finite`` marks the rows holding a value that is NaN or ±Inf once rounded to
    bfloat16 (so also a finite value beyond the bf16 range).
    """
    try:
        xp = xp_of(h)
    except TypeError as error:
        raise TypeError(f"h: {error}") from None
    if np.dtype(h.dtype) not in FLOAT_DTYPES:
        raise TypeError(dtype_message("h", h.dtype))
    if h.ndim != 2:
        raise ValueError(f"h: expected a 2-D matrix, got shape {tuple(h.shape)}")
    rows, columns = check_layout(tuple(h.shape), tile, slots, name="h")
    tiles = columns // tile
    nonzero = h != 0  # NaN counts as a nonzero
    m, n = xp.nonzero(nonzero)
    bits = bf16_bits(h[m, n])
    rounds_to_zero = (bits & xp.uint32(0x7FFF)) == 0  # tiny values: ±0 in bf16
    if bool(rounds_to_zero.any()):
        nonzero[m[rounds_to_zero], n[rounds_to_zero]] = False
        m, n, bits = m[~rounds_to_zero], n[~rounds_to_zero], bits[~rounds_to_zero]
    non_finite = xp.zeros(rows, dtype=bool)
    exponent = xp.uint32(0x7F80)
    non_finite[m[(bits & exponent) == exponent]] = True
    counts = nonzero.reshape(rows, tiles, tile).sum(axis=2, dtype=xp.int64)
    packed = xp.zeros((rows, tiles * slots), dtype=xp.uint32)
    packed[:, ::slots] = counts.astype(xp.uint32)
    if m.size:
        # Entries come in row-major order, so each row-tile's entries are contiguous:
        # an entry's rank in its row-tile is its position minus the group's start.
        group = m * tiles + n // tile
        flat_counts = counts.reshape(-1)
        starts = xp.cumsum(flat_counts) - flat_counts
        rank = xp.arange(m.size) - starts[group]
        keep = rank < slots - 1
        m, n, bits, rank = m[keep], n[keep], bits[keep], rank[keep]
        word = (n // tile) * slots + 1 + rank
        packed[m, word] = n.astype(xp.uint32) | (bits << 16)
    return packed, counts, non_finite


def csr_matrix(entries: tuple[Any, Any, Any], shape: tuple[int, int], xp: Any):  # noqa: ANN201
    """``(row, column, value)`` entries as a SciPy (NumPy data) or cupyx CSR matrix."""
    m, n, v = entries
    if xp is np:
        import scipy.sparse

        matrix = scipy.sparse.csr_matrix((v, (m, n)), shape=shape, dtype=np.float32)
    else:
        import cupyx.scipy.sparse

        matrix = cupyx.scipy.sparse.coo_matrix((v, (m, n)), shape=shape).tocsr()
    matrix.sum_duplicates()
    return matrix


def dense_zeros(xp: Any, shape: tuple[int, ...], dtype: np.dtype) -> Any:
    """Zeros of ``dtype`` (bf16 on CuPy as 16-bit words viewed as bf16)."""
    if dtype == bfloat16 and xp is not np:  # CuPy holds bf16 as 16-bit words
        return xp.zeros(shape, dtype=xp.uint16).view(bfloat16)
    return xp.zeros(shape, dtype=dtype)


def widen(values: Any) -> Any:
    """Dense-part values as float32 (float64 kept), for decoding."""
    if np.dtype(values.dtype) == np.float64:
        return values
    return as_float32(values)


def put_values(out: Any, index: Any, values: Any) -> None:
    """``out[index] = values`` converted to ``out``'s dtype (bf16 by rounding), quietly."""
    dtype = np.dtype(out.dtype)
    xp = xp_of(out)
    if dtype == bfloat16 and xp is not np:
        out.view(xp.uint16)[index] = bf16_bits(values).astype(xp.uint16)
        return
    with np.errstate(over="ignore"):  # e.g. float32 values beyond float16's range: ±Inf
        out[index] = values.astype(dtype)
