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
from profile_host import per_call_us  # noqa: E402

from twell import workloads
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

        print(
            f"[{label}] twell fwd+bwd host {per_call_us(step, args.calls):.0f} us per step; "
            f"dense torch {per_call_us(dense, args.calls):.0f} us"
        )
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.calls):
            step()
        profile.disable()
        torch.cuda.synchronize()
        stats = pstats.Stats(profile)
        stats.sort_stats("tottime").print_stats(28)
        stats.sort_stats("cumtime").print_stats(40)


if __name__ == "__main__":
    main()
