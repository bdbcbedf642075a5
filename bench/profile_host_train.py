"""Host time of the training ops (``twell.autograd.ffn_train`` forward + backward) on torch
tensors, with a batch small enough that the GPU is never the bottleneck, and where it goes
(cProfile), beside the dense torch block's forward + backward.

    PYTHONPATH=. python bench/profile_host_train.py [--M 2048 --K 1024 --N 2816]
"""

import argparse
import cProfile
import pstats
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_host import host_us, per_call_us  # noqa: E402

from twell import autograd, workloads
from twell.autograd import ffn_train
from twell.options import Options


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--M", type=int, default=2048)
    p.add_argument("--K", type=int, default=1024)
    p.add_argument("--N", type=int, default=2816)
    p.add_argument("--calls", type=int, default=100)
    args = p.parse_args()
    prob = workloads.uniform(args.M, args.K, args.N, seed=0)
    x, wg, wu, wd = (torch.from_numpy(a.astype(np.float32)).cuda() for a in prob.arrays())
    options = Options()
    for label, dtype in (("bf16 weights", torch.bfloat16), ("fp32 weights, autocast", None)):
        ws = [w.to(dtype or torch.float32).requires_grad_() for w in (wg, wu, wd)]
        xb = x.bfloat16().requires_grad_()
        dy = torch.randn_like(xb)

        def step(ws=ws, xb=xb, dy=dy, autocast=dtype is None) -> None:  # noqa: ANN001
            with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
                y, l1, _ = ffn_train(xb, *ws, options, "per_token")
            torch.autograd.backward((y, l1), (dy, torch.ones_like(l1)))

        def dense(ws=ws, xb=xb, dy=dy, autocast=dtype is None) -> None:  # noqa: ANN001
            with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
                y = F.linear(F.relu(F.linear(xb, ws[0])) * F.linear(xb, ws[1]), ws[2])
            y.backward(dy)

        def step_graphs(ws=ws, xb=xb, dy=dy, autocast=dtype is None) -> None:  # noqa: ANN001
            with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
                y, l1, _ = ffn_train(xb, *ws, options, "per_token", graphs=True)
            torch.autograd.backward((y, l1), (dy, torch.ones_like(l1)))

        fw, bw = autograd._FORWARD_GRAPHS, autograd._BACKWARD_GRAPHS
        print(
            f"[{label}] with op graphs: {per_call_us(step_graphs, args.calls):.0f} us per "
            f"step; with the GPU held busy {host_us(step_graphs):.0f} us (graphs captured / "
            f"replayed: forward {fw.captures}/{fw.replays}, backward {bw.captures}/{bw.replays})"
        )
        print(
            f"[{label}] twell fwd+bwd host {per_call_us(step, args.calls):.0f} us per step; "
            f"dense torch {per_call_us(dense, args.calls):.0f} us; with the GPU held busy: "
            f"twell {host_us(step):.0f} us, dense {host_us(dense):.0f} us"
        )
        if dtype is not None:
            breakdown(xb, ws, dy, options, args.calls)
            autograd_parts(step, xb, ws, dy, options, args.calls)
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.calls):
            step()
        profile.disable()
        torch.cuda.synchronize()
        stats = pstats.Stats(profile)
        stats.sort_stats("tottime").print_stats(28)
        stats.sort_stats("cumtime").print_stats(40)


def breakdown(xb, ws, dy, options, calls) -> None:  # noqa: ANN001
    """Host time of each op alone, through torch's custom-op dispatch and called directly
    (what the dispatch adds), without autograd."""
    from twell import autograd

    settings = (options.tile, options.slots, -1, options.dense_capacity, "per_token")
    x, wg, wu, wd = xb.detach(), *(w.detach() for w in ws)
    out = autograd.ffn_train_forward(x, wg, wu, wd, *settings)
    saved = out[2:]
    one = torch.ones((), device=x.device)
    parts = {
        "forward op": lambda: autograd.ffn_train_forward(x, wg, wu, wd, *settings),
        "forward impl": lambda: autograd._forward_cuda(x, wg, wu, wd, *settings),
        "backward op": lambda: autograd.ffn_train_backward(dy, one, x, wg, wu, wd, *saved,
                                                           *settings),
        "backward impl": lambda: autograd._backward_cuda(dy, one, x, wg, wu, wd, *saved,
                                                         *settings),
    }  # fmt: skip
    for name, fn in parts.items():
        print(f"    {name}: {per_call_us(fn, calls):.0f} us per call, {host_us(fn):.0f} us of host")


def autograd_parts(step, xb, ws, dy, options, calls) -> None:  # noqa: ANN001
    """The step through autograd: its forward alone, its backward alone (retained graph)."""

    def forward() -> None:
        ffn_train(xb, *ws, options, "per_token")

    y, l1, _ = ffn_train(xb, *ws, options, "per_token")
    grads = (dy, torch.ones_like(l1))

    def backward() -> None:
        torch.autograd.backward((y, l1), grads, retain_graph=True)

    for name, fn in (("autograd forward", forward), ("autograd backward", backward)):
        print(f"    {name}: {per_call_us(fn, calls):.0f} us per call, {host_us(fn):.0f} us of host")


if __name__ == "__main__":
    main()
