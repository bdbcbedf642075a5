"""The gate GEMM through a cuBLAS handle of twell's own with no workspace (cuBLAS then
picks kernels that need no memset) against ``torch.mm`` on torch's handle: whether the
own handle's GEMM can be captured in a torch CUDA graph and a CuPy stream capture, its
bits eager and replayed, its kernels, and µs per GEMM replayed from a graph over weight
sets that exceed L2.

    PYTHONPATH=. python bench/dev_gate_handle.py [--M 64 2048 4096] [--out FILE]
"""

from __future__ import annotations

import argparse
import json

import cupy as cp
import numpy as np
import torch
from cupy_backends.cuda.libs import cublas

from bench.dev_gate_cublas import kernels
from twell.benchmark import gpu_name

K, N, SETS = 2048, 5632, 4
ONE, ZERO = np.ones(1, np.float32), np.zeros(1, np.float32)


def make_handle() -> int:
    handle = cublas.create()
    cublas.setWorkspace(handle, 0, 0)
    cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
    return handle


def own_mm(handle: int, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    m, k = x.shape
    n = w.shape[0]
    cublas.setStream(handle, torch.cuda.current_stream().cuda_stream)
    cublas.gemmEx(handle, 1, 0, n, m, k, ONE.ctypes.data, w.data_ptr(), 14, k,
                  x.data_ptr(), 14, k, ZERO.ctypes.data, out.data_ptr(), 14, n, 68, -1)  # fmt: skip


def timed(graph: torch.cuda.CUDAGraph) -> float:
    times = []
    for i in range(25):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        if i >= 5:
            times.append(start.elapsed_time(stop) * 1e3 / SETS)
    return sorted(times)[len(times) // 2]


def run(m: int, handle: int) -> list[dict]:
    x = torch.randn(m, K, device="cuda").bfloat16()
    ws = [torch.randn(N, K, device="cuda").bfloat16() for _ in range(SETS)]
    outs = [torch.empty(m, N, device="cuda", dtype=torch.bfloat16) for _ in range(SETS)]
    records = []
    for name in ("torch", "own"):

        def gemm(w, o, name=name):  # noqa: ANN001, ANN202
            if name == "torch":
                torch.mm(x, w.t(), out=o)
            else:
                own_mm(handle, x, w, o)

        for w, o in zip(ws, outs, strict=True):
            gemm(w, o)
        torch.cuda.synchronize()
        eager = outs[0].clone()
        r = {"M": m, "gemm": name}
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for w, o in zip(ws, outs, strict=True):
                    gemm(w, o)
            outs[0].fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            r["graph_bits_equal_eager"] = bool(torch.equal(outs[0].view(torch.int16),
                                                           eager.view(torch.int16)))  # fmt: skip
            r["gemm_us"] = timed(graph)
            r["kernels"] = kernels(graph)
        except Exception as error:  # noqa: BLE001 - what the capture says is the record
            r["torch_capture_error"] = repr(error)
        if name == "own":  # a CuPy stream capture of the same call
            stream = cp.cuda.Stream(non_blocking=True)
            try:
                with stream, torch.cuda.stream(torch.cuda.ExternalStream(stream.ptr)):
                    stream.begin_capture()
                    own_mm(handle, x, ws[0], outs[0])
                    g = stream.end_capture()
                    outs[0].fill_(float("nan"))
                    g.launch(stream)
                    stream.synchronize()
                r["cupy_capture_bits_equal_eager"] = bool(
                    torch.equal(outs[0].view(torch.int16), eager.view(torch.int16))
                )
            except Exception as error:  # noqa: BLE001
                r["cupy_capture_error"] = repr(error)
        records.append(r)
        print(json.dumps(r), flush=True)
    return records


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--M", nargs="+", type=int, default=[64, 2048, 4096])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    handle = make_handle()
    records = [r for m in args.M for r in run(m, handle)]
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": gpu_name(), "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
