"""Light-row kernels on a skewed workload: one warp per token against eight (the
``wide`` kernel for every token), to see what the tail of long tokens costs.

    python bench/dev_rows.py
"""

from __future__ import annotations

import json

import cupy as cp
import numpy as np

from bench.dev_gate_gemm import time_ms
from twell.benchmark import make_problem, to_device
from twell.kernels import light_rows
from twell.kernels.buffers import empty_bf16
from twell.kernels.cublas import gemm_nt
from twell.kernels.pipeline import PreparedBlock
from twell.options import Options


def main() -> None:
    for workload in ("uniform", "paperlike"):
        measure(workload)


def measure(workload: str) -> None:
    p = make_problem(workload, 16384, 2048, 5632)
    x, wg, wu, wd = (to_device(a) for a in (p.x, p.w_gate, p.w_up, p.w_down))
    block = PreparedBlock(wg, wu, wd, Options())
    pre = gemm_nt(x, wg)
    heavy = cp.zeros((16384,), cp.uint8)
    y = empty_bf16((16384, 2048))
    bits = pre.view(cp.uint16)
    l0 = cp.asnumpy(((bits & 0x8000) == 0).sum(axis=1))  # nonnegative pre-activations
    out = {"workload": workload, "l0_quantiles": np.quantile(l0, [0.5, 0.9, 0.99]).tolist()}
    for cap in (168, 1024):
        out[f"one_warp_cap{cap}"] = time_ms(
            lambda cap=cap: light_rows.from_pre(
                x, pre, heavy, block.w_up, block.w_down_t, y, tile=256, slots=32,
                max_row_nnz=cap,
            )
        )  # fmt: skip
        out[f"eight_warps_cap{cap}"] = time_ms(
            lambda cap=cap: light_rows._launch(
                "twell_light_rows_from_pre_wide", 16384, 32 * light_rows.WIDE_WARPS, x,
                pre.view(cp.uint16), heavy, block.w_up, block.w_down_t, y, 256, 32, cap,
            )
        )  # fmt: skip
    light_rows.from_pre(x, pre, heavy, block.w_up, block.w_down_t, y, tile=256, slots=32,
                        max_row_nnz=168)  # fmt: skip
    out["heavy_rows_cap168"] = int(heavy.sum())
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
