"""Probe ``decode_gates``: which gate the by-unit decode route (decode_units_*.cu) computes for
how many tokens, ``decode_units.MMA_GATE_TOKENS`` and ``WGMMA_TOKENS``.

The route at M tokens with each of its three gates (mma.sync in the gate/up kernel, the
TMA/wgmma kernel, a cuBLAS GEMM before the gate/up kernel), ``uniform`` at K=2048,
N=5632. The gate's cost steps with its 8-token tiles (17 tokens take the tiles of 32),
so the sizes are the ends of those steps. mma.sync takes the tokens up to the bound that
costs least against wgmma over the sizes measured (``common.decide``); wgmma those above,
up to the bound that costs least against cuBLAS.
"""

from __future__ import annotations

from typing import Any

from bench.tune.common import Context, decide, problem
from twell.kernels import decode_units
from twell.kernels.buffers import empty_bf16

SIZES = (1, 4, 8, 16, 17, 24, 32, 33, 48, 64)
QUICK_SIZES = (1, 8, 16, 17, 32, 48, 64)


def route(x: Any, gate: str) -> Any:
    """The by-unit route on ``x`` with ``gate``, as ``call(block) -> [y, *scratch]``."""

    def call(b: Any) -> list[Any]:
        y = empty_bf16((x.shape[0], b.k))
        return [y, *decode_units.forward(x, b.w_first, b.w_up, b.w_down_t, y, gate=gate)]

    return call


def measure(ctx: Context) -> dict[str, tuple[int, dict]]:
    sizes = QUICK_SIZES if ctx.quick else SIZES
    prob = problem(rows=max(sizes))
    times: dict[str, list[float]] = {"mma": [], "wgmma": [], "cublas": []}
    for m in sizes:
        x = prob.tokens(m)
        for gate, ts in times.items():
            what = f"by-unit route, {gate} gate, M={m}"
            ts.append(ctx.timed(what, route(x, gate), prob.blocks, x))
    mma = decide(sizes, times["mma"], times["wgmma"], ctx.values["decode_units.MMA_GATE_TOKENS"])
    above = [i for i, m in enumerate(sizes) if m > mma]  # wgmma against cuBLAS above mma.sync
    wgmma = max(mma, decide([sizes[i] for i in above], [times["wgmma"][i] for i in above],
                            [times["cublas"][i] for i in above],
                            ctx.values["decode_units.WGMMA_TOKENS"]))  # fmt: skip
    how = "K=2048, N=5632, uniform, the route in a CUDA graph, weights from DRAM, µs"
    data = {"how": how, "M": list(sizes), **{f"{g}_us": [round(t, 2) for t in ts]
                                              for g, ts in times.items()}}  # fmt: skip
    return {"decode_units.MMA_GATE_TOKENS": (mma, data),
            "decode_units.WGMMA_TOKENS": (wgmma, data)}  # fmt: skip
