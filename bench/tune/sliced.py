"""Probe ``sliced``: ``light_rows_sliced.WEIGHT_BYTES`` and ``MIN_ROWS``, from which weight
size and batch size the fused path reads its light rows by 256-column slices of the
weights (light_rows_sliced.cu, the slice being read staying in L2) rather than per token.

The block both ways at K=4096 and N from 2816 to 14336 (46 to 235 MB of gathered
``w_up`` and ``w_down``), 2048 to 16384 tokens, ``uniform``, in a CUDA graph, weights
from DRAM. A weight size takes the slices from the smallest batch at which they are
ahead at that batch and every larger one; WEIGHT_BYTES is the smallest size from which
every larger size measured takes them, MIN_ROWS the largest of those sizes' batches.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from bench.tune.common import Context, level, problem
from twell.kernels import light_rows_sliced

K = 4096
WIDTHS = (2816, 5632, 8192, 14336)
SIZES = (2048, 4096, 8192, 16384)
#: WEIGHT_BYTES where the slices never pay: no model reaches it.
NEVER = 1 << 40


@contextlib.contextmanager
def sliced(on: bool) -> Iterator[None]:
    """The fused path reading its light rows by slices at every size (``on``) or never."""
    saved = light_rows_sliced.WEIGHT_BYTES, light_rows_sliced.MIN_ROWS
    light_rows_sliced.WEIGHT_BYTES, light_rows_sliced.MIN_ROWS = (0, 0) if on else (NEVER, 1)
    try:
        yield
    finally:
        light_rows_sliced.WEIGHT_BYTES, light_rows_sliced.MIN_ROWS = saved


def measure(ctx: Context) -> dict[str, tuple[int, dict]]:
    bytes_now = ctx.values["light_rows_sliced.WEIGHT_BYTES"]
    rows_now = ctx.values["light_rows_sliced.MIN_ROWS"]
    percent = ctx.values["options.ROW_LIMIT_PERCENT"]
    records, from_rows = [], {}
    for n in WIDTHS:
        size = 2 * n * K * 2
        prob = problem(K, n, rows=max(SIZES), percent=percent)
        wins = []
        for m in SIZES:
            x = prob.tokens(m)
            block = lambda b, x=x: b(x)  # noqa: E731
            with sliced(True):
                t_on = ctx.timed(f"K={K} N={n} by slices, M={m}", block, prob.blocks, x)
            with sliced(False):
                t_off = ctx.timed(f"K={K} N={n} per token, M={m}", block, prob.blocks, x)
            pays_now = size >= bytes_now and m >= rows_now
            wins.append(pays_now if level(t_on, t_off) else t_on < t_off)
            records.append([n, size, m, round(t_on, 2), round(t_off, 2)])
        # the smallest batch from which the slices are ahead at every larger one
        start = None
        for m, won in zip(reversed(SIZES), reversed(wins), strict=True):
            if not won:
                break
            start = m
        from_rows[size] = start
        del prob
    sizes = sorted(from_rows)
    paying = [s for i, s in enumerate(sizes) if all(from_rows[t] for t in sizes[i:])]
    weight_bytes = paying[0] if paying else NEVER
    min_rows = max(from_rows[s] for s in paying) if paying else rows_now
    data = {"how": "gated, uniform, the block in a CUDA graph, weights from DRAM, µs",
            "[N, gathered bytes, M, by slices us, per token us] at K=4096": records}  # fmt: skip
    return {"light_rows_sliced.WEIGHT_BYTES": (weight_bytes, data),
            "light_rows_sliced.MIN_ROWS": (min_rows, data)}  # fmt: skip
