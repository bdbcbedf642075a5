"""Batch-size and density sweeps: twell's public torch API against the dense torch
block, in the three timing modes of docs/benchmark.md, plus the host cost of one call.

For each configuration, in one process, on the same torch bf16 tensors:
``per_call`` (events around one call, synchronised), ``back_to_back`` (20 calls, one
pair of events), ``graph`` (a ``torch.cuda.graph`` capture replayed; M <= 4096), and at
M=64 ``host_us`` (CPU time per call in a loop that does not wait); the timers are
:mod:`twell.timing`'s, twell's and dense's figures each the median of four rounds that
alternate between them (:func:`twell.timing.alternating`). Weight sets rotate so the
working set exceeds L2. Records go to ``bench/results/<gpu>/serving.json`` (``--out``;
a rerun replaces the records of the configurations it measures) and a table is printed.

    python -m twell bench --sweep --plot bench/results/h200/serving.png
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

import numpy as np

from twell._optional import optional_dependency

with optional_dependency("torch", "the benchmark sweeps"):
    import torch
    import torch.nn.functional as F  # noqa: N812

import twell
from twell._interop import cupy_view
from twell.benchmark import make_problem
from twell.reference.forward import ffn_dense
from twell.testing.asserts import relative_error
from twell.timing import (
    alternating,
    back_to_back_ms,
    gpu_name,
    graph_ms,
    graph_of,
    host_us,
    merge_records,
    per_call_ms,
    record_path,
    versions,
)

# The timers are also imported from here by the threshold probes (bench/tune).
__all__ = ["back_to_back_ms", "config", "graph_ms", "graph_of", "host_us", "main",
           "per_call_ms", "plot", "torch_problem"]  # fmt: skip


def torch_problem(workload: str, m: int, k: int, n: int) -> tuple[Any, Any, list, int]:
    """The workload on the GPU as torch bf16 tensors: ``(problem, x, weight sets, sets)``,
    the gated weights ``(w_gate, w_up, w_down)`` copied into enough sets that rotating
    through them reads the weights from DRAM (working set about 3x the L2)."""
    p = make_problem(workload, m, k, n)
    cuda = [torch.from_numpy(a.astype(np.float32)).cuda().bfloat16() for a in p.arrays()]
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    sets = max(1, min(8, math.ceil(3 * l2 / (2 * (m * k + 3 * n * k)))))
    weights = [cuda[1:]] + [[w.clone() for w in cuda[1:]] for _ in range(sets - 1)]
    return p, cuda[0], weights, sets


def config(workload: str, m: int, k: int, n: int, api: str = "SparseFFN") -> list[dict]:
    p, x, weights, sets = torch_problem(workload, m, k, n)
    blocks = [twell.SparseFFN(*w) for w in weights]

    def ours(i: int) -> Any:
        if api == "ffn":
            return twell.ffn(x, *weights[i])
        return blocks[i](x)

    def dense(i: int) -> Any:
        wg, wu, wd = weights[i]
        return F.linear(F.relu(F.linear(x, wg)) * F.linear(x, wu), wd)

    rows = np.unique(np.linspace(0, m - 1, min(m, 256)).astype(int))
    oracle = ffn_dense(p.x[rows], p.w_gate, p.w_up, p.w_down)
    for _ in range(2):  # every block's density switch measures, then acts on it
        for i in range(sets):
            ours(i)
        torch.cuda.synchronize()
    y = ours(0)
    rel = relative_error(y[torch.as_tensor(rows, device="cuda")].float().cpu().numpy(), oracle)
    modes = {"per_call": per_call_ms, "back_to_back": back_to_back_ms}
    if m <= 4096:
        modes["graph"] = graph_ms
    records = []
    fns = {"twell": ours, "dense": dense}
    for timing, fn in modes.items():
        times = alternating(fn, fns, sets=sets)
        t, td = times["twell"], times["dense"]
        r = dict(gpu=gpu_name(), op="ffn_forward", api=api, workload=workload, M=m, K=k, N=n,
                 tile=256, slots=32, path="fused", default=True, timing=timing, t_ms=t,
                 t_dense_ms=td, speedup=td / t, rel_err=rel,
                 dense_path=(
                     None if api == "ffn" else blocks[0]._prepared.takes_dense(cupy_view(x))
                 ),
                 density_estimate=None if api == "ffn" else blocks[0]._prepared.density.estimate,
                 **versions())  # fmt: skip
        if workload.startswith("density="):
            r["p"] = float(workload.split("=")[1])
        if m == 64 and timing != "graph":
            host = alternating(host_us, fns, sets=sets)
            r["host_us"], r["host_us_dense"] = host["twell"], host["dense"]
        records.append(r)
        print(json.dumps(r), flush=True)
    return records


def plot(records: list[dict], path: str) -> None:
    """Speedup against batch size (one line per timing mode) and against density, as PNG
    (needs matplotlib: pip install 'twell[plots]'); a panel only where there are records
    for it (a sweep run with ``--densities`` and no value has no density panel)."""
    with optional_dependency("matplotlib", "the sweep's plot"):
        import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batch = [r for r in records if r["workload"] == "uniform" and r["api"] == "SparseFFN"]
    dense = [r for r in records if "p" in r]
    panels = [name for name, rs in (("batch", batch), ("density", dense)) if rs] or ["batch"]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    axis_of = dict(zip(panels, axes[0], strict=True))
    if "batch" in axis_of:
        left = axis_of["batch"]
        for timing in ("per_call", "back_to_back", "graph"):
            rs = sorted((r for r in batch if r["timing"] == timing), key=lambda r: r["M"])
            if rs:
                left.plot([r["M"] for r in rs], [r["speedup"] for r in rs], "o-", label=timing)
        left.set(
            xscale="log",
            xlabel="tokens M",
            ylabel="speedup over dense (×)",
            title=f"uniform p=0.005, K={batch[0]['K']}, N={batch[0]['N']}" if batch else "",
        )
    if "density" in axis_of:
        right = axis_of["density"]
        for timing in ("per_call", "back_to_back"):
            rs = sorted((r for r in dense if r["timing"] == timing), key=lambda r: r["p"])
            if rs:
                right.plot([r["p"] for r in rs], [r["speedup"] for r in rs], "o-", label=timing)
        right.set(xscale="log", xlabel="share of active units p", title="density, M=16384")
    for axis in axis_of.values():
        axis.axhline(1.0, color="grey", lw=0.8)
        if axis.get_legend_handles_labels()[0]:
            axis.legend()
    fig.suptitle(records[0]["gpu"] if records else "")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m twell bench --sweep")
    parser.add_argument(
        "--out", default=None, help="JSON record file (default: bench/results/<gpu>/serving.json)"
    )
    parser.add_argument("--plot", default=None, help="PNG of the sweeps (needs matplotlib)")
    parser.add_argument("--M", nargs="+", type=int,
                        default=[1, 8, 64, 512, 2048, 4096, 16384, 65536],
                        help="tokens per call of the batch-size sweep")  # fmt: skip
    parser.add_argument("--workloads", nargs="+", default=["uniform"],
                        help="workloads of the batch-size sweep")  # fmt: skip
    parser.add_argument(
        "--densities", nargs="*",
        help="workloads of the density sweep at 16384 tokens (none given: no density sweep)",
        default=["density=0.001", "density=0.005", "density=0.02", "density=0.05", "density=0.1"],
    )  # fmt: skip
    args = parser.parse_args(argv)
    records = []
    for workload in args.workloads:
        for m in args.M:
            records += config(workload, m, 2048, 5632)
    records += config("uniform", min(16384, max(args.M)), 2048, 5632, api="ffn")
    for workload in args.densities:
        records += config(workload, 16384, 2048, 5632)
    if args.plot:
        plot(records, args.plot)
    path = merge_records(args.out or record_path("serving", gpu_name()), records)
    print(f"{'workload':<14}{'api':<10}{'M':>7} {'timing':<13}{'twell':>8}{'dense':>8}{'x':>6}"
          f"{'err':>9}{'host us':>9}{'dense us':>9}")  # fmt: skip
    for r in records:
        host, host_dense = r.get("host_us", math.nan), r.get("host_us_dense", math.nan)
        print(f"{r['workload']:<14}{r['api']:<10}{r['M']:>7} {r['timing']:<13}{r['t_ms']:>8.3f}"
              f"{r['t_dense_ms']:>8.3f}{r['speedup']:>6.2f}{r['rel_err']:>9.1e}"
              f"{host:>9.1f}{host_dense:>9.1f}")  # fmt: skip
    print(f"wrote {path}")
    return 0
