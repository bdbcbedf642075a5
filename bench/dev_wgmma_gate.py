"""The decode route's gate on wgmma (decode_units.cu, ``twell_units_gate_wgmma``: TMA ring,
wgmma, the up products in the same kernel) against the route's other gates (the
mma.sync gate/up kernel, measured up to 32 tokens; cuBLAS's GEMM) and dense cuBLAS math: µs
per block call replayed from a CUDA graph, weights L2-warm (one set) and rotated over
sets that exceed L2 (read from DRAM); and the gate GEMM alone (cuBLAS against the wgmma
kernel writing the pre-activation). Checks every variant against float64 dense math and
for run-to-run bits first.

    PYTHONPATH=. python bench/dev_wgmma_gate.py [--M 8 32 64] [--out wgmma_gate.json]
"""

from __future__ import annotations

import argparse
import json

import cupy as cp
import numpy as np
import torch  # noqa: F401 - the cuBLAS gate GEMM is captured through torch

from twell.benchmark import fused_blocks, gpu_name, graph_ms_cupy, make_problem, to_device
from twell.kernels import decode_units, pipeline
from twell.kernels.buffers import alloc, empty_bf16
from twell.kernels.cublas import gemm_nt
from twell.kernels.gate_gemm import tensor_map
from twell.reference.forward import ffn_dense
from twell.testing.asserts import relative_error

SETS = 4  # 4 x 69 MB of weights: far past the 50 MB of L2
K, N = 2048, 5632


def variants(m: int) -> list[tuple[str, dict]]:
    out = [("cublas", {"gate": "cublas"})]
    if m <= 32:
        out.append(("mma", {"gate": "mma"}))
    for ut, stages in GEOMETRIES:
        out.append((f"wgmma_ut{ut}_s{stages}", {"gate": "wgmma", "ut": ut, "stages": stages}))
    return out


#: (UT, stages) of the wgmma gate measured
GEOMETRIES = ((4, 6), (4, 8), (2, 6), (2, 8), (1, 6))


def run(workload: str, m: int) -> list[dict]:
    problems = [make_problem(workload, m, K, N, seed=s) for s in range(SETS)]
    x = to_device(problems[0].x)
    blocks = fused_blocks(problems)
    p0 = problems[0]
    ref = ffn_dense(p0.x, p0.w_gate, p0.w_up, p0.w_down)

    def dense(b):  # noqa: ANN001, ANN202
        y = empty_bf16((m, K))
        return [y, *pipeline.dense_block(b, x, y)]

    def route(**kw: object):  # noqa: ANN202
        def call(b):  # noqa: ANN001, ANN202
            y = empty_bf16((m, K))
            return [y, *decode_units.forward(x, b.w_first, b.w_up, b.w_down_t, y, **kw)]

        return call

    out = []
    for name, fn in [("dense", dense)] + [(n, route(**kw)) for n, kw in variants(m)]:
        y = fn(blocks[0])[0]
        err = relative_error(y, ref)
        again = fn(blocks[0])[0]
        same = bool(cp.array_equal(y.view(cp.uint16), again.view(cp.uint16)))
        warm = graph_ms_cupy(lambda fn=fn: fn(blocks[0]), reps=50) * 1e3
        rotated = graph_ms_cupy(lambda fn=fn: [fn(b) for b in blocks], reps=30) * 1e3 / SETS
        record = {"workload": workload, "M": m, "variant": name, "warm_us": warm,
                  "rotated_us": rotated, "rel_err": err, "deterministic": same}  # fmt: skip
        out.append(record)
        print(json.dumps(record), flush=True)

    # the gate GEMM alone: cuBLAS against the wgmma kernel writing the pre-activation
    def cublas_gate(b):  # noqa: ANN001, ANN202
        return gemm_nt(x, b.w_first)

    def wgmma_gate(ut: int, stages: int):  # noqa: ANN202
        module = {"KDIM": K, "GATED": 1, "NT": decode_units.token_tiles(m), "UT": ut, "DC": 16,
                  "PRE": 1, "STAGES": stages}  # fmt: skip
        fn = decode_units.SOURCE.kernel("twell_units_gate_wgmma", **module)
        smem = decode_units.wgmma_shared_bytes(16 * ut, stages)
        fn.max_dynamic_shared_size_bytes = max(fn.max_dynamic_shared_size_bytes, smem)

        def call(b):  # noqa: ANN001, ANN202
            pre = alloc((m, N), np.uint16)
            null = np.uint64(0)
            fn((N // (16 * ut),), (256,),
               (tensor_map(x, m), tensor_map(b.w_first, 16 * ut), x.view(cp.uint16), null,
                null, pre, null, null, np.int32(m), np.int32(N)), shared_mem=smem)  # fmt: skip
            return pre

        return call

    want = cublas_gate(blocks[0]).view(cp.uint16)
    gates = [("gate_cublas", cublas_gate)]
    gates += [(f"gate_wgmma_ut{ut}_s{s}", wgmma_gate(ut, s)) for ut, s in GEOMETRIES]
    for name, fn in gates:
        got = fn(blocks[0]).view(cp.uint16)
        differ = int((got != want).sum())
        warm = graph_ms_cupy(lambda fn=fn: fn(blocks[0]), reps=50) * 1e3
        rotated = graph_ms_cupy(lambda fn=fn: [fn(b) for b in blocks], reps=30) * 1e3 / SETS
        record = {"workload": workload, "M": m, "variant": name, "warm_us": warm,
                  "rotated_us": rotated, "bits_differing_from_cublas": differ}  # fmt: skip
        out.append(record)
        print(json.dumps(record), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--M", nargs="+", type=int, default=[1, 8, 16, 24, 32, 48, 64])
    ap.add_argument("--workload", default="uniform")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    records = []
    for m in args.M:
        records += run(args.workload, m)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": gpu_name(), "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
