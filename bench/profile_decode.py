"""Where the GPU time of a small-batch `SparseFFN` call goes: its kernels (torch.profiler,
CUDA activity) for M = 1 ... 512, beside the dense torch block's, and the whole call
replayed in the user's own CUDA graph.

    PYTHONPATH=. python bench/profile_decode.py [--M 1 64 512]
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812

import twell
from twell import workloads


def kernels(fn, calls: int = 20) -> list[tuple[str, float, int]]:  # noqa: ANN001
    """(name, µs per call, launches per call) of the CUDA kernels of ``fn``."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = [
        (e.key[:70], e.self_device_time_total / calls, e.count // calls)
        for e in prof.key_averages()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0
    ]
    return sorted(rows, key=lambda r: -r[1])


def graph_us(fn, reps: int = 200) -> float:  # noqa: ANN001
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(10):
        graph.replay()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / reps * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--M", nargs="+", type=int, default=[1, 64, 512])
    p.add_argument("--out", default=None, help="JSON records (one per M and block)")
    args = p.parse_args()
    records = []
    for m in args.M:
        prob = workloads.uniform(m, 2048, 5632, seed=0)
        x, wg, wu, wd = (
            torch.from_numpy(a.astype(np.float32)).cuda().bfloat16() for a in prob.arrays()
        )
        block = twell.SparseFFN(wg, wu, wd)
        dense = lambda x=x, wg=wg, wu=wu, wd=wd: F.linear(  # noqa: E731
            F.relu(F.linear(x, wg)) * F.linear(x, wu), wd
        )
        for name, fn in (("twell", lambda block=block, x=x: block(x)), ("dense", dense)):
            rows = kernels(fn)
            total, launches = sum(r[1] for r in rows), sum(r[2] for r in rows)
            graph = graph_us(fn)
            print(f"M={m} {name}: kernels {total:.1f} us per call in {launches} launches; "
                  f"in a CUDA graph {graph:.1f} us")  # fmt: skip
            for key, us, count in rows:
                print(f"    {us:8.2f} us x{count:<3} {key}")
            records.append({
                "gpu": torch.cuda.get_device_name(), "M": m, "block": name,
                "kernels_us": total, "launches": launches, "graph_us": graph,
                "kernels": [{"name": k, "us": us, "count": c} for k, us, c in rows],
            })  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
