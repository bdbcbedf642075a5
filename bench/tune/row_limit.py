"""Probe ``row_limit``: ``options.ROW_LIMIT_PERCENT``, the default ``max_row_nnz`` as a
percent of N: a token with more active units leaves the gather (two weight rows from L2
per unit) for the heavy rows' dense math (N units' worth of tensor-core work).

The block (per-token route, switch off) at 1% to 6% of N, K=2048, N=5632, on a batch
whose tokens spread over those limits: ``uniform`` (about 28 units a token) with 10% of
the tokens scaled so that they fire about 110, 185, 300 and 560 units. The limit that
costs least over the batch sizes measured (time over the best time at each size,
summed) is kept; one level with the limit in force keeps that.
"""

from __future__ import annotations

from typing import Any

from bench.tune.common import Context, Problem, f32, kept_units, problem, row_limit
from twell.kernels.convert import as_bf16

PERCENTS = (1, 2, 3, 4, 6)
SIZES = (2048, 16384)
#: (share of the tokens, scale of their x): at p = 0.005 they fire ~110, 185, 300, 560 units.
GROUPS = ((0.03, 1.25), (0.03, 1.4), (0.02, 1.6), (0.02, 2.0))


def spread_tokens(prob: Problem, m: int) -> Any:
    """``x[:m]`` with the :data:`GROUPS` of tokens scaled (strided over the batch)."""
    f = f32(prob.x[:m])
    start = 0
    for share, scale in GROUPS:
        step = max(1, round(1 / share))
        f[start::step, 1:] *= scale
        start += 1
    return as_bf16(f)


def measure(ctx: Context) -> dict[str, tuple[int, dict]]:
    prob = problem(rows=max(SIZES))
    n = prob.n
    now = ctx.values["options.ROW_LIMIT_PERCENT"]
    times: dict[int, list[float]] = {p: [] for p in PERCENTS}
    for m in SIZES:
        x = spread_tokens(prob, m)
        for percent in PERCENTS:
            for b in prob.blocks:  # the routes read the block's limit per call
                b.max_row_nnz = row_limit(n, percent)
            what = f"max_row_nnz {row_limit(n, percent)} ({percent}% of N), M={m}"
            times[percent].append(ctx.timed(what, lambda b, x=x: b(x), prob.blocks, x))
    best = [min(times[p][i] for p in PERCENTS) for i in range(len(SIZES))]
    score = {p: sum(t / b for t, b in zip(times[p], best, strict=True)) for p in PERCENTS}
    choice = min(PERCENTS, key=lambda p: score[p])
    if now in score and score[now] <= score[choice] + 0.01 * len(SIZES):
        choice = now
    units = kept_units(prob.blocks[0], spread_tokens(prob, 1024)).mean()
    data = {"how": "K=2048, N=5632, uniform with 10% of the tokens firing 110-560 units, the "
            "block per token in a CUDA graph, weights from DRAM, µs",
            "M": list(SIZES), "mean_units": round(float(units), 1),
            **{f"{p}%_us": [round(t, 2) for t in times[p]] for p in PERCENTS}}  # fmt: skip
    return {"options.ROW_LIMIT_PERCENT": (choice, data)}
