"""Light-row kernels at mid-sized batches: warps per token. The one-warp kernel, the wide
kernel at W = 2…8 warps per token, and (up to 256 tokens) the decode kernel, each timed
as one launch replayed from a CUDA graph, with its heavy flags and output checked against
the one-warp kernel's. Used to place ``light_rows.wide_warps`` and the decode bound.

    PYTHONPATH=. python bench/dev_wide.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json

import cupy as cp
from ml_dtypes import bfloat16

from twell.benchmark import graph_ms_cupy, make_problem, to_device
from twell.kernels import light_rows, light_rows_decode
from twell.kernels.cublas import gemm_nt
from twell.kernels.pipeline import PreparedBlock
from twell.options import Options

SIZES = (32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 4096)
WARPS = (2, 3, 4, 6, 8)
#: Warps per token of the two-units-in-flight variant (twell_light_rows_from_pre_wide2).
WARPS2 = (2, 4, 8)


def launch_variant(kind: str, warps: int, x, pre, block, heavy, y) -> None:  # noqa: ANN001
    """One launch of the light-row stage: ``decode``, ``one`` (a warp per token) or
    ``wide`` (``warps`` warps per token)."""
    m = y.shape[0]
    if kind == "decode":
        light_rows_decode.from_pre(x, pre, heavy, block.w_up, block.w_down_t, y, tile=256,
                                   slots=32, max_row_nnz=block.max_row_nnz)  # fmt: skip
        return
    function = {
        "one": "twell_light_rows_from_pre",
        "wide": "twell_light_rows_from_pre_wide",
        "wide2": "twell_light_rows_from_pre_wide2",
    }[kind]
    light_rows._launch(function, m, 32 * warps, x, pre.view(cp.uint16), heavy, block.w_up,
                       block.w_down_t, y, 256, 32, block.max_row_nnz)  # fmt: skip


def measure(kind: str, warps: int, x, pre, block) -> tuple:  # noqa: ANN001
    """µs per graph replay, and the heavy flags and output (poisoned before the run)."""
    m = x.shape[0]
    heavy = cp.full((m,), 7, cp.uint8)
    y = cp.full((m, 2048), 0x7FC0, cp.uint16).view(bfloat16)  # NaN where nothing writes
    us = 1000 * graph_ms_cupy(lambda: launch_variant(kind, warps, x, pre, block, heavy, y))
    return us, heavy, y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=None)
    parser.add_argument("--workloads", nargs="+", default=["uniform", "paperlike", "heavy"])
    parser.add_argument("--M", nargs="+", type=int, default=list(SIZES))
    args = parser.parse_args()
    records = []
    for workload in args.workloads:
        for m in args.M:
            p = make_problem(workload, m, 2048, 5632)
            x, wg, wu, wd = (to_device(a) for a in (p.x, p.w_gate, p.w_up, p.w_down))
            block = PreparedBlock(wg, wu, wd, Options())
            pre = gemm_nt(x, wg)
            out = {"workload": workload, "M": m}
            base_us, base_heavy, base_y = measure("one", 1, x, pre, block)
            out["w1_us"] = round(base_us, 2)
            light = base_heavy == 0
            ref = base_y.astype(cp.float32)[light]
            scale = float(cp.abs(ref).max()) or 1.0
            variants = [("wide", w) for w in WARPS] + [("wide2", w) for w in WARPS2]
            variants += [("decode", 0)] if m <= 256 else []
            for kind, warps in variants:
                us, heavy, y = measure(kind, warps, x, pre, block)
                key = {"wide": f"w{warps}", "wide2": f"w{warps}x2"}.get(kind, "decode")
                out[f"{key}_us"] = round(us, 2)
                same_flags = bool((heavy == base_heavy).all())
                diff = float(cp.abs(y.astype(cp.float32)[light] - ref).max()) / scale
                if not same_flags or not diff <= 1e-2:
                    out[f"{key}_mismatch"] = {"flags": same_flags, "diff": diff}
            out["heavy_rows"] = int((base_heavy != 0).sum())
            print(json.dumps(out), flush=True)
            records.append(out)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
