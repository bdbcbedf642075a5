"""Kernels of SparseFFN calls alternating between two inputs at M=8 (re-pointable graph
against copies only), from the torch profiler: what runs on the GPU per call.

    PYTHONPATH=. python bench/debug_alternating.py
"""

from __future__ import annotations

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

import twell
from twell import _graphs, workloads


def main() -> None:
    p = workloads.uniform(8, 2048, 5632, seed=0)
    x, wg, wu, wd = (torch.from_numpy(a.astype(np.float32)).cuda().bfloat16() for a in p.arrays())
    xs = [x, x.clone()]
    block = twell.SparseFFN(wg, wu, wd)
    real = _graphs._try_repoint
    _graphs._try_repoint = lambda *a, **k: (None, None)
    copies = twell.SparseFFN(wg, wu, wd)
    copies(x)
    _graphs._try_repoint = real
    for name, b in (("repointable", block), ("copies", copies)):
        for i in range(10):
            b(xs[i % 2])
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for i in range(6):
                b(xs[i % 2])
            torch.cuda.synchronize()
        cuda = torch.autograd.DeviceType.CUDA
        events = sorted((e for e in prof.events() if e.device_type == cuda),
                        key=lambda e: e.time_range.start)  # fmt: skip
        t0 = events[0].time_range.start if events else 0
        print(name)
        for e in events:
            start, end = e.time_range.start - t0, e.time_range.end - t0
            print(f"  {start:9.1f} {end - start:7.1f}  {e.name[:60]}")
        g = next(iter(b._graphed._graphs.values()))
        print("  execs", [tuple(hex(v) for v in e.bases) for e in g.execs], "previous",
              [hex(v) for v in g._previous])  # fmt: skip


if __name__ == "__main__":
    main()
