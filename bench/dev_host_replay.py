"""Host time of a replayed SparseFFN call (torch tensors), the current code against the
same code with the replay path's earlier calls put back (``torch.cuda.current_stream``
for the stream, the public capture check, an uncached ``pipeline.crossover``, an eager
refresh call every 64th instead of every 256th): rounds
alternate in one process, each a loop of calls queued behind a GPU sleep so the GPU
never sets the time; medians of the rounds, µs per call; dense torch beside them.

    PYTHONPATH=. python bench/dev_host_replay.py [--M 1 8 64 256 2048] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics

import torch
import torch.nn.functional as F  # noqa: N812

import twell
from bench.profile_host import host_us  # calls queued behind a GPU sleep
from twell import _graphs
from twell.benchmark import gpu_name, versions
from twell.kernels import pipeline
from twell.sweeps import torch_problem


@contextlib.contextmanager
def earlier_calls(block: twell.SparseFFN):  # noqa: ANN201
    graphed = block._graphed
    saved = (_graphs._raw_stream, _graphs._capturing, pipeline.crossover, _graphs.REFRESH,
             graphed.measure)  # fmt: skip
    _graphs._raw_stream = lambda device: torch.cuda.current_stream(device).cuda_stream
    _graphs._capturing = torch.cuda.is_current_stream_capturing
    pipeline.crossover = pipeline.crossover.__wrapped__
    _graphs.REFRESH, graphed.measure = 64, lambda: None  # an eager call every 64th
    try:
        yield
    finally:
        (_graphs._raw_stream, _graphs._capturing, pipeline.crossover, _graphs.REFRESH,
         graphed.measure) = saved  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--M", type=int, nargs="+", default=[1, 8, 64, 256, 2048])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    records = []
    for m in args.M:
        _, x, ws, _ = torch_problem("uniform", m, 2048, 5632)
        wg, wu, wd = ws[0]
        block = twell.SparseFFN(wg, wu, wd)

        def dense(x=x, wg=wg, wu=wu, wd=wd) -> torch.Tensor:  # noqa: ANN001
            return F.linear(F.relu(F.linear(x, wg)) * F.linear(x, wu), wd)

        def ours(x=x, block=block) -> torch.Tensor:  # noqa: ANN001
            return block(x)

        y = ours()
        with earlier_calls(block):
            same = torch.equal(ours().view(torch.int16), y.view(torch.int16))
        times: dict[str, list[float]] = {"now": [], "earlier": [], "dense": []}
        for _ in range(args.rounds):
            # 256 calls of a graph replay and two copies, 128 of dense's six launches:
            # under the launch queue's depth of about 1000
            times["now"].append(host_us(ours, calls=256, repeats=1))
            with earlier_calls(block):
                times["earlier"].append(host_us(ours, calls=256, repeats=1))
            times["dense"].append(host_us(dense, calls=128, repeats=1))
        r = {"M": m, "bits_equal": same, **{f"host_us_{k}": statistics.median(v)
                                            for k, v in times.items()},
             "rounds": times}  # fmt: skip
        print(json.dumps({k: v for k, v in r.items() if k != "rounds"}), flush=True)
        records.append({**r, "gpu": gpu_name(), **versions()})
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
