"""What a CUDA-graph IF node around the heavy-row stage would save at M=2048 (K=2048,
N=5632, `uniform`: no heavy rows), measured with torch's conditional capture
(`CUDAGraph.begin_capture_to_if_node`) and twell's own kernels.

Graphs, each captured by torch on a side stream (CuPy launching on it), replayed back to
back (µs per replay, CUDA events over 200 replays, the three interleaved five times):
  plain    from_pre -> compact_rows -> two heavy-row matmuls   (what the fused route runs)
  if_node  from_pre -> IF(pred) { compact_rows -> two heavy-row matmuls }, pred a static
           bool tensor set to False (the best case: a kernel before it would write it)
  if_any   the same with pred = heavy.any() computed in the graph (one torch reduction)
  alone    from_pre only (the floor)
Then the IF graph with pred True and one row flagged heavy: that row of y must come out
with the plain graph's bits (y poisoned with NaN before each replay).

    PYTHONPATH=. python bench/dev_conditional.py [--M 2048] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import cupy as cp
import numpy as np
import torch

from twell.benchmark import gpu_name, make_problem, to_device, versions
from twell.kernels import heavy_rows, light_rows
from twell.kernels.buffers import empty_bf16
from twell.kernels.cublas import gemm_nt
from twell.kernels.pipeline import PreparedBlock
from twell.options import Options


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--M", type=int, default=2048)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    m, k, n = args.M, 2048, 5632
    p = make_problem("uniform", m, k, n)
    x, wg, wu, wd = (to_device(a) for a in (p.x, p.w_gate, p.w_up, p.w_down))
    block = PreparedBlock(wg, wu, wd, Options())
    pre = gemm_nt(x, wg)
    heavy = cp.zeros((m,), cp.uint8)
    y = empty_bf16((m, k))
    pre_h = empty_bf16((m, n))
    limit = block.max_row_nnz
    flag_rows = [False]  # the check run flags row 5 after from_pre

    def light() -> None:
        light_rows.from_pre(x, pre, heavy, block.w_up, block.w_down_t, y, tile=256, slots=32,
                            max_row_nnz=limit)  # fmt: skip
        if flag_rows[0]:
            heavy[5] = 1
            pre_h[5] = pre[5]

    def heavy_stage() -> None:
        ids, count = heavy_rows.compact_rows(heavy)
        heavy_rows.matmul(x, block.w_up, pre_h, ids, count, m, a_by_id=True, out_by_id=True,
                          gate=pre_h, gate_by_id=True, relu_gate=True)  # fmt: skip
        heavy_rows.matmul(pre_h, block.w_down, y, ids, count, m, a_by_id=True, out_by_id=True)
        keep.append((ids, count))

    keep: list = []
    pred = torch.zeros((), dtype=torch.bool, device="cuda")
    side = torch.cuda.Stream()

    def capture(kind: str) -> torch.cuda.CUDAGraph:
        for _ in range(2):  # warm-up, eager, on the side stream
            with torch.cuda.stream(side), cp.cuda.ExternalStream(side.cuda_stream):
                light()
                heavy_stage()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side), cp.cuda.ExternalStream(side.cuda_stream):
            g.capture_begin()
            light()
            if kind == "plain":
                heavy_stage()
            elif kind in ("if_node", "if_any"):
                cond = pred
                if kind == "if_any":
                    cond = torch.as_tensor(heavy, device="cuda").any()
                    keep.append(cond)
                g.begin_capture_to_if_node(cond)
                heavy_stage()
                g.end_capture_to_conditional_node()
            g.capture_end()
        torch.cuda.synchronize()
        return g

    rec: dict = {"M": m, "gpu": gpu_name(), **versions()}
    graphs = {}
    for kind in ("plain", "if_node", "if_any", "alone"):
        try:
            graphs[kind] = capture(kind)
        except Exception as error:  # noqa: BLE001 - recorded: the capture is what is probed
            rec[f"{kind}_error"] = repr(error)
            print(json.dumps({kind: repr(error)}), flush=True)
    times: dict[str, list[float]] = {kind: [] for kind in graphs}
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(5):
        for kind, g in graphs.items():
            for _ in range(10):
                g.replay()
            start.record()
            for _ in range(200):
                g.replay()
            stop.record()
            stop.synchronize()
            times[kind].append(start.elapsed_time(stop) / 200 * 1e3)
    rec["us_per_replay"] = {kind: sorted(v) for kind, v in times.items()}
    print(json.dumps(rec), flush=True)

    # The body runs when pred is True: one heavy row's output against the plain graph's.
    flag_rows[0] = True
    checks = {}
    try:
        plain, cond = capture("plain"), capture("if_node")
        u16 = y.view(cp.uint16)
        u16.fill(0x7FC0)
        plain.replay()
        torch.cuda.synchronize()
        want = u16[5].copy()
        for value in (True, False):
            pred.fill_(value)
            u16.fill(0x7FC0)
            cond.replay()
            torch.cuda.synchronize()
            got = u16[5]
            checks[str(value)] = {
                "row_equal_plain": bool(cp.array_equal(got, want)),
                "row_unwritten": bool((got == 0x7FC0).all()),
            }
    except Exception as error:  # noqa: BLE001
        checks["error"] = repr(error)
    rec["checks"] = checks
    rec["check_ok"] = bool(
        checks.get("True", {}).get("row_equal_plain")
        and checks.get("False", {}).get("row_unwritten")
    )
    print(json.dumps(rec), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rec, indent=1))
    if not np.isfinite(list(times.get("plain", [np.nan]))).all():
        raise SystemExit("no plain timing")


if __name__ == "__main__":
    main()
