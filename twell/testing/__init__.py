"""Test support for twell and for code built on it: Hypothesis strategies, assertions, profiles.

- :mod:`twell.testing.strategies`: activations with controlled per-tile counts, valid and
  corrupt TwELL/Hybrid objects (``corrupt_packed``, ``corrupt_hybrids``), whole FFN
  problems, also with NaN/Inf planted in the weights (``nonfinite_ffn_problems``), and
  malformed arguments (``malformed``) (needs Hypothesis: ``pip install 'twell[strategies]'``).
- :mod:`twell.testing.asserts`: :func:`assert_same_matrix` (validates both sides, then
  compares TwELL, Hybrid, sparse and dense matrices through decoding),
  :func:`assert_matches_dense` (an FFN block's output against dense float64 math, each
  element to within a tolerance of its summed terms' magnitude) and
  :func:`relative_error`.
- :mod:`twell.testing.profiles`: the ``dev``/``ci``/``deep`` Hypothesis profiles and
  :func:`~twell.testing.profiles.load_profile`.
- :mod:`twell.testing.gpu`: :func:`~twell.testing.gpu.poisoned_buffers`, every buffer the
  kernels write filled with 0xFF first (needs CuPy).

The assertions are imported here; the strategies and profiles need Hypothesis and are
imported from their modules.
"""

from twell.testing.asserts import (
    as_host,
    assert_matches_dense,
    assert_relative_error,
    assert_same_matrix,
    assert_same_nonfinite,
    matrix_entries,
    relative_error,
)

__all__ = [
    "as_host",
    "assert_matches_dense",
    "assert_relative_error",
    "assert_same_matrix",
    "assert_same_nonfinite",
    "matrix_entries",
    "relative_error",
]
