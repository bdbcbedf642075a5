"""Where the sparse routes stop paying: µs per block call replayed from a CUDA graph,
weights rotated over sets that exceed L2, for every route a batch of M tokens can take
(the by-unit decode route, the per-token route from the dense pre-activation, the GEMM
epilogue route, dense cuBLAS math) at several densities and batch sizes. The density
switch's per-M threshold (pipeline.DensitySwitch) comes from these records. Every
variant is checked against the dense block's output on the same inputs first.

Also: batches with heavy rows at fixed dense capacities (inference; ``--capacities``
from 512 tokens on), the data for choosing a capacity per call and for the switch's
heavy-row rule.

    PYTHONPATH=. python bench/dev_crossover.py [--quick | --small | --heavy | --capacities
        | --mid] [--out crossover.json]

``--mid``: the per-token routes against dense at 256-8192 tokens and 0.25-2% of N (the
part of the table the fused route's speed sets).
"""

from __future__ import annotations

import argparse
import json

import cupy as cp
import torch  # noqa: F401 - the cuBLAS gate GEMM is captured through torch

from twell.benchmark import gpu_name, graph_ms_cupy, make_problem, to_device
from twell.kernels import decode_units, pipeline
from twell.kernels.buffers import empty_bf16
from twell.options import Options
from twell.testing.asserts import relative_error

SETS = 4

MAIN_M = [64, 96, 128, 160, 192, 256, 320, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 8192]
MAIN_WORKLOADS = ["density=0.0025", "uniform", "density=0.01", "density=0.02", "paperlike"]
BIG_M = [64, 128, 256, 512, 1024, 2048, 4096]
MID_M = [256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 8192]


def problems_for(workload: str, m_max: int, k: int, n: int) -> list:
    return [make_problem(workload, m_max, k, n, seed=s) for s in range(SETS)]


def blocks_for(problems: list, **opts: object):  # noqa: ANN201
    xs = to_device(problems[0].x)
    blocks = {}
    for name, path in (("fused", "fused"), ("epilogue", "epilogue")):
        blocks[name] = [
            pipeline.PreparedBlock(
                to_device(p.w_gate), to_device(p.w_up), to_device(p.w_down),
                Options(path=path, density_switch=False, **opts),
            )
            for p in problems
        ]  # fmt: skip
    return xs, blocks


def with_rows(limit: int):  # noqa: ANN201
    def call(b, x):  # noqa: ANN001, ANN202
        saved = decode_units.MAX_ROWS
        decode_units.MAX_ROWS = limit
        try:
            return b(x)
        finally:
            decode_units.MAX_ROWS = saved

    return call


def dense(b, x):  # noqa: ANN001, ANN201
    y = empty_bf16((x.shape[0], b.k))
    return [y, *pipeline.dense_block(b, x, y)]


def first(y):  # noqa: ANN001, ANN201
    return y[0] if isinstance(y, list) else y


def sweep(workload: str, ms: list[int], k: int, n: int) -> list[dict]:
    xs, blocks = blocks_for(problems_for(workload, max(ms), k, n))
    out = []
    for m in ms:
        x = xs[:m]
        variants = []
        if m <= decode_units.MAX_TOKENS:
            variants += [("units", "fused", with_rows(decode_units.MAX_TOKENS)),
                         ("per_token", "fused", with_rows(0))]  # fmt: skip
        else:
            variants += [("per_token", "fused", lambda b, x: b(x))]
        if m >= 256:
            variants += [("epilogue", "epilogue", lambda b, x: b(x))]
        variants += [("dense", "fused", dense)]
        ref = first(dense(blocks["fused"][0], x))
        for name, kind, fn in variants:
            bs = blocks[kind]
            y = first(fn(bs[0], x))
            err = relative_error(y, ref)
            again = first(fn(bs[0], x))
            same = bool(cp.array_equal(y.view(cp.uint16), again.view(cp.uint16)))
            calls = lambda fn=fn, bs=bs, x=x: [fn(b, x) for b in bs]  # noqa: E731
            us = graph_ms_cupy(calls, reps=20) * 1e3 / SETS
            rec = {"workload": workload, "M": m, "K": k, "N": n, "variant": name,
                   "rotated_us": us, "rel_diff_vs_dense": err, "deterministic": same}  # fmt: skip
            print(json.dumps(rec), flush=True)
            out.append(rec)
    return out


def capacities(
    workload: str, ms: list[int], k: int, n: int, paths: tuple[str, ...] = ("fused", "epilogue")
) -> list[dict]:
    """The fused (and epilogue) route with fixed dense capacities against dense math."""
    out = []
    problems = problems_for(workload, max(ms), k, n)
    for f in (0.0, 1 / 64, 1 / 16, 1 / 4):
        xs, blocks = blocks_for(problems, dense_capacity=f)
        for m in ms:
            x = xs[:m]
            variants = [(kind, blocks[kind]) for kind in paths]
            if f == 0.0:
                variants.append(("dense", blocks["fused"]))
            for kind, bs in variants:
                fn = dense if kind == "dense" else (lambda b, x: b(x))
                y = first(fn(bs[0], x))
                ref = first(dense(bs[0], x))
                calls = lambda fn=fn, bs=bs, x=x: [fn(b, x) for b in bs]  # noqa: E731
                us = graph_ms_cupy(calls, reps=10) * 1e3 / SETS
                name = kind if kind == "dense" else f"{kind}_cap{f:.4f}"
                rec = {"workload": workload, "M": m, "K": k, "N": n, "variant": name,
                       "rotated_us": us, "rel_diff_vs_dense": relative_error(y, ref)}  # fmt: skip
                print(json.dumps(rec), flush=True)
                out.append(rec)
        del blocks
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--small", action="store_true", help="decode batches at high densities")
    ap.add_argument("--heavy", action="store_true", help="mid batches with heavy rows")
    ap.add_argument(
        "--capacities", action="store_true", help="heavy rows through cuBLAS at mid batches"
    )
    ap.add_argument("--mid", action="store_true", help="256-8192 tokens, 0.25-2% of N")
    args = ap.parse_args()
    records = []
    if args.capacities:
        for w in ("heavy", "paperlike"):
            records += capacities(w, [512, 1024, 2048, 4096, 8192, 16384], 2048, 5632, ("fused",))
            records += capacities(w, [1024, 4096], 4096, 14336, ("fused",))
    elif args.small or args.heavy:
        if args.small:
            for w in ("density=0.02", "density=0.05", "density=0.1", "density=0.2", "paperlike"):
                records += sweep(w, [1, 4, 16, 32, 48], 2048, 5632)
        if args.heavy:
            records += sweep("heavy", [256, 512, 1024, 2048, 4096, 8192], 2048, 5632)
            records += sweep("heavy", [64, 256, 1024, 4096], 4096, 14336)
            records += sweep("paperlike", [256, 1024, 4096], 4096, 14336)
    elif args.mid:
        for w in MAIN_WORKLOADS[:4]:
            records += sweep(w, MID_M, 2048, 5632)
    elif args.quick:
        records += sweep("uniform", [128, 256, 512], 2048, 5632)
    else:
        for w in MAIN_WORKLOADS:
            ms = MAIN_M if w != "paperlike" else [64, 128, 256, 512, 1024, 2048, 4096]
            records += sweep(w, ms, 2048, 5632)
        records += sweep("density=0.003", BIG_M, 4096, 14336)
        for w in ("heavy", "paperlike"):
            records += capacities(w, [16384], 2048, 5632)
    result = {"gpu": gpu_name(), "sets": SETS, "records": records}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
