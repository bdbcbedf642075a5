"""The heavy-row matmul's split of the reduction and ring depth, measured.

``twell_heavy_rows_matmul`` splits each 64 x 64 output tile's reduction over the CTAs of a
cluster (``split``) and stages k-slices through a cp.async ring (``stages``). With few
heavy rows the stage is bound by how many weight bytes are in flight, not by math: one
64-row block leaves the down projection (2048 outputs, reduction over N) 32 tiles. This
times each (split, stages) on the block's two heavy-row projections for a few row counts,
weights rotated over sets that exceed L2, replayed from a CUDA graph, each output checked
against float32 math on the same rows first; then whole blocks with heavy rows (the
per-token route, the switch off) with split 4 and a 3-deep ring (the former fixed
choice) and with the launcher's choice now, against dense math.

    PYTHONPATH=. python bench/dev_heavy_rows.py [--out heavy_rows.json] [--quick]
"""

from __future__ import annotations

import argparse
import json

import cupy as cp
import numpy as np
import torch  # noqa: F401 - the cuBLAS gate GEMM is captured through torch

from twell.benchmark import gpu_name, graph_ms_cupy, make_problem, to_device
from twell.kernels import heavy_rows, pipeline
from twell.kernels.buffers import bfloat16, empty_bf16, u16
from twell.options import Options
from twell.testing.asserts import relative_error

SETS = 4
K, N = 2048, 5632
CONFIGS = [(4, 3), (8, 5), (4, 5), (2, 5), (1, 5)]


def random_bf16(shape: tuple[int, ...], scale: float, seed: int) -> cp.ndarray:
    f = cp.random.default_rng(seed).standard_normal(shape, dtype=cp.float32) * scale
    return (f.view(cp.uint32) >> 16).astype(cp.uint16).view(bfloat16)


def as_f32(a: cp.ndarray) -> cp.ndarray:
    """bf16 bits (uint16) as float32."""
    return (a.astype(cp.uint32) << 16).view(cp.float32)


def stage(m: int, rows_list: list[int]) -> list[dict]:
    x = random_bf16((m, K), 1.0, 1)
    pre = random_bf16((m, N), 1.0, 2)
    ups = [random_bf16((N, K), K**-0.5, 10 + s) for s in range(SETS)]
    downs = [random_bf16((K, N), N**-0.5, 20 + s) for s in range(SETS)]
    out = []
    for r in rows_list:
        ids = cp.asarray(np.linspace(0, m - 1, r).round().astype(np.int32))
        count = cp.asarray(np.array([r], np.int32))
        xr, pr = as_f32(u16(x)[ids]), as_f32(u16(pre)[ids])
        ref_up = cp.maximum(pr, 0) * (xr @ as_f32(u16(ups[0])).T)
        ref_down = pr @ as_f32(u16(downs[0])).T
        for split, stages in CONFIGS:
            kw = {"split": split, "stages": stages}
            h = empty_bf16((m, N))
            y = empty_bf16((m, K))

            def up(w, h=h, ids=ids, count=count, kw=kw):  # noqa: ANN001, ANN202
                return heavy_rows.matmul(x, w, h, ids, count, m, a_by_id=True,
                                         out_by_id=True, gate=pre, gate_by_id=True,
                                         relu_gate=True, **kw)  # fmt: skip

            def down(w, y=y, ids=ids, count=count, kw=kw):  # noqa: ANN001, ANN202
                return heavy_rows.matmul(pre, w, y, ids, count, m, a_by_id=True,
                                         out_by_id=True, **kw)  # fmt: skip

            for name, fn, ws, res, ref in (
                ("up", up, ups, h, ref_up),
                ("down", down, downs, y, ref_down),
            ):
                u16(res).fill(0x7FC1)  # poison: a NaN
                fn(ws[0])
                first = u16(res)[ids]
                fn(ws[0])
                same = bool(cp.array_equal(first, u16(res)[ids]))
                err = relative_error(as_f32(first), ref)
                us = graph_ms_cupy(lambda fn=fn, ws=ws: [fn(w) for w in ws], reps=20) * 1e3 / SETS
                rec = {"kind": "stage", "projection": name, "rows": r, "M": m, "split": split,
                       "stages": stages, "rotated_us": us, "rel_err_vs_f32": err,
                       "deterministic": same}  # fmt: skip
                print(json.dumps(rec), flush=True)
                out.append(rec)
    return out


def blocks(workloads: list[str], ms: list[int]) -> list[dict]:
    out = []
    for workload in workloads:
        problems = [make_problem(workload, max(ms), K, N, seed=s) for s in range(SETS)]
        x_all = to_device(problems[0].x)
        bs = [
            pipeline.PreparedBlock(
                to_device(p.w_gate), to_device(p.w_up), to_device(p.w_down),
                Options(path="fused", density_switch=False),
            )
            for p in problems
        ]  # fmt: skip
        for m in ms:
            x = x_all[:m]

            def dense(b, x=x, m=m):  # noqa: ANN001, ANN202
                y = empty_bf16((m, K))
                return [y, *pipeline.dense_block(b, x, y)]

            ref = dense(bs[0])[0]
            us = graph_ms_cupy(lambda bs=bs: [dense(b) for b in bs], reps=20) * 1e3 / SETS
            rec = {
                "kind": "block",
                "workload": workload,
                "M": m,
                "variant": "dense",
                "rotated_us": us,
            }
            print(json.dumps(rec), flush=True)
            out.append(rec)
            for name, rule, stages in (
                ("split4_ring3", lambda outc: 4, 3),
                ("default", None, None),
            ):
                saved = heavy_rows.split_for, heavy_rows.STAGES
                if rule is not None:
                    heavy_rows.split_for, heavy_rows.STAGES = rule, stages
                try:
                    y = bs[0](x)
                    err = relative_error(y, ref)
                    us = graph_ms_cupy(lambda x=x, bs=bs: [b(x) for b in bs], reps=20) * 1e3 / SETS
                finally:
                    heavy_rows.split_for, heavy_rows.STAGES = saved
                rec = {"kind": "block", "workload": workload, "M": m, "variant": "per_token",
                       "heavy_rows": name, "rotated_us": us, "rel_diff_vs_dense": err}  # fmt: skip
                print(json.dumps(rec), flush=True)
                out.append(rec)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    records = stage(4096, [1, 16, 64] if args.quick else [1, 16, 64, 164, 512, 2048])
    if not args.quick:
        records += blocks(["heavy", "paperlike"], [512, 1024, 2048, 4096, 16384])
    result = {"gpu": gpu_name(), "sets": SETS, "records": records}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
