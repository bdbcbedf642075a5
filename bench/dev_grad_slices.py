"""The backward's weight-gradient kernel by K slices: time and bits for each slicing.

    PYTHONPATH=. python bench/dev_grad_slices.py --M 16384 65536 --slices 1 2 4 8

For each M (gated ``uniform`` at K=2048, N=5632 unless given): one forward with saved
state, then ``ffn_backward`` with ``backward.grad_slices`` forced to each value: the
backward back to back (median of ``--reps`` groups of 5 calls, CUDA events), the
weight-gradient kernel's own time (events around its launch, median of ``--reps``
calls), and whether its gradients have the bits of the first slicing; then the backward
with the forward's saved up products and without them (recomputed), with each kernel's
time. Writes ``$OUT/dev_grad_slices.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))

from bench_backward import events_ms, stage_times  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--M", type=int, nargs="+", default=[16384, 65536])
    parser.add_argument("--K", type=int, default=2048)
    parser.add_argument("--N", type=int, default=5632)
    parser.add_argument("--workload", default="uniform")
    parser.add_argument("--slices", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args(argv)

    from twell.benchmark import gpu_name

    result: dict[str, Any] = {"device": gpu_name(), "args": vars(args), "records": []}
    for m in args.M:
        result["records"] += measure(m, args)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "dev_grad_slices.json"), "w") as f:
        json.dump(result, f, indent=1)
    return 0


def measure(m: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    import cupy as cp

    from twell import workloads
    from twell.benchmark import to_device
    from twell.kernels import backward
    from twell.kernels.pipeline import PreparedBlock
    from twell.options import Options

    rule = backward.grad_slices
    p = getattr(workloads, args.workload)(m, args.K, args.N, seed=1)
    block = PreparedBlock(*(to_device(a) for a in (p.w_gate, p.w_up, p.w_down)), Options())
    x = to_device(p.x)
    dy = to_device(workloads.uniform(m, args.K, 8, seed=2).x)  # any bf16 [M, K]
    _, saved = block.forward(x, save=True)

    def step() -> Any:
        return backward.ffn_backward(block, x, dy, saved)

    first, records = None, []
    for s in args.slices:
        backward.grad_slices = lambda m_, k_, s=s: s
        try:
            got = step()
            same = None
            if first is None:
                first = got
            else:
                same = all(a is None or bool(cp.array_equal(a.view(cp.uint8), b.view(cp.uint8)))
                           for a, b in zip(first, got, strict=True))  # fmt: skip
            del got
            ms = events_ms(lambda i: step(), 1, 2, args.reps, calls=5)
            kernel = statistics.median(stage_times(backward, step)["twell_bw_weight_grads"]
                                       for _ in range(args.reps))  # fmt: skip
        finally:
            backward.grad_slices = rule
        rec = {"M": m, "slices": s, "rule_slices": rule(m, args.K),
               "rows_per_launch": backward.grad_rows(m, args.K, s), "backward_ms": round(ms, 4),
               "weight_grads_ms": round(kernel, 4), "bits_as_first": same}  # fmt: skip
        records.append(rec)
        print(rec, flush=True)
    # The light stage with the forward's up products and without them (recomputed).
    import dataclasses

    plain = dataclasses.replace(saved, up=None)
    for name, state in (("saved_up", saved), ("recomputed_up", plain)):
        ms = events_ms(lambda i, st=state: backward.ffn_backward(block, x, dy, st), 1, 2,
                       args.reps, calls=5)  # fmt: skip
        stages = stage_times(backward, lambda st=state: backward.ffn_backward(block, x, dy, st))
        rec = {"M": m, "up_products": name, "backward_ms": round(ms, 4), "stages_ms": stages}
        records.append(rec)
        print(rec, flush=True)
    cp.get_default_memory_pool().free_all_blocks()
    return records


if __name__ == "__main__":
    raise SystemExit(main())
