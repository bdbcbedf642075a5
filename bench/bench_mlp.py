"""``twell.torch.SparseMLP`` against its dense twin, the way a training loop calls it:
forward + backward of one Llama MLP (bf16 ``nn.Linear`` weights, the paper's shape),
eagerly and compiled, and the host's cost of one step.

    PYTHONPATH=. python bench/bench_mlp.py                          # M=4096 and 16384
    PYTHONPATH=. python bench/bench_mlp.py --M 4096 --workloads uniform --modes eager

Workloads (docs/benchmark.md): ``uniform`` (p=0.005), ``heavy`` (1% of tokens ×3) and
``nan`` (``uniform`` with two NaN rows in ``x``). Modes:

- ``eager``: what ``SparseMLP()`` does by default (op graphs up to
  ``twell.torch.OP_GRAPH_TOKENS`` tokens), against the dense module eagerly;
- ``eager_plain`` / ``eager_graphs``: op graphs forced off / on;
- ``ops``: the training custom ops called through torch's dispatcher, as compiled code
  calls them (graphs off): the cost of the dispatcher in eager loops;
- ``compiled`` / ``compiled_ro``: ``torch.compile`` (default / ``reduce-overhead``) of
  both modules.

Each record: back-to-back and per-call time of a step (``y = mlp(x); y.backward(dy)``,
gradients set to None between steps), the host's cost of a step with the GPU held busy
(``host_us`` / ``host_us_dense``; twell's must not synchronise), each figure the median
of four rounds that alternate twell and dense (``twell.timing.alternating``), the
gradients' relative error against the dense module's (float64 reference of the same bf16
inputs would differ only by rounding), and the L0. Writes
``bench/results/<gpu>/mlp.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import math
import sys
import traceback
from typing import Any

import numpy as np

from twell import workloads
from twell.timing import (
    alternating,
    back_to_back_ms,
    gpu_name,
    host_us_queued,
    per_call_ms,
    record_path,
    versions,
    write_json,
)

MODES = ("eager", "eager_plain", "eager_graphs", "ops", "compiled", "compiled_ro")


def problem(workload: str, m: int, k: int, n: int, seed: int) -> workloads.Problem:
    if workload == "uniform":
        return workloads.uniform(m, k, n, p=0.005, seed=seed)
    if workload == "heavy":
        return workloads.heavy(m, k, n, p=0.005, frac=0.01, scale=3.0, seed=seed)
    if workload == "nan":
        p = workloads.uniform(m, k, n, p=0.005, seed=seed)
        x = p.x.astype(np.float32)
        x[[m // 3, 2 * m // 3], 5] = np.nan
        import dataclasses

        return dataclasses.replace(p, x=x.astype(p.x.dtype))
    raise ValueError(f"workload: unknown {workload!r}")


def modules(p: workloads.Problem) -> tuple[Any, Any]:
    """(dense LlamaMLP-like module, its SparseMLP twin sharing no parameters)."""
    import torch
    from torch import nn

    from twell.torch import SparseMLP

    class LlamaMLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_proj = nn.Linear(p.K, p.N, bias=False)
            self.up_proj = nn.Linear(p.K, p.N, bias=False)
            self.down_proj = nn.Linear(p.N, p.K, bias=False)
            self.act_fn = nn.ReLU()

        def forward(self, x: Any) -> Any:
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    def build() -> Any:
        mlp = LlamaMLP().cuda().bfloat16()
        with torch.no_grad():
            for layer, w in ((mlp.gate_proj, p.w_gate), (mlp.up_proj, p.w_up),
                             (mlp.down_proj, p.w_down)):  # fmt: skip
                layer.weight.copy_(torch.from_numpy(w.astype(np.float32)))
        return mlp

    return build(), SparseMLP.from_module(build())


def step_fn(mlp: Any, xs: list, dys: list, mode: str) -> Any:
    import torch

    params = list(mlp.parameters())
    if mode == "ops":
        weights = (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)

        def step(i: int) -> None:
            for q in params:
                q.grad = None
            for x in xs:  # (x stands for an activation: no gradient kept across steps)
                x.grad = None
            y = torch.ops.twell.ffn_train_forward(xs[i], *weights, 256, 32, -1, 0.0, "mean",
                                                   False)[0]  # fmt: skip
            y.backward(dys[i])

        return step
    fn = mlp
    if mode == "compiled":
        fn = torch.compile(mlp)
    elif mode == "compiled_ro":
        fn = torch.compile(mlp, mode="reduce-overhead")

    def step(i: int) -> None:
        for q in params:
            q.grad = None
        for x in xs:  # (x stands for an activation: no gradient kept across steps)
            x.grad = None
        y = fn(xs[i])
        y.backward(dys[i])

    return step


def grads_error(sparse: Any, dense: Any, x: Any, dy: Any) -> float:
    """Worst relative error of twell's gradients against the dense module's (finite
    entries; NaN rows spread NaN in both)."""
    import torch

    out = []
    for mlp in (sparse, dense):
        for q in mlp.parameters():
            q.grad = None
        xi = x.clone().requires_grad_()
        mlp(xi).backward(dy)
        out.append([xi.grad.float()] + [q.grad.float() for q in mlp.parameters()])
    worst = 0.0
    for a, b in zip(*out, strict=True):
        both = torch.isfinite(a) & torch.isfinite(b)
        if not torch.equal(torch.isfinite(a), torch.isfinite(b)):
            return float("inf")
        num = (a - b)[both].norm()
        worst = max(worst, float(num / b[both].norm().clamp_min(1e-30)))
    return worst


def measure(workload: str, m: int, k: int, n: int, mode: str, reps: int) -> dict[str, Any]:
    import torch

    from twell.autograd import op_graph_memory, release_op_graphs

    release_op_graphs()  # this configuration's graphs only, in the memory figure below
    p = problem(workload, m, k, n, seed=m)
    dense, sparse = modules(p)
    sets = 2
    xs = [torch.from_numpy(p.x.astype(np.float32)).cuda().bfloat16().requires_grad_()
          for _ in range(sets)]  # fmt: skip
    gen = torch.Generator(device="cuda").manual_seed(0)
    dys = [torch.randn(m, k, device="cuda", generator=gen).bfloat16() for _ in range(sets)]
    if mode == "eager_plain":
        sparse.op_graphs = False
    elif mode == "eager_graphs":
        sparse.op_graphs = True
    error = grads_error(sparse, dense, xs[0].detach(), dys[0])
    twell_step = step_fn(sparse, xs, dys, mode)
    dense_mode = mode if mode.startswith("compiled") else "eager"
    dense_step = step_fn(dense, xs, dys, dense_mode)
    rec: dict[str, Any] = {
        "op": "ffn_train", "workload": workload, "M": m, "K": k, "N": n, "tile": 256,
        "slots": 32, "mode": mode, "default": mode == "eager", "rel_err": error,
    }  # fmt: skip
    # twell's and dense's figures each the median of rounds that alternate between them
    steps = {"twell": twell_step, "dense": dense_step}
    for name, t in alternating(back_to_back_ms, steps, sets=sets, calls=10, reps=reps).items():
        rec[f"back_to_back_ms_{name}"] = t
    for name, t in alternating(per_call_ms, steps, sets=sets, reps=reps).items():
        rec[f"per_call_ms_{name}"] = t
    errors: dict[Any, str] = {}

    def host(fn: Any) -> float:
        try:
            return host_us_queued(lambda: fn(0), calls=4, repeats=2)
        except RuntimeError as error:  # a synchronising step: recorded, not hidden
            errors[fn] = str(error)
            return math.inf

    for name, t in alternating(host, steps).items():
        suffix = "" if name == "twell" else "_dense"
        rec[f"host_us{suffix}"] = None if steps[name] in errors else t
        if steps[name] in errors:
            rec[f"host_error{suffix}"] = errors[steps[name]]
    rec["speedup"] = rec["back_to_back_ms_dense"] / rec["back_to_back_ms_twell"]
    rec["speedup_per_call"] = rec["per_call_ms_dense"] / rec["per_call_ms_twell"]
    torch.cuda.synchronize()
    twell_step(0)
    rec["l0"] = None if sparse.l0 is None else float(sparse.l0)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    for name, fn in (("twell", twell_step), ("dense", dense_step)):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        fn(0)
        torch.cuda.synchronize()
        rec[f"peak_extra_mb_{name}"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    # What the op graphs keep between steps (allocated before `base`) counts too.
    rec["graph_mb_twell"] = op_graph_memory() / 2**20
    rec["peak_extra_mb_twell"] += rec["graph_mb_twell"]
    rec["mem_ratio"] = rec["peak_extra_mb_twell"] / max(rec["peak_extra_mb_dense"], 1e-9)
    return rec


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--M", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--K", type=int, default=2048)
    parser.add_argument("--N", type=int, default=5632)
    parser.add_argument("--workloads", nargs="+", default=["uniform", "heavy", "nan"])
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=MODES,
        default=["eager", "eager_plain", "eager_graphs", "ops", "compiled"],
    )
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    out = args.out or record_path("mlp")
    # the command that makes these records (where they are written aside)
    command = " ".join(["python bench/bench_mlp.py", "--M", *map(str, args.M),
                        "--K", str(args.K), "--N", str(args.N),
                        "--workloads", *args.workloads, "--modes", *args.modes,
                        "--reps", str(args.reps)])  # fmt: skip
    report: dict[str, Any] = {"gpu": gpu_name(), **versions(), "command": command,
                              "records": []}  # fmt: skip
    failures = 0
    for m in args.M:
        for workload in args.workloads:
            for mode in args.modes:
                try:
                    rec = measure(workload, m, args.K, args.N, mode, args.reps)
                except Exception as error:  # noqa: BLE001 - recorded and counted
                    traceback.print_exc()
                    rec = {"op": "ffn_train", "workload": workload, "M": m, "mode": mode,
                           "error": f"{type(error).__name__}: {error}"}  # fmt: skip
                    failures += 1
                rec["gpu"] = report["gpu"]
                report["records"].append(rec)
                write_json(out, report)
                keys = (
                    "speedup",
                    "speedup_per_call",
                    "back_to_back_ms_twell",
                    "back_to_back_ms_dense",
                    "host_us",
                    "host_us_dense",
                    "rel_err",
                    "l0",
                )
                print(workload, m, mode, {k: rec.get(k) for k in keys}, rec.get("error", ""),
                      flush=True)  # fmt: skip
    bad = [r for r in report["records"] if "error" not in r and not r["rel_err"] < 2e-2]
    for r in bad:
        print(f"FAILED CHECK: {r['workload']} M={r['M']} {r['mode']} rel_err {r['rel_err']}")
    return 1 if failures or bad else 0


if __name__ == "__main__":
    sys.exit(main())
