"""Probe ``flag_rows``: ``heavy_rows.FLAG_ROWS``, the most tokens of an inference call whose
heavy-row kernels take the row flags and compact them themselves (one launch less)
rather than after ``heavy_rows.compact_rows``.

The block on the per-token route (sizes above the by-unit route's), ``uniform`` at
K=2048, N=5632 (no heavy row: the common case, which the launch saved is for; batches
with heavy rows at these sizes go to dense math), in a CUDA graph, weights from DRAM,
each way. The flags take the sizes up to the bound that costs least (``common.decide``),
in steps of 128 (the kernels' shared-memory capacity is the same number, at most 1024).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

from bench.tune.common import Context, decide, problem
from twell.kernels import heavy_rows

SIZES = (256, 384, 512, 768, 1024)
#: The most flags the kernels can hold (their shared memory).
CAPACITY = 1024


@contextlib.contextmanager
def flag_rows(limit: int) -> Iterator[None]:
    """``heavy_rows.FLAG_ROWS`` at ``limit``, the kernels built to hold :data:`CAPACITY`
    flags (a variant of the source when the module's was built for fewer)."""
    saved = heavy_rows.FLAG_ROWS, heavy_rows.SOURCE
    constants = {**heavy_rows.SOURCE.constants, "HR_FLAG_ROWS": CAPACITY}
    heavy_rows.SOURCE = dataclasses.replace(heavy_rows.SOURCE, constants=constants)
    heavy_rows.FLAG_ROWS = limit
    try:
        yield
    finally:
        heavy_rows.FLAG_ROWS, heavy_rows.SOURCE = saved


def measure(ctx: Context) -> dict[str, tuple[int, dict]]:
    sizes = [m for m in SIZES if m > ctx.values["decode_units.MAX_ROWS"]]
    prob = problem(rows=max(SIZES), percent=ctx.values["options.ROW_LIMIT_PERCENT"])
    flags, compacted = [], []
    for m in sizes:
        x = prob.tokens(m)
        block = lambda b, x=x: b(x)  # noqa: E731
        with flag_rows(CAPACITY):
            flags.append(ctx.timed(f"heavy rows by flags, M={m}", block, prob.blocks, x))
        with flag_rows(0):
            compacted.append(ctx.timed(f"heavy rows compacted first, M={m}", block, prob.blocks, x))
    value = decide(sizes, flags, compacted, ctx.values["heavy_rows.FLAG_ROWS"])
    value = min(CAPACITY, max(128, value // 128 * 128))
    data = {"how": "K=2048, N=5632, uniform, the block in a CUDA graph, weights from DRAM, µs",
            "M": sizes, "flags_us": [round(t, 2) for t in flags],
            "compacted_us": [round(t, 2) for t in compacted]}  # fmt: skip
    return {"heavy_rows.FLAG_ROWS": (value, data)}


def applied(value: int) -> int:
    """What the rest of a tune run may set ``heavy_rows.FLAG_ROWS`` to: at most the
    capacity the module's kernels were built with."""
    return min(value, heavy_rows.SOURCE.constants["HR_FLAG_ROWS"])
