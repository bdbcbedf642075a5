"""The one-warp light-row kernels (`light_rows.cu`, used from 1057 tokens at K = 2048)
built with other register budgets: the whole `SparseFFN` block per variant, against
dense torch in the same run (`uniform`, K = 2048, N = 5632, weights rotated so they come
from DRAM), in the user's CUDA graph and back to back, and each variant's output bits
against the first variant's.

    PYTHONPATH=. python bench/dev_row_occupancy.py [--M 2048 4096] [--out FILE]

A variant sets light_rows' ROW_MIN_BLOCKS (the launch bound of blocks per SM: 8 gives
up to 255 registers, 12 warps per SM at K = 2048; 16 gives 128 registers, 16 warps) and
SCAN_SIMD (the fused kernels' scan of a pre-activation tile two bf16 per instruction,
empty tiles skipped; 0: one value at a time, as before the fifteenth session).
(Commit 7f0c95f also built ROW_PIPELINE and commit 3c3be60 a ballot prefix in the scan and
2048 row flags compacted by the heavy-row kernels: none faster, taken out;
docs/perf-log.md.)
``--variants old new`` compares the defaults of the thirteenth session with today's
(both the fourteenth session's register bound and the fifteenth's SIMD scan);
``--variants scan`` the scan alone. ``--tail`` times the light-row kernel alone with the
longest rows sent to the heavy rows (how much of its time they set); ``--paths`` the
block by light-row route (also per call; ``--K``/``--N`` set its shape, and
``--plain-fused`` keeps "fused" off the sliced gather, which the records then say).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch
import torch.nn.functional as F  # noqa: N812

import twell
from twell.benchmark import gpu_name, versions
from twell.kernels import light_rows, light_rows_sliced
from twell.sweeps import back_to_back_ms, graph_ms, per_call_ms, torch_problem

OLD = {"ROW_MIN_BLOCKS": 8, "SCAN_SIMD": 0}
NEW = {"ROW_MIN_BLOCKS": 16, "SCAN_SIMD": 1}
SETS = {
    "registers": [OLD, {**OLD, "ROW_MIN_BLOCKS": 16}],
    "scan": [{**NEW, "SCAN_SIMD": 0}, NEW],
    "old": [OLD], "new": [NEW],
}  # fmt: skip
BASE = light_rows.SOURCE


def use(variant: dict) -> None:
    light_rows.SOURCE = dataclasses.replace(BASE, constants={**BASE.constants, **variant})
    light_rows._wide_warps_per_sm.cache_clear()


def paths(m: int, workload: str, names: list[str], k: int = 2048, n: int = 5632) -> list[dict]:
    """The block with each light-row route (``Options.path``) against dense, in the
    user's CUDA graph, back to back and per call; bits against the first route's."""

    _, x, ws, sets = torch_problem(workload, m, k, n)

    def dense(i: int) -> torch.Tensor:
        wg, wu, wd = ws[i]
        return F.linear(F.relu(F.linear(x, wg)) * F.linear(x, wu), wd)

    d_graph, d_b2b = graph_ms(dense, sets), back_to_back_ms(dense, sets)
    d_call = per_call_ms(dense, sets)
    out, ref = [], None
    for name in [*names, names[0]]:
        blocks = [twell.SparseFFN(*w, path=name) for w in ws]
        for _ in range(2):
            for b in blocks:
                b(x)
        y = blocks[0](x)
        torch.cuda.synchronize()
        ref = y.clone() if ref is None else ref
        fn = lambda i, blocks=blocks: blocks[i](x)  # noqa: E731
        r = {"M": m, "K": k, "N": n, "workload": workload, "path": name,
             "sliced_min_rows": light_rows_sliced.MIN_ROWS,
             "bits_equal": bool(torch.equal(y.view(torch.int16), ref.view(torch.int16))),
             "graph_ms": graph_ms(fn, sets), "b2b_ms": back_to_back_ms(fn, sets),
             "call_ms": per_call_ms(fn, sets), "dense_graph_ms": d_graph,
             "dense_b2b_ms": d_b2b, "dense_call_ms": d_call}  # fmt: skip
        r["speedup_graph"], r["speedup_b2b"] = d_graph / r["graph_ms"], d_b2b / r["b2b_ms"]
        r["speedup_call"] = d_call / r["call_ms"]
        print(json.dumps(r), flush=True)
        out.append({**r, "gpu": gpu_name(), **versions()})
        del blocks
    return out


def tail(m: int) -> list[dict]:
    """How much of the one-warp kernel's time at ``m`` tokens the longest rows set: the
    light-row kernel alone (CuPy, eager launches timed with events, weights L2-warm)
    with rows of more than ``cap`` active units sent to the heavy rows instead."""
    import cupy as cp

    from bench.dev_gate_gemm import time_ms
    from twell.benchmark import make_problem, to_device
    from twell.kernels.buffers import empty_bf16
    from twell.kernels.cublas import gemm_nt
    from twell.kernels.pipeline import PreparedBlock
    from twell.options import LIST_CAPACITY, Options

    p = make_problem("uniform", m, 2048, 5632)
    x, wg, wu, wd = (to_device(a) for a in (p.x, p.w_gate, p.w_up, p.w_down))
    block = PreparedBlock(wg, wu, wd, Options())
    pre = gemm_nt(x, wg)
    heavy = cp.zeros((m,), cp.uint8)
    y = empty_bf16((m, 2048))
    l0 = cp.asnumpy(((pre.view(cp.uint16) & 0x8000) == 0).sum(axis=1))
    out = []
    for cap in (LIST_CAPACITY, 44, 40, 36, 32, 28):

        def run(cap: int = cap) -> None:
            light_rows.from_pre(x, pre, heavy, block.w_up, block.w_down_t, y, tile=256,
                                slots=32, max_row_nnz=cap)  # fmt: skip

        t = time_ms(run)
        run()
        r = {"M": m, "cap": cap, "light_rows_ms": t, "heavy_rows": int(heavy.sum()),
             "l0_mean": float(l0.mean()), "l0_max": int(l0.max()),
             "mean_units_of_light_rows": float(l0[l0 <= cap].mean())}  # fmt: skip
        print(json.dumps(r), flush=True)
        out.append(r)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--M", type=int, nargs="+", default=[1536, 2048, 3072, 4096, 8192, 16384])
    parser.add_argument("--variants", nargs="+", default=["registers"], choices=sorted(SETS))
    parser.add_argument("--workload", default="uniform")
    parser.add_argument("--tail", action="store_true", help="the longest rows' share instead")
    parser.add_argument("--paths", nargs="*", default=None, help="compare these routes instead")
    parser.add_argument("--K", type=int, default=2048, help="with --paths")
    parser.add_argument("--N", type=int, default=5632, help="with --paths")
    parser.add_argument(
        "--plain-fused",
        action="store_true",
        help='"fused" never reads its light rows by slices (light_rows_sliced.pays)',
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not args.paths and (args.K, args.N, args.plain_fused) != (2048, 5632, False):
        parser.error("--K, --N and --plain-fused go with --paths")
    if args.plain_fused:
        light_rows_sliced.MIN_ROWS = 1 << 62
    variants = [v for name in args.variants for v in SETS[name]]
    if args.paths:
        records = [r for m in args.M for r in paths(m, args.workload, args.paths, args.K, args.N)]
        if args.out:
            with open(args.out, "w") as f:
                json.dump(records, f, indent=1)
        return
    if args.tail:
        records = [r for m in args.M for r in tail(m)]
        if args.out:
            with open(args.out, "w") as f:
                json.dump(records, f, indent=1)
        return
    records = []
    for m in args.M:
        _, x, ws, sets = torch_problem(args.workload, m, 2048, 5632)

        def dense(i: int, ws=ws, x=x) -> torch.Tensor:  # noqa: ANN001
            wg, wu, wd = ws[i]
            return F.linear(F.relu(F.linear(x, wg)) * F.linear(x, wu), wd)

        d_graph, d_b2b = graph_ms(dense, sets), back_to_back_ms(dense, sets)
        ref = None
        for variant in [*variants, variants[0]]:
            use(variant)
            blocks = [twell.SparseFFN(*w) for w in ws]
            for _ in range(2):
                for b in blocks:
                    b(x)
            y = blocks[0](x)
            torch.cuda.synchronize()
            if ref is None:
                ref = y.clone()
            fn = lambda i, blocks=blocks, x=x: blocks[i](x)  # noqa: E731
            r = {"M": m, "workload": args.workload, **variant,
                 "bits_equal": bool(torch.equal(y.view(torch.int16), ref.view(torch.int16))),
                 "graph_ms": graph_ms(fn, sets), "b2b_ms": back_to_back_ms(fn, sets),
                 "dense_graph_ms": d_graph, "dense_b2b_ms": d_b2b}  # fmt: skip
            r["speedup_graph"] = d_graph / r["graph_ms"]
            r["speedup_b2b"] = d_b2b / r["b2b_ms"]
            print(json.dumps(r), flush=True)
            records.append({**r, "gpu": gpu_name(), **versions()})
            del blocks
    use(NEW)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
