"""Probes of the by-unit decode route (decode_units_*.cu) against the other kernels of small
batches, ``uniform`` at K=2048, N=5632, weights from DRAM:

- ``decode_rows`` (``decode_units.MAX_ROWS``): the whole block by unit against the
  per-token kernels (the route's bound at 0) at 1 to 256 tokens; the bound is the one
  that costs least over the sizes measured (``common.decide``), as for SCAN_TOKENS;
- ``decode_scan`` (``decode_units.SCAN_TOKENS``, ``SCAN_WIDE_UNITS``): the route's down
  projection by a scan against lists of token groups (16 to 128 tokens), and the scan's
  CTA of 64 threads against 128 at means of 16 to 80 kept units a token, with a few
  tokens of hundreds of units or none (their output bits must be equal).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from bench.tune.common import Context, N, ProbeError, decide, kept_units, level, problem
from twell.kernels import decode_units
from twell.kernels.buffers import empty_bf16, u16

ROW_SIZES = (1, 32, 64, 96, 128, 160, 192, 224, 256)
SCAN_SIZES = (16, 32, 48, 64, 96, 128)
#: Token counts and mean kept units a token at which the scan's CTA sizes are compared.
WIDE_SIZES = (16, 32, 64)
WIDE_UNITS = (16, 28, 40, 56, 80)


@contextlib.contextmanager
def max_rows(limit: int) -> Iterator[None]:
    """``decode_units.MAX_ROWS`` set to ``limit`` (0: every call takes the per-token kernels)."""
    saved = decode_units.MAX_ROWS
    decode_units.MAX_ROWS = limit
    try:
        yield
    finally:
        decode_units.MAX_ROWS = saved


def measure_rows(ctx: Context) -> dict[str, tuple[int, dict]]:
    prob = problem(rows=max(ROW_SIZES), percent=ctx.values["options.ROW_LIMIT_PERCENT"])
    by_unit, per_token = [], []
    for m in ROW_SIZES:
        x = prob.tokens(m)
        block = lambda b, x=x: b(x)  # noqa: E731
        with max_rows(decode_units.MAX_TOKENS):
            by_unit.append(ctx.timed(f"block by unit, M={m}", block, prob.blocks, x))
        with max_rows(0):
            per_token.append(ctx.timed(f"block per token, M={m}", block, prob.blocks, x))
    value = decide(ROW_SIZES, by_unit, per_token, ctx.values["decode_units.MAX_ROWS"])
    data = {"how": "K=2048, N=5632, uniform, the block in a CUDA graph, weights from DRAM, µs",
            "M": list(ROW_SIZES), "by_unit_us": _r(by_unit),
            "per_token_us": _r(per_token)}  # fmt: skip
    return {"decode_units.MAX_ROWS": (value, data)}


def route(x: Any, **kw: Any) -> Any:
    def call(b: Any) -> list[Any]:
        y = empty_bf16((x.shape[0], b.k))
        return [y, *decode_units.forward(x, b.w_first, b.w_up, b.w_down_t, y, **kw)]

    return call


def measure_scan(ctx: Context) -> dict[str, tuple[int, dict]]:
    prob = problem(rows=max(SCAN_SIZES + WIDE_SIZES))
    scan, lists = [], []
    for m in SCAN_SIZES:
        x = prob.tokens(m)
        for down, ts in (("scan", scan), ("lists", lists)):
            ts.append(ctx.timed(f"by unit, down by {down}, M={m}", route(x, down=down),
                                prob.blocks, x))  # fmt: skip
    tokens = decide(SCAN_SIZES, scan, lists, ctx.values["decode_units.SCAN_TOKENS"])
    # 64 against 128 threads: mean kept units a token, with two tokens of hundreds or none
    wide_now = ctx.values["decode_units.SCAN_WIDE_UNITS"]
    rows, narrow_wins = [], []
    for units in WIDE_UNITS:
        prob.set_density(units / N)
        for m in WIDE_SIZES:
            for heavy in ((), (0, m // 2)):
                x = prob.tokens(m, heavy)
                mean = float(kept_units(prob.blocks[0], x).mean())
                t = {}
                for threads in (64, 128):
                    call = route(x, down="scan", scan_threads=threads)
                    what = f"scan {threads} threads, M={m}, {mean:.0f} units a token"
                    t[threads] = ctx.timed(what, call, prob.blocks, x)
                _same_bits(prob.blocks[0], x)
                narrow = t[64] < t[128] or (level(t[64], t[128]) and mean <= wide_now)
                rows.append([m, round(mean, 1), round(t[64], 2), round(t[128], 2)])
                narrow_wins.append((mean, narrow))
    # 128 threads above the largest mean at which 64 were not behind
    wide = round(max((mean for mean, narrow in narrow_wins if narrow), default=0.0))
    prob.set_density(0.005)
    how = "K=2048, N=5632, the route in a CUDA graph, weights from DRAM, µs"
    return {
        "decode_units.SCAN_TOKENS": (tokens, {"how": how, "M": list(SCAN_SIZES),
                                              "scan_us": _r(scan), "lists_us": _r(lists)}),
        "decode_units.SCAN_WIDE_UNITS": (wide, {"how": how, "[M, mean units a token, 64 "
                                                "threads us, 128 threads us]": rows}),
    }  # fmt: skip


def _same_bits(block: Any, x: Any) -> None:
    ys = []
    for threads in (64, 128):
        y = route(x, down="scan", scan_threads=threads)(block)[0]
        ys.append(u16(y).copy())
    if not bool((ys[0] == ys[1]).all()):
        raise ProbeError(f"the scan's output bits depend on its CTA size (M={x.shape[0]})")


def _r(ts: list[float]) -> list[float]:
    return [round(t, 2) for t in ts]
