"""validate.cu (the GPU check of user-built formats) against the NumPy checks: the same
verdict on drawn corrupt and valid Hybrids, and the same message for a single defect.

Skipped without a GPU; run on the GPU machine.
"""

from __future__ import annotations

import re

import cupy as cp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from twell.formats import Hybrid, TwELL
from twell.testing import strategies as tst

# The check of user-built formats, on buffers as CuPy's pool hands them out.
pytestmark = pytest.mark.unpoisoned


def on_gpu(h: Hybrid) -> Hybrid:
    ell = TwELL(cp.asarray(h.ell.packed), h.shape, h.tile, h.slots)
    dense = h.dense
    if dense.dtype.itemsize == 2 and dense.dtype != np.float16:  # bf16 travels as bits
        dense = cp.asarray(dense.view(np.uint16)).view(dense.dtype)
    else:
        dense = cp.asarray(dense)
    return Hybrid(ell, cp.asarray(h.dense_rows), dense)


def verdict(h: Hybrid) -> str | None:
    try:
        h.validate()
    except ValueError as error:
        return str(error)
    return None


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tst.corrupt_hybrids(rows=8))
def test_gpu_validation_rejects_what_numpy_rejects(case: tst.CorruptHybrid) -> None:
    cpu = verdict(case.matrix)
    assert cpu is not None, case.kind
    gpu = verdict(on_gpu(case.matrix))
    assert gpu is not None, case.kind
    # One defect: both name the same row (the NumPy checks run by kind, the kernel by
    # position, so for a row that is wrong twice over they may word it differently).
    row = re.compile(r"row (\d+)")
    if case.kind in ("count_over_tile", "column_outside_tile", "zero_value"):
        assert row.search(gpu).group(1) == row.search(cpu).group(1), (gpu, cpu)


@settings(max_examples=40, deadline=None)
@given(tst.hybrid_matrices(rows=8))
def test_gpu_validation_accepts_what_numpy_accepts(h: Hybrid) -> None:
    assert verdict(h) is None
    assert verdict(on_gpu(h)) is None
