"""The by-unit decode route (decode_units.cu) against the per-token route it replaces at
M <= 192 and against dense cuBLAS math: µs per block call replayed from a CUDA graph,
with the weights L2-warm (one set) and rotated over sets that exceed L2, plus each of
its two kernels alone (up to MMA_GATE_TOKENS tokens, where there are two; the down
kernels by lists and by a scan). Checks every variant against float64
dense math first.

    PYTHONPATH=. python bench/dev_units.py [--M 1 8 16] [--out dev_units.json]
"""

from __future__ import annotations

import argparse
import inspect
import json

import cupy as cp
import numpy as np
import torch  # noqa: F401 - the cuBLAS gate GEMM is captured through torch

from twell.benchmark import gpu_name, graph_ms_cupy, make_problem, to_device
from twell.kernels import decode_units, pipeline
from twell.kernels.buffers import alloc, empty_bf16
from twell.kernels.compile import device_info
from twell.options import Options
from twell.reference.forward import ffn_dense
from twell.testing.asserts import relative_error

SETS = 4  # 4 x 69 MB of weights: far past the 50 MB of L2


def run(workload: str, m: int, k: int, n: int, gated: bool) -> list[dict]:
    problems = [make_problem(workload, m, k, n, seed=s) for s in range(SETS)]
    x = to_device(problems[0].x)
    blocks = [
        pipeline.PreparedBlock(
            to_device(p.w_gate) if gated else None, to_device(p.w_up), to_device(p.w_down),
            Options(path="fused", density_switch=False),
        )
        for p in problems
    ]  # fmt: skip
    p0 = problems[0]
    ref = ffn_dense(p0.x, p0.w_gate if gated else None, p0.w_up, p0.w_down)
    saved = decode_units.MAX_ROWS

    def units(b):  # noqa: ANN001, ANN202
        decode_units.MAX_ROWS = decode_units.MAX_TOKENS  # the kernels' bound, not the route's
        try:
            return b(x)
        finally:
            decode_units.MAX_ROWS = saved

    def old(b):  # noqa: ANN001, ANN202
        decode_units.MAX_ROWS = 0
        try:
            return b(x)
        finally:
            decode_units.MAX_ROWS = saved

    def dense(b):  # noqa: ANN001, ANN202
        y = empty_bf16((m, k))
        return [y, *pipeline.dense_block(b, x, y)]

    def geometry(**kw: object):  # noqa: ANN202
        def call(b):  # noqa: ANN001, ANN202
            y = empty_bf16((m, k))
            up = b.w_up if gated else None
            return [y, *decode_units.forward(x, b.w_first, up, b.w_down_t, y, **kw)]

        return call

    variants = [("units", units), ("per_token", old), ("dense", dense)]
    if 8 <= m <= 64 and k * n >= 2048 * 5632:
        variants += [("units_mma_gate", geometry(gate="mma")),
                     ("units_cublas_gate", geometry(gate="cublas"))]  # fmt: skip
    has_down = "down" in inspect.signature(decode_units.forward).parameters  # an old tree's
    if m <= 192 and has_down:
        variants += [(f"units_scan{t}", geometry(down="scan", scan_threads=t))
                     for t in (64, 128)]  # fmt: skip
        variants += [("units_lists", geometry(down="lists"))]
    lists = {"down": "lists"} if has_down else {}
    if m <= 16 and workload == "uniform" and gated and k == 2048:
        variants += [(f"units_dc{dc}", geometry(columns=dc, **lists)) for dc in (16, 32, 64)]
    if 32 <= m <= 64 and workload == "uniform" and gated and k == 2048:
        variants += [(f"units_dc{dc}", geometry(columns=dc, **lists)) for dc in (32, 64)]
    if m > 64 and workload == "uniform" and gated and k == 2048:
        variants += [
            (f"units_dc{dc}_dt{dt}", geometry(columns=dc, down_tokens=dt))
            for dc in (64, 128) for dt in (8, 16)
        ]  # fmt: skip
    out = []
    bits = {}
    for name, fn in variants:
        y = fn(blocks[0])
        y = y[0] if isinstance(y, list) else y
        bits[name] = y.view(cp.uint16).copy()
        err = relative_error(y, ref)
        again = fn(blocks[0])
        again = again[0] if isinstance(again, list) else again
        same = bool(cp.array_equal(y.view(cp.uint16), again.view(cp.uint16)))
        warm = graph_ms_cupy(lambda fn=fn: fn(blocks[0]), reps=50) * 1e3
        rotated = graph_ms_cupy(lambda fn=fn: [fn(b) for b in blocks], reps=30) * 1e3 / SETS
        out.append({"workload": workload, "M": m, "K": k, "N": n, "gated": gated,
                    "variant": name, "warm_us": warm, "rotated_us": rotated,
                    "rel_err": err, "deterministic": same})  # fmt: skip
    if "units_scan64" in bits:  # the scan's bits must not depend on its CTA size
        same = bool(cp.array_equal(bits["units_scan64"], bits["units_scan128"]))
        out.append({"workload": workload, "M": m, "variant": "scan64_bits_equal_scan128",
                    "equal": same})  # fmt: skip
    # the two kernels alone (L2-warm), where the gate kernel computes the gate
    if m > decode_units.MMA_GATE_TOKENS or not decode_units.fits(m, n, most=m):
        return out
    b = blocks[0]
    h = alloc((m, n), np.float32)
    masks = alloc((m, n // decode_units.UNITS), np.uint16)
    nt, ut = decode_units.token_tiles(m), decode_units.unit_tiles(m, n)
    nt_down = decode_units.token_tiles(min(m, decode_units.DOWN_TOKENS))
    source = decode_units.SOURCE
    sms = device_info().multiprocessors
    cols, threads = decode_units.down_columns(m, k, n, sms), decode_units.DOWN_THREADS
    kw = {"KDIM": k, "GATED": int(gated), "PRE": 0, "STAGES": 0}
    gate = source.kernel("twell_units_gate_up", NT=nt, UT=ut, DC=16, **kw)
    down = source.kernel("twell_units_down", NT=nt_down, UT=1, DC=cols, **kw)
    y = empty_bf16((m, k))
    u16 = lambda a: a.view(cp.uint16)  # noqa: E731
    gate_args = (u16(x), u16(b.w_first), u16(b.w_up) if gated else np.uint64(0),
                 u16(b.w_down_t), np.uint64(0), h, masks, np.int32(m), np.int32(n))  # fmt: skip
    shared = decode_units.down_shared_bytes(m, n, cols)
    down_args = (masks.view(cp.uint32), h, u16(b.w_down_t), u16(y), np.int32(m), np.int32(n))
    g_us = graph_ms_cupy(lambda: gate((n // (16 * ut),), (256,), gate_args), reps=50) * 1e3
    grid = (-(-k // cols), -(-m // (8 * nt_down)))
    d_us = (
        graph_ms_cupy(lambda: down(grid, (threads,), down_args, shared_mem=shared), reps=50) * 1e3
    )
    record = {"workload": workload, "M": m, "K": k, "N": n, "gated": gated,
              "variant": "kernels", "gate_up_us": g_us, "down_us": d_us}  # fmt: skip
    if has_down:
        for t in (64, 128):
            scan = source.kernel(f"twell_units_down_scan{t}", NT=1, UT=1, DC=16, **kw)
            record[f"down_scan{t}_us"] = 1e3 * graph_ms_cupy(
                lambda t=t, scan=scan: scan((-(-k // 32), m), (t,), down_args), reps=50
            )
    out.append(record)
    for r in out:
        print(json.dumps(r), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--M", nargs="+", type=int, default=[1, 8, 16, 32, 64, 96, 128, 192, 256])
    ap.add_argument("--out", default=None)
    ap.add_argument("--uniform-only", action="store_true", help="gated uniform, K=2048 only")
    ap.add_argument("--also", nargs="*", default=[], metavar="WORKLOAD:M",
                    help="gated K=2048 runs added to the plan, e.g. heavy:8")  # fmt: skip
    args = ap.parse_args()
    records = []
    plan = [("uniform", True, args.M), ("uniform", False, [1, 16]),
            ("paperlike", True, [1, 16, 64, 128]), ("density=0.1", True, [1, 16])]  # fmt: skip
    if args.uniform_only:
        plan = plan[:1]
    plan += [(w, True, [int(m)]) for w, m in (a.rsplit(":", 1) for a in args.also)]
    for workload, gated, ms in plan:
        for m in ms:
            records += run(workload, m, 2048, 5632, gated)
    for m in () if args.uniform_only else (1, 16, 64, 128):
        records += run("uniform", m, 4096, 14336, True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": gpu_name(), "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
