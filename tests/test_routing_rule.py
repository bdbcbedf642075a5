"""The routing rule is written once per language; the two copies agree.

``twell/kernels/common.cuh`` holds the kernels' copy (bit tests on bf16 patterns, tile
overflow, row limit) in plain integer C++, so the machine's C++ compiler builds it here:
every one of the 65536 bf16 patterns, and a grid of counts, go through both the C++
functions and ``twell.formats.dense_row_mask`` / the value-level definitions.
"""

from __future__ import annotations

import importlib.resources
import shutil
import subprocess

import numpy as np
import pytest

from twell._arrays import bf16_values
from twell.formats import dense_row_mask

CXX = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")

PROGRAM = r"""
#include <cstdio>
#include "common.cuh"
int main() {
  for (unsigned b = 0; b < 65536; ++b)
    std::printf("%d%d%d%d", (int)twell_relu_keeps(b), (int)twell_relu_keeps_top(b << 16),
                (int)twell_non_finite(b), (int)twell_non_finite_top(b << 16));
  std::printf("\n");
  for (unsigned b = 0; b < 65536; ++b)  // b in each half, the other half its negation
    std::printf("%08x%08x", twell_relu_bf16x2(b | ((b ^ 0x8000u) << 16)),
                twell_relu_bf16x2((b << 16) | (b ^ 0x8000u)));
  std::printf("\n");
  for (int slots = 2; slots <= 256; slots *= 2)
    for (int count = 0; count <= 257; ++count)
      std::printf("%d", (int)twell_tile_overflows(count, slots));
  std::printf("\n");
  for (int limit = 0; limit <= 40; ++limit)
    for (int nnz = 0; nnz <= 40; ++nnz) std::printf("%d", (int)twell_row_over_limit(nnz, limit));
  std::printf("\n");
}
"""


@pytest.fixture(scope="module")
def cxx_rule(tmp_path_factory: pytest.TempPathFactory) -> list[np.ndarray]:
    if CXX is None:
        pytest.skip("no C++ compiler on this machine")
    folder = tmp_path_factory.mktemp("rule")
    header = importlib.resources.files("twell.kernels").joinpath("common.cuh").read_text()
    (folder / "common.cuh").write_text(header)
    (folder / "rule.cpp").write_text(PROGRAM)
    exe = folder / "rule"
    subprocess.run([CXX, "-std=c++17", "-O1", "-o", str(exe), str(folder / "rule.cpp")],
                   check=True, capture_output=True)  # fmt: skip
    lines = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()
    return [np.frombuffer(line.encode(), dtype=np.uint8) - ord("0") for line in lines]


def test_bit_tests_agree_with_the_values(cxx_rule: list[np.ndarray]) -> None:
    bits = np.arange(65536, dtype=np.uint32)
    values = bf16_values(bits)
    table = cxx_rule[0].reshape(65536, 4).astype(bool)
    keeps = np.isnan(values) | (values > 0)  # relu(h) != 0, NaN propagated
    np.testing.assert_array_equal(table[:, 0], keeps)
    np.testing.assert_array_equal(table[:, 1], keeps)
    np.testing.assert_array_equal(table[:, 2], ~np.isfinite(values))
    np.testing.assert_array_equal(table[:, 3], ~np.isfinite(values))


def test_relu_on_bit_pairs_keeps_what_relu_keeps(cxx_rule: list[np.ndarray]) -> None:
    """``twell_relu_bf16x2``: each half is its pattern where relu keeps it (+0 passes
    too), else +0, whatever the other half holds."""
    text = (cxx_rule[1] + ord("0")).astype(np.uint8).tobytes().decode()  # (hex digits)
    words = np.frombuffer(bytes.fromhex(text), dtype=">u4")
    words = words.astype(np.uint32).reshape(65536, 2)
    bits = np.arange(65536, dtype=np.uint32)
    values = bf16_values(bits)
    want = np.where(np.isnan(values) | (values > 0), bits, 0).astype(np.uint32)
    neg = bits ^ 0x8000
    want_neg = np.where(np.isnan(values) | (values < 0), neg, 0).astype(np.uint32)  # relu(-b)
    np.testing.assert_array_equal(words[:, 0] & 0xFFFF, want)
    np.testing.assert_array_equal(words[:, 0] >> 16, want_neg)
    np.testing.assert_array_equal(words[:, 1] >> 16, want)
    np.testing.assert_array_equal(words[:, 1] & 0xFFFF, want_neg)


def test_tile_overflow_agrees_with_dense_row_mask(cxx_rule: list[np.ndarray]) -> None:
    counts = np.arange(258)
    table = cxx_rule[2].reshape(-1, 258).astype(bool)
    for row, slots in zip(table, [2, 4, 8, 16, 32, 64, 128, 256], strict=True):
        python = dense_row_mask(counts[:, None], np.zeros(258, bool), slots)
        np.testing.assert_array_equal(row, python)


def test_row_limit_agrees_with_dense_row_mask(cxx_rule: list[np.ndarray]) -> None:
    table = cxx_rule[3].reshape(41, 41).astype(bool)
    nnz = np.arange(41)
    for limit in range(41):
        # one entry per tile (never an overflow at 256 slots), nnz tiles
        counts = (np.arange(41)[None, :] < nnz[:, None]).astype(np.int32)
        python = dense_row_mask(counts, np.zeros(41, bool), 256, max_row_nnz=limit)
        np.testing.assert_array_equal(table[limit], python)


def test_non_finite_rows_go_dense() -> None:
    counts = np.zeros((3, 2), np.int32)
    assert dense_row_mask(counts, np.array([False, True, False]), 32).tolist() == [0, 1, 0]
