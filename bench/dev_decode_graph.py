"""Kernel by kernel, what one replay of a user's CUDA graph of SparseFFN calls costs, at
decode sizes by default (``--path`` picks the light-row route; weights rotated over
sets, as in the serving sweep's graph column, so they come from DRAM): torch profiler
over one replay, kernel durations and the idle gaps between them, per call; dense
torch beside it.

    PYTHONPATH=. python bench/dev_decode_graph.py [--M 1 8 64] [--out FILE]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F  # noqa: N812
from torch.profiler import ProfilerActivity, profile

import twell
from twell.sweeps import graph_ms, graph_of, torch_problem


def replay_kernels(fn, sets: int) -> list[tuple[str, float, float]]:  # noqa: ANN001
    graph, keep = graph_of(fn, sets)
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    del keep
    ks = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    return [(name[:40], round(end - start, 2), round(start - ks[i - 1][1], 2) if i else 0.0)
            for i, (start, end, name) in enumerate(ks)]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--M", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--path", default="fused", help="SparseFFN's path option")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    records = []
    for m in args.M:
        _, x, ws, sets = torch_problem("uniform", m, 2048, 5632)
        blocks = [twell.SparseFFN(*w, path=args.path) for w in ws]

        def ours(i: int, blocks=blocks, x=x) -> torch.Tensor:  # noqa: ANN001
            return blocks[i](x)

        def dense(i: int, ws=ws, x=x) -> torch.Tensor:  # noqa: ANN001
            wg, wu, wd = ws[i]
            return F.linear(F.relu(F.linear(x, wg)) * F.linear(x, wu), wd)

        for name, fn in (("twell", ours), ("dense", dense)):
            r = {"M": m, "sets": sets, "what": name, "path": args.path,
                 "graph_ms": graph_ms(fn, sets),
                 "kernels": replay_kernels(fn, sets)}  # fmt: skip
            print(json.dumps(r), flush=True)
            records.append(r)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
