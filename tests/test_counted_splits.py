"""The count build's split of a reduction (twell.kernels.gate_gemm.count_splits), on the
host: the kernel computes the same function of the device's row count, and the reduce
kernel and the parts buffer rely on its properties. CPU only."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from twell.kernels import gate_gemm as gg


@given(st.integers(0, 70000), st.integers(1, 64), st.integers(1, 2000),
       st.integers(1, gg.MAX_SPLITS))  # fmt: skip
def test_splits_fill_the_units_without_an_empty_part(rows: int, n8: int, k8: int, most: int):
    n, k = 128 * n8, 8 * k8
    s = gg.count_splits(rows, n, k, most)
    kblocks = math.ceil(k / gg.BLOCK_K)
    units = math.ceil(rows / gg.BLOCK_M) * math.ceil(n / gg.BLOCK_N)
    assert 1 <= s <= max(1, min(most, kblocks))
    per = math.ceil(kblocks / s)
    assert (s - 1) * per < kblocks  # every part sums at least one k block
    if s > 1:
        assert units * s <= gg.SPLIT_UNITS


@given(st.integers(1, 20000), st.sampled_from([(5632, 2048), (2048, 5632), (512, 264)]))
def test_the_parts_buffer_holds_every_count_up_to_m(m: int, shape: tuple[int, int]) -> None:
    n, k = shape
    rows = gg.part_rows(m, n, k, gg.MAX_SPLITS)
    for count in {1, m // 3, m // 2, m, *range(1, min(m, 2048), 97)}:
        s = gg.count_splits(count, n, k, gg.MAX_SPLITS)
        if s > 1:
            assert s * math.ceil(count / gg.BLOCK_M) * gg.BLOCK_M <= rows


def test_few_heavy_rows_split_the_down_projection_most() -> None:
    """The paper's shape: a handful of heavy rows split the down projection (8 column
    tiles) into 15 parts and the up projection (22) into 6; past ~1000 rows none."""
    assert gg.count_splits(5, 2048, 5632, gg.MAX_SPLITS) == 15
    assert gg.count_splits(5, 5632, 2048, gg.MAX_SPLITS) == 6
    assert gg.count_splits(1500, 2048, 5632, gg.MAX_SPLITS) == 1
    assert gg.count_splits(16384, 5632, 2048, gg.MAX_SPLITS) == 1
