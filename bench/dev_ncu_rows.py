"""A driver for Nsight Compute: one SparseFFN call per batch size on the `uniform`
workload (K=2048, N=5632), each call's kernels bracketed by an NVTX range named
``M<m>`` so that ``ncu --nvtx --nvtx-include "M2048/"`` picks one size.

    ncu --nvtx --nvtx-include "M2048/" --section SpeedOfLight ... \\
        python bench/dev_ncu_rows.py --M 2048
"""

from __future__ import annotations

import argparse

import torch

import twell
from twell.sweeps import torch_problem


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--M", type=int, nargs="+", default=[2048])
    parser.add_argument("--workload", default="uniform")
    parser.add_argument("--path", default="fused", help="SparseFFN's path option")
    args = parser.parse_args()
    for m in args.M:
        _, x, ws, _ = torch_problem(args.workload, m, 2048, 5632)
        block = twell.SparseFFN(*ws[0], path=args.path)
        block(x)  # compile and capture, measure the density
        torch.cuda.synchronize()
        block(x)  # the statistics taken in: the range's call replays the graph it keys
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push(f"M{m}")
        block(x)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()


if __name__ == "__main__":
    main()
