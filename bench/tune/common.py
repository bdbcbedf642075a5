"""What the probes share: weight sets drawn on the GPU, a checked timing, and the rules
that turn timings into a threshold.

Every timing is of a CUDA graph replaying one call per weight set (``twell.timing.
graph_ms_cupy``, median of 20 replays), the sets rotated so that the weights come from
DRAM, per call in µs. Before a variant is timed, :meth:`Context.timed` runs it twice
eagerly and checks its output against float32 math on a sample of rows (and that the
two runs gave the same bits): a probe that times a wrong result stops the tune
(:class:`ProbeError`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import cupy as cp
import numpy as np
import torch  # noqa: F401 - a captured cuBLAS gate GEMM runs through torch

from twell.kernels import pipeline
from twell.kernels.buffers import empty_bf16, u16
from twell.kernels.convert import as_bf16
from twell.kernels.cublas import gemm_nt
from twell.options import LIST_CAPACITY, Options
from twell.testing.asserts import relative_error
from twell.timing import graph_ms_cupy

#: The shape most thresholds are measured at (the paper's 0.5-2B models).
K, N = 2048, 5632
#: Units firing per token in the uniform workload (docs/benchmark.md: p = 0.005, ~28 of 5632).
P = 0.005
#: Bytes of weights a timing rotates over at least: twice an H100's or H200's 50 MB L2.
ROTATE_BYTES = 200 << 20
#: Timings within this share of each other are level: the threshold in force decides.
TIE = 0.01
#: Largest relative error against float32 math a timed variant may have (bf16 rounding
#: points differ between routes: about 2e-3 is usual).
TOLERANCE = 2e-2
#: Rows of a call compared with float32 math.
CHECK_ROWS = 64


class ProbeError(RuntimeError):
    """A timed variant gave a wrong result (or different bits when run twice)."""


def row_limit(n: int, percent: int) -> int:
    """``max_row_nnz`` for ``percent`` of N (twell.options.default_max_row_nnz's rule)."""
    return max(16, min(LIST_CAPACITY, n * percent // 100))


@dataclass
class Problem:
    """Gated weight sets of the ``uniform`` workload (docs/benchmark.md), drawn on the GPU,
    and tokens: ``x[:, 0] = 1`` and ``w_gate[:, 0] = -z``, so that each gate
    pre-activation is about ``N(-z, 1)`` and a share ``p`` of the units fires
    (:meth:`set_density` changes ``p`` in place).

    Attributes:
        blocks: one prepared block per weight set (the density switch off).
        x: bf16 ``[rows, K]`` tokens (a call takes ``x[:m]``).
        p: the share of units that fire.
    """

    blocks: list[Any]
    x: Any
    p: float

    @property
    def k(self) -> int:
        return self.blocks[0].k

    @property
    def n(self) -> int:
        return self.blocks[0].n

    def set_density(self, p: float) -> None:
        """Rewrite ``w_gate[:, 0]`` of every set so that a share ``p`` of units fires."""
        bits = u16(as_bf16(cp.full((1,), -statistics.NormalDist().inv_cdf(1 - p), cp.float32)))
        for b in self.blocks:
            u16(b.w_gate)[:, 0] = bits[0]
        self.p = p

    def tokens(self, m: int, heavy: Sequence[int] = (), scale: float = 3.0) -> Any:
        """``x[:m]``, or a copy with the tokens ``heavy`` scaled by ``scale`` (but x[:, 0]):
        at p = 0.005 a token scaled by 3 fires about a fifth of the units."""
        if not heavy:
            return self.x[:m]
        f = f32(self.x[:m])
        rows = cp.asarray(list(heavy))
        f[rows, 1:] *= scale
        return as_bf16(f)


def f32(a: Any) -> Any:
    """A bf16 CuPy array as float32."""
    return (u16(a).astype(cp.uint32) << 16).view(cp.float32)


def kept_units(block: Any, x: Any) -> Any:
    """Units firing per token of ``x`` in ``block`` (positive gate pre-activations)."""
    bits = u16(gemm_nt(x, block.w_first))
    return ((bits > 0) & (bits < 0x8000)).sum(axis=1)


def _normal(shape: tuple[int, int], scale: float, rng: Any) -> Any:
    return as_bf16(rng.standard_normal(shape, dtype=cp.float32) * np.float32(scale))


def problem(
    k: int = K, n: int = N, rows: int = 256, p: float = P, *, sets: int | None = None,
    seed: int = 0, percent: int = 3,
) -> Problem:  # fmt: skip
    """A :class:`Problem` of ``rows`` tokens with enough weight sets to rotate over
    :data:`ROTATE_BYTES` (``sets`` to choose), max_row_nnz at ``percent`` of N."""
    rng = cp.random.default_rng(seed)
    sets = sets or max(1, min(8, math.ceil(ROTATE_BYTES / (3 * n * k * 2))))
    options = Options(path="fused", density_switch=False, max_row_nnz=row_limit(n, percent))
    blocks = []
    for _ in range(sets):
        w_gate = _normal((n, k), (k - 1) ** -0.5, rng)
        w_up, w_down = _normal((n, k), k**-0.5, rng), _normal((k, n), n**-0.5, rng)
        blocks.append(pipeline.PreparedBlock(w_gate, w_up, w_down, options))
    x = rng.standard_normal((rows, k), dtype=cp.float32)
    x[:, 0] = 1.0
    out = Problem(blocks, as_bf16(x), p)
    out.set_density(p)
    return out


def reference(block: Any, x: Any, rows: Any) -> Any:
    """float32 ``[len(rows), K]``: the block on ``x[rows]`` in float32 math."""
    xs = f32(u16(x)[rows])  # (index the bits: CuPy has no bf16 kernels)
    g = xs @ f32(block.w_gate).T
    h = cp.maximum(g, 0) * (xs @ f32(block.w_up).T)
    return h @ f32(block.w_down).T


def dense(block: Any, x: Any) -> list[Any]:
    """The whole block in dense math (``pipeline.dense_block``): ``[y, *scratch]``."""
    y = empty_bf16((x.shape[0], block.k))
    return [y, *pipeline.dense_block(block, x, y)]


def _first(out: Any) -> Any:
    return out[0] if isinstance(out, (list, tuple)) else out


@dataclass
class Context:
    """What a probe gets: the mode, the values in force (the file the run started from,
    then what the probes before it measured), a log."""

    quick: bool
    values: dict[str, Any]
    log: Callable[[str], None] = print

    def timed(
        self, what: str, call: Callable[[Any], Any], blocks: Sequence[Any], x: Any,
        *, check: bool = True, reps: int = 20,
    ) -> float:  # fmt: skip
        """µs per call of ``call(block)`` (returns ``y`` or ``[y, *scratch]`` for ``x``),
        replayed from a CUDA graph over ``blocks``; first checked against float32 math
        on a row sample of ``x`` and for the same bits twice (``check``)."""
        if check:
            first = _first(call(blocks[0]))
            again = u16(_first(call(blocks[0]))).copy()
            m = x.shape[0]
            rows = cp.arange(m)[:: max(1, m // CHECK_ROWS)][:CHECK_ROWS]
            err = relative_error(f32(u16(first)[rows]), reference(blocks[0], x, rows))
            if not err <= TOLERANCE:
                raise ProbeError(f"{what}: relative error {err:.3g} against float32 math")
            if not bool(cp.array_equal(u16(first), again)):
                raise ProbeError(f"{what}: two runs gave different bits")
        us = graph_ms_cupy(lambda: [call(b) for b in blocks], reps=reps) * 1e3 / len(blocks)
        for b in blocks:  # the buffers the capture kept
            b._graph_scratch.clear()
        self.log(f"  {what:<48} {us:9.1f} µs")
        return us


def level(a: float, b: float) -> bool:
    """Whether two timings are within :data:`TIE` of each other."""
    return abs(a - b) <= TIE * min(a, b)


def decide(ms: Sequence[int], first: Sequence[float], second: Sequence[float], current: int) -> int:
    """The threshold up to which (``m <= threshold``) the first choice runs, from timings
    of both choices at the sizes ``ms`` (ascending): the threshold whose choices cost
    least over the sizes measured (each size's time over its best time, summed), so that
    one noisy size does not move it; ``current``, the threshold in force, when its
    choices cost within :data:`TIE` of that."""

    def cost(threshold: int) -> float:
        return sum((a if m <= threshold else b) / min(a, b)
                   for m, a, b in zip(ms, first, second, strict=True))  # fmt: skip

    candidates = [0, *ms]
    best = min(candidates, key=lambda t: (cost(t), abs(t - current)))
    return current if cost(current) <= cost(best) * (1 + TIE) else best


def crossing(ps: Sequence[float], ts: Sequence[float], t_ref: float) -> tuple[float, bool]:
    """The density at which ``t(p)`` (measured at ascending ``ps``) meets ``t_ref``:
    linear between the two measured points around it, else extrapolated from the two
    nearest ends (second: True), at least a quarter of the smallest density measured."""
    points = list(zip(ps, ts, strict=True))
    for (p0, t0), (p1, t1) in zip(points, points[1:], strict=False):
        if (t0 - t_ref) * (t1 - t_ref) <= 0 and t0 != t1:
            return p0 + (t_ref - t0) * (p1 - p0) / (t1 - t0), False
    (p0, t0), (p1, t1) = ((ps[-2], ts[-2]), (ps[-1], ts[-1])) if ts[-1] < t_ref else (
        (ps[0], ts[0]), (ps[1], ts[1]))  # fmt: skip
    slope = (t1 - t0) / (p1 - p0)
    p = p1 + (t_ref - t1) / slope if slope > 0 else (ps[-1] * 4 if ts[-1] < t_ref else ps[0] / 4)
    return min(1.0, max(ps[0] / 4, p)), True
