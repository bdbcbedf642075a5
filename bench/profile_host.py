"""Where the host time of one SparseFFN call goes (cProfile over many calls, torch
tensors, M tokens, 64 by default), beside the dense torch block's host time; and, above
the graph wrapper's bound (``twell._graphs.GRAPH_TOKENS``, where a call launches eagerly),
how long a call's host work runs before its gate GEMM is launched: time the GPU idles in
a single eager call.

    PYTHONPATH=. python bench/profile_host.py [--M 64]
"""

import argparse
import cProfile
import pstats
import time

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812

import twell
from twell import _graphs, workloads
from twell.kernels import cublas, gate_gemm, pipeline


def per_call_us(fn, calls: int = 300) -> float:  # noqa: ANN001
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def host_us(fn, calls: int = 8, repeats: int = 5, pick=min) -> float:  # noqa: ANN001
    """Host time per call with the GPU held busy: ``calls`` calls are queued behind a long
    GPU sleep, so the GPU is never what the host waits for; ``pick`` (the least by
    default) of ``repeats`` rounds. A call that synchronises with the GPU would wait out
    the sleep: that raises. (Keep calls x launches per call under the launch queue's
    depth, about 1000.)"""
    for _ in range(3):
        fn()
    rounds = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        torch.cuda._sleep(1_000_000_000)  # about 0.5 s of GPU clock cycles
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed = time.perf_counter() - start
        torch.cuda.synchronize()
        if elapsed > 0.3:
            raise RuntimeError(f"{fn}: {elapsed:.2f} s behind a GPU sleep: it synchronises")
        rounds.append(elapsed / calls * 1e6)
    return pick(rounds)


def until_gate_us(fn, calls: int = 20) -> float:  # noqa: ANN001
    """Median host time from a call's start to its gate GEMM's launch (cuBLAS or
    gate_gemm.cu), the GPU idle before."""
    marks: list[float] = []
    saved = gate_gemm.launch, cublas.gemm_nt, pipeline.gemm_nt

    def mark(real):  # noqa: ANN001, ANN202
        def wrapped(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            marks.append(time.perf_counter())
            return real(*args, **kwargs)

        return wrapped

    gate_gemm.launch, cublas.gemm_nt, pipeline.gemm_nt = (mark(f) for f in saved)
    try:
        times = []
        for _ in range(calls):
            torch.cuda.synchronize()
            marks.clear()
            start = time.perf_counter()
            fn()
            if marks:
                times.append((marks[0] - start) * 1e6)
        torch.cuda.synchronize()
    finally:
        gate_gemm.launch, cublas.gemm_nt, pipeline.gemm_nt = saved
    return float(np.median(times)) if times else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--M", type=int, default=64)
    m = parser.parse_args().M
    p = workloads.uniform(m, 2048, 5632, seed=0)
    x, wg, wu, wd = (torch.from_numpy(a.astype(np.float32)).cuda().bfloat16() for a in p.arrays())
    block = twell.SparseFFN(wg, wu, wd)
    dense = lambda: F.linear(F.relu(F.linear(x, wg)) * F.linear(x, wu), wd)  # noqa: E731
    functional = lambda: twell.ffn(x, wg, wu, wd)  # noqa: E731
    for name, fn in (("SparseFFN", lambda: block(x)), ("twell.ffn", functional),
                     ("dense torch", dense)):  # fmt: skip
        print(f"M={m} {name} host {per_call_us(fn):.1f} us per call in a loop, "
              f"{host_us(fn):.1f} us behind a GPU sleep")  # fmt: skip
    if m > _graphs.GRAPH_TOKENS:  # below, a call replays a graph: no launch to time
        print(f"M={m} SparseFFN: {until_gate_us(lambda: block(x)):.1f} us from the call to "
              "the gate GEMM's launch")  # fmt: skip
    calls = 300 if m <= _graphs.GRAPH_TOKENS else 40  # large M: stay within the launch queue
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)  # the GPU busy: no launch waits for it
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        block(x)
    profile.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profile)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:30]  # by own time
    print(f"{'calls/call':>10} {'own us/call':>12} {'cum us/call':>12}  function")
    for (path, line, name), (_, ncalls, own, cum, _) in rows:
        print(f"{ncalls / calls:>10.1f} {own / calls * 1e6:>12.1f} {cum / calls * 1e6:>12.1f}"
              f"  {path.split('/')[-1]}:{line}({name})")  # fmt: skip


if __name__ == "__main__":
    main()
