"""Light-row kernels at mid-sized batches: one warp per token against eight (the wide
kernel), to place ``light_rows.WIDE_ROWS_BELOW``. CUDA-graph replay of each launch.

    PYTHONPATH=. python bench/dev_wide.py
"""

from __future__ import annotations

import json

import cupy as cp

from twell.benchmark import graph_ms_cupy, make_problem, to_device
from twell.kernels import light_rows
from twell.kernels.buffers import empty_bf16
from twell.kernels.cublas import gemm_nt
from twell.kernels.pipeline import PreparedBlock
from twell.options import Options


def main() -> None:
    for workload in ("uniform", "paperlike"):
        for m in (128, 256, 512, 1024, 2048):
            p = make_problem(workload, m, 2048, 5632)
            x, wg, wu, wd = (to_device(a) for a in (p.x, p.w_gate, p.w_up, p.w_down))
            block = PreparedBlock(wg, wu, wd, Options())
            pre = gemm_nt(x, wg)
            heavy = cp.zeros((m,), cp.uint8)
            y = empty_bf16((m, 2048))
            out = {"workload": workload, "M": m}
            args = (x, pre.view(cp.uint16), heavy, block.w_up, block.w_down_t, y, 256, 32,
                    block.max_row_nnz)  # fmt: skip
            kernels = {
                "one_warp": ("twell_light_rows_from_pre", m, light_rows.ROW_WARPS),
                "wide": ("twell_light_rows_from_pre_wide", m, light_rows.WIDE_WARPS),
            }
            for name, (function, grid, warps) in kernels.items():
                out[f"{name}_us"] = 1000 * graph_ms_cupy(
                    lambda f=function, g=grid, w=warps, a=args: light_rows._launch(f, g, 32 * w, *a)
                )
            print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
