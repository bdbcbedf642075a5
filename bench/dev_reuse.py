"""The "reuse" route's light stage against the per-token gather, measured.

For each workload and batch size, the gate packs TwELL once per weight set (gate_gemm.cu);
then, on the same TwELL, each light stage runs as CUDA-graph replays over SETS weight sets
(rotated, so the weights come from DRAM as in a model), µs per set:

- ``gather``: light_rows.from_twell, up and down rows of every pair read per token;
- ``pairs``: the reuse route's lists + up products (per-token gather of the up rows);
- ``down_tpg<t>_w<w>_s<s>``: its down projection alone, t tokens per group of lanes,
  w consumer warps, a ring of s chunks;
- ``reuse``: the whole reuse stage (pairs, then down with the launcher's choice).

Every variant's light rows are first checked bit for bit against the gather's. Then whole
blocks (``PreparedBlock``, density switch off): ``epilogue`` (gather), ``reuse``, ``fused``
(the default route) and ``dense`` (three cuBLAS GEMMs), with relative error against dense.

    PYTHONPATH=. python bench/dev_reuse.py [--out reuse.json] [--M 2048 16384]
"""

from __future__ import annotations

import argparse
import json

import cupy as cp
import numpy as np
import torch  # noqa: F401 - the cuBLAS gate GEMM is captured through torch

from twell.benchmark import gpu_name, graph_ms_cupy, make_problem, to_device
from twell.kernels import gate_gemm, light_rows, light_rows_reuse, pipeline
from twell.kernels.buffers import empty_bf16
from twell.options import Options
from twell.testing.asserts import relative_error

SETS = 4
K, N = 2048, 5632
TILE, SLOTS = 256, 32
#: Down-kernel geometries timed: (tokens per group, consumer warps, ring depth).
GEOMETRIES = [(8, 11, 4), (8, 11, 6), (4, 15, 4), (4, 15, 6), (2, 15, 4), (8, 7, 6)]


def emit(records: list[dict], **rec: object) -> None:
    print(json.dumps(rec), flush=True)
    records.append(rec)


def stages(workload: str, m: int, blocks: list, x: cp.ndarray, records: list[dict]) -> None:
    limit = blocks[0].max_row_nnz
    packs = [gate_gemm.gate_pack(x, b.w_first, TILE, SLOTS) for b in blocks]
    ys = [empty_bf16((m, K)) for _ in blocks]

    def gather() -> list:
        for b, (packed, heavy), y in zip(blocks, packs, ys, strict=True):
            light_rows.from_twell(x, packed, heavy, b.w_up, b.w_down_t, y, tile=TILE,
                                  slots=SLOTS, max_row_nnz=limit)  # fmt: skip
        return ys

    def pairs() -> list:
        return [
            light_rows_reuse.pairs(x, packed, heavy, b.w_up, N, K, tile=TILE, slots=SLOTS,
                                   max_row_nnz=limit)
            for b, (packed, heavy) in zip(blocks, packs, strict=True)
        ]  # fmt: skip

    gather()
    ref = [y.copy() for y in ys]
    lights = [cp.asnumpy(heavy) == 0 for _, heavy in packs]

    def same_light_rows(outs: list) -> bool:
        return all(
            np.array_equal(cp.asnumpy(a.view(cp.uint16))[lt], cp.asnumpy(b.view(cp.uint16))[lt])
            for a, b, lt in zip(outs, ref, lights, strict=True)
        )

    emit(records, kind="stage", workload=workload, M=m, variant="gather",
         us=graph_ms_cupy(gather) * 1e3 / SETS)  # fmt: skip
    emit(records, kind="stage", workload=workload, M=m, variant="pairs",
         us=graph_ms_cupy(pairs) * 1e3 / SETS)  # fmt: skip
    made = pairs()
    for tpg, warps, depth in GEOMETRIES:
        outs = [empty_bf16((m, K)) for _ in blocks]

        def down(tpg=tpg, warps=warps, depth=depth, outs=outs) -> list:  # noqa: ANN001
            for b, (_, heavy), p, y in zip(blocks, packs, made, outs, strict=True):
                light_rows_reuse.down(*p, heavy, b.w_down_t, y, tpg=tpg, warps=warps,
                                      stages=depth)  # fmt: skip
            return outs

        down()
        same = same_light_rows(outs)
        emit(records, kind="stage", workload=workload, M=m,
             variant=f"down_tpg{tpg}_w{warps}_s{depth}",
             us=graph_ms_cupy(down) * 1e3 / SETS, same_bits_as_gather=same)  # fmt: skip

    def reuse() -> list:
        for b, (packed, heavy), y in zip(blocks, packs, ys, strict=True):
            light_rows_reuse.from_twell(x, packed, heavy, b.w_up, b.w_down_t, y, tile=TILE,
                                        slots=SLOTS, max_row_nnz=limit)  # fmt: skip
        return ys

    us = graph_ms_cupy(reuse) * 1e3 / SETS
    emit(records, kind="stage", workload=workload, M=m, variant="reuse", us=us,
         same_bits_as_gather=same_light_rows(reuse()),
         tpg=light_rows_reuse.tokens_per_group(m, K, 132))  # fmt: skip


def whole(workload: str, m: int, problems: list, x: cp.ndarray, records: list[dict]) -> None:
    def blocks_for(path: str) -> list:
        return [
            pipeline.PreparedBlock(to_device(p.w_gate), to_device(p.w_up), to_device(p.w_down),
                                   Options(path=path, density_switch=False))
            for p in problems
        ]  # fmt: skip

    dense_blocks = blocks_for("fused")

    def dense() -> list:
        out = []
        for b in dense_blocks:
            y = empty_bf16((m, K))
            out += [y, *pipeline.dense_block(b, x, y)]
        return out

    ref = dense()[0]
    emit(records, kind="block", workload=workload, M=m, variant="dense",
         us=graph_ms_cupy(dense) * 1e3 / SETS)  # fmt: skip
    for path in ("epilogue", "reuse", "fused"):
        bs = dense_blocks if path == "fused" else blocks_for(path)
        y = bs[0](x)
        emit(records, kind="block", workload=workload, M=m, variant=path,
             us=graph_ms_cupy(lambda bs=bs: [b(x) for b in bs]) * 1e3 / SETS,
             rel_diff_vs_dense=relative_error(y, ref))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--M", type=int, nargs="+", default=[2048, 4096, 16384, 65536])
    ap.add_argument("--workloads", nargs="+", default=["uniform", "paperlike", "heavy"])
    ap.add_argument("--no-blocks", action="store_true")
    args = ap.parse_args()
    records: list[dict] = []
    for workload in args.workloads:
        problems = [make_problem(workload, max(args.M), K, N, seed=s) for s in range(SETS)]
        x_all = to_device(problems[0].x)
        blocks = [
            pipeline.PreparedBlock(to_device(p.w_gate), to_device(p.w_up), to_device(p.w_down),
                                   Options(path="reuse", density_switch=False))
            for p in problems
        ]  # fmt: skip
        for m in args.M:
            x = x_all[:m]
            stages(workload, m, blocks, x, records)
            if not args.no_blocks:
                whole(workload, m, problems, x, records)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": gpu_name(), "sets": SETS, "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
