"""Host time of a replayed `SparseFFN` call (torch tensors, `uniform`), for comparing two
trees of twell in one device call: run it once per tree with that tree first on
PYTHONPATH and compare the JSON lines. µs per call: behind a GPU sleep (the GPU never
what the host waits for; the least and the median of ``--repeats`` rounds of ``--calls``
calls) and in a plain loop.

    PYTHONPATH=<tree>:. python bench/dev_host_ab.py [--M 1 64 2048 4096] [--tag NAME]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

import twell
from bench.profile_host import host_us, per_call_us
from twell import workloads


def allocation_us(calls: int = 2000) -> dict[str, float]:
    """µs per allocation of a [2048, 2048] bf16 output, three ways (freed at once, as a
    loop that drops its output frees it)."""
    x = torch.empty((2048, 2048), dtype=torch.bfloat16, device="cuda")
    shape, dtype = (2048, 2048), torch.bfloat16
    ways = {
        "torch.empty(device=x.device)": lambda: torch.empty(shape, dtype=dtype, device=x.device),
        "x.new_empty": lambda: x.new_empty(shape, dtype=dtype),
        "torch.empty(device=index)": lambda: torch.empty(shape, dtype=dtype, device=0),
    }
    out = {}
    for _ in range(2):
        for name, fn in ways.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            out[name] = (time.perf_counter() - start) / calls * 1e6
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--M", type=int, nargs="+", default=[1, 64, 2048, 4096])
    parser.add_argument("--tag", default="")
    parser.add_argument("--calls", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(json.dumps({"tag": args.tag, "allocation_us": allocation_us()}), flush=True)
    for m in args.M:
        p = workloads.uniform(m, 2048, 5632, seed=0)
        x, wg, wu, wd = (
            torch.from_numpy(a.astype(np.float32)).cuda().bfloat16() for a in p.arrays()
        )
        block = twell.SparseFFN(wg, wu, wd)
        for _ in range(3):  # the graph captured (the second call of a large batch)
            block(x)
        call = lambda block=block, x=x: block(x)  # noqa: E731
        rec = {"tag": args.tag, "twell": twell.__file__, "M": m, "calls": args.calls,
               "repeats": args.repeats,
               "host_sleep_us": host_us(call, args.calls, args.repeats),
               "host_sleep_median_us": host_us(call, args.calls, args.repeats, statistics.median),
               "host_loop_us": per_call_us(call),
               "captures": block._graphed.captures}  # fmt: skip
        print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
