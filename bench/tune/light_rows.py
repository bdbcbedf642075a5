"""Probe ``light_rows``: ``light_rows_decode.DECODE_ROWS_BELOW``, the most tokens whose light
rows from a pre-activation run in the cluster kernel (light_rows_decode.cu) rather than in
light_rows.cu's kernels (a block of ``light_rows.cols_warps`` warps per token, or a warp
per token, as ``light_rows.from_pre`` picks).

The light-row stage alone, one launch per weight set replayed from a CUDA graph,
``uniform`` at K=2048, N=5632 (no heavy rows), its output checked against float32 math
of the whole block. The cluster kernel takes the tokens up to the bound that costs least
over the sizes measured (``common.decide``). (The stage runs at these sizes where the
by-unit route does not: the paths other than ``"fused"``, and N not a multiple of 32.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from bench.tune.common import Context, ProbeError, decide, problem
from twell.kernels import light_rows, light_rows_decode
from twell.kernels.buffers import alloc, empty_bf16
from twell.kernels.cublas import gemm_nt

SIZES = (1, 16, 32, 48, 64, 96, 128, 192)


@contextlib.contextmanager
def decode_rows_below(limit: int) -> Iterator[None]:
    saved = light_rows_decode.DECODE_ROWS_BELOW
    light_rows_decode.DECODE_ROWS_BELOW = limit
    try:
        yield
    finally:
        light_rows_decode.DECODE_ROWS_BELOW = saved


def stage(x: Any, pres: dict[int, Any]) -> Any:
    """The light-row stage on ``x`` as ``call(block) -> [y, heavy, pre]`` (the block's
    pre-activation computed beforehand)."""

    def call(b: Any) -> list[Any]:
        m = x.shape[0]
        y, heavy = empty_bf16((m, b.k)), alloc((m,), np.uint8)
        o = b.options
        light_rows.from_pre(x, pres[id(b)], heavy, b.w_up, b.w_down_t, y, tile=o.tile,
                            slots=o.slots, max_row_nnz=b.max_row_nnz)  # fmt: skip
        return [y, heavy]

    return call


def measure(ctx: Context) -> dict[str, tuple[int, dict]]:
    prob = problem(rows=max(SIZES), percent=ctx.values["options.ROW_LIMIT_PERCENT"])
    cluster, other = [], []
    for m in SIZES:
        x = prob.tokens(m)
        pres = {id(b): gemm_nt(x, b.w_first) for b in prob.blocks}
        call = stage(x, pres)
        if call(prob.blocks[0])[1].any():  # heavy rows' y is the heavy-row stage's
            raise ProbeError(f"light rows, M={m}: heavy rows in a uniform batch")
        with decode_rows_below(1 << 20):
            cluster.append(ctx.timed(f"light rows, cluster kernel, M={m}", call, prob.blocks, x))
        with decode_rows_below(0):
            other.append(ctx.timed(f"light rows, light_rows.cu, M={m}", call, prob.blocks, x))
    value = decide(SIZES, cluster, other, ctx.values["light_rows_decode.DECODE_ROWS_BELOW"])
    data = {"how": "K=2048, N=5632, uniform, the light-row stage alone in a CUDA graph, µs",
            "M": list(SIZES), "cluster_us": [round(t, 2) for t in cluster],
            "light_rows_us": [round(t, 2) for t in other]}  # fmt: skip
    return {"light_rows_decode.DECODE_ROWS_BELOW": (value, data)}
