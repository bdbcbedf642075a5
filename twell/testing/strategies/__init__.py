"""Hypothesis strategies for twell's formats and ops.

Every strategy is public and composable: sizes are small by default (a test runs in
milliseconds) and every size argument takes an ``int``, a strategy, or ``None`` for the
default range. The structure of a drawn matrix (which row is empty, which tile is full or
overflows) is drawn by Hypothesis, so it shrinks to a minimal case; columns and values
come from a NumPy generator seeded by a drawn integer.

Strategies:
    :func:`layouts`            ``(tile, slots)`` pairs valid under docs/format.md.
    :func:`activations`        dense float32 matrices with controlled per-tile counts.
    :func:`packing_problems`   ``(h, tile, slots)``: a layout and an activation for it.
    :func:`twell_matrices`     valid :class:`TwELL` objects (from_dense or raw buffers).
    :func:`hybrid_matrices`    valid :class:`Hybrid` objects (from_dense or raw parts).
    :func:`corrupt_packed`     ``(packed, shape, tile, slots, kind)`` invalid buffers.
    :func:`corrupt_hybrids`    ``CorruptHybrid(matrix, kind)``: a Hybrid built through the
                               public constructors with one defect ``validate()`` rejects.
    :func:`ffn_problems`       ``FFNProblem(x, w_gate, w_up, w_down)`` for the FFN ops,
                               N a multiple of their default tile (``twell.ffn(*p)``
                               runs as drawn; ``p.tile``: a tile the ops take).
    :func:`nonfinite_ffn_problems`  FFN problems with NaN/±Inf planted in the weights
                               (preferably at units no token activates) or in ``x``.
    :func:`malformed`          an argument gone wrong: transposed, flattened, batched,
                               resized, the wrong dtype or type, ``None``, ...

Plain helpers:
    :func:`pack`               an independent, loop-level packer (entry order and unused
                               words under the caller's control): the second opinion on
                               :meth:`TwELL.from_dense`, and the way to build raw buffers.
    :func:`bf16_values_like`   random bf16-representable nonzero float32 values.

The strategies live in :mod:`~twell.testing.strategies.matrices` (layouts, activations,
valid formats, the packer), :mod:`~twell.testing.strategies.corruption` (invalid formats)
and :mod:`~twell.testing.strategies.problems` (FFN problems, malformed arguments); every
name is importable from here. They need Hypothesis (``pip install 'twell[strategies]'``).

Example:
    >>> from hypothesis import given
    >>> from twell import Hybrid
    >>> from twell.testing import assert_same_matrix
    >>> from twell.testing import strategies as tst
    >>> @given(tst.packing_problems(allow_nonfinite=True))
    ... def test_round_trip(problem):
    ...     h, tile, slots = problem
    ...     assert_same_matrix(Hybrid.from_dense(h, tile, slots), h)
"""

from twell.testing.strategies.corruption import (
    CORRUPTIONS,
    HYBRID_CORRUPTIONS,
    CorruptHybrid,
    corrupt_hybrids,
    corrupt_packed,
)
from twell.testing.strategies.matrices import (
    TILES,
    activations,
    bf16_values_like,
    hybrid_matrices,
    layouts,
    pack,
    packing_problems,
    twell_matrices,
)
from twell.testing.strategies.problems import (
    MALFORMATIONS,
    FFNProblem,
    ffn_problems,
    malformed,
    nonfinite_ffn_problems,
)

__all__ = [
    "TILES",
    "CORRUPTIONS",
    "FFNProblem",
    "layouts",
    "activations",
    "packing_problems",
    "twell_matrices",
    "hybrid_matrices",
    "corrupt_packed",
    "HYBRID_CORRUPTIONS",
    "CorruptHybrid",
    "corrupt_hybrids",
    "ffn_problems",
    "nonfinite_ffn_problems",
    "MALFORMATIONS",
    "malformed",
    "pack",
    "bf16_values_like",
]
