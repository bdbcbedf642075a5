"""Where a ``SparseFFN`` call's own CUDA graph pays (``twell._graphs.GraphedBlock``: one
launch of a graph re-pointed at the call's tensors): per call, back to back and host
time per call, with that graph path on and off (the block's eager launches), at
mid-sized batches; the dense torch block in the same run.

    PYTHONPATH=. python bench/dev_call_graphs.py [--M 512 1024 2048 4096] [--out DIR]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F  # noqa: N812

import twell
from twell.benchmark import gpu_name, versions
from twell.sweeps import back_to_back_ms, host_us, per_call_ms, torch_problem


def measure(m: int, k: int, n: int) -> list[dict]:
    """Records of M=m with the graph path on and off, twice each."""
    _, x, weights, sets = torch_problem("uniform", m, k, n)
    blocks = [twell.SparseFFN(*w) for w in weights]

    def ours(i: int) -> torch.Tensor:
        return blocks[i](x) if graphed else blocks[i]._graphed.run(x)

    def dense(i: int) -> torch.Tensor:
        wg, wu, wd = weights[i]
        return F.linear(F.relu(F.linear(x, wg)) * F.linear(x, wu), wd)

    records, outputs = [], {}
    for graphed in (True, False, True, False):  # interleaved
        for _ in range(2):
            for i in range(sets):
                ours(i)
        torch.cuda.synchronize()
        outputs[graphed] = ours(0).clone()
        r = dict(gpu=gpu_name(), M=m, K=k, N=n, workload="uniform", rotation_sets=sets,
                 graphed=graphed,
                 per_call_ms=per_call_ms(ours, sets),
                 back_to_back_ms=back_to_back_ms(ours, sets), host_us=host_us(ours, sets),
                 dense_per_call_ms=per_call_ms(dense, sets),
                 dense_back_to_back_ms=back_to_back_ms(dense, sets),
                 dense_host_us=host_us(dense, sets), **versions())  # fmt: skip
        r["speedup_per_call"] = r["dense_per_call_ms"] / r["per_call_ms"]
        r["speedup_back_to_back"] = r["dense_back_to_back_ms"] / r["back_to_back_ms"]
        records.append(r)
        print(json.dumps(r), flush=True)
    same = bool(torch.equal(outputs[True], outputs[False]))
    print(json.dumps({"M": m, "graph_and_eager_bits_equal": same}), flush=True)
    records.append({"M": m, "graph_and_eager_bits_equal": same})
    return records


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--M", nargs="+", type=int, default=[512, 1024, 2048, 4096])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    records = []
    for m in args.M:
        records += measure(m, 2048, 5632)
    if args.out:
        with open(f"{args.out}/call_graphs.json", "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
