"""The training ops' CUDA graphs (``twell._graphs.OpGraphs``) re-pointed at each step's
tensors, against the same graphs replayed with copies in (the design before) and
against eager launches: a forward + backward step of ``twell.autograd.
ffn_train`` on torch tensors, new activations every step (as in training), back to back
(CUDA events) and per step (synchronised), with the host time of a step behind a GPU
sleep; the gradients' bits compared across the three.

    PYTHONPATH=. python bench/dev_op_graphs.py [--M 16384] [--K 2048] [--N 5632] [--out F]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from twell import _graphs, autograd, workloads
from twell.autograd import ffn_train
from twell.benchmark import gpu_name, versions
from twell.options import Options


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--M", type=int, default=16384)
    p.add_argument("--K", type=int, default=2048)
    p.add_argument("--N", type=int, default=5632)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out")
    args = p.parse_args()
    prob = workloads.uniform(args.M, args.K, args.N, seed=0)
    x0, wg, wu, wd = (torch.from_numpy(a.astype(np.float32)).cuda().bfloat16()
                      for a in prob.arrays())  # fmt: skip
    ws = [w.clone().requires_grad_() for w in (wg, wu, wd)]
    options = Options()
    dys = [torch.randn_like(x0) for _ in range(3)]

    def step(i: int, graphs: bool) -> list[torch.Tensor]:
        x = (x0 * (1.0 + 0.01 * (i % 3))).requires_grad_()  # a new tensor every step
        y, l1, _ = ffn_train(x, *ws, options, "per_token", graphs=graphs)
        for w in ws:
            w.grad = None
        torch.autograd.backward((y, l1), (dys[i % 3], torch.ones_like(l1)))
        return [x.grad, *(w.grad for w in ws), y]

    real = _graphs._try_repoint_op

    def copies_only(graph, args, buffers, outputs):  # noqa: ANN001, ANN202
        repointed, replayed = real(graph, args, buffers, outputs)
        if repointed is not None:
            repointed.close()
            for buffer, arg in zip(buffers, args, strict=True):
                if buffer is not None:
                    buffer.copy_(arg)  # the check poisoned the floating-point ones
        return None, replayed

    record: dict = {"gpu": gpu_name(), "M": args.M, "K": args.K, "N": args.N, **versions()}
    results = {}
    for variant in ("repointed", "copies", "eager", "repointed", "copies", "eager"):
        autograd._FORWARD_GRAPHS.clear()
        autograd._BACKWARD_GRAPHS.clear()
        _graphs._try_repoint_op = copies_only if variant == "copies" else real
        graphs = variant != "eager"
        try:
            for i in range(4):
                step(i, graphs)
            modes = [g.repointed is not None for g in autograd._FORWARD_GRAPHS._graphs.values()]
            modes += [g.repointed is not None for g in autograd._BACKWARD_GRAPHS._graphs.values()]
            torch.cuda.synchronize()
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for i in range(args.steps):
                step(i, graphs)
            end.record()
            torch.cuda.synchronize()
            b2b = begin.elapsed_time(end) / args.steps
            per = []
            for i in range(args.steps):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                step(i, graphs)
                torch.cuda.synchronize()
                per.append((time.perf_counter() - t0) * 1e3)
            torch.cuda.synchronize()
            torch.cuda._sleep(2_000_000_000)
            t0 = time.perf_counter()
            for i in range(4):
                step(i, graphs)
            host = (time.perf_counter() - t0) / 4 * 1e6
            torch.cuda.synchronize()
            grads = [t.clone() for t in step(0, graphs)]
        finally:
            _graphs._try_repoint_op = real
        timing_point = {}
        for name, ops in (
            ("forward", autograd._FORWARD_GRAPHS),
            ("backward", autograd._BACKWARD_GRAPHS),
        ):
            for g in ops._graphs.values():
                rp = g.repointed
                if rp is None:
                    continue
                bases = list(rp._bases)
                other = [b + 512 for b in bases]  # never launched: only the host cost
                t0 = time.perf_counter()
                for i in range(50):
                    rp.point(other if i % 2 == 0 else bases)
                timing_point[name] = {
                    "patched_nodes": len(rp.patched),
                    "point_us": round((time.perf_counter() - t0) / 50 * 1e6, 1),
                }
        r = {"variant": variant, "graph_modes": modes, "point": timing_point,
             "back_to_back_ms": round(b2b, 4),
             "per_step_ms": round(float(np.median(per)), 4), "host_us": round(host, 1),
             "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}  # fmt: skip
        if variant in results:
            r["bits_equal_first_run"] = all(
                torch.equal(a, b) for a, b in zip(grads, results[variant], strict=True)
            )
        results.setdefault(variant, grads)
        r["bits_equal_eager"] = None
        if "eager" in results:
            r["bits_equal_eager"] = all(
                torch.equal(a, b) for a, b in zip(grads, results["eager"], strict=True)
            )
        print(json.dumps(r), flush=True)
        record.setdefault("runs", []).append(r)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
