"""The decode route at 8-64 tokens, piece by piece, against what reading its bytes costs:
µs per call replayed from a CUDA graph, weights rotated over sets that exceed L2 (read
from DRAM) and L2-warm (one set).

- ``route``: ``decode_units.forward`` with its default gate (what twell runs) and dense
  math (cuBLAS), for reference;
- ``gate_up``: the wgmma gate kernel alone (the gate, then the up products of the kept
  pairs: ``h`` and the masks; the route's first kernel from 17 tokens, where the
  mma.sync kernel gives way), ``gate_only``: the same kernel writing the gate's
  pre-activation and stopping (``wgmma_pre``), ``gate_cublas``: cuBLAS's GEMM;
- ``down``: the route's down kernel alone, on the masks and ``h`` of the first kernel
  (its rows rotate over four sets, ~25 MB at M=64: mostly from L2);
- ``read_gate``: a plain kernel reading ``w_first``'s 23 MB once (16-byte loads, every SM
  busy); ``read_rows``: one reading the ``w_up`` and ``w_down_t`` rows of the units that
  any token keeps (4 KB each, a warp a row), the bytes the up products and the down
  projection cannot avoid (four sets rotate 7-50 MB: partly from L2, a lower bound).

Checks the route against float64 dense math and for run-to-run bits first.

    PYTHONPATH=. python bench/dev_gate_floor.py [--M 8 32 64] [--out gate_floor.json]
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

_READS = cp.RawModule(
    code=r"""
extern "C" __global__ void read_once(const uint4* __restrict__ p, long long n, unsigned* out) {
  unsigned acc = 0;
  const long long step = (long long)gridDim.x * blockDim.x;
#pragma unroll 4
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += step) {
    const uint4 v = __ldg(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) out[0] = acc;  // keeps the loads; (almost) never stores
}
// rows[ids[i]] of two [N, row16] matrices, one warp a row of each
extern "C" __global__ void read_rows(const uint4* __restrict__ a, const uint4* __restrict__ b,
                                     const int* __restrict__ ids, int count, int row16,
                                     unsigned* out) {
  unsigned acc = 0;
  const int lane = threadIdx.x & 31;
  const int warps = gridDim.x * (blockDim.x / 32);
  for (int w = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; w < 2 * count; w += warps) {
    const uint4* row = (w < count ? a : b) + (long long)ids[w % count] * row16;
#pragma unroll 4
    for (int i = lane; i < row16; i += 32) {
      const uint4 v = __ldg(row + i);
      acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
  }
  if (acc == 0x9e3779b9u) out[0] = acc;
}
""",
)


def run(workload: str, m: int) -> list[dict]:
    problems = [make_problem(workload, m, K, N, seed=s) for s in range(SETS)]
    x = to_device(problems[0].x)
    blocks = fused_blocks(problems)
    p0 = problems[0]
    ref = ffn_dense(p0.x, p0.w_gate, p0.w_up, p0.w_down)
    out = []

    def record(name: str, fn, **extra: object) -> None:  # noqa: ANN001
        warm = graph_ms_cupy(lambda: fn(blocks[0]), reps=50) * 1e3
        rotated = graph_ms_cupy(lambda: [fn(b) for b in blocks], reps=30) * 1e3 / SETS
        r = {"workload": workload, "M": m, "variant": name, "warm_us": warm,
             "rotated_us": rotated, **extra}  # fmt: skip
        out.append(r)
        print(json.dumps(r), flush=True)

    def dense(b):  # noqa: ANN001, ANN202
        y = empty_bf16((m, K))
        return [y, *pipeline.dense_block(b, x, y)]

    def route(b):  # noqa: ANN001, ANN202
        y = empty_bf16((m, K))
        return [y, *decode_units.forward(x, b.w_first, b.w_up, b.w_down_t, y)]

    for name, fn in (("dense", dense), ("route", route)):
        y = fn(blocks[0])[0]
        again = fn(blocks[0])[0]
        same = bool(cp.array_equal(y.view(cp.uint16), again.view(cp.uint16)))
        record(name, fn, rel_err=relative_error(y, ref), deterministic=same)

    # the wgmma kernels one at a time, in the route's geometry (its own above MMA_GATE_TOKENS)
    ut, stages = decode_units.WGMMA_UNIT_TILES, decode_units.WGMMA_STAGES
    units = 16 * ut
    smem = decode_units.wgmma_shared_bytes(units, stages)
    module = {"KDIM": K, "GATED": 1, "NT": decode_units.token_tiles(m), "UT": ut, "DC": 16,
              "STAGES": stages}  # fmt: skip
    kernels = {
        pre: decode_units.SOURCE.kernel("twell_units_gate_wgmma", **module, PRE=pre)
        for pre in (0, 1)
    }
    for fn in kernels.values():
        fn.max_dynamic_shared_size_bytes = max(fn.max_dynamic_shared_size_bytes, smem)
    null = np.uint64(0)
    state = {}

    def gate_kernel(pre: int):  # noqa: ANN202
        def call(b):  # noqa: ANN001, ANN202
            h = alloc((m, N), np.float32)
            masks = alloc((m, N // 16), np.uint16)
            p = alloc((m, N), np.uint16) if pre else None
            kernels[pre](
                (N // units,), (256,),
                (tensor_map(x, m), tensor_map(b.w_first, units), x.view(cp.uint16),
                 b.w_up.view(cp.uint16), b.w_down_t.view(cp.uint16),
                 null if p is None else p, h, masks, np.int32(m), np.int32(N)),
                shared_mem=smem,
            )  # fmt: skip
            state[id(b)] = (h, masks)
            return [h, masks] if p is None else [p]

        return call

    record("gate_up", gate_kernel(0))
    record("gate_only", gate_kernel(1))
    record("gate_cublas", lambda b: gemm_nt(x, b.w_first))

    for b in blocks:  # h and the masks of each set, for the down kernel alone
        gate_kernel(0)(b)
    threads = decode_units.scan_threads_for(m)
    scan = decode_units.SOURCE.kernel(f"twell_units_down_scan{threads}", **module, PRE=0)

    def down(b):  # noqa: ANN001, ANN202
        h, masks = state[id(b)]
        y = empty_bf16((m, K))
        scan((-(-K // 32), m), (threads,),
             (masks.view(cp.uint32), h, b.w_down_t.view(cp.uint16), y.view(cp.uint16),
              np.int32(m), np.int32(N)))  # fmt: skip
        return [y]

    record("down", down)

    sink = cp.zeros(1, cp.uint32)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    read_once, read_rows = _READS.get_function("read_once"), _READS.get_function("read_rows")

    def read_gate(b):  # noqa: ANN001, ANN202
        w = b.w_first.view(cp.uint16)
        read_once((sms * 8,), (256,), (w, np.int64(w.size // 8), sink))
        return [sink]

    record("read_gate", read_gate, bytes=N * K * 2)
    kept = {}
    for b in blocks:  # the units any token keeps (the gate kernel's masks)
        bits = np.unpackbits(state[id(b)][1].get().view(np.uint8), axis=1, bitorder="little")
        kept[id(b)] = cp.asarray(np.flatnonzero(bits.any(axis=0)).astype(np.int32))

    def rows(b):  # noqa: ANN001, ANN202
        ids = kept[id(b)]
        read_rows((sms * 8,), (256,),
                  (b.w_up.view(cp.uint16), b.w_down_t.view(cp.uint16), ids, np.int32(ids.size),
                   np.int32(K // 8), sink))  # fmt: skip
        return [sink]

    count = int(kept[id(blocks[0])].size)
    record("read_rows", rows, units=count, bytes=2 * count * K * 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--M", nargs="+", type=int, default=[8, 32, 64])
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
