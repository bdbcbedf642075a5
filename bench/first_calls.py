"""Seconds from a bare process until a ``SparseMLP`` of one layer shape (default K=2048,
N=5632, bf16) has run its first inference calls (M = 1, 64, 4096) and one training
forward and backward (M = 4096): what a model's first ``generate`` or training step
waits for.

Run it with a fresh ``CUPY_CACHE_DIR`` for the cold figure, again for the warm one, or
after ``python -m twell warmup --training`` (same cache directory) for the figure a
warm-up buys. Prints the total and its parts (imports and the module; the calls).
"""

import argparse
import time

start = time.perf_counter()

import torch  # noqa: E402

from twell.torch import SparseMLP  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=5632)
    args = p.parse_args()
    k, n = args.hidden, args.ffn
    torch.manual_seed(0)
    shapes = ((k, n), (k, n), (n, k))
    layers = [torch.nn.Linear(a, b, bias=False) for a, b in shapes]
    mlp = SparseMLP(*layers).cuda().bfloat16()
    built = time.perf_counter()
    with torch.no_grad():
        for m in (1, 64, 4096):
            mlp(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
    mlp.train()
    x = torch.randn(4096, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = mlp(x)
    (y.float().square().sum() + mlp.l1).backward()
    torch.cuda.synchronize()
    done = time.perf_counter()
    print(
        f"{done - start:.2f} s from process start (imports and module {built - start:.2f} s, "
        f"first calls {done - built:.2f} s)"
    )


if __name__ == "__main__":
    main()
