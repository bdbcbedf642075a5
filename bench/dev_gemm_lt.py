"""The prefill route's gate GEMM (``x [M, K] @ w [N, K].T``, bf16 out) through the ways
torch reaches cuBLAS: ``torch.mm`` (what ``cublas.gemm_nt`` runs for torch callers),
``F.linear`` with a zero bias (cuBLASLt's bias epilogue), ``torch.addmm`` on a zero bias
row, and ``torch.mm`` with cuBLASLt preferred (``torch.backends.cuda.preferred_blas_library``):
µs per GEMM replayed from a CUDA graph, weights rotated over four sets (DRAM) or one
(L2-warm); the kernels each way launches (torch profiler); whether each way's bits equal
``torch.mm``'s.

    PYTHONPATH=. python bench/dev_gemm_lt.py [--M 128 2048 4096] [--out gemm_lt.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F  # noqa: N812

from twell.benchmark import gpu_name

SETS = 4
K, N = 2048, 5632


def graph_us(fn, reps: int = 30) -> float:  # noqa: ANN001
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        keep = fn()
    times = []
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for i in range(5 + reps):
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        if i >= 5:
            times.append(start.elapsed_time(stop) * 1e3)
    del keep
    return statistics.median(times)


def kernels(fn) -> list[str]:  # noqa: ANN001
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def run(m: int) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, K, device="cuda", generator=g).bfloat16()
    ws = [torch.randn(N, K, device="cuda", generator=g).bfloat16() * 0.02 for _ in range(SETS)]
    zero = torch.zeros(N, device="cuda", dtype=torch.bfloat16)
    zero_row = zero.expand(m, N)

    def lt_mm(w):  # noqa: ANN001, ANN202
        previous = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library("cublaslt")
        try:
            return torch.mm(x, w.t())
        finally:
            torch.backends.cuda.preferred_blas_library(previous)

    ways = {
        "torch_mm": lambda w: torch.mm(x, w.t()),
        "linear_zero_bias": lambda w: F.linear(x, w, zero),
        "addmm_zero_row": lambda w: torch.addmm(zero_row, x, w.t()),
        "mm_cublaslt": lt_mm,
    }
    want = ways["torch_mm"](ws[0])
    out = []
    for name, fn in ways.items():
        try:
            got = fn(ws[0])
            same = bool(torch.equal(got.view(torch.int16), want.view(torch.int16)))
            err = float((got.float() - want.float()).norm() / want.float().norm())
            warm = graph_us(lambda fn=fn: fn(ws[0]))
            rotated = graph_us(lambda fn=fn: [fn(w) for w in ws]) / SETS
            names = kernels(lambda fn=fn: fn(ws[0]))
        except Exception as error:  # noqa: BLE001 - a way torch refuses is a result too
            r = {"M": m, "way": name, "error": f"{type(error).__name__}: {error}"}
        else:
            r = {"M": m, "way": name, "warm_us": warm, "rotated_us": rotated,
                 "same_bits_as_mm": same, "rel_diff": err, "kernels": names}  # fmt: skip
        out.append(r)
        print(json.dumps(r), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--M", nargs="+", type=int, default=[2048, 4096])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    records = []
    for m in args.M:
        records += run(m)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": gpu_name(), "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
