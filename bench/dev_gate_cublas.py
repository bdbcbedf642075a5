"""The gate GEMM as twell runs it (``torch.mm``, bf16, [M, K] x [N, K]^T) replayed from
a CUDA graph over weight sets that exceed L2 (µs per GEMM), and the kernels cuBLAS
launches for it (torch profiler over a replay: names, durations, gaps). Run it once with the default
environment and once with ``CUBLAS_WORKSPACE_CONFIG=:0:0`` (no workspace: cuBLAS may not
pick kernels that need one) to see what the workspace-using kernels cost.

    PYTHONPATH=. python bench/dev_gate_cublas.py [--M 64 2048 4096] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from twell.benchmark import gpu_name
from twell.sweeps import graph_ms, graph_of

K, N, SETS = 2048, 5632, 4


def kernels(graph: torch.cuda.CUDAGraph) -> list[list]:
    """(name, µs, gap before it in µs) of the kernels and memsets of one replay."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    events = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )
    out, end = [], None
    for e in events:
        gap = 0.0 if end is None else e.time_range.start - end
        out.append([e.name[:60], round(e.time_range.elapsed_us(), 2), round(gap, 2)])
        end = e.time_range.end
    return out


def run(m: int) -> dict:
    x = torch.randn(m, K, device="cuda").bfloat16()
    ws = [torch.randn(N, K, device="cuda").bfloat16() for _ in range(SETS)]
    outs = [torch.empty(m, N, device="cuda", dtype=torch.bfloat16) for _ in range(SETS)]

    def gemm(i: int) -> torch.Tensor:
        return torch.mm(x, ws[i].t(), out=outs[i])

    graph, _ = graph_of(gemm, SETS)
    r = {"M": m, "workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
         "gemm_us": graph_ms(gemm, SETS) * 1e3, "kernels": kernels(graph)}  # fmt: skip
    print(json.dumps(r), flush=True)
    return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--M", nargs="+", type=int, default=[64, 2048, 4096])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    records = [run(m) for m in args.M]
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": gpu_name(), "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
