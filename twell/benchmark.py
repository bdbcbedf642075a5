"""Benchmark of the gated/non-gated FFN forward: twell GPU kernels against dense cuBLAS.

Protocol (docs/benchmark.md): CUDA events around each call on one stream, >= 5 warm-ups (JIT
excluded), median of >= 20 timed calls, twell's and dense's timed in rounds that alternate
(``twell.timing.alternating``), inputs rotated so the working set exceeds L2,
torch dense baseline (``F.linear`` + ``relu`` + ``*`` + ``F.linear``) on the same inputs
in the same process, rel. error of every timed configuration against float64 dense math
(rows subsampled), JSON records in ``bench/results/<gpu>/ffn.json`` (the latest record of
each configuration). The timers are :mod:`twell.timing`'s.

    python -m twell bench                                  # uniform M=16384 K=2048 N=5632
    python -m twell bench --workloads uniform heavy paperlike --M 4096 16384
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

import ml_dtypes
import numpy as np

from twell.testing.asserts import relative_error
from twell.timing import (
    alternating,
    gpu_name,
    graph_ms,
    graph_ms_cupy,
    merge_records,
    record_path,
    time_ms,
    versions,
)

# time_ms, graph_ms_cupy, gpu_name and versions are also imported from here by the
# threshold probes (bench/tune) and by bench/compare_trees.py, which must run older trees
# too; they live in twell.timing.
__all__ = ["bench_config", "demo", "fused_blocks", "gpu_name", "graph_ms_cupy",
           "make_problem", "main", "time_ms", "to_device", "versions"]  # fmt: skip

BF16 = np.dtype(ml_dtypes.bfloat16)


def make_problem(workload: str, m: int, k: int, n: int, seed: int = 0) -> Any:
    """A workload of docs/benchmark.md by name (``density=P``: uniform at density P;
    ``heavy=F``: ``heavy`` with a share F of heavy tokens; ``heavy=FxS``: and their ``x``
    scaled by S)."""
    from twell import workloads

    if workload.startswith("density="):
        return workloads.make("density", m, k, n, seed=seed, p=float(workload.split("=")[1]))
    if workload.startswith("heavy="):
        frac, x, scale = workload.split("=")[1].partition("x")
        try:
            kw = {"frac": float(frac)} | ({"scale": float(scale)} if x else {})
        except ValueError:
            raise ValueError(
                f"workload {workload!r}: expected heavy=F or heavy=FxS (e.g. heavy=0.02x4)"
            ) from None
        return workloads.make("heavy", m, k, n, seed=seed, **kw)
    return workloads.make(workload, m, k, n, seed=seed)


def to_device(array: np.ndarray | None) -> Any:
    """A NumPy array (ml_dtypes bf16 included) copied to the current GPU as CuPy."""
    import cupy as cp

    if array is None:
        return None
    array = np.ascontiguousarray(array)
    if array.dtype == BF16:
        return cp.asarray(array.view(np.uint16)).view(BF16)
    return cp.asarray(array)


def fused_blocks(problems: list[Any]) -> list[Any]:
    """One ``PreparedBlock`` per problem's gated weights on the current GPU, on the fused
    path with the density switch off: the weight sets the decode probes rotate over."""
    from twell.kernels.pipeline import PreparedBlock
    from twell.options import Options

    options = Options(path="fused", density_switch=False)
    return [
        PreparedBlock(to_device(p.w_gate), to_device(p.w_up), to_device(p.w_down), options)
        for p in problems
    ]


def bench_config(
    workload: str,
    m: int,
    k: int,
    n: int,
    *,
    gated: bool = True,
    tile: int = 256,
    slots: int = 32,
    seed: int = 0,
    stages: bool = False,
    check_rows: int = 256,
    paths: tuple[str, ...] = ("fused",),
    graphs: bool = False,
    max_row_nnz: int | None = None,
    dense_capacity: float | str = "auto",
) -> list[dict[str, Any]]:
    import cupy as cp
    import torch
    import torch.nn.functional as F  # noqa: N812

    from twell import reference
    from twell.kernels import cublas, light_rows
    from twell.kernels.buffers import empty_bf16
    from twell.kernels.gate_gemm import gate_pack
    from twell.kernels.pack import pack
    from twell.kernels.pipeline import PreparedBlock
    from twell.options import Options

    problem = make_problem(workload, m, k, n, seed)
    w_gate = problem.w_gate if gated else None
    # Non-gated block relu(x @ w_up.T) @ w_down.T: the workload's thresholded gate weights
    # play w_up, so the hidden activation has the workload's sparsity.
    w_up = problem.w_up if gated else problem.w_gate
    # Rotate weight sets (and x) so the working set of consecutive calls exceeds L2.
    l2 = cp.cuda.Device().attributes["L2CacheSize"]
    set_bytes = 2 * (m * k + (3 if gated else 2) * n * k)
    sets = max(1, min(8, math.ceil(3 * l2 / set_bytes)))
    xs, blocks, dense_w = [], [], []
    for s in range(sets):
        x = to_device(problem.x)
        wg, wu, wd = to_device(w_gate), to_device(w_up), to_device(problem.w_down)
        xs.append(x)
        blocks.append(
            {
                p: PreparedBlock(wg, wu, wd, Options(tile, slots, p, max_row_nnz, dense_capacity))
                for p in paths
            }
        )
        tw = [None if a is None else torch.from_dlpack(a) for a in (wg, wu, wd)]
        dense_w.append(tw)
        del s
    xt = [torch.from_dlpack(x) for x in xs]

    def ours(i: int, path: str = paths[0]) -> Any:
        return blocks[i][path](xs[i])

    def dense(i: int) -> Any:
        wg, wu, wd = dense_w[i]
        if wg is None:
            return F.linear(F.relu(F.linear(xt[i], wu)), wd)
        return F.linear(F.relu(F.linear(xt[i], wg)) * F.linear(xt[i], wu), wd)

    def gate_gemm(i: int) -> Any:
        wg, wu, _ = dense_w[i]
        return F.linear(xt[i], wu if wg is None else wg)

    for _ in range(2):  # every block's density switch measures, then acts on it
        for i in range(sets):
            for p in paths:
                ours(i, p)
        torch.cuda.synchronize()
    # each path, dense and the gate GEMM timed in rounds that alternate between them
    fns = {p: lambda i, p=p: ours(i, p) for p in paths} | {"dense!": dense, "gemm!": gate_gemm}
    times = alternating(time_ms, fns, sets=sets)
    t_paths = {p: times[p] for p in paths}
    t_dense, t_gemm = times["dense!"], times["gemm!"]

    record: dict[str, Any] = {}
    if graphs:  # CUDA-graph replay of all weight sets: launch overhead out of the figure
        try:
            replays = alternating(lambda timer: timer(), {
                "twell": lambda: graph_ms_cupy(lambda: [ours(i) for i in range(sets)]) / sets,
                "dense": lambda: graph_ms(dense, sets),
            })  # fmt: skip
            record["t_graph_ms"], record["t_dense_graph_ms"] = replays["twell"], replays["dense"]
            record["speedup_graph"] = record["t_dense_graph_ms"] / record["t_graph_ms"]
        except Exception as error:  # report, do not hide
            record["graph_error"] = f"{type(error).__name__}: {error}"[:300]
    if stages:  # time the pipeline's parts (differences, no counters)
        b = blocks[0][paths[0]]
        args = dict(tile=tile, slots=slots, max_row_nnz=b.max_row_nnz)
        x_up, w_up_b = (xs[0], b.w_up) if gated else (None, None)
        pre = cublas.gemm_nt(xs[0], b.w_first)
        packed, heavy = pack(pre, tile, slots)
        y = empty_bf16((m, k))
        record["t_pack_ms"] = time_ms(lambda i: pack(pre, tile, slots), 1)
        record["t_gemm_cupy_ms"] = time_ms(lambda i: cublas.gemm_nt(xs[0], b.w_first, pre), 1)
        record["t_gate_epilogue_ms"] = time_ms(
            lambda i: gate_pack(xs[0], b.w_first, tile, slots), 1
        )
        record["t_gemm_torchpath_ms"] = time_ms(
            lambda i: cublas.gemm_nt(xs[0], b.w_first, pre, via="torch"), 1
        )
        record["t_light_rows_from_twell_ms"] = time_ms(
            lambda i: light_rows.from_twell(x_up, packed, heavy, w_up_b, b.w_down_t, y, **args), 1
        )
        record["t_light_rows_from_pre_ms"] = time_ms(
            lambda i: light_rows.from_pre(x_up, pre, heavy, w_up_b, b.w_down_t, y, **args), 1
        )

    # Correctness: float64 dense math on a row sample, for every timed path.
    rows = np.unique(np.r_[np.linspace(0, m - 1, min(m, check_rows)).astype(int)])
    heavy_ids = problem.params.get("heavy_rows")
    if heavy_ids is not None:
        rows = np.unique(np.r_[rows, np.asarray(heavy_ids)[:64]])
    oracle = reference.forward.ffn_dense(problem.x[rows], w_gate, w_up, problem.w_down)
    # L0 and heavy rows from the packed gate.
    b = blocks[0][paths[0]]
    pre = cublas.gemm_nt(xs[0], b.w_first)
    packed, heavy = pack(pre, tile, slots)
    l0 = float(packed[:, ::slots].astype(cp.float64).sum().get() / m)
    heavy_rows = int(heavy.astype(cp.int64).sum().get())
    gemm_flops = 2.0 * m * n * k
    records = []
    for path in paths:
        y = ours(0, path)
        rel_err = relative_error(y[cp.asarray(rows)], oracle)
        t_ours = t_paths[path]
        r = dict(record)
        r.update(
            gpu=gpu_name(),
            op="ffn_forward" if gated else "ffn_forward_nongated",
            workload=workload,
            path=path,
            # the light-row route a sparse call of this size takes ("fused" stands for
            # the fastest measured route of the shape)
            route=blocks[0][path].route(m),
            M=m,
            K=k,
            N=n,
            tile=tile,
            slots=slots,
            t_ms=t_ours,
            t_dense_ms=t_dense,
            speedup=t_dense / t_ours,
            t_gate_gemm_ms=t_gemm,
            floor_ratio=t_ours / t_gemm,
            gate_gemm_tflops=gemm_flops / t_gemm / 1e9,
            rel_err=rel_err,
            l0=l0,
            heavy_rows=heavy_rows,
            max_row_nnz=b.max_row_nnz,
            dense_capacity=b.options.dense_capacity,
            timing="per_call",
            # what twell.SparseFFN(w_gate, w_up, w_down) runs
            default=blocks[0][path].options == Options(dense_capacity="auto"),
            dense_path=blocks[0][path].takes_dense(xs[0]),
            heavy_rows_by_count=b.counts_heavy_rows(m),
            rotation_sets=sets,
            **versions(),
        )
        records.append(r)
    return records


def demo(problem: Any, *, large: int = 16384) -> dict[str, Any]:
    """Run a workload problem through the kernels and time it against dense cuBLAS.

    The GPU part of ``python -m twell demo``: the protocol's timer (back-to-back calls,
    median of 5 rounds of 20 after warm-up), the float64 oracle on the first 256 rows,
    the torch dense baseline (torch bf16 ``F.linear`` chain) on the same torch tensors.
    When the asked batch is smaller than ``large`` tokens, the same workload at ``large``
    tokens is timed too, so the report shows a batch where the sparse block wins beside
    the one that was asked for (whichever way each comes out).

    Returns:
        ``"hybrid"`` (the GPU :class:`twell.Hybrid` of the gate), the relative error, and
        per batch size the twell and dense times (ms) and the speedup (> 1: faster).
    """
    import torch
    import torch.nn.functional as F  # noqa: N812

    import twell
    from twell.reference.forward import ffn_dense
    from twell.timing import back_to_back_ms

    def tensors(p: Any) -> list[Any]:
        return [None if a is None else torch.from_numpy(np.asarray(a, np.float32)).cuda()
                .bfloat16() for a in p.arrays()]  # fmt: skip

    def timed(p: Any) -> tuple[Any, float, float]:
        x, wg, wu, wd = tensors(p)
        block = twell.SparseFFN(wg, wu, wd)
        if wg is None:
            dense = lambda i: F.linear(F.relu(F.linear(x, wu)), wd)  # noqa: E731
        else:
            dense = lambda i: F.linear(F.relu(F.linear(x, wg)) * F.linear(x, wu), wd)  # noqa: E731
        return block(x), back_to_back_ms(lambda i: block(x), 1), back_to_back_ms(dense, 1)

    m = problem.x.shape[0]
    y, t, t_dense = timed(problem)
    rows = min(256, m)
    ref = ffn_dense(problem.x[:rows], problem.w_gate, problem.w_up, problem.w_down)
    x_gpu, w_first = (to_device(a) for a in (problem.x, problem.w_gate))
    report: dict[str, Any] = {
        "hybrid": twell.gate(x_gpu, w_first),
        "rel. error": relative_error(y[:rows].float().cpu().numpy(), ref),
        f"twell M={m} (ms)": t,
        f"dense M={m} (ms)": t_dense,
        f"speedup M={m}": t_dense / t,
    }
    if m < large:
        from twell import workloads

        big = workloads.make(problem.name, large, problem.x.shape[1], problem.w_up.shape[0],
                             seed=0)  # fmt: skip
        _, t, t_dense = timed(big)
        report[f"twell M={large} (ms)"] = t
        report[f"dense M={large} (ms)"] = t_dense
        report[f"speedup M={large}"] = t_dense / t
    return report


def _capacity(text: str) -> float | str:
    return text if text == "auto" else float(text)


def print_table(records: list[dict[str, Any]]) -> None:
    head = (
        f"{'op':<22}{'workload':<12}{'path':<9}{'M':>7}{'S':>4}{'ours':>8}{'dense':>8}{'gemm':>8}"
    )
    print(head + f"{'speedup':>8}{'floor':>7}{'rel_err':>9}{'L0':>7}{'heavy':>7}{'graph x':>8}")
    for r in records:
        print(
            f"{r['op']:<22}{r['workload']:<12}{r.get('path', ''):<9}{r['M']:>7}{r['slots']:>4}"
            f"{r['t_ms']:>8.3f}"
            f"{r['t_dense_ms']:>8.3f}{r['t_gate_gemm_ms']:>8.3f}{r['speedup']:>8.2f}"
            f"{r['floor_ratio']:>7.2f}{r['rel_err']:>9.1e}{r['l0']:>7.1f}{r['heavy_rows']:>7}"
            f"{r.get('speedup_graph', float('nan')):>8.2f}"
        )


def main(argv: list[str] | None = None) -> int:
    from twell.options import PATHS

    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="python -m twell bench --sweep: batch-size and density sweeps of the public "
        "torch API (twell.sweeps; --sweep --help)",
    )
    parser.add_argument(
        "--workloads", nargs="+", default=["uniform"],
        help="twell.workloads names, or heavy=<share>x<scale>, density=<p>",
    )  # fmt: skip
    parser.add_argument("--M", nargs="+", type=int, default=[16384], help="tokens per call")
    parser.add_argument("--K", type=int, default=2048, help="model width")
    parser.add_argument("--N", type=int, default=5632, help="FFN width (units)")
    parser.add_argument("--slots", nargs="+", type=int, default=[32],
                        help="TwELL words per 256-column tile (docs/format.md)")  # fmt: skip
    parser.add_argument("--nongated", action="store_true", help="also the non-gated block")
    parser.add_argument("--stages", action="store_true", help="time pack and sparse alone")
    parser.add_argument(
        "--out", default=None,
        help="JSON record file (default: bench/results/<gpu>/ffn.json; a rerun replaces the "
        "records of the configurations it measures)",
    )  # fmt: skip
    parser.add_argument(
        "--max-row-nnz", type=int, default=None,
        help="active units over which a row is heavy (default: the GPU's)",
    )  # fmt: skip
    parser.add_argument(
        "--dense-capacity", type=_capacity, default="auto",
        help="auto (SparseFFN's default: sized per call) or a fraction of M of heavy rows "
        "via cuBLAS (0: none)",
    )  # fmt: skip
    parser.add_argument("--graph-below", type=int, default=512, help="also time CUDA graphs")
    parser.add_argument("--paths", nargs="+", default=["fused"], choices=list(PATHS),
                        help="light-row routes to time (docs/ops.md)")  # fmt: skip
    args = parser.parse_args(argv)
    records = []
    for workload in args.workloads:
        for m in args.M:
            for slots in args.slots:
                for gated in (True, False) if args.nongated else (True,):
                    rs = bench_config(
                        workload, m, args.K, args.N, gated=gated, slots=slots,
                        stages=args.stages, paths=tuple(args.paths), graphs=m <= args.graph_below,
                        max_row_nnz=args.max_row_nnz, dense_capacity=args.dense_capacity,
                    )  # fmt: skip
                    records += rs
                    for r in rs:
                        print(json.dumps(r), flush=True)
    path = merge_records(args.out or record_path("ffn", records[0]["gpu"] if records else None),
                         records)  # fmt: skip
    print(f"wrote {path}")
    print_table(records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
