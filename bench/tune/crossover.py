"""Probes of where the sparse path stops paying, the density switch's thresholds
(twell.kernels.density), at K=2048, N=5632 with the weights from DRAM:

- ``crossover`` (``density.CROSSOVER``): at each batch size of the table, the block as it
  runs by default (the by-unit route for decode batches, the per-token route above;
  the density switch off) at densities around the crossover in force, and dense cuBLAS
  math; the crossover is the density at which the two meet (linear between the
  densities measured, extrapolated past them, the record says where);
- ``heavy_dense`` (``density.HEAVY_DENSE``): the block with one heavy token (a fifth of
  the units firing) in a ``uniform`` batch against dense math, 16 to 8192 tokens; the
  interval runs from the first size where dense math is ahead to the first size above
  it where the sparse path is ahead again.
"""

from __future__ import annotations

from typing import Any

from bench.tune.common import Context, P, crossing, dense, level, problem
from twell.kernels import density

#: The batch sizes of the table.
SIZES = (1, 4, 16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 8192)
#: Densities measured, as multiples of the crossover in force at the size.
AROUND = (0.5, 1.0, 2.0)
AROUND_FULL = (0.5, 0.75, 1.0, 1.5, 2.0)
#: Densities tried past those when the crossing lies outside them (at most one each way).
FURTHER = 2.0
#: Sizes of the heavy-row probe.
HEAVY_SIZES = (16, 32, 48, 64, 96, 128, 192, 256, 512, 1024, 2048, 4096, 8192)


def _block(x: Any) -> Any:
    return lambda b: b(x)


def _dense(x: Any) -> Any:
    return lambda b: dense(b, x)


def measure(ctx: Context) -> dict[str, tuple[Any, dict]]:
    prob = problem(rows=max(SIZES), percent=ctx.values["options.ROW_LIMIT_PERCENT"])
    table = ctx.values["density.CROSSOVER"]
    around = AROUND if ctx.quick else AROUND_FULL
    points, rows, guessed = [], [], []
    for m in SIZES:
        guess = _interpolate(table, m)
        x = prob.tokens(m)
        prob.set_density(min(0.5, guess))
        t_dense = ctx.timed(f"dense math, M={m}", _dense(x), prob.blocks, x)

        def sparse(f: float, m: int = m, x: Any = x) -> float:
            prob.set_density(f)
            return ctx.timed(f"sparse block, M={m}, p={f:.4g}", _block(x), prob.blocks, x)

        fs = sorted({min(0.5, guess * a) for a in around})
        ts = [sparse(f) for f in fs]
        if ts[-1] < t_dense and fs[-1] < 0.5:  # still sparse at the densest: one more
            fs.append(min(0.5, fs[-1] * FURTHER))
            ts.append(sparse(fs[-1]))
        elif ts[0] > t_dense:  # dense at the sparsest: one more below
            fs.insert(0, fs[0] / FURTHER)
            ts.insert(0, sparse(fs[0]))
        f, extrapolated = crossing(fs, ts, t_dense)
        points.append([m, round(f, 5 if f < 0.01 else 4)])
        if extrapolated:
            guessed.append(m)
        rows.append({"M": m, "dense_us": round(t_dense, 2), "p": [round(f, 5) for f in fs],
                     "sparse_us": [round(t, 2) for t in ts]})  # fmt: skip
    prob.set_density(P)
    data = {
        "how": "K=2048, N=5632, gated, uniform at density p, the block as it runs by default "
        "(switch off) and dense math, each in a CUDA graph, weights from DRAM",
        "extrapolated_at_M": guessed,
        "measured": rows,
    }
    return {"density.CROSSOVER": (points, data)}


def _interpolate(table: Any, m: int) -> float:
    """The crossover in force at ``m`` tokens (density.crossover's rule on ``table``)."""
    saved = density.CROSSOVER
    density.CROSSOVER = tuple(tuple(p) for p in table)
    density.crossover.cache_clear()
    try:
        return density.crossover(m)
    finally:
        density.CROSSOVER = saved
        density.crossover.cache_clear()


def measure_heavy(ctx: Context) -> dict[str, tuple[Any, dict]]:
    prob = problem(rows=max(HEAVY_SIZES), percent=ctx.values["options.ROW_LIMIT_PERCENT"])
    low_now, high_now = ctx.values["density.HEAVY_DENSE"]
    rows, dense_wins = [], []
    for m in HEAVY_SIZES:
        x = prob.tokens(m, heavy=(m // 2,))
        t_sparse = ctx.timed(f"sparse block, one heavy token, M={m}", _block(x), prob.blocks, x)
        t_dense = ctx.timed(f"dense math, M={m}", _dense(x), prob.blocks, x)
        level_here = level(t_dense, t_sparse)  # level: the interval in force decides
        dense_wins.append(low_now <= m < high_now if level_here else t_dense < t_sparse)
        rows.append([m, round(t_sparse, 2), round(t_dense, 2)])
    low = next((m for m, won in zip(HEAVY_SIZES, dense_wins, strict=True) if won), 0)
    high = next((m for m, won in zip(HEAVY_SIZES, dense_wins, strict=True)
                 if m > low and not won), HEAVY_SIZES[-1] * 2) if low else 0  # fmt: skip
    data = {"how": "K=2048, N=5632, uniform with one token's x scaled by 3, the block as it "
            "runs by default (switch off) and dense math in a CUDA graph, weights from DRAM",
            "[M, sparse us, dense us]": rows}  # fmt: skip
    return {"density.HEAVY_DENSE": ([low, high], data)}
